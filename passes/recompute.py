"""recompute: activation recomputation (Strategy.recompute), each repeated block one region.

    before: layer_norm = layer_norm(add_3, ...)                 # f32[2, 16, 32] blocks.1.ln_1
            linear_4 = linear(layer_norm, blocks_1_attn_q_weight, ...)
            ...
            add_5 = add(add_4, dropout_3)                       # f32[2, 16, 32] blocks.1
    after:  recompute_1 = self.recompute_1(add_3, blocks_1_ln_1_weight, ...)  # (f32[2, 16, 32]) blocks.1
            add_5 = getitem(recompute_1, 0)                     # f32[2, 16, 32] blocks.1

A region is a maximal run of a block's nodes (a unit that is a child of an nn.ModuleList or
nn.Sequential, see passes/partition_stages.py) in one stage; the run stops at a node that
changes model state (BatchNorm's statistics, an in-place update) or calls a module, which
runs as before between two regions. Its nodes move into a `RecomputeRegion`
(graphpar/runtime/recompute.py): the forward keeps the region's inputs and the outputs of the
calls the mode saves, and the backward runs the region again. The dump prints each region's
body after the program, every node marked `recomputed` or `saved (<ops>)`.

What each mode saves besides the inputs and the dropout masks (below):

    "full"       nothing: the block runs twice (Megatron's full recompute)
    "selective"  the outputs of the matmul and attention calls (SELECTIVE); norms, activations
                 and elementwise ops run again (torchtitan's op-level selective policy)
    f in (0, 1]  the calls that save the most recompute per byte, while what the program saves
                 for one microbatch (every stage) stays within f times its figure without
                 recomputation; refused with the smallest reachable f when "full" is above it

Every mode keeps each region's random draws (its dropout masks, bool: 1 byte an element)
when the replay can take all of them from the forward (graphpar/runtime/recompute.py, `fills`),
so the backward draws nothing: on CPU a mask costs more to draw than the block's other
elementwise work (the 8-layer GPT of benchmarks/bench_recompute.py: half its forward), for a
quarter of the bytes of the fp32 value it masks. Megatron and torch's checkpoint draw them
again. A budget is met at the least recompute cost by a greedy knapsack over the regions' calls:
each call's bytes (its outputs) and cost (COST below), found by running the program on fake
tensors (passes/saved_bytes.py), as the planner does. Identical regions (same calls, same
sizes: the blocks of a stack) decide together, so every block of a stack saves the same
calls, whatever the stage split.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import operator
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Set, Tuple

import torch
import torch.fx
import torch.nn as nn
from torch.utils.flop_counter import flop_registry

from graphpar.ir import NodeRecord, TensorMeta, record, set_record
from graphpar.ir.compiled import RecomputePlan
from graphpar.passes.partition_stages import node_units, unit_containers
from graphpar.passes.saved_bytes import saved_activation_bytes
from graphpar.passes.tracing import on_meta
from graphpar.runtime import ops, recompute as runtime
from graphpar.runtime.experts import ExpertParallel
from graphpar.runtime import sync_batch_norm as sbn
from graphpar.runtime.single_stage import loss_only

PASS = "recompute"
log = logging.getLogger("graphpar")

# "selective" keeps the outputs of these ops (aten names): what is costly to run again
SELECTIVE = frozenset({
    "mm", "addmm", "bmm", "baddbmm", "convolution", "_convolution",
    "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
})
# The cost of running a call again, in flops: a matmul's or attention's multiply-adds; any
# other op is bound by memory traffic, counted as ELEMENTWISE flop-equivalents per output
# element (a few bytes moved per element at a flop/byte ratio of a few: a rough figure, enough
# to rank a norm against a matmul)
ELEMENTWISE = 8
_STATEFUL = (ops.batch_norm, ops.count_batch, sbn.sync_batch_norm)


@dataclass
class Region:
    unit: str
    stage: Optional[int]
    nodes: List[torch.fx.Node]


# ---- finding the regions ---------------------------------------------------------------------

def _in_place(node: torch.fx.Node) -> bool:
    """An op that writes a tensor it is given: an aten op whose schema says so, else (torch
    functions, tensor methods) a trailing underscore or an `out=` argument."""
    schema = getattr(node.target, "_schema", None)
    if node.op == "call_function" and schema is not None:
        return schema.is_mutable
    name = str(node.target) if node.op == "call_method" else getattr(node.target, "__name__", "")
    return (name.endswith("_") and not name.endswith("__")) or "out" in node.kwargs


def _side_effect(node: torch.fx.Node) -> bool:
    """fx's impurity, random ops excepted: a region replays their draws."""
    try:
        return node.is_impure(impure_random=False)
    except TypeError:  # a torch without impure_random: random ops count as impure and stay out of regions
        return node.is_impure()


