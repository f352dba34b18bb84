"""How a full tensor maps onto tp ranks under a Shard spec, and back.

    Shard(0)            rank r holds rows [r*n/tp, (r+1)*n/tp)
    Shard(0|q,k,v)      rank r holds the r-th piece of each block: [q_r; k_r; v_r]
"""
from __future__ import annotations

from typing import List

import torch

from graphpar.ir import Shard


def local_shard(full: torch.Tensor, spec: Shard, rank: int, tp: int) -> torch.Tensor:
    blocks = full.split(list(spec.segments), dim=spec.dim) if spec.segments else [full]
    return torch.cat([b.chunk(tp, dim=spec.dim)[rank] for b in blocks], dim=spec.dim)


def full_from_shards(parts: List[torch.Tensor], spec: Shard) -> torch.Tensor:
    tp = len(parts)
    if not spec.segments:
        return torch.cat(parts, dim=spec.dim)
    local_sizes = [s // tp for s in spec.segments]
    pieces = [p.split(local_sizes, dim=spec.dim) for p in parts]
    blocks = [torch.cat([pieces[r][i] for r in range(tp)], dim=spec.dim) for i in range(len(local_sizes))]
    return torch.cat(blocks, dim=spec.dim)
