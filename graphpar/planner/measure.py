"""Measured step times of strategies, to set beside the cost model's predictions.

    seconds = measure_steps(model, [strategy, ...], example_inputs, loss_fn, optimizer, example_target)

launches the strategies' world (graphpar.launch, gloo) once per strategy, in fresh
processes each time (what a compiled model leaves in its process, its process groups and
their threads, slowed the strategies measured after it: a dp = 4 step by 20% after 20 other
compiles, and the pipelines late in a run of 124 strategies up to 5x), compiles a copy of
the model in every rank, runs `warmup` steps and then `steps` timed ones; a step's time is
the slowest rank's, and each strategy's result is the median.
"""
from __future__ import annotations

import statistics
import time
from typing import Any, Callable, List, Optional

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree

from graphpar.distributed.launch import launch
from graphpar.frontend.compile import compile as compile_model
from graphpar.runtime.single_stage import batch_size
from graphpar.strategy import Strategy


def measure_steps(model: torch.nn.Module, strategies: List[Strategy], example_inputs,
                  loss_fn: Optional[Callable] = None, optimizer: Optional[Callable] = None,
                  example_target: Any = None, steps: int = 5, warmup: int = 2, **options) -> List[float]:
    """Median seconds per training step of each strategy, all of one world size
    (example_inputs / example_target: the global batch, split over dp as the search splits it)."""
    if steps < 1 or warmup < 0:
        raise ValueError(f"measure_steps: steps={steps} must be >= 1 and warmup={warmup} >= 0; e.g. steps=5")
    worlds = {s.world_size for s in strategies}
    if len(worlds) != 1:
        raise ValueError(f"measure_steps: the strategies span world sizes {sorted(worlds)}; one launch runs one "
                         f"world. Fix: measure each world size's strategies in a call of its own")
    world = worlds.pop()
    found = []
    for strategy in strategies:
        per_rank = launch(_timed_strategy, world, args=(model, strategy, tuple(example_inputs), loss_fn, optimizer,
                                                        example_target, steps, warmup, options))
        found.append(statistics.median(max(times) for times in zip(*per_rank)))
    return found


def _local(value, dp: int):
    if isinstance(value, torch.Tensor) and value.dim() > 0:
        return value[: value.shape[0] // dp]
    return value


def _timed_strategy(model, strategy: Strategy, inputs, loss_fn, optimizer, target, steps: int, warmup: int,
                    options) -> List[float]:
    """In each rank: the seconds of each timed step (every dp rank steps on the first dp
    share of the batch: the time does not depend on the values)."""
    flat, spec = pytree.tree_flatten(inputs)
    batch_size(flat, "example_inputs")
    local = pytree.tree_unflatten([_local(v, strategy.dp) for v in flat], spec)
    target = _local(target, strategy.dp)
    pm = compile_model(model, strategy, example_inputs=local, loss_fn=loss_fn, optimizer=optimizer,
                       example_target=target, **options)
    for _ in range(warmup):
        pm.train_step(*local, target=target)
    times = []
    for _ in range(steps):
        dist.barrier()
        start = time.perf_counter()
        pm.train_step(*local, target=target)
        times.append(time.perf_counter() - start)
    return times
