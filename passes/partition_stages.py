"""partition_stages: decide the pipeline stage of every node (tag; split_stages applies it).

    before: linear = linear(ln_1, q_weight, q_bias)       # f32[2, 16, 32] R blocks.0.attn.q
    after:  linear = linear(ln_1, q_weight, q_bias)       # f32[2, 16, 32] R stage 0 blocks.0.attn.q

The graph's nodes are grouped into units, the model's layers in execution order: each child
of an nn.ModuleList / nn.Sequential (a repeated block, with everything inside it) is one
unit, and any other module that runs ops (an embedding, a final norm, an LM head) is one.
The Strategy.partition policy (passes/partition_policies.py) splits the unit list into
pp * virtual_stages contiguous stages. Nodes outside any module (position ids, the loss)
go to the first stage where all their inputs exist, and no node runs before its inputs.
Parameters and inputs get no stage: every stage that reads them has its own get_attr /
placeholder. The plan is left in ctx.results.stage_plan. No-op at one stage.

A program compiled again (the lazy loss trace, another input shape) keeps the cut of the
program before it (ctx.previous.stage_plan): its stages hold the same parameters, and a
"profile" cut is not measured again (the measurement is a collective, and its times vary).
"""
from __future__ import annotations

import datetime
import logging
import time
from collections import Counter
from typing import Dict, List, Optional, Set

import torch
import torch.fx
import torch.nn as nn

from graphpar.distributed import groups as distributed
from graphpar.ir import TensorMeta, record, stamp
from graphpar.ir.compiled import StagePlan
from graphpar.passes.partition_policies import Unit, describe_partition, partition
from graphpar.passes.tracing.expert_lists import expert_list_paths, is_expert_list

PASS = "partition_stages"
log = logging.getLogger("graphpar")


def unit_containers(model: nn.Module) -> Set[str]:
    """Paths of the model's nn.ModuleList and nn.Sequential: each child is a unit. Not a list of
    experts (passes/tracing/expert_lists.py): its experts are one call, one unit (unit_of), which
    a stage cut must not split (expert parallelism puts the call on one stage)."""
    return {name for name, m in model.named_modules()
            if isinstance(m, (nn.ModuleList, nn.Sequential)) and not is_expert_list(m)}


def unit_of(path: str, containers: Set[str], wholes: Set[str] = frozenset()) -> Optional[str]:
    """The unit a module path belongs to: its first ancestor that is a container's child, or
    one of `wholes` (a list of experts), whichever is outer."""
    if not path:
        return None
    parts = path.split(".")
    for i in range(1, len(parts) + 1):
        parent, own = ".".join(parts[:i - 1]), ".".join(parts[:i])
        if parent in containers or own in wholes:
            return own
    return path


def node_units(gm: torch.fx.GraphModule, model: nn.Module) -> Dict[torch.fx.Node, Optional[str]]:
    """The unit (a layer's module path, see unit_of) of every computing node; None outside any
    module. The planner costs each unit with this and build_units, as if each were a stage."""
    containers, wholes = unit_containers(model), set(expert_list_paths(model))
    units = {}
    for node in gm.graph.nodes:
        if node.op in ("call_function", "call_method", "call_module"):
            units[node] = unit_of(record(node).module_path, containers, wholes)
    return units


def _param_numel(node: torch.fx.Node) -> int:
    value = record(node).value
    return value.numel if isinstance(value, TensorMeta) and value.requires_grad else 0


def build_units(gm, model, node_units, seconds: Optional[Dict[str, float]] = None) -> List[Unit]:
    """The model's units in execution order, with the parameters each reads (and its measured
    seconds, for partition='profile')."""
    containers, seconds = unit_containers(model), seconds or {}
    reads: Dict[str, Dict[str, int]] = {}  # unit -> {parameter: elements}, units in execution order
    for node, unit in node_units.items():
        if unit is None:
            continue
        params = reads.setdefault(unit, {})
        for source in node.all_input_nodes:
            if source.op == "get_attr" and _param_numel(source):
                params[str(source.target)] = _param_numel(source)
    # every stage reading a tied weight holds a copy, so each reader counts it (Unit.tied)
    readers = Counter(name for params in reads.values() for name in params)
    parent = lambda u: u.rpartition(".")[0]  # noqa: E731
    return [Unit(path=u, module_type=_type_name(model, u), params=sum(params.values()),
                 repeated=parent(u) in containers or (u.count(".") == 0 and "" in containers),
                 seconds=seconds.get(u, 0.0),
                 tied=tuple((name, size) for name, size in params.items() if readers[name] > 1))
            for u, params in reads.items()]


