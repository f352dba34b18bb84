"""Planning time of graphpar.plan for GPTs of growing depth on the meta device.

    .venv/bin/python benchmarks/bench_planning.py [--out FILE]

Times `graphpar.plan` (the pass pipeline once, for tp rank 0, up to partition_stages; the
fake-tensor run that measures saved activations; the per-rank memory and transfers) for
the GPT from graphpar.models.gpt built on the meta device (`with torch.device("meta")`: no
weights are allocated) with 6, 12, 24 and 48 layers (n_embd 1024, 16 heads, seq 512, vocab
32000, loss included, AdamW), strategy dp=2 tp=4 pp=2 with 4 microbatches (1F1B) on a world
of 16 ranks, each dp rank planning a batch of 8 sequences (2 per microbatch). Median of 3
runs per size, after one untimed warm-up plan (lazy imports and one-time set-up are paid
once per process, not per model). The model is built once per size; graphpar.plan does not
modify it.

The work is per graph node (one analysis per pipeline stage serves every dp and tp rank),
so time should grow linearly with depth: a fixed part (embeddings, LM head, loss, the
schedule) plus a constant cost per layer. The table shows seconds, milliseconds per layer,
the ratio to the smallest model and the cost each added layer brings (the slope between
neighbouring sizes); the verdict compares the growth exponent log(t_max / t_min) /
log(L_max / L_min) (1 for proportional growth, below 1 with a fixed part, 2 for quadratic)
and the slope between the two largest sizes against the slope over the whole range:
sublinear when the exponent is below 0.8 (e.g. a planner that analyses identical layers
once), linear when it is at most 1.15 and the last slope at most 1.5x the overall one,
superlinear otherwise. CPU
time of the process (time.process_time) is measured beside wall time and judged the same
way: on a shared machine wall time mostly measures the neighbours, CPU time the planner.

A second table times the 12-layer model on growing worlds (tp=4 x pp=4 and dp up to 1024:
16, 1,024 and 16,384 ranks): ranks of one role share one plan, so the time should barely
grow with the world (the target is under 5 s for 16,384 ranks). Beside each plan it times
Report.to_text(), to_json() and to_html(), whose size does grow with the world.

Results are printed; --out writes the same markdown to a file, which must lie outside the
repository (results are machine-specific and do not belong in it).
"""
from __future__ import annotations

import argparse
import functools
import gc
import math
import statistics
import sys
import tempfile
import time
from typing import Dict, List

import torch

import _common
import graphpar
from graphpar.models.gpt import GPT, GPTConfig, lm_loss

LAYERS = (6, 12, 24, 48)
RUNS = 3
N_EMBD, N_HEAD, SEQ, VOCAB = 1024, 16, 512, 32000
DP, TP, PP, MICROBATCHES, WORLD = 2, 4, 2, 4, 16
BATCH = 8                   # per dp rank: what one rank's train_step sees, split into microbatches
MAX_EXPONENT = 1.15         # growth exponent above which the growth is called superlinear
MAX_SLOPE_RATIO = 1.5       # last slope / overall slope above which it is called superlinear
MIN_EXPONENT = 0.8          # below this, time grows clearly less than depth: called sublinear
WORLD_LAYERS = 12           # the model of the world-size table
WORLDS = (16, 1024, 16384)  # dp = world / (TP * PP)
WORLD_TARGET_S = 5.0        # planning 16,384 ranks should take less than this


def strategy(dp: int = DP) -> graphpar.Strategy:
    return graphpar.Strategy(dp=dp, tp=TP, pp=PP, microbatches=MICROBATCHES)


def build(layers: int):
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=VOCAB, block_size=SEQ, n_layer=layers, n_head=N_HEAD, n_embd=N_EMBD))
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    return model, x, torch.roll(x, -1, dims=1)


