"""insert_collectives: an explicit collective wherever a consumer's spec differs from its producer's.

    Partial -> Replicate            reduce_from (g): all-reduce forward, identity backward
    Replicate -> Shard region       copy_to (f): identity forward, all-reduce backward,
                                    for inputs that need a gradient (the input of a column
                                    layer): its gradient on each rank covers only the rank's
                                    shard, the all-reduce sums them
    Shard -> graph output           gather_from: all-gather forward (pm(x) returns full values;
                                    dropped from the training program, which returns the loss)

    before: linear = linear(ln_1, q_weight, q_bias)    linear_1 = linear(ln_1, k_weight, k_bias)
    after:  copy_to = copy_to(ln_1, 'tp')
            linear = linear(copy_to, q_weight, q_bias) linear_1 = linear(copy_to, k_weight, k_bias)

One copy_to per producer, shared by all its sharded consumers: separate q, k and v
projections make one backward all-reduce, not three. No-op at tp = 1.
"""
from __future__ import annotations

import dataclasses
from typing import Dict

import torch.fx

from graphpar.ir import Partial, Replicate, Shard, TensorMeta, record
from graphpar.pipeline import builtin_pass
from graphpar.tp import collectives

PASS = "insert_collectives"
AXIS = "tp"


def _is_sharded(spec) -> bool:
    return isinstance(spec, (Shard, Partial))


def _needs_grad(node: torch.fx.Node) -> bool:
    value = record(node).value
    return isinstance(value, TensorMeta) and value.requires_grad


def _insert_after(node: torch.fx.Node, fn, args, spec) -> torch.fx.Node:
    with node.graph.inserting_after(node):
        new = node.graph.call_function(fn, args)
    new.meta["graphpar"] = record(node).replace(PASS, spec=spec)
    return new


def _reduce_partials(gm: torch.fx.GraphModule) -> None:
    for node in list(gm.graph.nodes):
        if node.op != "output" and isinstance(record(node).spec, Partial):
            users = list(node.users)
            reduced = _insert_after(node, collectives.reduce_from, (node, AXIS), Replicate())
            for user in users:
                user.replace_input_with(node, reduced)


def _copy_into_regions(gm: torch.fx.GraphModule) -> None:
    copies: Dict[torch.fx.Node, torch.fx.Node] = {}
    for node in list(gm.graph.nodes):
        if node.op in ("output", "get_attr", "placeholder") or not _is_sharded(record(node).spec):
            continue
        if node.target in (collectives.copy_to, collectives.reduce_from):
            continue
        for source in node.all_input_nodes:
            if isinstance(record(source).spec, Replicate) and _needs_grad(source):
                if source not in copies:
                    copies[source] = _insert_after(source, collectives.copy_to, (source, AXIS), Replicate())
                node.replace_input_with(source, copies[source])


def _gather_outputs(gm: torch.fx.GraphModule, tp: int) -> None:
    output = next(n for n in gm.graph.nodes if n.op == "output")
    values = list(output.args[0])
    for i, value in enumerate(values):
        spec = record(value).spec if isinstance(value, torch.fx.Node) else None
        if isinstance(spec, Shard):
            if spec.segments:
                raise ValueError(f"output {i} ({value.name}) is sharded by fused blocks; gathering it is "
                                 f"not supported. Fix: return the values after the split.")
            gathered = _insert_after(value, collectives.gather_from, (value, spec.dim, AXIS), Replicate())
            local = record(value).value
            full = list(local.shape)
            full[spec.dim] *= tp
            gathered.meta["graphpar"] = record(gathered).replace(PASS, value=dataclasses.replace(local, shape=tuple(full)))
            values[i] = gathered
    output.args = (tuple(values),)


@builtin_pass(PASS)
def insert_collectives(gm, ctx):
    if ctx.mesh.tp == 1:
        return gm
    _reduce_partials(gm)
    _copy_into_regions(gm)
    _gather_outputs(gm, ctx.mesh.tp)
    return gm
