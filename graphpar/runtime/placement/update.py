"""The modules a rank's update program calls, one set per gradient bucket.

    grads_0 = self.grads_0()                     # device: the bucket's gradients, flat
    grads_0_host = to_host(grads_0)              # inserted by lower_placement
    weights_0 = self.update_0(grads_0_host)      # host: fp32 master step, returns compute copy
    weights_0_device = to_device(weights_0, "cpu")
    written_0 = self.write_0(weights_0_device)   # device: the compute weights, updated

`MasterWeights` owns a bucket's fp32 master weights (a flat buffer; each parameter is a view
of it). Gradients arrive in Strategy.gradient_dtype (fp32 unless reduce_dtype is the compute
dtype); low-precision ones are widened one tensor at a time for the step, so no second fp32
gradient copy of the bucket is kept. The optimizer is the user's, built once over every bucket's
master parameters (`build_optimizer`), so its state_dict, param_groups and LR schedulers
work as usual. A bucket steps alone: only its master parameters have a .grad during its
step, and torch optimizers skip parameters without one.
"""
from __future__ import annotations

import warnings
from typing import Callable, Dict, List, Optional, Sequence

import torch
import torch.nn as nn

from graphpar.runtime.optimizer import make_optimizer
from graphpar.runtime.grad_sync import flat_grads

class GatherGrads(nn.Module):
    """A bucket's gradients as one flat tensor on the device (zeros for a missing one)."""

    def __init__(self, params: Sequence[nn.Parameter]):
        super().__init__()
        self.__dict__["params"] = list(params)  # the program's own parameters, not re-registered

    def forward(self) -> torch.Tensor:
        buffer = _bucket_buffer(self.params)
        return buffer if buffer is not None else flat_grads(self.params)


def _bucket_buffer(params: Sequence[nn.Parameter]) -> Optional[torch.Tensor]:
    """With dp the gradients are already consecutive views of the bucket's averaged
    all-reduce buffer (GradientSync.complete): that buffer (less its trailing usage flags,
    grad_sync.flat_grads_and_usage), not a second copy of it."""
    base = getattr(params[0].grad, "_base", None)
    total = sum(p.numel() for p in params)
    if base is None or base.dim() != 1 or base.numel() != total + len(params):
        return None
    offset = base.storage_offset()
    for p in params:
        if p.grad is None or p.grad._base is not base or p.grad.storage_offset() != offset:
            return None
        offset += p.numel()
    return base[:total]


class WriteParams(nn.Module):
    """Copy updated weights (flat, compute dtype) into the bucket's device parameters."""

    def __init__(self, params: Sequence[nn.Parameter]):
        super().__init__()
        self.__dict__["params"] = list(params)

    def forward(self, flat: torch.Tensor) -> torch.Tensor:
        offset = 0
        with torch.no_grad():
            for p in self.params:
                p.copy_(flat[offset:offset + p.numel()].view_as(p))
                offset += p.numel()
        return flat


class MasterWeights(nn.Module):
    """fp32 master weights of one bucket where its placement says, and their update."""

    def __init__(self, names: Sequence[str], values: Sequence[torch.Tensor], device: torch.device,
                 compute_dtype: torch.dtype):
        super().__init__()
        self.names = list(names)
        self.shapes = [tuple(v.shape) for v in values]
        flat = torch.cat([v.detach().reshape(-1).to(device=device, dtype=torch.float32) for v in values])
        self.__dict__["flat"] = flat
        self.__dict__["params"] = [nn.Parameter(view) for view in _views(flat, self.shapes)]
        self.compute_dtype = compute_dtype
        # the compute copy the step writes; fp32 compute reads the master directly
        self.__dict__["compute"] = (flat if compute_dtype == torch.float32
                                    else torch.empty(flat.numel(), dtype=compute_dtype, device=device))
        self.__dict__["optimizer"] = None
        self.__dict__["kernel"] = None
        # set by the runner when it steps after backward (graphpar/runtime/grad_divisor.py: the fp16
        # loss scale, a token-weighted loss's count), divided out of the gradients here
        self.grad_divisor = 1.0
        # per parameter: whether its device copy got a gradient this step (set by the
        # runner); one without is not stepped, as torch optimizers skip a .grad of None
        self.with_grad = [True] * len(self.params)

    def bind(self, optimizer: torch.optim.Optimizer, kernel: Optional[Callable]) -> None:
        self.__dict__["optimizer"], self.__dict__["kernel"] = optimizer, kernel

    def named_masters(self) -> Dict[str, nn.Parameter]:
        return dict(zip(self.names, self.params))

    def refresh(self) -> torch.Tensor:
        """The compute copy from the master (after loading weights)."""
        if self.compute is not self.flat:
            self.compute.copy_(self.flat)
        return self.compute

    def forward(self, grads: torch.Tensor) -> torch.Tensor:
        """One step from the bucket's flat gradients (their dtype); returns the new weights."""
        if self.kernel is not None:
            self.kernel(self, grads)
        else:
            self._optimizer_step(grads)
            self.refresh()
        return self.compute

    def _optimizer_step(self, grads: torch.Tensor) -> None:
        for p, g, has in zip(self.params, _views(grads.to(torch.float32) / self.grad_divisor, self.shapes),
                             self.with_grad):
            p.grad = g if has else None
        try:
            if self.optimizer is not None:  # compile(optimizer=None): gradients only, no step
                self.optimizer.step()
        finally:
            for p in self.params:
                p.grad = None


