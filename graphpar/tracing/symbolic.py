"""Front end 1: torch.fx.symbolic_trace, with torch.nn leaves lowered to functions."""
from __future__ import annotations

from typing import Iterable, Tuple

import torch
import torch.fx
import torch.nn as nn

from graphpar.tracing.leaf_modules import lower_leaf_modules
from graphpar.tracing.program import MODEL_PREFIX, WithLoss


class _Tracer(torch.fx.Tracer):
    def __init__(self, leaf_paths: Tuple[str, ...], leaf_types: Tuple[type, ...]):
        super().__init__()
        self.leaf_paths = leaf_paths
        self.leaf_types = leaf_types

    def is_leaf_module(self, m: nn.Module, qualified_name: str) -> bool:
        if qualified_name.removeprefix(MODEL_PREFIX) in self.leaf_paths:
            return True
        if self.leaf_types and isinstance(m, self.leaf_types):
            return True
        return super().is_leaf_module(m, qualified_name)


def _strip_prefix(graph: torch.fx.Graph) -> None:
    for node in graph.nodes:
        if node.op in ("get_attr", "call_module"):
            node.target = str(node.target).removeprefix(MODEL_PREFIX)


def trace_symbolic(wrapper: WithLoss, leaf_modules: Iterable = ()) -> torch.fx.GraphModule:
    leaf_paths = tuple(m for m in leaf_modules if isinstance(m, str))
    leaf_types = tuple(m for m in leaf_modules if isinstance(m, type))
    graph = _Tracer(leaf_paths, leaf_types).trace(wrapper)
    _strip_prefix(graph)
    gm = torch.fx.GraphModule(wrapper.model, graph, class_name="GraphparProgram")
    kept = tuple(n.target for n in gm.graph.nodes if n.op == "call_module"
                 and (n.target in leaf_paths or isinstance(gm.get_submodule(n.target), leaf_types or ())))
    lower_leaf_modules(gm, keep=kept)
    gm.recompile()
    return gm
