"""Which embedding tables Strategy.offload_embedding puts in host memory, and their lookups.

Compile-time analysis shared by compile (the argument check), the place_on_host pass, the
planner and verify; the tables' run time is graphpar/runtime/placement/embedding.py.
"""
from __future__ import annotations

import warnings
from typing import Iterator, List, Tuple

import torch
import torch.fx
import torch.nn as nn

from graphpar.ir import record
from graphpar.passes.tp.opinfo import op_of


def _shared_weights(model: nn.Module) -> set:
    seen, shared = set(), set()
    for _, p in model.named_parameters(remove_duplicate=False):
        (shared if id(p) in seen else seen).add(id(p))
    return shared


def host_embedding_paths(model: nn.Module, offload, warn: bool = True) -> List[str]:
    """The module paths of the embeddings `Strategy.offload_embedding` puts on the host
    (`warn`: say which tied tables `True` leaves on the device; compile does, once)."""
    if not offload:
        return []
    modules = dict(model.named_modules())
    shared = _shared_weights(model)
    if offload is True:
        chosen = [path for path, m in modules.items() if isinstance(m, nn.Embedding)]
        tied = [p for p in chosen if id(modules[p].weight) in shared]
        if tied and warn:
            warnings.warn(f"offload_embedding=True leaves {tied} on the device: their weight is tied to "
                          f"another module (e.g. an LM head), which needs the whole table on the device.",
                          stacklevel=3)
        return [p for p in chosen if p not in tied]
    for path in offload:
        _check_path(path, modules, shared)
    return list(offload)


def _check_path(path: str, modules, shared) -> None:
    embeddings = [p for p, m in modules.items() if isinstance(m, nn.Embedding)]
    if path not in modules:
        raise ValueError(f"Strategy.offload_embedding names {path!r}, which is not a module of the model. "
                         f"Fix: use one of its embedding modules: {embeddings}.")
    if not isinstance(modules[path], nn.Embedding):
        raise ValueError(f"Strategy.offload_embedding names {path!r}, a {type(modules[path]).__name__}; only "
                         f"nn.Embedding tables can live on the host. Fix: use one of {embeddings}.")
    if id(modules[path].weight) in shared:
        raise ValueError(f"Strategy.offload_embedding names {path!r}, whose weight is tied to another module "
                         f"(an LM head?); a host table cannot also be a device weight. Fix: untie the weights "
                         f"or leave {path!r} on the device.")


def host_lookups(gm: torch.fx.GraphModule, model: nn.Module, offload) -> Iterator[Tuple[torch.fx.Node, torch.fx.Node]]:
    """(lookup node, table get_attr node) of every embedding placed on the host."""
    paths = set(host_embedding_paths(model, offload))
    for node in list(gm.graph.nodes):
        if node.op in ("call_function", "call_method") and record(node).module_path in paths:
            info = op_of(node)
            if info.kind == "embedding" and isinstance(info.args.get("weight"), torch.fx.Node):
                yield node, info.args["weight"]
