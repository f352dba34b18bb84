"""ZeRO-3: parameters sharded over the dp ranks, gathered just before their first use and
freed after their last (FSDP2's reshard-after-forward), as explicit nodes of the rank's program.

Each gradient bucket of the update program (ShardLayout in graphpar/runtime/zero.py) is one
`Unsharded` module: the rank's shard of the bucket's flat, padded weights (`shard`, compute
dtype), which is all the rank holds of them. passes/shard_parameters.py puts its nodes into
the rank's program (dump: `14_shard_parameters.py`):

    zero3_0_start = self.zero3_0.start()              # all-gather of bucket 0 over dp, async
    zero3_0_wait = self.zero3_0.wait(zero3_0_start)   # the bucket's weights, one view per parameter
    zero3_1_start = self.zero3_1.start()              # prefetch: bucket 1 arrives while bucket 0 computes
    fc1_weight = getitem(zero3_0_wait, 0)
    ...
    zero3_0_free = self.zero3_0.free()                # after the last use in forward: buffer released

Backward keeps no gathered weight alive: while a bucket is gathered in forward, a tensor
autograd saves that lies in its buffer (a weight, its transpose) is saved as a `Recipe`
instead (see `regathered_in_backward`). The bucket forward reads last (at pp = 1) has
`zero3_k.keep()` in place of its free: its buffer is handed to backward, which reads it
first. Backward gathers every other bucket again when it first needs it, starts the gather of the bucket it will need next (the one whose forward use ended
just before), and drops the buffer when the bucket's gradient is reduced: the gradient of the
whole bucket is reduce-scattered (in Strategy.gradient_dtype, fp32 unless reduce_dtype is the
compute dtype, one usage flag per parameter behind each rank's part, as at zero=1/2) as soon as
autograd has it, every microbatch, and added to the rows earlier microbatches reduced. The rank keeps only the summed
row of its shard until the update program's step takes it (`TakeReduced`, the launch node).

With expert parallelism the expert weights of each experts module are buckets of their own,
sharded over the edp group (the ranks holding the same experts; `axis`), gathered over it just
before the module's experts call, which gets the views as keyword arguments, and freed after it;
backward gathers them again and reduce-scatters their gradients over edp (mesh.experts_stage).

Every collective of a step is issued on one thread (forward's, then backward's, which is the
same for CPU autograd) in graph order, the same on every rank of the bucket's group.
"""
from __future__ import annotations

import contextlib
import datetime
import math
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn

from graphpar.distributed import groups as distributed
from graphpar.runtime import ops
from graphpar.runtime.zero import Pending, ShardLayout, reduce_rows, reduce_rows_over

# storage address of a bucket's buffer -> the bucket, while it is gathered in a forward that
# records autograd (between its `wait` and its `free`); the pack hook looks tensors up here
_GATHERED: dict = {}


@dataclass(frozen=True)
class Recipe:
    """A saved tensor that was a view of a gathered bucket: regathered when backward unpacks it."""
    bucket: "Unsharded"
    size: Tuple[int, ...]
    stride: Tuple[int, ...]
    offset: int


def _pack(tensor: torch.Tensor):
    if not _GATHERED or tensor.device.type == "meta":
        return tensor
    bucket = _GATHERED.get(tensor.untyped_storage().data_ptr())
    if bucket is None or tensor.dtype != bucket.shard.dtype:
        return tensor
    bucket.__dict__["needed_in_backward"] = True
    return Recipe(bucket, tuple(tensor.shape), tuple(tensor.stride()), tensor.storage_offset())


def _unpack(saved):
    if isinstance(saved, Recipe):
        return saved.bucket.backward_weights().as_strided(saved.size, saved.stride, saved.offset)
    return saved


@dataclass(frozen=True)
class _Outer:
    """A saved tensor packed by the caller's own saved-tensor hooks (torch.autograd.graph.
    saved_tensors_hooks around train_step: save_on_cpu, a measurement), unpacked by them."""
    packed: Any
    unpack: Any


