"""Pipeline step time: every graphpar schedule against torch.distributed.pipelining's.

    .venv/bin/python benchmarks/bench_pipeline_parallel.py [--pp 2,4 --steps 20 --layers 8 ...]

One graphpar.launch per pipeline degree (pp=2 and pp=4: world size pp, gloo). For each of
graphpar's schedules, each rank compiles the same GPT (same seed, so the same initial weights)
with graphpar, then builds torch's pipelines from *the very same stage programs graphpar
produced*, so both systems run identical work on identical stages and microbatches:

    graphpar   gp.compile(Strategy(pp=p, microbatches=m, schedule=...)); pm.train_step(x, y)
    torch      torch.distributed.pipelining.PipelineStage over a deep copy of each of this
               rank's stage GraphModules (pm.compiled.stages[s].gm), driven by each torch
               schedule for that stage layout (SCHEDULES): GPipe and 1F1B on graphpar's
               gpipe / 1f1b stages; Interleaved1F1B and InterleavedZeroBubble (ZB1P) on
               interleaved-1f1b's (2 stages per rank, looping); ZBVZeroBubble and DualPipeV on
               zbv's (2 stages per rank in a V). torch has no ZB-H1 of one stage per rank, so
               graphpar's zero-bubble runs without a peer of its own; every schedule is in
               the best-against-best comparison.

How the stage programs are reused (`TorchStage` below):

  * stage 0's GraphModule takes the batch (token ids) and returns the tuple of values sent
    to stage 1; a middle stage takes the received activations and returns what it sends.
    torch's PipelineStage sends that tuple on and hands the received values to the next
    stage's forward as positional arguments, in the same order. For this GPT exactly one
    activation (the residual stream, microbatch x seq x n_embd, float32) crosses each cut:
    the position ids are computed and used inside stage 0, so no later stage reads the
    batch besides its activations (the script checks this and stops if it is not so).
  * graphpar's last stage computes the loss inside its graph (placeholders: target, then
    the received activation). torch's pipelining computes the loss itself, through the
    schedule's loss_fn, so the torch side gets graphpar's evaluation projection of the same
    last-stage graph (graphpar.runtime.single_stage.forward_only: the same nodes minus the loss and the
    target input, returning the logits) and `lm_loss` as the schedule's loss_fn. graphpar
    trains with the loss projection (loss_only: the same nodes minus the logits output), so
    the arithmetic is the same; the scaling differs only in place (graphpar divides each
    microbatch loss by m, torch's scale_grads=True divides the gradients by m at the end).
  * the weights are untied (GPTConfig(tie_weights=False)): torch's pipelining would copy a
    tied embedding/LM-head weight onto both stages without summing the two gradients,
    while graphpar all-reduces them; untied, both do the same work and the same maths.
  * graphpar's split schedules (zero-bubble, zbv) compute weight gradients from the stage
    programs' split calls (passes/split_backward.py); torch's zero-bubble schedules split
    each backward with autograd on the same programs. torch's stages are graphpar's programs
    before that pass, whose calls are the plain ops.

Both sides use AdamW (lr 1e-3) and the same batch; their per-step losses are compared as a
check that the work really is identical. A timed round runs one step of every system (each
graphpar schedule and each torch schedule), in an order rotated from round to round; every
step starts after a barrier, so the time of a step is the time its ranks spend in it (the
slowest rank's), optimizer step included. Each step also all-reduces the loss over the
pipeline, as graphpar's train_step does to return the global loss.

Ratios are per round (both steps ran in the same round, under the same load) and their
median is reported: per graphpar schedule against each torch schedule on its stages, and
graphpar's best schedule (lowest median) against torch's best.

Bubble fraction, measured as graphpar.runtime.pipeline.simulate.result_from does it: 1 - (busy
time of all ranks) / (ranks x makespan), where busy is the time inside forward and backward
(and weight-gradient) work and the makespan is the end of the last one, from the start of the
step on each rank (each step starts after a barrier). graphpar's records come from
pm.timeline() (gathered with all_gather_object); torch's from timers wrapped around its
stages' forward_one_chunk / backward_one_chunk / backward_weight_one_chunk and the schedule's
loss computation (graphpar's forward includes the loss), only in this script. Two simulated
bubbles beside it, both from graphpar.runtime.pipeline.simulate on the schedule graphpar ran:
with equal stages (forward 1, backward 2, a split backward's weight gradient half of it), and
a replay of each timed step with each op's measured duration (op_costs_of): the difference
between the two is what unequal stages and ops slowed down by other processes cost (the first
stage holds the embedding, the last the LM head and loss), the difference between the replay
and the measured bubble the idle time the executor adds beyond its ops' own durations
(transfers, python between ops). Medians over timed steps.
Nothing is written to disk.
"""
from __future__ import annotations

