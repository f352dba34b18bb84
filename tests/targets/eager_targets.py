"""Per-rank functions for tests/multiprocess/runtime/test_eager_semantics.py (run in processes started by graphpar.launch)."""
import contextlib
import threading

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import graphpar as gp


class PartlyUsed(nn.Module):
    """`side` is read by the graph but gets no gradient (its output is detached), `frozen`
    has requires_grad=False, `unused` is never read: eager AdamW moves none of them."""

    def __init__(self):
        super().__init__()
        self.up = nn.Linear(4, 8)
        self.side = nn.Linear(4, 8)
        self.frozen = nn.Linear(8, 8)
        self.frozen.requires_grad_(False)
        self.down = nn.Linear(8, 2)
        self.unused = nn.Linear(2, 2)

    def forward(self, x):
        h = self.frozen(torch.relu(self.up(x))) + self.side(x).detach()
        return self.down(h)


def partly_used():
    torch.manual_seed(0)
    return PartlyUsed()


def batches(steps=3, batch=8):
    g = torch.Generator().manual_seed(2)
    return [(torch.randn(batch, 4, generator=g), torch.randn(batch, 2, generator=g)) for _ in range(steps)]


def mse(output, target):
    """The loss of these tests: F.mse_loss, which torch.export spells with a broadcast_tensors
    of output and target (the export cases check that pm(x) still needs no target)."""
    return F.mse_loss(output, target)


def optimizer(params):
    """AdamW with weight decay: a parameter stepped with a zero gradient would still shrink."""
    return torch.optim.AdamW(params, lr=1e-2, eps=1e-6, weight_decay=0.1)


def train_partly_used(strategy: dict, steps: int):
    s = gp.Strategy(**strategy)
    data = batches(steps)
    local = data[0][0].shape[0] // s.dp
    pm = gp.compile(partly_used(), s, (data[0][0][:local],), loss_fn=mse,
                    example_target=data[0][1][:local], optimizer=optimizer)
    rows = slice(pm.mesh.dp_rank * local, (pm.mesh.dp_rank + 1) * local)
    losses = [pm.train_step(x[rows], target=y[rows]) for x, y in data]
    return losses, pm.full_state_dict()


def out_of_step():
    """Rank 0 catches a failed train_step (a batch of the wrong shape) and carries on."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    pm = gp.compile(model, gp.Strategy(dp=2), (torch.randn(4, 4),), loss_fn=mse,
                    example_target=torch.randn(4, 2), optimizer=optimizer)
    pm.train_step(torch.randn(4, 4), target=torch.randn(4, 2))
    if rank == 0:
        try:
            pm.train_step(torch.randn(4, 5), target=torch.randn(4, 2))
        except ValueError:
            pass
    try:
        pm.train_step(torch.randn(4, 4), target=torch.randn(4, 2))
    except gp.StepMismatchError as exc:
        return str(exc)
    return "no error"


@contextlib.contextmanager
def train_step_held(pm, x, y):
    """Run pm.train_step(x, target=y) on a thread named 'first', held inside the step (in its
    executor) for the duration of the block: a deterministic concurrent call."""
    inside, release = threading.Event(), threading.Event()
    run = pm._executor.train_step

    def held(*args):
        inside.set()
        assert release.wait(60)
        return run(*args)

    pm._executor.train_step = held
    first = threading.Thread(target=pm.train_step, args=(x,), kwargs={"target": y}, name="first")
    first.start()
    assert inside.wait(60)
    try:
        yield
    finally:
        release.set()
        first.join(60)
        pm._executor.train_step = run
