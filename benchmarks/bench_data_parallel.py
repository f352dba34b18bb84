"""dp=2 training step time: graphpar against torch DistributedDataParallel.

    .venv/bin/python benchmarks/bench_data_parallel.py [--steps 20 --layers 4 ...]

One graphpar.launch starts 2 gloo ranks. Each rank builds the same GPT (same seed, so the
same initial weights) three times and trains the copies side by side on its own fixed
batch, with AdamW on each:

    graphpar          gp.compile(Strategy(dp=2)): buckets all-reduced during backward
    graphpar, no overlap   the same, but every bucket is all-reduced after backward
    DDP               DistributedDataParallel over the *same* process group (graphpar's
                      dp group), with the same bucket size

A timed round runs one step of each variant, rotating which goes first so that none
always follows the same neighbour; every step starts after a barrier, so the time of a
step is the time both ranks spend in it (the slower rank's). Warmup rounds are discarded
(DDP re-buckets after its first step). The headline ratio is the median over rounds of
(graphpar step / DDP step) in the same round: the variants of one round share whatever
else the machine is doing then, so pairing cancels most of a noisy neighbour; the ratio
of the fastest steps is shown beside it. The DDP step also all-reduces the loss, as
graphpar's train_step does to return the global mean loss.

How much all-reduce is hidden behind backward (graphpar), two estimates:

    by wait     1 - median(time in grad_sync.finish(), overlapped)
                  / median(time in grad_sync.finish(), no overlap)
                With no overlap, finish() launches every bucket's all-reduce after
                backward and waits for it: the whole all-reduce time, exposed. With
                overlap, finish() only waits for what backward did not already cover.
    by step     median over rounds of (step no overlap - step overlapped)
                / median finish() time with no overlap
                Also counts what overlapping costs: on a CPU, gloo's threads take cores
                from backward, so this is the share that really came off the step.

The no-overlap variant is made by replacing its GradientSync's arm() with a no-op, and
finish() is wrapped with a timer; both touch graphpar internals, only in this script.
Nothing is written to disk.
"""
from __future__ import annotations

import argparse
import copy
import functools
import statistics
import time
from typing import Callable, Dict, List

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import _common
import graphpar as gp
from graphpar.models.gpt import lm_loss, num_parameters

