"""Plan a large run before paying for it: per-rank memory and communication from gp.plan.

What it shows
    ``gp.plan`` runs graphpar's pass pipeline for a strategy and a world size without any
    process group, and without allocating the model: here a GPT with n_embd 2048 and 24
    layers (~1.3B parameters) is built on PyTorch's meta device, which has shapes but no
    storage, and planned for 64 ranks as dp=4 x tp=4 x pp=4 with 8 microbatches. The report
    lists, for every rank, the bytes of parameters, gradients, AdamW states and saved
    activations, and every collective and point-to-point transfer of one train_step, plus
    the pipeline bubble. It is printed with ``report.to_text()`` (``to_json()`` and
    ``to_html(path)`` give the same in other forms).

What it checks
    The report covers all 64 ranks; ranks that differ only in their dp or tp coordinate
    have the same plan; tensor and pipeline parallelism shrink every rank's parameters to
    well under the full model's; AdamW's states are twice the gradients plus a 4-byte step
    per parameter tensor; the bubble is strictly between 0 and 1; and nothing was allocated
    (the model stays on meta). Exits 1 otherwise.

How to run
    python examples/plan_before_running.py            # 1.3B-parameter GPT on 64 ranks
    python examples/plan_before_running.py --small    # a 4-layer, n_embd 256 GPT on 8 ranks (CI)
    python examples/plan_before_running.py --dp 8 --tp 8 --pp 2 --microbatches 16
"""
from __future__ import annotations

import argparse
import functools
import sys
import time

import torch

import graphpar as gp
from graphpar.models.gpt import GPT, GPTConfig, lm_loss


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--small", action="store_true", help="a small GPT on 8 ranks (CI)")
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--n-embd", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=50304)
    parser.add_argument("--dp", type=int, default=4)
    parser.add_argument("--tp", type=int, default=4)
    parser.add_argument("--pp", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--local-batch", type=int, default=8, help="samples per dp rank per step")
    parser.add_argument("--html", default=None, help="also write the report as HTML to this path")
    args = parser.parse_args(argv)
    if args.small:
        args.layers, args.n_embd, args.heads, args.seq_len, args.vocab = 4, 256, 8, 128, 4096
        args.dp, args.tp, args.pp, args.microbatches, args.local_batch = 2, 2, 2, 4, 8

    config = GPTConfig(vocab_size=args.vocab, block_size=args.seq_len, n_layer=args.layers, n_head=args.heads,
                       n_embd=args.n_embd)
    with torch.device("meta"):          # shapes only: no memory is allocated for the weights
        model = GPT(config)
    n_params = sum(p.numel() for p in model.parameters())
    n_tensors = len(list(model.parameters()))
    x = torch.randint(0, config.vocab_size, (args.local_batch, args.seq_len))   # one dp rank's batch
    strategy = gp.Strategy(dp=args.dp, tp=args.tp, pp=args.pp, microbatches=args.microbatches)
    world = strategy.world_size
    print(f"GPT: {args.layers} layers, n_embd {args.n_embd}, {n_params / 1e6:,.1f}M parameters "
          f"({n_params * 4 / 2**20:,.0f} MiB in float32); planning for {world} ranks\n")

    start = time.perf_counter()
    report = gp.plan(model, strategy, example_inputs=(x,), example_target=x, loss_fn=lm_loss,
                     optimizer=functools.partial(torch.optim.AdamW, lr=1e-4), world_size=world)
    elapsed = time.perf_counter() - start
    print(report.to_text())
    print(f"\nplanned in {elapsed:.1f} s, without a process group or the model's memory")
    if args.html:
        print("wrote", report.to_html(args.html))

    failures = []

    def check(condition, message):
        print(("ok   " if condition else "FAIL ") + message)
        if not condition:
            failures.append(message)

    full_bytes = n_params * 4
    check(len(report.ranks) == world, f"the report covers all {world} ranks")
    check(all(p.is_meta for p in model.parameters()), "the model is still on the meta device")
    for r in report.ranks:
        twin = report.ranks[r.pp_rank * args.dp * args.tp]   # dp rank 0, tp rank 0 of its pp stage
        same = (r.param_bytes, r.grad_bytes, r.optimizer_bytes, r.activation_peak_bytes) == \
               (twin.param_bytes, twin.grad_bytes, twin.optimizer_bytes, twin.activation_peak_bytes)
        if not same:
            check(False, f"rank {r.rank} has the same plan as rank {twin.rank} (same pp rank)")
            break
    else:
        check(True, "ranks with the same pp rank have the same plan")
    biggest = max(r.param_bytes for r in report.ranks)
    check(biggest < full_bytes / args.tp,
          f"the largest rank holds {biggest / 2**20:.0f} MiB of parameters, under 1/tp of the full model "
          f"({full_bytes / args.tp / 2**20:.0f} MiB)")
    # beyond exp_avg and exp_avg_sq (twice the gradients), AdamW keeps a 4-byte step per tensor
    steps = [r.optimizer_bytes - 2 * r.grad_bytes for r in report.ranks]
    check(all(s % 4 == 0 and 0 < s // 4 <= n_tensors for s in steps),
          "AdamW's states are twice the gradients (exp_avg, exp_avg_sq) plus a 4-byte step per parameter tensor")
    check(0 < report.bubble_fraction < 1, f"pipeline bubble {report.bubble_fraction:.1%} is in (0, 1)")
    check(all(r.activation_peak_bytes > 0 for r in report.ranks), "every rank saves activations")
    axes = {t.axis for t in report.ranks[0].collectives}
    check({"dp", "tp", "pp"} <= axes, f"rank 0 communicates along dp, tp and pp ({sorted(axes)})")
    if failures:
        print(f"FAIL: {len(failures)} check(s) failed")
        return 1
    print("PASS")
    return 0


if __name__ == "__main__":
    sys.exit(main())
