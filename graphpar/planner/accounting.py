"""The planner's bytes for placed state: what the update program and host tables hold.

Per rank, for N trainable device parameter elements in P tensors, of compute dtype size d (2
for bf16 and fp16, 4 for fp32) and gradient dtype size g (Strategy.gradient_dtype: 4, or d
with reduce_dtype=param_dtype), and an optimizer keeping s fp32 elements per parameter element
and c bytes of scalars per parameter tensor (OptimizerState):

    device parameters   N * d                 (plus non-trainable ones, at d)
    device gradients    N * g
    fp32 masters        4 * N     when d < 4 or offloaded   (device, or host if offloaded)
    optimizer states    4 * s * N + c * P                   (device, or host if offloaded)
    host gradients      N * g     when offloaded (what to_host brings; widened per block)
    host compute copy   N * d     when offloaded and d < 4 (the fused cast's output)

so mixed-precision Adam on the device is 2 + 4 + 4 + 8 = 18 bytes per parameter with fp32
gradients (Megatron's figure), 16 with reduce_dtype=param_dtype (plus AdamW's 4-byte `step`
per tensor), and with the optimizer offloaded the device keeps 2 + 4 and the host
4 + 8 + 4 + 2 (2 + 2 and 4 + 8 + 2 + 2 with bf16 gradients). A host table holds its rows of the dp split (ceil(rows / dp) each) in fp32 plus
s fp32 elements per entry of row-wise optimizer state and the table's c bytes of scalars.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List

import torch

from graphpar.ir import TensorMeta
from graphpar.runtime.grad_sync import bucket_spans
from graphpar.runtime.placement.embedding import rows_per_rank

FP32 = 4


@dataclass(frozen=True)
class OptimizerState:
    """What an optimizer keeps per parameter tensor it steps, read off the optimizer itself
    (graphpar.planner.plan.optimizer_state): AdamW 2 elements and a 4-byte step, SGD with
    momentum 1 element, plain SGD nothing. torch keeps the scalars (Adam's `step`) as 0-d
    fp32 tensors, one per tensor stepped: per parameter, or per ZeRO piece."""
    elements: int = 0      # fp32 elements of state per parameter element
    scalar_bytes: int = 0  # bytes of per-tensor scalar state

    def held(self, elements: int, tensors: int) -> int:
        """The state of `tensors` stepped tensors holding `elements` elements in all."""
        return FP32 * self.elements * elements + self.scalar_bytes * tensors


@dataclass
class PlacedBytes:
    param: int
    grad: int
    optimizer: int
    host: int
    moves: List[tuple] = field(default_factory=list)   # (op, bytes, count, what)


def _size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def placed_bytes(params: Dict[str, TensorMeta], strategy, states: OptimizerState, tables: Dict[str, TensorMeta],
                 dp: int, bucket_bytes: int) -> PlacedBytes:
    compute = strategy.param_dtype or torch.float32
    d, g = _size(compute), _size(strategy.gradient_dtype)
    device = {n: m for n, m in params.items() if n not in tables}
    trainable = [m for m in device.values() if m.requires_grad]
    n = sum(m.numel for m in trainable)
    param = sum(m.numel * (d if m.dtype.is_floating_point else _size(m.dtype)) for m in device.values())
    offload = strategy.offload_optimizer
    masters = FP32 * n if (offload or d < FP32) else 0
    optimizer = masters + states.held(n, len(trainable))
    host = 0
    moves = []
    if offload:
        host = optimizer + n * g + (n * d if d < FP32 else 0)
        optimizer = 0
        count = len(bucket_spans([m.numel * g for m in reversed(trainable)], bucket_bytes))
        moves = [("to_host", n * g, count, "gradients to the host optimizer"),
                 ("to_device", n * d, count, "updated weights from the host optimizer")]
    for meta in tables.values():
        rows = rows_per_rank(meta.shape[0], dp)
        host += FP32 * rows * meta.shape[1] + states.held(rows * meta.shape[1], 1)
    return PlacedBytes(param, n * g, optimizer, host, moves)
