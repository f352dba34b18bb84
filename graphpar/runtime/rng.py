"""Random streams for dropout, reproducible from Strategy.seed (see passes/assign_rng_streams.py;
the offsets, below, are graphpar.strategy.stream_offsets).

    global    seed + 1000 * pp_rank                 same on every tp rank (and dp replica)
    tp_local  seed + 2718 + tp_rank + 1000 * pp_rank different on each tp rank

Pipeline stages hold different layers, so each stage has its own streams (as in Megatron,
whose tp offset 2718 is kept; graphpar spaces pp stages by 1000).
"""
from __future__ import annotations

from typing import Dict

import torch

from graphpar.strategy import stream_offsets


def make_streams(seed: int, mesh, device) -> Dict[str, torch.Generator]:
    streams = {}
    for name, offset in stream_offsets(mesh.tp_rank, mesh.pp_rank).items():
        generator = torch.Generator(device=device)
        generator.manual_seed(seed + offset)
        streams[name] = generator
    return streams
