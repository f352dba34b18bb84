"""The single-device run `graphpar.verify` compares a parallel program with.

It trains what graphpar trains, on one device, with eager PyTorch: the model in fp32, or,
with `Strategy(param_dtype=...)`, mixed precision as graphpar does it (docs/placement.md):

- a compute copy in `param_dtype` (floating inputs cast to it) whose gradients accumulate in
  `reduce_dtype` (fp32 by default, through `Tensor.grad_dtype`),
- fp32 master weights that take the optimizer step, then are copied into the compute copy,
- fp16: backward from the loss times the run's loss scale, the master gradients divided by
  it; the steps the run's loss scaler skipped are skipped (the reference's batch is the
  global one, whose gradient sums overflow at other scales than a rank's),
- host embedding tables updated row-wise, on the rows the batch looked up (lazy Adam for
  Adam/AdamW), as graphpar's host tables are.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.utils._pytree as pytree

from graphpar.passes.host_tables import host_embedding_paths
from graphpar.runtime.placement.embedding import row_optimizer, take_scheduled


@dataclass
class Expected:
    """A reference value, and how far rounding to param_dtype alone moved it: the largest
    difference from the same training in fp32 (0.0 without param_dtype)."""
    value: Any
    noise: float = 0.0


class SingleDeviceReference:
    """The reference training and, with param_dtype, the same training in fp32 beside it: a
    correct parallel run rounds differently from the reference (other sum orders, a loss
    computed in fp32 over tp), by about as much as the reference differs from fp32."""

    def __init__(self, model: torch.nn.Module, strategy, optimizer: Callable):
        tables = host_embedding_paths(model, strategy.offload_embedding, warn=False)
        self.run = _Training(model, strategy.param_dtype, strategy.reduce_dtype or torch.float32, tables, optimizer)
        self.exact = None if strategy.param_dtype is None else _Training(model, None, torch.float32, tables, optimizer)

    def forward_backward(self, inputs, target, loss_fn: Optional[Callable], loss_scale: float = 1.0) -> Expected:
        """One step's loss, with the masters' gradients set (unscaled, fp32)."""
        loss = self.run.forward_backward(inputs, target, loss_fn, loss_scale)
        return self._expected(loss, self.exact and self.exact.forward_backward(inputs, target, loss_fn, 1.0))

    def clip(self, max_norm: float) -> Expected:
        """As compile(max_grad_norm=...) clips: every gradient, before the step; the total norm."""
        return self._expected(self.run.clip(max_norm), self.exact and self.exact.clip(max_norm))

    def schedule(self, lr_scheduler: Callable) -> None:
        """Build `lr_scheduler(optimizer)` on each training's optimizer; step() steps them."""
        for training in self._trainings():
            training.scheduler = lr_scheduler(training.optimizer)

    def step(self, skip: bool = False) -> None:
        """The optimizer step, or with `skip` none (the step the compiled run's fp16 loss scaler
        skipped: which steps overflow is its decision), then the scheduler's either way."""
        for training in self._trainings():
            training.step(skip)

    def _trainings(self) -> List["_Training"]:
        return [self.run] + ([self.exact] if self.exact is not None else [])

    def evaluate(self, inputs) -> List[Expected]:
        """The model's outputs in evaluation mode (no dropout), flattened."""
        ours = self.run.evaluate(inputs)
        exact = self.exact.evaluate(inputs) if self.exact is not None else [None] * len(ours)
        return [self._expected(a, b) for a, b in zip(ours, exact)]

    def grads(self) -> Dict[str, Expected]:
        exact = self.exact.grads() if self.exact is not None else {}
        return {name: self._expected(g, exact.get(name)) for name, g in self.run.grads().items()}

    def state_dict(self) -> Dict[str, Expected]:
        """The fp32 weights: what pm.full_state_dict() returns (masters with param_dtype). Their
        noise is the largest over the whole state, not each tensor's own: an optimizer that
        normalises its step (Adam) moves an element whose gradient is rounding noise by up to
        its learning rate either way, whichever tensor the element is in."""
        ours = self.run.master.state_dict()
        if self.exact is None:
            return {key: Expected(v) for key, v in ours.items()}
        exact = self.exact.master.state_dict()
        noise = max((self._expected(v, exact[key]).noise for key, v in ours.items()), default=0.0)
        return {key: Expected(v, noise) for key, v in ours.items()}

    @staticmethod
    def _expected(value, exact) -> Expected:
        if exact is None:
            return Expected(value)
        if isinstance(value, torch.Tensor):
            if not value.is_floating_point() or value.numel() == 0:
                return Expected(value)
            return Expected(value, float((value.double() - exact.double()).abs().max()))
        return Expected(value, abs(value - exact))


