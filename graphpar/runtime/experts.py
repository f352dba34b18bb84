"""Expert parallelism at run time: a mixture-of-experts layer's experts split over the ep
ranks, tokens dispatched to them and their outputs combined with all-to-all.

passes/expert_parallel.py replaces the traced code of each experts module by one call of
this rank's copy of that module, whose class it turns into `expert_parallel_class(cls)`: the
user's class with `ExpertParallel.forward` in front. The copy holds only this rank's experts
(rows ep_rank * E/ep .. (ep_rank + 1) * E/ep of every expert weight, under the user's own
parameter names) and says it has E/ep of them. At zero=3 with edp > 1 it holds none of them: the
call gets them, gathered over edp just before it, as keyword arguments (passes/shard_parameters.py),
and they stand in its attributes for that call only. Its forward runs eagerly inside the traced
program: how many tokens each rank sends and receives depends on the routing, a different
number every step, so no shape of it is baked into the graph and nothing is traced again
when the counts change.

The experts interface is the one `transformers` defines for its fused experts modules
(`@use_experts_implementation`): forward(hidden [T, H], top_k_index [T, K], top_k_weights
[T, K]) -> [T, H], the sum over k of weight k times expert index[k] applied to the token.

    capacity  with Strategy.expert_capacity_factor f: each expert takes the first
              ceil(f * T * K / E) of its pairs of the replica's T tokens, in token order; the
              others are dropped: not sent, their output zero (the token keeps its residual)
    split     with tp > 1 and whole experts: this tp rank's 1/tp of the tokens (the tp ranks of a replica hold the
              same tokens; each dispatches its share once)
    pairs     each kept (token, k) is a pair; pairs sorted by expert (stable), so by destination
    counts    pairs per destination rank, exchanged (all-to-all of ep ints)
    dispatch  the pairs' hidden rows and local expert ids, all-to-all to the experts' ranks
    experts   the user's forward on the received rows, each with its one expert and weight 1
              (with expert tensor parallelism on this rank's pieces, summed over tp)
    combine   the rows back, all-to-all in reverse; unsorted
    gather    with tp > 1 and whole experts: every tp rank's pairs, all-gathered over tp
    weighted  weighted and summed over k on the token's own ranks, so the router's gradient
              never crosses ranks

Weighting on the token's rank with the same ops eager uses (output * weight, then the sum
over k) keeps the numbers of single-device training; multiplying by the weight 1 on the
expert's rank changes nothing. Every all-to-all has the collective timeout, and its backward
is the all-to-all in reverse, which every rank of the ep group runs (a rank that received no
token still sends and receives its empty share, and still runs its experts on zero rows, so
its expert weights get the gradient eager gives them: zeros).

With expert tensor parallelism (Strategy.expert_tp = tp, Megatron's expert tensor
parallelism) each expert's matrices are split over the tp group instead: gate_up_proj by
columns (this rank's 1/tp of the gate's rows and the same of the up projection's, so the
gating pairs them as on one device), down_proj by rows (the matching 1/tp of its input
columns). Every tp rank then dispatches all its replica's tokens over its ep group (the dp
ranks at its tp rank), and on the expert's rank

    copy      the received rows, identity forward; backward: their gradient summed over tp
              (each tp rank's pieces give a partial one)
    experts   the user's forward on this rank's pieces: a partial output
    reduce    the partial outputs summed over tp (all-reduce); backward: identity (every tp
              rank gets the same gradient for the sum)

Megatron's conjugate pair around a column- then row-parallel MLP, put around the experts on
the rows they received; the rows the tp ranks of a replica receive are alike (their tokens
and routing are), so each tp rank of an ep group combines whole outputs.

Experts held as modules of a container (the list layout: passes/tracing/expert_lists.py)
take the same dispatch and combine (ExpertParallelList): the rank's copy of the container
holds its E/ep expert modules, each run on the rows it received and not called when it got
none (no gradient then, as in the user's loop); a one-hot [T, K, E] routing mask
(SwitchTransformers) becomes the indices, its all-zero pairs (dropped by the router) not sent.

With tp > 1 and whole experts (expert_tp = 1) the experts module sits between
tensor-parallel regions, where every tp rank of a replica holds the same tokens and gets the
same gradient for them (Megatron's invariant).
The split's backward all-gathers the hidden rows' gradients (each tp rank computed its
share's), and the gather's backward keeps this rank's rows of a gradient every tp rank has
whole; the routing weights multiply the gathered pairs on every tp rank, so the router's
gradient is whole and the same on each, as without tp.
"""
from __future__ import annotations