import argparse
import copy
import functools
import statistics
import time
from typing import Dict, List, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleDualPipeV, ScheduleGPipe,
                                          ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble,
                                          ScheduleZBVZeroBubble)
from torch.distributed.pipelining.schedules import PipelineScheduleMulti

import _common
import graphpar as gp
from graphpar.runtime.single_stage import forward_only
from graphpar.models.gpt import lm_loss, num_parameters
from graphpar.runtime.pipeline.schedules import build_schedule
from graphpar.runtime.pipeline.simulate import result_from as measured
from graphpar.runtime.pipeline.simulate import op_costs_of, simulate
from graphpar.runtime.split_backward import SPLIT_OF

# graphpar schedule -> (virtual stages, the torch schedules run on its stage programs)
SCHEDULES = {
    "gpipe": (1, [ScheduleGPipe]),
    "1f1b": (1, [Schedule1F1B]),
    "interleaved-1f1b": (2, [ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble]),
    "zero-bubble": (1, []),
    "zbv": (2, [ScheduleZBVZeroBubble, ScheduleDualPipeV]),
}
GP = "graphpar"


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    _common.add_model_options(parser, layers=8, embd=256, heads=4, vocab=256, seq=128, batch=16,
                              batch_help="global batch (pp only: every rank's)")
    parser.add_argument("--pp", default="2,4", help="comma-separated pipeline degrees, one launch each")
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--schedules", default=",".join(SCHEDULES),
                        help=f"comma-separated, from {', '.join(SCHEDULES)}")
    parser.add_argument("--no-torch", action="store_true", help="graphpar's schedules only")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20, help="timed rounds")
    parser.add_argument("--quick", action="store_true", help="pp=2 only, 1 warmup and 6 timed rounds")
    args = parser.parse_args(argv)
    if args.quick:
        args.pp, args.warmup, args.steps = "2", 1, 6
    args.pp = [int(p) for p in args.pp.split(",") if p.strip()]
    args.schedules = [s.strip() for s in args.schedules.split(",") if s.strip()]
    unknown = [s for s in args.schedules if s not in SCHEDULES]
    if unknown:
        parser.error(f"unknown schedule(s) {unknown}; choose from {list(SCHEDULES)}")
    return args


# ---- the torch side, built from graphpar's stage programs --------------------------------

class TorchStage(nn.Module):
    """One of graphpar's stage GraphModules, called the way torch's PipelineStage calls a
    stage: forward(*batch inputs) on the first stage, forward(*received) on the others."""

    def __init__(self, gm: torch.fx.GraphModule, returns_tuple: bool):
        super().__init__()
        self.gm = gm
        self.returns_tuple = returns_tuple

    def forward(self, *args):
        out = self.gm(*args)
        return tuple(out) if self.returns_tuple else out[0]


