"""ZeRO at dp=2: graphpar's Strategy(zero=1|3) against torch's ZeroRedundancyOptimizer and
FSDP2, and against plain data parallelism; step time and bytes per rank.

    .venv/bin/python benchmarks/bench_zero.py [--warmup 2] [--rounds 12] [--quick]

One graphpar.launch starts 2 gloo ranks (1 thread each). Each rank builds the same GPT
(_common.gpt: same seed, so the same initial weights) once per variant and trains the
copies side by side on its own fixed batch, all with AdamW(lr=1e-3), all over the same
process group (graphpar's dp group, which is the world here):

    graphpar dp          gp.compile(Strategy(dp=2))
    DDP                  DistributedDataParallel(gradient_as_bucket_view=True)
    graphpar zero=1      gp.compile(Strategy(dp=2, zero=1))
    ZeroRedundancyOptimizer   DDP as above + ZeroRedundancyOptimizer(AdamW): each rank
                         keeps the AdamW state of its share of the parameters
    graphpar zero=3      gp.compile(Strategy(dp=2, zero=3))
    FSDP2                torch.distributed.fsdp.fully_shard on every transformer block,
                         then on the root, over a DeviceMesh of the same group

graphpar's and DDP's gradient buckets are --bucket-mb. A graphpar variant whose
Strategy(zero=k) this build refuses (at construction, or at compile on every rank) is
reported as not available, with graphpar's message, and the others run.

Time: a timed round runs one step of each variant, rotating which goes first; every step
starts after a barrier, so a step's time is the slower rank's. Warmup rounds are dropped.
Ratios are medians over rounds of the per-round ratio (the variants of a round share the
machine's load at that moment); the ratio of the fastest steps is shown beside it. Every
torch step all-reduces its loss, as graphpar's train_step does to return the global mean.

Memory, per rank, after the timed rounds, one variant at a time:
    peak         the largest number of tensor bytes alive during one step, counted at the
                 dispatcher by _memory.step_peak (method and blind spots in
                 benchmarks/_memory.py): the same measurement for every variant
    at start     tensor bytes alive when that step began (what the previous one kept)
    resident     after the step, the distinct storages behind the parameters, gradients
                 and optimizer states the system holds (pm.parameters() and their .grad,
                 pm.optimizer's param_groups and state; for FSDP2 the local shards of its
                 DTensors; for ZeroRedundancyOptimizer the state of its local optimizer)
For the graphpar variants, gp.plan's per-rank bytes are shown beside the measured ones.
Nothing is written to disk.
"""
from __future__ import annotations

import argparse
import copy
import functools
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Tuple

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

import _common
import _memory
import graphpar as gp
from graphpar.models.gpt import lm_loss, num_parameters

GP_DP, DDP, GP_Z1, ZRO, GP_Z3, FSDP = ("graphpar dp", "DDP", "graphpar zero=1", "ZeroRedundancyOptimizer",
                                       "graphpar zero=3", "FSDP2")
VARIANTS = (GP_DP, DDP, GP_Z1, ZRO, GP_Z3, FSDP)
GRAPHPAR_ZERO = {GP_DP: 0, GP_Z1: 1, GP_Z3: 3}
# (variant, peer, target on the per-round ratio or None)
COMPARISONS = ((GP_DP, DDP, None), (GP_Z1, ZRO, None), (GP_Z1, GP_DP, 1.05), (GP_Z3, FSDP, 1.0))
QUICK = {"warmup": 1, "rounds": 5}
MiB = 2**20


