"""Tensor-parallel collectives as autograd-correct graph ops, named by mesh axis.

Megatron's conjugate pair, plus what the specs need at region borders:

    copy_to(x, axis)        f: identity forward, all-reduce backward   (enters a region)
    reduce_from(x, axis)    g: all-reduce forward, identity backward   (Partial -> Replicate)
    gather_from(x, dim, axis)  all-gather forward, take own slice backward (Shard -> Replicate)

sequence parallelism (Megatron-LM's sequence-parallel regions; `blocks` > 1 when batch and
sequence share one dim, see graphpar.ir.layout.piece):

    reduce_scatter(x, dim, axis, blocks)  reduce-scatter forward, all-gather backward
                                          (Partial -> SequenceShard, after a row layer)
    gather_to(x, dim, axis, blocks)       all-gather forward, reduce-scatter backward
                                          (SequenceShard -> the input of a TP region; replaces copy_to)
    scatter_to(x, dim, axis, blocks)      own piece forward, all-gather backward
                                          (Replicate -> SequenceShard; also Replicate -> Shard
                                          where the tp plan slices a replicated input, as
                                          BLOOM's alibi bias)
    gather_from(x, dim, axis, blocks)     also gathers SequenceShard values for replicated consumers

On gloo a reduce-scatter is an all-reduce of the full tensor and each rank keeps its piece
(graphpar.distributed.groups.has_reduce_scatter: gloo's own reduce-scatter is that
all-reduce plus copies; the plan names the all-reduce); NCCL runs reduce_scatter_tensor.

and the two layers whose math needs collectives inside:

    vocab_parallel_embedding(ids, table, axis)   masked local lookup (Partial; a g follows)
    parallel_cross_entropy(logits, target, ...)  Megatron's vocab-parallel cross entropy:
        all-reduces of the max, the sum of exps and the target logit; full logits are
        never gathered. Also handles ignore_index, label smoothing over the full
        vocabulary and reduction='sum' (token-weighted losses), which Megatron's version
        does not.

Graph nodes carry the axis name ("tp"), not a process group: the executor binds it (see
graphpar.runtime.ops.running_on), so the graph prints the same on every rank.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.fx

from graphpar.distributed.groups import has_reduce_scatter
from graphpar.runtime import ops
from graphpar.ir.layout import join, piece


def _rank(axis: str) -> int:
    return 0 if ops.simulating() else dist.get_rank(ops.axis_group(axis))


def _all_reduce(t: torch.Tensor, axis: str, op=dist.ReduceOp.SUM) -> torch.Tensor:
    t = t.contiguous()
    if ops.simulating():
        t.mul_(1)  # the in-place write the all-reduce makes, for what tracks writes (recompute's kept outputs)
    else:
        dist.all_reduce(t, op=op, group=ops.axis_group(axis))
    return t


class _CopyTo(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, axis):
        ctx.axis = axis
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad.clone(), ctx.axis), None


class _ReduceFrom(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, axis):
        # In place, as Megatron does: insert_collectives makes reduce_from the only reader
        # of a partial sum, and the matmul that produced it does not save its output.
        if not x.is_contiguous():
            return _all_reduce(x.clone(), axis)
        ctx.mark_dirty(x)
        return _all_reduce(x, axis)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _all_gather(x: torch.Tensor, dim: int, axis: str, blocks: int) -> torch.Tensor:
    if ops.simulating():
        return join([x] * ops.axis_size(axis), dim, blocks)
    group = ops.axis_group(axis)
    parts = [torch.empty_like(x, memory_format=torch.contiguous_format) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return join(parts, dim, blocks)


def _own_piece(x: torch.Tensor, dim: int, axis: str, blocks: int) -> torch.Tensor:
    return piece(x, dim, _rank(axis), ops.axis_size(axis), blocks).contiguous()


def _reduce_scatter(x: torch.Tensor, dim: int, axis: str, blocks: int) -> torch.Tensor:
    if ops.simulating():
        return _own_piece(x, dim, axis, blocks)
    group = ops.axis_group(axis)
    if not has_reduce_scatter(dist.get_backend(group)):
        return _own_piece(_all_reduce(x.clone(memory_format=torch.contiguous_format), axis), dim, axis, blocks)
    tp = dist.get_world_size(group)
    # reduce_scatter_tensor scatters along dim 0: bring each rank's pieces there
    stacked = x.unflatten(dim, (blocks, tp, -1)).movedim(dim + 1, 0).contiguous()
    out = torch.empty(stacked.shape[1:], dtype=x.dtype, device=x.device)
    dist.reduce_scatter_tensor(out, stacked, group=group)
    return out.flatten(dim, dim + 1)


def _sequence_function(name: str, forward, backward):
    """An autograd Function running forward(x, dim, axis, blocks), whose backward runs
    backward(grad, dim, axis, blocks): the sequence-parallel collectives are pairs of these."""
    def run_forward(ctx, x, dim, axis, blocks):
        ctx.dim, ctx.axis, ctx.blocks = dim, axis, blocks
        return forward(x, dim, axis, blocks)

    def run_backward(ctx, grad):
        return backward(grad, ctx.dim, ctx.axis, ctx.blocks), None, None, None
    return type(name, (torch.autograd.Function,),
                {"forward": staticmethod(run_forward), "backward": staticmethod(run_backward)})


@torch.fx.wrap
def copy_to(x: torch.Tensor, axis: str) -> torch.Tensor:
    return _CopyTo.apply(x, axis)


@torch.fx.wrap
def reduce_from(x: torch.Tensor, axis: str) -> torch.Tensor:
    return _ReduceFrom.apply(x, axis)


def _sequence_op(name: str, function):
    """The graph op `name`(x, dim, axis, blocks=1) that runs the autograd Function `function`."""
    def op(x: torch.Tensor, dim: int, axis: str, blocks: int = 1) -> torch.Tensor:
        return function.apply(x, dim, axis, blocks)
    op.__name__ = op.__qualname__ = name   # how graphs print it and pickle finds it
    return op


gather_from = _sequence_op("gather_from", _sequence_function("_GatherFrom", _all_gather, _own_piece))
reduce_scatter = _sequence_op("reduce_scatter", _sequence_function("_ReduceScatter", _reduce_scatter, _all_gather))
# each rank's gradient at a column input is a partial sum over its shard: sum, keep own piece
gather_to = _sequence_op("gather_to", _sequence_function("_GatherTo", _all_gather, _reduce_scatter))
scatter_to = _sequence_op("scatter_to", _sequence_function("_ScatterTo", _own_piece, _all_gather))
for _name in ("gather_from", "reduce_scatter", "gather_to", "scatter_to"):
    torch.fx.wrap(_name)   # by name: fx.wrap of a function would take its code's name, "op"


@torch.fx.wrap
def vocab_parallel_embedding(ids: torch.Tensor, table: torch.Tensor, axis: str,
                             padding_idx=None) -> torch.Tensor:
    """This rank's rows are [rank * rows, (rank + 1) * rows); other ids look up zeros.

    padding_idx keeps F.embedding's meaning: the row is looked up as usual but gets no
    gradient from the lookup (it may still change through a tied LM head)."""
    rows = table.shape[0]
    start = _rank(axis) * rows
    local = ids - start
    outside = (local < 0) | (local >= rows)
    local_padding = padding_idx - start if padding_idx is not None and 0 <= padding_idx - start < rows else None
    out = torch.nn.functional.embedding(local.masked_fill(outside, 0), table, padding_idx=local_padding)
    return out.masked_fill(outside.unsqueeze(-1), 0.0)


class _ParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, ignore_index, label_smoothing, vocab, axis, reduction):
        rows = logits.shape[-1]
        start = _rank(axis) * rows
        logits = logits.float()
        maximum = _all_reduce(logits.max(dim=-1).values, axis, dist.ReduceOp.MAX)
        shifted = logits - maximum.unsqueeze(-1)
        exp = shifted.exp()
        sum_exp = _all_reduce(exp.sum(dim=-1), axis)
        local = target - start
        mine = (local >= 0) & (local < rows)
        picked = shifted.gather(-1, local.clamp(0, rows - 1).unsqueeze(-1)).squeeze(-1)
        target_logit = _all_reduce(torch.where(mine, picked, torch.zeros_like(picked)), axis)
        log_z = sum_exp.log()
        nll = log_z - target_logit
        if label_smoothing > 0:
            # smoothing spreads over the full vocabulary: mean of -log p over all classes
            mean_logit = _all_reduce(shifted.sum(dim=-1), axis) / vocab
            nll = (1 - label_smoothing) * nll + label_smoothing * (log_z - mean_logit)
        valid = target != ignore_index
        # 'sum' divides by nothing (a token-weighted loss_fn divides by the global count);
        # 'mean' by the non-ignored targets, at least one (F.cross_entropy's 0/0 is nan)
        count = valid.sum().clamp(min=1) if reduction == "mean" else torch.ones((), dtype=torch.int64, device=logits.device)
        loss = torch.where(valid, nll, torch.zeros_like(nll)).sum() / count
        ctx.save_for_backward(exp / sum_exp.unsqueeze(-1), local, mine, valid, count)
        ctx.label_smoothing, ctx.vocab = label_smoothing, vocab
        return loss

    @staticmethod
    def backward(ctx, grad):
        softmax, local, mine, valid, count = ctx.saved_tensors
        rows = softmax.shape[-1]
        one_hot = torch.zeros_like(softmax)
        one_hot.scatter_(-1, local.clamp(0, rows - 1).unsqueeze(-1), mine.unsqueeze(-1).to(softmax.dtype))
        eps = ctx.label_smoothing
        target_dist = (1 - eps) * one_hot + eps / ctx.vocab
        scale = (valid.to(softmax.dtype) / count).unsqueeze(-1) * grad
        return (softmax - target_dist) * scale, None, None, None, None, None, None


@torch.fx.wrap
def parallel_cross_entropy(logits, target, ignore_index: int, label_smoothing: float, vocab: int,
                           axis: str, reduction: str = "mean") -> torch.Tensor:
    """Cross entropy over the non-ignored targets, logits sharded on the class dim: their
    mean, or (reduction='sum') their sum."""
    return _ParallelCrossEntropy.apply(logits, target, ignore_index, label_smoothing, vocab, axis, reduction)


COLLECTIVES = (copy_to, reduce_from, gather_from, reduce_scatter, gather_to, scatter_to, vocab_parallel_embedding,
               parallel_cross_entropy)
