"""ZeRO-1 and ZeRO-2: optimizer states (and gradients) sharded over the dp ranks.

Each gradient bucket of the update program (passes/build_update.py) is one flat buffer of
`total` elements, padded to `dp * shard` (shard = ceil(total / dp)); dp rank r owns the
elements [r * shard, (r + 1) * shard). The padding is zeros that no parameter reads; the
last ranks own less real data (at dp = 3 a bucket of 10 elements gives shards of 4, 4 and
2 + 2 padding). A rank's part of a parameter is a `Piece`; the optimizer steps 1-D views
of the pieces, so a rank holds optimizer state for its pieces only. That equals the
per-parameter step only for optimizers whose update is elementwise (ELEMENTWISE).

Per bucket k the program runs, in three phases (graphpar/runtime/placement/runner.py):

    launch (in backward, when the bucket's gradients are final, on autograd's thread)
        reduce_k = self.reduce_k()             # ReduceScatterGrads: flat buffer of the gradients' dtype, async
                                               #   reduce-scatter over dp (zero=2: p.grad freed)
    step (worker thread, while backward goes on)
        shard_k = self.shard_k(reduce_k)       # WaitShard: this rank's averaged gradient shard
        update_k = self.update_k(shard_k)      # ShardStep: the optimizer steps the rank's pieces
        gather_k = self.gather_k(update_k)     # AllGatherParams: every rank's updated shard, async
    write (after backward, caller's thread)
        weights_k = self.weights_k(gather_k)   # GatheredWeights: waits for the all-gather
        write_k = self.write_k(weights_k)      # WriteParams: into the device parameters

Each dp process group gets its collectives from one thread, in one order on every rank:
the reduce-scatters from backward's thread over the dp group, the all-gathers from the
worker thread (which takes buckets in the order backward completes them) over the second
dp group, DP_WEIGHTS.

The reduce buffer carries one usage flag per parameter behind each rank's part (rank r's
row is [its `shard` gradient elements | one flag per parameter of the bucket]), so the
reduce-scatter also hands every rank the summed flags: a parameter no rank's backward
reached is not stepped on any rank, as with plain dp (graphpar/runtime/grad_sync.py).

In fp32 on the device the weights are the device parameters themselves (no master copy): a
piece's optimizer parameter is a view into its device parameter, stepped in place; the
all-gather then brings the other ranks' updated pieces. With a lower compute dtype
(param_dtype) or offload_optimizer each rank holds an fp32 master shard (on the host when
offloaded), steps it, and the all-gather moves the compute dtype: gather in low precision,
reduce in the gradients' dtype (Strategy.gradient_dtype: fp32 unless reduce_dtype is the
compute dtype, passes/cast_params.py; the step widens a low-precision row). Whole masters exist only while a state dict or checkpoint is built or loaded
(gather_whole / scatter_whole). The optimizer state is sharded either way
(full_optimizer_states / load_optimizer_states turn it into per-parameter tensors).
"""
from __future__ import annotations

import datetime
import math
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn

from graphpar.distributed import groups as distributed
from graphpar.distributed.mesh import WEIGHTS_GROUP
from graphpar.runtime.grad_sync import grad_dtype
from graphpar.runtime.optimizer import make_optimizer

# torch optimizers whose update of an element reads only that element's gradient, state and
# the step count: stepping 1-D pieces of a parameter is the same as stepping it whole
# (weight decay, momentum, nesterov, amsgrad, foreach and fused kernels included).
ELEMENTWISE = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax, torch.optim.Adagrad,
               torch.optim.Adadelta, torch.optim.RMSprop, torch.optim.Rprop, torch.optim.NAdam, torch.optim.RAdam,
               torch.optim.ASGD)


def zero_active(strategy, dp: int) -> bool:
    """ZeRO changes anything only with more than one dp replica."""
    return strategy.zero > 0 and dp > 1


