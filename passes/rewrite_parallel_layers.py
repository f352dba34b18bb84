"""rewrite_parallel_layers: apply the TP plan's layer choices and make every shape local.

    row-parallel linear
      before: linear_3 = linear(view_3, proj_weight, proj_bias)          # R
      after:  linear_3 = linear(view_3, proj_weight)                     # P(sum)
              linear_3_bias = add(linear_3, proj_bias)                   # R (after the all-reduce
                                                                         #    insert_collectives adds)
    vocab-parallel embedding
      before: embedding = embedding(input_0, wte_weight)
      after:  embedding = vocab_parallel_embedding(input_0, wte_weight, 'tp')   # P(sum)
    cross entropy on vocab-sharded logits
      before: cross_entropy = cross_entropy(view, target)
      after:  cross_entropy = parallel_cross_entropy(view, target, -100, 0.0, 64, 'tp')
    shape constants of sharded values (heads, hidden, fused-projection blocks)
      before: view = view(q, 2, 16, 4, 8)       # S(2), 4 heads
      after:  view = view(q, 2, 16, 2, 8)       # S(2), 4 / tp heads on this rank

Finally every record's value becomes this rank's local shape. No-op at tp = 1.

Sequence parallelism (SequenceShard specs, Sq): a row layer's bias add keeps the row's Sq
spec and its partial sum the full shape; tp_plan.reduce_to records that the partial is
reduce-scattered, not all-reduced. A size read at run time off a Sq value is local, so a
view that needs the full sequence scales it back:

      before: view = view(q, b, t, 4, 8)        # t = layer_norm.size(1), layer_norm Sq(1)
      after:  mul = t * 2
              view = view(q, b, mul, 2, 8)      # S(2): the column layer saw the whole sequence
"""
from __future__ import annotations

import dataclasses
import operator

import torch
import torch.fx

from graphpar.ir import Partial, Replicate, Shard, TensorMeta, copy_record, record, set_record, stamp
from graphpar.runtime import collectives
from graphpar.ir.layout import local_segments
from graphpar.passes.tp.opinfo import op_of
from graphpar.passes.tp.rules import check_divisible, first, shape
from graphpar.passes.tp.solver import linear_op

PASS = "rewrite_parallel_layers"
# ops whose second argument (or the rest, for methods) is the target shape
SHAPE_METHODS = {"view", "reshape", "expand", "broadcast_to"}
SHAPE_FUNCTIONS = {torch.ops.aten.view.default, torch.ops.aten.reshape.default, torch.ops.aten._unsafe_view.default,
                   torch.ops.aten.expand.default, torch.reshape, torch.broadcast_to}
AXIS = "tp"
aten = torch.ops.aten


def _replace(node: torch.fx.Node, new: torch.fx.Node, spec, rec=None) -> None:
    set_record(new, (rec or record(node)).replace(PASS, spec=spec))
    node.replace_all_uses_with(new)
    node.graph.erase_node(node)


def _partial_record(node: torch.fx.Node, tp: int):
    """The record of a partial sum standing for `node`: always the full shape (a reduce-scatter
    to a SequenceShard makes it local later)."""
    rec = record(node)
    spec = rec.spec
    value = _with_dim(rec.value, spec.dim, rec.value.shape[spec.dim] * tp) if isinstance(spec, Shard) else rec.value
    return rec.replace(PASS, spec=Partial(), value=value)


