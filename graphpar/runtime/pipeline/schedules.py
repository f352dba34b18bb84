"""Pipeline schedules as plain data, a validator and a timing simulator.

A schedule says, for every pipeline rank, the exact order in which that rank posts
its compute and communication work for one training (or evaluation) step. It is
pure data: ``build_schedule`` returns ``list[list[Instr]]`` indexed by pp rank, and
nothing here touches torch or torch.distributed, so schedules can be checked,
simulated and drawn without a model.

Stages and ranks
----------------
``pp`` pipeline ranks each hold ``v`` model chunks ("virtual stages"), giving
``S = pp * v`` global stages ``0 .. S-1``. Data flows ``s -> s+1`` forward and
gradients ``s+1 -> s`` backward; stage ``S-1`` computes the loss. Stage ``s``
lives on rank ``s % pp`` (Megatron's interleaved layout: rank ``r`` holds stages
``r, r+pp, r+2pp, ...``), so with ``v == 1`` stage and rank coincide.

Instructions
------------
``Instr(op, stage, mb, peer=None)``; ``peer`` is the *pp rank* on the other side of
a communication and ``None`` for compute:

=============  =========================================================  ================
op             meaning                                                    exists when
=============  =========================================================  ================
``recv_act``   receive ``mb``'s activations for ``stage`` from stage-1    ``stage > 0``
``forward``    run ``stage``'s forward on ``mb``                          always
``send_act``   send ``mb``'s output activations to stage+1                ``stage < S-1``
``recv_grad``  receive the gradient of ``stage``'s output from stage+1    ``stage < S-1``
``backward``   run ``stage``'s backward on ``mb``                         always
``send_grad``  send the gradient of ``stage``'s input to stage-1          ``stage > 0``
``step``       optimizer step (``stage = mb = -1``); last on every rank    training only
=============  =========================================================  ================

Execution semantics (used by ``simulate`` and expected of the executor): a rank
posts its instructions strictly in list order; sends are asynchronous and
buffered (they never block); a receive blocks until the matching send, identified
by ``(kind, source stage, destination stage, mb)``, has been issued. Every
compute op is therefore preceded by the receive it needs and followed by the send
its consumer needs, and the whole schedule is deadlock-free exactly when the
per-rank orders are consistent with the data dependencies.

Schedules
---------
``gpipe``
    Every rank runs all ``m`` forwards, then all ``m`` backwards in reverse
    microbatch order. Simple; every rank keeps all ``m`` microbatches' activations.
``1f1b``
    PipeDream-flush, Megatron-LM's non-interleaved schedule. Rank ``r`` runs
    ``min(pp - r - 1, m)`` warm-up forwards, then alternates one forward / one
    backward, then drains the remaining backwards. Same bubble as GPipe, but rank
    ``r`` never holds more than ``min(pp - r, m)`` microbatches in flight.
``interleaved-1f1b``
    Megatron-LM's ``forward_backward_pipelining_with_interleaving`` with
    ``v > 1`` chunks per rank; needs ``m % pp == 0``. Forward number ``k`` on a
    rank runs chunk ``(k // pp) % v`` on microbatch
    ``(k // (pp*v)) * pp + k % pp`` (groups of ``pp`` microbatches sweep through
    the chunks); backward number ``k`` uses the same microbatch with the chunk
    reversed. Warm-up is ``(pp - r - 1) * 2 + (v - 1) * pp`` forwards (capped at
    ``m * v``), then 1F1B, then cool-down. The bubble shrinks by a factor ``v``.

``forward_only`` gives the evaluation schedule (receive, forward, send; no
backward, no step) for the same stage layout.

Tools
-----
``check_schedule`` validates a schedule and raises ``ScheduleError`` with a precise
message; ``simulate`` runs an event-driven timing model and returns a
``SimResult``; ``to_chrome_trace`` and ``graphpar.planner.drawing.timeline_svg(sim.order, title)``
visualise it.
"""
from __future__ import annotations

