"""Data-parallel gradient averaging in buckets, overlapped with backward.

Parameters are grouped into buckets of about `bucket_bytes` in the order their gradients
become ready: the reverse of the model's parameter order, which follows the forward pass in
practice (the planner buckets the same way). During the
backward of the last microbatch a post-accumulate-grad hook counts each bucket's ready
gradients; when a bucket is complete its gradients are flattened into one buffer and an
asynchronous all-reduce starts, while autograd goes on computing earlier layers. `finish`
waits for every bucket (each wait has the collective timeout) and writes the averages back.
A bucket's buffer ends with one flag per parameter (1: this rank has its gradient), summed
by the same all-reduce: a parameter no rank's backward reached keeps `.grad = None`, so the
optimizer skips it as eager PyTorch (and DDP) do; one reached on some ranks gets the average
on every rank, the others counting zero, as in DDP.
Earlier microbatches only accumulate: gradients are reduced once per step, as DDP's
no_sync does.
"""
from __future__ import annotations

import datetime
from typing import Callable, List, Optional, Sequence

import torch
import torch.distributed as dist

DEFAULT_BUCKET_BYTES = 25 * 1024 * 1024


class _Bucket:
    def __init__(self, params: List[torch.nn.Parameter], group):
        self.params = params
        self.group = group   # the ranks averaging these gradients
        self.buffer: Optional[torch.Tensor] = None
        self.work = None
        self.launched = False  # this step; `work` alone is cleared when the bucket completes


def grad_dtype(p: torch.Tensor) -> torch.dtype:
    """The dtype p.grad has: the parameter's own, or the fp32 that passes/cast_params.py asks
    autograd to accumulate a low-precision parameter's gradient in (Tensor.grad_dtype)."""
    return getattr(p, "grad_dtype", None) or p.dtype


def flat_grads(params: Sequence[torch.nn.Parameter]) -> torch.Tensor:
    """The parameters' gradients as one new flat tensor (zeros for a missing one, in the dtype
    the others have: a rank whose backward reached none sends the same dtype as the rest)."""
    return torch.cat([(p.grad if p.grad is not None else torch.zeros(p.shape, dtype=grad_dtype(p), device=p.device))
                      .reshape(-1) for p in params])


def flat_grads_and_usage(params: Sequence[torch.nn.Parameter]) -> torch.Tensor:
    """flat_grads followed by one flag per parameter, 1 where it has a gradient: summed over
    ranks with the gradients, a flag > 0 says some rank's backward reached the parameter."""
    grads = flat_grads(params)
    used = torch.tensor([p.grad is not None for p in params], dtype=grads.dtype, device=grads.device)
    return torch.cat([grads, used])


def summed_gradient_bytes(nbytes: int, numel: int) -> int:
    """The bytes a gradient of `nbytes` and `numel` elements takes in a flat_grads_and_usage
    buffer: one more element of its dtype, its usage flag (the planner counts with this)."""
    return nbytes + nbytes // max(numel, 1)


def write_grads(params: Sequence[torch.nn.Parameter], reduced: torch.Tensor, divisor: int) -> None:
    """After the all-reduce of a flat_grads_and_usage buffer: each parameter some rank
    reached gets its slice (a view) divided by `divisor`; one no rank reached keeps no
    gradient, so it is not stepped."""
    reduced.div_(divisor)
    total = sum(p.numel() for p in params)
    offset = 0
    for p, used in zip(params, reduced[total:].tolist()):
        n = p.numel()
        p.grad = reduced[offset:offset + n].view_as(p) if used > 0 else None  # train_step resets grads
        offset += n


class BucketTracker:
    """Calls `on_ready(k)` when every armed parameter of bucket k has received its gradient
    in this backward, counting post-accumulate-grad hooks. Arming says which gradients are
    final: all at once (the last microbatch) or a pipeline stage's parameters before that
    stage's last backward; a gradient that arrives unarmed is an earlier microbatch's."""

    def __init__(self, buckets: Sequence[Sequence[torch.nn.Parameter]], on_ready: Callable[[int], None]):
        self.buckets = [list(b) for b in buckets]
        self.on_ready = on_ready
        self._bucket_of = {id(p): k for k, bucket in enumerate(self.buckets) for p in bucket}
        self._ready = [0] * len(self.buckets)
        self._armed: set = set()   # ids of the parameters whose next gradient is final
        self._handles = [p.register_post_accumulate_grad_hook(self._on_grad) for b in self.buckets for p in b]

    def arm(self, params: Optional[Sequence[torch.nn.Parameter]] = None) -> None:
        if params is None:
            self._ready = [0] * len(self.buckets)
            self._armed = set(self._bucket_of)
        else:
            self._armed.update(id(p) for p in params)

    def disarm(self) -> None:
        """The step's backward is over: forget what arrived."""
        self._armed, self._ready = set(), [0] * len(self.buckets)

    def _on_grad(self, param: torch.nn.Parameter) -> None:
        if id(param) not in self._armed:
            return
        k = self._bucket_of[id(param)]
        self._ready[k] += 1
        if self._ready[k] == len(self.buckets[k]):
            self.on_ready(k)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def bucket_spans(sizes: Sequence[int], bucket_bytes: int) -> List[range]:
    """The one bucketing rule (the runtime, the update program and the planner all use it):
    the positions of consecutive runs of `sizes` (bytes, in gradient-ready order) of at
    least `bucket_bytes` each; the last run may be smaller."""
    spans, start, size = [], 0, 0
    for end, item in enumerate(sizes, 1):
        size += item
        if size >= bucket_bytes:
            spans.append(range(start, end))
            start, size = end, 0
    if start < len(sizes):
        spans.append(range(start, len(sizes)))
    return spans


