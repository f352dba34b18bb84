"""lower_to_rank: give the graph this rank's own parameters, on this rank's device.

    before: fc_weight = get_attr[fc.weight]   (the user's tensor, full size)
    after:  fc_weight = get_attr[fc.weight]   (this rank's copy of its local shard)

Up to here the graph reads the user's model. This pass builds a fresh root module holding
copies, so training never changes the user's model; names are already canonical (trace
names every tensor by its first state_dict key, so a tied weight is one parameter). A
model on the meta device gets uninitialised storage, flagged in ctx.results.uninitialized
until weights are loaded.
"""
from __future__ import annotations

import copy
from typing import Dict

import torch
import torch.fx
import torch.nn as nn

from graphpar.ir import fetch_attr, first_keys, stamp
from graphpar.ir.layout import local_shard

PASS = "lower_to_rank"


def _owner(root: nn.Module, target: str):
    """The submodule that will hold `target`, created on the way if missing."""
    *path, leaf = target.split(".")
    module = root
    for part in path:
        if not hasattr(module, part):
            module.add_module(part, nn.Module())
        module = getattr(module, part)
    return module, leaf


def _local_copy(tensor: torch.Tensor, device: torch.device, spec, mesh) -> torch.Tensor:
    if spec is not None:
        tensor = local_shard(tensor, spec, mesh.tp_rank, mesh.tp)
    if tensor.is_meta:
        return torch.empty_like(tensor, device=device)
    return tensor.detach().to(device, copy=True)


def _attach(root: nn.Module, target: str, tensor, device, persistent: bool,
            existing: Dict[str, torch.Tensor], spec, mesh) -> None:
    module, leaf = _owner(root, target)
    if leaf in module._parameters or leaf in module._buffers or leaf in module._modules:
        return
    if isinstance(tensor, nn.Module):  # a higher-order op's subgraph (export): stateless code
        module.add_module(leaf, tensor)
        return
    if target in existing:  # a program compiled again (e.g. with its loss) shares the state
        shared = existing[target]
        if isinstance(shared, nn.Parameter):
            module.register_parameter(leaf, shared)
        else:
            module.register_buffer(leaf, shared, persistent=persistent)
        return
    local = _local_copy(tensor, device, spec, mesh)
    if isinstance(tensor, nn.Parameter):
        module.register_parameter(leaf, nn.Parameter(local, requires_grad=tensor.requires_grad))
    else:
        module.register_buffer(leaf, local, persistent=persistent)


def _leaf_module(gm: torch.fx.GraphModule, target: str, device, existing: Dict[str, torch.Tensor]) -> nn.Module:
    """This rank's copy of a module kept whole (leaf_modules). A program compiled again takes
    the tensors of the one before, as get_attr targets do: a fresh copy of the user's module
    would hold untrained weights the optimizer does not step."""
    module = copy.deepcopy(gm.get_submodule(target)).to(device)
    for name in list(module.state_dict(keep_vars=True)):
        shared = existing.get(f"{target}.{name}")
        if shared is not None:
            owner, leaf = _owner(module, name)
            (owner._parameters if leaf in owner._parameters else owner._buffers)[leaf] = shared
    return module


def _held_in_shards(previous, attrs: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """zero=3, compiled again: the parameters live only in the shards of the update program the
    new program shares (graphpar/runtime/zero3.py). The new program gets shape-only stand-ins,
    which shard_parameters replaces by those same shards; nothing whole is built. An expert
    weight's (sharded over edp) has the model's shape: expert_parallel takes the rank's experts of it."""
    update = previous.update if previous is not None else None
    return {name: nn.Parameter(torch.empty(shape if bucket.axis == "dp" else attrs[name].shape,
                                           dtype=attrs[name].dtype, device="meta"))
            for bucket in getattr(update, "unsharded", []) for name, shape in zip(bucket.names, bucket.shapes)
            if name in attrs}


def lower_to_rank(gm: torch.fx.GraphModule, ctx) -> torch.fx.GraphModule:
    device = torch.device(ctx.options.device)
    plan = ctx.results.tp_plan
    planned = plan.params if plan is not None else {}
    attrs: Dict[str, torch.Tensor] = {}
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            attrs[str(node.target)] = fetch_attr(gm, str(node.target))
            stamp(node, PASS)
    existing = {**(ctx.previous.parameters if ctx.previous is not None else {}), **_held_in_shards(ctx.previous, attrs)}
    shards = {name: planned[name] for name in attrs if name in planned}  # this rank's piece of each
    root = nn.Module()
    persistent = set(first_keys(ctx.model).values())
    for target, tensor in attrs.items():
        _attach(root, target, tensor, device, target in persistent, existing, shards.get(target), ctx.mesh)
    ctx.results.param_shards = shards
    for node in gm.graph.nodes:
        if node.op == "call_module":
            module, leaf = _owner(root, str(node.target))
            if not hasattr(module, leaf):
                module.add_module(leaf, _leaf_module(gm, str(node.target), device, existing))
    ctx.results.uninitialized = any(isinstance(t, torch.Tensor) and t.is_meta and name not in existing
                                     for name, t in attrs.items())
    return torch.fx.GraphModule(root, gm.graph, class_name="GraphparProgram")
