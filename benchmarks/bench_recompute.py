"""Activation recomputation at world 1: graphpar's Strategy(recompute=...) against
torch.utils.checkpoint on the same eager GPT; step time and bytes kept for backward.

    .venv/bin/python benchmarks/bench_recompute.py [--warmup 2] [--rounds 12] [--budget 0.5] [--quick]

One process builds the GPT (_common.gpt with dropout 0.1: same seed, so the same initial
weights) once per variant and trains the copies side by side on one fixed batch, all with
AdamW(lr=1e-3):

    graphpar none        gp.compile(Strategy())
    graphpar selective   gp.compile(Strategy(recompute="selective"))
    graphpar full        gp.compile(Strategy(recompute="full"))
    graphpar budget B    gp.compile(Strategy(recompute=B)), B from --budget
    eager                the model as written, no checkpointing
    eager + checkpoint   torch.utils.checkpoint(use_reentrant=False) around every block:
                         what a torch user writes for "full"
    eager + SAC          the same with torch's selective activation checkpointing
                         (create_selective_checkpoint_contexts), whose policy saves the
                         outputs of the ops graphpar's "selective" saves (matmuls, attention)
                         and recomputes the rest

Every eager variant seeds torch before its k-th step with k, so the three draw the same
dropout masks and their losses must agree; the graphpar variants draw from graphpar's own
dropout streams (replayed in the backward), so theirs agree with graphpar none, not with eager.

Time: a timed round runs one step of each variant, rotating which goes first; warmup rounds
are dropped (the first holds graphpar's first train_step). Ratios are medians over rounds of
the per-round ratio (the variants of a round share the machine's load at that moment); the
ratio of the fastest steps is shown beside it.

Memory, after the timed rounds, one variant at a time, one step each:
    saved        the most bytes kept for backward at any one time (_memory.SavedBytes):
                 what autograd saves, seen by torch.autograd.graph.saved_tensors_hooks,
                 each storage once while saved, parameters excluded; for eager + SAC also
                 the op outputs its policy caches, which torch keeps in its own dispatch
                 mode where the hooks do not see them (reported by the policy with
                 SavedBytes.keep, counted the same way until freed). torch's checkpoint
                 keeps each block's input as a saved tensor, which the hooks see.
    planned      gp.plan's activation_peak_bytes and recompute_flops, for graphpar
    step peak    all tensor bytes alive during a step and at its start (_memory.step_peak,
                 two more steps under the dispatcher count): the same for every variant,
                 hooks or not
Nothing is written to disk.
"""
from __future__ import annotations

import argparse
import copy
import functools
import itertools
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

import torch
import torch.nn as nn
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

import _common
import _memory
import graphpar as gp
from graphpar.models.gpt import lm_loss, num_parameters
from graphpar.passes.recompute import SELECTIVE

GP_NONE, GP_SEL, GP_FULL = "graphpar none", "graphpar selective", "graphpar full"
EAGER, CKPT, SAC = "eager", "eager + checkpoint", "eager + SAC"
QUICK = {"warmup": 1, "rounds": 5}
FULL_TIME_TARGET = 1.4      # the issue: "full" at most 1.4x the no-recompute step
FULL_SAVED_TARGET = 0.25    # the issue: "full" on an 8-layer GPT saves at most 1/4
PLAN_TOLERANCE = 0.10       # the issue: measured saved bytes within 10% of gp.plan's figure
MiB = 2**20


_START = time.perf_counter()


def progress(message: str) -> None:
    """A line on stderr, with the seconds since the start: where a run of a few minutes is."""
    print(f"bench_recompute: [{time.perf_counter() - _START:.0f} s] {message}", file=sys.stderr, flush=True)


def budget(text: str) -> float:
    value = float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{text}: a fraction of the activation peak without "
                                         "recomputation, in (0, 1]; e.g. --budget 0.5")
    return value


