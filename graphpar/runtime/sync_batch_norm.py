"""Batch normalisation with statistics over the whole data-parallel batch, on any backend.

torch.nn.SyncBatchNorm only runs on CUDA tensors; this version is plain tensor code plus
all-reduces, so it works on gloo and the CPU. Forward all-reduces per-channel (sum, sum of
squares, count); backward all-reduces (sum dy, sum dy * x_hat), as Megatron/torch do, so
every rank's input gradient is that of the sum of all ranks' losses. Weight and bias
gradients stay local: data-parallel averaging turns them into the global-batch gradient.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.fx

from graphpar.runtime import ops


def _channel_dims(x: torch.Tensor):
    return [d for d in range(x.dim()) if d != 1]


def _per_channel(t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return t.view([1, -1] + [1] * (x.dim() - 2))


class _SyncBatchNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, momentum, eps, group):
        dims = _channel_dims(x)
        count = torch.tensor([x.numel() / x.shape[1]], dtype=torch.float64)
        stats = torch.cat([x.sum(dims).double(), (x.double() ** 2).sum(dims), count])
        if group is not None:
            dist.all_reduce(stats, group=group)
        c = x.shape[1]
        n = stats[-1]
        mean = stats[:c] / n
        var = stats[c:2 * c] / n - mean ** 2
        with torch.no_grad():
            running_mean.mul_(1 - momentum).add_(momentum * mean.to(running_mean.dtype))
            unbiased = var * n / (n - 1).clamp(min=1)
            running_var.mul_(1 - momentum).add_(momentum * unbiased.to(running_var.dtype))
        invstd = torch.rsqrt(var + eps).to(x.dtype)
        x_hat = (x - _per_channel(mean.to(x.dtype), x)) * _per_channel(invstd, x)
        ctx.save_for_backward(x_hat, weight, invstd)
        ctx.group, ctx.count, ctx.has_bias = group, n, bias is not None
        y = x_hat * _per_channel(weight, x) if weight is not None else x_hat
        return y + _per_channel(bias, x) if bias is not None else y

    @staticmethod
    def backward(ctx, dy):
        x_hat, weight, invstd = ctx.saved_tensors
        dims = _channel_dims(dy)
        local_dy = dy.sum(dims)
        local_dy_xhat = (dy * x_hat).sum(dims)
        sums = torch.cat([local_dy, local_dy_xhat]).double()
        if ctx.group is not None:
            dist.all_reduce(sums, group=ctx.group)
        c = dy.shape[1]
        mean_dy = (sums[:c] / ctx.count).to(dy.dtype)
        mean_dy_xhat = (sums[c:] / ctx.count).to(dy.dtype)
        scale = invstd * weight if weight is not None else invstd
        dx = _per_channel(scale, dy) * (dy - _per_channel(mean_dy, dy) - x_hat * _per_channel(mean_dy_xhat, dy))
        dweight = local_dy_xhat if weight is not None else None
        dbias = local_dy if ctx.has_bias else None
        return dx, dweight, dbias, None, None, None, None, None


@torch.fx.wrap
def sync_batch_norm(x, running_mean, running_var, weight, bias, momentum: float, eps: float, axis: str,
                    module: str = ""):
    if not ops.is_training(module) or ops.axis_size(axis) == 1:
        return ops.batch_norm(x, running_mean, running_var, weight, bias, momentum, eps, module=module)
    group = None if ops.simulating() else ops.axis_group(axis)
    return _SyncBatchNorm.apply(x, weight, bias, running_mean, running_var, momentum, eps, group)
