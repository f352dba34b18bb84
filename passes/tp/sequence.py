"""Sequence parallelism: split the values between TP regions along the sequence.

Megatron-LM's sequence parallelism (Korthikanti et al., 2022). Plain TP replicates
everything outside its regions: the residual stream, LayerNorm/RMSNorm, dropout and the
residual adds run in full on every tp rank. These ops work position by position, so each
rank can run them on its own 1/tp of the sequence instead:

    TP:  row -> all-reduce -> [norm, dropout, add: R] -> copy_to -> column
    SP:  row -> reduce-scatter -> [norm, dropout, add: Sq] -> all-gather -> column

The same bytes move (an all-reduce is a reduce-scatter plus an all-gather), and the
activations between regions take 1/tp of the memory.

The solver here runs after the TP solver (solver.py) and only re-tags values the TP plan
left replicated. Seeds: the outputs of row-parallel layers and vocab-parallel embeddings,
the partial sums of the plan, whose layout is [batch, sequence, ...] (SequenceShard(1)) or
[batch * sequence, ...] (SequenceShard(0) with one segment per sequence, GPT-2's Conv1D).
Batch and sequence sizes come from the first model input: inputs are batch-first, and its
dim 1 is the sequence (token ids [b, s]). From the seeds the spec flows forward through ops
that act on each position alone (pointwise ops, norms and reductions over other dims,
views that keep the sequence dim whole or merge it with the batch, transposes); any other
reader gets the full value back by an all-gather (insert_collectives decides which kind).
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch
import torch.fx

from graphpar.ir import Partial, SequenceShard, Shard, TensorMeta, record
from graphpar.ir.layout import blocks_of
from graphpar.passes.tp.opinfo import op_of
from graphpar.passes.tp.rules import DivisibilityError, R, dim_groups, first, norm_dim, shape

SEED_ROLES = ("row", "vocab_embedding")


def input_layout(gm: torch.fx.GraphModule) -> Optional[Tuple[str, int, int]]:
    """(name, batch, sequence) of the first model input with a sequence dim (rank >= 2)."""
    for node in gm.graph.nodes:
        if node.op == "placeholder" and node.name != "target":
            dims = shape(node)
            if dims is not None and len(dims) >= 2:
                return node.name, dims[0], dims[1]
    return None


def seed_spec(node: torch.fx.Node, batch: int, seq: int) -> Optional[SequenceShard]:
    dims = shape(node)
    if dims is None:
        return None
    if len(dims) >= 3 and dims[0] == batch and dims[1] == seq:
        return SequenceShard(1)
    if len(dims) >= 2 and dims[0] == batch * seq:
        return SequenceShard(0, (seq,) * batch if batch > 1 else None)
    return None


def spanned_dim(out_rank: int, spec: Shard, source_shape, full_size: int) -> Optional[int]:
    """The dim of a pointwise operand that runs along the output's sharded dim (broadcast
    aligns dims from the right), or None if the operand broadcasts over it."""
    dim = spec.dim - (out_rank - len(source_shape))
    return dim if dim >= 0 and source_shape[dim] == full_size else None


# ---- rules: the spec of a node reading a SequenceShard value, or None (it needs the full value)
def _pointwise(node, info, spec_of) -> Optional[SequenceShard]:
    out = shape(node)
    chosen = None
    for arg in info.args["inputs"]:
        spec = spec_of(arg)
        if isinstance(spec, SequenceShard):
            candidate = SequenceShard(spec.dim + len(out) - len(shape(arg)), spec.segments)
            if chosen is not None and candidate != chosen:
                return None
            chosen = candidate
        elif isinstance(spec, (Shard, Partial)):
            return None   # a TP-sharded operand: not a position-wise op on the sequence
    return chosen


def _norm(node, info, spec_of) -> Optional[SequenceShard]:
    spec = spec_of(first(info.args, "input"))
    normalized = first(info.args, "normalized_shape") or ()
    others = [first(info.args, name) for name in ("weight", "bias")]
    if any(isinstance(spec_of(t), (Shard, Partial)) for t in others):
        return None
    return spec if spec.dim < len(shape(node)) - len(normalized) else None


def _reduce(node, info, spec_of) -> Optional[SequenceShard]:
    source = first(info.args, "input", "self")
    spec, rank = spec_of(source), len(shape(source))
    dims = info.args.get("dim")
    if dims is None or dims == []:
        return None       # a reduction over everything mixes the sequence
    dims = {norm_dim(d, rank) for d in (dims if isinstance(dims, (list, tuple)) else [dims])}
    if spec.dim in dims:
        return None
    keepdim = info.args.get("keepdim", False)
    return SequenceShard(spec.dim if keepdim else spec.dim - sum(d < spec.dim for d in dims), spec.segments)


def _reshape(node, info, spec_of, tp: int) -> Optional[SequenceShard]:
    """A view keeps the split if the sequence dim survives as the same pieces: whole, or
    merged with outer dims (each outer index becomes one block), or split back out."""
    source = first(info.args, "input")
    spec, in_shape, out_shape = spec_of(source), shape(source), shape(node)
    groups = dim_groups(in_shape, out_shape)
    for in_dims, out_dims in groups or ():
        if spec.dim not in in_dims:
            continue
        at = in_dims.index(spec.dim)
        blocks = blocks_of(spec)
        outer = _product(in_shape[d] for d in in_dims[:at]) * blocks
        inner = in_shape[spec.dim] // blocks * _product(in_shape[d] for d in in_dims[at + 1:])
        prefix = 1
        for i, d in enumerate(out_dims):
            if outer % prefix == 0 and out_shape[d] % (outer // prefix) == 0:
                count, size = outer // prefix, out_shape[d] // (outer // prefix)
                if size % tp == 0 and size * _product(out_shape[e] for e in out_dims[i + 1:]) == inner:
                    return SequenceShard(d, (size,) * count if count > 1 else None)
            prefix *= out_shape[d]
        return None
    return None


def _product(sizes) -> int:
    total = 1
    for s in sizes:
        total *= s
    return total


def _transpose(node, info, spec_of) -> SequenceShard:
    spec = spec_of(info.args["input"])
    rank = len(shape(node))
    if info.kind == "transpose":
        d0, d1 = norm_dim(info.args["dim0"], rank), norm_dim(info.args["dim1"], rank)
        return SequenceShard({d0: d1, d1: d0}.get(spec.dim, spec.dim), spec.segments)
    dims = [norm_dim(d, rank) for d in info.args["dims"]]
    return SequenceShard(dims.index(spec.dim), spec.segments)


def _softmax(node, info, spec_of) -> Optional[SequenceShard]:
    spec = spec_of(first(info.args, "input"))
    return spec if norm_dim(first(info.args, "dim"), len(shape(node))) != spec.dim else None


def sequence_rule(node: torch.fx.Node, spec_of, tp: int) -> Optional[SequenceShard]:
    if not isinstance(record(node).value, TensorMeta):
        return None
    info = op_of(node)
    if info.kind == "pointwise":
        return _pointwise(node, info, spec_of)
    primary = first(info.args, "input", "self")
    if not isinstance(spec_of(primary), SequenceShard):
        return None
    rules = {"norm": lambda: _norm(node, info, spec_of), "reduce": lambda: _reduce(node, info, spec_of),
             "view": lambda: _reshape(node, info, spec_of, tp), "transpose": lambda: _transpose(node, info, spec_of),
             "permute": lambda: _transpose(node, info, spec_of), "softmax": lambda: _softmax(node, info, spec_of)}
    return rules[info.kind]() if info.kind in rules else None


# ---- the solver ---------------------------------------------------------------------------------
def _no_sequence_error(tp: int, layout) -> ValueError:
    seen = f"{layout[0]} has shape [{layout[1]}, {layout[2]}, ...]" if layout else "no model input has two dims"
    return ValueError(
        f"Strategy(sequence_parallel=True, tp={tp}): no tensor-parallel layer output has a "
        f"[batch, sequence, ...] or [batch * sequence, ...] layout ({seen}), so nothing can be split "
        f"along a sequence. Fix: use sequence_parallel=False, or pass batch-first inputs whose dim 1 is "
        f"the sequence.")


def _check_sequence_divides(seq: int, tp: int, input_name: str) -> None:
    if seq % tp:
        near = sorted({seq - seq % tp, seq + tp - seq % tp} - {0})
        raise DivisibilityError(
            f"Strategy(sequence_parallel=True, tp={tp}): tp does not divide the sequence length {seq} "
            f"(dim 1 of {input_name}): sequence parallelism splits the sequence into tp equal parts. "
            f"Fix: use a sequence length divisible by {tp} (such as {' or '.join(map(str, near))}), "
            f"or sequence_parallel=False.")


def solve_sequence(gm: torch.fx.GraphModule, plan) -> Dict[str, SequenceShard]:
    """Tag the values between the plan's TP regions SequenceShard (in plan.specs)."""
    layout = input_layout(gm)
    seeds = {n for n in gm.graph.nodes if plan.roles.get(n.name) in SEED_ROLES}
    if layout is None or not any(seed_spec(n, layout[1], layout[2]) for n in seeds):
        raise _no_sequence_error(plan.tp, layout)
    name, batch, seq = layout
    _check_sequence_divides(seq, plan.tp, name)
    specs: Dict[torch.fx.Node, SequenceShard] = {}

    def spec_of(n):
        if not isinstance(n, torch.fx.Node):
            return None
        return specs.get(n) or plan.specs.get(n.name, R)
    for node in gm.graph.nodes:
        if node in seeds:
            spec = seed_spec(node, batch, seq)
        elif node.name in plan.specs or node.op not in ("call_function", "call_method"):
            continue
        elif any(n in specs for n in node.all_input_nodes):
            spec = sequence_rule(node, spec_of, plan.tp)
        else:
            continue
        if spec is not None:
            specs[node] = spec
    found = {n.name: s for n, s in specs.items()}
    plan.specs.update(found)
    return found
