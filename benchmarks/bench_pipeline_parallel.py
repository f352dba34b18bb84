"""pp=2 training step time: graphpar's pipeline against torch.distributed.pipelining.

    .venv/bin/python benchmarks/bench_pipeline_parallel.py [--steps 20 --layers 8 ...]

One graphpar.launch starts 2 gloo ranks (pp=2). For each schedule, each rank compiles the
same GPT (same seed, so the same initial weights) with graphpar, then builds torch's
pipeline from *the very same stage programs graphpar produced*, so both systems run
identical work on identical stages and microbatches:

    graphpar   gp.compile(Strategy(pp=2, microbatches=m, schedule=...)); pm.train_step(x, y)
    torch      torch.distributed.pipelining.PipelineStage over a deep copy of each of this
               rank's stage GraphModules (pm.compiled.stages[s].gm), driven by
               ScheduleGPipe / Schedule1F1B / ScheduleInterleaved1F1B with the same m

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

Both sides use AdamW (lr 1e-3) and the same batch; their per-step losses are compared as a
check that the work really is identical. A timed round runs one step of each system per
schedule, alternating which goes first; every step starts after a barrier, so the time of
a step is the time both ranks spend in it (the slower rank's), optimizer step included.
Each step also all-reduces the loss over the pipeline, as graphpar's train_step does to
return the global loss. torch's send/receive run on the default (world) group, graphpar's
on its pp group: with pp=2 they are the same two ranks.

Bubble fraction, measured as graphpar.runtime.pipeline.simulate.result_from does it: 1 - (busy time of all
ranks) / (ranks x makespan), where busy is the time inside forward and backward and the
makespan is the end of the last one, from the start of the step on each rank (each step
starts after a barrier, so the ranks' clocks start within a barrier's skew of each other).
graphpar's records come from pm.timeline() (gathered with all_gather_object); torch's from
timers wrapped around its stages' forward_one_chunk / backward_one_chunk and the
schedule's loss computation (graphpar's forward includes the loss), only in this script.
Reported: the median over timed steps, next to the formula (p-1)/(m+p-1), divided by v for
the interleaved schedule. Nothing is written to disk.
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
from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe,
                                          ScheduleInterleaved1F1B)

import _common
import graphpar as gp
from graphpar.runtime.single_stage import forward_only
from graphpar.models.gpt import lm_loss, num_parameters
from graphpar.runtime.pipeline.simulate import result_from as measured

# graphpar schedule name, virtual stages, torch schedule class
SCHEDULES = {
    "gpipe": ("gpipe", 1, ScheduleGPipe),
    "1f1b": ("1f1b", 1, Schedule1F1B),
    "interleaved-1f1b": ("interleaved-1f1b", 2, ScheduleInterleaved1F1B),
}
GP, TORCH = "graphpar", "torch"


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    _common.add_model_options(parser, layers=8, embd=256, heads=4, vocab=256, seq=128, batch=16,
                              batch_help="global batch (pp only: every rank's)")
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--schedules", default=",".join(SCHEDULES),
                        help=f"comma-separated, from {', '.join(SCHEDULES)}")
    parser.add_argument("--no-torch-interleaved", action="store_true",
                        help="run graphpar's interleaved-1f1b without a torch peer")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20, help="timed rounds")
    args = parser.parse_args(argv)
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


def torch_stage_module(program, num_stages: int) -> TorchStage:
    gm = copy.deepcopy(program.gm)  # its own weights: same initial values as graphpar's
    if program.is_last:
        gm = forward_only(gm, has_loss=True)  # logits only; torch's loss_fn computes the loss
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
            module = torch_stage_module(programs[s], num_stages)
            stage = PipelineStage(module, s, num_stages, device)  # default (world) group
            stage.forward_one_chunk = self.timeline.wrap(stage.forward_one_chunk, f"F{s}")
            stage.backward_one_chunk = self.timeline.wrap(stage.backward_one_chunk, f"B{s}")
            self.modules.append(module)
            self.stages.append(stage)
        self.first = 0 in programs
        self.last = (num_stages - 1) in programs
        self.m = microbatches
        multi = cls is ScheduleInterleaved1F1B
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

def rank_main(args: argparse.Namespace) -> dict:
    # Two ranks on two cores: more threads would only contend with the peer and gloo.
    torch.set_num_threads(1)
    rank = dist.get_rank()
    # untied: torch's pipelining would copy a tied weight onto both stages without a gradient sum
    model = _common.gpt(args, tie_weights=False)
    x, y = _common.token_batch(args, seed=0)  # pipeline parallelism: every rank sees the whole batch
    optimizer = functools.partial(torch.optim.AdamW, lr=1e-3)
    runs: Dict[str, dict] = {}
    for name in args.schedules:
        gp_name, v, cls = SCHEDULES[name]
        strategy = gp.Strategy(pp=2, microbatches=args.microbatches, schedule=gp_name, virtual_stages=v)
        pm = gp.compile(copy.deepcopy(model), strategy, example_inputs=(x,), example_target=y,
                        loss_fn=lm_loss, optimizer=optimizer)
        torch_pp, torch_error = None, None
        if not (v > 1 and args.no_torch_interleaved):
            try:
                torch_pp = TorchPipeline(pm, cls, args.microbatches, optimizer)
            except Exception as e:  # reported, not fatal: graphpar still runs
                torch_error = f"{type(e).__name__}: {e}"
        plan = pm.compiled.stage_plan
        bounds = plan.bounds + [len(plan.units)]
        runs[name] = {"pm": pm, "torch": torch_pp, "error": torch_error, "v": v,
                      "units": [[u.path for u in plan.units[b:e]] for b, e in zip(bounds[:-1], bounds[1:])],
                      "times": {GP: [], TORCH: []}, "losses": {GP: [], TORCH: []},
                      "timelines": {GP: [], TORCH: []}}

    world = dist.group.WORLD
    for round_ in range(args.warmup + args.steps):
        timed = round_ >= args.warmup
        for name in args.schedules:
            run = runs[name]
            # The lambdas are called below, before the loop moves on to the next run.
            steps = {GP: lambda: run["pm"].train_step(x, target=y)}  # noqa: B023
            if run["torch"] is not None:
                steps[TORCH] = lambda: run["torch"].train_step(x, y)  # noqa: B023
            order = list(steps) if round_ % 2 == 0 else list(steps)[::-1]
            for system in order:
                if run["error"] is not None and system == TORCH:
                    continue
                dist.barrier(world)
                start = time.perf_counter()
                try:
                    loss = steps[system]()
                except Exception as e:
                    if system == GP:
                        raise
                    # torch's pipeline failed at run time: drop it for this schedule. Both
                    # ranks must agree, or the peer hangs in its step; the collective
                    # timeout then ends the run.
                    run["error"], run["torch"] = f"{type(e).__name__}: {e}", None
                    continue
                elapsed = time.perf_counter() - start
                run["losses"][system].append(loss)
                if timed:
                    run["times"][system].append(elapsed)
                    rows = (list(run["pm"].timeline()) if system == GP else list(run["torch"].timeline.rows))
                    run["timelines"][system].append([(a, b, str(i)) for a, b, i in rows])

    # every rank's timelines, for the bubble fraction over both ranks
    mine = {name: run["timelines"] for name, run in runs.items()}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    result = {name: {k: run[k] for k in ("units", "times", "losses", "error", "v")}
              for name, run in runs.items()}
    if rank == 0:
        for name in runs:
            result[name]["timelines"] = {system: [[per_rank[name][system][i] for per_rank in everyone]
                                                  for i in range(len(everyone[0][name][system]))]
                                         for system in (GP, TORCH)}
    result["params"] = num_parameters(model)
    return result


# ---- report ------------------------------------------------------------------------------

def _slowest_rank(results: List[dict], name: str, system: str) -> List[float]:
    return _common.slowest_rank(r[name]["times"][system] for r in results)


def summarize(args, results: List[dict]) -> Dict[str, dict]:
    p, m = 2, args.microbatches
    out = {}
    for name in args.schedules:
        r0 = results[0][name]
        v = r0["v"]
        have_torch = bool(results[0][name]["times"][TORCH]) and all(r[name]["error"] is None for r in results)
        s = {"v": v, "units": r0["units"], "error": next((r[name]["error"] for r in results if r[name]["error"]), None),
             "formula": (p - 1) / (m + p - 1) / v, "torch": have_torch}
        gp_steps = _slowest_rank(results, name, GP)
        s["gp_median"], s["gp_min"] = statistics.median(gp_steps), min(gp_steps)
        s["gp_bubble"] = statistics.median(measured(rec).bubble_fraction for rec in r0["timelines"][GP])
        s["gp_busy"] = _busy(r0["timelines"][GP])
        # the least disturbed step: on a shared machine, the closest to the schedule's own bubble
        s["gp_bubble_fastest"] = measured(r0["timelines"][GP][gp_steps.index(s["gp_min"])]).bubble_fraction
        if have_torch:
            torch_steps = _slowest_rank(results, name, TORCH)
            s["torch_median"], s["torch_min"] = statistics.median(torch_steps), min(torch_steps)
            s["ratio"] = _common.median_ratio(gp_steps, torch_steps)
            s["ratio_of_medians"] = s["gp_median"] / s["torch_median"]
            s["torch_bubble"] = statistics.median(measured(rec).bubble_fraction
                                                  for rec in r0["timelines"][TORCH])
            s["torch_busy"] = _busy(r0["timelines"][TORCH])
            s["torch_bubble_fastest"] = measured(
                r0["timelines"][TORCH][torch_steps.index(s["torch_min"])]).bubble_fraction
            pairs = list(zip(r0["losses"][GP], r0["losses"][TORCH]))
            s["loss_gap"] = max(abs(a - b) for a, b in pairs)
            s["loss_first_last"] = (pairs[0][0], pairs[-1][0])
        out[name] = s
    return out


def _busy(timelines) -> List[float]:
    """Median per rank of the time spent inside forward / backward in a step: how evenly the
    stages split the work (an uneven split is bubble the formula does not count)."""
    per_step = [measured(rec).busy for rec in timelines]
    return [statistics.median(step[r] for step in per_step) for r in range(len(per_step[0]))]


def report(args, results: List[dict], summary: Dict[str, dict], load_before: str, load_after: str) -> str:
    ms = lambda t: f"{t * 1e3:.0f}"  # noqa: E731
    pct = lambda f: f"{f:.1%}"  # noqa: E731
    lines = [
        "## Pipeline parallelism: graphpar vs torch.distributed.pipelining (pp=2)",
        "",
        f"GPT {args.layers} layers, n_embd {args.embd}, {args.heads} heads, vocab {args.vocab}, seq {args.seq}, "
        f"untied LM head ({results[0]['params'] / 1e6:.2f} M parameters), global batch {args.batch} in "
        f"{args.microbatches} microbatches, AdamW; both systems run graphpar's stage programs; "
        f"{args.warmup} warmup + {args.steps} timed rounds; times are the slower rank's, optimizer step included.",
        "",
        "| schedule | stages (v) | graphpar median (ms) | torch median (ms) | graphpar / torch | "
        "graphpar bubble (measured) | formula | torch bubble (measured) | max loss gap |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, s in summary.items():
        if s["torch"]:
            lines.append(
                f"| {name} | {2 * s['v']} ({s['v']}) | {ms(s['gp_median'])} | {ms(s['torch_median'])} | "
                f"**{s['ratio']:.3f}** | {pct(s['gp_bubble'])} | {pct(s['formula'])} | {pct(s['torch_bubble'])} | "
                f"{s['loss_gap']:.1e} |")
        else:
            lines.append(f"| {name} | {2 * s['v']} ({s['v']}) | {ms(s['gp_median'])} | n/a | n/a | "
                         f"{pct(s['gp_bubble'])} | {pct(s['formula'])} | n/a | n/a |")
    lines += [""]
    for name, s in summary.items():
        stages = "; ".join(f"{i}: {', '.join(u)}" for i, u in enumerate(s["units"]))
        extra = (f"fastest steps {ms(s['gp_min'])} / {ms(s['torch_min'])} ms "
                 f"(ratio {s['gp_min'] / s['torch_min']:.3f}), ratio of medians {s['ratio_of_medians']:.3f}; "
                 f"loss {s['loss_first_last'][0]:.4f} -> {s['loss_first_last'][1]:.4f}"
                 if s["torch"] else f"no torch peer: {s['error'] or 'not requested'}")
        busy = "/".join(ms(b) for b in s["gp_busy"])
        fastest = f"bubble in the fastest step {pct(s['gp_bubble_fastest'])}"
        if s["torch"]:
            busy += " (torch " + "/".join(ms(b) for b in s["torch_busy"]) + ")"
            fastest += f" (torch {pct(s['torch_bubble_fastest'])})"
        lines.append(f"- {name}: stages [{stages}]; compute per step on rank 0/1 {busy} ms; "
                     f"{fastest}; {extra}")
    lines += [
        "",
        "graphpar / torch is the median over rounds of the per-round ratio (< 1: graphpar faster). "
        "Bubble: 1 - busy / (ranks x makespan) over both ranks' forward/backward records, median over "
        "timed steps; formula (p-1)/(m+p-1), divided by v when interleaved. Max loss gap: largest "
        "|loss(graphpar) - loss(torch)| over all steps (same weights, data, optimizer).",
        "",
        *_common.reproduce_lines("1 thread per rank", load_before, load_after, "bench_pipeline_parallel.py"),
    ]
    return "\n".join(lines)


def main(argv=None) -> None:
    args = parse_args(argv)
    results, load_before, load_after = _common.launch(rank_main, world_size=2, args=(args,))
    print(report(args, results, summarize(args, results), load_before, load_after))


if __name__ == "__main__":
    main()
