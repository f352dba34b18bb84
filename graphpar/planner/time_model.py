"""The calibrated step-time model (graphpar/planner/auto.py uses it when given a Calibration).

For a plan (graphpar.Report) with m microbatches of r = tokens per dp rank / m rows each,
per pipeline stage s on rank p (its stages share the rank's parameters equally; at zero=3
the weights it computes with are dp times its shard):

    F_s = 2 P_s r / flops(r, tp) + executor_s / 3 + work_s / 3 + inside_p / (2 m S_p)
    B_s = 4 P_s r / flops(r, tp) + recompute_p / (m S_p flops(r, tp))
          + 2 executor_s / 3 + 2 work_s / 3 + inside_p / (2 m S_p)

    executor_s = units_s * unit + microbatch
    work_s     = zero_p + model_overhead * units_s / (all units)

    P_s: the stage's parameter elements; S_p the rank's stages; units_s the stage's pipeline
    units; unit and microbatch the executor's calibrated overheads (a third in forward, two
    thirds in backward); zero_p the units' work: unit_step_overhead and the ZeRO stage's
    calibrated work per unit, once per step (spread over the m S_p ops), but zero=3's every
    microbatch (its gathers and scatters repeat), times the rank's units over S_p; the model
    overhead, what the model's own steps take beyond the rest, per microbatch, each stage its
    units' share; inside_p the time of rank p's transfers inside the ops per step (tp's, and at
    zero=3 the dp weight gathers and gradient scatters: issued between computations, each
    call's latency the busy one, Calibration.busy_link); flops(r, tp): the calibrated
    throughput at r rows (Calibration.flops).

The pipeline (pp > 1) is simulated (graphpar/runtime/pipeline/simulate.py) with those
stage costs and a point-to-point message of alpha + bytes / beta, twice: the first at the
speed calibrated with every rank computing; the second with each op's compute, work and
transfers inside it at Calibration.speed(the ranks computing while it ran in the first), so
that a rank alone in the bubble computes at its speed alone, and each message at the speed
of the ranks busy while it is in flight (message_seconds). The executor's overheads are
fitted from pipeline steps of a GPT with nothing to compute (calibrate.overheads_from), whose
ranks ran them about as fast as a rank alone (a call or two at once): the second simulation
takes speed(1) / speed(n) of them, their calibrated time for an op alone, more among busy ranks. Its makespan includes the bubble. At pp = 1
every rank computes all the time: the makespan is m (F + B). Then, per rank, what follows
the last backward:

    dp     = the dp (and edp) all-reduces and reduce-scatters not inside the ops, less
             overlap * (the part that fits in the last microbatch's backward on that rank):
             gradient buckets are reduced while backward runs
    other  = the rank's other collectives (ZeRO-1/2's all-gathers, tied weights, the world's
             loss check): alpha * calls + sent / beta each, the link of its op and group size
    host   = the optimizer step: 2 * (host bytes) / memory bandwidth when offloaded (masters
             and states read and written), plus the device-host transfers at that bandwidth;
             on the device (2 * optimizer bytes + 3 * parameter bytes it steps) / memory
             bandwidth (states read and written, the weight read and written, the gradient
             read; the bandwidth is the calibrated optimizer's own)

    cost = step overhead + makespan + max over ranks of (dp + other + host)

The terms reported are the slowest rank's: compute (its matmuls and recompute), overhead
(the executor's, its units' work and the model's share, plus the step's), comms (inside the
ops, exposed dp, other), host, and bubble: the rest of the makespan, the time that rank waits.
"""
from __future__ import annotations

import bisect
from typing import Callable, Dict, Tuple

from graphpar.distributed.mesh import edp_size
from graphpar.planner.calibration import SENT_SHARE, Calibration
from graphpar.planner.plan import RankPlan, Report, Transfer
from graphpar.runtime.pipeline.schedules import build_schedule
from graphpar.runtime.pipeline.simulate import SimResult, simulate

# the terms step_time returns, which add up to a step's time (auto: a candidate's cost; overhead
# is 0 in auto's fixed-constant model)
TERMS = ("compute", "overhead", "comms", "bubble", "host")