import difflib
import heapq
import numbers
from collections import Counter, defaultdict, deque
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

__all__ = [
    "SCHEDULES", "OPS", "Instr", "ScheduleError", "SimResult", "build_schedule", "forward_only",
    "check_schedule", "simulate", "to_chrome_trace", "stage_rank",
]

GPIPE, ONE_F_ONE_B, INTERLEAVED = "gpipe", "1f1b", "interleaved-1f1b"
SCHEDULES = (GPIPE, ONE_F_ONE_B, INTERLEAVED)

COMPUTE_OPS = ("forward", "backward")
COMM_OPS = ("recv_act", "send_act", "recv_grad", "send_grad")
OPS = ("recv_act", "forward", "send_act", "recv_grad", "backward", "send_grad", "step")


class ScheduleError(RuntimeError):
    """A schedule is malformed, mismatched or deadlocks."""


@dataclass(frozen=True)
class Instr:
    """One posted operation; see the module docstring for the op table."""

    op: str
    stage: int
    mb: int
    peer: int | None = None

    def __str__(self) -> str:
        if self.op == "step":
            return "step"
        if self.op in COMPUTE_OPS:
            return f"{self.op}(stage {self.stage}, mb {self.mb})"
        direction = "from" if self.op.startswith("recv") else "to"
        return f"{self.op}(stage {self.stage}, mb {self.mb}, {direction} rank {self.peer})"


STEP = Instr("step", -1, -1)


def stage_rank(stage: int, pp: int) -> int:
    """The pp rank that holds global stage ``stage`` (Megatron's interleaved layout)."""
    return stage % pp


# --------------------------------------------------------------------------- #
# Argument validation. Messages name the value, the rule and a fix, like Strategy.
# --------------------------------------------------------------------------- #


def _invalid(subject: str, rule: str, fix: str) -> ValueError:
    return ValueError(f"{subject} is invalid: {rule}. Fix: {fix}.")


def _check_count(name: str, value: Any) -> int:
    # bool is an int subclass; pp=True is almost certainly a bug, so reject it.
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise _invalid(f"{name}={value!r}", f"{name} must be an int >= 1, got {type(value).__name__}",
                       f"pass an int such as {name}=1")
    if value < 1:
        raise _invalid(f"{name}={value!r}", f"{name} must be >= 1", f"use {name}=1 or more")
    return int(value)


def _check_name(name: Any) -> str:
    allowed = ", ".join(repr(s) for s in SCHEDULES)
    if not isinstance(name, str):
        raise _invalid(f"schedule={name!r}", f"the schedule name must be a str, one of {allowed}",
                       "use schedule='1f1b'")
    if name in SCHEDULES:
        return name
    # Compare case-insensitively so "1F1B" gets a suggestion with the canonical spelling.
    lowered = {s.lower(): s for s in SCHEDULES}
    near = difflib.get_close_matches(name.strip().lower(), list(lowered), n=1, cutoff=0.6)
    fix = f"use {lowered[near[0]]!r} (did you mean it?)" if near else f"use one of {allowed}"
    raise _invalid(f"schedule={name!r}", f"unknown schedule; it must be one of {allowed}", fix)


