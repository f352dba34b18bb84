"""Compile time of graphpar.compile for GPTs of growing depth, with both front ends.

    .venv/bin/python benchmarks/bench_compile.py [--out FILE]

Times `graphpar.compile` (trace, the pass pipeline, building the executor) for the GPT from
graphpar.models.gpt with 12, 24 and 48 layers (n_embd 128, 4 heads, seq 64, batch 4, loss
included), median of 3 runs per size and front end, and prints a markdown table. Compile
work is per graph node, so time should grow linearly with depth: ratios to the 12-layer
time of ~2 and ~4. Target: under 2 s for 12 layers.

Results are printed; --out writes the same markdown to a file, which must lie outside the
repository (results are machine-specific and do not belong in it).
"""
from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from typing import Dict, List

import torch

import _common
import graphpar
from graphpar.models.gpt import GPT, GPTConfig, lm_loss

COMMAND = _common.command("bench_compile.py", [])
LAYERS = (12, 24, 48)
FRONT_ENDS = ("fx", "export")
RUNS = 3
TARGET_S = 2.0        # for 12 layers, either front end
N_EMBD, N_HEAD, SEQ, BATCH, VOCAB = 128, 4, 64, 4, 256


def build(layers: int):
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=VOCAB, block_size=SEQ, n_layer=layers, n_head=N_HEAD, n_embd=N_EMBD))
    x = torch.randint(0, VOCAB, (BATCH, SEQ))
    return model, x, torch.roll(x, -1, dims=1)


def compile_seconds(model, x, y, tracer: str) -> float:
    gc.collect()  # the previous compile's garbage is not this one's cost
    start = time.perf_counter()
    graphpar.compile(model, graphpar.Strategy(), example_inputs=(x,), example_target=y,
                     loss_fn=lm_loss, tracer=tracer)
    return time.perf_counter() - start


def warm_up() -> None:
    """One small compile per front end first: lazy imports and torch.export's one-time set-up
    are paid once per process, not per model, and would otherwise land in the first size."""
    model, x, y = build(1)
    for tracer in FRONT_ENDS:
        compile_seconds(model, x, y, tracer)


def measure() -> Dict[str, Dict[int, List[float]]]:
    times: Dict[str, Dict[int, List[float]]] = {tracer: {} for tracer in FRONT_ENDS}
    for layers in LAYERS:
        model, x, y = build(layers)
        for tracer in FRONT_ENDS:
            times[tracer][layers] = [compile_seconds(model, x, y, tracer) for _ in range(RUNS)]
            print(f"  {tracer:6s} {layers:2d} layers: "
                  f"{', '.join(f'{t:.2f}' for t in times[tracer][layers])} s", file=sys.stderr)
    return times


def render(times: Dict[str, Dict[int, List[float]]]) -> str:
    lines = ["# graphpar compile time", "",
             f"GPT, n_embd {N_EMBD}, {N_HEAD} heads, seq {SEQ}, batch {BATCH}, loss included; "
             f"median of {RUNS} runs after a warm-up compile.", "",
             f"machine: {_common.machine()}", f"command: `{COMMAND}`", "",
             "| front end | layers | median (s) | per layer (ms) | ratio to 12 layers | runs (s) |",
             "|---|---:|---:|---:|---:|---|"]
    for tracer, by_layers in times.items():
        base = statistics.median(by_layers[LAYERS[0]])
        for layers, runs in by_layers.items():
            median = statistics.median(runs)
            lines.append(f"| {tracer} | {layers} | {median:.2f} | {1000 * median / layers:.1f} | "
                         f"{median / base:.2f} | {', '.join(f'{t:.2f}' for t in runs)} |")
    lines.append("")
    for tracer, by_layers in times.items():
        median = statistics.median(by_layers[LAYERS[0]])
        verdict = "met" if median < TARGET_S else "MISSED"
        lines.append(f"target {tracer}: {LAYERS[0]} layers under {TARGET_S:g} s: {verdict} ({median:.2f} s)")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    _common.add_out_option(parser, example="/tmp/bench_compile.md")
    args = parser.parse_args()
    print(f"timing graphpar.compile, {RUNS} runs per size and front end...", file=sys.stderr)
    warm_up()
    _common.emit(render(measure()), args.out)


if __name__ == "__main__":
    main()
