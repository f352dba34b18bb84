"""Data parallelism with BatchNorm: sharded batches, synchronised statistics, exact evaluation.

What it shows
    A small CNN with BatchNorm2d layers compiled with ``gp.Strategy(dp=2)`` on 2 local
    processes. Three things that plain DistributedDataParallel leaves to the user:

    * ``graphpar.tools.data.DistributedBatches`` deals a map-style dataset out to the dp ranks in
      global batches of ``dp * batch_size`` samples. The training set here has 50 samples,
      which 2 ranks x 4 samples do not divide: with ``remainder="drop"`` every rank gets the
      same number of full batches (6), so no rank waits in a gradient all-reduce its peer
      never joins, and the 2 samples left over differ from epoch to epoch (``shuffle=True``
      with ``set_epoch``).
    * BatchNorm becomes SyncBatchNorm (graphpar's ``sync_batch_norm`` pass): the batch
      statistics, and the running statistics used in evaluation, are those of the global
      batch, so dp=2 trains exactly like one device on the 8-sample global batch.
    * ``graphpar.tools.data.evaluate_exact`` computes a metric over a test set of 37 samples
      (not a multiple of 8 either), padding the last batches to the compiled batch shape and
      masking the padding out, so every sample counts exactly once.

What it checks
    The same CNN is trained on one device on the same global batches. Per-step losses, the
    final state (weights and BatchNorm running statistics) and the test loss and accuracy
    from evaluate_exact must match the single-device numbers. Exits 1 otherwise.

How to run
    python examples/syncbn_data_parallel.py            # 5 epochs
    python examples/syncbn_data_parallel.py --small    # 2 epochs (CI)
"""
from __future__ import annotations

import argparse
import copy
import functools
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import Dataset

import graphpar as gp
from graphpar.tools.data import DistributedBatches, evaluate_exact

DP, BATCH = 2, 4            # 4 samples per rank, a global batch of 8
TRAIN_N, TEST_N = 50, 37    # neither divides by 8
CLASSES = 4
OPTIMIZER = functools.partial(torch.optim.AdamW, lr=1e-2, eps=1e-6)
LOSS_TOL, METRIC_TOL = 1e-4, 1e-4


class Quadrants(Dataset):
    """8x8 RGB noise images; the label is the brightest quadrant (a task a CNN can learn)."""

    def __init__(self, n: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 3, 8, 8, generator=g)
        quadrant_means = F.avg_pool2d(self.x.sum(1, keepdim=True), 4).flatten(1)   # [n, 4]
        self.y = quadrant_means.argmax(1)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def make_model() -> nn.Module:
    # No conv bias before BatchNorm (as in ResNet): BN subtracts the mean, so a bias would
    # get only rounding-noise gradients.
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
        nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(8 * 2 * 2, CLASSES))


# metric_sum_fn for evaluate_exact: unreduced, one row per sample
def cross_entropy_per_sample(output, target):
    return F.cross_entropy(output, target, reduction="none")


def correct(output, target):
    return output.argmax(-1) == target


def train_rank(epochs: int):
    train, test = Quadrants(TRAIN_N, seed=1), Quadrants(TEST_N, seed=2)
    x, y = torch.stack([train[i][0] for i in range(BATCH)]), torch.stack([train[i][1] for i in range(BATCH)])
    pm = gp.compile(make_model(), gp.Strategy(dp=DP), example_inputs=(x,), example_target=y,
                    loss_fn=F.cross_entropy, optimizer=OPTIMIZER)
    batches = DistributedBatches(train, BATCH, pm, remainder="drop", shuffle=True, seed=0)
    losses, layout = [], []
    for epoch in range(epochs):
        batches.set_epoch(epoch)
        plan = batches.plan()
        layout.append((len(batches), plan.dropped, plan.batches[0]))
        losses += [pm.train_step(x, target=y) for x, y in batches]   # x, y: this rank's 4 samples
    test_loss = evaluate_exact(pm, test, BATCH, cross_entropy_per_sample)
    test_accuracy = evaluate_exact(pm, test, BATCH, correct)
    return {"losses": losses, "layout": layout, "state": pm.full_state_dict(),
            "test_loss": test_loss, "test_accuracy": test_accuracy}


