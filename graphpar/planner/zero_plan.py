"""The planner's ZeRO accounting (Strategy.zero > 0 at dp > 1; graphpar/runtime/zero.py).

The rank's trainable parameters are bucketed as the update program buckets them (reverse
model order, `bucket_bytes` of gradients); each bucket is padded to dp * shard. Per rank,
for n trainable elements of compute dtype size d and gradient dtype size g
(Strategy.gradient_dtype: 4 unless reduce_dtype is the compute dtype), of which it owns o
(its pieces of every bucket, p pieces in all), and an optimizer keeping s fp32 elements per
parameter element and c bytes of scalars per tensor it steps (accounting.OptimizerState):

    parameters         zero=1, 2: d * n (whole), plus each bucket's padding in fp32 on the device,
                       where the parameters are views of one flat dp * shard buffer per bucket;
                       zero=3: d * shard per bucket (padding included), the rank's flat shard,
                       and nothing else between steps
    gradients          zero=1: g * n (kept whole); zero=2, 3: 0 after the step (each bucket's
                       full gradients are freed into the reduce buffer, the shard after the step)
    optimizer states   4 * s * o + c * p  (o is about n / dp; the last ranks own less where
                       there is padding; torch keeps one scalar `step` per piece stepped)
    fp32 masters       4 * shard per bucket (padding included), with a compute dtype below
                       fp32 or offload_optimizer; offloaded, masters and states are host bytes,
                       with the reduced gradient rows the host receives
    gathered (zero=3)  in forward and backward, at most two buckets' gathered weights at once
                       (dp * shard * d each: the bucket in use and the next, prefetched): the
                       largest sum over two buckets used one after the other

and per step, per bucket, one reduce-scatter of dp * (shard + one flag per parameter)
elements of size g (the buffer it reads) and, at zero=1 and 2, one all-gather of dp * shard weights after
the step (the buffer it fills). zero=3 gathers the weights before their use instead, in every
microbatch's forward and again in its backward (only buckets holding a weight autograd saves:
not a bucket of embedding tables alone), and reduce-scatters every microbatch's gradients:
up to 2 * m all-gathers and m reduce-scatters per bucket and step, none after the step; at
pp = 1 the bucket forward reads last stays gathered into its backward, so it is gathered
once per microbatch (passes/shard_parameters.py keeps it). Its
buckets hold one stage's weights each, a weight tied across pp ranks alone (zero3.bucket_runs).
Offloaded, the reduced row (shard + flags, size g) goes to the host and the updated shard
(compute dtype) comes back. With expert parallelism the expert weights are planned apart,
sharded over their edp group (at zero=3 in one run per experts module, gathered around its call;
at edp = 1 as zero=2 plans them: mesh.experts_stage).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch

from graphpar.ir import TensorMeta
from graphpar.planner.accounting import OptimizerState
from graphpar.runtime.grad_sync import bucketize
from graphpar.runtime.zero import ShardLayout

FP32 = 4


@dataclass
class ZeroPlan:
    param: int                 # device parameter bytes held between steps (every dp rank alike)
    grad: int                  # gradient bytes held after a step (every dp rank alike)
    optimizer: List[int]       # device optimizer-state (and master) bytes of each dp rank
    host: List[int]            # host bytes of each dp rank (offloaded masters and states)
    gathered: int              # zero=3: the most gathered weight bytes in flight at once
    runs_in_flight: int        # zero=3: the gathered bytes of the two largest runs (expert weights: one experts call's each)
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


def bucket_names(params: Dict[str, TensorMeta], order: List[str], bucket_bytes: int, size: int,
                 runs: Optional[List[List[str]]] = None) -> List[List[str]]:
    """Each bucket's parameters, bucketed as build_update does (gradients of `size` bytes an
    element); `runs` (zero=3: names in bucket order, zero3.bucket_runs) keeps different runs
    in different buckets."""
    trained = [name for name in reversed(order) if name in params and params[name].requires_grad]
    buckets = []
    for run in runs or [trained]:
        sized = [_Sized(params[name]) for name in run]
        names = {id(s): name for s, name in zip(sized, run)}
        buckets += [[names[id(s)] for s in bucket] for bucket in bucketize(sized, bucket_bytes, size)]
    return buckets



def zero_notes(strategy) -> List[str]:
    if strategy.zero and strategy.dp == 1:
        return [f"zero={strategy.zero} at dp=1: nothing to shard over, so nothing is sharded"]
    return []


def zero_plan(params: Dict[str, TensorMeta], order: List[str], bucket_bytes: int, strategy,
              states: OptimizerState, runs: Optional[List[List[str]]] = None,
              weights_saved: Optional[set] = None, shards: Optional[int] = None,
              kept: Optional[str] = None) -> ZeroPlan:
    """`weights_saved`: the parameters autograd saves (zero=3 gathers a bucket again in backward
    only when it holds one); None: every bucket. `shards`: the ranks the buckets are sharded
    over, dp unless given (expert weights: their edp group). `kept`: the parameter read last in
    forward, whose bucket zero=3 keeps gathered into backward instead of gathering it again."""
    dp, zero = shards or strategy.dp, strategy.zero
    grad = torch.empty((), dtype=strategy.gradient_dtype).element_size()
    names = bucket_names(params, order, bucket_bytes, grad, runs)
    buckets = [tuple(params[name].numel for name in bucket) for bucket in names]
    regathered = [(weights_saved is None or any(name in weights_saved for name in bucket)) and kept not in bucket
                  for bucket in names]
    layouts = [[ShardLayout(numels, dp, r) for numels in buckets] for r in range(dp)]
    first = layouts[0]
    weight = max((m.nbytes // max(m.numel, 1) for m in params.values() if m.requires_grad), default=FP32)
    n = sum(lay.total for lay in first)
    masters = sum(FP32 * lay.shard for lay in first) if masters_needed(strategy) else 0  # padding included
    held = [states.held(sum(lay.owned() for lay in mine), sum(len(lay.pieces()) for lay in mine)) + masters
            for mine in layouts]
    moves = _dp_moves(first, zero, strategy.microbatches, weight, strategy.gradient_dtype, regathered)
    if strategy.offload_optimizer:
        rows = sum((lay.shard + lay.flags) * grad for lay in first)
        moves += [("to_host", rows, len(first), "reduced gradient shards to the host optimizer"),
                  ("to_device", sum(lay.shard * weight for lay in first), len(first),
                   "updated weight shards from the host optimizer")]
        held = [h + rows for h in held]  # the host gradient shards, as the unsharded host update counts them
    frozen = sum(m.nbytes for m in params.values() if not m.requires_grad)
    return ZeroPlan(param=frozen + _param_elements(first, zero, strategy) * weight,
                    grad=n * grad if zero == 1 else 0,
                    optimizer=[0] * dp if strategy.offload_optimizer else held,
                    host=held if strategy.offload_optimizer else [0] * dp,
                    gathered=gathered_in_flight(first, weight) if zero == 3 else 0,
                    runs_in_flight=_two_largest_runs(names, first, runs, weight) if zero == 3 else 0,
                    moves=moves, note=_note(zero, dp, layouts, n))


def _param_elements(layouts: List[ShardLayout], zero: int, strategy) -> int:
    """The trained weight elements a rank holds between steps: zero=3 its padded shard of each
    bucket; zero=1/2 with fp32 weights on the device each bucket's flat buffer, padding included
    (zero.flatten_bucket); with fp32 masters the parameters alone."""
    if zero == 3:
        return sum(lay.shard for lay in layouts)
    if masters_needed(strategy):
        return sum(lay.total for lay in layouts)
    return sum(lay.shard * lay.dp for lay in layouts)


def _dp_moves(layouts: List[ShardLayout], zero: int, microbatches: int, weight: int, grad_dtype: torch.dtype,
              regathered: List[bool]) -> List[Tuple[str, int, int, str]]:
    """The dp collectives of one step: (op, bytes, calls, what)."""
    grad = torch.empty((), dtype=grad_dtype).element_size()
    scattered = sum(lay.dp * (lay.shard + lay.flags) * grad for lay in layouts)
    reduced = f"reduce-scattered in {str(grad_dtype).removeprefix('torch.')}"
    gathered = [lay.dp * lay.shard * weight for lay in layouts]
    buckets = len(layouts)
    if zero < 3:
        return [("reduce_scatter", scattered, buckets, f"gradient buckets, {reduced} (zero={zero})"),
                ("all_gather", sum(gathered), buckets, "updated weight shards, all-gathered")]
    m = microbatches
    again = [size for size, saved in zip(gathered, regathered) if saved]  # only buckets holding a saved weight
    return [("all_gather", m * (sum(gathered) + sum(again)), m * (buckets + len(again)),
             "weights gathered before their use in forward, and in backward where autograd saved one (zero=3)"),
            ("reduce_scatter", m * scattered, m * buckets, f"gradient buckets, {reduced} (zero=3)")]


def _two_largest_runs(names: List[List[str]], layouts: List[ShardLayout], runs: Optional[List[List[str]]],
                      weight: int) -> int:
    """The gathered bytes of the two runs (all buckets as one, without runs) whose buckets add
    up to most."""
    run_of = {name: i for i, run in enumerate(runs or [[n for bucket in names for n in bucket]]) for name in run}
    sizes: Dict[int, int] = {}
    for bucket, lay in zip(names, layouts):
        sizes[run_of[bucket[0]]] = sizes.get(run_of[bucket[0]], 0) + lay.dp * lay.shard * weight
    return sum(sorted(sizes.values())[-2:])


def gathered_in_flight(layouts: List[ShardLayout], weight: int) -> int:
    """zero=3: the bucket in use and the next one, prefetched, are gathered at once; forward
    and backward walk the buckets in opposite orders, so both hold the same neighbours. The
    bucket kept from forward into backward (pp = 1) adds no pair: it is held with the bucket
    before it in forward, alone through the loss, and with that same bucket, prefetched, in
    backward."""
    sizes = [lay.dp * lay.shard * weight for lay in layouts]
    return max([a + b for a, b in zip(sizes, sizes[1:])] or sizes or [0])


def _note(zero: int, dp: int, layouts: List[List[ShardLayout]], n: int) -> str:
    first = layouts[0]
    owned = [sum(lay.owned() for lay in mine) for mine in layouts]
    return (f"zero={zero} over dp={dp}: {len(first)} bucket(s) padded by {sum(lay.padding for lay in first)} "
            f"element(s) in all to a multiple of {dp}; dp ranks own {', '.join(map(str, owned))} of the {n} "
            f"trained elements" + ("; each rank keeps its padded shard of every bucket as its parameters and "
                                   "gathers at most two buckets at once" if zero == 3 else ""))


def masters_needed(strategy) -> bool:
    """As passes/build_update.py decides (the planner does not import passes' internals)."""
    return strategy.offload_optimizer or (strategy.param_dtype or torch.float32) != torch.float32
