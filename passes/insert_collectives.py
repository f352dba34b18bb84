"""insert_collectives: an explicit collective wherever a consumer's spec differs from its producer's.

    Partial -> Replicate            reduce_from (g): all-reduce forward, identity backward
    Replicate -> Shard region       copy_to (f): identity forward, all-reduce backward,
                                    for inputs that need a gradient (the input of a column
                                    layer): its gradient on each rank covers only the rank's
                                    shard, the all-reduce sums them
    Shard -> graph output           gather_from: all-gather forward (pm(x) returns full values;
                                    dropped from the training program, which returns the loss)
    Replicate -> Shard, on an edge  scatter_to: this rank's slice forward (no communication),
    in tp_plan.local_slices         all-gather backward: a replicated input the solver found
                                    no linear to shard (BLOOM's alibi bias over batch x heads:
                                    scatter_to(to, 0, 'tp', 2), S(0|4,4), each of the b
                                    blocks of heads split)

    before: linear = linear(ln_1, q_weight, q_bias)    linear_1 = linear(ln_1, k_weight, k_bias)
    after:  copy_to = copy_to(ln_1, 'tp')
            linear = linear(copy_to, q_weight, q_bias) linear_1 = linear(copy_to, k_weight, k_bias)

One copy_to per producer, shared by all its sharded consumers: separate q, k and v
projections make one backward all-reduce, not three. No-op at tp = 1.

Sequence parallelism (SequenceShard values, written Sq) adds:

    Partial -> Sq                   reduce_scatter: reduce-scatter forward, all-gather backward
    Sq -> TP region input           gather_to: all-gather forward, reduce-scatter backward
                                    (in place of copy_to)
    Replicate -> Sq, full size      scatter_to: own piece forward, all-gather backward
                                    (position embeddings added to the sequence-split stream)
    Replicate -> Sq, broadcast      copy_to, when it needs a gradient: LayerNorm/RMSNorm weights
                                    and row biases see 1/tp of the sequence, so their gradients
                                    are all-reduced over tp (Megatron's sequence-parallel
                                    gradient all-reduce), explicitly in the graph
    Sq -> replicated consumer       gather_from: all-gather forward, own piece backward
"""
from __future__ import annotations

import dataclasses
from typing import Dict, Optional, Tuple

import torch.fx

from graphpar.ir import Partial, Replicate, SequenceShard, Shard, TensorMeta, copy_record, record
from graphpar.runtime import collectives
from graphpar.ir.layout import blocks_of
from graphpar.passes.tp.opinfo import op_of
from graphpar.passes.tp.sequence import spanned_dim

PASS = "insert_collectives"
AXIS = "tp"
# readers that take no data from a tensor: a size read at run time is meant to be local
# (rewrite_parallel_layers scales it where a full size is needed)
_METADATA_KINDS = ("size", "assert_metadata")
_INSERTED = (collectives.copy_to, collectives.reduce_from, collectives.gather_from, collectives.reduce_scatter,
             collectives.gather_to, collectives.scatter_to)


def _is_sharded(spec) -> bool:
    return isinstance(spec, (Shard, Partial))


def _is_tp_sharded(spec) -> bool:
    return _is_sharded(spec) and not isinstance(spec, SequenceShard)


def _needs_grad(node: torch.fx.Node) -> bool:
    value = record(node).value
    return isinstance(value, TensorMeta) and value.requires_grad


def _with_dim(value: TensorMeta, dim: int, size: int) -> TensorMeta:
    shape = list(value.shape)
    shape[dim] = size
    return dataclasses.replace(value, shape=tuple(shape))


def _insert(node: torch.fx.Node, fn, args, spec, value=None, before=None) -> torch.fx.Node:
    """fn(*args) right after `node` (or right before `before`), with node's record and `spec`."""
    with node.graph.inserting_before(before) if before is not None else node.graph.inserting_after(node):
        new = node.graph.call_function(fn, args)
    changes = {"spec": spec} if value is None else {"spec": spec, "value": value}
    copy_record(node, new, PASS, **changes)
    return new


def _split_args(node: torch.fx.Node, spec: Shard) -> Tuple:
    """(x, dim, axis[, blocks]) of a collective along a sharded dim; blocks only when > 1."""
    blocks = blocks_of(spec)
    return (node, spec.dim, AXIS) + ((blocks,) if blocks > 1 else ())


def _gathered(node: torch.fx.Node, fn, tp: int) -> torch.fx.Node:
    """fn(node) all-gathers a SequenceShard (or Shard) value into the full, replicated one."""
    spec = record(node).spec
    value = record(node).value
    full = _with_dim(value, spec.dim, value.shape[spec.dim] * tp)
    return _insert(node, fn, _split_args(node, spec), Replicate(), full)