def _recomputable(node: torch.fx.Node) -> bool:
    return (node.op in ("call_function", "call_method") and node.target not in _STATEFUL
            and not _side_effect(node) and not _in_place(node))


def _is_block(unit: Optional[str], containers: Set[str]) -> bool:
    return unit is not None and unit.rpartition(".")[0] in containers and unit not in containers


def find_regions(gm: torch.fx.GraphModule, model: nn.Module,
                 calls: Sequence[Tuple[torch.fx.Node, ...]] = ()) -> List[Region]:
    """Each block's maximal runs of recomputable nodes in one stage, in graph order. Parameters
    and inputs read inside a run do not break it (they move before the region). `calls`: runs
    of traced nodes that a later pass turns into one module call at the last of them (an
    experts layer under expert parallelism, passes/expert_parallel.py): the planner analyses
    the traced program and must find the regions the compile finds, so the others are passed
    over and the last breaks the run, as that call will."""
    units, containers = node_units(gm, model), unit_containers(model)
    passed_over = {node for call in calls for node in call[:-1]}
    barriers = {call[-1] for call in calls}
    regions: List[Region] = []
    current: Optional[Region] = None
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "get_attr") or node in passed_over:
            continue
        unit = units.get(node)
        recomputable = _recomputable(node) and node not in barriers
        key = (unit, record(node).stage) if _is_block(unit, containers) and recomputable else None
        if current is not None and (current.unit, current.stage) != key:
            regions.append(current)
            current = None
        if key is not None:
            current = current or Region(unit, record(node).stage, [])
            current.nodes.append(node)
    if current is not None:
        regions.append(current)
    return [r for r in regions if sum(isinstance(record(n).value, TensorMeta) for n in r.nodes) >= 2]


# ---- outlining a region into a RecomputeRegion ---------------------------------------------------

def _inputs(region: Region) -> List[torch.fx.Node]:
    members = set(region.nodes)
    return list(dict.fromkeys(a for n in region.nodes for a in n.all_input_nodes if a not in members))


def _outputs(region: Region) -> List[torch.fx.Node]:
    members = set(region.nodes)
    return [n for n in region.nodes if any(u not in members for u in n.users)]


def _body(gm: torch.fx.GraphModule, region: Region, inputs, outputs) -> torch.fx.GraphModule:
    graph, env = torch.fx.Graph(), {}
    for node in inputs:
        env[node] = graph.placeholder(node.name)
        set_record(env[node], record(node))
    for node in region.nodes:
        env[node] = graph.node_copy(node, lambda n: env[n])
    graph.output(tuple(env[n] for n in outputs))
    return torch.fx.GraphModule(gm, graph, class_name="RecomputeBody")


def outline(gm: torch.fx.GraphModule, region: Region, name: str) -> runtime.RecomputeRegion:
    """Move the region's nodes into a RecomputeRegion called where the region began."""
    inputs, outputs = _inputs(region), _outputs(region)
    module = runtime.RecomputeRegion(_body(gm, region, inputs, outputs), unit=region.unit)
    gm.add_module(name, module)
    first, order = region.nodes[0], {n: i for i, n in enumerate(gm.graph.nodes)}
    for node in inputs:  # a parameter first read inside the run
        if order[node] > order[first]:
            first.prepend(node)
    with gm.graph.inserting_before(first):
        call = gm.graph.call_module(name, tuple(inputs))
    set_record(call, NodeRecord(value=tuple(record(n).value for n in outputs), module_path=region.unit,
                                module_type="RecomputeRegion", stage=region.stage, set_by=PASS))
    members = set(region.nodes)
    with gm.graph.inserting_after(call):
        for i, node in reversed(list(enumerate(outputs))):
            value = gm.graph.call_function(operator.getitem, (call, i))
            set_record(value, record(node).replace(PASS))
            node.replace_all_uses_with(value, delete_user_cb=lambda user: user not in members)
    for node in reversed(region.nodes):
        gm.graph.erase_node(node)
    return module


# ---- what each call costs ------------------------------------------------------------------------