def progress(message: str) -> None:
    """A line on stderr (rank 0 only under launch): where a run of a few minutes is."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"bench_zero: {message}", file=sys.stderr, flush=True)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world", type=int, default=2, help="dp ranks (default 2)")
    _common.add_model_options(parser, layers=4, embd=256, heads=4, vocab=256, seq=128, batch=8,
                              batch_help="samples per rank")
    parser.add_argument("--bucket-mb", type=float, default=4.0,
                        help="gradient bucket size of graphpar and DDP (MiB)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=12, help="timed rounds")
    parser.add_argument("--quick", action="store_true",
                        help=f"the short run (1-2 minutes): --warmup {QUICK['warmup']} --rounds {QUICK['rounds']}")
    args = parser.parse_args(argv)
    if args.quick:
        args.warmup, args.rounds = QUICK["warmup"], QUICK["rounds"]
    return args


def optimizer_factory():
    return functools.partial(torch.optim.AdamW, lr=1e-3)


def refusals(world: int) -> Dict[str, str]:
    """Why this build refuses Strategy(zero=k), per graphpar variant ('' when it accepts)."""
    out = {}
    for name, k in GRAPHPAR_ZERO.items():
        try:
            gp.Strategy(dp=world, zero=k) if k else gp.Strategy(dp=world)
            out[name] = ""
        except Exception as e:  # a TypeError (no such field) or a ValueError (not that stage yet)
            out[name] = f"Strategy(zero={k}) refused: {type(e).__name__}: {e}"
    return out


# ---- the systems, per rank ---------------------------------------------------------------------

@dataclass
class System:
    step: Callable[[], float]
    # after a step: (parameters, gradients, optimizer states) the system holds on this rank
    held: Callable[[], Tuple[List[torch.Tensor], List[torch.Tensor], List[torch.Tensor]]]
    group: object = None   # graphpar's dp group, which the torch variants share


@dataclass
class Unavailable:
    reason: str


def optimizer_state(opt: torch.optim.Optimizer) -> List[torch.Tensor]:
    return [v for state in opt.state.values() for v in state.values() if isinstance(v, torch.Tensor)]


def params_and_grads(params) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
    params = list(params)
    return params, [p.grad for p in params if p.grad is not None]


def graphpar_system(model, args, k: int, x, y) -> System:
    strategy = gp.Strategy(dp=args.world, zero=k) if k else gp.Strategy(dp=args.world)
    pm = gp.compile(model, strategy, example_inputs=(x,), example_target=y, loss_fn=lm_loss,
                    optimizer=optimizer_factory(), bucket_bytes=int(args.bucket_mb * MiB))

    def held():
        group_params = [p for g in pm.optimizer.param_groups for p in g["params"]]
        params, grads = params_and_grads([*pm.parameters(), *group_params])
        return params, grads, optimizer_state(pm.optimizer)

    return System(lambda: pm.train_step(x, target=y), held, pm.mesh.group("dp"))


def ddp_system(model, args, group, x, y, zero: bool) -> System:
    ddp = DistributedDataParallel(model, process_group=group, bucket_cap_mb=args.bucket_mb,
                                  gradient_as_bucket_view=True)
    if zero:
        opt = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.AdamW, process_group=group,
                                      lr=1e-3)
        local = opt.optim
    else:
        opt = local = optimizer_factory()(ddp.parameters())

    def held():
        return (*params_and_grads(ddp.parameters()), optimizer_state(local))

    return System(lambda: _common.eager_train_step(ddp, opt, x, y, group, args.world), held)


def fsdp_system(model, args, group, x, y) -> System:
    mesh = DeviceMesh.from_group(group, "cpu")
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = optimizer_factory()(model.parameters())

    def held():
        return (*params_and_grads(model.parameters()), optimizer_state(opt))

    return System(lambda: _common.eager_train_step(model, opt, x, y, group, args.world), held)


def build(name: str, model, args, group, x, y):
    if name in GRAPHPAR_ZERO:
        return graphpar_system(model, args, GRAPHPAR_ZERO[name], x, y)
    if name == FSDP:
        return fsdp_system(model, args, group, x, y)
    return ddp_system(model, args, group, x, y, zero=name == ZRO)


def agreed(outcome):
    """The same outcome on every rank: unavailable everywhere if any rank could not build or
    step the variant (a refusal is the same on every rank; this keeps them in step)."""
    reasons = [None] * dist.get_world_size()
    dist.all_gather_object(reasons, outcome.reason if isinstance(outcome, Unavailable) else None)
    failed = {why for why in reasons if why}
    if len(failed) == 1 and None not in reasons:
        return Unavailable(failed.pop())
    if failed:
        return Unavailable("; ".join(f"rank {r}: {why or 'ok'}" for r, why in enumerate(reasons)))
    return outcome


def first_step(name: str, system: System):
    """The first step of a graphpar zero variant, where a build that accepts the strategy but
    cannot run it yet would fail; other variants run it unguarded."""
    if GRAPHPAR_ZERO.get(name, 0) == 0:
        return system.step()
    try:
        return system.step()
    except Exception as e:
        return Unavailable(f"train_step failed: {type(e).__name__}: {e}")


def rank_main(args: argparse.Namespace, refused: Dict[str, str]) -> dict:
    torch.set_num_threads(1)   # two ranks on two cores: more threads only contend with gloo
    model = _common.gpt(args)
    x, y = _common.token_batch(args, seed=dist.get_rank())   # each rank its own batch
    systems: Dict[str, object] = {}
    group = None   # graphpar dp's group, built first; then every variant uses it
    for name in VARIANTS:
        progress(f"building {name}")
        if refused.get(name):
            systems[name] = Unavailable(refused[name])
            continue
        try:
            outcome = build(name, copy.deepcopy(model), args, group, x, y)
        except Exception as e:
            if name not in GRAPHPAR_ZERO:
                raise
            outcome = Unavailable(f"Strategy(zero={GRAPHPAR_ZERO[name]}) refused at compile: "
                                  f"{type(e).__name__}: {e}")
        systems[name] = agreed(outcome)
        group = group or systems[GP_DP].group
    losses: Dict[str, List[float]] = {n: [] for n, s in systems.items() if isinstance(s, System)}
    for name in list(losses):
        dist.barrier(group)
        result = agreed(first_step(name, systems[name]))
        if isinstance(result, Unavailable):
            systems[name] = result
            del losses[name]
        else:
            losses[name].append(result)
    running = [n for n in VARIANTS if n in losses]
    times = {name: [] for name in running}
    progress(f"{args.warmup} warmup + {args.rounds} timed rounds of {', '.join(running)}")
    for round_ in range(args.warmup + args.rounds):
        shift = round_ % len(running)
        for name in running[shift:] + running[:shift]:
            dist.barrier(group)
            start = time.perf_counter()
            losses[name].append(systems[name].step())
            times[name].append(time.perf_counter() - start)
    memory = {}
    for name in running:
        progress(f"bytes of {name} (two steps under the dispatcher count)")
        dist.barrier(group)
        at_start, peak, threads = _memory.step_peak(systems[name].step)
        memory[name] = {"at_start": at_start, "peak": peak, "threads": threads, **resident(systems[name])}
    return {"times": {k: v[args.warmup:] for k, v in times.items()}, "losses": losses, "memory": memory,
            "unavailable": {n: s.reason for n, s in systems.items() if isinstance(s, Unavailable)},
            "params": num_parameters(model)}


def resident(system: System) -> Dict[str, int]:
    params, grads, states = system.held()
    return {"params": _memory.distinct_bytes(params), "grads": _memory.distinct_bytes(grads),
            "optimizer": _memory.distinct_bytes(states),
            "resident": _memory.distinct_bytes([*params, *grads, *states])}


# ---- the plan ----------------------------------------------------------------------------------

def plans(args, refused: Dict[str, str]) -> Dict[str, object]:
    """gp.plan's report per graphpar variant this build accepts, or why there is none."""
    x, y = _common.token_batch(args, seed=0)
    out = {}
    for name, k in GRAPHPAR_ZERO.items():
        if refused[name]:
            continue
        strategy = gp.Strategy(dp=args.world, zero=k) if k else gp.Strategy(dp=args.world)
        try:
            out[name] = gp.plan(_common.gpt(args), strategy, example_inputs=(x,), example_target=y,
                                loss_fn=lm_loss, optimizer=optimizer_factory(), world_size=args.world,
                                bucket_bytes=int(args.bucket_mb * MiB))
        except Exception as e:
            out[name] = f"gp.plan failed: {type(e).__name__}: {e}"
    return out


