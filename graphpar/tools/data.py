"""Sharding a dataset across data-parallel ranks without hangs or double counting.

Every dp rank must run the same number of ``train_step`` calls: each step ends in a
gradient all-reduce, and a rank with one batch more than its peers waits in that
all-reduce for peers that already finished the epoch (until the collective timeout).
Compiled graphpar programs also have fixed batch shapes, so a short last batch would not
run at all. This module therefore deals a dataset of ``n`` samples out in *global
batches* of ``dp * batch_size`` samples::

    order  = range(n), or a permutation seeded by (seed, epoch), the same on every rank
    step s = order[s*G : (s+1)*G]            G = dp * batch_size
    rank r = step s[r*batch_size : (r+1)*batch_size]

so every rank gets the same number of equal-sized batches, and together the ranks of one
step read consecutive samples of the order. What happens to the ``n % G`` samples left
over is the ``remainder`` choice:

``"drop"`` (training)
    The final partial global batch is skipped: ``n // G`` batches per rank, every sample at
    most once per epoch, and ``n % G`` samples unseen this epoch (with ``shuffle=True``
    and :meth:`DistributedBatches.set_epoch`, a different few each epoch).

``"pad"`` (evaluation)
    The final global batch is completed with samples repeated from the start of the order,
    ``ceil(n / G)`` batches per rank, and every position carries a ``valid`` flag that is
    False for those repeats. :func:`evaluate_exact` uses the flags so that each sample is
    counted exactly once and the metric equals the single-process metric.

Compared with ``torch.utils.data.DistributedSampler``: it also pads by repeating samples
(to a multiple of the number of replicas, not of the global batch), but has no mask, so an
evaluation metric averaged over its batches counts up to ``dp - 1`` samples twice and is
skewed; and its ranks' last batches can be shorter than the others, which a compiled
program with fixed batch shapes cannot run.

Every rank must see a dataset of the same length (the shard layout depends on nothing
else); :func:`evaluate_exact` checks that, :class:`DistributedBatches` takes it on trust so
that building one needs no collective.
"""
from __future__ import annotations

import datetime
import math
from dataclasses import dataclass
from typing import Any, Callable, Iterator, List, Optional, Tuple

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import default_collate

from graphpar.distributed import groups as distributed
from graphpar.errors import invalid, is_int_at_least

__all__ = ["ShardPlan", "shard_indices", "DistributedBatches", "evaluate_exact", "REMAINDERS"]

#: The accepted values of ``remainder``.
REMAINDERS = ("drop", "pad")


@dataclass
class ShardPlan:
    """One rank's batches for one epoch.

    ``batches[k]`` are the dataset indices of this rank's k-th batch (always
    ``batch_size`` of them); ``valid[k][j]`` is False where ``batches[k][j]`` is a padding
    repeat (only with ``remainder="pad"``) that must not be counted. ``dropped`` is the
    number of samples no rank reads this epoch (only with ``remainder="drop"``).
    """
    batches: List[List[int]]
    valid: List[List[bool]]
    dropped: int = 0

    def __len__(self) -> int:
        return len(self.batches)

    @property
    def num_valid(self) -> int:
        return sum(sum(flags) for flags in self.valid)


