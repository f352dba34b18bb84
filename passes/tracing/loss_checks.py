"""Mistakes in loss_fn or the target, named as such (not as a model that cannot be traced).

    check_loss_fn(loss_fn)              before tracing: callable as loss_fn(output, target)
    check_loss_value(loss)              while tracing: one tensor, not a tuple
    loss_error(...)                     after every front end failed but the model alone traces

The loss is traced inside the model's graph (tracing/program.py), so a loss that fails
makes the whole trace fail; these checks say which of the two is at fault.
"""
from __future__ import annotations

import inspect
from typing import Any, Callable, Optional

import torch

from graphpar.runtime.target import LossError, short_repr

ACCEPTED = ("a floating scalar tensor, the mean over the batch (graphpar does not yet support the "
            "(loss_sum, count) form for token-weighted losses)")


def loss_name(loss_fn: Callable) -> str:
    return getattr(loss_fn, "__qualname__", None) or type(loss_fn).__name__


def check_loss_fn(loss_fn: Optional[Callable]) -> None:
    if loss_fn is None:
        return
    if isinstance(loss_fn, type):
        raise LossError(f"loss_fn={loss_fn.__name__} is a class, not a loss: graphpar calls loss_fn(output, "
                        f"target), which would construct a {loss_fn.__name__}. Fix: pass an instance, "
                        f"loss_fn={loss_fn.__name__}().")
    if not callable(loss_fn):
        raise LossError(f"loss_fn={loss_fn!r} is not callable. Fix: pass a callable(output, target) -> scalar "
                        f"tensor, e.g. loss_fn=torch.nn.functional.cross_entropy.")
    try:
        signature = inspect.signature(loss_fn)
    except (TypeError, ValueError):  # some builtins have none: the trace will tell
        return
    try:
        signature.bind(None, None)
    except TypeError as exc:
        raise LossError(f"loss_fn={loss_name(loss_fn)}{signature} cannot be called as loss_fn(output, target) "
                        f"({exc}). Fix: take exactly the model's output and the target, e.g. "
                        f"loss_fn=lambda output, target: F.mse_loss(output, target).") from None


def check_loss_value(loss: Any, loss_fn: Callable) -> None:
    if isinstance(loss, (tuple, list)):
        raise LossError(f"loss_fn={loss_name(loss_fn)} returned a {type(loss).__name__} of {len(loss)} values; "
                        f"graphpar accepts {ACCEPTED}. Fix: return one tensor, e.g. loss_sum / count.")


def loss_error(loss_fn: Callable, output: str, target: Any, failures) -> LossError:
    """The trace failed with the loss but succeeds without it: name the loss and the target."""
    lines = [f"loss_fn={loss_name(loss_fn)} failed on the model's output {output} and the target "
             f"{_describe_target(target)} (the model alone traces, so the loss or the target is at fault):"]
    lines += [f"  {name}: {type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0]}"
              for name, exc, _ in failures]
    lines.append("Fix: give a target that loss_fn accepts for this output (e.g. class indices as torch.long "
                 "for cross_entropy, a float tensor of the output's shape for mse_loss), or a loss_fn for it.")
    error = LossError("\n".join(lines))
    error.__cause__ = failures[-1][1]
    return error


def _describe_target(target: Any) -> str:
    if isinstance(target, torch.Tensor):
        return f"of shape {list(target.shape)} and dtype {target.dtype}"
    return short_repr(target)
