"""The planner's bytes for placed state: what the update program and host tables hold.

Per rank, for N trainable device parameter elements of compute dtype size d (2 for bf16 and
fp16, 4 for fp32) and an optimizer keeping s fp32 elements per parameter element:

    device parameters   N * d                 (plus non-trainable ones, at d)
    device gradients    N * d
    fp32 masters        4 * N     when d < 4 or offloaded   (device, or host if offloaded)
    optimizer states    4 * s * N                           (device, or host if offloaded)
    host gradients      N * d     when offloaded (what to_host brings; widened per block)
    host compute copy   N * d     when offloaded and d < 4 (the fused cast's output)

so mixed-precision Adam on the device is 2 + 2 + 4 + 8 = 16 bytes per parameter, and with
the optimizer offloaded the device keeps 2 + 2 and the host 4 + 8 + 2 + 2. A host table holds its rows of the dp split
(ceil(rows / dp) each) in fp32 plus s fp32 elements per entry of row-wise optimizer state.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List

import torch

from graphpar.ir import TensorMeta
from graphpar.runtime.grad_sync import bucket_spans
from graphpar.runtime.placement.embedding import rows_per_rank

FP32 = 4


@dataclass
class PlacedBytes:
    param: int
    grad: int
    optimizer: int
    host: int
    moves: List[tuple] = field(default_factory=list)   # (op, bytes, count, what)


def _size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def placed_bytes(params: Dict[str, TensorMeta], strategy, states: int, tables: Dict[str, TensorMeta],
                 dp: int, bucket_bytes: int) -> PlacedBytes:
    compute = strategy.param_dtype or torch.float32
    d = _size(compute)
    device = {n: m for n, m in params.items() if n not in tables}
    trainable = [m for m in device.values() if m.requires_grad]
    n = sum(m.numel for m in trainable)
    param = sum(m.numel * (d if m.dtype.is_floating_point else _size(m.dtype)) for m in device.values())
    offload = strategy.offload_optimizer
    masters = FP32 * n if (offload or d < FP32) else 0
    optimizer = masters + FP32 * states * n
    host = 0
    moves = []
    if offload:
        host = optimizer + n * d + (n * d if d < FP32 else 0)
        optimizer = 0
        count = len(bucket_spans([m.numel * d for m in reversed(trainable)], bucket_bytes))
        moves = [("to_host", n * d, count, "gradients to the host optimizer"),
                 ("to_device", n * d, count, "updated weights from the host optimizer")]
    for meta in tables.values():
        rows = rows_per_rank(meta.shape[0], dp)
        host += FP32 * rows * meta.shape[1] * (1 + states)
    return PlacedBytes(param, n * d, optimizer, host, moves)