def bucketize(params: Sequence[torch.nn.Parameter], bucket_bytes: int,
              element_size: Optional[int] = None) -> List[List[torch.nn.Parameter]]:
    """`params` grouped by bucket_spans; `element_size` counts the gradients' size when it
    will differ from the parameters' now."""
    sizes = [p.numel() * (element_size or p.element_size()) for p in params]
    return [[params[i] for i in span] for span in bucket_spans(sizes, bucket_bytes)]


def _all_experts(bucket: Sequence[torch.nn.Parameter], experts: set) -> bool:
    """Whether a bucket holds expert weights (all of them: a bucket is reduced over one group)."""
    held = [id(p) in experts for p in bucket]
    if any(held) and not all(held):
        raise ValueError("a gradient bucket mixes expert and dense weights, which are reduced over different "
                         "groups (edp and dp): passes/build_update.py keeps them in buckets of their own")
    return all(held)


class GradientSync:
    def __init__(self, params_in_ready_order: Sequence[torch.nn.Parameter], group, world: int,
                 timeout_s: float, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 buckets: Optional[Sequence[Sequence[torch.nn.Parameter]]] = None,
                 experts: Sequence[torch.nn.Parameter] = (), expert_group=None):
        """`buckets` overrides the grouping (the host update's, so both walk the same buckets).
        `experts` (expert parallelism): weights whose gradients are summed over `expert_group`
        only, the ranks holding the same experts, in buckets of their own (after the others';
        given `buckets` must keep them apart too); each already sums the tokens of its whole
        ep group, so they too are divided by `world`."""
        self.group = group
        self.world = world
        self.timeout = datetime.timedelta(seconds=timeout_s)
        split = {id(p) for p in experts}
        if buckets is None:
            dense = [p for p in params_in_ready_order if p.requires_grad and id(p) not in split]
            buckets = bucketize(dense, bucket_bytes) + bucketize([p for p in experts if p.requires_grad], bucket_bytes)
        self.buckets = [_Bucket(list(b), expert_group if _all_experts(b, split) else group) for b in buckets]
        self.launched_in_backward = 0  # buckets started by backward itself (overlap), ever
        # the host update (graphpar.runtime.placement.runner) takes each bucket as its all-reduce starts
        self.on_launch: Optional[Callable[[int], None]] = None
        self._tracker = BucketTracker([b.params for b in self.buckets], self._launch_in_backward)

    def arm(self, params: Optional[Sequence[torch.nn.Parameter]] = None) -> None:
        """Reduce during the next backward (the last microbatch's). With `params`, only those:
        a pipeline arms each stage's parameters before that stage's last backward, which
        comes at a different time for each stage; the step's buckets are kept."""
        if params is None:
            self.reset()
        self._tracker.arm(params)

    def reset(self) -> None:
        """Forget this step's buckets (after they all completed)."""
        for bucket in self.buckets:
            bucket.work, bucket.buffer, bucket.launched = None, None, False

    def _launch_in_backward(self, index: int) -> None:
        self.launched_in_backward += 1
        self._launch(self.buckets[index])

    def _launch(self, bucket: _Bucket) -> None:
        bucket.buffer = flat_grads_and_usage(bucket.params)
        # a group of one (ep = dp: each rank's experts are its own) has nothing to sum
        alone = dist.get_world_size(bucket.group) == 1
        bucket.work = None if alone else dist.all_reduce(bucket.buffer, group=bucket.group, async_op=True)
        bucket.launched = True
        if self.on_launch is not None:
            self.on_launch(self.buckets.index(bucket))

    def launch_remaining(self) -> None:
        """Buckets whose gradients never all arrived (unused parameters, an unarmed step)."""
        self._tracker.disarm()
        for bucket in self.buckets:
            if not bucket.launched:
                self._launch(bucket)

    def complete(self, index: int) -> None:
        """Wait for one bucket's all-reduce and write its averages back to the gradients."""
        bucket = self.buckets[index]
        if bucket.work is not None:
            bucket.work.wait(self.timeout)
        write_grads(bucket.params, bucket.buffer, self.world)
        bucket.buffer, bucket.work = None, None

    def finish(self) -> None:
        """Launch buckets with unused parameters, wait for all, write the averages back."""
        self.launch_remaining()
        for index in range(len(self.buckets)):
            self.complete(index)
        self.reset()

    def remove(self) -> None:
        self._tracker.remove()
