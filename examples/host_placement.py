"""Host placement: the optimizer and an embedding table in host memory, bf16 weights on the device.

What it shows
    A GPT with an untied token embedding, compiled on 2 local processes with

        gp.Strategy(dp=2, offload_optimizer=True, param_dtype=torch.bfloat16,
                    offload_embedding=["wte"])

    * The AdamW update, the fp32 master weights and the optimizer states live on the host
      (ZeRO-Offload's split); the device keeps bf16 weights and fp32 gradients (accumulated
      and reduced over dp in fp32, Strategy.reduce_dtype's default): about 2 + 4 bytes per
      parameter instead of 18. Each gradient bucket moves to the host and takes its step
      while backward is still running.
    * The token table lives on the host, its rows split over the 2 ranks (parameter-server
      style, over all-to-all): a step moves only the rows its batch looks up.
    * The plan (``pm.report()``) says all of this before training, and the update program
      (``pm.dump(dir)``, file ``*update*.py``) shows the transfers as graph nodes.

What it checks
    The same model trained on one device the same way (bf16 copy of the model for forward and
    backward with fp32 gradients, fp32 master weights for the step; row-wise SGD on the table
    equals dense SGD): losses and final master weights must match within bf16 rounding. The
    plan's device bytes per parameter must be 2 (weights) + 4 (gradients) + 0 (optimizer).
    Exits 1 otherwise.

How to run
    python examples/host_placement.py            # 30 steps
    python examples/host_placement.py --small    # 4 steps (CI)
"""
from __future__ import annotations

import argparse
import copy
import functools
import sys
import tempfile

import torch
import torch.nn.functional as F

import graphpar as gp
from graphpar.models.gpt import GPT, GPTConfig

DP, BATCH, SEQ, VOCAB = 2, 8, 16, 256
OPTIMIZER = functools.partial(torch.optim.SGD, lr=0.3)   # row-wise SGD on the table = dense SGD
# each rank's gradients are computed in bf16 (2**-8 relative rounding) on its half of the batch,
# not on the whole batch as on one device: per SGD step an entry can differ by lr * |g| * 2**-7,
# a few 1e-4 over the steps.
PARAM_TOL, LOSS_TOL = 3e-3, 2e-2


def make_model() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=VOCAB, block_size=SEQ, n_layer=2, n_head=4, n_embd=64, tie_weights=False))


def loss_fn(logits, target):
    # fp32 cross entropy on bf16 logits, as Megatron computes it
    return F.cross_entropy(logits.float().flatten(0, 1), target.flatten())


def batches(steps: int):
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (steps, BATCH * DP, SEQ + 1), generator=g)
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def rank_main(steps: int):
    import torch.distributed as dist
    rank = dist.get_rank()
    data = batches(steps)
    local = lambda t: t[rank * BATCH:(rank + 1) * BATCH]  # noqa: E731
    strategy = gp.Strategy(dp=DP, offload_optimizer=True, param_dtype=torch.bfloat16, offload_embedding=["wte"])
    pm = gp.compile(make_model(), strategy, example_inputs=(local(data[0][0]),), example_target=local(data[0][1]),
                    loss_fn=loss_fn, optimizer=OPTIMIZER)
    plan = pm.report().ranks[rank]
    losses = [pm.train_step(local(x), target=local(y)) for x, y in data]
    if rank == 0:
        with tempfile.TemporaryDirectory() as directory:
            pm.dump(directory)
    return losses, pm.full_state_dict(), plan, sum(p.numel() for p in pm.parameters())


def reference(steps: int):
    master = make_model()
    compute = copy.deepcopy(master).to(torch.bfloat16)
    for p in compute.parameters():
        p.grad_dtype = torch.float32  # gradients kept in fp32, as graphpar keeps them (reduce_dtype=None)
    opt = OPTIMIZER(master.parameters())
    losses = []
    for x, y in batches(steps):
        for p in compute.parameters():
            p.grad = None
        loss = loss_fn(compute(x), y)
        loss.backward()
        for m, c in zip(master.parameters(), compute.parameters()):
            m.grad = c.grad
        opt.step()
        with torch.no_grad():
            for m, c in zip(master.parameters(), compute.parameters()):
                c.copy_(m)
        losses.append(loss.item())
    return losses, master.state_dict()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--small", action="store_true", help="4 steps (CI)")
    steps = 4 if parser.parse_args().small else 30
    results = gp.launch(rank_main, world_size=DP, args=(steps,))
    ref_losses, ref_state = reference(steps)
    ok = True
    for rank, (losses, state, plan, device_params) in enumerate(results):
        worst = max(abs(a - b) for a, b in zip(losses, ref_losses))
        diff = max((state[k] - v).abs().max().item() for k, v in ref_state.items())
        per_param = (plan.param_bytes / device_params, plan.grad_bytes / device_params,
                     plan.optimizer_bytes / device_params)
        print(f"rank {rank}: loss {losses[0]:.4f} -> {losses[-1]:.4f} (max gap to one device {worst:.1e}), "
              f"max weight gap {diff:.1e}; device bytes/param: weights {per_param[0]:g}, grads "
              f"{per_param[1]:g}, optimizer {per_param[2]:g}; host {plan.host_bytes / 2**20:.2f} MiB")
        ok &= worst < LOSS_TOL and diff < PARAM_TOL and per_param == (2, 4, 0)
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
