"""Sharding propagation rules: the spec of an op's output from the specs of its inputs.

Only ops that touch a sharded value need a rule: an op whose tensor inputs are all
Replicate produces Replicate. A rule returns the output spec, or one of

    Demand(node, spec)     the op can stay local only if another input is sharded too
                           (k and v of an attention whose q is sharded; the up projection
                           of a gated MLP); the region solver tries to shard its producer
    Segments(node, sizes)  a split of the sharded dim into blocks (fused q|k|v): the
                           producer must shard each block separately
    Unsupported(reason)    no local rule: the region is abandoned (and reported)
    DivisibilityError      a size the tp degree does not divide: a user error

Dims in specs are non-negative. Shapes come from the node records (global shapes).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch.fx

from graphpar.ir import Replicate, Shard, TensorMeta, record
from graphpar.passes.tp.opinfo import OpInfo, op_of

R = Replicate()


@dataclass
class Demand:
    node: torch.fx.Node
    spec: Shard


@dataclass
class Segments:
    node: torch.fx.Node          # the value that was split
    sizes: Tuple[int, ...]


@dataclass
class Unsupported:
    reason: str


class DivisibilityError(ValueError):
    pass


Result = Union[Replicate, Shard, tuple, Demand, Segments, Unsupported, None]
SpecOf = Callable[[Any], Any]


def shape(node) -> Optional[Tuple[int, ...]]:
    if not isinstance(node, torch.fx.Node):
        return None
    value = record(node).value
    return value.shape if isinstance(value, TensorMeta) else None


def first(args: Dict[str, Any], *names):
    for name in names:
        if name in args:
            return args[name]
    return None


def norm_dim(dim: int, rank: int) -> int:
    return dim + rank if dim < 0 else dim


def where(node: torch.fx.Node) -> str:
    rec = record(node)
    return f"{rec.module_path or '<top>'} ({node.name})"


def check_divisible(size: int, tp: int, what: str, node: torch.fx.Node) -> None:
    if size % tp:
        options = [d for d in range(1, size + 1) if size % d == 0 and d <= 64]
        raise DivisibilityError(
            f"tp={tp} does not divide {what}={size} at {where(node)}: tensor parallelism splits it "
            f"into tp equal parts. Fix: use a tp that divides {size} (one of {options}), or list the "
            f"module in compile(..., tp_replicate=[...]) to keep it whole.")


# ---- dim mapping through reshapes -----------------------------------------------------
def dim_groups(a: Sequence[int], b: Sequence[int]) -> Optional[List[Tuple[List[int], List[int]]]]:
    """Pair runs of dims of `a` and `b` with equal products (the reshape's dim grouping),
    ignoring size-1 dims."""
    ia = [i for i, s in enumerate(a) if s != 1]
    ib = [i for i, s in enumerate(b) if s != 1]
    groups, i, j = [], 0, 0
    while i < len(ia) and j < len(ib):
        ga, gb = [ia[i]], [ib[j]]
        pa, pb = a[ia[i]], b[ib[j]]
        while pa != pb:
            if pa < pb:
                i += 1
                if i >= len(ia):
                    return None
                ga.append(ia[i])
                pa *= a[ia[i]]
            else:
                j += 1
                if j >= len(ib):
                    return None
                gb.append(ib[j])
                pb *= b[ib[j]]
        groups.append((ga, gb))
        i, j = i + 1, j + 1
    return groups if i == len(ia) and j == len(ib) else None


def reshape_rule(node, spec: Shard, in_shape, out_shape, tp: int) -> Result:
    """A reshape regroups dims; the sharded dim's group is read as `blocks` equal blocks
    (the dims before it in the group, times its own equal segments), each split over tp.
    Merging it as the inner part of a dim gives a blocked split of the merged dim (BLOOM's
    [b, h/tp] heads into b*h/tp: S(0|h,h,..)); splitting a blocked dim again finds the dim
    the blocks end on (b*h/tp back to [b, h/tp]: S(1))."""
    groups = dim_groups(in_shape, out_shape)
    if groups is None:
        return Unsupported(f"reshape {list(in_shape)} -> {list(out_shape)} has no dim grouping")
    for in_dims, out_dims in groups:
        if spec.dim not in in_dims:
            continue
        if len(in_dims) == 1 and len(out_dims) == 1:
            return Shard(out_dims[0], spec.segments)
        if spec.segments and len(set(spec.segments)) != 1:
            return Unsupported("reshape of a dim sharded in blocks of different sizes")
        blocks = len(spec.segments or (None,))
        for d in in_dims[:in_dims.index(spec.dim)]:
            blocks *= in_shape[d]
        return _blocked_spec(node, blocks, out_dims, out_shape, tp)
    return Unsupported("sharded dim of size 1")


def _blocked_spec(node, blocks: int, out_dims, out_shape, tp: int) -> Result:
    """The spec of a reshape's output group whose flattened elements are `blocks` equal
    blocks, each split over tp: the outer dims that only count blocks stay whole, the next
    one is sharded (in the blocks left, if it does not end them)."""
    for d in out_dims:
        size = out_shape[d]
        if blocks % size == 0:
            blocks //= size
            continue
        if size % blocks:
            return Unsupported(f"reshape splits the sharded blocks across dim {d} of size {size}")
        check_divisible(size // blocks, tp, "the number of heads (a reshaped dim)", node)
        return Shard(d, (size // blocks,) * blocks if blocks > 1 else None)
    return Unsupported("reshape leaves no dim to shard")


def expand_rule(spec: Shard, in_shape, out_shape) -> Result:
    offset = len(out_shape) - len(in_shape)
    out_dim = spec.dim + offset
    if out_shape[out_dim] != in_shape[spec.dim]:
        return Unsupported("expand broadcasts along the sharded dim")
    return Shard(out_dim, spec.segments)


# ---- rules by op kind --------------------------------------------------------------------
def pointwise_rule(node, info: OpInfo, spec_of: SpecOf) -> Result:
    out = shape(node)
    if out is None:
        return Unsupported("pointwise op with a non-tensor result")
    chosen: Optional[Shard] = None
    for arg in info.args["inputs"]:
        spec, arg_shape = spec_of(arg), shape(arg)
        if isinstance(spec, Shard) and arg_shape is not None:
            out_dim = spec.dim + len(out) - len(arg_shape)
            candidate = Shard(out_dim, spec.segments)
            if chosen is not None and chosen != candidate:
                return Unsupported(f"inputs sharded differently ({chosen.describe()} vs {candidate.describe()})")
            chosen = candidate
    if chosen is None:
        return R
    return _broadcast_operands(chosen, info.args["inputs"], len(out), spec_of)


def _broadcast_operands(chosen: Shard, operands, out_rank: int, spec_of: SpecOf) -> Result:
    """`chosen`, once every replicated operand that runs along its dim (broadcasting aligns
    dims from the right; a size-1 dim broadcasts over it) is sharded alike."""
    for arg in operands:
        arg_shape = shape(arg)
        if arg_shape is None or isinstance(spec_of(arg), Shard):
            continue
        in_dim = chosen.dim - (out_rank - len(arg_shape))
        if in_dim >= 0 and arg_shape[in_dim] != 1:
            return Demand(arg, Shard(in_dim, chosen.segments))
    return chosen


def transpose_rule(info: OpInfo, spec: Shard, rank: int) -> Result:
    d0 = norm_dim(info.args["dim0"], rank)
    d1 = norm_dim(info.args["dim1"], rank)
    mapping = {d0: d1, d1: d0}
    return Shard(mapping.get(spec.dim, spec.dim), spec.segments)


def permute_rule(info: OpInfo, spec: Shard, rank: int) -> Result:
    dims = [norm_dim(d, rank) for d in info.args["dims"]]
    return Shard(dims.index(spec.dim), spec.segments)


def split_rule(node, info: OpInfo, spec: Shard, source, in_shape, tp: int) -> Result:
    dim = norm_dim(first(info.args, "dim") or 0, len(in_shape))
    pieces = record(node).value
    if not isinstance(pieces, tuple):
        return Unsupported("split with an unknown number of pieces")
    if dim != spec.dim:
        return tuple(spec for _ in pieces)
    # sizes from the traced output shapes: the arguments may be symbolic (x.size(-1))
    sizes = tuple(piece.shape[dim] for piece in pieces)
    if spec.segments != sizes:
        if spec.segments is None:
            for s in sizes:
                check_divisible(s, tp, "a block of a fused projection (split size)", node)
            return Segments(source, sizes)
        return Unsupported(f"split sizes {sizes} differ from the sharded blocks {spec.segments}")
    return tuple(Shard(dim) for _ in sizes)


def getitem_rule(node, info: OpInfo, spec_of: SpecOf) -> Result:
    source, index = info.args["input"], info.args["index"]
    spec = spec_of(source)
    if isinstance(spec, tuple):
        return spec[index]
    if not isinstance(spec, Shard):
        return R
    return index_rule(spec, index, shape(source))


def index_rule(spec: Shard, index, in_shape) -> Result:
    """Basic tensor indexing x[..., :n] etc.: the sharded dim must be taken whole. One list
    of ints (Falcon's qkv[:, :, :, [-2]]) keeps its dim in place, as a slice does."""
    items = index if isinstance(index, tuple) else (index,)
    lists = [i for i in items if isinstance(i, list)]
    mixed = lists and any(isinstance(i, int) for i in items)  # ints join the list: dims move to the front
    if len(lists) > 1 or mixed or any(not all(isinstance(j, int) for j in i) for i in lists):
        return Unsupported("advanced indexing of a sharded value")
    items = tuple(slice(None, 0) if isinstance(i, list) else i for i in items)  # in place, not taken whole
    if any(not (isinstance(i, (slice, int)) or i is None or i is Ellipsis) for i in items):
        return Unsupported("advanced indexing of a sharded value")
    if Ellipsis in items:
        at = items.index(Ellipsis)
        used = len([i for i in items if i is not None and i is not Ellipsis])
        items = items[:at] + (slice(None),) * (len(in_shape) - used) + items[at + 1:]
    in_dim, out_dim = 0, 0
    for item in items:
        if item is None:
            out_dim += 1
            continue
        if in_dim == spec.dim:
            if item != slice(None):
                return Unsupported("indexing into the sharded dim")
            return Shard(out_dim, spec.segments)
        if isinstance(item, slice):
            out_dim += 1
        in_dim += 1
    return Shard(out_dim + spec.dim - in_dim, spec.segments)


def select_rule(info: OpInfo, spec: Shard, rank: int) -> Result:
    """select drops a dim (BLOOM's fused [h, 3, d] qkv: q, k and v picked by index)."""
    dim = norm_dim(info.args["dim"], rank)
    if dim == spec.dim:
        return Unsupported("select along the sharded dim")
    return Shard(spec.dim - (dim < spec.dim), spec.segments)


def slice_rule(info: OpInfo, spec: Shard, rank: int) -> Result:
    if norm_dim(first(info.args, "dim") or 0, rank) == spec.dim:
        return Unsupported("slice along the sharded dim")
    return spec


def _sharded_alike(tensors, spec_of: SpecOf, what: str) -> Result:
    """The one spec all of `tensors` share, demanding it of the replicated ones."""
    specs = [spec_of(t) for t in tensors]
    sharded = [s for s in specs if isinstance(s, Shard)]
    if any(s != sharded[0] for s in sharded):
        return Unsupported(f"{what} of differently sharded values")
    for t, s in zip(tensors, specs):
        if not isinstance(s, Shard):
            return Demand(t, sharded[0])
    return sharded[0]


def cat_rule(info: OpInfo, spec_of: SpecOf, node) -> Result:
    dim = norm_dim(first(info.args, "dim") or 0, len(shape(node)))
    if any(isinstance(spec_of(t), Shard) and spec_of(t).dim == dim for t in info.args["tensors"]):
        return Unsupported("cat along the sharded dim")
    return _sharded_alike(info.args["tensors"], spec_of, "cat")


def stack_rule(info: OpInfo, spec_of: SpecOf, node) -> Result:
    """stack adds a dim at `dim` (GPT-J's rotary interleaves halves with it)."""
    dim = norm_dim(first(info.args, "dim") or 0, len(shape(node)))
    spec = _sharded_alike(info.args["tensors"], spec_of, "stack")
    if not isinstance(spec, Shard):
        return spec
    return Shard(spec.dim + 1 if spec.dim >= dim else spec.dim, spec.segments)


def sdpa_rule(info: OpInfo, spec_of: SpecOf) -> Result:
    q, k, v = (first(info.args, *names) for names in (("query", "q"), ("key", "k"), ("value", "v")))
    specs = [spec_of(t) for t in (q, k, v)]
    heads = Shard(1)
    for t, s in zip((q, k, v), specs):
        if isinstance(s, Shard) and s.dim != 1:
            return Unsupported("attention with q/k/v sharded on a dim other than heads")
    for t, s in zip((q, k, v), specs):
        if not isinstance(s, Shard) and shape(t)[1] != 1:   # one k/v head broadcasts over the local heads
            return Demand(t, heads)
    mask = first(info.args, "attn_mask")
    mask_shape = shape(mask)
    if mask_shape is not None and len(mask_shape) == 4 and mask_shape[1] != 1 and not isinstance(spec_of(mask), Shard):
        return Demand(mask, heads)
    return heads


def softmax_rule(info: OpInfo, spec: Shard, rank: int) -> Result:
    if norm_dim(first(info.args, "dim"), rank) == spec.dim:
        return Unsupported("softmax over the sharded dim")
    return spec


def norm_rule(info: OpInfo, spec: Shard, rank: int) -> Result:
    normalized = first(info.args, "normalized_shape") or ()
    if spec.dim >= rank - len(normalized):
        return Unsupported("normalisation over the sharded dim")
    return spec


def matmul_rule(info: OpInfo, spec_of: SpecOf, node) -> Result:
    return _batched_matmul(first(info.args, "input", "self"), first(info.args, "other", "mat2"), spec_of, node)


def baddbmm_rule(info: OpInfo, spec_of: SpecOf, node) -> Result:
    """beta * input + alpha * batch1 @ batch2, batches sharded (BLOOM's alibi bias plus
    q @ k^T over batch x heads); `input` broadcasts like a pointwise operand."""
    spec = _batched_matmul(first(info.args, "batch1"), first(info.args, "batch2"), spec_of, node)
    if spec == R:
        return Unsupported("baddbmm with only its bias sharded")
    if not isinstance(spec, Shard):
        return spec
    bias, out_rank = first(info.args, "input", "self"), len(shape(node))
    bias_spec = spec_of(bias)
    if isinstance(bias_spec, Shard) and bias_spec != Shard(spec.dim - (out_rank - len(shape(bias))), spec.segments):
        return Unsupported("baddbmm bias sharded differently from the batches")
    return _broadcast_operands(spec, [bias], out_rank, spec_of)


def _batched_matmul(a, b, spec_of: SpecOf, node) -> Result:
    """a @ b sharded on a batch dim (blocks kept: batch x heads merged in one dim)."""
    sa, sb = spec_of(a), spec_of(b)
    rank = len(shape(node))
    batch_spec = next((s for s in (sa, sb) if isinstance(s, Shard)), None)
    if batch_spec is None:
        return R
    if batch_spec.dim >= len(shape(a)) - 2:
        return Unsupported("matmul contracting or producing along the sharded dim")
    for t, s in ((a, sa), (b, sb)):
        if not isinstance(s, Shard):
            return Demand(t, batch_spec)
        if s != batch_spec:
            return Unsupported("matmul inputs sharded differently")
    return Shard(batch_spec.dim + rank - len(shape(a)), batch_spec.segments)


def repeat_interleave_rule(info: OpInfo, spec: Shard, rank: int) -> Result:
    dim = first(info.args, "dim")
    if dim is None:
        return Unsupported("repeat_interleave without a dim flattens the sharded value")
    return spec  # rank r's kv groups repeat into exactly rank r's heads


def propagate(node: torch.fx.Node, spec_of: SpecOf, tp: int) -> Result:
    """The output spec of `node` given the specs of its inputs (see module docstring)."""
    info = op_of(node)
    tensor_inputs = [n for n in node.all_input_nodes]
    sharded = [n for n in tensor_inputs if isinstance(spec_of(n), (Shard, tuple))]
    if not sharded:
        return R
    kind = info.kind
    if kind == "pointwise":
        return pointwise_rule(node, info, spec_of)
    if kind == "getitem":
        return getitem_rule(node, info, spec_of)
    if kind in ("size", "assert_metadata"):
        return None
    if kind in ("unknown", "call_module"):
        return Unsupported(f"no sharding rule for {_name(node)}")
    source = first(info.args, "input", "self", "tensor")
    spec = spec_of(source) if source is not None else None
    in_shape = shape(source)
    if not isinstance(spec, Shard):
        if kind == "cat":
            return cat_rule(info, spec_of, node)
        if kind == "stack":
            return stack_rule(info, spec_of, node)
        if kind == "sdpa":
            return sdpa_rule(info, spec_of)
        if kind == "matmul":
            return matmul_rule(info, spec_of, node)
        if kind == "baddbmm":
            return baddbmm_rule(info, spec_of, node)
        return Unsupported(f"no sharding rule for {_name(node)} with a sharded non-primary input")
    rank = len(in_shape)
    if kind == "view":
        return reshape_rule(node, spec, in_shape, shape(node), tp)
    if kind == "expand":
        return expand_rule(spec, in_shape, shape(node))
    simple = {
        "transpose": lambda: transpose_rule(info, spec, rank),
        "permute": lambda: permute_rule(info, spec, rank),
        "split": lambda: split_rule(node, info, spec, source, in_shape, tp),
        "chunk": lambda: split_rule(node, info, spec, source, in_shape, tp),
        "select": lambda: select_rule(info, spec, rank),
        "slice": lambda: slice_rule(info, spec, rank),
        "cat": lambda: cat_rule(info, spec_of, node),
        "sdpa": lambda: sdpa_rule(info, spec_of),
        "softmax": lambda: softmax_rule(info, spec, rank),
        "norm": lambda: norm_rule(info, spec, rank),
        "matmul": lambda: matmul_rule(info, spec_of, node),
        "baddbmm": lambda: baddbmm_rule(info, spec_of, node),
        "repeat_interleave": lambda: repeat_interleave_rule(info, spec, rank),
    }
    if kind in simple:
        return simple[kind]()
    return Unsupported(f"no sharding rule for {_name(node)}")


def _name(node: torch.fx.Node) -> str:
    target = node.target
    return getattr(target, "__name__", None) or str(target)
