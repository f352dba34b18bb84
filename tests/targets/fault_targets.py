"""Fault injection for tests/multiprocess/distributed/test_faults.py: a tiny GPT that trains normally until a
FaultInjector, a leaf module after its last block, is armed; then, on one rank, inside the
pipeline stage's forward, it raises, kills its own process or stalls forever.

Runs under graphpar.launch (train_with_fault) and under torchrun (tests/targets/fault_scripts/).
"""
import os
import signal
import time

import torch
import torch.distributed as dist

import graphpar as gp
from tests.helpers import adamw, lm_loss, tiny_gpt, token_batch

HOW = ("raise", "kill", "stall")
WHERE = ("forward", "before_step")
STALL_S = 3600   # "forever": far beyond any test's hard limit


class InjectedFault(RuntimeError):
    pass


_armed = {}   # set by arm(): how; empty while compiling and in the steps before the fault


class FaultInjector(torch.nn.Module):
    """Identity until armed. A leaf module (the tracer keeps it opaque), so this Python
    forward runs inside the compiled stage program on every microbatch."""

    def forward(self, x):
        if _armed:
            inject(_armed["how"], "in a pipeline stage's forward")
        return x


def inject(how, where):
    """Note the wall-clock time of the fault for the test, then raise, die or stall."""
    rank = dist.get_rank()
    stamp_dir = os.environ.get("GRAPHPAR_FAULT_STAMPS")
    if stamp_dir:
        with open(os.path.join(stamp_dir, f"rank{rank}"), "w") as f:
            f.write(repr(time.time()))
    if how == "raise":
        raise InjectedFault(f"injected fault on rank {rank} {where}")
    if how == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(STALL_S)


def faulty_gpt():
    model = tiny_gpt()
    model.blocks.append(FaultInjector())   # runs after the last block: in the last pipeline stage
    return model


def train_with_fault(how, where, pp, dp, fault_rank=1, fault_step=2, steps=4):
    """Train a tiny GPT at pp x dp; at `fault_step`, `fault_rank` misbehaves (`how`) inside
    its stage's forward or just before the step. Returns the losses if nothing failed."""
    assert how in HOW and where in WHERE, (how, where)
    rank = dist.get_rank()
    x, y = token_batch(batch=8)
    local = 8 // dp
    dp_rank = rank % dp
    xs, ys = x[dp_rank * local:(dp_rank + 1) * local], y[dp_rank * local:(dp_rank + 1) * local]
    # pp=2: stage 1 (ranks dp..2dp-1) begins at the last block and holds the injector
    strategy = gp.Strategy(dp=dp, pp=pp, microbatches=2, partition=["blocks.1"] if pp > 1 else "parameters")
    pm = gp.compile(faulty_gpt(), strategy, example_inputs=(xs,), example_target=ys, loss_fn=lm_loss,
                    optimizer=adamw(), leaf_modules=[FaultInjector])
    losses = []
    for step in range(steps):
        if step == fault_step and rank == fault_rank:
            if where == "before_step":
                inject(how, "before its train step")
            _armed["how"] = how
        losses.append(pm.train_step(xs, target=ys))
    return losses