def at_least(least: int):
    """An argparse type: an integer no smaller than `least`."""
    def parse(text: str) -> int:
        value = int(text)
        if value < least:
            raise argparse.ArgumentTypeError(f"{text}: must be at least {least}")
        return value
    return parse


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    _common.add_model_options(parser, layers=8, embd=256, heads=4, vocab=256, seq=128, batch=8)
    parser.add_argument("--dropout", type=float, default=0.1, help="the GPT's dropout (default 0.1)")
    parser.add_argument("--budget", type=budget, default=0.5,
                        help="graphpar's budget variant: Strategy(recompute=BUDGET) (default 0.5)")
    parser.add_argument("--threads", type=at_least(1), default=None,
                        help="torch threads (default: the cores this process may use)")
    parser.add_argument("--warmup", type=at_least(0), default=2)
    parser.add_argument("--rounds", type=at_least(1), default=12, help="timed rounds")
    parser.add_argument("--quick", action="store_true",
                        help=f"the short run (1-2 minutes): --warmup {QUICK['warmup']} --rounds {QUICK['rounds']}")
    args = parser.parse_args(argv)
    if args.quick:
        args.warmup, args.rounds = QUICK["warmup"], QUICK["rounds"]
    args.threads = args.threads or _common.usable_cores()
    return args


def graphpar_modes(args) -> Dict[str, object]:
    """Variant name -> Strategy.recompute, the no-recompute one first."""
    return {GP_NONE: None, GP_SEL: "selective", GP_FULL: "full", budget_name(args): args.budget}


def budget_name(args) -> str:
    return f"graphpar budget {args.budget:g}"


def baseline(name: str) -> str:
    """The variant's own no-recompute run: what its losses and saved bytes compare with."""
    return GP_NONE if name.startswith("graphpar") else EAGER


def optimizer_factory():
    return functools.partial(torch.optim.AdamW, lr=1e-3)


# ---- the systems -------------------------------------------------------------------------------

@dataclass
class System:
    step: Callable[[], float]
    parameters: List[torch.Tensor]                # excluded from the saved bytes
    policy: Optional["SavePolicy"] = None         # eager + SAC's, which reports what it caches
    losses: List[float] = field(default_factory=list)

    def run(self) -> None:
        """One step, its loss recorded."""
        self.losses.append(self.step())


class SavePolicy:
    """torch's selective checkpointing policy: keep the outputs of the ops graphpar's
    "selective" keeps (graphpar.passes.recompute.SELECTIVE: matmuls, attention), recompute the
    rest. While `report` is set (a SavedBytes.keep), it is given each output the cache keeps."""

    def __init__(self) -> None:
        self.report: Optional[Callable[[torch.Tensor], None]] = None

    def __call__(self, ctx, op, *args, **kwargs):
        if op.overloadpacket.__name__ not in SELECTIVE:
            return CheckpointPolicy.PREFER_RECOMPUTE
        if self.report is not None:
            for t in tree_leaves(ctx.op_output):
                if isinstance(t, torch.Tensor):
                    self.report(t)
        return CheckpointPolicy.MUST_SAVE


class Checkpointed(nn.Module):
    """A block run under torch.utils.checkpoint (non-reentrant), selectively with a policy."""

    def __init__(self, block: nn.Module, policy: Optional[SavePolicy]) -> None:
        super().__init__()
        self.block = block
        self.options = {"use_reentrant": False}
        if policy is not None:
            self.options["context_fn"] = functools.partial(create_selective_checkpoint_contexts, policy)

    def forward(self, x):
        return checkpoint(self.block, x, **self.options)


def graphpar_system(model, mode, x, y) -> System:
    pm = gp.compile(model, gp.Strategy(recompute=mode), example_inputs=(x,), example_target=y, loss_fn=lm_loss,
                    optimizer=optimizer_factory())
    return System(lambda: pm.train_step(x, target=y), list(pm.parameters()))


def eager_system(model, name: str, x, y) -> System:
    policy = SavePolicy() if name == SAC else None
    if name != EAGER:
        for i, block in enumerate(model.blocks):
            model.blocks[i] = Checkpointed(block, policy)
    opt = optimizer_factory()(model.parameters())
    steps = itertools.count()

    def step() -> float:
        torch.manual_seed(next(steps))   # the k-th step of every eager variant draws the same masks
        opt.zero_grad(set_to_none=True)
        loss = lm_loss(model(x), y)
        loss.backward()
        opt.step()
        return loss.item()

    return System(step, list(model.parameters()), policy)


def build(args, x, y) -> Dict[str, System]:
    model = _common.gpt(args, dropout=args.dropout)
    systems = {}
    for name, mode in graphpar_modes(args).items():
        progress(f"compiling {name}")
        systems[name] = graphpar_system(copy.deepcopy(model), mode, x, y)
    for name in (EAGER, CKPT, SAC):
        systems[name] = eager_system(copy.deepcopy(model), name, x, y)
    return systems


