"""Front end 2: torch.export (non-strict), for models symbolic_trace cannot follow.

export lifts parameters, buffers and tensor constants into placeholders. graphpar's IR keeps
them as get_attr nodes named by their qualified name in the user's model, as symbolic_trace
does, so the two front ends yield the same kind of graph:

    before: p_model_fc_weight (placeholder)   linear = aten.linear(x, p_model_fc_weight, ...)
    after:  fc_weight = get_attr[fc.weight]   linear = aten.linear(x, fc_weight, ...)
"""
from __future__ import annotations

import contextlib
import operator
from typing import Dict, Iterator, List

import torch
import torch.fx

from graphpar.passes.tracing.program import MODEL_PREFIX, WithLoss

CONSTANT_PREFIX = "_graphpar_constant_"


def _lifted_targets(ep) -> Dict[str, str]:
    sig = ep.graph_signature
    lifted = {}
    for mapping in (sig.inputs_to_parameters, sig.inputs_to_buffers):
        for placeholder, target in mapping.items():
            lifted[placeholder] = target.removeprefix(MODEL_PREFIX)
    return lifted


def _lift_constants(ep, gm: torch.fx.GraphModule) -> None:
    """Tensor constants become non-persistent buffers of the program (not model state)."""
    targets = {}
    for i, (placeholder, name) in enumerate(ep.graph_signature.inputs_to_lifted_tensor_constants.items()):
        target = f"{CONSTANT_PREFIX}{i}"
        gm.register_buffer(target, ep.constants[name], persistent=False)
        targets[placeholder] = target
    _replace_placeholders(gm.graph, targets)


def _replace_placeholders(graph: torch.fx.Graph, targets: Dict[str, str]) -> None:
    first_op = next(n for n in graph.nodes if n.op != "placeholder")
    for node in list(graph.nodes):
        if node.op != "placeholder" or node.name not in targets:
            continue
        with graph.inserting_before(first_op):
            # create_node, not get_attr: the attribute is attached to the GraphModule built next
            attr = graph.create_node("get_attr", targets[node.name])
        attr.meta.update(node.meta)
        node.replace_all_uses_with(attr)
        graph.erase_node(node)


def _program_root(model: torch.nn.Module, ep_module: torch.fx.GraphModule,
                  graph: torch.fx.Graph) -> torch.nn.Module:
    """The user's model plus what export created itself: the subgraphs of higher-order ops
    such as autocast regions (LLaMA's rotary embedding), read by get_attr."""
    root = torch.nn.Module()
    for name, child in model.named_children():
        root.add_module(name, child)
    for name, tensor in model.named_parameters(recurse=False):
        root.register_parameter(name, tensor)
    for name, tensor in model.named_buffers(recurse=False):
        root.register_buffer(name, tensor)
    for node in graph.nodes:
        if node.op == "get_attr" and "." not in str(node.target) and not hasattr(root, str(node.target)):
            root.add_module(str(node.target), getattr(ep_module, str(node.target)))
    return root


def _drop_identity_broadcasts(graph: torch.fx.Graph) -> None:
    """Read a broadcast_tensors result as its input where the broadcast changes no shape.

    export decomposes losses such as F.mse_loss into broadcast_tensors([output, target])
    followed by the loss, and the model's output is then returned through the broadcast, as
    if the output depended on the target: evaluating the model (pm(x)) would need a target.
    A broadcast to the input's own shape is a view with the same values and gradient."""
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not torch.ops.aten.broadcast_tensors.default:
            continue
        inputs = node.args[0]
        for user in list(node.users):
            source = inputs[user.args[1]] if user.target is operator.getitem else None
            if source is not None and _same_shape(source, user):
                user.replace_all_uses_with(source)
                graph.erase_node(user)
        if not node.users:
            graph.erase_node(node)


def _same_shape(a: torch.fx.Node, b: torch.fx.Node) -> bool:
    va, vb = a.meta.get("val"), b.meta.get("val")
    return isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor) and va.shape == vb.shape


@contextlib.contextmanager
def _casts_to_the_same_kept() -> Iterator[None]:
    """module.to(dtype or device) inside a forward where every tensor of the module already
    has it returns the module itself, as eager's conversion changes nothing then (transformers'
    SwitchTransformers router casts its classifier to float32 on every call). export's fake
    parameters would otherwise be swapped for converted copies, which it refuses."""
    original = torch.nn.Module.to

    def to(module, *args, **kwargs):
        device, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)
        tensors = [*module.parameters(), *module.buffers()]
        if all((dtype is None or not t.is_floating_point() or t.dtype == dtype)
               and (device is None or t.device == device) for t in tensors):
            return module
        return original(module, *args, **kwargs)

    torch.nn.Module.to = to
    try:
        yield
    finally:
        torch.nn.Module.to = original


def trace_export(wrapper: WithLoss, flat_example: List) -> torch.fx.GraphModule:
    with _casts_to_the_same_kept():
        ep = torch.export.export(wrapper, tuple(flat_example), strict=False)
    graph = ep.graph_module.graph
    _replace_placeholders(graph, _lifted_targets(ep))
    _drop_identity_broadcasts(graph)
    root = _program_root(wrapper.model, ep.graph_module, graph)
    gm = torch.fx.GraphModule(root, graph, class_name="GraphparProgram")
    _lift_constants(ep, gm)
    gm.recompile()
    return gm