def check_zero_optimizer(factory: Optional[Callable], strategy) -> None:
    """zero > 0 steps pieces of parameters: only an elementwise optimizer gives the same step.
    Checked on a throwaway parameter before anything is compiled."""
    if not strategy.zero or factory is None:
        return
    optimizer = make_optimizer(factory, [nn.Parameter(torch.zeros(2, 2))])  # 2-D: Muon takes only matrices
    if type(optimizer) in ELEMENTWISE:
        return
    allowed = ", ".join(cls.__name__ for cls in ELEMENTWISE)
    raise ValueError(
        f"Strategy.zero={strategy.zero} with optimizer {type(optimizer).__module__}.{type(optimizer).__qualname__} "
        f"is refused: ZeRO steps each rank's flat shard of the parameters, which equals the per-parameter step "
        f"only for an optimizer whose update is elementwise (exactly one of torch.optim's {allowed}; a subclass "
        f"may change the step, so it is not assumed to be). Fix: use one of those optimizers, or zero=0.")


# ---- the layout of one bucket --------------------------------------------------------------

@dataclass(frozen=True)
class Piece:
    index: int    # the parameter's position in the bucket
    start: int    # first element of the piece in the parameter (flattened)
    stop: int
    offset: int   # where the piece starts in the rank's shard

    @property
    def numel(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class ShardLayout:
    numels: Tuple[int, ...]   # the bucket's parameters' sizes, in bucket order
    dp: int
    rank: int

    @property
    def total(self) -> int:
        return sum(self.numels)

    @property
    def shard(self) -> int:
        return -(-self.total // self.dp)

    @property
    def padding(self) -> int:
        return self.shard * self.dp - self.total

    @property
    def flags(self) -> int:
        return len(self.numels)

    def pieces(self) -> List[Piece]:
        """The parts of the bucket's parameters in this rank's shard, in order."""
        first, last = self.rank * self.shard, (self.rank + 1) * self.shard
        pieces, begin = [], 0
        for index, n in enumerate(self.numels):
            lo, hi = max(begin, first), min(begin + n, last)
            if lo < hi:
                pieces.append(Piece(index, lo - begin, hi - begin, lo - first))
            begin += n
        return pieces

    def owned(self) -> int:
        """Real (not padding) elements this rank owns."""
        return sum(p.numel for p in self.pieces())


def shard_layout(numels: Sequence[int], mesh, axis: str = "dp") -> ShardLayout:
    """A bucket sharded over this rank's group along `axis`: "dp", or "edp" for expert weights
    (expert parallelism: sharded over the ranks holding the same experts)."""
    ranks = mesh.ranks_along(axis)
    return ShardLayout(tuple(numels), len(ranks), ranks.index(mesh.rank))


def _flat_view(p: torch.Tensor) -> torch.Tensor:
    if not p.is_contiguous():
        raise ValueError(f"ZeRO shards parameters as flat views, but a parameter of shape {list(p.shape)} is not "
                         f"contiguous. Fix: make it contiguous in the model (p.data = p.data.contiguous()), or "
                         f"use zero=0.")
    return p.detach().view(-1)


def flatten_bucket(params: Sequence[nn.Parameter], layout: ShardLayout) -> torch.Tensor:
    """zero=1/2 with fp32 weights on the device: the bucket's parameters become views of one flat
    buffer of dp * shard elements (Megatron's parameter buffer; the padding at its end is zeros
    no parameter reads), so the rank's pieces are one contiguous shard of it, stepped in place,
    and the all-gather of the updated shards writes the parameters themselves: no gathered copy
    of the bucket, and no copy back into the parameters."""
    flat = torch.zeros(layout.shard * layout.dp, dtype=params[0].dtype, device=params[0].device)
    offset = 0
    with torch.no_grad():
        for p in params:
            view = flat[offset:offset + p.numel()]
            view.copy_(p.detach().reshape(-1))
            p.data = view.view(p.shape)
            offset += p.numel()
    return flat


class Pending:
    """A collective under way: its work handles (none: done already), the buffer it fills and,
    for a reduce-scatter at zero=3 with several microbatches, the sum of the rows earlier
    microbatches reduced, added once it is done. `finish`: what makes the result of the buffer
    once the work is done (_exchange_rows: this rank's row plus the rows received)."""

    def __init__(self, work, row: torch.Tensor, earlier: Optional[torch.Tensor] = None,
                 finish: Optional[Callable[[], torch.Tensor]] = None):
        self.works = [] if work is None else work if isinstance(work, list) else [work]
        self.row, self.earlier, self.finish = row, earlier, finish

    def result(self) -> torch.Tensor:
        for work in self.works:
            work.wait(datetime.timedelta(seconds=distributed.DEFAULT_TIMEOUT_S))
        if self.finish is not None:
            self.row = self.finish()
        if self.earlier is not None:
            self.row.add_(self.earlier)
        self.works, self.earlier, self.finish = [], None, None  # asked again, the same row
        return self.row


def reduce_rows_over(rows: torch.Tensor, group, earlier: Optional[torch.Tensor] = None) -> Pending:
    """Starts summing `rows` ([ranks, n]: row r is rank r's part) over `group`; the result is
    this rank's row summed. A reduce-scatter where the backend has one of its own, otherwise
    point-to-point messages (_exchange_rows; graphpar.distributed.groups.has_reduce_scatter)."""
    if distributed.has_reduce_scatter(dist.get_backend(group)):
        row = torch.empty(rows.shape[1], dtype=rows.dtype, device=rows.device)
        work = dist.reduce_scatter_single(row, rows.view(-1), group=group, async_op=True)
        return Pending(work, row, earlier)
    return _exchange_rows(rows, group, earlier)


_EXCHANGES: Dict[Any, int] = {}   # group -> exchanges started on it: the tag of the next one


def _exchange_rows(rows: torch.Tensor, group, earlier: Optional[torch.Tensor]) -> Pending:
    """A reduce-scatter from point-to-point messages: row j goes to rank j, and this rank's row
    comes from every other rank, then summed (in group rank order, the same on every rank).
    Each rank sends (N-1)/N of the buffer, as a ring reduce-scatter does, where gloo's own
    reduce-scatter all-reduces a copy of the whole buffer (twice the bytes) and copies its part
    out. Every rank starts its exchanges in the same order (backward's buckets), so the k-th
    exchange of a group carries tag k on every rank and messages of buckets in flight at once
    do not meet the wrong receive."""
    peers, own = dist.get_process_group_ranks(group), dist.get_rank(group)
    tag = _EXCHANGES.get(group, 0)
    _EXCHANGES[group] = (tag + 1) % (1 << 20)
    received = torch.empty_like(rows)
    operations = []
    for index, peer in enumerate(peers):
        if index != own:
            operations += [dist.P2POp(dist.isend, rows[index], peer, group, tag),
                           dist.P2POp(dist.irecv, received[index], peer, group, tag)]
    works = dist.batch_isend_irecv(operations) if operations else []   # a group of one: nothing to send

    def summed() -> torch.Tensor:
        received[own] = rows[own]
        return received.sum(dim=0)
    return Pending(works, rows, earlier, finish=summed)


def reduce_rows(layout: ShardLayout, pieces_of_each_rank: Sequence[List[Piece]], grads: Sequence[Optional[torch.Tensor]],
                dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The reduce-scatter's input: dp rows of [rank r's shard of the bucket's gradients (`grads`
    in bucket order, None: no gradient, zeros) | one usage flag per parameter], in `dtype`.
    Each gradient is copied once, straight into its ranks' rows (no flat copy to cut up)."""
    lay = layout
    rows = torch.empty(lay.dp, lay.shard + lay.flags, dtype=dtype, device=device)
    for rank, pieces in enumerate(pieces_of_each_rank):
        owned = 0
        for piece in pieces:
            target = rows[rank, piece.offset:piece.offset + piece.numel]
            grad = grads[piece.index]
            if grad is None:
                target.zero_()
            else:
                target.copy_(grad.reshape(-1)[piece.start:piece.stop])
            owned += piece.numel
        rows[rank, owned:lay.shard].zero_()  # padding
    rows[:, lay.shard:] = torch.tensor([g is not None for g in grads], dtype=dtype, device=device)
    return rows


class _BucketModule(nn.Module):
    def __init__(self, params: Sequence[nn.Parameter], layout: ShardLayout, mesh, stage: int, axis: str = "dp"):
        super().__init__()
        self.__dict__["params"] = list(params)  # the program's own parameters, not re-registered
        self.__dict__["mesh"] = mesh
        self.layout = layout
        self.stage = stage  # Strategy.zero
        self.axis = axis    # the group the bucket is sharded over: "dp", or "edp" for expert weights

    def extra_repr(self) -> str:
        lay = self.layout
        return (f"zero={self.stage}, dp={lay.dp}, elements={lay.total}, shard={lay.shard}, "
                f"padding={lay.padding}")



class ReduceScatterGrads(_BucketModule):
    """Launch: the bucket's gradients (in their dtype, padded, with usage flags) reduce-scattered over dp."""

    def __init__(self, params: Sequence[nn.Parameter], layout: ShardLayout, mesh, stage: int, axis: str = "dp"):
        super().__init__(params, layout, mesh, stage, axis)
        self.pieces_of_each_rank = [ShardLayout(layout.numels, layout.dp, r).pieces() for r in range(layout.dp)]

    def forward(self) -> Pending:
        lay = self.layout
        device, dtype = self.params[0].device, grad_dtype(self.params[0])  # every rank's, even one with no gradient
        rows = reduce_rows(lay, self.pieces_of_each_rank, [p.grad for p in self.params], dtype, device)
        if self.stage >= 2:  # ZeRO-2: the full gradients go as soon as they are in the buffer
            for p in self.params:
                p.grad = None
        return reduce_rows_over(rows, self.mesh.group(self.axis))


class WaitShard(_BucketModule):
    """Step: wait for the reduce-scatter; the shard averaged over dp (flags stay sums): divided
    by dp also when summed over edp, whose expert gradients each count the tokens of their
    whole ep group (graphpar/runtime/grad_sync.py). At zero=1 the average is also written
    into this rank's part of p.grad."""

    def forward(self, pending: Optional[Pending]) -> Optional[torch.Tensor]:
        if pending is None:  # zero=3: no rank's backward reached the bucket, nothing was reduced
            return None
        row, lay = pending.result(), self.layout
        row[:lay.shard].div_(self.mesh.dp)
        if self.stage == 1:
            with torch.no_grad():
                for piece in lay.pieces():
                    grad = self.params[piece.index].grad
                    if grad is not None:
                        grad.view(-1)[piece.start:piece.stop].copy_(row[piece.offset:piece.offset + piece.numel])
        return row


class ShardStep(_BucketModule):
    """Step: the optimizer steps this rank's pieces with the averaged shard; returns the rank's
    updated shard, padded, in the compute dtype. In fp32 on the device the pieces are views
    into the weights themselves, stepped in place, no copy: the device parameters at zero=1/2,
    the rank's parameter shard at zero=3 (`unsharded`, graphpar/runtime/zero3.py). With a lower
    compute dtype or offload_optimizer they are views of an fp32 master shard (`flat`) on the
    master device, and the compute copy is cast from it."""

    def __init__(self, params, layout, mesh, stage, names: Sequence[str], master_device=None,
                 compute_dtype: torch.dtype = torch.float32, unsharded=None, axis: str = "dp", weights=None):
        # zero=3 keeps no reference to the whole parameters: the shard is all the rank holds
        super().__init__(params if unsharded is None else [], layout, mesh, stage, axis)
        self.__dict__["weights"] = weights  # zero=1/2 in fp32: the bucket's flat parameters (flatten_bucket)
        self.names = list(names)
        self.shapes = [tuple(p.shape) for p in params]
        self.__dict__["device"] = params[0].device
        self.pieces = layout.pieces()
        self.compute_dtype = compute_dtype
        self.grad_divisor = 1.0  # the post-backward divisor (set by the runner), divided out of the shard here
        self.__dict__["optimizer"] = None
        self.__dict__["unsharded"] = unsharded
        self.__dict__["flat"] = None
        self.__dict__["initial"] = None
        if master_device is None and unsharded is None:
            self.__dict__["shards"] = [nn.Parameter(_flat_view(params[p.index])[p.start:p.stop])
                                       for p in self.pieces]
            return
        # the parameters are fp32 now (build_update runs before cast_params): the whole bucket
        # is kept until the first replica's values are broadcast (take_initial), then only the shard
        self.__dict__["initial"] = torch.cat([p.detach().reshape(-1).to(master_device or self.device, torch.float32)
                                              for p in params])
        if master_device is None:  # zero=3 in fp32: the pieces are views of the rank's parameter shard
            base = unsharded.shard.detach()
        else:
            self.__dict__["flat"] = torch.zeros(layout.shard, dtype=torch.float32, device=master_device)
            base = self.flat
        self.__dict__["shards"] = [nn.Parameter(base[p.offset:p.offset + p.numel]) for p in self.pieces]
        self.take_initial()

    def take_initial(self) -> None:
        """The shard from the whole bucket's fp32 values (after their broadcast)."""
        with torch.no_grad():
            for piece, shard in zip(self.pieces, self.shards):
                begin = sum(self.layout.numels[:piece.index]) + piece.start
                shard.copy_(self.initial[begin:begin + piece.numel])
        self.refresh_unsharded()

    def refresh_unsharded(self) -> None:
        """zero=3 with fp32 masters: the rank's compute shard follows its master shard."""
        if self.unsharded is not None and self.flat is not None:
            self.unsharded.write(self.flat)

    def bind(self, optimizer: Optional[torch.optim.Optimizer]) -> None:
        self.__dict__["optimizer"] = optimizer

    def forward(self, row: Optional[torch.Tensor]) -> torch.Tensor:
        lay = self.layout
        used = row[lay.shard:].tolist() if row is not None else [0] * lay.flags
        # the pieces are fp32 (masters, or the fp32 weights): a row reduced in the compute dtype is widened
        grads = row[:lay.shard].float() if row is not None else None
        if grads is not None and self.grad_divisor != 1.0:  # in place: the row is this chain's own (zero=1's p.grad stays scaled)
            grads.div_(self.grad_divisor)
        for piece, shard in zip(self.pieces, self.shards):
            shard.grad = grads[piece.offset:piece.offset + piece.numel] if used[piece.index] > 0 else None
        try:
            if self.optimizer is not None:
                self.optimizer.step()
        finally:
            for shard in self.shards:  # the optimizer spans every bucket: a bucket steps alone
                shard.grad = None
        if self.flat is not None:
            return self.flat.to(self.compute_dtype)
        if self.unsharded is not None:  # stepped in place
            return self.unsharded.shard.detach()
        if self.weights is not None:  # stepped in place: the rank's shard of the flat parameters
            return self.weights[self.layout.rank * lay.shard:(self.layout.rank + 1) * lay.shard]
        out = torch.empty(lay.shard, dtype=self.params[0].dtype, device=self.device)
        owned = 0
        for piece, shard in zip(self.pieces, self.shards):
            out[piece.offset:piece.offset + piece.numel].copy_(shard.detach())
            owned += piece.numel
        out[owned:].zero_()  # padding (the pieces fill the shard from its start)
        return out


class AllGatherParams(_BucketModule):
    """Step: starts the all-gather of every rank's updated shard into the bucket's flat weights,
    right after the step, on the worker thread, so it overlaps the rest of backward. It goes
    over the second group of its axis (WEIGHTS_GROUP): backward's thread issues the
    reduce-scatters over the first, and each group sees its collectives in one order on every rank."""

    def __init__(self, params: Sequence[nn.Parameter], layout: ShardLayout, mesh, stage: int, axis: str = "dp",
                 weights: Optional[torch.Tensor] = None):
        super().__init__(params, layout, mesh, stage, axis)
        self.__dict__["weights"] = weights  # the flat parameters themselves, gathered into (flatten_bucket)

    def forward(self, shard: torch.Tensor) -> Pending:
        lay = self.layout
        full = (self.weights if self.weights is not None
                else torch.empty(lay.shard * lay.dp, dtype=shard.dtype, device=shard.device))
        work = dist.all_gather_single(full, shard.contiguous(), group=self.mesh.group(WEIGHTS_GROUP[self.axis]),
                                    async_op=True)
        return Pending(work, full)


class GatheredWeights(_BucketModule):
    """Write: waits for the all-gather (after backward, when no op reads the weights any more)."""

    def forward(self, gathering: Pending) -> torch.Tensor:
        return gathering.result()


# ---- the optimizer over every bucket's pieces, and its state as whole parameters -------------

def build_shard_optimizer(factory: Optional[Callable], steps: Sequence[ShardStep]) -> Optional[torch.optim.Optimizer]:
    """The user's optimizer over this rank's pieces of every bucket, bound to the buckets."""
    if factory is None:
        return None
    _check_every_rank_owns_some(steps)
    shards = [s for step in steps for s in step.shards]
    optimizer = make_optimizer(factory, shards)
    for step in steps:
        step.bind(optimizer)
    return optimizer


# ---- fp32 master shards (param_dtype below fp32, offload_optimizer) ---------------------------

def broadcast_initial_masters(steps: Sequence[ShardStep]) -> None:
    """Every replica's master shards from the first replica's fp32 weights (collective over each
    bucket's axis: dp, or edp for expert weights)."""
    for step in steps:
        if step.initial is not None:
            source = step.mesh.ranks_along(step.axis)[0]
            dist.broadcast(step.initial, src=source, group=step.mesh.group(step.axis))
            step.take_initial()
            step.__dict__["initial"] = None


def gather_whole(steps: Sequence[ShardStep]) -> Dict[str, torch.Tensor]:
    """Each parameter, whole, from every rank's shards (collective over each bucket's axis): the fp32 master
    where there is one, else (zero=3) the rank's compute shard. A bucket with neither (expert
    weights at zero=3 at edp = 1 in fp32, mesh.experts_stage) is left out: its parameters are
    whole on the rank, their own truth."""
    whole: Dict[str, torch.Tensor] = {}
    for step in sharded_truth(steps):
        lay = step.layout
        mine = step.flat if step.flat is not None else step.unsharded.shard.detach()
        full = torch.empty(lay.shard * lay.dp, dtype=mine.dtype, device=mine.device)
        dist.all_gather_single(full, mine, group=step.mesh.group(step.axis), async_op=True).wait(
            datetime.timedelta(seconds=distributed.DEFAULT_TIMEOUT_S))
        offset = 0
        for name, shape in zip(step.names, step.shapes):
            numel = math.prod(shape)
            whole[name] = full[offset:offset + numel].view(shape).clone()
            offset += numel
    return whole


def sharded_truth(steps: Sequence[ShardStep]) -> List[ShardStep]:
    """The buckets whose weights' truth lives only in shards: fp32 master shards, or zero=3's
    parameter shards."""
    return [step for step in steps if step.flat is not None or step.unsharded is not None]


def scatter_whole(steps: Sequence[ShardStep], whole: Dict[str, torch.Tensor]) -> None:
    """Whole values back into the shards and the device copies (after loading)."""
    with torch.no_grad():
        for step in sharded_truth(steps):
            for piece, shard in zip(step.pieces, step.shards):
                shard.copy_(whole[step.names[piece.index]].reshape(-1)[piece.start:piece.stop])
            step.refresh_unsharded()
            for name, p in zip(step.names, step.params):
                p.copy_(whole[name])


def owned_ranges(steps: Sequence[ShardStep]) -> Dict[str, List[Tuple[int, int]]]:
    """Per parameter name, the flat ranges of it this rank owns (where, at zero=1, p.grad holds
    the dp average)."""
    ranges: Dict[str, List[Tuple[int, int]]] = {}
    for step in steps:
        for piece in step.pieces:
            ranges.setdefault(step.names[piece.index], []).append((piece.start, piece.stop))
    return ranges


def _check_every_rank_owns_some(steps: Sequence[ShardStep]) -> None:
    """Every rank checks every rank's share, so all refuse together (none waits in a collective).
    Expert buckets are sharded over the edp group: the dp x tp rank `flat` of a stage owns
    dense shard flat // tp and expert shard flat // (ep * etp) (graphpar/distributed/mesh.py)."""
    mesh = steps[0].mesh
    for flat in range(mesh.dp * mesh.tp):
        index = {"dp": flat // mesh.tp, "edp": flat // (mesh.ep * mesh.etp)}
        rank = index["dp"]
        if all(ShardLayout(step.layout.numels, step.layout.dp, index[step.axis]).owned() == 0 for step in steps):
            raise ValueError(
                f"Strategy.zero={steps[0].stage} at dp={mesh.dp} leaves dp rank {rank} no element of any parameter "
                f"(the {sum(step.layout.total for step in steps)} trained elements fill the first ranks' shards, "
                f"the rank's are padding only), so it would have nothing to step. Fix: use a smaller dp, or zero=0 "
                f"for so small a model.")


def full_optimizer_states(steps: Sequence[ShardStep], optimizer) -> Dict[str, Dict[str, Any]]:
    """Every parameter's optimizer state, whole (shaped like the parameter), on every dp rank:
    per bucket the ranks' pieces are all-gathered (collective over dp)."""
    states: Dict[str, Dict[str, Any]] = {}
    for step in steps:
        states.update(_bucket_states(step, optimizer))
    return states


def _bucket_states(step: ShardStep, optimizer) -> Dict[str, Dict[str, Any]]:
    lay, group = step.layout, step.mesh.group(step.axis)
    # per parameter: which entries are elementwise (shaped like the piece), and the others' values
    summary = {piece.index: {key: ("elementwise", value.dtype) if _is_elementwise(value, piece) else ("whole", value)
                             for key, value in optimizer.state.get(shard, {}).items()}
               for piece, shard in zip(step.pieces, step.shards)}
    everyone: List[Dict[int, Dict[str, Any]]] = [None] * lay.dp
    dist.all_gather_object(everyone, summary, group=group)
    merged: Dict[int, Dict[str, Any]] = {}
    for theirs in everyone:
        for i, entries in theirs.items():
            merged.setdefault(i, {}).update(entries)
    keys = sorted({(key, kind[1]) for entries in merged.values() for key, kind in entries.items()
                   if kind[0] == "elementwise"}, key=lambda k: k[0])
    states = {name: {} for name in step.names}
    for i, entries in merged.items():
        for key, (kind, value) in entries.items():
            if kind == "whole":
                states[step.names[i]][key] = value
    for key, dtype in keys:
        shard = torch.zeros(lay.shard, dtype=dtype, device=step.device)
        for piece, shard_param in zip(step.pieces, step.shards):
            value = optimizer.state.get(shard_param, {}).get(key)
            if value is not None:
                shard[piece.offset:piece.offset + piece.numel].copy_(value)
        full = torch.empty(lay.shard * lay.dp, dtype=dtype, device=shard.device)
        dist.all_gather_single(full, shard, group=group, async_op=True).wait(
            datetime.timedelta(seconds=distributed.DEFAULT_TIMEOUT_S))
        offset = 0
        for i, (name, shape) in enumerate(zip(step.names, step.shapes)):
            numel = math.prod(shape)
            if key in merged.get(i, {}):
                states[name][key] = full[offset:offset + numel].view(shape).clone()
            offset += numel
    return states


def _is_elementwise(value: Any, piece: Piece) -> bool:
    return torch.is_tensor(value) and value.dim() == 1 and value.numel() == piece.numel


# per-parameter scalars of the elementwise optimizers (Adam's step, ASGD's eta and mu): whole
# even where the parameter itself is a scalar
_SCALAR_STATE = ("step", "eta", "mu")


def _sliced(key: str, value: Any, shape: Tuple[int, ...]) -> bool:
    """Whether a whole-parameter state entry is cut into pieces like the parameter."""
    return (torch.is_tensor(value) and tuple(value.shape) == tuple(shape)
            and (len(shape) > 0 or key not in _SCALAR_STATE))


def load_optimizer_states(steps: Sequence[ShardStep], optimizer, states: Dict[str, Dict[str, Any]]) -> None:
    """Install whole-parameter optimizer states: each rank keeps its pieces' slices."""
    for step in steps:
        for piece, shard in zip(step.pieces, step.shards):
            shape = step.shapes[piece.index]
            full = states.get(step.names[piece.index], {})
            optimizer.state[shard] = {
                key: (value.reshape(-1)[piece.start:piece.stop].to(shard.device).clone()
                      if _sliced(key, value, shape) else value)
                for key, value in full.items()}
            if not full:
                optimizer.state.pop(shard, None)