# ---- measuring ---------------------------------------------------------------------------------

def timed_rounds(args, systems: Dict[str, System]) -> Dict[str, List[float]]:
    """Step times per variant, warmup rounds dropped (the timer also takes in recording the
    loss, a float appended to a list, the same for every variant)."""
    names = list(systems)
    times = {name: [] for name in names}
    progress(f"{args.warmup} warmup + {args.rounds} timed rounds of {len(names)} variants")
    for round_ in range(args.warmup + args.rounds):
        shift = round_ % len(names)
        for name in names[shift:] + names[:shift]:
            start = time.perf_counter()
            systems[name].run()
            times[name].append(time.perf_counter() - start)
    return {name: t[args.warmup:] for name, t in times.items()}


def saved_bytes(system: System) -> int:
    """The peak bytes one step keeps for backward (see the module docstring)."""
    saved = _memory.SavedBytes(exclude=system.parameters)
    if system.policy is not None:
        system.policy.report = saved.keep
    try:
        with saved.counting():
            system.run()
    finally:
        if system.policy is not None:
            system.policy.report = None
    return saved.peak


def memory(systems: Dict[str, System]) -> Dict[str, dict]:
    out = {}
    for name, system in systems.items():
        progress(f"bytes of {name} (one step counting saves, two under the dispatcher count)")
        saved = saved_bytes(system)
        at_start, peak, _ = _memory.step_peak(system.run)
        out[name] = {"saved": saved, "at_start": at_start, "peak": peak}
    return out


def plans(args, x, y) -> Dict[str, object]:
    """gp.plan's report per graphpar variant."""
    return {name: gp.plan(_common.gpt(args, dropout=args.dropout), gp.Strategy(recompute=mode), example_inputs=(x,),
                          example_target=y, loss_fn=lm_loss, optimizer=optimizer_factory())
            for name, mode in graphpar_modes(args).items()}


# ---- report ------------------------------------------------------------------------------------

def _ms(t: float) -> str:
    return f"{t * 1e3:.1f}"


def _mib(n: float) -> str:
    return f"{n / MiB:.2f}"


def loss_gap(systems: Dict[str, System], name: str) -> float:
    """Largest difference to its baseline's loss at the same step (the same work: 0 expected)."""
    return max(abs(a - b) for a, b in zip(systems[name].losses, systems[baseline(name)].losses))