def train_single_device(epochs: int):
    """One process, batches of 8 in the same order: what dp=2 must reproduce."""
    train, test = Quadrants(TRAIN_N, seed=1), Quadrants(TEST_N, seed=2)
    model = copy.deepcopy(make_model()).train()
    opt = OPTIMIZER(model.parameters())
    batches = DistributedBatches(train, DP * BATCH, dp=1, dp_rank=0, remainder="drop", shuffle=True, seed=0)
    losses = []
    for epoch in range(epochs):
        batches.set_epoch(epoch)
        for x, y in batches:
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
    model.eval()
    with torch.no_grad():
        out = model(test.x)
    return {"losses": losses, "state": model.state_dict(),
            "test_loss": cross_entropy_per_sample(out, test.y).mean().item(),
            "test_accuracy": correct(out, test.y).float().mean().item()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--small", action="store_true", help="2 epochs (CI)")
    parser.add_argument("--epochs", type=int, default=5)
    args = parser.parse_args(argv)
    if args.small:
        args.epochs = 2

    results = gp.launch(train_rank, world_size=DP, args=(args.epochs,))
    ref = train_single_device(args.epochs)

    print(f"training set: {TRAIN_N} samples, dp={DP} x batch {BATCH} = global batch {DP * BATCH}, "
          f'remainder="drop", shuffle=True')
    for epoch in range(args.epochs):
        for rank, r in enumerate(results):
            steps, dropped, first = r["layout"][epoch]
            print(f"  epoch {epoch} rank {rank}: {steps} batches, {dropped} samples dropped, "
                  f"first batch reads {first}")
    print("| step | graphpar dp=2 | single device | diff |\n|---:|---:|---:|---:|")
    for step, (a, b) in enumerate(zip(results[0]["losses"], ref["losses"])):
        print(f"| {step} | {a:.6f} | {b:.6f} | {abs(a - b):.1e} |")
    print(f"test set of {TEST_N} samples, evaluate_exact: loss {results[0]['test_loss']:.6f} "
          f"(single device {ref['test_loss']:.6f}), accuracy {results[0]['test_accuracy']:.4f} "
          f"(single device {ref['test_accuracy']:.4f})")

    failures = []
    param_tol = 0.02 * OPTIMIZER.keywords["lr"] * len(ref["losses"])   # AdamW noise: 2% of lr per step
    for rank, r in enumerate(results):
        if len(r["losses"]) != len(ref["losses"]):
            failures.append(f"rank {rank} ran {len(r['losses'])} steps, single device {len(ref['losses'])}")
            continue
        loss_diff = max(abs(a - b) for a, b in zip(r["losses"], ref["losses"]))
        if loss_diff > LOSS_TOL:
            failures.append(f"rank {rank}: losses differ by {loss_diff:.2e} > {LOSS_TOL}")
        for key, value in ref["state"].items():
            diff = (r["state"][key].double() - value.double()).abs().max().item()
            if diff > param_tol:
                failures.append(f"rank {rank}: {key} differs by {diff:.2e} > {param_tol:.1e}")
        for metric in ("test_loss", "test_accuracy"):
            if abs(r[metric] - ref[metric]) > METRIC_TOL:
                failures.append(f"rank {rank}: {metric} {r[metric]:.6f} != single device {ref[metric]:.6f}")
    if failures:
        print("FAIL: " + "; ".join(failures))
        return 1
    print("PASS: dp=2 with SyncBatchNorm, DistributedBatches and evaluate_exact matches one device")
    return 0


if __name__ == "__main__":
    sys.exit(main())