def unsplit(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """The program with passes/split_backward.py's calls turned back into the ops they stand
    for (same arguments): torch splits backward its own way, on plain ops."""
    original = {split: op for op, split in SPLIT_OF.items()}
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in original:
            node.target = original[node.target]
    gm.recompile()
    return gm


def torch_stage_module(program, loss_outputs: int) -> TorchStage:
    gm = unsplit(copy.deepcopy(program.gm))  # its own weights: same initial values as graphpar's
    if program.is_last:
        gm = forward_only(gm, loss_outputs)  # logits only; torch's loss_fn computes the loss
        placeholders = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
        if placeholders != program.receives:
            raise RuntimeError(f"stage {program.stage} reads {placeholders}, not only what it receives "
                               f"({program.receives}); this benchmark can't hand it to PipelineStage as is")
        return TorchStage(gm, returns_tuple=False)
    expected = program.inputs if program.stage == 0 else []
    if program.inputs != expected:
        raise RuntimeError(f"stage {program.stage} reads batch inputs {program.inputs} besides its "
                           f"activations; torch's PipelineStage only feeds the batch to stage 0")
    return TorchStage(gm, returns_tuple=True)


class Timeline:
    """(start, end, label) of each forward / backward / loss of the current step."""

    def __init__(self):
        self.rows: List[Tuple[float, float, str]] = []
        self.start = 0.0

    def reset(self):
        self.rows, self.start = [], time.perf_counter()

    def wrap(self, fn, label: str):
        @functools.wraps(fn)
        def timed(*a, **k):
            began = time.perf_counter() - self.start
            result = fn(*a, **k)
            self.rows.append((began, time.perf_counter() - self.start, label))
            return result
        return timed


class TorchPipeline:
    def __init__(self, pm, cls, microbatches: int, optimizer):
        programs = pm.compiled.stages
        num_stages = pm.compiled.stage_plan.num_stages
        self.timeline = Timeline()
        self.stages = []
        self.modules = []
        device = torch.device("cpu")
        for s in sorted(programs):
            module = torch_stage_module(programs[s], pm.compiled.program.loss_outputs)
            stage = PipelineStage(module, s, num_stages, device)  # default (world) group
            stage.forward_one_chunk = self.timeline.wrap(stage.forward_one_chunk, f"F{s}")
            stage.backward_one_chunk = self.timeline.wrap(stage.backward_one_chunk, f"B{s}")
            stage.backward_weight_one_chunk = self.timeline.wrap(stage.backward_weight_one_chunk, f"W{s}")
            self.modules.append(module)
            self.stages.append(stage)
        self.first = 0 in programs
        self.last = (num_stages - 1) in programs
        self.m = microbatches
        multi = issubclass(cls, PipelineScheduleMulti)
        self.schedule = cls(self.stages if multi else self.stages[0], n_microbatches=microbatches,
                            loss_fn=lm_loss, scale_grads=True)
        self.schedule._compute_loss = self.timeline.wrap(self.schedule._compute_loss, "loss")
        self.optimizer = optimizer([p for mod in self.modules for p in mod.parameters()])
        self.group = pm.mesh.group("pp")

    def train_step(self, x, y) -> float:
        self.optimizer.zero_grad(set_to_none=True)
        losses: List[torch.Tensor] = []
        self.timeline.reset()
        args = (x,) if self.first else ()
        self.schedule.step(*args, target=y if self.last else None, losses=losses if self.last else None,
                           return_outputs=False)
        self.optimizer.step()
        # graphpar's train_step returns the global mean loss: the same all-reduce here
        loss = (torch.stack([mb_loss.detach() for mb_loss in losses]).sum() / self.m if self.last
                else torch.zeros(())).double()
        dist.all_reduce(loss, group=self.group)
        return float(loss)


# ---- per rank ----------------------------------------------------------------------------

def _systems(args, model, x, y, optimizer) -> Dict[str, dict]:
    """Every system this rank times, by label: each graphpar schedule ("graphpar zbv") and each
    torch schedule on its stage programs ("torch ScheduleZBVZeroBubble"), in SCHEDULES' order."""
    pp, m = dist.get_world_size(), args.microbatches
    systems: Dict[str, dict] = {}
    for name in args.schedules:
        v, torch_schedules = SCHEDULES[name]
        strategy = gp.Strategy(pp=pp, microbatches=m, schedule=name, virtual_stages=v)
        pm = gp.compile(copy.deepcopy(model), strategy, example_inputs=(x,), example_target=y,
                        loss_fn=lm_loss, optimizer=optimizer)
        plan = pm.compiled.stage_plan
        bounds = plan.bounds + [len(plan.units)]
        systems[f"{GP} {name}"] = {"schedule": name, "v": v, "step": functools.partial(pm.train_step, x, target=y),
                                   "timeline": pm.timeline, "error": None,
                                   "units": [[u.path for u in plan.units[b:e]] for b, e in zip(bounds[:-1], bounds[1:])]}
        for cls in [] if args.no_torch else torch_schedules:
            entry = {"schedule": name, "v": v, "peer_of": f"{GP} {name}", "error": None}
            try:
                pipeline = TorchPipeline(pm, cls, m, optimizer)
                entry.update(step=functools.partial(pipeline.train_step, x, y),
                             timeline=functools.partial(getattr, pipeline.timeline, "rows"))
            except Exception as e:  # reported, not fatal: the others still run
                entry["error"] = f"{type(e).__name__}: {e}"
            systems[f"torch {cls.__name__}"] = entry
    return systems


def rank_main(args: argparse.Namespace) -> dict:
    # Ranks share 2 cores: more threads would only contend with the peers and gloo.
    torch.set_num_threads(1)
    # untied: torch's pipelining would copy a tied weight onto both stages without a gradient sum
    model = _common.gpt(args, tie_weights=False)
    x, y = _common.token_batch(args, seed=0)  # pipeline parallelism: every rank sees the whole batch
    optimizer = functools.partial(torch.optim.AdamW, lr=1e-3)
    systems = _systems(args, model, x, y, optimizer)
    for entry in systems.values():
        entry.update(times=[], losses=[], timelines=[])
        _agree(entry)
    world = dist.group.WORLD
    labels = list(systems)
    for round_ in range(args.warmup + args.steps):
        timed = round_ >= args.warmup
        shift = round_ % len(labels)
        for label in labels[shift:] + labels[:shift]:   # no system always runs first
            entry = systems[label]
            if entry["error"] is not None:
                continue
            dist.barrier(world)
            start = time.perf_counter()
            try:
                loss = entry["step"]()
            except Exception as e:
                if label.startswith(GP):
                    raise
                # torch's pipeline failed at run time: drop it. Every rank must agree, or a
                # peer hangs in its step; the collective timeout then ends the run.
                entry["error"] = f"{type(e).__name__}: {e}"
            elapsed = time.perf_counter() - start
            if not label.startswith(GP) and _agree(entry):
                continue
            entry["losses"].append(loss)
            if timed:
                entry["times"].append(elapsed)
                entry["timelines"].append(list(entry["timeline"]()))
    # every rank's timelines, for the bubble fraction over all ranks
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, {label: entry["timelines"] for label, entry in systems.items()})
    keep = ("schedule", "v", "peer_of", "units", "times", "losses", "error")
    result = {"systems": {label: {k: entry[k] for k in keep if k in entry} for label, entry in systems.items()},
              "params": num_parameters(model)}
    if dist.get_rank() == 0:
        for label, entry in result["systems"].items():
            entry["timelines"] = [[per_rank[label][i] for per_rank in everyone]
                                  for i in range(len(everyone[0][label]))]
    return result


