"""The dtypes torch.export fixed at trace time, taken from a second trace in the compute dtype.

torch.export traces in float32 and records a cast whose dtype the model computes
(`x.to(input_dtype)` in an RMSNorm, `.to(device)`, `torch.ones(..., dtype=x.dtype)`) with the
float32 it saw, plus a check (`_assert_tensor_metadata`) that the cast's input was float32.
Under Strategy.param_dtype the program must compute as `model.to(param_dtype)` would, so
cast_params needs what those casts mean in that dtype. This module traces the model again, on
fake tensors (no data copied) with its floating parameters, buffers and inputs in the compute
dtype, hands every call's dtype arguments of that trace (and the float constants derived
from them, `torch.finfo(dtype).min`) to the program's call of the same name, reads a cast that
was a no-op as its input where that trace does, then drops the float checks. A program whose
calls cannot be matched that way is left to cast_params to refuse.
"""
from __future__ import annotations

import copy
import itertools
from typing import Dict, List, Optional, Tuple

import torch
import torch.fx
import torch.nn as nn
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensorMode

from graphpar.passes.tracing import trace_program

Key = Tuple[str, str]  # (graph module path, node name)


_CHECK = torch.ops.aten._assert_tensor_metadata.default


def _calls(gm: torch.fx.GraphModule) -> Dict[Key, torch.fx.Node]:
    """Every call of the program, nested graphs (higher-order ops' bodies) included, by key."""
    return {(path, node.name): node for path, module in gm.named_modules()
            if isinstance(module, torch.fx.GraphModule) for node in module.graph.nodes
            if node.op == "call_function"}


def float_checks(gm: torch.fx.GraphModule) -> List[torch.fx.Node]:
    """Every export check that a value was of a floating dtype, nested graphs included."""
    return [node for node in _calls(gm).values()
            if node.target is _CHECK and getattr(node.kwargs.get("dtype"), "is_floating_point", False)]


def _fake_copy(model: nn.Module, dtype: torch.dtype, mode: FakeTensorMode) -> nn.Module:
    """The model with every parameter and buffer a fake tensor of `mode` on its own device,
    floating ones in `dtype`. Fake, not meta: a model that branches on its device (transformers'
    grouped experts count tokens with `histc` on a float copy on CPU, an int one elsewhere)
    must take the branch it took in the program's trace."""
    memo = {}
    for tensor in itertools.chain(model.parameters(), model.buffers()):
        fake = _fake(tensor.detach(), dtype, mode)
        memo[id(tensor)] = nn.Parameter(fake, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else fake
    return copy.deepcopy(model, memo)


def _cast(value, dtype: Optional[torch.dtype]):
    return value.to(dtype) if dtype and isinstance(value, torch.Tensor) and value.is_floating_point() else value


def _fake(value, dtype: Optional[torch.dtype], mode: FakeTensorMode):
    if not isinstance(value, torch.Tensor):
        return value
    fake = mode.from_tensor(value)
    with mode:
        return _cast(fake, dtype)


def _retrace(ctx, dtype: torch.dtype) -> torch.fx.GraphModule:
    mode = FakeTensorMode()
    inputs = pytree.tree_map(lambda v: _fake(v, dtype, mode), ctx.example_inputs)
    # the target stays in its dtype, as cast_params leaves it
    target = pytree.tree_map(lambda v: _fake(v, None, mode), ctx.example_target)
    return trace_program(_fake_copy(ctx.model, dtype, mode), inputs, loss_fn=ctx.loss_fn,
                         example_target=target, with_loss=ctx.with_loss, front_end="export",
                         leaf_modules=ctx.options.leaf_modules, dense_experts=ctx.strategy.splits_experts).gm


def _floating_dtypes(node: torch.fx.Node) -> bool:
    return any(isinstance(leaf, torch.dtype) and leaf.is_floating_point
               for leaf in pytree.tree_leaves((node.args, node.kwargs)))


_CASTS = {torch.ops.aten.to.dtype, torch.ops.aten.to.device, torch.ops.aten.to.dtype_layout,
          torch.ops.aten._to_copy.default}


def _uncast(mine, theirs):
    """`mine`'s input where `mine` is a cast of the value `theirs` names: export reads a cast
    that was a no-op in float32 as the value itself, so later readers of the value (a residual
    added after an RMSNorm's `x.to(float32)`) read the cast; in the compute dtype they do not."""
    if (isinstance(mine, torch.fx.Node) and isinstance(theirs, torch.fx.Node) and mine.op == "call_function" and mine.target in _CASTS and isinstance(mine.args[0], torch.fx.Node)
            and mine.args[0].name == theirs.name):
        return mine.args[0]
    return mine


def _with_dtypes(mine: torch.fx.Node, theirs: Optional[torch.fx.Node]):
    """(args, kwargs) of `mine` with each dtype and float taken from `theirs` at the same place and each
    no-op cast read as its input where `theirs` reads the input; None when `theirs` is
    missing, another op, or differs in structure or in a dtype's place."""
    if theirs is None or theirs.target != mine.target:
        return None
    leaves, spec = pytree.tree_flatten((mine.args, mine.kwargs))
    other, other_spec = pytree.tree_flatten((theirs.args, theirs.kwargs))
    if spec != other_spec:
        return None
    merged = []
    for a, b in zip(leaves, other):
        if isinstance(a, torch.dtype) != isinstance(b, torch.dtype):
            return None
        # a float constant that differs was derived from the dtype (torch.finfo(dtype).min)
        adopted = isinstance(a, torch.dtype) or (type(a) is float and type(b) is float)
        merged.append(b if adopted else _uncast(a, b))
    return pytree.tree_unflatten(merged, spec)


def adopt_compute_dtypes(gm: torch.fx.GraphModule, ctx, dtype: torch.dtype) -> Optional[torch.fx.Node]:
    """Give the program the dtypes of its trace in `dtype` and drop export's float checks.
    Returns the first call with a floating dtype that could not be matched (nothing is
    changed then), else None."""
    checks = float_checks(gm)
    if not checks:
        return None
    theirs = _calls(_retrace(ctx, dtype))
    updates = []
    for key, node in _calls(gm).items():
        if node.target is _CHECK:
            continue
        merged = _with_dtypes(node, theirs.get(key))
        if merged is None and _floating_dtypes(node):
            return node
        if merged is not None and merged != (node.args, node.kwargs):
            updates.append((node, merged))
    changed = {node.graph.owning_module for node in [*checks, *(n for n, _ in updates)]}
    for node, (args, kwargs) in updates:
        node.args, node.kwargs = args, kwargs
    for node in checks:
        node.graph.erase_node(node)
    for module in changed:
        module.recompile()
    return None
