"""The user's optimizer factory, checked and called over the parameters graphpar gives it.

compile checks the factory (check_optimizer_factory); the runtime builds each optimizer
with make_optimizer: the rank's device optimizer, the host update's, a host table's, and
the planner's probe that counts optimizer states.
"""
from __future__ import annotations

import inspect
from typing import Any, Sequence

import torch

_FACTORY_FIX = "pass a factory, e.g. optimizer=functools.partial(torch.optim.AdamW, lr=1e-3)"


def check_optimizer_factory(factory: Any) -> None:
    """`optimizer=` must be None or a callable(params) -> Optimizer, not an optimizer."""
    if isinstance(factory, torch.optim.Optimizer):
        raise TypeError(f"optimizer={type(factory).__name__}(...) is an optimizer instance, but graphpar needs a "
                        f"factory callable(params) -> torch.optim.Optimizer: it builds the optimizer over this "
                        f"rank's parameter shards, which the instance does not hold. Fix: {_FACTORY_FIX}.")
    if factory is not None and not callable(factory):
        raise TypeError(f"optimizer={factory!r} is not callable; it must be a factory callable(params) -> "
                        f"torch.optim.Optimizer. Fix: {_FACTORY_FIX}.")


def make_optimizer(factory, params: Sequence[torch.Tensor]) -> torch.optim.Optimizer:
    """factory(params), checked: an Optimizer stepping exactly `params` (one that steps other
    tensors, e.g. the user's model.parameters(), would leave the compiled model untrained)
    and whose step needs no closure (graphpar calls step() once per train_step)."""
    check_optimizer_factory(factory)
    optimizer = factory(list(params))
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"the optimizer factory {_name(factory)} returned {_describe(optimizer)}, not a "
                        f"torch.optim.Optimizer. Fix: return the optimizer, e.g. "
                        f"optimizer=lambda params: torch.optim.SGD(params, lr=0.1).")
    stepped = [p for group in optimizer.param_groups for p in group["params"]]
    given = {id(p) for p in params}
    if len(stepped) != len(given) or {id(p) for p in stepped} != given:
        ours = sum(id(p) in given for p in stepped)
        raise ValueError(f"the optimizer factory {_name(factory)} returned a {type(optimizer).__name__} over "
                         f"{len(stepped)} tensor(s), {ours} of them among the {len(given)} parameter(s) graphpar "
                         f"gave it; it must step exactly those (this rank's shards), or the compiled model is "
                         f"not trained. Fix: build the optimizer from the factory's argument, e.g. "
                         f"optimizer=lambda params: torch.optim.SGD(params, lr=0.1), not model.parameters().")
    if _step_needs_closure(optimizer):
        raise ValueError(f"optimizer {type(optimizer).__name__} needs a closure in step(closure) (it re-evaluates "
                         f"the loss), but train_step steps once per batch with no closure. Fix: use an optimizer "
                         f"whose step(closure=None) has a default, such as SGD, Adam or AdamW.")
    return optimizer


def _step_needs_closure(optimizer: torch.optim.Optimizer) -> bool:
    closure = inspect.signature(optimizer.step).parameters.get("closure")
    return closure is not None and closure.default is inspect.Parameter.empty


def _name(fn) -> str:
    return repr(getattr(fn, "__qualname__", None) or fn)


def _describe(value) -> str:
    return "None" if value is None else f"a {type(value).__name__}"