def _check_combination(name: str, pp: int, m: int, v: int) -> None:
    interleaved = name == INTERLEAVED
    if interleaved and v == 1:
        raise _invalid(f"schedule={name!r} with virtual_stages=1",
                       "the interleaved schedule splits each rank's layers into several chunks, "
                       "so it needs virtual_stages > 1",
                       "pass virtual_stages=2 (or more), or use schedule='1f1b'")
    if v > 1 and not interleaved:
        raise _invalid(f"virtual_stages={v} with schedule={name!r}",
                       f"virtual_stages > 1 is only used by schedule={INTERLEAVED!r}",
                       f"use schedule={INTERLEAVED!r}, or virtual_stages=1")
    if interleaved and pp == 1:
        raise _invalid(f"schedule={name!r} with pp=1",
                       "an interleaved pipeline needs at least two pipeline ranks",
                       "use pp > 1, or schedule='1f1b' with virtual_stages=1")
    if interleaved and m % pp:
        lower = m // pp * pp
        options = " or ".join(f"microbatches={c}" for c in (lower, lower + pp) if c >= 1)
        raise _invalid(f"microbatches={m} with pp={pp} and virtual_stages={v}",
                       "the interleaved schedule needs microbatches to be a multiple of pp "
                       "(Megatron-LM's rule: microbatches go through the chunks in groups of pp)",
                       f"use {options}")


# --------------------------------------------------------------------------- #
# Building blocks: each compute op is wrapped in the receive it needs and the
# send its consumer needs, so ordering decisions are made on compute ops only.
# --------------------------------------------------------------------------- #


def _forward(stage: int, mb: int, pp: int, num_stages: int) -> list[Instr]:
    out = []
    if stage > 0:
        out.append(Instr("recv_act", stage, mb, stage_rank(stage - 1, pp)))
    out.append(Instr("forward", stage, mb))
    if stage < num_stages - 1:
        out.append(Instr("send_act", stage, mb, stage_rank(stage + 1, pp)))
    return out


def _backward(stage: int, mb: int, pp: int, num_stages: int) -> list[Instr]:
    out = []
    if stage < num_stages - 1:
        out.append(Instr("recv_grad", stage, mb, stage_rank(stage + 1, pp)))
    out.append(Instr("backward", stage, mb))
    if stage > 0:
        out.append(Instr("send_grad", stage, mb, stage_rank(stage - 1, pp)))
    return out


def _expand(order: Iterable[tuple[str, int, int]], pp: int, num_stages: int) -> list[Instr]:
    """Turn a rank's ("F"|"B", stage, mb) compute order into instructions."""
    out: list[Instr] = []
    for kind, stage, mb in order:
        out += (_forward if kind == "F" else _backward)(stage, mb, pp, num_stages)
    return out


def _one_f_one_b(warmup: int, total: int, fwd, bwd) -> list[tuple[str, int, int]]:
    """warm-up forwards, steady (one forward, one backward), cool-down backwards.

    ``fwd(k)``/``bwd(k)`` give the (stage, mb) of this rank's k-th forward/backward.
    Shared by 1F1B (fixed stage) and interleaved 1F1B (chunk varies with k).
    """
    steady = total - warmup
    order = [("F", *fwd(k)) for k in range(warmup)]
    for k in range(steady):
        # Forward first: the backward of microbatch k may need this very forward
        # (the last stage's first backward follows its own forward immediately).
        order += [("F", *fwd(warmup + k)), ("B", *bwd(k))]
    order += [("B", *bwd(k)) for k in range(steady, total)]
    return order


def _gpipe_rank(r: int, pp: int, m: int) -> list[tuple[str, int, int]]:
    return [("F", r, mb) for mb in range(m)] + [("B", r, mb) for mb in reversed(range(m))]


def _1f1b_rank(r: int, pp: int, m: int) -> list[tuple[str, int, int]]:
    # A rank must forward pp - r - 1 extra microbatches before the first gradient
    # can come back from the last stage; fewer if there are not that many.
    warmup = min(pp - r - 1, m)
    return _one_f_one_b(warmup, m, lambda k: (r, k), lambda k: (r, k))


