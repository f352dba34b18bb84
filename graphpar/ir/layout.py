"""How a full tensor maps onto tp ranks under a Shard spec, and back.

    Shard(0)            rank r holds rows [r*n/tp, (r+1)*n/tp)
    Shard(0|q,k,v)      rank r holds the r-th piece of each block: [q_r; k_r; v_r]
    Shard(0|q,Rk,Rv)    the same, blocks k and v whole on every rank: [q_r; k; v]
    SequenceShard(0|b x s)  the same with b equal blocks: each sequence of a flattened
                        [b*s, h] value split separately (see blocks_of)
"""
from __future__ import annotations

from typing import List, Tuple

import torch

from graphpar.ir import Shard


def local_shard(full: torch.Tensor, spec: Shard, rank: int, tp: int) -> torch.Tensor:
    blocks = full.split(list(spec.segments), dim=spec.dim) if spec.segments else [full]
    return torch.cat([b if i in spec.whole else b.chunk(tp, dim=spec.dim)[rank] for i, b in enumerate(blocks)],
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
    tp = len(parts)
    if not spec.segments:
        return torch.cat(parts, dim=spec.dim)
    local_sizes = local_segments(spec, tp)
    pieces = [p.split(local_sizes, dim=spec.dim) for p in parts]
    blocks = [pieces[0][i] if i in spec.whole else torch.cat([pieces[r][i] for r in range(tp)], dim=spec.dim)
              for i in range(len(local_sizes))]   # a whole block: every rank holds the same one
    return torch.cat(blocks, dim=spec.dim)


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