def call_cost(func, args, kwargs, out) -> float:
    """Flops to run the call again (see ELEMENTWISE for ops that are not matmuls)."""
    packet = func.overloadpacket
    if any(r.alias_info is not None for r in func._schema.returns):
        return 0.0  # a view (or an in-place op's result): no work of its own
    if packet in flop_registry:
        return float(flop_registry[packet](*args, **kwargs, out_val=out))
    if packet.__name__.startswith("_scaled_dot_product"):
        q, k = args[0], args[1]   # [..., s_q, d] and [..., s_k, d]: QK^T and PV
        return 4.0 * math.prod(q.shape[:-1]) * k.shape[-2] * q.shape[-1]
    return float(ELEMENTWISE * sum(t.numel() for t in runtime.tensors_in(out)))


# ---- choosing what to save -------------------------------------------------------------------

@dataclass(frozen=True)
class _Call:
    call: runtime.Call
    savable: bool
    draws: bool
    nbytes: int
    cost: float


def _calls(infos: Sequence[runtime.CallInfo]) -> List[_Call]:
    """Each call of a region's profile; a draw is kept as a copy, so a later write to what it
    filled does not stop it being kept."""
    calls = []
    for i in infos:
        draws = runtime.draws(i.func, i.args, i.kwargs)
        calls.append(_Call(i.call, runtime.savable(i.func, i.args, i.kwargs) and (draws or not i.overwritten), draws,
                           runtime.kept_bytes(i.func, i.args, i.kwargs, i.out),
                           call_cost(i.func, i.args, i.kwargs, i.out)))
    return calls


def _masks(calls: Sequence[_Call]) -> Set[runtime.Call]:
    """The region's random draws when every one can be kept (a fill), else none: a draw skipped
    in the replay before one made would shift the stream it draws from."""
    drawn = [c for c in calls if c.draws]
    return {c.call for c in drawn} if all(c.savable for c in drawn) else set()


def _selective(calls: Sequence[_Call]) -> Set[runtime.Call]:
    return {c.call for c in calls if c.savable and c.call[1].split(".")[1] in SELECTIVE}


def _signature(calls: Sequence[_Call]) -> Tuple:
    return tuple((c.call[1], c.nbytes, c.cost) for c in calls)


def _budget(profiles: Dict[runtime.RecomputeRegion, List[_Call]], room: float,
            weights: Dict[str, int]) -> Dict[runtime.RecomputeRegion, Set[runtime.Call]]:
    """Greedy knapsack: positions of identical regions' calls, most cost saved per byte first,
    while their bytes (times how many regions share them) fit in `room`."""
    groups: Dict[Tuple, List[runtime.RecomputeRegion]] = {}
    for region, calls in profiles.items():
        groups.setdefault(_signature(calls), []).append(region)
    items = []
    for g, (signature, regions) in enumerate(groups.items()):
        count = sum(weights.get(r.unit, 1) for r in regions)
        calls = profiles[regions[0]]
        items += [(c.cost / c.nbytes, -g, -i, count * c.nbytes, regions, i)
                  for i, c in enumerate(calls) if c.savable and not c.draws and c.nbytes > 0]
    chosen: Dict[runtime.RecomputeRegion, Set[runtime.Call]] = {r: set() for r in profiles}
    for _, _, _, nbytes, regions, i in sorted(items, key=lambda item: item[:3], reverse=True):
        if nbytes <= room:
            room -= nbytes
            for region in regions:
                chosen[region].add(profiles[region][i].call)
    return chosen


def _mark(region: runtime.RecomputeRegion, skipped) -> None:
    """Each body node's record says whether backward runs it again, keeps its outputs or skips
    its calls (their values are read by nothing backward needs)."""
    for node in region.body.graph.nodes:
        if node.op not in ("placeholder", "output"):
            marks = [f"{what} ({', '.join(ops)})" for what, calls in (("saved", region.saves), ("skipped", skipped))
                     if (ops := _ops_of(node.name, calls))]
            set_record(node, record(node).replace(PASS, recompute=", ".join(marks) or "recomputed"))


def _ops_of(node: str, calls) -> List[str]:
    return [op.removeprefix("aten.").removesuffix(".default") for n, op, _ in sorted(calls) if n == node]


