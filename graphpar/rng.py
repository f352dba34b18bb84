"""Random streams for dropout, reproducible from Strategy.seed (see passes/assign_rng_streams.py).

    global    seed + 1000 * pp_rank                 same on every tp rank (and dp replica)
    tp_local  seed + 2718 + tp_rank + 1000 * pp_rank different on each tp rank

Pipeline stages hold different layers, so each stage has its own streams (as in Megatron,
whose tp offset 2718 is kept; graphpar spaces pp stages by 1000).
"""
from __future__ import annotations

from typing import Dict

import torch


def make_streams(seed: int, mesh, device) -> Dict[str, torch.Generator]:
    offset = 1000 * mesh.pp_rank
    streams = {}
    for name, value in (("global", seed + offset), ("tp_local", seed + 2718 + mesh.tp_rank + offset)):
        generator = torch.Generator(device=device)
        generator.manual_seed(value)
        streams[name] = generator
    return streams