def _agree(entry: dict) -> bool:
    """Whether a system failed on any rank; if so, every rank drops it (a rank going on alone
    would wait in its step for peers that never come)."""
    failed = torch.tensor([entry["error"] is not None], dtype=torch.int32)
    dist.all_reduce(failed, op=dist.ReduceOp.MAX)
    if failed.item() and entry["error"] is None:
        entry["error"] = "failed on another rank"
    return bool(failed.item())


# ---- report ------------------------------------------------------------------------------

def summarize(args, pp: int, results: List[dict]) -> Dict[str, dict]:
    """Per system: its step times (the slowest rank's, per round), median and bubbles."""
    m = args.microbatches
    out: Dict[str, dict] = {}
    for label, entry in results[0]["systems"].items():
        error = next((r["systems"][label]["error"] for r in results if r["systems"][label]["error"]), None)
        s = {k: entry.get(k) for k in ("schedule", "v", "peer_of", "units")}
        s["error"] = error
        steps = _common.slowest_rank(r["systems"][label]["times"] for r in results)
        if error is not None or not steps:
            out[label] = s
            continue
        timelines = entry["timelines"]
        s.update(steps=steps, median=statistics.median(steps), losses=entry["losses"],
                 bubble=statistics.median(measured(t).bubble_fraction for t in timelines),
                 busy=[statistics.median(b) for b in zip(*(measured(t).busy for t in timelines))])
        if label.startswith(GP):
            schedule = build_schedule(s["schedule"], pp, m, s["v"])
            s["simulated_equal"] = simulate(schedule, pp).bubble_fraction
            s["simulated_measured"] = statistics.median(
                simulate(schedule, pp, stage_costs=op_costs_of(t)).bubble_fraction for t in timelines)
        out[label] = s
    return out


