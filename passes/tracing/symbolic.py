"""Front end 1: torch.fx.symbolic_trace, with torch.nn leaves lowered to functions.

Buffers are traced as graph values (get_attr), like parameters, so an in-place update in
forward (a step counter) becomes a graph node that runs at every step instead of running
once, on the user's model, while tracing. symbolic_trace records a leaf module as one node
without calling it, so hooks on a leaf would be lost: such a model is refused here
(tracer="auto" then uses torch.export, which runs the hooks).
"""
from __future__ import annotations

from typing import Iterable, List, Tuple

import torch
import torch.fx
import torch.nn as nn

from graphpar.passes.tracing.leaf_modules import lower_leaf_modules
from graphpar.passes.tracing.program import MODEL_PREFIX, WithLoss


class _Tracer(torch.fx.Tracer):
    def __init__(self, leaf_paths: Tuple[str, ...], leaf_types: Tuple[type, ...]):
        super().__init__()
        self.leaf_paths = leaf_paths
        self.leaf_types = leaf_types
        self.proxy_buffer_attributes = True

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


def _has_forward_hooks(module: nn.Module) -> bool:
    return bool(module._forward_hooks or module._forward_pre_hooks)


def hooked_leaves(tracer: _Tracer, wrapper: WithLoss) -> List[str]:
    """Module paths whose forward hooks symbolic_trace would drop: leaves with hooks of
    their own, or every leaf when global module hooks are registered."""
    hooked_globally = bool(nn.modules.module._global_forward_hooks or nn.modules.module._global_forward_pre_hooks)
    return [path.removeprefix(MODEL_PREFIX) for path, m in wrapper.named_modules()
            if path.startswith(MODEL_PREFIX) and tracer.is_leaf_module(m, path)
            and (hooked_globally or _has_forward_hooks(m))]


def trace_symbolic(wrapper: WithLoss, leaf_modules: Iterable = ()) -> torch.fx.GraphModule:
    leaf_paths = tuple(m for m in leaf_modules if isinstance(m, str))
    leaf_types = tuple(m for m in leaf_modules if isinstance(m, type))
    tracer = _Tracer(leaf_paths, leaf_types)
    hooked = hooked_leaves(tracer, wrapper)
    if hooked:
        raise TypeError(f"symbolic_trace would drop the forward hooks of leaf module(s) {hooked[:5]}: it records "
                        f"a leaf as one call without running it. Fix: tracer='export' (or 'auto'), which runs "
                        f"the hooks, or register the hook on a module that contains the leaf.")
    graph = tracer.trace(wrapper)
    _strip_prefix(graph)
    gm = torch.fx.GraphModule(wrapper.model, graph, class_name="GraphparProgram")
    kept = tuple(n.target for n in gm.graph.nodes if n.op == "call_module"
                 and (n.target in leaf_paths or isinstance(gm.get_submodule(n.target), leaf_types or ())))
    lower_leaf_modules(gm, keep=kept)
    gm.recompile()
    return gm