# ---- report ------------------------------------------------------------------------------------

def summarize(results: List[dict]) -> dict:
    running = list(results[0]["times"])
    step = {n: _common.slowest_rank(r["times"][n] for r in results) for n in running}
    ratio, fastest = {}, {}
    for variant, peer, _ in COMPARISONS:
        if variant in step and peer in step:
            ratio[variant, peer] = _common.median_ratio(step[variant], step[peer])
            fastest[variant, peer] = min(step[variant]) / min(step[peer])
    losses = results[0]["losses"]
    gap = {n: max(abs(a - b) for a, b in zip(losses[n], losses[DDP])) for n in running}
    return {"running": running, "median": {k: statistics.median(v) for k, v in step.items()},
            "min": {k: min(v) for k, v in step.items()}, "iqr": {k: _common.iqr(v) for k, v in step.items()},
            "ratio": ratio, "fastest": fastest, "loss_gap": gap}


def _ms(t: float) -> str:
    return f"{t * 1e3:.1f}"


def _mib(n: int) -> str:
    return f"{n / MiB:.2f}"


def _per_rank(results: List[dict], name: str, key: str) -> str:
    return " / ".join(_mib(r["memory"][name][key]) for r in results)


def time_table(s: dict) -> List[str]:
    lines = ["| variant | median step (ms) | min (ms) | IQR (ms) | largest loss gap to DDP |",
             "|---|---:|---:|---:|---:|"]
    for name in VARIANTS:
        if name in s["median"]:
            lines.append(f"| {name} | {_ms(s['median'][name])} | {_ms(s['min'][name])} | {_ms(s['iqr'][name])} | "
                         f"{s['loss_gap'][name]:.1e} |")
        else:
            lines.append(f"| {name} | n/a | n/a | n/a | n/a |")
    return lines