# the dp transfers that overlap backward: gradient reduction (on gloo ZeRO's rows go as
# point-to-point messages: the sends, each with its receive)
_OVERLAPPED = ("all_reduce", "reduce_scatter", "send")


def group_size(transfer: Transfer, strategy: Dict, world_size: int) -> int:
    """The ranks of a transfer's group (a tied weight: two pp ranks, an embedding and its head;
    a point-to-point transfer: two). ep folds into dp x tp; edp: the ranks holding the same experts."""
    ep = strategy.get("ep", 1)
    edp = edp_size(strategy["dp"], strategy["tp"], ep, strategy.get("expert_tp", 1))
    return {"dp": strategy["dp"], "tp": strategy["tp"], "world": world_size, "tied": 2, "ep": ep,
            "edp": edp}.get(transfer.axis, 2)


def transfer_time(transfer: Transfer, strategy: Dict, world_size: int, calibration: Calibration) -> float:
    """A transfer's seconds: alpha * calls + sent / beta with the link of its op and group
    size; those inside the ops, between computations (inside), with the busy latency."""
    if transfer.axis == "host":
        return transfer.bytes / calibration.memory_bandwidth
    g = group_size(transfer, strategy, world_size)
    share = SENT_SHARE.get(transfer.op)
    sent = transfer.bytes * share(g) if share else transfer.bytes
    busy = inside(transfer, strategy)
    link = calibration.busy_link(transfer.op, g) if busy else calibration.link(transfer.op, g)
    return link.time(sent, transfer.count)


def inside(transfer: Transfer, strategy: Dict) -> bool:
    """Whether a transfer runs inside the ops, between their computations, every microbatch:
    tp's, and at zero=3 the dp (and edp) weight gathers and gradient reduce-scatters (on
    gloo the scatter's rows, sent point to point; a receive is costed by its send)."""
    if transfer.axis == "tp":
        return True
    return (strategy["zero"] == 3 and transfer.axis in ("dp", "edp")
            and transfer.op in ("all_gather", "reduce_scatter", "send"))


def step_time(report: Report, tokens_per_dp_rank: int, calibration: Calibration) -> Dict[str, float]:
    """The calibrated step time of a plan, split into terms that sum to it (seconds)."""
    strategy = report.strategy
    m, pp, tp = strategy["microbatches"], strategy["pp"], strategy["tp"]
    rows = tokens_per_dp_rank / m
    flops = calibration.flops(rows, tp)
    firsts = {r.pp_rank: r for r in report.ranks if r.dp_rank == 0 and r.tp_rank == 0}
    ops: Dict[Tuple[str, int], Tuple[float, float, float]] = {}
    parts = {}
    for p, rank in firsts.items():
        parts[p] = _rank_parts(rank, report, rows, flops, calibration)
        ops.update(parts[p]["ops"])
    if pp == 1:   # every rank computes all the time: the speed calibrated with all of them at once
        makespan = m * sum(sum(op) for op in ops.values())
        busy = {0: _busy_terms(ops.values(), m)}
    else:
        makespan, busy = _pipeline(report, firsts, ops, calibration)
    tails = {p: _tail(firsts[p], report, parts[p], calibration) for p in firsts}
    slowest = max(firsts, key=lambda p: (sum(tails[p].values()), -p))
    tail = tails[slowest]
    compute, executor, other = busy[slowest]
    tp_seconds = m * parts[slowest]["inside"]
    return {"compute": compute, "overhead": executor + (other - tp_seconds) + calibration.step_overhead,
            "comms": tp_seconds + tail["dp"] + tail["other"], "bubble": makespan - (compute + executor + other),
            "host": tail["host"], "recompute": parts[slowest]["recompute"] * m}


def step_seconds(report: Report, tokens_per_dp_rank: int, calibration: Calibration) -> float:
    """The calibrated step time of a plan: its terms (step_time) added up."""
    terms = step_time(report, tokens_per_dp_rank, calibration)
    return sum(terms[k] for k in TERMS)


def _busy_terms(ops, times: float = 1.0) -> Tuple[float, float, float]:
    """(compute, executor overhead, the rest) summed over such triples, times `times`."""
    ops = list(ops)
    return tuple(times * sum(op[i] for op in ops) for i in range(3))


