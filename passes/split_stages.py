"""split_stages: cut the rank's graph into one GraphModule per local pipeline stage.

    before: one graph, every node tagged with its stage (partition_stages)
    after:  root graph of this rank, its local stages as submodules:
                input_0 = placeholder                  # the batch (every rank gets it)
                add_7 = placeholder                    # received from stage 0
                stage_1 = self.stage_1(add_7, target)  # (loss,) or the values sent on
                return (getitem,)

A value crosses the cut between stages b-1 and b when it is computed before b and read at
b or later: it is sent to b, and a stage that only passes it on (a skip connection, position
ids, a mask) receives it and sends it again, so every transfer is between neighbours. Any
kind of tensor may cross (integer ids, boolean masks, values that need no gradient); a
gradient travels back only for those that need one. Stage s lives on pp rank s % pp, so a
rank holds stages r, r + pp, ... (interleaved schedules), or under zbv on the V's rank (r
and 2pp - 1 - r; graphpar.strategy.stage_rank is the rule). Each stage reads only the
parameters it uses; the loss runs inside the last stage. ctx.results.stages describes each
local stage for the executor: its inputs, what it receives and what it sends.
"""
from __future__ import annotations

import operator
from typing import Dict, List

import torch
import torch.fx
import torch.nn as nn

from graphpar.ir import TensorMeta, copy_record, describe_kind, parameter_readers, record
from graphpar.ir.compiled import StageProgram
from graphpar.strategy import rank_stages

PASS = "split_stages"


def _stage(node: torch.fx.Node) -> int:
    return record(node).stage


def _computed(node: torch.fx.Node) -> bool:
    return node.op in ("call_function", "call_method", "call_module")


def crossings(gm: torch.fx.GraphModule, num_stages: int) -> Dict[int, List[torch.fx.Node]]:
    """For each stage b > 0, the values it receives from stage b - 1, in graph order."""
    last_reader: Dict[torch.fx.Node, int] = {}
    for node in gm.graph.nodes:
        reader = num_stages - 1 if node.op == "output" else (_stage(node) if _computed(node) else None)
        if reader is None:
            continue
        for source in node.all_input_nodes:
            if _computed(source):
                last_reader[source] = max(last_reader.get(source, -1), reader)
    return {b: [n for n in gm.graph.nodes if _computed(n) and _stage(n) < b <= last_reader.get(n, -1)]
            for b in range(1, num_stages)}


def _build_stage(gm, stage, num_stages, receives: List[torch.fx.Node], sends: List[torch.fx.Node]):
    graph = torch.fx.Graph()
    env: Dict[torch.fx.Node, torch.fx.Node] = {}
    nodes = [n for n in gm.graph.nodes if _computed(n) and _stage(n) == stage]
    used = {src for n in nodes for src in n.all_input_nodes}
    output = next(n for n in gm.graph.nodes if n.op == "output")
    if stage == num_stages - 1:
        used |= set(output.all_input_nodes)
    inputs = [n for n in gm.graph.nodes if n.op == "placeholder" and n in used]
    for node in inputs + receives:
        env[node] = graph.placeholder(node.name)
        env[node].meta = dict(node.meta)
    for node in gm.graph.nodes:
        if node.op == "get_attr" and node in used:
            env[node] = graph.node_copy(node, lambda n: env[n])
    for node in nodes:
        env[node] = graph.node_copy(node, lambda n: env[n])
    if stage == num_stages - 1:
        graph.output(tuple(env[v] if isinstance(v, torch.fx.Node) else v for v in output.args[0]))
    else:
        graph.output(tuple(env[n] for n in sends))
    return torch.fx.GraphModule(gm, graph, class_name=f"GraphparStage{stage}"), [n.name for n in inputs]


def _meta(nodes: List[torch.fx.Node]) -> List[TensorMeta]:
    metas = []
    for node in nodes:
        value = record(node).value
        if not isinstance(value, TensorMeta):
            raise ValueError(f"{node.name} ({describe_kind(value)}, from {record(node).module_path or 'the model'}) "
                             f"crosses a pipeline cut but is not a single tensor. Fix: move the cut "
                             f"(Strategy.partition as a list of module paths) so this value stays inside a stage.")
        metas.append(value)
    return metas


def _driver(gm, programs: Dict[int, StageProgram]) -> torch.fx.GraphModule:
    """The rank's program as one graph: which inputs and received values feed each local
    stage, and what comes out. The executor runs the stages; this graph is for reading."""
    root = nn.Module()
    graph = torch.fx.Graph()
    originals = {n.name: n for n in gm.graph.nodes}
    inputs = {}
    results = []
    for stage, program in programs.items():
        root.add_module(f"stage_{stage}", program.gm)
        args = []
        for name in program.inputs + program.receives:
            key = name if name in program.inputs else f"recv_{stage}_{name}"
            if key not in inputs:
                inputs[key] = graph.placeholder(key)
                inputs[key].meta = dict(originals[name].meta)
            args.append(inputs[key])
        call = graph.call_module(f"stage_{stage}", tuple(args))
        copy_record(originals[program.receives[0]] if program.receives else args[0], call, PASS,
                    value=tuple(record(n).value for n in _outputs(program.gm)), stage=stage, module_path="")
        for i, value in enumerate(_outputs(program.gm)):
            item = graph.call_function(operator.getitem, (call, i))
            copy_record(value, item, PASS, stage=stage)
            results.append(item)
    graph.output(tuple(results))
    return torch.fx.GraphModule(root, graph, class_name="GraphparRankProgram")


def _outputs(gm: torch.fx.GraphModule) -> List[torch.fx.Node]:
    output = next(n for n in gm.graph.nodes if n.op == "output")
    return [v for v in output.args[0] if isinstance(v, torch.fx.Node)]


def split_stages(gm, ctx):
    plan = ctx.results.stage_plan
    if plan is None:
        return gm
    num_stages, pp = plan.num_stages, ctx.mesh.pp
    cuts = crossings(gm, num_stages)
    programs: Dict[int, StageProgram] = {}
    for stage in rank_stages(ctx.mesh.pp_rank, pp, num_stages, ctx.strategy.schedule):
        receives = cuts.get(stage, [])
        sends = cuts.get(stage + 1, [])
        stage_gm, inputs = _build_stage(gm, stage, num_stages, receives, sends)
        programs[stage] = StageProgram(stage, stage_gm, inputs, [n.name for n in receives],
                                       [n.name for n in sends], _meta(receives), _meta(sends),
                                       stage == num_stages - 1)
    ctx.results.stages = programs
    ctx.results.crossings = {b: [n.name for n in nodes] for b, nodes in cuts.items()}
    ctx.results.param_stages = {**parameter_readers(gm), **ctx.results.sharded_readers}
    ctx.results.input_names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    output = next(n for n in gm.graph.nodes if n.op == "output")
    ctx.results.output_meta = [record(v).value for v in output.args[0]]
    return _driver(gm, programs)
