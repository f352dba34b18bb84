"""Per-rank functions for tests/multiprocess/runtime/test_reduce_dtype.py and the runs of its
unit twin (tests/unit/runtime/test_reduce_dtype.py): bf16 weights whose gradients accumulate
and reduce in fp32 (the default) or in bf16 (reduce_dtype), against fp32 training of the
same model on the same data."""
import contextlib
import functools

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import graphpar as gp
from tests.helpers import dp_slice

FEATURES, WIDTH, OUTPUTS = 8, 16, 4
SAMPLES = 4   # one microbatch: a dp rank's SAMPLES samples, the same in each of its microbatches
SGD = functools.partial(torch.optim.SGD, lr=0.1)


class TwoLayers(nn.Module):
    """A regression MLP; at pp=2, partition=["head"] puts `head` on the second stage."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(FEATURES, WIDTH), nn.Tanh())
        self.head = nn.Linear(WIDTH, OUTPUTS)

    def forward(self, x):
        return self.head(self.body(x))


def mse(output, target):
    """The loss in fp32 from the (bf16) output, so the loss is not itself rounded to 8 bits."""
    return F.mse_loss(output.float(), target)


def batch(dp: int, microbatches: int):
    """The global batch: each dp rank's SAMPLES samples (random targets, so the loss stays away
    from zero), repeated in every one of its microbatches."""
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(dp, SAMPLES, FEATURES, generator=g), torch.randn(dp, SAMPLES, OUTPUTS, generator=g)
    return (x.repeat_interleave(microbatches, 0).reshape(-1, FEATURES),
            y.repeat_interleave(microbatches, 0).reshape(-1, OUTPUTS))


# torch.distributed's reductions, and which argument is the tensor they reduce; on gloo ZeRO
# reduces its rows by point-to-point messages (zero._exchange_rows), recorded as their sends
_REDUCTIONS = {"all_reduce": 0, "reduce_scatter_single": 1, "batch_isend_irecv": None}


@contextlib.contextmanager
def reductions():
    """[(op, dtype, elements)] of every all-reduce, reduce-scatter and point-to-point send
    ("isend") issued inside the block."""
    issued, originals = [], {name: getattr(dist, name) for name in _REDUCTIONS}

    def recording(name, fn):
        def wrapper(*args, **kwargs):
            if name == "batch_isend_irecv":
                issued.extend(("isend", op.tensor.dtype, op.tensor.numel()) for op in args[0]
                              if op.op.__name__ == "isend")
            else:
                tensor = args[_REDUCTIONS[name]]
                issued.append((name, tensor.dtype, tensor.numel()))
            return fn(*args, **kwargs)
        return wrapper

    for name, fn in originals.items():
        setattr(dist, name, recording(name, fn))
    try:
        yield issued
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


def train(strategy_dict, steps):
    """This rank's losses over `steps` train_steps; the reductions of the last step (reductions());
    after it, the dtype of every compute weight and of its gradient (None: no gradient kept),
    by name."""
    strategy = gp.Strategy.from_dict(strategy_dict)
    x, y = batch(strategy.dp, strategy.microbatches)
    xs, ys = dp_slice(x, strategy), dp_slice(y, strategy)
    pm = gp.compile(TwoLayers(), strategy, example_inputs=(xs,), example_target=ys, loss_fn=mse, optimizer=SGD)
    losses = [pm.train_step(xs, target=ys) for _ in range(steps - 1)]
    with reductions() as issued:
        losses.append(pm.train_step(xs, target=ys))
    weights = {name: p.dtype for gm in pm.graph_modules for name, p in gm.named_parameters()}
    grads = {name: p.grad.dtype if p.grad is not None else None for gm in pm.graph_modules
             for name, p in gm.named_parameters()}
    return {"losses": losses, "reductions": issued, "weights": weights, "grads": grads}


def train_many(cases):
    """train() of each (strategy dict, steps) in one set of processes (start-up dominates
    these runs)."""
    return [train(strategy_dict, steps) for strategy_dict, steps in cases]
