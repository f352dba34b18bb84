"""expert_parallel: split each mixture-of-experts layer's experts over the ep ranks.

    before: the experts module's traced code (sort by expert, grouped matmuls, the weighted sum)
            reading the whole 3-D expert weights
    after:  experts = call_module[<path>](hidden, top_k_index, top_k_weights)
            <path> is this rank's copy of the experts module, holding E/ep experts, whose
            forward dispatches and combines tokens with all-to-all (graphpar/runtime/experts.py)

An experts module is found in the graph by what it reads and how it is called: a module of
the model whose own parameters all have one leading size E > 1, one of them at least 3-D
([E, out, in]: a router's [E, H] weight is not an experts module) (the experts, the fused
layout of `transformers`: Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, ...) and an int attribute
`num_experts` equal to E, whose traced nodes take three tensors from outside, the hidden
rows [T, H], the routing weights [T, K] and the routing indices [T, K] (an integer tensor),
and give one [T, H] value back. The router stays in the graph, replicated: every rank routes
its own tokens exactly as one device would. Runs after lower_to_rank, on this rank's copies.

Experts held as E modules of a container (the list layout: SwitchTransformers, a user's
ModuleList; passes/tracing/expert_lists.py, which traced the container as its dense function)
are found by the container and called the same way, or with a one-hot [T, K, E] mask in place
of the indices; this rank's copy of the container holds its E/ep expert modules whole, under
their own names.

With Strategy.expert_tp = tp (expert tensor parallelism) it also runs at ep = 1, and each
expert weight this rank keeps is its tp rank's piece: gate_up_proj's columns (of the gate and
of the up projection), down_proj's matching rows (check_expert_tp_layout says which layouts).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Dict, List, Tuple

import torch
import torch.fx
import torch.nn as nn

from graphpar.ir import TensorMeta, copy_record, record
from graphpar.passes.tracing.expert_lists import ExpertParallelError, check_expert_list, is_expert_list
from graphpar.runtime.experts import DOWN, GATE_UP, expert_parallel_class, tp_piece

PASS = "expert_parallel"
__all__ = ["ExpertParallelError", "expert_parallel"]


@dataclass(frozen=True)
class ExpertsLayer:
    path: str                     # the experts module's path in the model
    experts: int                  # E
    params: Tuple[str, ...]       # its parameters' names (each [E, ...]; list layout: every expert's)
    keys: Tuple[str, ...] = ()    # list layout: the expert modules' names, in expert order (fused: none)


def expert_parallel(gm: torch.fx.GraphModule, ctx) -> torch.fx.GraphModule:
    ep = ctx.strategy.ep
    if not ctx.strategy.splits_experts:
        return gm
    layers = find_experts_layers(ctx.model, gm)
    if not layers:
        split = f"ep={ep}" if ctx.strategy.expert_tp == 1 else f"ep={ep}, expert_tp={ctx.strategy.expert_tp}"
        raise ExpertParallelError(
            f"Strategy.{split} found no mixture-of-experts layer in {type(ctx.model).__name__}: no module reads "
            f"parameters whose leading size is its num_experts and is called with (hidden, top_k_index, "
            f"top_k_weights), the experts layout of transformers' Mixtral, Qwen-MoE and OLMoE, and no "
            f"nn.ModuleList or nn.ModuleDict with num_experts and a forward holds expert modules (the list "
            f"layout, SwitchTransformers') (docs/expert-parallel.md). Fix: use ep=1 (and expert_tp=1) for a model "
            f"without such layers.")
    shards: Dict[str, int] = {}
    owners: Dict[str, int] = {}
    for layer in layers:
        _check_divisible(layer, ep)
        check_expert_tp_layout(ctx.model.get_submodule(layer.path), layer, ctx.strategy.expert_tp)
        _outline(gm, layer, ctx)
        if layer.keys:
            layer_owners = list_owners(layer, ep)
            owners.update(layer_owners)
            shards.update({name: layer.experts for name, rank in layer_owners.items() if rank == ctx.mesh.ep_rank})
        else:
            shards.update({f"{layer.path}.{name}": layer.experts for name in layer.params})
    ctx.results.expert_shards = shards
    ctx.results.expert_owners = owners
    gm.graph.lint()
    gm.recompile()
    return gm


def find_experts_layers(model: nn.Module, gm: torch.fx.GraphModule) -> List[ExpertsLayer]:
    """The experts modules of `model` the graph reads, in model order."""
    read = {str(n.target) for n in gm.graph.nodes if n.op == "get_attr"}
    return [layer for layer in experts_modules(model) if all(f"{layer.path}.{name}" in read for name in layer.params)]


def experts_modules(model: nn.Module) -> List[ExpertsLayer]:
    """The modules of `model` holding experts by their parameters (the planner's view, which
    does not look at the graph)."""
    layers = []
    for path, module in model.named_modules():
        if is_expert_list(module):
            found = check_expert_list(path, module)
            layers.append(ExpertsLayer(path, len(found.keys), tuple(f"{key}.{name}" for key in found.keys
                                                                    for name in found.params), found.keys))
            continue
        params = dict(module.named_parameters(recurse=False))
        experts = getattr(module, "num_experts", None)
        if not params or not isinstance(experts, int) or experts < 2:
            continue
        stacked = all(p.dim() >= 2 and p.shape[0] == experts for p in params.values()) and \
            any(p.dim() >= 3 for p in params.values())   # a router's [E, H] weight is not experts
        if stacked:
            layers.append(ExpertsLayer(path, experts, tuple(params)))
    return layers


def _check_divisible(layer: ExpertsLayer, ep: int) -> None:
    if layer.experts % ep:
        options = [d for d in range(2, layer.experts + 1) if layer.experts % d == 0]
        raise ExpertParallelError(
            f"Strategy.ep={ep} cannot split the {layer.experts} experts of {layer.path!r}: each ep rank holds "
            f"an equal share, so ep must divide the number of experts. Fix: use ep="
            f"{' or ep='.join(map(str, options))}, or ep=1.")


def list_owners(layer: ExpertsLayer, ep: int) -> Dict[str, int]:
    """Every parameter of a list layout's experts (canonical name) -> the ep rank holding its
    expert: rank r holds experts r * E/ep .. (r + 1) * E/ep - 1."""
    share = layer.experts // ep
    return {f"{layer.path}.{name}": layer.keys.index(name.split(".")[0]) // share for name in layer.params}


def check_expert_tp_layout(module: nn.Module, layer: ExpertsLayer, expert_tp: int) -> None:
    """Expert tensor parallelism splits the fused layout of transformers' gated experts: exactly
    gate_up_proj [E, 2I, H] (the gate's I rows, then the up projection's, halves of one matmul's
    output that the default gating multiplies) and down_proj [E, H, I], no bias, not transposed,
    with I a multiple of expert_tp."""
    if expert_tp == 1:
        return
    params = dict(module.named_parameters(recurse=False))
    gate_up, down = params.get(GATE_UP), params.get(DOWN)
    gate = getattr(type(module), "_apply_gate", None)
    fused = (set(params) == {GATE_UP, DOWN} and gate_up.dim() == down.dim() == 3
             and gate_up.shape[1] == 2 * down.shape[2] and gate_up.shape[2] == down.shape[1]
             and not getattr(module, "is_transposed", False)
             and getattr(gate, "__name__", "_default_apply_gate") == "_default_apply_gate")
    shapes = ", ".join(f"{name} {list(p.shape)}" for name, p in params.items())
    if not fused:
        raise ExpertParallelError(
            f"Strategy.expert_tp={expert_tp} cannot split the experts of {layer.path!r} ({type(module).__name__}: "
            f"{shapes}): expert tensor parallelism splits the fused gated layout of transformers' experts, exactly "
            f"gate_up_proj [E, 2I, H] (gate rows, then up rows; the default gating) and down_proj [E, H, I], "
            f"without bias or transposed weights. Fix: use expert_tp=1 for this model (ep still splits its experts).")
    if down.shape[2] % expert_tp:
        raise ExpertParallelError(
            f"Strategy.expert_tp={expert_tp} cannot split the experts of {layer.path!r} ({shapes}): each tp rank "
            f"takes an equal share of the {down.shape[2]} intermediate features, so expert_tp must divide "
            f"{down.shape[2]}. Fix: use expert_tp=1, or a tp dividing {down.shape[2]} with expert_tp=tp.")


def _in_layer(node: torch.fx.Node, path: str) -> bool:
    if node.op not in ("call_function", "call_method", "call_module"):
        return False
    module = record(node).module_path
    return module == path or module.startswith(path + ".")


@dataclass(frozen=True)
class ExpertsCall:
    """Where an experts layer is in a traced graph: its nodes and the values of its call."""
    layer: ExpertsLayer
    region: Tuple[torch.fx.Node, ...]   # its traced nodes, in graph order
    hidden: torch.fx.Node               # [T, H]
    top_k_index: torch.fx.Node          # [T, K], integer
    top_k_weights: torch.fx.Node        # [T, K]
    output: torch.fx.Node               # [T, H]

    @property
    def replaced(self) -> Tuple[torch.fx.Node, ...]:
        """Its traced nodes with the output last: the pass puts the module call where the
        output was (what passes/recompute.py find_regions takes as one call)."""
        return tuple(n for n in self.region if n is not self.output) + (self.output,)


def experts_call(gm: torch.fx.GraphModule, layer: ExpertsLayer) -> ExpertsCall:
    """The traced code of `layer` in `gm` and the three values it takes (or the error)."""
    region = [n for n in gm.graph.nodes if _in_layer(n, layer.path)]
    inside = set(region)
    weights = {f"{layer.path}.{name}" for name in layer.params}
    inputs = list(dict.fromkeys(a for n in region for a in n.all_input_nodes
                                if a not in inside and not (a.op == "get_attr" and str(a.target) in weights)))
    outputs = [n for n in region if any(u not in inside for u in n.users)]
    hidden, top_k_weights, top_k_index = _interface(layer, inputs, outputs)
    return ExpertsCall(layer, tuple(region), hidden, top_k_index, top_k_weights, outputs[0])


def _outline(gm: torch.fx.GraphModule, layer: ExpertsLayer, ctx) -> None:
    graph = gm.graph
    found = experts_call(gm, layer)
    check_tokens_split(found, ctx.strategy)
    region, hidden, top_k_index, top_k_weights = found.region, found.hidden, found.top_k_index, found.top_k_weights
    weights = {f"{layer.path}.{name}" for name in layer.params}
    out = found.output
    with graph.inserting_before(out):
        call = graph.call_module(layer.path, (hidden, top_k_index, top_k_weights))
    copy_record(out, call, PASS, module_path=layer.path, module_type=type(ctx.model.get_submodule(layer.path)).__name__)
    out.replace_all_uses_with(call)
    for node in reversed(region):
        graph.erase_node(node)
    _install_local_experts(gm, layer, ctx)
    for node in [n for n in graph.nodes if n.op == "get_attr" and str(n.target) in weights]:
        if node.users:
            raise ExpertParallelError(
                f"{node.target!r} is read outside the experts module {layer.path!r} "
                f"({', '.join(u.name for u in node.users)}), so it cannot be split over the ep ranks. "
                f"Fix: use ep=1 for this model, or read expert weights only inside the experts module.")
        graph.erase_node(node)


def check_tokens_split(found: ExpertsCall, strategy) -> None:
    """With tp > 1 each tp rank of a replica dispatches its 1/tp of the layer's tokens
    (graphpar/runtime/experts.py), which every tp rank holds whole: tensor parallelism has no
    rule for an experts module or for what consumes it, so it leaves the module's inputs and
    weights replicated (the router too: its softmax is over the experts). The tokens must
    split evenly."""
    tp, layer = strategy.tp, found.layer
    tokens = record(found.hidden).value.shape[0]
    if tokens % tp and strategy.expert_tp == 1:   # with expert_tp every tp rank dispatches all
        raise ExpertParallelError(
            f"Strategy.ep={strategy.ep} with tp={tp}: the experts module {layer.path!r} gets {tokens} tokens "
            f"per microbatch, which the {tp} tp ranks of a replica cannot dispatch in equal shares (each sends "
            f"tokens / tp). Fix: use a batch whose tokens per microbatch are a multiple of {tp}, or tp=1.")


def _interface(layer: ExpertsLayer, inputs, outputs):
    """(hidden, top_k_weights, top_k_index) among the region's inputs, or the error."""
    values = [record(n).value for n in inputs]
    shapes = ", ".join(f"{n.name}: {record(n).value.describe() if isinstance(record(n).value, TensorMeta) else '-'}"
                       for n in inputs)
    if len(inputs) == 3 and len(outputs) == 1 and all(isinstance(v, TensorMeta) for v in values):
        index = [n for n, v in zip(inputs, values) if not v.dtype.is_floating_point]
        floats = [n for n, v in zip(inputs, values) if v.dtype.is_floating_point]
        if len(index) == 1 and len(floats) == 2:
            k = record(index[0]).value.shape
            if layer.keys and len(k) == 3 and k[2] == layer.experts:   # a one-hot mask [T, K, E]
                k = k[:2]
            routing = [n for n in floats if record(n).value.shape == k]
            other = [n for n in floats if record(n).value.shape != k]
            if len(routing) == 1 and len(other) == 1 and len(k) == 2:
                return other[0], routing[0], index[0]
    raise ExpertParallelError(
        f"the experts module {layer.path!r} is not called as forward(hidden [T, H], top_k_index [T, K], "
        f"top_k_weights [T, K]) -> [T, H]: its traced code takes {len(inputs)} value(s) from outside ({shapes}) "
        f"and gives {len(outputs)} back. Fix: use ep=1 for this model; expert parallelism follows the experts "
        f"interface of transformers (docs/expert-parallel.md).")


