"""Lowering of torch.nn leaf modules into functional calls on get_attr parameters.

symbolic_trace keeps every torch.nn module as an opaque call_module node. graphpar's IR wants
parameters as get_attr nodes and ops as functions, the same as torch.export produces, so
that one set of sharding rules serves both front ends. Each rule is data: a module type and a
function that emits the replacement nodes. Modules with no rule (and modules the user marks
as leaves) stay call_module nodes.
"""
from __future__ import annotations

from typing import Callable, Dict, Optional, Tuple, Type

import torch
import torch.fx
import torch.nn as nn
import torch.nn.functional as F

from graphpar.runtime import ops

# A rule gets (graph, module, qualified name, input node) and returns the output node, or None
# when this instance has an option the functional form cannot express (kept as call_module).
LoweringRule = Callable[[torch.fx.Graph, nn.Module, str, torch.fx.Node], Optional[torch.fx.Node]]


def _attr(graph: torch.fx.Graph, module: nn.Module, path: str, name: str):
    return graph.get_attr(f"{path}.{name}") if getattr(module, name, None) is not None else None


def _linear(graph, m, path, x):
    return graph.call_function(F.linear, (x, _attr(graph, m, path, "weight"), _attr(graph, m, path, "bias")))


def _embedding(graph, m, path, x):
    if m.max_norm is not None:  # renormalises the table in place; keep the module's own code
        return None
    return graph.call_function(F.embedding, (x, _attr(graph, m, path, "weight")),
                               {"padding_idx": m.padding_idx, "scale_grad_by_freq": m.scale_grad_by_freq,
                                "sparse": m.sparse})


def _layer_norm(graph, m, path, x):
    return graph.call_function(F.layer_norm, (x, tuple(m.normalized_shape), _attr(graph, m, path, "weight"),
                                              _attr(graph, m, path, "bias"), m.eps))


def _rms_norm(graph, m, path, x):
    return graph.call_function(F.rms_norm, (x, tuple(m.normalized_shape), _attr(graph, m, path, "weight"), m.eps))


def _conv(fn):
    def rule(graph, m, path, x):
        if m.padding_mode != "zeros":
            return None
        return graph.call_function(fn, (x, _attr(graph, m, path, "weight"), _attr(graph, m, path, "bias"),
                                        m.stride, m.padding, m.dilation, m.groups))
    return rule


def _dropout(graph, m, path, x):
    return graph.call_function(ops.dropout, (x, m.p)) if m.p > 0 else x


def _batch_norm(graph, m, path, x):
    if not m.track_running_stats or m.momentum is None:  # cumulative averaging: keep module code
        return None
    graph.call_function(ops.count_batch, (graph.get_attr(f"{path}.num_batches_tracked"),))
    return graph.call_function(ops.batch_norm, (
        x, graph.get_attr(f"{path}.running_mean"), graph.get_attr(f"{path}.running_var"),
        _attr(graph, m, path, "weight"), _attr(graph, m, path, "bias"), m.momentum, m.eps))


def _simple(fn, *attrs: str):
    """Modules that are a function of the input plus constructor constants."""
    def rule(graph, m, path, x):
        return graph.call_function(fn, (x,), {a: getattr(m, a) for a in attrs})
    return rule


def _flatten(graph, m, path, x):
    return graph.call_function(torch.flatten, (x, m.start_dim, m.end_dim))


def _identity(graph, m, path, x):
    return x


RULES: Dict[Type[nn.Module], LoweringRule] = {
    nn.Linear: _linear,
    nn.Embedding: _embedding,
    nn.LayerNorm: _layer_norm,
    nn.RMSNorm: _rms_norm,
    nn.Conv1d: _conv(F.conv1d),
    nn.Conv2d: _conv(F.conv2d),
    nn.Conv3d: _conv(F.conv3d),
    nn.Dropout: _dropout,
    nn.BatchNorm1d: _batch_norm,
    nn.BatchNorm2d: _batch_norm,
    nn.BatchNorm3d: _batch_norm,
    nn.ReLU: _simple(F.relu),
    nn.GELU: _simple(F.gelu, "approximate"),
    nn.SiLU: _simple(F.silu),
    nn.Tanh: _simple(torch.tanh),
    nn.Sigmoid: _simple(torch.sigmoid),
    nn.Softmax: _simple(F.softmax, "dim"),
    nn.LogSoftmax: _simple(F.log_softmax, "dim"),
    nn.MaxPool2d: _simple(F.max_pool2d, "kernel_size", "stride", "padding", "dilation", "ceil_mode"),
    nn.AvgPool2d: _simple(F.avg_pool2d, "kernel_size", "stride", "padding", "ceil_mode", "count_include_pad"),
    nn.AdaptiveAvgPool2d: _simple(F.adaptive_avg_pool2d, "output_size"),
    nn.Flatten: _flatten,
    nn.Identity: _identity,
}


def rule_for(module: nn.Module) -> Optional[LoweringRule]:
    return RULES.get(type(module))


def lower_leaf_modules(gm: torch.fx.GraphModule, keep: Tuple[str, ...] = ()) -> None:
    """Replace call_module nodes that have a rule; the nodes created inherit the module
    stack of the call they replace, so their records name the module they came from."""
    graph = gm.graph
    for node in list(graph.nodes):
        if node.op != "call_module" or node.target in keep:
            continue
        module = gm.get_submodule(node.target)
        rule = rule_for(module)
        if rule is None or len(node.args) != 1 or node.kwargs:
            continue
        before = set(graph.nodes)
        with graph.inserting_before(node):
            out = rule(graph, module, node.target, node.args[0])
        if out is None:
            continue
        for created in set(graph.nodes) - before:
            created.meta["nn_module_stack"] = dict(node.meta.get("nn_module_stack", {}))
        node.replace_all_uses_with(out)
        graph.erase_node(node)