def ratio_table(s: dict) -> List[str]:
    lines = ["| comparison | per-round ratio (median) | ratio of fastest steps | target | met |",
             "|---|---:|---:|---|---|"]
    for variant, peer, target in COMPARISONS:
        goal = "-" if target is None else (f"<= {target:.2f}" if target <= 1 else f"within {target - 1:.0%}")
        if (variant, peer) in s["ratio"]:
            r = s["ratio"][variant, peer]
            met = "-" if target is None else ("yes" if r <= target else "no")
            lines.append(f"| {variant} / {peer} | {r:.3f} | {s['fastest'][variant, peer]:.3f} | {goal} | {met} |")
        else:
            lines.append(f"| {variant} / {peer} | n/a | n/a | {goal} | not run |")
    return lines


def memory_table(results: List[dict], running: List[str]) -> List[str]:
    lines = ["| variant | peak in a step (MiB) | at step start (MiB) | params (MiB) | grads (MiB) | "
             "optimizer states (MiB) | params + grads + states (MiB) |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for name in running:
        cells = [_per_rank(results, name, key) for key in ("peak", "at_start", "params", "grads", "optimizer",
                                                            "resident")]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    threads = {name: ", ".join(results[0]["memory"][name]["threads"]) for name in running}
    return lines + ["", "Threads whose ops were counted (rank 0): "
                    + "; ".join(f"{name}: {names}" for name, names in threads.items())]


def plan_table(results: List[dict], plan_of: Dict[str, object]) -> List[str]:
    lines = ["| variant | rank | params measured / planned | grads measured / planned | "
             "optimizer measured / planned | planned activations | planned total | measured peak |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    notes = []
    for name, rep in plan_of.items():
        if isinstance(rep, str):
            notes.append(f"- {name}: {rep}")
            continue
        for r, result in enumerate(results):
            m, p = result["memory"].get(name), rep.ranks[r]
            if m is None:
                continue
            lines.append(f"| {name} | {r} | {m['params']:,} / {p.param_bytes:,} | {m['grads']:,} / {p.grad_bytes:,} | "
                         f"{m['optimizer']:,} / {p.optimizer_bytes:,} | {p.activation_peak_bytes:,} | "
                         f"{p.total_bytes:,} | {m['peak']:,} |")
    return lines + ([""] + notes if notes else [])


def report(args, results: List[dict], plan_of: Dict[str, object], unavailable: Dict[str, str],
           load_before: str, load_after: str) -> str:
    s = summarize(results)
    r0 = results[0]
    lines = [
        f"## ZeRO: graphpar vs ZeroRedundancyOptimizer and FSDP2 (dp={args.world})",
        "",
        f"GPT {args.layers} layers, n_embd {args.embd}, {args.heads} heads, vocab {args.vocab}, seq {args.seq}, "
        f"batch {args.batch} per rank ({r0['params'] / 1e6:.2f} M parameters, tied embedding and head), AdamW; "
        f"gradient buckets of {args.bucket_mb:g} MiB for graphpar and DDP; {args.warmup} warmup + {args.rounds} "
        f"timed rounds; times are the slower rank's.",
        "",
        *time_table(s),
        "",
        *ratio_table(s),
        "",
    ]
    if unavailable:
        lines += ["Not run:", ""]
        lines += [f"- {name}: not available in this build ({why})" for name, why in unavailable.items()]
        lines.append("")
    lines += [
        "### Bytes per rank (rank 0 / rank 1)",
        "",
        "Peak and step start: tensor bytes alive during the step, counted at the dispatcher "
        "(benchmarks/_memory.py; not gloo's own buffers, kernel scratch or malloc overhead). The last four "
        "columns: distinct storages of the parameters, gradients and optimizer states each system holds "
        "after the step.",
        "",
        *memory_table(results, s["running"]),
        "",
        "### graphpar: measured against gp.plan (bytes)",
        "",
        *plan_table(results, plan_of),
        "",
        *_common.reproduce_lines("1 thread per rank", load_before, load_after, "bench_zero.py"),
    ]
    return "\n".join(lines)


def main(argv=None) -> None:
    args = parse_args(argv)
    refused = refusals(args.world)
    progress("gp.plan of the graphpar variants")
    plan_of = plans(args, refused)
    results, load_before, load_after = _common.launch(rank_main, world_size=args.world, args=(args, refused))
    unavailable = results[0]["unavailable"]
    print(report(args, results, plan_of, unavailable, load_before, load_after))


if __name__ == "__main__":
    main()