def _install_local_experts(gm: torch.fx.GraphModule, layer: ExpertsLayer, ctx) -> None:
    """This rank's copy of the experts module, holding experts ep_rank*E/ep .. (ep_rank+1)*E/ep
    (with expert_tp, this tp rank's piece of each: graphpar/runtime/experts.py tp_piece)."""
    user = ctx.model.get_submodule(layer.path)
    if layer.keys:
        _install_local_list(gm, layer, user, ctx)
        return
    if any(True for _ in user.parameters(recurse=False)) and any(
            any(True for _ in child.parameters()) for child in user.children()):
        raise ExpertParallelError(
            f"the experts module {layer.path!r} has submodules with parameters of their own, which expert "
            f"parallelism does not split yet. Fix: use ep=1 for this model.")
    local = copy.copy(user)
    local.__dict__.update(_parameters={}, _buffers=dict(user._buffers), _modules=dict(user._modules))
    local.__class__ = expert_parallel_class(type(user))
    share = layer.experts // ctx.strategy.ep
    first = ctx.mesh.ep_rank * share
    previous = ctx.previous.parameters if ctx.previous is not None else {}
    for name in layer.params:
        target = f"{layer.path}.{name}"
        full = gm.get_parameter(target)
        shared = previous.get(target)
        block = full.detach()[first:first + share]
        if ctx.strategy.expert_tp > 1:
            block = tp_piece(name, block, ctx.mesh.tp_rank, ctx.strategy.expert_tp)
        local.register_parameter(name, shared if shared is not None else nn.Parameter(
            block.clone(), requires_grad=full.requires_grad))
    local.num_experts = share
    local.global_experts = layer.experts
    local.expert_tp = ctx.strategy.expert_tp
    local.capacity_factor = ctx.strategy.expert_capacity_factor
    local.dropped_pairs = 0
    parent, _, leaf = layer.path.rpartition(".")
    gm.get_submodule(parent).add_module(leaf, local)


