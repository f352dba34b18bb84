"""Mistakes in loss_fn or the target, named as such (not as a model that cannot be traced).

    check_loss_fn(loss_fn)              before tracing: callable as loss_fn(output, target)
    check_loss_value(loss)              while tracing: one tensor, or the pair (loss_sum, count)
    check_count(count, loss_fn)         after tracing: the pair's count is a scalar number of tokens
    loss_error(...)                     after every front end failed but the model alone traces

The loss is traced inside the model's graph (tracing/program.py), so a loss that fails
makes the whole trace fail; these checks say which of the two is at fault.
"""
from __future__ import annotations

import inspect
from typing import Any, Callable, Optional, Tuple

import torch
import torch.fx

from graphpar.ir import TensorMeta, describe_kind, record
from graphpar.runtime.target import LossError, short_repr

ACCEPTED = ("a floating scalar tensor (the mean over the batch), or a pair (loss_sum, count) for a token-weighted "
            "loss (graphpar divides the sum by the count summed over every microbatch and dp rank)")


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
    """One loss, or the pair (loss_sum, count); what each value is, is checked on the traced
    graph (tracing.check_loss), where shapes and dtypes are known."""
    if isinstance(loss, (tuple, list)) and len(loss) != 2:
        raise LossError(f"loss_fn={loss_name(loss_fn)} returned a {type(loss).__name__} of {len(loss)} values; "
                        f"graphpar accepts {ACCEPTED}. Fix: return one tensor, e.g. loss_sum / count, or the "
                        f"pair (loss_sum, count).")


def loss_values(loss: Any) -> Tuple[Any, ...]:
    """The loss as the program's leading outputs: (loss,) or (loss_sum, count)."""
    return tuple(loss) if isinstance(loss, (tuple, list)) else (loss,)


def check_count(count: Any, loss_fn: Callable) -> None:
    """The count of (loss_sum, count), as traced (a graph node, or a constant the front end
    baked in): a scalar tensor of an integer or floating dtype that no parameter reaches.
    graphpar sums it over microbatches and dp ranks and divides by the total, treating it as
    a constant, as single-device training on the whole batch would."""
    value = record(count).value if isinstance(count, torch.fx.Node) else None
    if isinstance(value, TensorMeta) and value.shape == () and not value.dtype.is_complex \
            and value.dtype != torch.bool and not value.requires_grad:
        return
    if isinstance(value, TensorMeta) and value.requires_grad:
        problem, fix = "depends on the parameters (it requires grad)", "detach it, e.g. count.detach()"
    else:
        seen = describe_kind(value) if isinstance(count, torch.fx.Node) else f"the constant {short_repr(count)}"
        problem, fix = (f"is {seen}", "count the real tokens as a tensor, e.g. (target != ignore_index).sum() "
                                      "(a fixed count: torch.ones_like(loss_sum) * n)")
    raise LossError(f"loss_fn={loss_name(loss_fn)} returned (loss_sum, count) whose count {problem}; the count must "
                    f"be a scalar tensor of an integer or floating dtype (not bool) that does not depend on the "
                    f"parameters: graphpar divides the loss sum and the gradients by its total over every microbatch "
                    f"and dp rank. Fix: {fix}.")


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
