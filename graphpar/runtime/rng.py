"""Random streams for dropout, reproducible from Strategy.seed (see passes/assign_rng_streams.py).

    global    seed + 1000 * pp_rank                 same on every tp rank (and dp replica)
    tp_local  seed + 2718 + tp_rank + 1000 * pp_rank different on each tp rank

Pipeline stages hold different layers, so each stage has its own streams (as in Megatron,
whose tp offset 2718 is kept; graphpar spaces pp stages by 1000).
"""
from __future__ import annotations

from typing import Dict

import torch


#: torch seeds generators with unsigned 64-bit ints
SEED_LIMIT = 2 ** 64


def _offsets(tp_rank: int, pp_rank: int) -> Dict[str, int]:
    return {"global": 1000 * pp_rank, "tp_local": 2718 + tp_rank + 1000 * pp_rank}


def largest_seed(tp: int, pp: int) -> int:
    """The largest Strategy.seed whose every rank's stream seeds fit in 64 bits."""
    return SEED_LIMIT - 1 - max(_offsets(tp - 1, pp - 1).values())


def make_streams(seed: int, mesh, device) -> Dict[str, torch.Generator]:
    streams = {}
    for name, offset in _offsets(mesh.tp_rank, mesh.pp_rank).items():
        generator = torch.Generator(device=device)
        generator.manual_seed(seed + offset)
        streams[name] = generator
    return streams