def _install_local_list(gm: torch.fx.GraphModule, layer: ExpertsLayer, user: nn.Module, ctx) -> None:
    """This rank's copy of a list layout's container, holding its E/ep expert modules under
    their own names, each a copy of the user's module around this rank's parameters."""
    share = layer.experts // ctx.strategy.ep
    mine = layer.keys[ctx.mesh.ep_rank * share:(ctx.mesh.ep_rank + 1) * share]
    previous = ctx.previous.parameters if ctx.previous is not None else {}
    local = copy.copy(user)
    local.__dict__.update(_parameters={}, _buffers={}, _modules={})
    local.__class__ = expert_parallel_class(type(user), listed=True)
    for key in mine:
        expert = _module_tree(user.get_submodule(key))
        for name, _ in user.get_submodule(key).named_parameters():
            target = f"{layer.path}.{key}.{name}"
            owner, _, leaf = name.rpartition(".")
            expert.get_submodule(owner).register_parameter(leaf, previous.get(target, gm.get_parameter(target)))
        local.add_module(key, expert)
    local.held = tuple(name for name, _ in local.named_parameters())
    local.num_experts = share
    local.global_experts = layer.experts
    local.listed_params = layer.params   # every ep rank's experts' (parameter_readers stages them all)
    local.expert_tp = 1
    local.capacity_factor = ctx.strategy.expert_capacity_factor
    local.dropped_pairs = 0
    parent, _, leaf = layer.path.rpartition(".")
    gm.get_submodule(parent).add_module(leaf, local)


def _module_tree(module: nn.Module) -> nn.Module:
    """A copy of `module` and its submodules (the objects, not their tensors), whose
    parameters are to be registered anew (None, as a Linear's absent bias, stays None)."""
    copied = copy.copy(module)
    copied.__dict__.update(_parameters=dict.fromkeys(module._parameters), _buffers=dict(module._buffers),
                           _modules={name: _module_tree(child) for name, child in module._modules.items()})
    return copied