def shard_indices(n: int, dp: int, dp_rank: int, batch_size: int, *, remainder: str = "drop",
                  shuffle: bool = False, seed: int = 0, epoch: int = 0) -> ShardPlan:
    """The batches rank ``dp_rank`` of ``dp`` reads from a dataset of ``n`` samples.

    Pure and deterministic: every rank computes the whole layout from the same arguments
    (only ``dp_rank`` differs), so no communication is needed to agree on it. See the
    module docstring for the layout and for ``remainder``. With ``shuffle=True`` the order
    is a permutation drawn from ``(seed, epoch)``; distinct pairs give independent
    permutations (unlike ``seed + epoch``, where seed 0 epoch 1 equals seed 1 epoch 0).

    Raises:
        ValueError: for a batch_size below 1, a dp_rank outside the dp group, an unknown
            remainder, or ``remainder="drop"`` with fewer than ``dp * batch_size`` samples
            (every rank would get zero batches).
    """
    _check_layout(n, dp, dp_rank, batch_size, remainder)
    _check_int("seed", seed, 0, "pass the same non-negative int on every rank")
    _check_int("epoch", epoch, 0, "count epochs from 0")
    order = _order(n, shuffle, seed, epoch)
    per_step = dp * batch_size
    steps = n // per_step if remainder == "drop" else math.ceil(n / per_step)
    batches, valid = [], []
    for step in range(steps):
        start = step * per_step + dp_rank * batch_size
        positions = range(start, start + batch_size)
        # Padding wraps around to the start of the order; it only exists for "pad",
        # where the n % G leftover samples need a full global batch.
        batches.append([order[p % n] for p in positions])
        valid.append([p < n for p in positions])
    dropped = n - steps * per_step if remainder == "drop" else 0
    return ShardPlan(batches, valid, dropped)


def _order(n: int, shuffle: bool, seed: int, epoch: int) -> List[int]:
    if not shuffle:
        return list(range(n))
    # SeedSequence mixes the pair, so (seed, epoch) pairs never share a permutation; numpy
    # rather than torch so the global RNG state the user seeded is left untouched.
    return np.random.default_rng([seed, epoch]).permutation(n).tolist()