def _pipeline(report: Report, firsts: Dict[int, RankPlan], ops: Dict, calibration: Calibration):
    """The simulated makespan and each pipeline rank's (compute, executor overhead, rest) seconds.

    Simulated twice: first at the speed of every rank computing at once; then each op's
    compute and rest (its work and the transfers inside it) at the speed of the ranks that
    compute while it runs in the first simulation (its own pipeline rank and the others' ops
    it overlaps, each standing for its dp x tp ranks: Calibration.speed), so that a rank
    alone in a bubble runs at its speed alone; the executor's overheads, calibrated from
    pipeline steps at about a rank's speed alone, at speed(1) / speed(those ranks) of it;
    each message at the speed of the ranks busy while it is in flight (message_seconds)."""
    strategy = report.strategy
    pp, m = strategy["pp"], strategy["microbatches"]
    schedule = build_schedule(strategy["schedule"], pp, m, strategy["virtual_stages"])
    p2p = _p2p_cost(firsts[0], calibration)
    costs = {(op, stage): sum(_op_parts(ops, op, stage))
             for stage in {s for _, s in ops} for op in ("forward", "backward", "backward_weight")}
    first = simulate(schedule, pp, p2p_cost=p2p, stage_costs=costs)
    replicas = report.world_size / pp
    ends = [[end for _, end, _ in rows] for rows in first.order]
    scaled, busy = {}, {}
    for p, rows in enumerate(first.order):
        terms = []
        for start, end, ins in rows:
            compute, executor, rest = _op_parts(ops, ins.op, ins.stage)
            ranks = (1 + _overlapping(first.order, ends, p, start, end)) * replicas
            slower = 1 / calibration.speed(ranks)
            # the executor's overheads were fitted from pipelines whose ranks ran them about as
            # fast as a rank alone: alone they cost that, among busy ranks more
            terms.append((compute * slower, executor * calibration.speed(1) * slower, rest * slower))
            scaled[(ins.op, ins.stage, ins.mb)] = sum(terms[-1])
        busy[p] = _busy_terms(terms)
    return simulate(schedule, pp, p2p_cost=message_seconds(p2p, first, replicas, calibration.speed),
                    stage_costs=scaled).makespan, busy


def message_seconds(seconds: float, sent: SimResult, replicas: float, speed: Callable[[float], float]) -> float:
    """A pipeline message of `seconds` as calibrated (with every rank busy: the rank pairs'
    round trips all at once) at the speed of the ranks busy while it is in flight: its two
    ends at least, else as many as the pipeline keeps busy on average (`sent`: the step
    simulated with it, busy time over makespan), each standing for its `replicas` (the dp x
    tp pipelines sending at once). Pipeline steps show it: the GPT's pp = 4 with one
    microbatch at world 4 on 2 cores sent its 6 messages, with the executor between its
    calls, in 2.8 ms, where the link calibrated with every rank at once gives them 8.2 ms."""
    occupancy = sum(sent.busy) / sent.makespan if sent.makespan else sent.pp
    return seconds / speed(max(2.0, occupancy) * replicas)


def _op_parts(ops: Dict, op: str, stage: int) -> Tuple[float, float, float]:
    """An op's (compute, executor overhead, rest): a split backward's weight half is half the backward."""
    if op == "backward_weight":
        return tuple(x / 2 for x in ops[("backward", stage)])
    return ops[(op, stage)]


def _overlapping(order, ends, rank: int, start: float, end: float) -> float:
    """How many of the other pipeline ranks compute, on average, between start and end
    (`ends`: each rank's ops' end times, ascending as its ops run one after the other)."""
    if end <= start:
        return 0.0
    covered = 0.0
    for q, rows in enumerate(order):
        if q == rank:
            continue
        first = bisect.bisect_right(ends[q], start)
        for s, e, _ in rows[first:]:
            if s >= end:
                break
            covered += min(e, end) - max(s, start)
    return covered / (end - start)