import datetime
import math
from typing import List, Optional

import torch
import torch.distributed as dist

from graphpar.distributed import groups as distributed
from graphpar.runtime import collectives, ops

EP_AXIS = "ep"
TP_AXIS = "tp"


def _timeout() -> datetime.timedelta:
    return datetime.timedelta(seconds=distributed.DEFAULT_TIMEOUT_S)


def _all_to_all(x: torch.Tensor, send: List[int], receive: List[int], group) -> torch.Tensor:
    """Rows of `x` (in destination order, send[r] for rank r) to their ranks; what arrives,
    receive[r] rows from rank r, in rank order."""
    out = x.new_empty((sum(receive), *x.shape[1:]))
    work = dist.all_to_all_single(out, x.contiguous(), output_split_sizes=receive, input_split_sizes=send,
                                  group=group, async_op=True)
    work.wait(_timeout())
    return out


class _AllToAll(torch.autograd.Function):
    """all-to-all forward; backward: the gradients of the received rows go back the same way."""

    @staticmethod
    def forward(ctx, x, send, receive, group):
        ctx.send, ctx.receive, ctx.group = send, receive, group
        return _all_to_all(x, send, receive, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_to_all(grad, ctx.receive, ctx.send, ctx.group), None, None, None


def _gather_rows(x: torch.Tensor, group) -> torch.Tensor:
    """Every rank of `group`'s rows (as many from each), in group-rank order."""
    out = x.new_empty((x.shape[0] * dist.get_world_size(group), *x.shape[1:]))
    work = dist.all_gather_into_tensor(out, x.contiguous(), group=group, async_op=True)
    work.wait(_timeout())
    return out


def _own_rows(x: torch.Tensor, group) -> torch.Tensor:
    """This rank's 1/size of the rows of `x`, in group-rank order."""
    share = x.shape[0] // dist.get_world_size(group)
    first = dist.get_rank(group) * share
    return x[first:first + share]


class _SplitRows(torch.autograd.Function):
    """This tp rank's share of rows the tp ranks hold alike; backward: every share's gradient."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _own_rows(x, group).clone()

    @staticmethod
    def backward(ctx, grad):
        return _gather_rows(grad, ctx.group), None


class _GatherRows(torch.autograd.Function):
    """Every tp rank's rows; backward: this rank's rows of a gradient the tp ranks hold alike."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_rows(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _own_rows(grad, ctx.group), None


# expert tensor parallelism's split of the expert weights of transformers' fused layout
# (passes/expert_parallel.py checks a layer has exactly these before splitting it)
GATE_UP, DOWN = "gate_up_proj", "down_proj"


def tp_piece(name: str, full: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
    """tp rank `rank`'s piece of expert weight `name` ([E, 2I, H] or [E, H, I], any E): of
    gate_up_proj its 1/tp of the gate's rows and of the up projection's, of down_proj the
    matching 1/tp of its input columns."""
    if name.rpartition(".")[2] == GATE_UP:
        gate, up = full.chunk(2, dim=1)
        return torch.cat([gate.chunk(tp, dim=1)[rank], up.chunk(tp, dim=1)[rank]], dim=1)
    return full.chunk(tp, dim=2)[rank]


def tp_whole(name: str, pieces: List[torch.Tensor]) -> torch.Tensor:
    """The expert weight `name` from every tp rank's piece, in tp-rank order (tp_piece's inverse)."""
    if name.rpartition(".")[2] == GATE_UP:
        halves = [p.chunk(2, dim=1) for p in pieces]
        return torch.cat([g for g, _ in halves] + [u for _, u in halves], dim=1)
    return torch.cat(pieces, dim=2)


def tp_whole_shape(name: str, shape, tp: int) -> tuple:
    """The shape of the expert weight whose tp pieces have `shape`."""
    return tuple(n * tp if d == _tp_dim(name) else n for d, n in enumerate(shape))


def tp_piece_shape(name: str, shape, tp: int) -> tuple:
    """The shape of each tp piece of the expert weight of `shape` (tp_piece's)."""
    return tuple(n // tp if d == _tp_dim(name) else n for d, n in enumerate(shape))


def _tp_dim(name: str) -> int:
    return 1 if name.rpartition(".")[2] == GATE_UP else 2


def exchange_counts(send: torch.Tensor, group) -> List[int]:
    """How many rows each rank of `group` sends this rank, given what this rank sends each."""
    receive = torch.empty_like(send)
    work = dist.all_to_all_single(receive, send, group=group, async_op=True)
    work.wait(_timeout())
    return receive.tolist()


class ExpertParallel:
    """Put in front of an experts module's class (expert_parallel_class): `num_experts` is
    this rank's share, `global_experts` the layer's, and the forward is the dispatch, the
    user's forward on this rank's experts, and the combine."""

    num_experts: int
    global_experts: int
    expert_tp: int = 1   # 1: whole experts; tp: each expert's matrices split over the tp group
    capacity_factor: Optional[float] = None   # Strategy.expert_capacity_factor: None is dropless
    dropped_pairs: int = 0                    # pairs dropped past capacity since the count was reset

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor, **gathered: torch.Tensor) -> torch.Tensor:
        """`gathered`: at zero=3 (edp > 1) the expert weights, gathered over edp just before
        this call (passes/shard_parameters.py), which the module no longer holds itself."""
        if ops.simulating() or hidden_states.is_meta or _is_fake(hidden_states):
            return _shape_stand_in(hidden_states, top_k_weights)
        kept = self._kept(top_k_index)
        if gathered:
            # the user's forward reads self.<weight>: the gathered views stand there for this
            # call only, so nothing holds them after it (the bucket is freed right after)
            self.__dict__.update(gathered)
            try:
                return self._routed(hidden_states, top_k_index, top_k_weights, kept)
            finally:
                for name in gathered:
                    del self.__dict__[name]
        return self._routed(hidden_states, top_k_index, top_k_weights, kept)

    def keyword(self, name: str) -> str:
        """The keyword the call gets expert weight `name` under at zero=3 (its own name)."""
        return name

    def _routed(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                kept: torch.Tensor) -> torch.Tensor:
        """Each kept pair computed on its expert's rank, weighted and summed over k here."""
        tokens, k = top_k_index.shape
        tp = ops.axis_group(TP_AXIS)
        if tp is not None and dist.get_world_size(tp) > 1 and self.expert_tp == 1:
            mine = _own_rows(kept.view(tokens, k), tp).reshape(-1)
            share = self._pair_outputs(_SplitRows.apply(hidden_states, tp), _own_rows(top_k_index, tp), mine)
            pairs = _GatherRows.apply(share, tp)
        else:
            pairs = self._pair_outputs(hidden_states, top_k_index, kept)
        weighted = pairs * top_k_weights.reshape(-1).unsqueeze(-1)
        return weighted.view(tokens, k, -1).sum(dim=1).to(hidden_states.dtype)

    def _kept(self, top_k_index: torch.Tensor, routed: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Which pairs (row t * K + k) their expert takes: all of them (dropless), or with a
        capacity factor the first `expert_capacity` of each expert's, counted on the replica's
        tokens before any tp split, so every tp rank of a replica keeps the same pairs.
        `routed` (list layout, a one-hot mask): the pairs the router kept; the others are
        neither taken nor counted against a capacity."""
        if routed is None:
            routed = torch.ones(top_k_index.numel(), dtype=torch.bool, device=top_k_index.device)
        if self.capacity_factor is None:
            return routed
        tokens, k = top_k_index.shape
        # the router's dropped pairs go to a bucket past the last expert, which no capacity takes
        index = top_k_index.masked_fill(~routed.view_as(top_k_index), self.global_experts)
        kept = first_pairs(index, self.global_experts + 1,
                           expert_capacity(tokens, k, self.global_experts, self.capacity_factor)) & routed
        self.dropped_pairs += int(routed.sum() - kept.sum())
        return kept

    def _pair_outputs(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                      kept: torch.Tensor) -> torch.Tensor:
        """Expert index[t, k]'s output for token t, row t * K + k, computed on its ep rank (at
        ep = 1, on this rank); zeros for a pair not `kept` (dropped: it is not sent, and the
        token keeps only its residual)."""
        group = ops.axis_group(EP_AXIS) if self.global_experts > self.num_experts else None
        k = top_k_index.shape[1]
        pairs = kept.nonzero().squeeze(1)                   # the kept pairs' rows, in pair order
        experts = top_k_index.reshape(-1)[pairs]
        order = torch.argsort(experts, stable=True)   # pairs by expert, so by destination rank
        sent, sorted_experts = pairs[order], experts[order]
        rows = hidden_states[sent // k]
        if group is None:
            back = self._experts(rows, sorted_experts)
        else:
            destination = torch.div(sorted_experts, self.num_experts, rounding_mode="floor")
            send = torch.bincount(destination, minlength=dist.get_world_size(group))
            receive = exchange_counts(send, group)
            send = send.tolist()
            rows = _AllToAll.apply(rows, send, receive, group)
            local = _all_to_all(sorted_experts - destination * self.num_experts, send, receive, group)
            back = _AllToAll.apply(self._experts(rows, local), receive, send, group)
        return back.new_zeros((kept.numel(), back.shape[1])).index_copy(0, sent, back)

    def _experts(self, rows: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
        """The user's forward on `rows`, each with its one local expert and weight 1; with
        expert tensor parallelism, on this rank's pieces, summed over tp."""
        if self.expert_tp == 1:
            return super().forward(rows, local.unsqueeze(1), rows.new_ones((rows.shape[0], 1)))
        # Megatron's conjugate pair around the pieces: identity forward, the pieces' partial
        # input gradients summed over tp in backward; the partial outputs summed over tp
        rows = collectives.copy_to(rows, TP_AXIS)
        out = super().forward(rows, local.unsqueeze(1), rows.new_ones((rows.shape[0], 1)))
        return collectives.reduce_from(out, TP_AXIS)


class _Gate(torch.autograd.Function):
    """The gathered expert weights of a list's call (zero=3), as views of the same storage (the
    saved-tensor recipes find them); backward: every one's gradient (None for an expert that did
    not run) at once, after all of the call's backward, so that each rank of the edp group reaches
    the weights' buckets at the same point, in the same order, whichever experts ran on it."""

    @staticmethod
    def forward(ctx, *weights):
        ctx.set_materialize_grads(False)
        return tuple(w.view_as(w) for w in weights)

    @staticmethod
    def backward(ctx, *grads):
        return grads


class _Reach(torch.autograd.Function):
    """The call's output, depending on every gathered weight with no gradient for it: backward
    reaches _Gate (hence the buckets' reductions) on a rank where no expert ran too."""

    @staticmethod
    def forward(ctx, out, *weights):
        ctx.weights = len(weights)
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        return (grad,) + (None,) * ctx.weights


class ExpertParallelList(ExpertParallel):
    """ExpertParallel for experts held as modules of a container (the list layout,
    passes/tracing/expert_lists.py): the container holds this rank's E/ep expert modules, in
    expert order, and each runs on the rows it received. An expert that received none is not
    called, so its parameters get no gradient, as in the user's own loop; with a one-hot mask
    [T, K, E] for routing (SwitchTransformers), a pair whose row is all zeros (the router
    dropped it) is not sent.

    At zero=3 with edp > 1 the expert modules hold no weights: the call gets them gathered, as
    held_<i> for `held[i]` (their names, relative to the container), and each stands in its
    module's attribute for that call only."""

    held: tuple = ()   # this rank's expert weights' names (`0.w1.weight`), in the container's order

    def keyword(self, name: str) -> str:
        return f"held_{self.held.index(name)}"

    def forward(self, hidden_states: torch.Tensor, routing: torch.Tensor, top_k_weights: torch.Tensor,
                **gathered: torch.Tensor) -> torch.Tensor:
        if ops.simulating() or hidden_states.is_meta or _is_fake(hidden_states):
            return _shape_stand_in(hidden_states, top_k_weights)
        if not gathered:
            return self._listed(hidden_states, routing, top_k_weights)
        views = _Gate.apply(*gathered.values())
        placed = [(self.get_submodule(owner), leaf, view) for key, view in zip(gathered, views)
                  for owner, _, leaf in [self.held[int(key.rpartition("_")[2])].rpartition(".")]]
        self.__dict__["gathered_views"] = views
        for module, leaf, view in placed:
            module.__dict__[leaf] = view
        try:
            return self._listed(hidden_states, routing, top_k_weights)
        finally:
            for module, leaf, _ in placed:
                del module.__dict__[leaf]
            del self.__dict__["gathered_views"]

    def _listed(self, hidden_states: torch.Tensor, routing: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        if routing.dim() == 2:
            return self._routed(hidden_states, routing, top_k_weights, self._kept(routing))
        picked = routing.sum(dim=-1)
        if bool((picked > 1).any()) or bool((routing < 0).any()):
            raise ValueError(
                f"{type(self).__name__}: the routing mask of shape {list(routing.shape)} has a pair (token, k) with "
                f"{int(picked.max())} experts or a negative entry; the mask layout routes each pair to at most one "
                f"expert (one-hot, or all zeros for a pair the router dropped). Fix: route each pair to one "
                f"expert, or use ep=1.")
        index = routing.argmax(dim=-1)
        return self._routed(hidden_states, index, top_k_weights, self._kept(index, picked.reshape(-1) > 0))

    def _experts(self, rows: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
        """Each received row through its local expert (every row has one; rows * 0 when none
        arrived)."""
        out = rows * 0
        for e, expert in enumerate(self.children()):
            picked = (local == e).nonzero().squeeze(1)
            if picked.numel():
                out = out.index_copy(0, picked, expert(rows[picked]).to(rows.dtype))
        gathered = self.__dict__.get("gathered_views")
        if gathered and torch.is_grad_enabled():
            out = _Reach.apply(out, *gathered)
        if torch.is_grad_enabled() and not out.requires_grad and any(p.requires_grad for p in self.parameters()):
            # no expert ran here and the rows need no gradient (the model's input): the combine's
            # backward, an all-to-all, must still run on this rank as on those whose experts ran;
            # what reaches this throwaway leaf is dropped, no parameter gets a gradient from it
            out.requires_grad_()
        return out


def expert_capacity(tokens: int, k: int, experts: int, factor: float) -> int:
    """How many of a call's tokens * k pairs one expert takes: ceil(factor * tokens * k / experts),
    the capacity of Switch, GShard, Megatron-LM and DeepSpeed (each on the tokens one rank routes)."""
    return math.ceil(factor * tokens * k / experts)


def first_pairs(top_k_index: torch.Tensor, experts: int, capacity: int) -> torch.Tensor:
    """[T * K] bool: pair t * K + k is among the first `capacity` pairs of its expert, in pair
    order (token order, then k): the tokens dropped past capacity are the last ones, as
    Megatron-LM's drop policy 'position' drops them."""
    flat = top_k_index.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=experts)
    starts = torch.cumsum(counts, 0) - counts
    place = torch.arange(flat.numel(), device=flat.device) - starts[flat[order]]
    kept = torch.empty_like(flat, dtype=torch.bool)
    kept[order] = place < capacity
    return kept


def _is_fake(t: torch.Tensor) -> bool:
    return isinstance(t, torch._subclasses.fake_tensor.FakeTensor)


def _shape_stand_in(hidden_states: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
    """Fake-tensor runs (records, the planner) need the output's shape and dtype, and a
    gradient path to the router's weights; how many rows each rank gets is known only with
    real routing."""
    return hidden_states * top_k_weights.sum(dim=-1, keepdim=True).to(hidden_states.dtype)


_CLASSES: dict = {}


def expert_parallel_class(cls: type, listed: bool = False) -> type:
    """`cls` with ExpertParallel's forward in front (one class per experts class); `listed`:
    a container of expert modules (ExpertParallelList)."""
    if cls not in _CLASSES:
        front = ExpertParallelList if listed else ExpertParallel
        _CLASSES[cls] = type(f"ExpertParallel{cls.__name__}", (front, cls), {"__module__": __name__})
    return _CLASSES[cls]