def _best(summary: Dict[str, dict], prefix: str):
    timed = [label for label, s in summary.items() if label.startswith(prefix) and "median" in s]
    return min(timed, key=lambda label: summary[label]["median"]) if timed else None


def report(args, runs: Dict[int, Tuple[List[dict], Dict[str, dict], str, str]]) -> str:
    ms = lambda t: f"{t * 1e3:.0f}"  # noqa: E731
    pct = lambda f: f"{f:.1%}"  # noqa: E731
    first = next(iter(runs.values()))[0]
    lines = [
        "## Pipeline parallelism: graphpar vs torch.distributed.pipelining",
        "",
        f"GPT {args.layers} layers, n_embd {args.embd}, {args.heads} heads, vocab {args.vocab}, seq {args.seq}, "
        f"untied LM head ({first[0]['params'] / 1e6:.2f} M parameters), global batch {args.batch} in "
        f"{args.microbatches} microbatches, AdamW; both systems run graphpar's stage programs; "
        f"{args.warmup} warmup + {args.steps} timed rounds; times are the slowest rank's, optimizer step included.",
        "",
        "| pp | schedule | stages (v) | torch schedule | graphpar median (ms) | torch median (ms) | graphpar / torch | "
        "graphpar bubble (measured) | simulated (each op's measured time) | simulated (equal stages) | "
        "torch bubble (measured) | max loss gap |",
        "|---:|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    notes: List[str] = []
    for pp, (_, summary, _, _) in runs.items():
        for label, s in summary.items():
            if not label.startswith(GP):
                continue
            peers = [(p, summary[p]) for p, t in summary.items() if t.get("peer_of") == label] or [(None, None)]
            for peer, t in peers:
                lines.append(_row(pp, label, s, peer, t, ms, pct))
        gp_best, torch_best = _best(summary, GP), _best(summary, "torch")
        if gp_best and torch_best:
            g, t = summary[gp_best], summary[torch_best]
            ratio = _common.median_ratio(g["steps"], t["steps"])
            lines.append(f"| {pp} | **best: {g['schedule']}** | {pp * g['v']} ({g['v']}) | **best: "
                         f"{torch_best.split(' ', 1)[1]}** | {ms(g['median'])} | {ms(t['median'])} | **{ratio:.3f}** | "
                         f"{pct(g['bubble'])} | {pct(g['simulated_measured'])} | {pct(g['simulated_equal'])} | "
                         f"{pct(t['bubble'])} | |")
        fastest = _fastest_per_round(summary)
        if fastest is not None:
            notes.append(f"- pp={pp}: each system's fastest schedule in each round, graphpar / torch: "
                         f"**{fastest:.3f}** (median over rounds)")
        for label, s in summary.items():
            if s["error"]:
                notes.append(f"- pp={pp}, {label}: not timed: {s['error']}")
            elif label.startswith(GP):
                stages = "; ".join(f"{i}: {', '.join(u)}" for i, u in enumerate(s["units"]))
                notes.append(f"- pp={pp}, {label}: compute per step on each rank "
                             f"{'/'.join(ms(b) for b in s['busy'])} ms; stages [{stages}]")
    lines += [""] + notes + [
        "",
        "graphpar / torch is the median over rounds of the per-round ratio (< 1: graphpar faster); the best "
        "row pairs each system's schedule of lowest median. Bubble: 1 - busy / (ranks x makespan) over every "
        "rank's forward / backward / weight-gradient records, median over timed steps; simulated: "
        "graphpar.runtime.pipeline.simulate on the same schedule with equal stages (forward 1, backward 2), "
        "and with each op's measured duration (a replay of the step: measured minus replay is the idle time "
        "graphpar's executor added). Max loss gap: largest |loss(graphpar) - "
        "loss(torch)| over all steps (same weights, data, optimizer).",
        "",
    ]
    for pp, (_, _, before, after) in runs.items():
        lines.append(f"pp={pp}: load average (1/5/15 min) {before} before, {after} after")
    lines += ["", *_common.reproduce_lines("1 thread per rank", *_load_span(runs), "bench_pipeline_parallel.py")]
    return "\n".join(lines)


def _fastest_per_round(summary: Dict[str, dict]):
    """Median over rounds of (graphpar's fastest step in the round) / (torch's fastest): best
    against best without choosing the best schedules first."""
    steps = {prefix: [s["steps"] for label, s in summary.items() if label.startswith(prefix) and "steps" in s]
             for prefix in (GP, "torch")}
    if not steps[GP] or not steps["torch"]:
        return None
    return _common.median_ratio([min(r) for r in zip(*steps[GP])], [min(r) for r in zip(*steps["torch"])])


def _row(pp, label, s, peer, t, ms, pct) -> str:
    name = s["schedule"]
    stages = f"{pp * s['v']} ({s['v']})"
    if "median" not in s:
        return f"| {pp} | {name} | {stages} | n/a | n/a | n/a | n/a | n/a | n/a | n/a | n/a | n/a |"
    gp_cells = [pct(s["bubble"]), pct(s["simulated_measured"]), pct(s["simulated_equal"])]
    if t is None or "median" not in t:
        torch_name = peer.split(" ", 1)[1] + " (failed)" if peer else "none"
        return (f"| {pp} | {name} | {stages} | {torch_name} | {ms(s['median'])} | n/a | n/a | "
                f"{' | '.join(gp_cells)} | n/a | n/a |")
    ratio = _common.median_ratio(s["steps"], t["steps"])
    gap = max(abs(a - b) for a, b in zip(s["losses"], t["losses"]))
    return (f"| {pp} | {name} | {stages} | {peer.split(' ', 1)[1]} | {ms(s['median'])} | {ms(t['median'])} | "
            f"**{ratio:.3f}** | {' | '.join(gp_cells)} | {pct(t['bubble'])} | {gap:.1e} |")


def _load_span(runs) -> Tuple[str, str]:
    values = list(runs.values())
    return values[0][2], values[-1][3]


def main(argv=None) -> None:
    args = parse_args(argv)
    runs = {}
    for pp in args.pp:
        results, before, after = _common.launch(rank_main, world_size=pp, args=(args,))
        runs[pp] = (results, summarize(args, pp, results), before, after)
    print(report(args, runs))


if __name__ == "__main__":
    main()