def _rewrite_row(node: torch.fx.Node, tp: int) -> torch.fx.Node:
    lin = linear_op(node)
    graph = node.graph
    reduced_spec = record(node).spec    # Replicate, or SequenceShard under sequence parallelism
    with graph.inserting_before(node):
        if lin.weight_t is not None:   # `x @ w.T` has no bias to take out
            partial = graph.call_function(node.target, (lin.x, lin.weight_t))
        elif lin.out_dim_of_weight == 0:
            target = aten.linear.default if node.target is aten.linear.default else torch.nn.functional.linear
            partial = graph.call_function(target, (lin.x, lin.weight))
        else:
            target = aten.mm.default if node.target is aten.addmm.default else torch.mm
            partial = graph.call_function(target, (lin.x, lin.weight))
        set_record(partial, _partial_record(node, tp))
        if lin.bias is None:
            _replace(node, partial, Partial(), _partial_record(node, tp))
            return partial
        biased = graph.call_function(torch.add, (partial, lin.bias))
    _replace(node, biased, reduced_spec)
    return partial


def _rewrite_embedding(node: torch.fx.Node, tp: int) -> torch.fx.Node:
    info = op_of(node)
    padding = first(info.args, "padding_idx")
    padding = None if padding is None or padding < 0 else padding
    with node.graph.inserting_before(node):
        new = node.graph.call_function(collectives.vocab_parallel_embedding,
                                       (first(info.args, "input", "indices"), first(info.args, "weight"), AXIS, padding))
    _replace(node, new, Partial(), _partial_record(node, tp))
    return new


# F.cross_entropy's reduction names and aten.cross_entropy_loss's enum for them
_REDUCTIONS = {"mean": "mean", 1: "mean", "sum": "sum", 2: "sum"}


def _rewrite_cross_entropy(node: torch.fx.Node, tp: int) -> None:
    info = op_of(node)
    reduction = info.args.get("reduction", "mean")
    if reduction not in _REDUCTIONS:
        raise ValueError(f"cross entropy at {record(node).module_path or node.name} uses reduction={reduction!r}; "
                         f"the vocab-parallel cross entropy computes the mean or the sum. Fix: use "
                         f"reduction='mean', or reduction='sum' in a token-weighted loss_fn returning "
                         f"(loss_sum, count).")
    logits = first(info.args, "input", "self")
    args = (logits, first(info.args, "target"), info.args.get("ignore_index", -100),
            float(info.args.get("label_smoothing", 0.0) or 0.0), shape(logits)[-1] * tp, AXIS)
    if _REDUCTIONS[reduction] == "sum":  # the mean is the default: its graphs print as before
        args += ("sum",)
    with node.graph.inserting_before(node):
        new = node.graph.call_function(collectives.parallel_cross_entropy, args)
    _replace(node, new, Replicate())


def _size_is_local(arg) -> bool:
    """A size read at run time off a tensor sharded on that dim is a local size."""
    if not isinstance(arg, torch.fx.Node):
        return False
    if arg.op == "call_function" and arg.target is operator.getitem:
        source, index = arg.args
        if isinstance(source, torch.fx.Node) and op_of(source).kind == "size" and len(source.args) == 1:
            tensor = source.args[0]
            spec = record(tensor).spec
            rank = len(shape(tensor))
            return isinstance(spec, Shard) and spec.dim == index % rank
    if arg.op == "call_method" and arg.target == "size" and len(arg.args) > 1:
        tensor, dim = arg.args[0], arg.args[1]
        spec = record(tensor).spec
        return isinstance(spec, Shard) and spec.dim == dim % len(shape(tensor))
    return False


def _size_op(value: torch.fx.Node, op, tp: int, node: torch.fx.Node) -> torch.fx.Node:
    with node.graph.inserting_before(node):
        sized = node.graph.call_function(op, (value, tp))
    copy_record(value, sized, PASS)
    return sized


def _local_size(value, tp: int, node: torch.fx.Node):
    if isinstance(value, int):
        if value == -1:
            return value
        check_divisible(value, tp, "a sharded size in a reshape", node)
        return value // tp
    if isinstance(value, torch.fx.Node) and not _size_is_local(value):
        return _size_op(value, operator.floordiv, tp, node)
    return value


def _full_size(value, tp: int, node: torch.fx.Node):
    """An unsharded entry read off a sharded dim at run time (the sequence length read off a
    SequenceShard value, used by a view in a TP region) is local: scale it back up."""
    return _size_op(value, operator.mul, tp, node) if _size_is_local(value) else value


