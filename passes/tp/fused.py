"""Split a fused projection into one linear per block when tp cannot split every block's heads.

Falcon-7B's query_key_value holds the rows [q heads (n*d); k (d); v (d)]: one k/v head shared
by every q head. Its output is viewed as heads and q, k and v are taken by ranges of heads:

    before: matmul = matmul(ln, w.T)                          # f32[2, 16, 48]
            view = view(matmul, b, s, 6, 8)
            q = view[..., :-2, :]   k = view[..., [-2], :]   v = view[..., [-1], :]
    after:  split = split(w, [32, 8, 8], 0)                   # the one parameter, by blocks
            linear = linear(ln, split[0]);  q = view(linear, b, s, 4, 8)
            linear_1 = linear(ln, split[1]); k = view(linear_1, b, s, 1, 8)
            linear_2 = linear(ln, split[2]); v = view(linear_2, b, s, 1, 8)

The solver then makes the q block column-parallel and the whole k/v blocks stay replicated
(Megatron's layout for tp > kv heads): the parameter is one state_dict entry laid out as
S(0|32,R8,R8) (graphpar/ir/layout.py), each rank holding [q_r; k; v]. k and v are computed
whole on every rank and read by the sharded attention, so insert_collectives puts a copy_to
on them: their gradients are summed over tp there, which makes the k/v rows' gradient whole
and equal on every rank. A projection whose blocks tp all divides is left fused (its blocks
are split in place, S(0|q,k,v)).
"""
from __future__ import annotations

import dataclasses
import operator
from typing import List, Optional, Tuple

import torch
import torch.fx
import torch.nn.functional as F

from graphpar.ir import TensorMeta, copy_record, record
from graphpar.passes.tp.opinfo import op_of
from graphpar.passes.tp.rules import norm_dim, shape
from graphpar.passes.tp.solver import linear_op   # it also reads the blocks this makes


def split_fused_blocks(gm: torch.fx.GraphModule, tp: int, pass_name: str) -> None:
    for node in list(gm.graph.nodes):
        lin = linear_op(node)
        if lin is None or lin.block is not None or lin.out_dim_of_weight != 0 or lin.bias is not None:
            continue
        found = _head_ranges(node)
        if found is not None and any((stop - start) % tp for _, start, stop in found[1]):
            _split(lin, found[0], found[1], pass_name)


def _data_users(node: torch.fx.Node) -> List[torch.fx.Node]:
    return [u for u in node.users if op_of(u).kind != "size"]


def _head_ranges(node) -> Optional[Tuple[torch.fx.Node, List[Tuple[torch.fx.Node, int, int]]]]:
    """The view of `node` into [..., heads, d] and its readers with the heads each takes,
    when they are contiguous ranges covering every head in order; else None."""
    users = _data_users(node)
    out = shape(node)
    if len(users) != 1 or op_of(users[0]).kind != "view" or users[0].op != "call_method" or not out:
        return None
    view = users[0]
    viewed = shape(view)
    if viewed is None or len(viewed) != len(out) + 1 or viewed[:-2] != out[:-1] or len(view.args) != 1 + len(viewed):
        return None
    if not all(_reads_leading_dims(u, len(out)) for u in node.users if u is not view):
        return None
    heads_dim = len(viewed) - 2
    if view.args[1 + heads_dim] != viewed[heads_dim]:   # the heads are a constant of the view
        return None
    ranges, next_head = [], 0
    for user in sorted(_data_users(view), key=lambda u: _head_range(u, heads_dim, viewed) or (0, 0)):
        taken = _head_range(user, heads_dim, viewed)
        if taken is None or taken[0] != next_head:
            return None
        ranges.append((user, *taken))
        next_head = taken[1]
    return (view, ranges) if next_head == viewed[heads_dim] and len(ranges) > 1 else None


