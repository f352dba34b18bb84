"""A graphpar training script for torchrun, single- or multi-node.

What it shows
    The same script runs under ``torchrun`` (one or many machines), under
    ``graphpar.launch`` and as plain ``python``. ``graphpar.distributed.launch.run_in_process_group``
    joins the process group that torchrun describes in the environment (``RANK``,
    ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``: gloo on CPU, nccl on GPUs), or just
    calls the function when those are not set. Then every rank calls ``gp.compile`` with
    ``gp.Strategy(tp=world_size)`` (tp=2 in the two-node run) and trains a small GPT.
    torchrun's own rendezvous connects the machines; graphpar only uses the default group.

    ``examples/torchrun_two_nodes.sh`` starts a two-"node" run on this machine: two
    torchrun launches, ``--nnodes 2 --nproc-per-node 1 --node-rank 0`` and ``1``, meeting at
    ``--master-addr 127.0.0.1``. On two real machines run the same command on each, with
    the first machine's address as ``--master-addr``::

        torchrun --nnodes 2 --nproc-per-node 1 --node-rank 0 --master-addr HOST0 --master-port 29500 \\
            examples/torchrun_two_nodes.py        # on HOST0
        torchrun --nnodes 2 --nproc-per-node 1 --node-rank 1 --master-addr HOST0 --master-port 29500 \\
            examples/torchrun_two_nodes.py        # on HOST1

What it checks
    Every rank trains the same model eagerly on one device too (it is small) and compares:
    the losses of ``pm.train_step`` and the final parameters must match. A rank exits 1 on
    a mismatch, which makes torchrun, and the .sh script, fail.

How to run
    bash examples/torchrun_two_nodes.sh              # two local "nodes", tp=2, 10 steps
    bash examples/torchrun_two_nodes.sh --small      # 3 steps (CI)
    python examples/torchrun_two_nodes.py --small    # one process, tp=1
"""
from __future__ import annotations

import argparse
import copy
import functools
import os
import socket
import sys

import torch
import torch.distributed as dist

import graphpar as gp
from graphpar.distributed.launch import run_in_process_group
from graphpar.models.gpt import GPT, GPTConfig, lm_loss

OPTIMIZER = functools.partial(torch.optim.AdamW, lr=1e-3)
LOSS_TOL, PARAM_TOL_PER_STEP = 1e-4, 2e-5   # see graphpar/tools/demo.py: 2% of lr per AdamW step


def make_model() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=64, block_size=32, n_layer=2, n_head=4, n_embd=64))


def batches(steps: int):
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, 64, (4, 32), generator=g), torch.randint(0, 64, (4, 32), generator=g))
            for _ in range(steps)]


def train(steps: int) -> int:
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    node = os.environ.get("GROUP_RANK", "0")     # torchrun's node rank
    print(f"[rank {rank}/{world}] node {node} on {socket.gethostname()}, "
          f"backend {dist.get_backend() if dist.is_initialized() else 'none'}", flush=True)

    data = batches(steps)
    x, y = data[0]
    pm = gp.compile(make_model(), gp.Strategy(tp=world), example_inputs=(x,), example_target=y,
                    loss_fn=lm_loss, optimizer=OPTIMIZER)
    losses = []
    for step, (x, y) in enumerate(data):
        losses.append(pm.train_step(x, target=y))
        if rank == 0:
            print(f"step {step}  loss {losses[-1]:.5f}", flush=True)
    state = pm.full_state_dict()

    # The single-device reference, on every rank: the same weights, batches and optimizer.
    model = copy.deepcopy(make_model())
    opt = OPTIMIZER(model.parameters())
    expected = []
    for x, y in data:
        opt.zero_grad()
        loss = lm_loss(model(x), y)
        loss.backward()
        opt.step()
        expected.append(loss.item())
    loss_diff = max(abs(a - b) for a, b in zip(losses, expected))
    param_diff = max((state[k] - v).abs().max().item() for k, v in model.state_dict().items())
    ok = loss_diff <= LOSS_TOL and param_diff <= PARAM_TOL_PER_STEP * steps
    local = sum(p.numel() for p in pm.parameters())
    print(f"[rank {rank}] tp rank {pm.mesh.tp_rank} holds {local:,} of "
          f"{sum(p.numel() for p in model.parameters()):,} parameters; vs single device: "
          f"loss diff {loss_diff:.1e}, parameter diff {param_diff:.1e} -> {'PASS' if ok else 'FAIL'}",
          flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0 if ok else 1


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--small", action="store_true", help="3 steps (CI)")
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args(argv)
    steps = 3 if args.small else args.steps
    # Joins torchrun's process group when RANK/WORLD_SIZE are set; otherwise one process.
    return run_in_process_group(train, steps)


if __name__ == "__main__":
    sys.exit(main())
