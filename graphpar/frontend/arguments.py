"""compile's arguments, checked before anything is traced, built or changed.

Every check names the value, the rule and a fix (docs/errors.md, section "compile"). The
loss and target checks live in passes/tracing/loss_checks.py, next to the trace they guard;
the optimizer factory's in graphpar/runtime/optimizer.py, which builds the optimizers.
"""
from __future__ import annotations

import difflib
import math
import numbers
import re
from typing import Any, Iterable, List, Optional, Tuple

import torch
import torch.nn as nn

from graphpar.errors import invalid, is_int_at_least


# ---- module names: leaf_modules, tp_replicate ----------------------------------------------
def check_module_names(model: nn.Module, option: str, names: Any, types_allowed: bool = False) -> Tuple[Any, ...]:
    """`names` as a tuple, each entry naming a module of `model` (a path from
    model.named_modules(), or, where `types_allowed`, a module class the model uses): a name
    that matches nothing would silently do nothing."""
    if isinstance(names, str):
        raise TypeError(f"{option}={names!r} is a string, but {option} takes a list of module paths; a "
                        f"string would be read as one path per character. Fix: {option}=[{names!r}].")
    kinds = (str, type) if types_allowed else (str,)
    entries = tuple(names)
    paths = [path for path, _ in model.named_modules() if path]
    for entry in entries:
        if not isinstance(entry, kinds):
            raise TypeError(f"{option} entry {entry!r} is a {type(entry).__name__}; entries must be module paths "
                            f"(str){' or nn.Module classes' if types_allowed else ''}. Fix: use a path from "
                            f"model.named_modules(), e.g. {option}=[{(paths or ['layer'])[0]!r}].")
        if isinstance(entry, str) and entry not in paths:
            raise ValueError(f"{option} names {entry!r}, which is not a module of {type(model).__name__}, so it "
                             f"would do nothing. Fix: {_closest_paths(entry, paths)}.")
        if isinstance(entry, type) and not any(isinstance(m, entry) for m in model.modules()):
            raise ValueError(f"{option} names the class {entry.__name__}, of which {type(model).__name__} has no "
                             f"module, so it would do nothing. Fix: name a class the model uses, or a module path.")
    return entries


def _closest_paths(entry: str, paths: List[str]) -> str:
    near = difflib.get_close_matches(entry, paths, n=3)
    if near:
        return f"did you mean {' or '.join(repr(p) for p in near)}?"
    return f"use paths from model.named_modules(), e.g. {paths[:5]}"


# ---- device, buckets, shapes ---------------------------------------------------------
def check_device(device: Any) -> None:
    """`device=` must parse, and CUDA must exist if it asks for CUDA."""
    if device is None:
        return
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device={device!r} is not a torch device ({exc}). Fix: device='cpu' or 'cuda:0', "
                         f"or leave it out to use the model's device.") from None
    if parsed.type != "cuda":
        return
    if not torch.cuda.is_available():
        raise ValueError(f"device={device!r} asks for CUDA, but torch.cuda.is_available() is False here "
                         f"(torch {torch.__version__} {'has' if torch.backends.cuda.is_built() else 'has no'} "
                         f"CUDA support). Fix: device='cpu', or leave device out on a machine without a GPU.")
    if parsed.index is not None and parsed.index >= torch.cuda.device_count():
        raise ValueError(f"device={device!r} names GPU {parsed.index}, but this machine has "
                         f"{torch.cuda.device_count()}. Fix: device='cuda:<local rank>', e.g. "
                         f"f'cuda:{{os.environ[\"LOCAL_RANK\"]}}' under torchrun.")


_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([kmg])i?b?\s*$", re.I)
_UNITS = {"k": 10, "m": 20, "g": 30}