class DistributedBatches:
    """This dp rank's batches of a map-style dataset, collated, one epoch per iteration.

    ::

        pm = gp.compile(model, gp.Strategy(dp=2), example_inputs=(x,), example_target=y, ...)
        batches = DistributedBatches(dataset, batch_size=8, mesh_or_pm=pm, shuffle=True)
        for epoch in range(epochs):
            batches.set_epoch(epoch)
            for x, y in batches:
                pm.train_step(x, target=y)

    Only this rank's indices are read (``dataset[i]``), ``len()`` is the same on every
    rank, and every batch has exactly ``batch_size`` samples, the fixed shape a compiled
    program needs. dp and dp_rank come from ``mesh_or_pm`` (a ParallelModule or its
    ``.mesh``) or from ``dp``/``dp_rank``; with neither, from torch.distributed's world
    (dp = world size), or a single rank when it is not initialised.

    The layout is computed at construction and at each :meth:`set_epoch` (without it, every
    epoch repeats the same order, as with DistributedSampler).

    With ``remainder="pad"``, iterating yields the padded batches as they are: the padding
    repeats samples, which training would count twice. Iterate :meth:`masked` instead to
    get each batch's ``valid`` mask (see :func:`evaluate_exact`).
    """

    def __init__(self, dataset: Any, batch_size: int, mesh_or_pm: Any = None,
                 dp: Optional[int] = None, dp_rank: Optional[int] = None, remainder: str = "drop",
                 shuffle: bool = False, seed: int = 0,
                 collate: Callable[[List[Any]], Any] = default_collate):
        self.dataset = dataset
        self.batch_size = batch_size
        self.dp, self.dp_rank = _resolve_dp(mesh_or_pm, dp, dp_rank)
        self.remainder = remainder
        self.shuffle = shuffle
        self.seed = seed
        self.collate = collate
        self.epoch = 0
        self._start = 0  # where the next iteration begins (a restored position), in batches
        self._done = 0   # batches of this epoch handed out so far
        # Validates every argument now, on every rank alike, rather than at the first
        # iteration, where one rank failing would leave the others waiting.
        self._plan = self.plan()

    def set_epoch(self, epoch: int) -> None:
        """Use ``epoch``'s permutation (with ``shuffle=True``) from the next iteration on."""
        _check_int("epoch", epoch, 0, "count epochs from 0")
        if epoch != self.epoch:
            self._start = self._done = 0  # a restored position belongs to its own epoch
        self.epoch = epoch
        self._plan = self.plan()

    def plan(self) -> ShardPlan:
        """The indices and valid flags of this rank's batches in the current epoch."""
        return shard_indices(_dataset_length(self.dataset), self.dp, self.dp_rank, self.batch_size,
                             remainder=self.remainder, shuffle=self.shuffle, seed=self.seed,
                             epoch=self.epoch)

    def __len__(self) -> int:
        return len(self._plan)

    def __iter__(self) -> Iterator[Any]:
        for batch, _ in self.masked():
            yield batch

    def masked(self) -> Iterator[Tuple[Any, torch.Tensor]]:
        """Yield ``(batch, valid)``; ``valid`` is a bool tensor of shape ``[batch_size]``."""
        plan, start, self._start = self._plan, self._start, 0
        for k in range(start, len(plan)):
            self._done = k + 1
            yield self.collate([self.dataset[i] for i in plan.batches[k]]), torch.tensor(plan.valid[k])

    def state_dict(self) -> dict:
        """The position: the epoch and how many samples of its order the ranks have read
        (counted in the global order, so a run resumed with another dp continues there)."""
        return {"epoch": self.epoch, "samples_done": self._done * self.dp * self.batch_size,
                "length": _dataset_length(self.dataset), "shuffle": self.shuffle, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        """Continue from a saved position: the next iteration starts after the batches read."""
        self.check_state_dict(state)
        self.epoch = state["epoch"]
        self._plan = self.plan()
        self._start = self._done = state["samples_done"] // (self.dp * self.batch_size)

    def check_state_dict(self, state: dict) -> None:
        """Raise ValueError if ``load_state_dict(state)`` would refuse it; changes nothing
        (load_checkpoint checks before it loads anything)."""
        mine = self.state_dict()
        differs = [f"{k}={state[k]!r} (here {mine[k]!r})" for k in ("length", "shuffle", "seed")
                   if state[k] != mine[k]]
        per_step = self.dp * self.batch_size
        if differs:
            raise ValueError(f"DistributedBatches.load_state_dict: the saved position is in another sample "
                             f"order: {', '.join(differs)}. Fix: build the DistributedBatches over the same "
                             f"dataset with the same shuffle and seed as the run that saved it.")
        if state["samples_done"] % per_step:
            raise ValueError(f"DistributedBatches.load_state_dict: {state['samples_done']} samples were read, not a "
                             f"multiple of this layout's global batch dp * batch_size = {per_step}. Fix: "
                             f"a dp * batch_size that divides it, or resume at an epoch boundary.")


def evaluate_exact(pm_or_fn: Callable[..., Any], dataset: Any, batch_size: int,
                   metric_sum_fn: Callable[[Any, Any], torch.Tensor], dp: Optional[int] = None,
                   dp_rank: Optional[int] = None, group: Any = None, *,
                   collate: Callable[[List[Any]], Any] = default_collate) -> float:
    """The mean of a metric over every sample of ``dataset``, each counted exactly once.

    Call it on every rank of the dp group. ``dataset[i]`` is an ``(input, target)`` pair
    (``input`` may be a tuple of model inputs). Each rank reads its shard with
    ``remainder="pad"``, so all ranks run the same number of batches of exactly
    ``batch_size`` samples, the fixed shape a compiled program needs: pass the compiled
    local batch size (or a multiple of its microbatch size). The padding samples are
    repeats, and the ``valid`` mask removes their rows before summing.

    ``metric_sum_fn(output, target)`` returns the unreduced metric, batch first, e.g.
    ``F.mse_loss(out, y, reduction="none")`` or ``(out.argmax(-1) == y)``. Each rank sums
    the valid rows' elements and counts them (in float64); one all-reduce over the dp
    group adds (sum, count) up, and the result is sum / count: the mean over all elements
    of all samples, the same number one process computes on the whole dataset, up to the
    order of the float additions. Averaging per-rank means instead, or padding without a
    mask as ``DistributedSampler`` does, weights some samples twice.

    dp, dp_rank and group come from ``pm_or_fn.mesh`` for a ParallelModule; for a plain
    function from ``group`` (default: the whole world), or one rank without
    torch.distributed. The all-reduces wait at most graphpar's collective timeout.

    Raises:
        ValueError: for an empty dataset, ranks with datasets of different lengths, a
            metric that does not return one row per sample, or the shard errors of
            :func:`shard_indices`.
    """
    dp, dp_rank, group = _resolve_eval_group(pm_or_fn, dp, dp_rank, group)
    n = _dataset_length(dataset)
    if dp > 1:
        _check_same_length(n, group)
    if n == 0:
        raise ValueError("evaluate_exact: the dataset is empty, so the mean is undefined. "
                         "Fix: evaluate on a dataset with at least one sample.")
    batches = DistributedBatches(dataset, batch_size, dp=dp, dp_rank=dp_rank, remainder="pad",
                                 collate=collate)
    totals = torch.zeros(2, dtype=torch.float64)  # (metric sum, element count)
    with torch.no_grad():
        for batch, valid in batches.masked():
            inputs, target = _split_sample(batch)
            output = pm_or_fn(*inputs) if isinstance(inputs, (tuple, list)) else pm_or_fn(inputs)
            values = _metric_rows(metric_sum_fn(output, target), batch_size)
            kept = values[valid.to(values.device)]
            totals[0] += kept.to(torch.float64).sum()
            totals[1] += kept.numel()
    if dp > 1:
        totals = _all_reduce(totals, dist.ReduceOp.SUM, group)
    return float(totals[0] / totals[1])


# ---- argument checks and helpers ---------------------------------------------------------

def _check_int(name: str, value: Any, minimum: int, fix: str) -> None:
    if not is_int_at_least(value, minimum):
        raise invalid(f"{name}={value!r}", f"it must be an int >= {minimum}", fix)


def _check_layout(n: int, dp: int, dp_rank: int, batch_size: int, remainder: str) -> None:
    _check_int("n", n, 0, "pass the dataset length, len(dataset)")
    _check_int("batch_size", batch_size, 1, "pass the per-rank batch size, e.g. batch_size=8")
    _check_int("dp", dp, 1, "pass the data-parallel degree, pm.mesh.dp")
    if not is_int_at_least(dp_rank, 0) or dp_rank >= dp:
        raise invalid(f"dp_rank={dp_rank!r}", f"it must be an int in [0, {dp}) for dp={dp}",
                      "pass this rank's data-parallel index, pm.mesh.dp_rank")
    if remainder not in REMAINDERS:
        raise ValueError(f"remainder={remainder!r} is invalid: it must be one of {REMAINDERS} "
                         f"(\"drop\" skips the last partial global batch, \"pad\" completes it with "
                         f"masked repeats). Fix: remainder=\"drop\" to train, \"pad\" to evaluate.")
    per_step = dp * batch_size
    if remainder == "drop" and n < per_step:
        smaller = (f"batch_size <= {n // dp} (n // dp), or " if n >= dp else
                   "fewer dp ranks than samples, or ")
        raise ValueError(
            f"a dataset of {n} samples is shorter than one global batch of dp * batch_size = "
            f"{dp} * {batch_size} = {per_step} samples, so remainder=\"drop\" would give every rank "
            f"zero batches. Fix: use {smaller}remainder=\"pad\" and the valid mask.")


def _dataset_length(dataset: Any) -> int:
    try:
        return len(dataset)
    except TypeError as exc:
        raise TypeError(f"the dataset must be map-style, with len() and dataset[i], got "
                        f"{type(dataset).__name__}. Fix: wrap it in a torch.utils.data.Dataset "
                        f"with __len__ and __getitem__.") from exc


def _mesh_of(mesh_or_pm: Any) -> Any:
    # A ParallelModule carries its mesh; a Mesh is used as it is.
    return getattr(mesh_or_pm, "mesh", mesh_or_pm)


def _resolve_dp(mesh_or_pm: Any, dp: Optional[int], dp_rank: Optional[int]) -> Tuple[int, int]:
    if mesh_or_pm is not None:
        mesh = _mesh_of(mesh_or_pm)
        for name, given, actual in (("dp", dp, mesh.dp), ("dp_rank", dp_rank, mesh.dp_rank)):
            if given is not None and given != actual:
                raise ValueError(f"{name}={given} contradicts the mesh, where {name} is {actual}. "
                                 f"Fix: pass either the mesh (or pm) or {name}, not both.")
        return mesh.dp, mesh.dp_rank
    if (dp is None) != (dp_rank is None):
        raise ValueError(f"dp={dp!r} and dp_rank={dp_rank!r}: pass both or neither. "
                         f"Fix: DistributedBatches(..., mesh_or_pm=pm) takes both from the mesh.")
    if dp is not None:
        return dp, dp_rank
    # With tp or pp, dp is only part of the world, so the world is a safe default only for
    # pure data parallelism; the mesh is the reliable source.
    return distributed.world_size(), distributed.rank()


def _resolve_eval_group(pm_or_fn: Any, dp: Optional[int], dp_rank: Optional[int],
                        group: Any) -> Tuple[int, int, Any]:
    mesh = getattr(pm_or_fn, "mesh", None)
    if mesh is not None:
        dp, dp_rank = _resolve_dp(mesh, dp, dp_rank)
        return dp, dp_rank, group if group is not None else mesh.group("dp")
    if not (dist.is_available() and dist.is_initialized()):
        if dp not in (None, 1):
            raise ValueError(f"dp={dp} but torch.distributed is not initialised, so there is no group "
                             f"to add the ranks' sums over. Fix: run under graphpar.launch or torchrun.")
        return 1, 0, None
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    if (dp is not None and dp != size) or (dp_rank is not None and dp_rank != rank):
        raise ValueError(f"dp={dp}, dp_rank={dp_rank} contradict the process group, which has "
                         f"{size} ranks and in which this is rank {rank}. Fix: pass the dp group "
                         f"(pm.mesh.group('dp')) and leave dp and dp_rank out.")
    return size, rank, group


def _all_reduce(tensor: torch.Tensor, op: Any, group: Any) -> torch.Tensor:
    """All-reduce a small CPU tensor; returns the result on the CPU."""
    # NCCL only reduces CUDA tensors; gloo reduces CPU tensors.
    device = "cuda" if dist.get_backend(group) == "nccl" else "cpu"
    tensor = tensor.to(device)
    # An explicit bounded wait: a peer that never arrives becomes an error here, not a hang,
    # whatever timeout the group was created with.
    work = dist.all_reduce(tensor, op=op, group=group, async_op=True)
    work.wait(datetime.timedelta(seconds=distributed.DEFAULT_TIMEOUT_S))
    return tensor.cpu()


def _check_same_length(n: int, group: Any) -> None:
    # One MAX over (n, -n) yields the largest and the smallest length; every rank sees the
    # same result and raises together, before any rank-dependent number of batches runs.
    extremes = _all_reduce(torch.tensor([n, -n], dtype=torch.int64), dist.ReduceOp.MAX, group)
    largest, smallest = int(extremes[0]), -int(extremes[1])
    if largest != smallest:
        raise ValueError(f"evaluate_exact: the ranks' datasets differ in length (from {smallest} to "
                         f"{largest} samples; this rank has {n}), so their shards would overlap or "
                         f"miss samples. Fix: give every rank the whole dataset; each reads only its "
                         f"own shard.")


def _split_sample(batch: Any) -> Tuple[Any, Any]:
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return batch[0], batch[1]
    raise ValueError(f"evaluate_exact: dataset samples must be (input, target) pairs, got a collated "
                     f"{type(batch).__name__}. Fix: wrap the dataset so dataset[i] returns (input, target).")


def _metric_rows(values: Any, batch_size: int) -> torch.Tensor:
    values = torch.as_tensor(values)
    if values.dim() == 0 or values.shape[0] != batch_size:
        raise ValueError(f"metric_sum_fn returned shape {list(values.shape)}, but evaluate_exact needs one "
                         f"row per sample ({batch_size} rows) to leave the padding out. Fix: return the "
                         f"unreduced metric, e.g. F.mse_loss(output, target, reduction='none').")
    return values