def _rank_parts(rank: RankPlan, report: Report, rows: float, flops: float, calibration: Calibration) -> Dict:
    """Per microbatch on one rank: each stage's forward and backward as (compute, executor
    overhead, rest: the transfers inside its ops, its units' work and the model's) seconds, keyed (op,
    stage); the rank's seconds per microbatch of transfers inside the ops ("inside") and of
    recompute."""
    strategy = report.strategy
    m, stages = strategy["microbatches"], rank.stages
    gathered = strategy["dp"] if strategy["zero"] == 3 else 1   # zero=3 computes with the gathered weights
    params = rank.param_bytes * gathered / 4 / len(stages)
    transfers = sum(transfer_time(t, strategy, report.world_size, calibration)
                    for t in rank.collectives if inside(t, strategy)) / (m * len(stages))
    recompute = rank.recompute_flops / (m * len(stages) * flops)
    # the units' work once per step (their optimizer step's and gradients', ZeRO's but
    # zero=3's): spread over the microbatches and stages like the rest; zero=3's repeats
    # every microbatch (its gathers and scatters do), so it is paid per microbatch
    units = sum(report.stage_units[s] for s in stages) if report.stage_units else len(stages)
    zero_work = calibration.zero_overhead.get(strategy["zero"], 0.0)
    per_step = calibration.unit_step_overhead + (0.0 if strategy["zero"] == 3 else zero_work)
    per_microbatch = zero_work if strategy["zero"] == 3 else 0.0
    units_work = (per_step / m + per_microbatch) * units / len(stages)
    found = {"ops": {}, "inside": transfers * len(stages), "recompute": recompute * len(stages)}
    all_units = sum(report.stage_units) if report.stage_units else strategy["pp"] * strategy["virtual_stages"]
    for stage in stages:
        stage_units = report.stage_units[stage] if report.stage_units else 1
        executor = stage_units * calibration.unit_overhead + calibration.microbatch_overhead
        # the model's own overhead is paid per microbatch, by each stage for its units
        work = units_work + calibration.model_overhead * stage_units / all_units
        (executor_f, executor_b), (work_f, work_b) = forward_backward(executor), forward_backward(work)
        found["ops"][("forward", stage)] = (2 * params * rows / flops, executor_f, transfers / 2 + work_f)
        found["ops"][("backward", stage)] = (4 * params * rows / flops + recompute, executor_b, transfers / 2 + work_b)
    return found


def forward_backward(seconds: float) -> Tuple[float, float]:
    """A stage call's overheads or work split between its forward and its backward: a third
    and two thirds, as its compute (2 and 4 flops per parameter element per token)."""
    return seconds / 3, 2 * seconds / 3


def _p2p_cost(rank: RankPlan, calibration: Calibration) -> float:
    """One activation (or gradient) message between neighbour stages."""
    sends = [t for t in rank.collectives if t.op == "send" and t.axis == "pp"]
    count = sum(t.count for t in sends)
    return calibration.p2p.time(sum(t.bytes for t in sends) / count) if count else 0.0


def _tail(rank: RankPlan, report: Report, part: Dict, calibration: Calibration) -> Dict[str, float]:
    """What a rank does after its last backward: exposed gradient reduction, its other
    collectives, and the optimizer step."""
    strategy, world = report.strategy, report.world_size
    dp = other = moved = 0.0
    for t in rank.collectives:
        if t.axis == "pp" or t.op == "recv" or inside(t, strategy):   # a receive: the time of its send
            continue
        seconds = transfer_time(t, strategy, world, calibration)
        if t.axis in ("dp", "edp") and t.op in _OVERLAPPED:
            dp += seconds
        elif t.axis == "host":
            moved += seconds
        else:
            other += seconds
    last_backward = sum(sum(op) for (name, _), op in part["ops"].items() if name == "backward")
    dp -= calibration.overlap * min(dp, last_backward)
    if strategy["offload_optimizer"]:
        host = 2 * rank.host_bytes / calibration.memory_bandwidth + moved
    else:
        stepped = rank.param_bytes / strategy["dp"] if strategy["zero"] else rank.param_bytes
        host = (2 * rank.optimizer_bytes + 3 * stepped) / calibration.memory_bandwidth + moved
    return {"dp": dp, "other": other, "host": host}