def check_bucket_bytes(value: Any) -> int:
    """`bucket_bytes=` is a positive int number of bytes."""
    if is_int_at_least(value, 1):
        return int(value)
    size = _SIZE.match(value) if isinstance(value, str) else None
    fix = (f"bucket_bytes={size.group(1)} * 2**{_UNITS[size.group(2).lower()]}" if size
           else "bucket_bytes=25 * 2**20 (the default, 25 MiB)")
    raise invalid(f"bucket_bytes={value!r}", "it must be a positive int number of bytes", fix)


def check_max_grad_norm(value: Any) -> Optional[float]:
    """`max_grad_norm=` is None (no clipping) or a positive number, as a float; float('inf')
    measures pm.last_grad_norm without ever clipping (clip_grad_norm_'s coefficient is then 1)."""
    if value is None:
        return None
    rule = ("it must be a positive number, the largest global gradient norm a step keeps (as "
            "torch.nn.utils.clip_grad_norm_'s max_norm), or None for no clipping")
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        number = _as_number(value)
        fix = f"max_grad_norm={number!r}" if number is not None else "max_grad_norm=1.0 (GPT and LLaMA recipes)"
        raise invalid(f"max_grad_norm={value!r}", f"{rule}; got a {type(value).__name__}", fix)
    if math.isnan(value) or value <= 0:
        effect = "nan" if math.isnan(value) else "zero" if value == 0 else "point the other way"
        raise invalid(f"max_grad_norm={value!r}", f"{rule}: clipping to {value!r} would make every gradient {effect}",
                      "max_grad_norm=1.0 (GPT and LLaMA recipes), float('inf') to measure pm.last_grad_norm "
                      "without clipping, or None")
    return float(value)


def _as_number(value: Any) -> Optional[float]:
    """The float a string or a one-element tensor given for a number stands for, if any."""
    try:
        number = float(value.item() if isinstance(value, torch.Tensor) else value)
    except (TypeError, ValueError, RuntimeError):
        return None
    return number if math.isfinite(number) and number > 0 else None


def check_max_shapes(value: Any) -> None:
    """`max_shapes=` is a positive int: how many input shapes get a program of their own."""
    if not is_int_at_least(value, 1):
        raise invalid(f"max_shapes={value!r}", "it must be a positive int, the number of input shapes (batch "
                      "sizes, sequence lengths) that get a program of their own", "max_shapes=8 (the default), "
                      "or 1 to refuse any shape but the example's")


def module_names_and_options(model: nn.Module, leaf_modules: Iterable, tp_replicate: Iterable) -> dict:
    """The checked leaf_modules and tp_replicate, as compile's options hold them."""
    return {"leaf_modules": check_module_names(model, "leaf_modules", leaf_modules, types_allowed=True),
            "tp_replicate": check_module_names(model, "tp_replicate", tp_replicate)}


# ---- hooks the compiled program cannot call ----------------------------------------------------
def check_no_backward_hooks(model: nn.Module) -> None:
    """The compiled program runs autograd over the traced graph and this rank's own copies of
    the parameters, so a module's backward (pre-)hook, or a hook on one of the user's
    parameters, would never be called: refused, rather than training without it. (Forward
    hooks are traced: passes/tracing/symbolic.py.)"""
    modules = [path or "<root>" for path, m in model.named_modules() if m._backward_hooks or m._backward_pre_hooks]
    if nn.modules.module._global_backward_hooks or nn.modules.module._global_backward_pre_hooks:
        modules = ["every module (a global module backward hook)"]
    params = [name for name, p in model.named_parameters()
              if p._backward_hooks or getattr(p, "_post_accumulate_grad_hooks", None)]
    if modules or params:
        where = f"module(s) {modules[:5]}" if modules else f"parameter(s) {params[:5]}"
        raise ValueError(
            f"{where} of {type(model).__name__} have backward hooks, which the compiled program would never call: "
            f"it differentiates the traced graph over this rank's own copies of the parameters. Fix: remove the "
            f"hooks before graphpar.compile; read gradients from pm.named_parameters() after train_step, or "
            f"change them in a graph pass (Strategy(passes=...)).")
