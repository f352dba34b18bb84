"""The planner's ZeRO accounting (Strategy.zero > 0 at dp > 1; graphpar/runtime/zero.py).

The rank's trainable parameters are bucketed as the update program buckets them (reverse
model order, `bucket_bytes` of fp32 gradients); each bucket is padded to dp * shard. Per rank,
for n trainable elements of which it owns o (its pieces of every bucket) and an optimizer
keeping s fp32 elements per parameter element:

    gradients          zero=1: d * n (kept whole); zero=2: 0 after the step (each bucket's
                       full gradients are freed into the reduce buffer, the shard after the step)
    optimizer states   4 * s * o  (o is about n / dp; the last ranks own less where there is padding)
    fp32 masters       4 * shard per bucket (padding included), with a compute dtype below
                       fp32 or offload_optimizer; offloaded, masters and states are host bytes,
                       with the reduced gradient rows the host receives

and per step, per bucket, one reduce-scatter of dp * (shard + one flag per parameter) fp32
elements (the buffer it reads) and one all-gather of dp * shard weights (the buffer it fills);
offloaded, the reduced row (shard + flags, fp32) goes to the host and the updated shard (compute
dtype) comes back.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Tuple

import torch

from graphpar.ir import TensorMeta
from graphpar.runtime.grad_sync import bucketize
from graphpar.runtime.zero import REDUCE_DTYPE, ShardLayout

FP32 = 4


@dataclass
class ZeroPlan:
    grad: int                  # gradient bytes held after a step (every dp rank alike)
    optimizer: List[int]       # device optimizer-state (and master) bytes of each dp rank
    host: List[int]            # host bytes of each dp rank (offloaded masters and states)
    moves: List[Tuple[str, int, int, str]]   # (op, bytes, calls, what) over dp, per step
    note: str


class _Sized:
    """A parameter stand-in for bucketize: its size and element size."""

    def __init__(self, meta: TensorMeta):
        self._numel, self._size = meta.numel, meta.nbytes // max(meta.numel, 1)

    def numel(self) -> int:
        return self._numel

    def element_size(self) -> int:
        return self._size


def bucket_numels(params: Dict[str, TensorMeta], order: List[str], bucket_bytes: int) -> List[Tuple[int, ...]]:
    """Each bucket's parameter sizes, bucketed as build_update does (fp32 gradients)."""
    trained = [_Sized(params[name]) for name in reversed(order) if name in params and params[name].requires_grad]
    size = torch.empty((), dtype=REDUCE_DTYPE).element_size()
    return [tuple(p.numel() for p in bucket) for bucket in bucketize(trained, bucket_bytes, size)]


def zero_notes(strategy) -> List[str]:
    if strategy.zero and strategy.dp == 1:
        return [f"zero={strategy.zero} at dp=1: nothing to shard over, so nothing is sharded"]
    return []


def zero_plan(params: Dict[str, TensorMeta], order: List[str], bucket_bytes: int, strategy, states: int) -> ZeroPlan:
    dp = strategy.dp
    buckets = bucket_numels(params, order, bucket_bytes)
    layouts = [[ShardLayout(numels, dp, r) for numels in buckets] for r in range(dp)]
    owned = [sum(layout.owned() for layout in mine) for mine in layouts]
    n = sum(sum(numels) for numels in buckets)
    weight = max((m.nbytes // max(m.numel, 1) for m in params.values() if m.requires_grad), default=FP32)
    first = layouts[0]
    padding = sum(layout.padding for layout in first)
    scattered = sum(dp * (layout.shard + layout.flags) * FP32 for layout in first)
    gathered = sum(dp * layout.shard * weight for layout in first)
    note = (f"zero={strategy.zero} over dp={dp}: {len(first)} bucket(s) padded by {padding} element(s) in all to "
            f"a multiple of {dp}; dp ranks own {', '.join(map(str, owned))} of the {n} trained elements")
    moves = [("reduce_scatter", scattered, len(first), f"gradient buckets, reduce-scattered in fp32 (zero={strategy.zero})"),
             ("all_gather", gathered, len(first), "updated weight shards, all-gathered")]
    masters = sum(FP32 * lay.shard for lay in first) if masters_needed(strategy) else 0  # padding included
    held = [FP32 * states * o + masters for o in owned]
    if strategy.offload_optimizer:
        rows = sum((lay.shard + lay.flags) * FP32 for lay in first)
        moves += [("to_host", rows, len(first), "reduced gradient shards to the host optimizer"),
                  ("to_device", sum(lay.shard * weight for lay in first), len(first),
                   "updated weight shards from the host optimizer")]
        held = [h + rows for h in held]  # the host gradient shards, as the unsharded host update counts them
    return ZeroPlan(grad=n * weight if strategy.zero == 1 else 0,
                    optimizer=[0] * dp if strategy.offload_optimizer else held,
                    host=held if strategy.offload_optimizer else [0] * dp, moves=moves, note=note)


def masters_needed(strategy) -> bool:
    """As passes/build_update.py decides (the planner does not import passes' internals)."""
    return strategy.offload_optimizer or (strategy.param_dtype or torch.float32) != torch.float32
