"""What a split backward costs: one pipeline stage's step, backward whole or split (B and W).

    .venv/bin/python benchmarks/bench_split_backward.py [--rounds 15 --layers 8 ...]

One process, 1 thread. The stage programs are graphpar's own for the pipeline benchmark's
GPT (bench_pipeline_parallel.py: 8 layers, n_embd 256, 4 heads, vocab 256, seq 128, untied
head; pp=2, microbatches of 2 sequences), lowered without processes (gp.lower_rank) twice:
under `1f1b` (the calls as traced) and under `zero-bubble` (passes/split_backward.py has
turned the linear layers and embeddings into graphpar.runtime.split_backward's calls). For
each stage, each round runs every variant once, in an order rotated from round to round,
each over --microbatches microbatches (gradients reset first, as train_step does):

    whole           forward, backward                                     (1F1B's work)
    split           forward, backward (B), backward_weight (W) at once    (ZB-H1's rank 0)
    split, W late   as split, each W after the next microbatch's B         (ZB-H1's rank 1)

Stage 0 (embedding and the first half of the blocks) gets a fixed random gradient for its
output; stage 1 (the rest, the LM head and the loss) its real loss. Times are CPU time of
this thread (time.thread_time: what the work costs, not what other processes on the
machine cost it in wall time), per step (all microbatches) and per kind of work; reported:
the medians over rounds after the first, and each variant's total over the whole one's,
median over rounds of the per-round ratio. Nothing is written to disk.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import statistics
import time
from typing import Callable, Dict, List

import torch

import _common
import graphpar as gp
from graphpar.models.gpt import lm_loss
from graphpar.runtime.split_backward import WeightGradients

VARIANTS = ("whole", "split", "split, W late")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    _common.add_model_options(parser, layers=8, embd=256, heads=4, vocab=256, seq=128, batch=2,
                              batch_help="sequences per microbatch")
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=15, help="timed rounds (one more runs first, untimed)")
    return parser.parse_args(argv)


def stage_programs(args, model, x, y, schedule: str) -> Dict[int, object]:
    strategy = gp.Strategy(pp=2, microbatches=1, schedule=schedule)
    return {rank: gp.lower_rank(model, strategy, (x,), rank=rank, world_size=2, loss_fn=lm_loss,
                                example_target=y).compiled.stages[rank] for rank in (0, 1)}


class StageStep:
    """One stage's work over the microbatches, timed per kind: forward, backward, weight."""

    def __init__(self, program, inputs: List[object], output_grad):
        self.program, self.inputs, self.output_grad = program, inputs, output_grad

    def _forward(self, queue, mb):
        with queue.collecting(0, mb) if queue is not None else contextlib.nullcontext():
            return self.program.gm(*self.inputs)

    def _backward(self, outputs):
        if self.program.is_last:
            outputs[0].backward()
        else:
            torch.autograd.backward(list(outputs), [self.output_grad])

    def run(self, variant: str, microbatches: int) -> Dict[str, float]:
        for p in self.program.gm.parameters():
            p.grad = None
        queue = WeightGradients() if variant != "whole" else None
        spent = {"forward": 0.0, "backward": 0.0, "weight": 0.0}
        late: List[int] = []
        for mb in range(microbatches):
            outputs = _timed(spent, "forward", functools.partial(self._forward, queue, mb))
            _timed(spent, "backward", functools.partial(self._backward, outputs))
            if queue is None:
                continue
            late.append(mb)
            if len(late) > (variant == "split, W late"):
                _timed(spent, "weight", functools.partial(queue.run, 0, late.pop(0)))
        for mb in late:
            _timed(spent, "weight", functools.partial(queue.run, 0, mb))
        return spent


def _timed(spent: Dict[str, float], kind: str, work: Callable):
    start = time.thread_time()
    result = work()
    spent[kind] += time.thread_time() - start
    return result


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)
    model = _common.gpt(args, tie_weights=False)
    x, y = _common.token_batch(args, seed=0)
    whole, split = stage_programs(args, model, x, y, "1f1b"), stage_programs(args, model, x, y, "zero-bubble")
    with torch.no_grad():
        sent = whole[0].gm(x)[0]
    received = sent.detach().requires_grad_()
    grad = torch.randn(sent.shape, generator=torch.Generator().manual_seed(1))
    steps = {}
    for stage in (0, 1):
        inputs = [x] if stage == 0 else [y, received]
        for variant in VARIANTS:
            program = whole[stage] if variant == "whole" else split[stage]
            steps[(stage, variant)] = StageStep(program, inputs, grad)
    spent: Dict[tuple, List[Dict[str, float]]] = {key: [] for key in steps}
    for round_ in range(args.rounds + 1):
        shift = round_ % len(VARIANTS)
        for stage in (0, 1):
            for variant in VARIANTS[shift:] + VARIANTS[:shift]:
                result = steps[(stage, variant)].run(variant, args.microbatches)
                if round_:
                    spent[(stage, variant)].append(result)
    print(report(args, spent))


def report(args, spent) -> str:
    lines = [f"CPU time per step of one stage ({args.microbatches} microbatches of {args.batch} x {args.seq} tokens), "
             f"median over {args.rounds} rounds, ms:", "",
             "| stage | backward | forward | B (input gradients) | W (weight gradients) | total | / whole |",
             "|---:|---|---:|---:|---:|---:|---:|"]
    for (stage, variant), rounds in spent.items():
        totals = [sum(r.values()) for r in rounds]
        whole = [sum(r.values()) for r in spent[(stage, "whole")]]
        cells = [statistics.median(r[kind] for r in rounds) * 1000 for kind in ("forward", "backward", "weight")]
        ratio = statistics.median(t / w for t, w in zip(totals, whole))
        weight = f"{cells[2]:.1f}" if variant != "whole" else "(in B)"
        lines.append(f"| {stage} | {variant} | {cells[0]:.1f} | {cells[1]:.1f} | {weight} | "
                     f"{statistics.median(totals) * 1000:.1f} | {ratio:.3f} |")
    lines += ["", f"Machine: {_common.machine()}", "", f"Reproduce: `{_common.command('bench_split_backward.py')}`"]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