def time_table(args, times: Dict[str, List[float]], systems: Dict[str, System]) -> List[str]:
    lines = ["| variant | median step (ms) | min (ms) | IQR (ms) | per-round ratio to eager | "
             "per-round ratio to graphpar none | largest loss gap to its baseline |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for name, t in times.items():
        lines.append(f"| {name} | {_ms(statistics.median(t))} | {_ms(min(t))} | {_ms(_common.iqr(t))} | "
                     f"{_common.median_ratio(t, times[EAGER]):.3f} | {_common.median_ratio(t, times[GP_NONE]):.3f} | "
                     f"{loss_gap(systems, name):.1e} |")
    return lines


def comparisons(args):
    """(variant, peer, target on the per-round step-time ratio or None)."""
    return ((GP_FULL, GP_NONE, FULL_TIME_TARGET), (budget_name(args), GP_NONE, None), (GP_SEL, GP_NONE, None),
            (GP_NONE, EAGER, None), (GP_FULL, CKPT, None), (GP_SEL, SAC, None))


def ratio_table(args, times: Dict[str, List[float]]) -> List[str]:
    lines = ["| comparison | per-round ratio (median) | ratio of fastest steps | target | met |",
             "|---|---:|---:|---|---|"]
    for variant, peer, target in comparisons(args):
        ratio = _common.median_ratio(times[variant], times[peer])
        fastest = min(times[variant]) / min(times[peer])
        goal, met = ("-", "-") if target is None else (f"<= {target:.2f}", "yes" if ratio <= target else "no")
        lines.append(f"| {variant} / {peer} | {ratio:.3f} | {fastest:.3f} | {goal} | {met} |")
    return lines


def memory_table(bytes_of: Dict[str, dict], plan_of: Dict[str, object]) -> List[str]:
    lines = ["| variant | saved for backward, peak (MiB) | ratio to its baseline | gp.plan activations (MiB) | "
             "measured / planned | gp.plan recompute (GFLOP per step) | peak in a step (MiB) | "
             "at step start (MiB) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, m in bytes_of.items():
        ratio = m["saved"] / bytes_of[baseline(name)]["saved"]
        if name in plan_of:
            rank = plan_of[name].ranks[0]
            planned = (f"{_mib(rank.activation_peak_bytes)} | {m['saved'] / rank.activation_peak_bytes:.3f} | "
                       f"{rank.recompute_flops / 1e9:.2f}")
        else:
            planned = "- | - | -"
        lines.append(f"| {name} | {_mib(m['saved'])} | {ratio:.3f} | {planned} | {_mib(m['peak'])} | "
                     f"{_mib(m['at_start'])} |")
    return lines


def targets_table(args, bytes_of: Dict[str, dict], plan_of: Dict[str, object]) -> List[str]:
    saved = {name: m["saved"] for name, m in bytes_of.items()}
    rows = [(f"{GP_FULL} / {GP_NONE}", saved[GP_FULL] / saved[GP_NONE], FULL_SAVED_TARGET),
            (f"{budget_name(args)} / {GP_NONE}", saved[budget_name(args)] / saved[GP_NONE], args.budget),
            (f"{GP_FULL} / {CKPT}", saved[GP_FULL] / saved[CKPT], None),
            (f"{GP_SEL} / {SAC}", saved[GP_SEL] / saved[SAC], None)]
    lines = ["| saved bytes | ratio | target | met |", "|---|---:|---|---|"]
    for what, ratio, target in rows:
        goal, met = ("-", "-") if target is None else (f"<= {target:.2f}", "yes" if ratio <= target else "no")
        lines.append(f"| {what} | {ratio:.3f} | {goal} | {met} |")
    for name, report in plan_of.items():
        ratio = saved[name] / report.ranks[0].activation_peak_bytes
        met = "yes" if abs(ratio - 1) <= PLAN_TOLERANCE else "no"
        lines.append(f"| {name}: measured / gp.plan | {ratio:.3f} | within {PLAN_TOLERANCE:.0%} | {met} |")
    return lines


def report(args, model_params: int, times, systems, bytes_of, plan_of, load_before: str, load_after: str) -> str:
    notes = [note for rep in plan_of.values() for note in rep.notes if note.startswith("recompute=")]
    lines = [
        "## Activation recomputation: graphpar vs torch.utils.checkpoint (world 1)",
        "",
        f"GPT {args.layers} layers, n_embd {args.embd}, {args.heads} heads, vocab {args.vocab}, seq {args.seq}, "
        f"batch {args.batch}, dropout {args.dropout:g} ({model_params / 1e6:.2f} M parameters, tied embedding and "
        f"head), AdamW; {args.threads} torch thread(s); {args.warmup} warmup + {args.rounds} timed rounds, each "
        "one step of every variant in a rotating order. Loss gaps: graphpar variants to graphpar none, eager ones "
        "to eager (each its own dropout masks).",
        "",
        *time_table(args, times, systems),
        "",
        *ratio_table(args, times),
        "",
        "### Bytes kept for backward",
        "",
        "Saved for backward: the peak of what autograd saves (saved_tensors_hooks, each storage once while saved, "
        "parameters excluded), for eager + SAC plus the op outputs its cache keeps (benchmarks/_memory.py, "
        "SavedBytes). Ratio to its baseline: to graphpar none or to eager. Peak in a step and at its start: all "
        "tensor bytes alive, counted at the dispatcher (_memory.step_peak).",
        "",
        *memory_table(bytes_of, plan_of),
        "",
        *targets_table(args, bytes_of, plan_of),
        "",
        "What gp.plan says it chose:",
        "",
        *[f"- {note}" for note in notes],
        "",
        f"Machine: {_common.machine()}. Load average (1/5/15 min) before / after: {load_before} / {load_after}.",
        "",
        f"Reproduce: `{_common.command('bench_recompute.py')}`",
    ]
    return "\n".join(lines)


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    load_before = _common.load_average()
    x, y = _common.token_batch(args, seed=0)
    progress("gp.plan of the graphpar variants")
    plan_of = plans(args, x, y)
    systems = build(args, x, y)
    times = timed_rounds(args, systems)
    bytes_of = memory(systems)
    model_params = num_parameters(_common.gpt(args))
    print(report(args, model_params, times, systems, bytes_of, plan_of, load_before, _common.load_average()))


if __name__ == "__main__":
    main()
