"""How each microbatch's loss becomes the step's mean gradient, and the one number every
gradient is divided by after backward, before any optimizer step.

A loss_fn returns either the mean over its microbatch or a token-weighted pair (loss_sum,
count) (passes/tracing/program.py). Per step, with m microbatches and dp replicas:

    mean form    backward of loss * loss_scale / m  ->  dp average  ->  / loss_scale
    pair form    backward of loss_sum * loss_scale  ->  dp average  ->  / (loss_scale * C / dp)

where C is the count summed over every microbatch and dp replica. The pair form gives exactly
the gradient of single-device training on the whole batch with the token mean, sum(loss_sum)
/ C, whatever the padding of each microbatch and replica; a mean of per-microbatch means
would weight a token of a sparse microbatch more. C is known only after the last forward,
and under 1F1B the last stage runs backward before later forwards, so it cannot scale the
loss before backward: the division waits until backward is over. Without a count the
divisor is the fp16 loss scale (or 1), known before backward, and update steps may start
during backward as before.

`value()` is the divisor, computed once per step on every rank (a collective over the world
when there is a count). Whatever else divides or scales the gradients between backward and
the step belongs in it too, so that the plain path (p.grad divided in place, ParallelModule)
and the update program's steps (grad_divisor, graphpar/runtime/placement/runner.py) can never
disagree: global gradient-norm clipping (compile's max_grad_norm) divides it by
torch.nn.utils.clip_grad_norm_'s coefficient,

    norm = ||gradients before the divisor|| / divisor      (one all-reduce over the world,
                                                            graphpar/runtime/grad_norm.py)
    coef = min(max_grad_norm / (norm + 1e-6), 1)   ->   divisor / coef

known only after backward and the dp reduction, so with clipping on, too, no update step
starts during backward.
"""
from __future__ import annotations

import datetime
import math
from typing import List, Optional

import torch
import torch.distributed as dist


class GradientDivisor:
    def __init__(self, mesh, microbatches: int, counted: bool, timeout_s: float,
                 max_grad_norm: Optional[float] = None):
        self.mesh = mesh
        self.microbatches = microbatches
        self.counted = counted  # the loss is a (loss_sum, count) pair
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.max_grad_norm = max_grad_norm  # None: no clipping, and no norm
        self.begin_step()

    @property
    def clipping(self) -> bool:
        return self.max_grad_norm is not None

    @property
    def after_backward(self) -> bool:
        """Whether the divisor is known only after the whole backward: no update step may
        start during it."""
        return self.counted or self.clipping

    def begin_step(self) -> None:
        self._counts: List[torch.Tensor] = []   # this rank's microbatches' counts
        self._global_count: Optional[float] = None
        self._clip_coef = 1.0
        self.grad_norm: Optional[float] = None  # this step's global norm before clipping, once clipped

    # ---- before and during backward (the executors) -----------------------------------------
    def scaled_for_backward(self, loss: torch.Tensor, loss_scale: float) -> torch.Tensor:
        """The microbatch's loss as backward takes it: the mean form is divided by the
        microbatches here (equal microbatches make the mean of means the local batch's
        mean); a loss sum waits for the global count."""
        if self.counted:
            return loss.float() * loss_scale
        return loss.float() * loss_scale / self.microbatches

    def add_count(self, count: torch.Tensor) -> None:
        """A microbatch's count, on the stage computing the loss (kept as a tensor: read only
        after backward, so no microbatch waits for its device)."""
        self._counts.append(count.detach())

    # ---- after backward -------------------------------------------------------------------------
    def global_count(self) -> float:
        """The count summed over every microbatch and dp replica (collective over the world,
        once per step). A replica's count is counted once: by its first tp rank, on the stage
        that computed it (the others add nothing), as the loss is in ParallelModule._global_mean."""
        if self._global_count is None:
            # float64: exact for any count below 2**53
            local = float(torch.stack(self._counts).double().sum()) if self._counts else 0.0
            total = torch.tensor([local if self.mesh.tp_rank == 0 else 0.0], dtype=torch.float64)
            if self.mesh.world_size > 1:
                dist.all_reduce(total, async_op=True).wait(self.timeout)
            self._global_count = _checked_count(float(total))
        return self._global_count

    def clip(self, local_square_sum: float, loss_scale: float = 1.0) -> None:
        """Once per step, after backward and the dp reduction, before any step: the global norm
        from each rank's sum of squares of the gradient elements it counts (NormShare, before
        the divisor; one float64 all-reduce over the world), and the clip coefficient of
        torch.nn.utils.clip_grad_norm_ (error_if_nonfinite=False: a nan or inf norm makes the
        coefficient nan or 0, and the gradients nan or 0, as there)."""
        unclipped = self._unclipped(loss_scale)
        total = torch.tensor([local_square_sum], dtype=torch.float64)
        if self.mesh.world_size > 1:
            dist.all_reduce(total, async_op=True).wait(self.timeout)
        self.grad_norm = math.sqrt(float(total)) / unclipped
        coef = self.max_grad_norm / (self.grad_norm + 1e-6)  # clip_grad_norm_'s 1e-6
        self._clip_coef = coef if coef < 1.0 or math.isnan(coef) else 1.0

    def skip_clip(self) -> None:
        """A step the fp16 loss scaler skips (some gradient overflowed): its norm is infinite,
        and nothing is clipped or stepped."""
        self.grad_norm = math.inf

    def value(self, loss_scale: float = 1.0) -> float:
        """What every gradient, after the dp average, is divided by before the optimizer step."""
        if self._clip_coef == 0.0:  # an infinite norm: clip_grad_norm_ multiplies by 0
            return math.inf
        return self._unclipped(loss_scale) / self._clip_coef

    def _unclipped(self, loss_scale: float) -> float:
        if not self.counted:
            return loss_scale
        return loss_scale * (self.global_count() / self.mesh.dp)

    def mean_loss(self, loss_sum: float) -> float:
        """The step's loss from the sum over the world of each replica's loss total (its
        microbatches' means, or loss sums)."""
        if self.counted:
            return loss_sum / self.global_count()
        return loss_sum / (self.microbatches * self.mesh.dp)


def _checked_count(total: float) -> float:
    """Every rank sees the same total, so every rank refuses the step together (none is left
    waiting in a collective), before any weight or optimizer state changes."""
    if math.isfinite(total) and total > 0:
        return total
    raise ValueError(
        f"loss_fn's counts sum to {total:g} over every microbatch and dp rank this step; graphpar divides the "
        f"loss sum and the gradients by that total, so it must be positive and finite (a batch whose targets "
        f"are all ignore_index has no token to train on). Fix: skip such batches before train_step, or "
        f"count at least one real token per step.")
