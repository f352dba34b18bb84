"""Give every node of a freshly traced graph its NodeRecord: value metadata and module path.

Values come from fake tensors (FakeTensorProp): shapes and dtypes without real compute, so
tracing works for models on the meta device as well.
"""
from __future__ import annotations

import copy
import dataclasses
from typing import List, Tuple

import torch
import torch.fx
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import (DataDependentOutputException, FakeTensor, FakeTensorMode,
                                           unset_fake_temporarily)
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from graphpar.ir import NodeRecord, TensorMeta, Value, fetch_attr, record, set_record, value_from_example
from graphpar.passes.tracing.program import MODEL_PREFIX


class _FakeStateProp(FakeTensorProp):
    """FakeTensorProp that also fakes parameters and buffers.

    Plain FakeTensorProp reads attributes as real tensors, so in-place ops in the graph
    (BatchNorm's running statistics, its step counter) would change the user's model.
    """

    def fetch_attr(self, target: str):
        value = super().fetch_attr(target)
        return self._mode.from_tensor(value) if isinstance(value, torch.Tensor) else value

    def call_module(self, target, args, kwargs):
        module = super().fetch_attr(target)
        state = {name: self._mode.from_tensor(t) for name, t in
                 [*module.named_parameters(), *module.named_buffers()]}
        try:
            return torch.func.functional_call(module, state, args, kwargs)
        except DataDependentOutputException:
            return self._run_for_real(module, args, kwargs)

    def _run_for_real(self, module, args, kwargs):
        """A leaf with control flow on tensor values cannot run on fake tensors: run it once
        on zeros of the right shapes (on a copy, so its state is untouched) to learn its
        output shapes."""
        def real(x):
            return torch.zeros(x.shape, dtype=x.dtype, device=x.device) if isinstance(x, FakeTensor) else x
        with unset_fake_temporarily(), torch.no_grad():
            out = copy.deepcopy(module)(*pytree.tree_map(real, args), **pytree.tree_map(real, kwargs))
        return pytree.tree_map(lambda t: self._mode.from_tensor(t) if isinstance(t, torch.Tensor) else t, out)


def propagate_fake_values(gm: torch.fx.GraphModule, flat_example: List) -> None:
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fake_inputs = [mode.from_tensor(x) if isinstance(x, torch.Tensor) else x for x in flat_example]
    _FakeStateProp(gm, mode).propagate(*fake_inputs)


def _module_of(node: torch.fx.Node) -> Tuple[str, str]:
    if node.op in ("get_attr", "call_module"):
        path = str(node.target)
        if node.op == "get_attr":
            path = path.rpartition(".")[0]
        stack = node.meta.get("nn_module_stack") or {}
        type_name = _type_name(list(stack.values())[-1][1]) if stack else ""
        return path, type_name if node.op == "call_module" else ""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return "", ""
    path, module_type = list(stack.values())[-1]
    return _strip(path), _type_name(module_type)


def _strip(path: str) -> str:
    if path == MODEL_PREFIX.rstrip("."):
        return ""
    return path.removeprefix(MODEL_PREFIX)


def _type_name(module_type) -> str:
    if isinstance(module_type, type):
        return module_type.__name__
    return str(module_type).rsplit(".", 1)[-1]


def _with_grad(value: Value, needs_grad: bool) -> Value:
    """Autograd decides requires_grad, not fake propagation (which runs without grad): a
    floating value needs a gradient when any of its inputs does."""
    if isinstance(value, TensorMeta):
        return dataclasses.replace(value, requires_grad=needs_grad and value.dtype.is_floating_point)
    if isinstance(value, tuple):
        return tuple(_with_grad(v, needs_grad) for v in value)
    return value


def _needs_grad(gm: torch.fx.GraphModule, node: torch.fx.Node) -> bool:
    if node.op == "placeholder":
        return False
    if node.op == "get_attr":
        attr = fetch_attr(gm, str(node.target))
        return isinstance(attr, torch.nn.Parameter) and attr.requires_grad
    if node.op == "call_module":
        module = gm.get_submodule(node.target)
        if any(p.requires_grad for p in module.parameters()):
            return True
    return any(_value_needs_grad(record(n).value) for n in node.all_input_nodes)


def _value_needs_grad(value: Value) -> bool:
    if isinstance(value, TensorMeta):
        return value.requires_grad
    if isinstance(value, tuple):
        return any(_value_needs_grad(v) for v in value)
    return False


def annotate_records(gm: torch.fx.GraphModule) -> None:
    for node in gm.graph.nodes:
        if node.op == "output":
            continue
        path, module_type = _module_of(node)
        value = _with_grad(value_from_example(node.meta.get("val")), _needs_grad(gm, node))
        set_record(node, NodeRecord(value=value, module_path=path, module_type=module_type, set_by="trace"))