def _views(flat: torch.Tensor, shapes) -> List[torch.Tensor]:
    views, offset = [], 0
    for shape in shapes:
        n = 1
        for s in shape:
            n *= s
        views.append(flat[offset:offset + n].view(shape))
        offset += n
    return views


# ---- the fused Adam/AdamW step, then the cast --------------------------------------------------------
def _adam_state(optimizer, param: nn.Parameter) -> dict:
    state = optimizer.state[param]
    if not state:  # torch's fused layout, so optimizer.state_dict() is the usual one
        state["step"] = torch.zeros((), dtype=torch.float32, device=param.device)
        state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
    return state


def fused_adam_step(bucket: MasterWeights, grads: torch.Tensor) -> None:
    """Adam/AdamW over the bucket with torch's fused CPU kernel, one call per param group (the
    kernel has a fixed cost per call, about 10 ms here, so per-tensor or cache-sized calls
    lose more than they save), then the cast of the new weights to the compute dtype, bucket
    by bucket on the host thread, so only compute-dtype weights cross to the device."""
    optimizer = bucket.optimizer
    mine = {id(p) for p, has in zip(bucket.params, bucket.with_grad) if has}
    views = dict(zip((id(p) for p in bucket.params), _views(grads, bucket.shapes)))
    for group in optimizer.param_groups:
        params = [p for p in group["params"] if id(p) in mine]
        if params:
            _fused_group_step(optimizer, group, params, [_widen(views[id(p)], bucket.grad_divisor) for p in params])
    if bucket.compute is not bucket.flat:
        bucket.compute.copy_(bucket.flat)
    _note_stepped(optimizer)


def _note_stepped(optimizer: torch.optim.Optimizer) -> None:
    """What the wrapper a torch LR scheduler puts around optimizer.step() records when step()
    runs; the scheduler's first step() warns ("lr_scheduler.step() before optimizer.step()")
    without it. The fused kernel stands in for step(), so it records the same."""
    optimizer._opt_called = True


def _fused_group_step(optimizer, group, params, grads) -> None:
    states = [_adam_state(optimizer, p) for p in params]
    steps = [state["step"] for state in states]
    torch._foreach_add_(steps, 1)
    decoupled = isinstance(optimizer, torch.optim.AdamW) or group.get("decoupled_weight_decay", False)
    op = torch._fused_adamw_ if decoupled else torch._fused_adam_
    beta1, beta2 = group["betas"]
    op([p.data for p in params], grads, [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states], [],
       steps, lr=float(group["lr"]), beta1=float(beta1), beta2=float(beta2),
       weight_decay=float(group["weight_decay"]), eps=float(group["eps"]), amsgrad=False,
       maximize=bool(group["maximize"]))


def _widen(grad: torch.Tensor, divisor: float) -> torch.Tensor:
    grad = grad.to(torch.float32)
    return grad / divisor if divisor != 1.0 else grad


def fused_adam_available() -> bool:
    """Whether this torch build has the fused Adam kernels for the host (CPU)."""
    try:
        t = [torch.zeros(2)]
        torch._fused_adamw_(t, [torch.zeros(2)], [torch.zeros(2)], [torch.zeros(2)], [], [torch.ones(())],
                            lr=0.0, beta1=0.9, beta2=0.999, weight_decay=0.0, eps=1e-8, amsgrad=False,
                            maximize=False)
        return True
    except (AttributeError, RuntimeError, NotImplementedError):
        return False


def _is_adam(optimizer: torch.optim.Optimizer) -> bool:
    return (isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)) and
            not any(g.get("amsgrad") or g.get("differentiable") or g.get("capturable")
                    for g in optimizer.param_groups))


def step_kernel(optimizer: torch.optim.Optimizer, host: bool) -> Optional[Callable]:
    """The fused Adam step for Adam/AdamW on the host; None: the optimizer's own step.
    Missing fused kernels are warned about loudly (never a silent slow path)."""
    if not (host and _is_adam(optimizer)):
        return None
    if fused_adam_available():
        return fused_adam_step
    warnings.warn(
        "graphpar: this torch build has no fused CPU Adam kernel (torch._fused_adamw_); the host "
        "optimizer falls back to torch's foreach implementation, about 2-4x slower per step on the "
        "host (see benchmarks/bench_host_optimizer.py). Fix: use torch>=2.4.", RuntimeWarning, stacklevel=2)
    return None


def build_optimizer(factory: Optional[Callable], buckets: Sequence[MasterWeights],
                    host: bool) -> Optional[torch.optim.Optimizer]:
    """The user's optimizer over every bucket's master parameters, bound to the buckets."""
    masters = [p for b in buckets for p in b.params]
    if factory is None or not masters:
        return None
    optimizer = make_optimizer(factory, masters)
    kernel = step_kernel(optimizer, host)
    for bucket in buckets:
        bucket.bind(optimizer, kernel)
    return optimizer