def _reduce_partials(gm: torch.fx.GraphModule, reduce_to: Dict[str, object], tp: int) -> None:
    for node in list(gm.graph.nodes):
        if node.op == "output" or not isinstance(record(node).spec, Partial):
            continue
        users = list(node.users)
        target = reduce_to.get(node.name, Replicate())
        if isinstance(target, SequenceShard):
            value = record(node).value
            local = _with_dim(value, target.dim, value.shape[target.dim] // tp)
            reduced = _insert(node, collectives.reduce_scatter, _split_args(node, target), target, local)
        else:
            reduced = _insert(node, collectives.reduce_from, (node, AXIS), Replicate())
        for user in users:
            user.replace_input_with(node, reduced)


def _conversion(consumer: torch.fx.Node, source: torch.fx.Node, tp: int, slices) -> Optional[Tuple]:
    """(collective, spec of what it makes or None) that turns `source` into what `consumer`
    reads, or None."""
    spec, source_spec = record(consumer).spec, record(source).spec
    if (consumer.name, source.name) in slices:   # Replicate -> Shard: this rank's slice
        sliceable = isinstance(source_spec, Replicate)
        return (collectives.scatter_to, slices[(consumer.name, source.name)]) if sliceable else None
    if isinstance(source_spec, SequenceShard):
        if _is_tp_sharded(spec):
            return collectives.gather_to, None
        if not isinstance(spec, SequenceShard) and op_of(consumer).kind not in _METADATA_KINDS:
            return collectives.gather_from, None
        return None
    if not isinstance(source_spec, Replicate) or not _is_sharded(spec):
        return None
    if isinstance(spec, SequenceShard) and isinstance(record(source).value, TensorMeta):
        out = record(consumer).value.shape
        dim = spanned_dim(len(out), spec, record(source).value.shape, out[spec.dim] * tp)
        if dim is not None:
            return collectives.scatter_to, SequenceShard(dim, spec.segments)
    return (collectives.copy_to, None) if _needs_grad(source) else None


def _convert_inputs(gm: torch.fx.GraphModule, tp: int, slices: Dict[Tuple[str, str], Shard]) -> None:
    """copy_to, the local slices the plan names, and under sequence parallelism gathers and
    scatters, before the consumers that need them; one per producer and kind, shared by all
    its consumers."""
    made: Dict[Tuple, torch.fx.Node] = {}
    sliced = set()
    for node in list(gm.graph.nodes):
        if node.op in ("output", "get_attr", "placeholder") or node.target in _INSERTED:
            continue
        for source in node.all_input_nodes:
            conversion = _conversion(node, source, tp, slices)
            if conversion is None:
                continue
            fn, spec = conversion
            key = (source, fn, spec)
            if key not in made:   # the first consumer in graph order: every other one comes after it
                made[key] = _make(source, fn, spec, tp, node)
            node.replace_input_with(source, made[key])
            sliced.add((node.name, source.name))
    missed = set(slices) - sliced
    if missed:   # a pass renamed a node of the plan: reading the whole value would be wrong
        raise RuntimeError(f"insert_collectives: local slices {sorted(missed)} of the tp plan name nodes "
                           f"no longer in the graph")


def _make(source: torch.fx.Node, fn, spec, tp: int, consumer: torch.fx.Node) -> torch.fx.Node:
    # a parameter's or input's conversion goes right before its first consumer, not after the
    # get_attr / placeholder, which torch.export hoists to the top of the graph: at the top, a
    # layer's norm weight copy_to would run before the embedding, and the pipeline's units
    # (ordered by their first node) would come out of execution order
    before = consumer if source.op in ("get_attr", "placeholder") else None
    if fn is collectives.copy_to:
        return _insert(source, fn, (source, AXIS), Replicate(), before=before)
    if fn is collectives.scatter_to:
        value = record(source).value
        return _insert(source, fn, _split_args(source, spec), spec,
                             _with_dim(value, spec.dim, value.shape[spec.dim] // tp), before=before)
    return _gathered(source, fn, tp)


def _gather_outputs(gm: torch.fx.GraphModule, tp: int) -> None:
    output = next(n for n in gm.graph.nodes if n.op == "output")
    values = list(output.args[0])
    for i, value in enumerate(values):
        spec = record(value).spec if isinstance(value, torch.fx.Node) else None
        if isinstance(spec, Shard):
            if spec.segments and not isinstance(spec, SequenceShard):
                raise ValueError(f"output {i} ({value.name}) is sharded by fused blocks; gathering it is "
                                 f"not supported. Fix: return the values after the split.")
            values[i] = _gathered(value, collectives.gather_from, tp)
    output.args = (tuple(values),)


def insert_collectives(gm, ctx):
    tp = ctx.mesh.tp
    if tp == 1:
        return gm
    _reduce_partials(gm, ctx.results.tp_plan.reduce_to, tp)
    _convert_inputs(gm, tp, ctx.results.tp_plan.local_slices)
    _gather_outputs(gm, tp)
    return gm