def apply_recompute(gm: torch.fx.GraphModule, model: nn.Module, mode, measure: Callable[[torch.fx.GraphModule], int],
                    weights: Optional[Dict[str, int]] = None,
                    calls: Sequence[Tuple[torch.fx.Node, ...]] = ()) -> Optional[RecomputePlan]:
    """Outline the regions of `gm` and choose what they save under `mode`. `measure(gm)`
    returns the bytes a fake run of the program saves for backward (every stage, one
    microbatch); `weights` counts a region of a unit as that many (the planner's surrogate of
    a deep stack stands for its other blocks with one); `calls` as find_regions. Returns None
    when nothing applies."""
    regions = find_regions(gm, model, calls)
    if not regions:
        return None
    before = measure(gm)
    modules = [outline(gm, region, f"recompute_{i}") for i, region in enumerate(regions)]
    gm.recompile()
    with runtime.profiling() as found:
        bare = measure(gm)
    profiles = {m: _calls(found.get(m, [])) for m in modules}
    masks = {m: _masks(profiles[m]) for m in modules}
    # a call the replay skips whatever is kept costs nothing to run again: never worth its bytes
    idle = {m: runtime.skipped_calls(found.get(m, []), frozenset(masks[m])) for m in modules}
    profiles = {m: [dataclasses.replace(c, savable=c.savable and c.call not in idle[m]) for c in profiles[m]]
                for m in modules}
    weight = {m: (weights or {}).get(m.unit, 1) for m in modules}  # a planner's surrogate block stands for several
    floor = bare + sum(weight[m] * c.nbytes for m in modules for c in profiles[m] if c.call in masks[m])
    chosen = {m: set() for m in modules}
    if mode == "selective":
        chosen = {m: _selective(profiles[m]) for m in modules}
    elif isinstance(mode, float):
        _check_reachable(mode, floor, before)
        chosen = _budget(profiles, mode * before - floor, weights or {})
    skipped = {}
    for m in modules:
        m.saves, m.masks = frozenset(chosen[m] | masks[m]), bool(masks[m])
        skipped[m] = runtime.skipped_calls(found.get(m, []), m.saves)
        _mark(m, skipped[m])
    after = measure(gm) if any(m.saves for m in modules) else bare
    flops: Dict[str, float] = {}
    for m in modules:
        flops[m.unit] = flops.get(m.unit, 0.0) + sum(c.cost for c in profiles[m]
                                                     if c.call not in m.saves and c.call not in skipped[m])
    total = sum((weights or {}).get(unit, 1) * f for unit, f in flops.items())
    return RecomputePlan(mode, sum(weight.values()), sum(weight[m] * len(chosen[m]) for m in modules), before,
                         after, flops, total, sum(weight[m] * len(masks[m]) for m in modules),
                         sum(weight[m] * len(skipped[m]) for m in modules))


def _check_reachable(fraction: float, floor: int, before: int) -> None:
    if floor <= fraction * before:
        return
    least = floor / before
    raise ValueError(
        f"Strategy.recompute={fraction:g} cannot be met: with every block recomputed in full the program still "
        f"saves {floor} bytes per microbatch for backward, {least:.3f} of the {before} bytes it saves without "
        f"recomputation (the inputs of each block and what runs outside the blocks: embeddings, the head, the "
        f"loss). Fix: a budget of at least recompute={math.ceil(least * 1000) / 1000:g}, recompute='full', or more "
        f"pipeline or tensor parallelism to split the activations.")


# ---- the pass ---------------------------------------------------------------------------------

def _measure(ctx) -> Callable[[torch.fx.GraphModule], int]:
    inputs, meta = ctx.graph_inputs(), on_meta(ctx.model)
    loss_outputs = ctx.results.program.loss_outputs

    def measure(gm: torch.fx.GraphModule) -> int:
        training = loss_only(gm, loss_outputs) if loss_outputs else gm
        return sum(saved_activation_bytes(training, inputs, ctx.mesh, meta, experts_stand_ins(training))[0].values())
    return measure


def experts_stand_ins(gm: torch.fx.GraphModule) -> Dict[torch.fx.Node, torch.fx.Node]:
    """The calls of experts modules expert_parallel left in `gm`, each with its routing weights.
    No region takes them (they call a module) and no mode changes what they save inside,
    which depends on the routing (a fake run sees none): those saves are not counted, and of
    their inputs each keeps the routing weights, which multiply its pairs' outputs
    (graphpar/runtime/experts.py), and nothing else. The planner counts its traced experts
    layers so (graphpar/planner/plan.py), so both weigh a budget on the same bytes."""
    return {n: n.args[2] for n in gm.graph.nodes
            if n.op == "call_module" and isinstance(gm.get_submodule(n.target), ExpertParallel)}


def recompute(gm: torch.fx.GraphModule, ctx) -> torch.fx.GraphModule:
    mode = ctx.strategy.recompute
    if mode is None:
        return gm
    plan = apply_recompute(gm, ctx.model, mode, _measure(ctx))
    if plan is None:
        log.warning("Strategy.recompute=%r: the model has no repeated blocks (children of an nn.ModuleList or "
                    "nn.Sequential) to recompute; it trains as without recomputation.", mode)
        return gm
    ctx.results.recompute = plan
    log.info("%s", plan.explain())
    return gm