def _caller_hooks():
    """The saved-tensor hooks active where the step was called, if any (torch uses only the
    innermost pair, so the executor's pair hands on what it does not keep itself)."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return top(False) if top is not None else None


def _chained(caller):
    if caller is None:
        return _pack, _unpack
    pack_outer, unpack_outer = caller

    def pack(tensor):
        saved = _pack(tensor)
        return saved if isinstance(saved, Recipe) else _Outer(pack_outer(tensor), unpack_outer)

    def unpack(saved):
        return saved.unpack(saved.packed) if isinstance(saved, _Outer) else _unpack(saved)
    return pack, unpack


@contextlib.contextmanager
def regathered_in_backward(gathers: bool):
    """Context for training forwards: weights autograd saves from gathered buckets are kept as
    recipes, so a bucket's buffer is freed after its last forward use. Costs a Python pack and
    unpack call per saved tensor, so it is only installed where the programs gather (`gathers`:
    any of them has a bucket, `buckets_of`); without zero=3 every tensor is saved as is (or as
    the caller's own saved-tensor hooks pack it), and the hooks would only cost time: 1.5-2% of
    a pipeline stage's CPU time per step on the pipeline benchmark's GPT (benchmarks/README.md).
    On the way out nothing stays registered, even after a failed forward: a freed buffer's
    address may be reused by any later tensor."""
    if not gathers:
        yield
        return
    _GATHERED.clear()
    try:
        with torch.autograd.graph.saved_tensors_hooks(*_chained(_caller_hooks())):
            yield
    finally:
        _GATHERED.clear()


class _Unshard(torch.autograd.Function):
    """shard -> one view per parameter of the bucket's gathered weights; backward reduce-scatters
    their gradients and gives the shard none (the update program takes the reduced row, see
    Unsharded.reduce). One function with one output per parameter, not views taken of one
    output: autograd would then give each view's gradient back as a zero-filled gradient of the
    whole buffer and add them up, a pass over the whole bucket per parameter; here each
    parameter's gradient arrives alone (None where backward did not reach it: the usage flag)
    and is copied once, into the reduce-scatter's rows."""

    @staticmethod
    def forward(ctx, shard: torch.Tensor, gathering: Pending, bucket: "Unsharded") -> Tuple[torch.Tensor, ...]:
        ctx.bucket = bucket
        ctx.set_materialize_grads(False)
        return bucket.views(gathering.result())

    @staticmethod
    def backward(ctx, *grads: Optional[torch.Tensor]):
        ctx.bucket.reduce(grads)
        return None, None, None


class _OfBucket(nn.Module):
    """A node's module acting on a bucket it refers to (the owner, not a child module)."""

    def __init__(self, bucket: "Unsharded"):
        super().__init__()
        self.__dict__["bucket"] = bucket


class _Node(_OfBucket):
    """One of a bucket's nodes in the rank's program; run for its effect, so dead-code
    elimination keeps it."""
    _is_impure = True


class Start(_Node):
    def forward(self) -> Pending:
        return self.bucket.gather()


class Wait(_Node):
    def forward(self, gathering: Pending) -> Tuple[torch.Tensor, ...]:
        return self.bucket.unshard(gathering)


class Free(_Node):
    def forward(self) -> None:
        self.bucket.release()


class Keep(_Node):
    """In place of `free` for the bucket forward reads last (shard_parameters decides): its
    buffer stays gathered into backward, which reads it first, instead of being gathered again."""

    def forward(self) -> None:
        self.bucket.keep_for_backward()


class Unsharded(nn.Module):
    """One bucket of zero=3 parameters: this rank's shard, and the gathers that make it whole."""

    def __init__(self, index: int, layout: ShardLayout, names: Sequence[str], shapes: Sequence[Tuple[int, ...]],
                 dtype: torch.dtype, device: torch.device, mesh, grad_dtype: torch.dtype, axis: str = "dp"):
        super().__init__()
        self.index = index
        self.axis = axis  # the group it is sharded, gathered and reduced over: dp, or edp for expert weights
        self.grad_dtype = grad_dtype  # what the gradients are reduced and summed over microbatches in
        self.layout = layout
        self.pieces_of_each_rank = [ShardLayout(layout.numels, layout.dp, r).pieces() for r in range(layout.dp)]
        self.names = list(names)
        self.shapes = [tuple(s) for s in shapes]
        # not registered: the rank's programs hold no parameter of the bucket, and state dicts
        # read the whole weights through the update program's ShardStep (zero.gather_whole)
        self.__dict__["shard"] = nn.Parameter(torch.zeros(layout.shard, dtype=dtype, device=device))
        self.__dict__["mesh"] = mesh
        self.start, self.wait, self.free, self.keep = Start(self), Wait(self), Free(self), Keep(self)
        # set by passes/shard_parameters.py: the bucket backward needs after this one
        self.__dict__["backward_next"] = None
        self._reset_step()

    def extra_repr(self) -> str:
        lay = self.layout
        return f"{self.axis}={lay.dp}, elements={lay.total}, shard={lay.shard}, padding={lay.padding}"

    def _reset_step(self) -> None:
        self.__dict__.update(forward_buffer=None, backward_buffer=None, prefetched=None, reduced=None,
                             on_final=None, reduced_in_backward=False, needed_in_backward=False, kept=False)

    # ---- forward --------------------------------------------------------------------------------
    def gather(self) -> Pending:
        lay = self.layout
        full = torch.empty(lay.shard * lay.dp, dtype=self.shard.dtype, device=self.shard.device)
        if ops.simulating():  # fake tensors, no process group
            return Pending(None, full)
        work = dist.all_gather_single(full, self.shard.detach(), group=self.mesh.group(self.axis), async_op=True)
        return Pending(work, full)

    def unshard(self, gathering: Pending) -> Tuple[torch.Tensor, ...]:
        if not torch.is_grad_enabled() or ops.simulating():
            return self.views(gathering.result())
        views = _Unshard.apply(self.shard, gathering, self)
        full = gathering.result()  # done already: the same buffer the views lie in
        _GATHERED[full.untyped_storage().data_ptr()] = self
        self.__dict__.update(forward_buffer=full, reduced_in_backward=False)
        return views

    def views(self, full: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        """One view of `full` per parameter, in bucket order."""
        views, offset = [], 0
        for shape in self.shapes:
            numel = math.prod(shape)
            views.append(full[offset:offset + numel].view(shape))
            offset += numel
        return tuple(views)

    def release(self) -> None:
        """After the bucket's last use in forward: its buffer is no longer held here."""
        full = self.forward_buffer
        if full is not None:
            _GATHERED.pop(full.untyped_storage().data_ptr(), None)
            self.__dict__["forward_buffer"] = None

    def keep_for_backward(self) -> None:
        """After the bucket's last use in forward, when backward reads it first: the buffer
        becomes backward's (dropped when the bucket's gradient is reduced, as a regathered one
        is). Kept only if autograd saved one of its weights: otherwise backward never reads it."""
        full = self.forward_buffer
        self.release()
        if full is not None and self.needed_in_backward:
            # detached: the buffer, not its autograd history, is what backward reads
            self.__dict__.update(backward_buffer=full.detach(), kept=True)

    # ---- backward -------------------------------------------------------------------------------
    def backward_weights(self) -> torch.Tensor:
        """The bucket's whole weights for backward: kept from forward, or gathered once per
        backward (or taken from the prefetch); on the first use the next bucket's gather starts."""
        first_use = self.backward_buffer is None or self.kept
        if self.backward_buffer is None:
            gathering = self.prefetched if self.prefetched is not None else self.gather()
            self.__dict__.update(backward_buffer=gathering.result(), prefetched=None)
        if first_use:
            self.__dict__["kept"] = False
            following = self.backward_next
            if following is not None and following.wants_prefetch():
                following.__dict__["prefetched"] = following.gather()
        return self.backward_buffer

    def wants_prefetch(self) -> bool:
        # only a bucket backward reads (autograd saved one of its weights: a bucket of embedding
        # tables alone is not), and never one already reduced, which may be stepping on the
        # update's worker thread
        return (self.needed_in_backward and self.backward_buffer is None and self.prefetched is None
                and not self.reduced_in_backward)

    def reduce(self, grads: Sequence[Optional[torch.Tensor]]) -> None:
        """Autograd has the gradients of every parameter of the bucket (None: not reached):
        reduce them over the bucket's axis (async; zero.reduce_rows_over), adding to what earlier
        microbatches reduced; on the step's last backward, hand the row over."""
        lay = self.layout
        device = self.shard.device
        # cast to the gradient dtype in the one copy
        rows = reduce_rows(lay, self.pieces_of_each_rank, grads, self.grad_dtype, device)
        earlier = self.reduced.result() if self.reduced is not None else None
        reduced = reduce_rows_over(rows, self.mesh.group(self.axis), earlier)
        self._drop_prefetch()
        self.__dict__.update(reduced=reduced, backward_buffer=None, reduced_in_backward=True, kept=False)
        if self.on_final is not None:
            on_final, self.__dict__["on_final"] = self.on_final, None
            on_final(self.index)

    def _drop_prefetch(self) -> None:
        if self.prefetched is not None:  # gathered for a backward that did not need it
            self.prefetched.result()
            self.__dict__["prefetched"] = None

    def sum_reduced_over(self, group) -> None:
        """A weight read on several pp ranks (alone in its bucket, so every copy's bucket lays
        out alike): this row summed with the other copies' rows over `group` (collective)."""
        lay = self.layout
        row = (self.reduced.result() if self.reduced is not None
               else torch.zeros(lay.shard + lay.flags, dtype=self.grad_dtype, device=self.shard.device))
        dist.all_reduce(row, group=group, async_op=True).wait(datetime.timedelta(seconds=distributed.DEFAULT_TIMEOUT_S))
        self.__dict__["reduced"] = Pending(None, row)

    def take_reduced(self) -> Optional[Pending]:
        """The launch node: this step's reduced row (None: no rank's backward reached the bucket)."""
        reduced, self.__dict__["reduced"] = self.reduced, None
        return reduced

    def end_step(self) -> None:
        """After the step: nothing gathered or pending is kept into the next one."""
        self._drop_prefetch()
        self.release()
        self._reset_step()

    # ---- the shard's values ---------------------------------------------------------------------
    def write(self, values: torch.Tensor) -> None:
        with torch.no_grad():
            self.shard.copy_(values)


class TakeReduced(_OfBucket):
    """Launch: the bucket's reduce-scatter, issued during backward by the bucket itself."""

    def forward(self) -> Optional[Pending]:
        return self.bucket.take_reduced()


class WriteShard(_OfBucket):
    """Write (fp32 masters only): the updated master shard, cast, into the rank's compute shard."""

    def forward(self, values: torch.Tensor) -> torch.Tensor:
        self.bucket.write(values)
        return values


class ReducedTracker:
    """The update runner's trigger at zero=3: a bucket starts its step when its last
    microbatch's reduce-scatter is issued (BucketTracker's role for zero=0..2)."""

    def __init__(self, buckets: Sequence[Unsharded], on_ready: Callable[[int], None]):
        self.buckets = list(buckets)
        self.on_ready = on_ready

    def arm(self, params=None) -> None:
        """The next reduce-scatter of every bucket, or (a pipeline stage's last backward) of
        the buckets whose shards are in `params`, is the step's last."""
        chosen = None if params is None else {id(p) for p in params}
        for bucket in self.buckets:
            if chosen is None or id(bucket.shard) in chosen:
                bucket.__dict__["on_final"] = self.on_ready

    def disarm(self) -> None:
        for bucket in self.buckets:
            bucket.__dict__["on_final"] = None

    def remove(self) -> None:
        for bucket in self.buckets:
            bucket.end_step()


def bucket_runs(names: Sequence[str], readers: Dict[str, Sequence[int]],
                stage_rank: Callable[[int], int]) -> List[List[str]]:
    """Runs of parameters (`names` in bucket order) that one zero=3 bucket may hold together,
    given the stages reading each and the pp rank holding a stage (Strategy.stage_rank). A
    bucket is gathered inside one stage's program, so a run is read by one stage; a weight
    read on several pp ranks (a tied embedding) is alone, so that its copies' buckets lay out
    alike and their reduced rows can be summed over those ranks. passes/build_update.py
    buckets by it, and the planner plans by it."""
    runs: List[List[str]] = []
    key = None
    for name in names:
        stages = readers.get(name, ())
        this = ("tied", name) if len({stage_rank(s) for s in stages}) > 1 else min(stages, default=None)
        if not runs or this != key:
            runs.append([])
            key = this
        runs[-1].append(name)
    return runs


def expert_runs(experts: List[str], edp: int, containers: Sequence[str] = ()) -> List[List[str]]:
    """The expert weights (names in bucket order) in runs that one zero=3 bucket may hold: one
    run per experts module where they are gathered around its call (edp > 1), so that a bucket
    holds one call's weights (`containers`: the list layout's expert containers, whose expert
    modules' weights are one call's); all in one run where they stay whole (edp = 1,
    mesh.experts_stage). passes/build_update.py buckets by it, and the planner plans by it."""
    if not experts or edp == 1:
        return [experts] if experts else []
    runs: Dict[str, List[str]] = {}
    for name in experts:
        call = next((c for c in containers if name.startswith(c + ".")), name.rpartition(".")[0])
        runs.setdefault(call, []).append(name)
    return list(runs.values())


def buckets_of(gm: nn.Module) -> List[Unsharded]:
    """The zero=3 buckets a program gathers (a pipeline stage's program holds their nodes, not
    always the bucket modules themselves: split_stages copies the modules its nodes call)."""
    found = {id(m.bucket): m.bucket for m in gm.modules() if isinstance(m, _Node)}
    return list(found.values())