def _interleaved_mb(k: int, pp: int, v: int) -> int:
    # The k-th op of a rank belongs to group k // (pp*v) of pp microbatches.
    return (k // (pp * v)) * pp + k % pp


def _interleaved_chunk(k: int, pp: int, v: int, forward: bool) -> int:
    # Megatron's get_model_chunk_id: pp consecutive ops per chunk; backward
    # walks the chunks in reverse (the last chunk's gradients arrive first).
    chunk = (k // pp) % v
    return chunk if forward else v - 1 - chunk


def _interleaved_rank(r: int, pp: int, m: int, v: int) -> list[tuple[str, int, int]]:
    total = m * v
    # Megatron: the (v-1)*pp term fills every chunk but the last for one group;
    # the 2*(pp-r-1) term lets the later ranks' first backwards come back.
    warmup = min((pp - r - 1) * 2 + (v - 1) * pp, total)

    def fwd(k: int) -> tuple[int, int]:
        return _interleaved_chunk(k, pp, v, True) * pp + r, _interleaved_mb(k, pp, v)

    def bwd(k: int) -> tuple[int, int]:
        return _interleaved_chunk(k, pp, v, False) * pp + r, _interleaved_mb(k, pp, v)

    return _one_f_one_b(warmup, total, fwd, bwd)


def interleaved_warmup(r: int, pp: int, m: int, v: int) -> int:
    """Warm-up forwards of rank ``r`` in the interleaved schedule (for tests and docs)."""
    return min((pp - r - 1) * 2 + (v - 1) * pp, m * v)


def build_schedule(name: str, pp: int, microbatches: int, virtual_stages: int = 1) -> list[list[Instr]]:
    """The training schedule ``name`` for ``pp`` ranks: one instruction list per pp rank."""
    name = _check_name(name)
    pp = _check_count("pp", pp)
    m = _check_count("microbatches", microbatches)
    v = _check_count("virtual_stages", virtual_stages)
    _check_combination(name, pp, m, v)
    num_stages = pp * v
    out = []
    for r in range(pp):
        if name == GPIPE:
            order = _gpipe_rank(r, pp, m)
        elif name == ONE_F_ONE_B:
            order = _1f1b_rank(r, pp, m)
        else:
            order = _interleaved_rank(r, pp, m, v)
        out.append(_expand(order, pp, num_stages) + [STEP])
    return out


def forward_only(pp: int, microbatches: int, virtual_stages: int = 1) -> list[list[Instr]]:
    """Evaluation schedule: receive, forward, send for every (stage, mb); no backward, no step.

    Ranks visit their (chunk, mb) pairs sorted by (mb // pp, chunk, mb): groups of
    pp microbatches sweep through the chunks. That is Megatron's interleaved
    forward order when ``m % pp == 0`` (and plain microbatch order when v == 1),
    and it works for any ``m``: every dependency goes from a smaller key to a
    larger one, so no rank can wait on work that is behind its own position.
    """
    pp = _check_count("pp", pp)
    m = _check_count("microbatches", microbatches)
    v = _check_count("virtual_stages", virtual_stages)
    out = []
    for r in range(pp):
        keys = sorted(((mb // pp, chunk, mb) for chunk in range(v) for mb in range(m)))
        out.append(_expand((("F", chunk * pp + r, mb) for _, chunk, mb in keys), pp, pp * v))
    return out


# --------------------------------------------------------------------------- #
# Validation
# --------------------------------------------------------------------------- #

# (kind, source stage, destination stage, mb) identifies one message.
MsgKey = tuple[str, int, int, int]


def _message(ins: Instr) -> tuple[MsgKey, int, int]:
    """(key, rank that sends it, rank that receives it) for a communication op."""
    s = ins.stage
    if ins.op == "send_act":
        src, dst, kind = s, s + 1, "act"
    elif ins.op == "recv_act":
        src, dst, kind = s - 1, s, "act"
    elif ins.op == "send_grad":
        src, dst, kind = s, s - 1, "grad"
    else:  # recv_grad
        src, dst, kind = s + 1, s, "grad"
    return (kind, src, dst, ins.mb), src, dst


def _fail(rank: int, index: int, ins: Instr, problem: str) -> ScheduleError:
    return ScheduleError(f"rank {rank}, instruction #{index} {ins}: {problem}")


def _check_instr(rank: int, index: int, ins: Instr, pp: int, m: int, num_stages: int) -> None:
    """Field-level rules: op known, stage/mb in range, on the right rank, right peer."""
    if not isinstance(ins, Instr):
        raise ScheduleError(f"rank {rank}, instruction #{index}: expected an Instr, got {ins!r}")
    if ins.op not in OPS:
        near = difflib.get_close_matches(str(ins.op), OPS, n=1)
        hint = f" (did you mean {near[0]!r}?)" if near else ""
        raise _fail(rank, index, ins, f"unknown op {ins.op!r}{hint}; ops are {', '.join(OPS)}")
    if ins.op == "step":
        return
    if not 0 <= ins.stage < num_stages:
        raise _fail(rank, index, ins, f"stage {ins.stage} is outside 0..{num_stages - 1} (pp*v={num_stages})")
    if not 0 <= ins.mb < m:
        raise _fail(rank, index, ins, f"microbatch {ins.mb} is outside 0..{m - 1}")
    if stage_rank(ins.stage, pp) != rank:
        raise _fail(rank, index, ins, f"stage {ins.stage} lives on rank {stage_rank(ins.stage, pp)} "
                                      f"(stage % pp), not rank {rank}")
    if ins.op in COMPUTE_OPS:
        if ins.peer is not None:
            raise _fail(rank, index, ins, "compute ops take no peer")
        return
    if ins.op in ("recv_act", "send_grad") and ins.stage == 0:
        raise _fail(rank, index, ins, "stage 0 has no previous stage to talk to")
    if ins.op in ("send_act", "recv_grad") and ins.stage == num_stages - 1:
        raise _fail(rank, index, ins, f"the last stage {num_stages - 1} has no next stage to talk to")
    _, src, dst = _message(ins)
    other = src if ins.op.startswith("recv") else dst
    if ins.peer != stage_rank(other, pp):
        raise _fail(rank, index, ins, f"peer should be rank {stage_rank(other, pp)} (the rank of stage {other})")


def _check_step(rank: int, instrs: Sequence[Instr], training: bool) -> None:
    steps = [i for i, ins in enumerate(instrs) if ins.op == "step"]
    if not training:
        if steps:
            raise _fail(rank, steps[0], instrs[steps[0]], "a forward-only schedule has no optimizer step")
        return
    if steps != [len(instrs) - 1]:
        where = f"at instructions {steps}" if steps else "missing"
        raise ScheduleError(f"rank {rank}: 'step' must appear exactly once, as the last instruction; "
                            f"it is {where} (list has {len(instrs)} instructions)")


def _check_local_order(rank: int, instrs: Sequence[Instr], num_stages: int) -> None:
    """On one rank: recv before compute, compute before send, forward before backward.

    Runs after ``_check_coverage``, so each compute op occurs exactly once.
    """
    seen: set[tuple[str, int, int]] = set()
    for index, ins in enumerate(instrs):
        s, mb = ins.stage, ins.mb
        need = []
        if ins.op == "forward" and s > 0:
            need.append(("recv_act", "its activations have not been received (recv_act must come first)"))
        if ins.op == "send_act":
            need.append(("forward", "the forward has not run yet"))
        if ins.op == "backward":
            need.append(("forward", "the forward has not run yet on this rank"))
            if s < num_stages - 1:
                need.append(("recv_grad", "the next stage's gradient has not been received "
                                          "(recv_grad must come first)"))
        if ins.op == "send_grad":
            need.append(("backward", "the backward has not run yet"))
        for op, why in need:
            if (op, s, mb) not in seen:
                raise _fail(rank, index, ins, why)
        seen.add((ins.op, s, mb))
    _check_sends_follow(rank, seen, num_stages)


def _check_sends_follow(rank: int, seen: set, num_stages: int) -> None:
    # A compute op whose consumer lives elsewhere must ship its result.
    for op, s, mb in sorted(x for x in seen if x[0] in COMPUTE_OPS):
        if op == "forward" and s < num_stages - 1 and ("send_act", s, mb) not in seen:
            raise ScheduleError(f"rank {rank}: forward(stage {s}, mb {mb}) is never followed by send_act")
        if op == "backward" and s > 0 and ("send_grad", s, mb) not in seen:
            raise ScheduleError(f"rank {rank}: backward(stage {s}, mb {mb}) is never followed by send_grad")


def _check_coverage(schedule: Sequence[Sequence[Instr]], pp: int, m: int, num_stages: int,
                    training: bool) -> None:
    """Every (stage, mb) forward (and backward when training) exactly once, on its rank."""
    ops = ("forward", "backward") if training else ("forward",)
    counts = Counter((ins.op, ins.stage, ins.mb) for instrs in schedule for ins in instrs)
    for op in ops:
        for s in range(num_stages):
            for mb in range(m):
                n = counts[(op, s, mb)]
                if n != 1:
                    raise ScheduleError(f"{op}(stage {s}, mb {mb}) appears {n} times; it must appear exactly "
                                        f"once, on rank {stage_rank(s, pp)}")
    if not training and counts and any(op == "backward" for op, _, _ in counts):
        raise ScheduleError("a forward-only schedule must not contain backward ops")


def _check_matching(schedule: Sequence[Sequence[Instr]]) -> None:
    """Every send has exactly one receive on its peer with the same message key, and back."""
    sends: Counter = Counter()
    recvs: Counter = Counter()
    for instrs in schedule:
        for ins in instrs:
            if ins.op in COMM_OPS:
                key, _, _ = _message(ins)
                (sends if ins.op.startswith("send") else recvs)[key] += 1
    for key in sorted(set(sends) | set(recvs)):
        kind, src, dst, mb = key
        if sends[key] != 1 or recvs[key] != 1:
            raise ScheduleError(f"{kind} message of mb {mb} from stage {src} to stage {dst} is sent "
                                f"{sends[key]} time(s) and received {recvs[key]} time(s); each must be exactly 1")


def check_schedule(schedule: Sequence[Sequence[Instr]], pp: int, m: int, v: int = 1,
                   training: bool | None = None) -> None:
    """Raise ``ScheduleError`` unless ``schedule`` is a valid, deadlock-free schedule.

    ``training=None`` infers the kind: a schedule with any backward or step is a
    training schedule (needs every backward and a final step), else forward-only.
    The last check runs ``simulate`` so that a well-formed but mis-ordered
    schedule (e.g. two receives swapped) is reported as the deadlock it causes.
    """
    pp, m, v = _check_count("pp", pp), _check_count("microbatches", m), _check_count("virtual_stages", v)
    if len(schedule) != pp:
        raise ScheduleError(f"schedule has {len(schedule)} rank lists, expected pp={pp}")
    if training is None:
        training = any(ins.op in ("backward", "step") for instrs in schedule for ins in instrs
                       if isinstance(ins, Instr))
    num_stages = pp * v
    for rank, instrs in enumerate(schedule):
        for index, ins in enumerate(instrs):
            _check_instr(rank, index, ins, pp, m, num_stages)
    # Missing or duplicated work is the most basic error, so it is reported first.
    _check_coverage(schedule, pp, m, num_stages, training)
    for rank, instrs in enumerate(schedule):
        _check_step(rank, instrs, training)
        _check_local_order(rank, instrs, num_stages)
    _check_matching(schedule)
    simulate(schedule, pp)


# --------------------------------------------------------------------------- #
# Simulation
# --------------------------------------------------------------------------- #


@dataclass
class SimResult:
    """Timing of one simulated step; times are in the units of the costs given."""

    makespan: float
    busy: list[float]
    bubble_fraction: float
    peak_in_flight: list[int]
    # Per rank: (start, end, Instr) of each compute op, in execution order.
    order: list[list[tuple[float, float, Instr]]] = field(repr=False)

    @property
    def pp(self) -> int:
        return len(self.busy)

    def records(self) -> list[list[tuple[str, float, float]]]:
        """Per rank (name, start, end), e.g. ("F3 s1", 2.0, 3.0), for ``to_chrome_trace``."""
        return [[(_label(ins), start, end) for start, end, ins in rows] for rows in self.order]


def _label(ins: Instr) -> str:
    return f"{'F' if ins.op == 'forward' else 'B'}{ins.mb} s{ins.stage}"


@dataclass
class _Rank:
    pc: int = 0
    clock: float = 0.0
    busy: float = 0.0
    in_flight: set = field(default_factory=set)
    peak: int = 0
    order: list = field(default_factory=list)


def _check_costs(**costs: float) -> None:
    for name, value in costs.items():
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or value < 0:
            raise _invalid(f"{name}={value!r}", f"{name} must be a number >= 0", f"use {name}=1.0")


def _run_compute(state: _Rank, ins: Instr, cost: float) -> None:
    start = state.clock
    state.clock += cost
    state.busy += cost
    state.order.append((start, state.clock, ins))
    key = (ins.stage, ins.mb)
    if ins.op == "forward":
        # In flight = forward done, backward not yet done, per (stage, mb): the
        # activations this rank must keep alive.
        state.in_flight.add(key)
        state.peak = max(state.peak, len(state.in_flight))
    else:
        state.in_flight.discard(key)


def simulate(schedule: Sequence[Sequence[Instr]], pp: int, forward_cost: float = 1.0,
             backward_cost: float = 2.0, p2p_cost: float = 0.0) -> SimResult:
    """Event-driven timing of all ranks running their lists in order.

    Ranks sit in a heap keyed by their clock and the earliest runnable rank posts
    its next instruction. A send stamps its message with the sender's clock and
    wakes the rank waiting for it; a receive finishes at
    ``max(own clock, send time + p2p_cost)`` or parks the rank until the send is
    issued. Compute ops cost ``forward_cost``/``backward_cost``; ``step`` costs 0.
    When the heap empties with work left, no rank can progress: ``ScheduleError``
    lists each blocked rank and what it waits on.
    """
    pp = _check_count("pp", pp)
    _check_costs(forward_cost=forward_cost, backward_cost=backward_cost, p2p_cost=p2p_cost)
    if len(schedule) != pp:
        raise ScheduleError(f"schedule has {len(schedule)} rank lists, expected pp={pp}")
    ranks = [_Rank() for _ in range(pp)]
    mailbox: dict[MsgKey, deque] = defaultdict(deque)  # key -> issue times of unreceived sends
    waiting: dict[MsgKey, list] = defaultdict(list)  # key -> ranks parked on that receive
    ready = [(0.0, r) for r in range(pp)]
    heapq.heapify(ready)
    while ready:
        _, r = heapq.heappop(ready)
        if _advance(r, schedule[r], ranks[r], mailbox, waiting, ready, forward_cost, backward_cost, p2p_cost):
            heapq.heappush(ready, (ranks[r].clock, r))
    blocked = [r for r in range(pp) if ranks[r].pc < len(schedule[r])]
    if blocked:
        raise _deadlock(schedule, ranks, blocked)
    return _result(ranks)


def _advance(r: int, instrs: Sequence[Instr], state: _Rank, mailbox, waiting, ready,
             forward_cost: float, backward_cost: float, p2p_cost: float) -> bool:
    """Post rank r's next instruction. True if r can go on, False if done or parked."""
    if state.pc >= len(instrs):
        return False
    ins = instrs[state.pc]
    if ins.op in COMPUTE_OPS:
        _run_compute(state, ins, forward_cost if ins.op == "forward" else backward_cost)
    elif ins.op in ("send_act", "send_grad"):
        key = _message(ins)[0]
        mailbox[key].append(state.clock)
        for parked in waiting.pop(key, ()):
            # The receiver re-tries the receive it is parked on (at max of both clocks).
            heapq.heappush(ready, (state.clock, parked))
    elif ins.op in ("recv_act", "recv_grad"):
        key = _message(ins)[0]
        if not mailbox[key]:
            waiting[key].append(r)
            return False
        state.clock = max(state.clock, mailbox[key].popleft() + p2p_cost)
    elif ins.op != "step":
        raise _fail(r, state.pc, ins, f"unknown op {ins.op!r}; ops are {', '.join(OPS)}")
    state.pc += 1
    return True


def _deadlock(schedule, ranks: list[_Rank], blocked: list[int]) -> ScheduleError:
    lines = []
    for r in blocked:
        ins = schedule[r][ranks[r].pc]
        lines.append(f"rank {r} waits at instruction #{ranks[r].pc} on {ins}{_sender_hint(schedule, ranks, ins)}")
    done = [r for r in range(len(ranks)) if r not in blocked]
    tail = f"; ranks {done} finished" if done else ""
    return ScheduleError("schedule deadlocks, no rank can progress: " + "; ".join(lines) + tail)


def _sender_hint(schedule, ranks: list[_Rank], ins: Instr) -> str:
    """Where the awaited send sits on its rank, so the cycle can be read off the message."""
    if ins.op not in ("recv_act", "recv_grad") or ins.peer is None or not 0 <= ins.peer < len(schedule):
        return ""
    key = _message(ins)[0]
    for index, other in enumerate(schedule[ins.peer]):
        if other.op in ("send_act", "send_grad") and _message(other)[0] == key and index >= ranks[ins.peer].pc:
            return f" (rank {ins.peer} sends it at its instruction #{index}, not reached)"
    return f" (rank {ins.peer} never sends it)"


def _result(ranks: list[_Rank]) -> SimResult:
    makespan = max((s.clock for s in ranks), default=0.0)
    busy = [s.busy for s in ranks]
    capacity = len(ranks) * makespan
    bubble = 1.0 - sum(busy) / capacity if capacity > 0 else 0.0
    return SimResult(makespan=makespan, busy=busy, bubble_fraction=bubble,
                     peak_in_flight=[s.peak for s in ranks], order=[s.order for s in ranks])


# --------------------------------------------------------------------------- #
# Chrome / Perfetto trace
# --------------------------------------------------------------------------- #


def to_chrome_trace(sim_or_records: SimResult | Sequence | Mapping) -> dict:
    """Chrome trace JSON (``{"traceEvents": [...]}``) that chrome://tracing and Perfetto open.

    Accepts a ``SimResult`` or per-rank records of ``(name, start_s, end_s)``, as
    a list indexed by rank or a ``{rank: records}`` dict. Times are seconds (the
    simulator's unit costs count as seconds) and become microseconds in ``ts``/``dur``.
    Each rank is one thread row of process 0, named by a metadata event.
    """
    if isinstance(sim_or_records, SimResult):
        per_rank: Mapping = dict(enumerate(sim_or_records.records()))
    elif isinstance(sim_or_records, Mapping):
        per_rank = sim_or_records
    else:
        per_rank = dict(enumerate(sim_or_records))
    events: list[dict] = [{"name": "process_name", "ph": "M", "pid": 0, "tid": 0,
                           "args": {"name": "pipeline"}}]
    for rank, records in sorted(per_rank.items()):
        events.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": int(rank),
                       "args": {"name": f"pp rank {rank}"}})
        for name, start, end in records:
            events.append({"name": str(name), "ph": "X", "ts": float(start) * 1e6,
                           "dur": (float(end) - float(start)) * 1e6, "pid": 0, "tid": int(rank)})
    return {"traceEvents": events, "displayTimeUnit": "ms"}