def _localize_shape_args(node: torch.fx.Node, tp: int) -> None:
    """view/reshape/expand with an explicit target shape: the sharded entry becomes local,
    and sizes read off other sharded values become full."""
    spec = record(node).spec
    takes_shape = node.target in SHAPE_METHODS if node.op == "call_method" else node.target in SHAPE_FUNCTIONS
    if not takes_shape:
        return
    dim = spec.dim if isinstance(spec, Shard) else None
    args = list(node.args)
    if node.op == "call_method":
        shape_args = args[1:]
        if len(shape_args) == 1 and isinstance(shape_args[0], (list, tuple)):
            args[1] = _with_local(list(shape_args[0]), dim, tp, node)
        else:
            args[1:] = _with_local(shape_args, dim, tp, node)
    elif len(args) > 1 and isinstance(args[1], (list, tuple)):
        args[1] = _with_local(list(args[1]), dim, tp, node)
    node.args = tuple(args)


def _with_local(sizes, dim, tp: int, node):
    return [_local_size(size, tp, node) if i == dim else _full_size(size, tp, node) for i, size in enumerate(sizes)]


def _localize_split(node: torch.fx.Node, tp: int) -> None:
    """A split of a sharded dim into the blocks of a fused projection: local block sizes."""
    info = op_of(node)
    if info.kind != "split":
        return
    source = first(info.args, "input", "self", "tensor")
    spec = record(source).spec
    if not isinstance(spec, Shard) or not spec.segments:
        return
    args = list(node.args)
    sizes = args[1]
    if spec.whole:   # a fused weight split into its blocks (passes/tp/fused.py): sizes are constants
        args[1] = local_segments(spec, tp)
    else:
        args[1] = ([_local_size(s, tp, node) for s in sizes] if isinstance(sizes, (list, tuple))
                   else _local_size(sizes, tp, node))
    node.args = tuple(args)


def _with_dim(value: TensorMeta, dim: int, size: int) -> TensorMeta:
    shape_ = list(value.shape)
    shape_[dim] = size
    return dataclasses.replace(value, shape=tuple(shape_))


def _local_value(value, spec, tp: int):
    if isinstance(value, TensorMeta) and isinstance(spec, Shard):
        size = sum(local_segments(spec, tp)) if spec.whole else value.shape[spec.dim] // tp
        return _with_dim(value, spec.dim, size)
    return value


def _localize_records(gm: torch.fx.GraphModule, plan, tp: int) -> None:
    for node in gm.graph.nodes:
        if node.op == "output":
            continue
        rec = record(node)
        spec = plan.specs.get(node.name, rec.spec)
        if isinstance(rec.value, tuple) and isinstance(spec, tuple):
            value = tuple(_local_value(v, s, tp) for v, s in zip(rec.value, spec))
        else:
            value = _local_value(rec.value, rec.spec, tp)
        if value != rec.value:
            stamp(node, PASS, value=value)


REWRITES = {"row": _rewrite_row, "vocab_embedding": _rewrite_embedding,
            "parallel_cross_entropy": _rewrite_cross_entropy}


def rewrite_parallel_layers(gm, ctx):
    tp = ctx.mesh.tp
    plan = ctx.results.tp_plan
    if tp == 1 or plan is None:
        return gm
    for node in list(gm.graph.nodes):
        if node.op in ("call_function", "call_method"):
            _localize_shape_args(node, tp)
            _localize_split(node, tp)
    _localize_records(gm, plan, tp)
    for node in list(gm.graph.nodes):
        role = plan.roles.get(node.name)
        if role in REWRITES:
            reduced_spec = record(node).spec
            partial = REWRITES[role](node, tp)  # records are local now: global sizes are local * tp
            if partial is not None and reduced_spec != Replicate():
                plan.reduce_to[partial.name] = reduced_spec
    return gm
