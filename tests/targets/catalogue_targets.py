"""Functions run inside graphpar.launch children by tests/errors/: the
catalogue entries that need a process group of two ranks."""
import functools
import threading

import torch
import torch.nn as nn
import torch.nn.functional as F

import graphpar as gp
from graphpar.tools import data
from tests.targets.eager_targets import out_of_step


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def _message(fn) -> str:
    try:
        fn()
    except ValueError as exc:
        return str(exc)
    return "no error"


def messages_on_two_ranks():
    """{catalogue id: this rank's error message} for the entries that need dp=2 or ranks
    that disagree. Every case raises on every rank alike, so no rank is left waiting."""
    rank = torch.distributed.get_rank()
    piped = gp.compile(mlp(), gp.Strategy(pp=2), (torch.randn(4, 4),), loss_fn=F.mse_loss,
                       example_target=torch.randn(4, 2))
    return {
        "E-run-shape": _message(lambda: piped.train_step(torch.randn(4, 5), target=torch.randn(4, 2))),
        # rank 1's batch has 8 rows, rank 0's 4: the two stages of one pipeline
        "E-run-replica-shapes": _message(lambda: piped.train_step(torch.randn(4 + 4 * rank, 4),
                                                                  target=torch.randn(4 + 4 * rank, 2))),
        "E-compile-rank-mismatch": _message(lambda: gp.compile(mlp(), gp.Strategy(dp=2, seed=rank),
                                                               (torch.randn(4, 4),))),
        "E-data-length-differs": _message(lambda: data.evaluate_exact(
            nn.Identity(), [(torch.ones(1), torch.ones(1))] * (4 + rank), 2, _rows)),
        "E-data-group-contradiction": _message(lambda: data.evaluate_exact(
            nn.Identity(), [(torch.ones(1), torch.ones(1))] * 4, 2, _rows, dp=4)),
        "E-collective-shape": _message(lambda: _stage_models_that_differ(rank).full_state_dict()),
        "E-run-lazy-layout": _message(lambda: _column_output_with_mse().train_step(torch.randn(4, 4),
                                                                                   target=torch.randn(4, 8))),
        "E-run-shape-layout": _message(lambda: _column_output_with_mse(torch.randn(4, 8))(torch.randn(2, 4))),
        "E-run-step-mismatch": out_of_step(),
        "E-run-token-count": _message(lambda: token_weighted_mlp(gp.Strategy(dp=2)).train_step(
            torch.randn(4, 4), target=torch.zeros(4, 2))),
        "E-run-pipeline-pending": _weight_gradient_dropped(),
    }


def _weight_gradient_dropped() -> str:
    """A zero-bubble schedule edited by hand to drop one backward_weight, on both ranks."""
    pm = gp.compile(mlp(), gp.Strategy(pp=2, microbatches=2, schedule="zero-bubble"), (torch.randn(4, 4),),
                    loss_fn=F.mse_loss, example_target=torch.randn(4, 2))
    executor = pm._executor
    executor.schedule = [i for i in executor.schedule if (i.op, i.mb) != ("backward_weight", 0)]
    try:
        pm.train_step(torch.randn(4, 4), target=torch.randn(4, 2))
    except RuntimeError as exc:
        return str(exc)
    return "no error"


def nonzero_targets(output, target):
    """A token-weighted mse: the squared errors of the nonzero targets, and their number."""
    real = target != 0
    return ((output - target) ** 2 * real).sum(), real.sum()


def token_weighted_mlp(strategy):
    return gp.compile(mlp(), strategy, (torch.randn(4, 4),), loss_fn=nonzero_targets,
                      example_target=torch.randn(4, 2),
                      optimizer=functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9))  # state once stepped


def _stage_models_that_differ(rank: int):
    """pp=2 where each rank built its last layer with another width: stage 0's rank would
    broadcast '2.weight' of one shape to stage 1's rank, which expects another."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2 + rank))
    return gp.compile(model, gp.Strategy(pp=2), (torch.randn(4, 4),))


def _column_output_with_mse(example_target=None):
    """tp=2: without the loss the linear is column parallel (its output gathered); mse_loss
    has no sharding rule, so traced with the loss it stays whole."""
    return gp.compile(nn.Sequential(nn.Linear(4, 8)), gp.Strategy(tp=2), (torch.randn(4, 4),), loss_fn=F.mse_loss,
                      example_target=example_target)


def _rows(output, target):
    return (output - target).abs()


def _refuse_to_unpickle():
    raise RuntimeError("this argument refuses to be unpickled")


class Unpicklable:
    """Pickles in the parent; unpickling it in a child raises."""

    def __reduce__(self):
        return _refuse_to_unpickle, ()


def take(_arg):
    return "unreachable"


def return_a_lock():
    return threading.Lock()


def zero_on_a_tiny_model():
    """Two parameter elements over four dp ranks: the last two own padding only."""
    torch.manual_seed(0)
    gp.compile(nn.Linear(1, 1), gp.Strategy(dp=4, zero=1), (torch.randn(2, 1),), loss_fn=F.mse_loss,
               example_target=torch.randn(2, 1), optimizer=functools.partial(torch.optim.SGD, lr=0.1))


class _Reused(nn.Module):
    """`shared` is read by the first and the third of four layers: with pp=2 and two virtual
    stages, stages 0 and 2 both run on pp rank 0."""

    def __init__(self):
        super().__init__()
        self.shared = nn.Linear(4, 4)
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(4))

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i in (0, 2):
                x = self.shared(x)
        return x


def zero3_weight_read_by_two_stages_of_a_rank():
    torch.manual_seed(0)
    strategy = gp.Strategy(dp=2, pp=2, virtual_stages=2, microbatches=2, zero=3, schedule="interleaved-1f1b",
                           partition=["layers.1", "layers.2", "layers.3"])
    gp.compile(_Reused(), strategy, (torch.randn(4, 4),), loss_fn=F.mse_loss, example_target=torch.randn(4, 4),
               optimizer=functools.partial(torch.optim.SGD, lr=0.1))


# catalogue entries refused alike on each of four ranks (tests/errors/conftest.py launches them together)
FOUR_RANK_REFUSALS = {"E-compile-zero-empty-rank": zero_on_a_tiny_model,
                      "E-compile-zero3-local-stages": zero3_weight_read_by_two_stages_of_a_rank}
