"""Train a small GPT from scratch with data x tensor x pipeline parallelism.

What it shows
    The GPT of graphpar.models.gpt (an ordinary nn.Module that knows nothing about
    graphpar) compiled with ``gp.Strategy(dp=2, tp=2, pp=2)`` and trained on 8 local
    processes started by ``gp.launch``, on byte-level windows of the text bundled with
    graphpar (the opening chapters of *Alice's Adventures in Wonderland*). Every rank
    passes its own DP slice of the global batch to ``pm.train_step``, which returns the
    global mean loss, the same on every rank.

What it checks
    A fresh copy of the model, from the same initial weights, is trained eagerly on one
    device with the same optimizer on the same batches. The per-step losses and the final
    parameters (``pm.full_state_dict()``) must agree within float32 noise; the script
    exits 1 if they do not.

How to run
    python examples/gpt_from_scratch.py              # 8 processes: dp=2 x tp=2 x pp=2, 20 steps
    python examples/gpt_from_scratch.py --small      # 4 processes: tp=2 x pp=2, 3 steps (CI)
    python examples/gpt_from_scratch.py --dp 1 --tp 2 --pp 4 --steps 10
"""
from __future__ import annotations

import argparse
import copy
import functools
import pathlib
import sys

import torch

import graphpar as gp
from graphpar.models.gpt import GPT, GPTConfig, lm_loss

CORPUS = pathlib.Path(gp.__file__).with_name("assets") / "corpus.txt"

# Parity tolerances (see graphpar/tools/demo.py for the reasoning): the compiled program runs the
# same float32 operations as eager PyTorch, in a slightly different order (microbatches,
# sharded matmuls), so losses agree to ~1e-6 and parameters drift by a small fraction of
# the learning rate per step. A real bug (a missing gradient sync, a dropped microbatch, a
# wrong shard) moves the loss by 1e-2 or more within a few steps.
LOSS_TOL = 1e-4
PARAM_TOL_PER_LR_STEP = 0.02


def make_model(args) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=256, block_size=args.seq_len, n_layer=args.layers, n_head=4,
                         n_embd=args.n_embd))


def global_batches(args):
    """The same seeded sequence of (input, target) global batches in every process."""
    corpus = torch.frombuffer(bytearray(CORPUS.read_bytes()), dtype=torch.uint8).long()
    g = torch.Generator().manual_seed(1)
    offsets = torch.arange(args.seq_len + 1)
    batches = []
    for _ in range(args.steps):
        starts = torch.randint(0, corpus.numel() - args.seq_len - 1, (args.batch, 1), generator=g)
        windows = corpus[starts + offsets]
        batches.append((windows[:, :-1], windows[:, 1:]))
    return batches


def optimizer(args):
    return functools.partial(torch.optim.AdamW, lr=args.lr)


def train_rank(args):
    """Runs in every process (gp.launch starts them with torch.distributed initialised)."""
    strategy = gp.Strategy(dp=args.dp, tp=args.tp, pp=args.pp, microbatches=args.microbatches)
    batches = global_batches(args)
    local = args.batch // args.dp
    x, y = batches[0]
    pm = gp.compile(make_model(args), strategy, example_inputs=(x[:local],), example_target=y[:local],
                    loss_fn=lm_loss, optimizer=optimizer(args))
    mesh = pm.mesh
    losses = []
    for step, (x, y) in enumerate(batches):
        # this DP rank's rows of the global batch; tp and pp ranks of one slice read the same rows
        xs, ys = x.chunk(mesh.dp, 0)[mesh.dp_rank], y.chunk(mesh.dp, 0)[mesh.dp_rank]
        losses.append(pm.train_step(xs, target=ys))
        if mesh.rank == 0:
            print(f"step {step:3d}  loss {losses[-1]:.5f}", flush=True)
    state = pm.full_state_dict()   # collective: every rank calls it
    local_params = sum(p.numel() for p in pm.parameters())
    return {"losses": losses, "state": state if mesh.rank == 0 else None,
            "coords": (mesh.dp_rank, mesh.tp_rank, mesh.pp_rank), "local_params": local_params}


def train_eager(args):
    model = copy.deepcopy(make_model(args)).train()
    opt = optimizer(args)(model.parameters())
    losses = []
    for x, y in global_batches(args):
        opt.zero_grad()
        loss = lm_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, model.state_dict()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--small", action="store_true", help="4 processes (tp2 x pp2), 3 steps: a CI run")
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--microbatches", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8, help="global batch (all dp ranks together)")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-3)
    args = parser.parse_args(argv)
    if args.small:
        args.dp, args.tp, args.pp, args.steps, args.seq_len, args.layers = 1, 2, 2, 3, 32, 2
    world = args.dp * args.tp * args.pp

    print(f"training GPT ({args.layers} layers, n_embd {args.n_embd}) on {world} processes: "
          f"dp={args.dp} tp={args.tp} pp={args.pp}, microbatches={args.microbatches}")
    results = gp.launch(train_rank, world_size=world, args=(args,))
    for rank, r in enumerate(results):
        print(f"  rank {rank}: (dp, tp, pp) = {r['coords']}, {r['local_params']:,} local parameters")

    print("training the same model eagerly on one device ...")
    ref_losses, ref_state = train_eager(args)
    print("\n| step | graphpar | single device | diff |\n|---:|---:|---:|---:|")
    for step, (a, b) in enumerate(zip(results[0]["losses"], ref_losses)):
        print(f"| {step} | {a:.6f} | {b:.6f} | {abs(a - b):.1e} |")

    failures = []
    for rank, r in enumerate(results):
        if r["losses"] != results[0]["losses"]:
            failures.append(f"rank {rank} reports different losses than rank 0")
    diffs = [abs(a - b) for a, b in zip(results[0]["losses"], ref_losses)]
    if max(diffs) > LOSS_TOL:
        failures.append(f"losses differ from single-device training by up to {max(diffs):.2e} > {LOSS_TOL}")
    param_tol = PARAM_TOL_PER_LR_STEP * args.lr * args.steps
    state = results[0]["state"]
    worst = max((state[k] - v).abs().max().item() for k, v in ref_state.items())
    print(f"\nlargest parameter difference after {args.steps} steps: {worst:.2e} (tolerance {param_tol:.1e})")
    if worst > param_tol:
        failures.append(f"parameters differ from single-device training by {worst:.2e} > {param_tol:.1e}")
    if failures:
        print("FAIL: " + "; ".join(failures))
        return 1
    print("PASS: graphpar matches single-device training")
    return 0


if __name__ == "__main__":
    sys.exit(main())