class _Training:
    """One single-device training: in fp32, or mixed precision as graphpar trains it."""

    def __init__(self, model: torch.nn.Module, dtype, grad_dtype, tables: List[str], optimizer: Callable):
        self.master = copy.deepcopy(model).train()
        self.dtype = dtype
        self.compute = self.master if dtype is None else _low_precision_copy(self.master, dtype, grad_dtype)
        self.optimizer, self.row_steps = _optimizers(self.master, tables, optimizer)
        self.scheduler = None

    def forward_backward(self, inputs, target, loss_fn: Optional[Callable], loss_scale: float) -> float:
        for p in self.compute.parameters():  # in mixed precision every master gradient is set below
            p.grad = None
        out = self.compute(*cast_inputs(inputs, self.dtype))
        loss = mean_loss(loss_fn(out, target)) if loss_fn else out
        (loss.float() * loss_scale).backward()
        if self.compute is not self.master:
            for master, compute in zip(self.master.parameters(), self.compute.parameters()):
                master.grad = None if compute.grad is None else compute.grad.float() / loss_scale
        return float(loss.detach())

    def clip(self, max_norm: float) -> float:
        return float(torch.nn.utils.clip_grad_norm_(self.master.parameters(), max_norm))

    def step(self, skip: bool) -> None:
        if not skip:
            for row_step in self.row_steps:
                row_step()
            self.optimizer.step()
            if self.compute is not self.master:
                with torch.no_grad():
                    for master, compute in zip(self.master.parameters(), self.compute.parameters()):
                        compute.copy_(master)
        if self.scheduler is not None:
            self.scheduler.step()

    def evaluate(self, inputs) -> List[Any]:
        with torch.no_grad():
            out = self.compute.eval()(*cast_inputs(inputs, self.dtype))
        self.compute.train()
        return pytree.tree_flatten(out)[0]

    def grads(self) -> Dict[str, torch.Tensor]:
        return {n: p.grad.detach().clone() for n, p in self.master.named_parameters() if p.grad is not None}


def cast_inputs(inputs, dtype) -> List[Any]:
    """The inputs as a model computing in `dtype` takes them: floating tensors cast (as
    cast_params casts the program's floating inputs), the rest as they are; dtype None: as given."""
    if dtype is None:
        return list(inputs)
    return [x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x for x in inputs]


def mean_loss(loss):
    """The single-device loss: a token-weighted (loss_sum, count) is the token mean of the batch."""
    if isinstance(loss, (tuple, list)):
        loss_sum, count = loss
        return loss_sum / count
    return loss


def _low_precision_copy(model: torch.nn.Module, dtype: torch.dtype, grad_dtype: torch.dtype) -> torch.nn.Module:
    compute = copy.deepcopy(model).to(dtype).train()
    if grad_dtype != dtype:  # autograd casts each gradient into p.grad's dtype (graphpar's reduce_dtype)
        for p in compute.parameters():
            p.grad_dtype = grad_dtype
    return compute


def _optimizers(master: torch.nn.Module, tables: List[str], optimizer: Callable):
    """The optimizer of the dense parameters, and one row-wise step per host embedding table:
    graphpar updates host tables row-wise (lazy Adam for Adam/AdamW, see docs/placement.md),
    so the reference updates the same tables the same way, on the rows its gradient touched."""
    weights = [master.get_submodule(path).weight for path in tables]
    dense = optimizer([p for p in master.parameters() if all(p is not w for w in weights)])
    return dense, [_row_step(w, *row_optimizer(w, optimizer), dense) for w in weights]


def _row_step(table: torch.nn.Parameter, row_opt: torch.optim.Optimizer, update, lead: torch.optim.Optimizer):
    """A host table's update: as graphpar's, it takes a scheduler's settings from the dense
    optimizer (graphpar: pm.optimizer) first."""
    def step():
        grad, table.grad = table.grad, None
        if grad is None:
            return
        take_scheduled(lead, row_opt)
        rows = grad.abs().sum(dim=1).nonzero().flatten()  # the rows the batch looked up
        update(table, rows, grad[rows])
    return step
