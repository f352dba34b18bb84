"""The target a loss is computed against, checked at compile and at every train_step.

LossError names loss_fn or the target as at fault (not the model); the loss checks made
while tracing are passes/tracing/loss_checks.py.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.utils._pytree as pytree


class LossError(ValueError):
    """loss_fn or the target is at fault; raised as is by every front end."""


def check_target(target: Any, batch: int, what: str) -> None:
    """`target` is a tensor (or a tuple/dict of tensors) whose first dimension is the
    inputs' batch: microbatches and data parallelism split inputs and target alike."""
    if target is None:
        return
    for leaf in pytree.tree_leaves(target):
        if not isinstance(leaf, torch.Tensor):
            raise LossError(f"{what} is a {type(target).__name__} holding {type(leaf).__name__} values "
                            f"({short_repr(target)}); the target must be a tensor (or a tuple or dict of tensors). "
                            f"Fix: {what}=torch.tensor(...) with a batch-first shape.")
        if leaf.dim() > 0 and leaf.shape[0] != batch:
            raise LossError(f"{what} has shape {list(leaf.shape)}, but the inputs' batch is {batch}: the "
                            f"target's first dimension must be the batch size, since microbatches and data "
                            f"parallelism split inputs and target alike. Fix: pass the target of the same "
                            f"{batch} samples.")


def short_repr(value: Any) -> str:
    text = repr(value)
    return text if len(text) < 60 else text[:57] + "..."
