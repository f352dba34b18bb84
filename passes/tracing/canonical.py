"""Canonical forms for the ops whose meaning depends on training mode.

Both front ends trace in training mode, which bakes `training=True` into these ops. Each rule
below rewrites one op, at either graph level, into the graphpar.runtime.ops function that reads the
mode at run time (see graphpar/runtime/ops.py). Rules are data: (ops matched, rewrite).
"""
from __future__ import annotations

from typing import Callable, Dict, Optional

import torch
import torch.fx
import torch.nn.functional as F
from torch.fx.operator_schemas import normalize_function

from graphpar.runtime import ops

aten = torch.ops.aten

# A rewrite gets the node and its arguments by name and returns the replacement, inserted
# before the node, or None to leave the node alone.
Rewrite = Callable[[torch.fx.Graph, torch.fx.Node, Dict[str, object]], Optional[torch.fx.Node]]


def _dropout(graph, node, a):
    if not a.get("train", a.get("training", True)):
        return None
    p = a["p"]
    if p == 0:
        return a["input"]
    return graph.call_function(ops.dropout, (a["input"], p))


def _batch_norm(graph, node, a):
    if not a.get("training") or a.get("running_mean") is None:
        return None
    return graph.call_function(ops.batch_norm, (
        a["input"], a["running_mean"], a["running_var"], a.get("weight"), a.get("bias"),
        a["momentum"], a["eps"]))


def _count_batch(graph, node, a):
    buffer, other = node.args[0], node.args[1] if len(node.args) > 1 else None
    is_counter = (isinstance(buffer, torch.fx.Node) and buffer.op == "get_attr"
                  and str(buffer.target).endswith("num_batches_tracked") and other == 1)
    return graph.call_function(ops.count_batch, (buffer,)) if is_counter else None


def _attention(graph, node, a):
    if not a.get("dropout_p"):
        return None
    kwargs = {k: a[k] for k in ("attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa") if k in a}
    q = a.get("query", a.get("q"))
    k = a.get("key", a.get("k"))
    v = a.get("value", a.get("v"))
    return graph.call_function(ops.attention, (q, k, v), kwargs)


RULES: Dict[object, Rewrite] = {
    aten.dropout.default: _dropout,
    F.dropout: _dropout,
    torch.dropout: _dropout,
    aten.batch_norm.default: _batch_norm,
    F.batch_norm: _batch_norm,
    aten.add_.Tensor: _count_batch,
    aten.scaled_dot_product_attention.default: _attention,
    F.scaled_dot_product_attention: _attention,
}


def _arguments(node: torch.fx.Node) -> Optional[Dict[str, object]]:
    normalized = normalize_function(node.target, tuple(node.args), dict(node.kwargs),
                                    normalize_to_only_use_kwargs=True)
    return dict(normalized.kwargs) if normalized is not None else None


def canonicalize_mode_ops(gm: torch.fx.GraphModule) -> None:
    graph = gm.graph
    for node in list(graph.nodes):
        rewrite = RULES.get(node.target) if node.op == "call_function" else None
        if rewrite is None:
            continue
        arguments = _arguments(node)
        if arguments is None:
            continue
        existing = set(graph.nodes)
        with graph.inserting_before(node):
            replacement = rewrite(graph, node, arguments)
        if replacement is None:
            continue
        if isinstance(replacement, torch.fx.Node) and replacement not in existing:
            # a new node stands for the old one; an existing one (dropout p=0 removed) keeps its own
            replacement.meta.update({k: v for k, v in node.meta.items() if k != "val"})
        node.replace_all_uses_with(replacement)
        graph.erase_node(node)
