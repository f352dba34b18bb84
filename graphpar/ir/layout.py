"""How a full tensor maps onto tp ranks under a Shard spec, and back.

    Shard(0)            rank r holds rows [r*n/tp, (r+1)*n/tp)
    Shard(0|q,k,v)      rank r holds the r-th piece of each block: [q_r; k_r; v_r]
    Shard(0|q,Rk,Rv)    the same, blocks k and v whole on every rank: [q_r; k; v]
    SequenceShard(0|b x s)  the same with b equal blocks: each sequence of a flattened
                        [b*s, h] value split separately (see blocks_of)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch

from graphpar.ir import Shard


@dataclass(frozen=True)
class Chunk:
    """One contiguous piece of a rank's local shard inside the full tensor."""
    offsets: Tuple[int, ...]     # where the piece starts in the full tensor
    sizes: Tuple[int, ...]
    dim: int                     # the dim the piece is cut along
    local_start: int             # where it starts along `dim` in this rank's tensor


def placement(full_shape, spec: Optional[Shard], tp_rank: int, tp: int) -> List[Chunk]:
    """The one layout rule: the pieces of rank ``tp_rank``'s tensor under a tp Shard spec.
    One for a whole tensor (spec None) or a plain Shard(dim), one per block for fused blocks
    (Shard(dim) with segments), whose local shard is not one contiguous part of the full
    tensor; a whole block lies at the same place on every rank. The sizes divide by tp
    (the tp rules refuse any other, passes/tp/rules.py check_divisible)."""
    full_shape = tuple(full_shape)
    if spec is None:
        return [Chunk((0,) * len(full_shape), full_shape, 0, 0)]
    chunks, full_start, local_start = [], 0, 0
    for i, block in enumerate(spec.segments or (full_shape[spec.dim],)):
        size = block if i in spec.whole else block // tp
        offsets, sizes = [0] * len(full_shape), list(full_shape)
        offsets[spec.dim], sizes[spec.dim] = full_start + (0 if i in spec.whole else tp_rank * size), size
        chunks.append(Chunk(tuple(offsets), tuple(sizes), spec.dim, local_start))
        full_start += block
        local_start += size
    return chunks


def local_shard(full: torch.Tensor, spec: Shard, rank: int, tp: int) -> torch.Tensor:
    """Rank `rank`'s local shard of `full`: its pieces (placement) concatenated."""
    return torch.cat([full.narrow(c.dim, c.offsets[c.dim], c.sizes[c.dim]) for c in placement(full.shape, spec, rank, tp)],
                     dim=spec.dim)


def local_segments(spec: Shard, tp: int) -> List[int]:
    """The sizes of a rank's pieces of the blocks of `spec` (a whole block keeps its size)."""
    return [s if i in spec.whole else s // tp for i, s in enumerate(spec.segments)]


def full_shape(local_shape, spec, tp: int) -> Tuple[int, ...]:
    """The full shape a tp rank's local shard of `local_shape` under `spec` is a piece of."""
    shape = list(local_shape)
    if spec is not None:
        shape[spec.dim] = sum(spec.segments) if spec.whole else shape[spec.dim] * tp
    return tuple(shape)


def full_from_shards(parts: List[torch.Tensor], spec: Shard) -> torch.Tensor:
    """The inverse of local_shard: each full-tensor piece (placement) from the rank that
    holds it, in the full tensor's order (a whole block from rank 0: every rank holds it)."""
    tp = len(parts)
    shape = full_shape(parts[0].shape, spec, tp)
    pieces = {}   # start along spec.dim -> piece; a whole block: rank 0's (every rank holds it)
    for rank, part in enumerate(parts):
        for c in placement(shape, spec, rank, tp):
            pieces.setdefault(c.offsets[spec.dim], part.narrow(c.dim, c.local_start, c.sizes[c.dim]))
    return torch.cat([pieces[start] for start in sorted(pieces)], dim=spec.dim)


def blocks_of(spec: Shard) -> int:
    """Equal blocks of the sharded dim (1: the dim is split as a whole)."""
    if not spec.segments:
        return 1
    if len(set(spec.segments)) != 1:
        raise ValueError(f"{spec.describe()} has blocks of different sizes; only equal blocks have a "
                         f"blocked collective. Fix: gather the values after splitting the blocks.")
    return len(spec.segments)


def piece(full: torch.Tensor, dim: int, rank: int, tp: int, blocks: int = 1) -> torch.Tensor:
    """Rank `rank`'s piece of `full` split on `dim` in `blocks` equal blocks (local_shard for
    equal blocks, as one view)."""
    return full.unflatten(dim, (blocks, tp, -1)).select(dim + 1, rank).flatten(dim, dim + 1)


def join(parts: List[torch.Tensor], dim: int, blocks: int = 1) -> torch.Tensor:
    """The inverse of piece: the full tensor from every rank's piece, in rank order."""
    return torch.stack([p.unflatten(dim, (blocks, -1)) for p in parts], dim=dim + 1).flatten(dim, dim + 2)
