"""assign_rng_streams: which random stream each dropout draws from.

    before: dropout = graphpar.runtime.ops.dropout(add, 0.1)                   # S(2)
    after:  dropout = graphpar.runtime.ops.dropout(add, 0.1, 'tp_local', None)  # S(2)

Megatron's rule: on a tp-sharded value each tp rank holds different elements and needs its
own mask, drawn from a stream seeded by (Strategy.seed, tp rank) ("tp_local"); on a
replicated value every tp rank must drop the same elements, so all draw from the stream
seeded by Strategy.seed alone ("global"). With compile(dropout_masks="tp_invariant"),
sharded values instead take their slice of the full-size mask drawn from the global stream,
so a run gives the same masks, and the same losses, at any tp degree.

Sequence parallelism (SequenceShard, Sq) follows the same rule: each tp rank holds other
positions of the sequence, so dropout there draws from "tp_local" (Megatron forks its
model-parallel RNG tracker around sequence-parallel dropout for the same reason), or takes
its slice of the global full-size mask with "tp_invariant" (then the masks, and the losses,
are those of the run without sequence parallelism and of tp = 1):

    dropout = graphpar.runtime.ops.dropout(add, 0.1, 'tp_local', None)     # Sq(1)
    dropout = graphpar.runtime.ops.dropout(add, 0.1, 'global', 1)          # Sq(1), tp_invariant
"""
from __future__ import annotations

from graphpar.runtime import ops
from graphpar.ir import SequenceShard, Shard, record, stamp
from graphpar.ir.layout import blocks_of

PASS = "assign_rng_streams"
MASK_MODES = ("local", "tp_invariant")


def _stream(spec, mode: str):
    """(stream, shard dim[, blocks]) for a value with this spec."""
    if not isinstance(spec, Shard):
        return "global", None
    if mode != "tp_invariant":
        return "tp_local", None
    blocks = blocks_of(spec) if isinstance(spec, SequenceShard) else 1
    return ("global", spec.dim) + ((blocks,) if blocks > 1 else ())


def assign_rng_streams(gm, ctx):
    mode = ctx.options.dropout_masks
    if mode not in MASK_MODES:
        raise ValueError(f"dropout_masks={mode!r} is not a mask mode: use one of {MASK_MODES}. Fix: "
                         f"'local' (Megatron: per-tp-rank streams) or 'tp_invariant' (same masks at any tp).")
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target is ops.dropout:
            node.args = (node.args[0], node.args[1]) + _stream(record(node).spec, mode)
        elif node.target is ops.attention:
            # attention dropout runs inside sdpa on this rank's heads: a tp-local stream
            node.kwargs = {**node.kwargs, "stream": _stream(record(node).spec, "local")[0]}
        else:
            continue
        stamp(node, PASS)
    return gm
