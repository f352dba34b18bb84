"""Per-rank functions for tests/multiprocess/tools/test_data.py (run in processes started by graphpar.launch)."""
import functools

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import Dataset, default_collate

import graphpar as gp
from graphpar.tools.data import DistributedBatches, evaluate_exact


class RegressionSet(Dataset):
    """n deterministic (x[3], y[2]) pairs that records which indices were read."""

    def __init__(self, n: int, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 3, generator=g)
        self.y = self.x @ torch.randn(3, 2, generator=g) + 0.1 * torch.randn(n, 2, generator=g)
        self.reads = []

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        self.reads.append(i)
        return self.x[i], self.y[i]


def tiny_regressor() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 2))


def squared_error(output, target):
    return F.mse_loss(output, target, reduction="none")


def correct(output, target):
    # "Accuracy" on the regression data: does the larger output match the larger target?
    return output.argmax(-1) == target.argmax(-1)


def _first_batch(data: RegressionSet, batch_size: int):
    x, y = default_collate([data[i] for i in range(batch_size)])
    data.reads.clear()  # compile's example is not part of the epoch being checked
    return x, y


def train_epochs_dp(n: int, batch_size: int, epochs: int):
    """Train with DistributedBatches(remainder="drop", shuffle=True); report each epoch."""
    data = RegressionSet(n)
    x, y = _first_batch(data, batch_size)
    pm = gp.compile(tiny_regressor(), gp.Strategy(dp=dist.get_world_size()), example_inputs=(x,),
                    example_target=y, loss_fn=F.mse_loss,
                    optimizer=functools.partial(torch.optim.AdamW, lr=1e-2))
    batches = DistributedBatches(data, batch_size, pm, shuffle=True, seed=3)
    report = []
    for epoch in range(epochs):
        batches.set_epoch(epoch)
        data.reads.clear()
        losses = [pm.train_step(x, target=y) for x, y in batches]
        report.append({"len": len(batches), "steps": len(losses), "reads": list(data.reads),
                       "losses": losses})
    return report


def evaluate_dp(n: int, batch_size: int):
    """evaluate_exact of a compiled model's MSE and accuracy; then a length mismatch."""
    data = RegressionSet(n)
    x, _ = _first_batch(data, batch_size)
    pm = gp.compile(tiny_regressor(), gp.Strategy(dp=dist.get_world_size()), example_inputs=(x,))
    mse = evaluate_exact(pm, data, batch_size, squared_error)
    reads = list(data.reads)
    accuracy = evaluate_exact(pm, data, batch_size, correct)
    try:
        evaluate_exact(pm, RegressionSet(n + pm.mesh.dp_rank), batch_size, squared_error)
        mismatch = None
    except ValueError as exc:
        mismatch = str(exc)
    return mse, accuracy, reads, mismatch
