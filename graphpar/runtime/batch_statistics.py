"""A mean over the global batch's rows, taken inside the program under data parallelism.

A loss term that is not a mean of per-row terms (a mixture-of-experts load-balancing loss:
the product of per-expert token fractions and mean router probabilities) is not averaged
correctly by data parallelism: the mean of the ranks' products is not the product of the
global batch's means. passes/global_router_statistics.py makes such means the global
batch's before they are combined, so every rank computes the single-device term.

    batch_mean(total, count, axis)   training: total and count (a tensor, or a number equal
                                     on every rank) summed over the axis' ranks, divided;
                                     evaluation (pm(x): this rank's batch): total / count

The sum's backward scales the gradient by the axis size: every dp rank computes the same
global term T and adds it to its loss, and data parallelism averages the ranks' gradients.
Rank r's backward reaches only its own rows' part of dT (a sum's gradient is the same for
each summand), and the ranks' parts add up to dT: averaged they would give dT / dp, so each
part is taken dp times.
"""
from __future__ import annotations

import datetime
from typing import Union

import torch
import torch.distributed as dist

from graphpar.distributed import groups as distributed
from graphpar.runtime import ops


def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    total = x.detach().clone().contiguous()
    work = dist.all_reduce(total, group=group, async_op=True)
    work.wait(datetime.timedelta(seconds=distributed.DEFAULT_TIMEOUT_S))
    return total


class _GlobalSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.size = dist.get_world_size(group)
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.size, None


@torch.fx.wrap
def batch_mean(total: torch.Tensor, count: Union[torch.Tensor, float], axis: str) -> torch.Tensor:
    """`total / count` over every rank of mesh axis `axis` in training (see the module docstring)."""
    if ops.simulating() or not ops.is_training():   # the planner's fake run; pm(x)
        return total / count
    group = ops.axis_group(axis)
    counted = _all_reduce(count, group) if isinstance(count, torch.Tensor) else count * dist.get_world_size(group)
    return _GlobalSum.apply(total, group) / counted