def _type_name(model: nn.Module, path: str) -> str:
    try:
        return type(model.get_submodule(path)).__name__
    except AttributeError:
        return ""


class _UnitTimer(torch.fx.Interpreter):
    """Runs the graph for real and adds each node's time to its unit ("profile" policy)."""

    def __init__(self, gm, node_units):
        super().__init__(gm)
        self.node_units = node_units
        self.seconds: Dict[str, float] = {}

    def run_node(self, n):
        start = time.perf_counter()
        result = super().run_node(n)
        unit = self.node_units.get(n)
        if unit is not None:
            self.seconds[unit] = self.seconds.get(unit, 0.0) + time.perf_counter() - start
        return result


def _profile(gm, node_units, ctx) -> Dict[str, float]:
    if any(t.is_meta for t in ctx.model.parameters()):
        raise ValueError("Strategy(partition='profile') times each layer on the example inputs, but the "
                         "model is on the meta device. Fix: use partition='parameters' or a model with weights.")
    timer = _UnitTimer(gm, node_units)
    with torch.no_grad():
        for _ in range(2):  # the first run warms allocator and kernels up; keep the second
            timer.seconds = {}
            timer.run(*ctx.graph_inputs())
    return _agreed(timer.seconds, sorted({u for u in node_units.values() if u is not None}))


def _agreed(seconds: Dict[str, float], units) -> Dict[str, float]:
    """Every rank measures its own times, which differ: left alone, ranks would choose
    different cuts and run mismatched stage programs. Under a process group (compile, not
    lower_rank or the planner) every rank takes the mean over the world's measurements."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return seconds
    world = torch.distributed.get_world_size()
    times = torch.tensor([seconds.get(u, 0.0) for u in units], dtype=torch.float64)
    work = torch.distributed.all_reduce(times, async_op=True)
    work.wait(datetime.timedelta(seconds=distributed.DEFAULT_TIMEOUT_S))  # read now: set_timeout may change it
    return {u: float(t) / world for u, t in zip(units, times)}


def assign_stages(gm, node_units, stage_of_unit, last: int) -> None:
    """Layer nodes take their unit's stage. Glue nodes outside any module run where they are
    first needed (position ids at the embedding, the target's reshape at the loss), so the
    forward-only program never reads the target; then no node may run before its inputs."""
    computed = [n for n in gm.graph.nodes if n.op in ("call_function", "call_method", "call_module")]
    stages: Dict[torch.fx.Node, int] = {n: stage_of_unit[node_units[n]] for n in computed
                                        if node_units.get(n) is not None}
    for node in reversed(computed):
        if node not in stages:
            readers = [last if u.op == "output" else stages.get(u) for u in node.users]
            readers = [r for r in readers if r is not None]
            stages[node] = min(readers) if readers else 0
    for node in computed:
        stages[node] = max([stages[node]] + [stages[n] for n in node.all_input_nodes if n in stages])
        stamp(node, PASS, stage=stages[node])


def partition_stages(gm, ctx):
    num_stages = ctx.strategy.pp * ctx.strategy.virtual_stages
    if num_stages == 1:
        return gm
    units_of_nodes = node_units(gm, ctx.model)
    previous = ctx.previous.stage_plan if ctx.previous is not None else None
    if previous is not None:
        # a unit the earlier program lacked (a loss module's) runs where it is needed, as glue does
        known = {node: unit if unit in previous.stage_of_unit else None for node, unit in units_of_nodes.items()}
        assign_stages(gm, known, previous.stage_of_unit, num_stages - 1)
        ctx.results.stage_plan = previous
        return gm
    seconds = _profile(gm, units_of_nodes, ctx) if ctx.strategy.partition == "profile" else {}
    units = build_units(gm, ctx.model, units_of_nodes, seconds)
    bounds = partition(units, num_stages, ctx.strategy.partition)
    stage_of_unit = {}
    for stage, start in enumerate(bounds):
        end = bounds[stage + 1] if stage + 1 < len(bounds) else len(units)
        for unit in units[start:end]:
            stage_of_unit[unit.path] = stage
    assign_stages(gm, units_of_nodes, stage_of_unit, num_stages - 1)
    description = describe_partition(units, bounds, ctx.strategy.partition)
    if ctx.rank == 0:
        log.info("pipeline partition (%s):\n%s", ctx.strategy.partition, description)
    ctx.results.stage_plan = StagePlan(num_stages, units, bounds, stage_of_unit, description)
    return gm
