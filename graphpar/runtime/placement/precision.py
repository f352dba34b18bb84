"""Dynamic loss scaling for fp16 compute weights (bf16 has fp32's range and needs none).

fp16 gradients of small magnitude underflow to zero; the loss is multiplied by a large
scale before backward and the fp32 master step divides it out. A step whose gradients
overflowed anywhere (any rank: tp, pp and dp ranks must skip together, or replicas drift)
is skipped and the scale halved; after `interval` good steps it doubles (torch.amp.GradScaler's
growth constants). The loss is scaled in fp32, but autograd hands the scale itself to the
fp16 loss as its gradient, so the first scale is 2**15, the largest power of two below
fp16's maximum (65504), not GradScaler's 2**16 (meant for fp32 losses under autocast).
"""
from __future__ import annotations

import datetime

import torch
import torch.distributed as dist


class LossScaler:
    def __init__(self, scale: float = 2.0 ** 15, growth: float = 2.0, backoff: float = 0.5,
                 interval: int = 2000):
        self.scale, self.growth, self.backoff, self.interval = scale, growth, backoff, interval
        self.good_steps = 0
        self.skipped = 0

    def found_overflow(self, grads, timeout_s: float) -> bool:
        """Whether any rank's gradients hold an inf or nan (collective over the world)."""
        local = any(not torch.isfinite(grad).all() for grad in grads)
        flag = torch.tensor([1.0 if local else 0.0])
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            work = dist.all_reduce(flag, op=dist.ReduceOp.MAX, async_op=True)
            work.wait(datetime.timedelta(seconds=timeout_s))
        return bool(flag.item())

    def update(self, overflow: bool) -> None:
        if overflow:
            self.scale *= self.backoff
            self.good_steps = 0
            self.skipped += 1
            return
        self.good_steps += 1
        if self.good_steps % self.interval == 0:
            self.scale *= self.growth