GP, GP_SYNC, DDP = "graphpar", "graphpar, no overlap", "DDP"
VARIANTS = (GP, GP_SYNC, DDP)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world", type=int, default=2, help="dp ranks (default 2)")
    _common.add_model_options(parser, layers=4, embd=256, heads=4, vocab=256, seq=128, batch=8,
                              batch_help="samples per rank")
    parser.add_argument("--bucket-mb", type=float, default=4.0,
                        help="all-reduce bucket size for both graphpar and DDP (MiB)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30, help="timed rounds")
    return parser.parse_args(argv)


# ---- per rank ----------------------------------------------------------------------------

def rank_main(args: argparse.Namespace) -> dict:
    # Two ranks on two cores: more threads would only contend with the peer and gloo.
    torch.set_num_threads(1)
    rank = dist.get_rank()
    model = _common.gpt(args)
    x, y = _common.token_batch(args, seed=rank)  # each rank its own data, as in real data parallelism
    optimizer = functools.partial(torch.optim.AdamW, lr=1e-3)
    bucket_bytes = int(args.bucket_mb * 2**20)
    compile_gp = functools.partial(gp.compile, strategy=gp.Strategy(dp=args.world), example_inputs=(x,),
                                   example_target=y, loss_fn=lm_loss, optimizer=optimizer,
                                   bucket_bytes=bucket_bytes)
    pm = compile_gp(copy.deepcopy(model))
    pm_sync = compile_gp(copy.deepcopy(model))
    pm_sync._executor.grad_sync.arm = lambda: None  # hooks stay idle; finish() reduces all
    finish_times = {GP: _time_finish(pm), GP_SYNC: _time_finish(pm_sync)}
    group = pm.mesh.group("dp")
    ddp = DistributedDataParallel(copy.deepcopy(model), process_group=group, bucket_cap_mb=args.bucket_mb)
    ddp_opt = optimizer(ddp.parameters())

    steps: Dict[str, Callable[[], float]] = {
        GP: lambda: pm.train_step(x, target=y),
        GP_SYNC: lambda: pm_sync.train_step(x, target=y),
        DDP: lambda: _common.eager_train_step(ddp, ddp_opt, x, y, group, args.world),
    }
    times = {name: [] for name in VARIANTS}
    losses = {name: [] for name in VARIANTS}
    for round_ in range(args.warmup + args.steps):
        shift = round_ % len(VARIANTS)
        for name in VARIANTS[shift:] + VARIANTS[:shift]:
            dist.barrier(group)
            start = time.perf_counter()
            loss = steps[name]()
            times[name].append(time.perf_counter() - start)
            losses[name].append(loss)
    keep = slice(args.warmup, None)
    return {"times": {k: v[keep] for k, v in times.items()},
            "finish": {k: v[keep] for k, v in finish_times.items()},
            "losses": losses, "buckets": len(pm._executor.grad_sync.buckets),
            "ddp_buckets": _ddp_bucket_count(ddp), "params": num_parameters(model)}


def _time_finish(pm) -> List[float]:
    sync = pm._executor.grad_sync
    original, log = sync.finish, []

    def finish():
        start = time.perf_counter()
        original()
        log.append(time.perf_counter() - start)

    sync.finish = finish
    return log


def _ddp_bucket_count(ddp) -> int:
    # DDP starts with one bucket and re-buckets by gradient order after the first step (the
    # warmup); private API, and the count is informational only.
    try:
        return len(ddp.reducer._get_zeros_like_grad_buckets())
    except Exception:
        return -1


# ---- report ------------------------------------------------------------------------------

def _slowest_rank(results: List[dict], key: str, name: str) -> List[float]:
    return _common.slowest_rank(r[key][name] for r in results)


def summarize(results: List[dict]) -> dict:
    step = {name: _slowest_rank(results, "times", name) for name in VARIANTS}
    finish = {name: statistics.median(_slowest_rank(results, "finish", name)) for name in (GP, GP_SYNC)}
    # Paired within a round: the three variants of one round share the machine's load at
    # that moment, so per-round ratios and differences cancel most of a noisy neighbour.
    ratio = {name: _common.median_ratio(step[name], step[DDP]) for name in VARIANTS}
    saved = statistics.median(s - o for s, o in zip(step[GP_SYNC], step[GP]))
    loss_gap = max(abs(a - b) for a, b in zip(results[0]["losses"][GP], results[0]["losses"][DDP]))
    return {"median": {k: statistics.median(v) for k, v in step.items()},
            "min": {k: min(v) for k, v in step.items()},
            "iqr": {k: _common.iqr(v) for k, v in step.items()},
            "ratio": ratio, "finish": finish, "loss_gap": loss_gap,
            "hidden_by_wait": 1 - finish[GP] / finish[GP_SYNC],
            "hidden_by_step": saved / finish[GP_SYNC]}


def report(args, results: List[dict], s: dict, load_before: str, load_after: str) -> str:
    r0 = results[0]
    ms = lambda t: f"{t * 1e3:.1f}"  # noqa: E731
    lines = [
        f"## Data parallelism: graphpar vs DDP (dp={args.world})",
        "",
        f"GPT {args.layers} layers, n_embd {args.embd}, {args.heads} heads, vocab {args.vocab}, "
        f"seq {args.seq}, batch {args.batch} per rank ({r0['params'] / 1e6:.2f} M parameters), "
        f"AdamW; buckets of {args.bucket_mb:g} MiB (graphpar {r0['buckets']}, DDP {r0['ddp_buckets']}); "
        f"{args.warmup} warmup + {args.steps} timed rounds; times are the slower rank's.",
        "",
        "| variant | median step (ms) | min (ms) | IQR (ms) | per-round ratio to DDP (median) |",
        "|---|---:|---:|---:|---:|",
    ]
    for name in VARIANTS:
        lines.append(f"| {name} | {ms(s['median'][name])} | {ms(s['min'][name])} | "
                     f"{ms(s['iqr'][name])} | {s['ratio'][name]:.3f} |")
    lines += [
        "",
        f"- graphpar / DDP step time: **{s['ratio'][GP]:.3f}** (median of per-round ratios); "
        f"{s['min'][GP] / s['min'][DDP]:.3f} from the fastest steps (target: within 2%)",
        f"- graphpar all-reduce time, exposed after backward (no overlap): {ms(s['finish'][GP_SYNC])} ms; "
        f"left to wait for with overlap: {ms(s['finish'][GP])} ms (medians)",
        f"- share of all-reduce hidden behind backward: {s['hidden_by_wait']:.0%} by wait, "
        f"{s['hidden_by_step']:.0%} by step time (method in the module docstring)",
        f"- largest |loss(graphpar) - loss(DDP)| over all steps (same weights, data, optimizer): "
        f"{s['loss_gap']:.2e}",
        "",
        *_common.reproduce_lines("1 thread per rank", load_before, load_after, "bench_data_parallel.py"),
    ]
    return "\n".join(lines)


def main(argv=None) -> None:
    args = parse_args(argv)
    results, load_before, load_after = _common.launch(rank_main, world_size=args.world, args=(args,))
    print(report(args, results, summarize(results), load_before, load_after))


if __name__ == "__main__":
    main()