def plan_seconds(model, x, y, world: int = WORLD):
    """(wall seconds, CPU seconds of this process, the report) of one graphpar.plan."""
    gc.collect()  # the previous plan's garbage is not this one's cost
    cpu, start = time.process_time(), time.perf_counter()
    report = graphpar.plan(model, strategy(world // (TP * PP)), example_inputs=(x,), example_target=y,
                           loss_fn=lm_loss, optimizer=functools.partial(torch.optim.AdamW, lr=1e-3), world_size=world)
    return time.perf_counter() - start, time.process_time() - cpu, report


def seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure_worlds(worlds, runs: int) -> List[str]:
    """Rows of the world-size table: plan time (wall and CPU medians) and report output times."""
    model, x, y = build(WORLD_LAYERS)
    rows = []
    for world in worlds:
        timed = [plan_seconds(model, x, y, world) for _ in range(runs)]
        report = timed[-1][2]
        text_s = seconds(report.to_text)
        json_s = seconds(report.to_json)
        with tempfile.TemporaryDirectory() as tmp:
            html_s = seconds(functools.partial(report.to_html, f"{tmp}/plan.html"))
        wall, cpu = statistics.median(t[0] for t in timed), statistics.median(t[1] for t in timed)
        rows.append(f"| {world:,} | {world // (TP * PP)} {TP} {PP} | {wall:.2f} | {cpu:.2f} | "
                    f"{', '.join(f'{t[0]:.2f}' for t in timed)} | {text_s:.3f} | {json_s:.2f} | "
                    f"{len(report.to_json()) / 2**20:.1f} | {html_s:.3f} |")
        print(f"  world {world}: {wall:.2f} s (CPU {cpu:.2f} s)", file=sys.stderr)
    verdict = "met" if wall < WORLD_TARGET_S else "MISSED"  # of the largest world, the last one
    return rows + ["", f"target: {world:,} ranks planned in under {WORLD_TARGET_S:g} s: **{verdict}** ({wall:.2f} s)"]


def render_worlds(lines: List[str], runs: int) -> str:
    return "\n".join(["## planning time vs world size", "",
                      f"the {WORLD_LAYERS}-layer model above, tp={TP} pp={PP}, dp = world / {TP * PP}; median of "
                      f"{runs} runs; the report's outputs timed once on the last plan.", "",
                      "| world | dp tp pp | median (s) | CPU median (s) | runs (s) | to_text (s) | to_json (s) | "
                      "to_json (MiB) | to_html (s) |",
                      "|---:|---|---:|---:|---|---:|---:|---:|---:|", *lines])


def warm_up() -> None:
    """One small plan first, so that lazy imports land in no size's time."""
    plan_seconds(*build(2))


def measure(layers_list, runs: int):
    times: Dict[int, List[float]] = {}
    cpu_times: Dict[int, List[float]] = {}
    per_rank_mib: Dict[int, float] = {}
    for layers in layers_list:
        model, x, y = build(layers)
        times[layers], cpu_times[layers] = [], []
        for _ in range(runs):
            seconds, cpu, report = plan_seconds(model, x, y)
            times[layers].append(seconds)
            cpu_times[layers].append(cpu)
        # the plan's own answer, as a check that the work planned really grows with depth
        per_rank_mib[layers] = max(r.total_bytes for r in report.ranks) / 2**20
        print(f"  {layers:2d} layers: {', '.join(f'{t:.2f}' for t in times[layers])} s "
              f"(CPU {', '.join(f'{t:.2f}' for t in cpu_times[layers])} s)", file=sys.stderr)
    return times, cpu_times, per_rank_mib


def growth(medians: Dict[int, float], what: str) -> str:
    sizes = sorted(medians)
    if len(sizes) < 2:
        return f"growth ({what}): one size only, nothing to compare"
    lo, hi = sizes[0], sizes[-1]
    exponent = math.log(medians[hi] / medians[lo]) / math.log(hi / lo)
    overall = (medians[hi] - medians[lo]) / (hi - lo)
    last = (medians[hi] - medians[sizes[-2]]) / (hi - sizes[-2])
    slope_ratio = last / overall if overall > 0 else None
    if exponent < MIN_EXPONENT:  # grows clearly less than depth: nothing to fear from the last slope
        verdict = "sublinear"
    elif exponent <= MAX_EXPONENT and (slope_ratio is None or slope_ratio <= MAX_SLOPE_RATIO):
        verdict = "linear"
    else:
        verdict = "SUPERLINEAR"
    ratio_text = "n/a" if slope_ratio is None else f"{slope_ratio:.2f}x"
    return (f"growth ({what}): **{verdict}** (exponent {exponent:.2f} from {lo} to {hi} layers: 1 is proportional, "
            f"below 1 a fixed part, 2 quadratic; added cost per layer {1000 * last:.1f} ms between the two "
            f"largest sizes vs {1000 * overall:.1f} ms over the whole range, {ratio_text}; sublinear "
            f"(better than linear) when the exponent is below {MIN_EXPONENT:g}, else linear when it is at most "
            f"{MAX_EXPONENT:g} and that ratio at most {MAX_SLOPE_RATIO:g})")


def render(times: Dict[int, List[float]], cpu_times: Dict[int, List[float]], per_rank_mib: Dict[int, float],
           runs: int, command: str) -> str:
    medians = {layers: statistics.median(t) for layers, t in times.items()}
    cpu = {layers: statistics.median(t) for layers, t in cpu_times.items()}
    sizes = sorted(medians)
    base, cpu_base = medians[sizes[0]], cpu[sizes[0]]
    lines = ["# graphpar planning time", "",
             f"graphpar.plan of a GPT on the meta device, n_embd {N_EMBD}, {N_HEAD} heads, seq {SEQ}, vocab {VOCAB}, "
             f"loss included, AdamW; dp={DP} tp={TP} pp={PP}, {MICROBATCHES} microbatches, world size {WORLD}, "
             f"batch {BATCH} per dp rank; median of {runs} runs after a warm-up plan.", "",
             f"machine: {_common.machine()}", f"command: `{command}`", "",
             f"| layers | median (s) | per layer (ms) | ratio to {sizes[0]} layers | layer ratio | "
             "added per layer (ms) | CPU median (s) | CPU ratio | runs (s) | planned peak per rank (MiB) |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|"]
    previous = None
    for layers in sizes:
        median = medians[layers]
        added = "" if previous is None else f"{1000 * (median - medians[previous]) / (layers - previous):.1f}"
        lines.append(f"| {layers} | {median:.2f} | {1000 * median / layers:.1f} | {median / base:.2f} | "
                     f"{layers / sizes[0]:g} | {added} | {cpu[layers]:.2f} | {cpu[layers] / cpu_base:.2f} | "
                     f"{', '.join(f'{t:.2f}' for t in times[layers])} | "
                     f"{per_rank_mib[layers]:.0f} |")
        previous = layers
    lines += ["", growth(medians, "wall time"), "", growth(cpu, "CPU time"), "",
              "CPU time is this process's (time.process_time), which other work on the machine barely "
              "changes: on a loaded machine trust its verdict over the wall-time one."]
    return "\n".join(lines)


def positive_ints(text: str) -> List[int]:
    """Sorted distinct values of a comma-separated list (layer counts, world sizes)."""
    try:
        values = sorted({int(v) for v in text.split(",") if v.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: comma-separated positive integers, e.g. 6,12,24,48")
    if not values or values[0] < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: the values must be positive")
    return values


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    _common.add_out_option(parser, example="/tmp/bench_planning.md")
    parser.add_argument("--layers", type=positive_ints, default=list(LAYERS),
                        help="comma-separated layer counts (default %s)" % ",".join(map(str, LAYERS)))
    parser.add_argument("--runs", type=int, default=RUNS, help=f"runs per size, the median is reported (default {RUNS})")
    parser.add_argument("--worlds", type=positive_ints, default=list(WORLDS),
                        help="comma-separated world sizes, multiples of %d (default %s)"
                             % (TP * PP, ",".join(map(str, WORLDS))))
    args = parser.parse_args()
    if args.runs < 1:
        parser.error("--runs must be at least 1")
    if any(world % (TP * PP) for world in args.worlds):
        parser.error(f"--worlds {args.worlds}: every world size must be a multiple of tp * pp = {TP * PP}")
    print(f"timing graphpar.plan, {args.runs} runs per size...", file=sys.stderr)
    warm_up()
    times, cpu_times, per_rank_mib = measure(args.layers, args.runs)
    worlds = measure_worlds(args.worlds, args.runs)
    command = _common.command("bench_planning.py")
    _common.emit(render(times, cpu_times, per_rank_mib, args.runs, command) + "\n\n" + render_worlds(worlds, args.runs),
                 args.out)


if __name__ == "__main__":
    main()