def _reads_leading_dims(size_read, rank: int) -> bool:
    """`x.shape[i]` / `x.size(i)` with i not the last dim: the same on every block's output."""
    if size_read.op == "call_method":
        return len(size_read.args) == 2 and isinstance(size_read.args[1], int) and norm_dim(size_read.args[1], rank) < rank - 1
    return all(u.target is operator.getitem and isinstance(u.args[1], int) and norm_dim(u.args[1], rank) < rank - 1
               for u in size_read.users)


def _head_range(user, heads_dim: int, viewed) -> Optional[Tuple[int, int]]:
    """[start, stop) of the heads `user` takes whole, other dims untouched: x[..., a:b, :]
    or x[..., [i], :] (a list of one index keeps the dim, as Falcon takes k and v)."""
    info = op_of(user)
    if info.kind != "getitem" or not isinstance(info.args["index"], tuple):
        return None
    items = info.args["index"]
    if items[:1] == (Ellipsis,):
        items = (slice(None),) * (len(viewed) - len(items) + 1) + items[1:]
    if len(items) != len(viewed) or any(i != slice(None) for d, i in enumerate(items) if d != heads_dim):
        return None
    item, heads = items[heads_dim], viewed[heads_dim]
    if isinstance(item, list) and len(item) == 1 and isinstance(item[0], int):
        start = norm_dim(item[0], heads)
        return start, start + 1
    if isinstance(item, slice) and item.step in (None, 1) and all(isinstance(b, (int, type(None)))
                                                                  for b in (item.start, item.stop)):
        start, stop, _ = item.indices(heads)
        return (start, stop) if stop > start else None
    return None


def _split(lin, view, ranges, pass_name: str) -> None:
    """One linear per range of heads, over the row blocks of the one [out, in] weight
    (linear, `x @ w.T`; a projection with a bias is left fused, and reported if tp cannot
    split it)."""
    graph, node = view.graph, lin.node
    head_size = shape(view)[-1]
    sizes = [(stop - start) * head_size for _, start, stop in ranges]
    with graph.inserting_before(node):
        weights = _blocks(graph, lin.weight, sizes, 0, pass_name)
        outs = [_node(graph, F.linear, (lin.x, weight), node, pass_name, shape(node)[:-1] + (size,))
                for size, weight in zip(sizes, weights)]
    with graph.inserting_before(view):   # where the sizes the view reads are known
        for (reader, start, stop), out in zip(ranges, outs):
            sizes_args = list(view.args[1:])
            sizes_args[len(shape(view)) - 2] = stop - start
            heads = _node(graph, "view", (out, *sizes_args), reader, pass_name, shape(reader), method=True)
            reader.replace_all_uses_with(heads)
    for user in list(node.users):   # size reads of the fused output read its leading dims
        user.replace_input_with(node, outs[0])
    for dead in [reader for reader, _, _ in ranges] + [view, node]:
        graph.erase_node(dead)
    if lin.weight_t is not None and not lin.weight_t.users:   # `w.T` of `x @ w.T`
        graph.erase_node(lin.weight_t)


def _blocks(graph, param, sizes, dim: int, pass_name: str) -> List[torch.fx.Node]:
    value = record(param).value
    pieces = tuple(dataclasses.replace(value, shape=_with(value.shape, dim, s)) for s in sizes)
    split = graph.call_function(torch.split, (param, sizes, dim))
    copy_record(param, split, pass_name, value=pieces)
    return [_node(graph, operator.getitem, (split, i), param, pass_name, piece.shape)
            for i, piece in enumerate(pieces)]


def _with(sizes, dim: int, size: int) -> Tuple[int, ...]:
    return tuple(size if d == dim else s for d, s in enumerate(sizes))


def _node(graph, target, args, like, pass_name: str, out_shape, method: bool = False) -> torch.fx.Node:
    new = graph.call_method(target, args) if method else graph.call_function(target, args)
    value = record(like).value
    if isinstance(value, TensorMeta):
        value = dataclasses.replace(value, shape=tuple(out_shape))
    copy_record(like, new, pass_name, value=value)
    return new
