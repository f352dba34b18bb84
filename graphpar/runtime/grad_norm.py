"""Global gradient-norm clipping: which gradient elements each rank counts, so that one sum
over the world counts every element of the model's gradient exactly once.

compile(..., max_grad_norm=c) clips as torch.nn.utils.clip_grad_norm_(model.parameters(), c)
would on one device. After backward and the dp reduction each rank sums the squares of the
elements it counts (`NormShare`), one all-reduce over the world adds them, and the clip
coefficient joins the post-backward divisor (GradientDivisor.clip,
graphpar/runtime/grad_divisor.py), so the plain path and the update program's steps divide by
the same number. Which rank counts what:

    tp    a parameter cut over tp: every tp rank its shard; one replicated over tp: tp rank 0
    pp    a weight read by stages on several pp ranks (a tied embedding, its gradient summed
          over them first): the pp rank of the first stage reading it, as state dicts do
    dp    whole gradients (the dp average is the same on every replica; with host masters,
          the device copies' gradients they step with): dp rank 0; ZeRO's reduced shards
          (zero=1/2/3): every dp rank its own pieces; a host table's rows: every dp rank the
          rows it owns (on tp rank 0, every tp rank holding the same)
    ep    an expert weight (experts split over the ep group, replicated over the edp group,
          which covers the tp ranks holding the same experts): the first rank of its edp
          group counts its whole gradient (the edp average is the same on each); ZeRO's
          reduced shards of it: every edp rank its own pieces

The squares are taken of the gradients as they stand before the divisor (times the fp16 loss
scale, a token-weighted loss's count): GradientDivisor.clip divides the norm by it.
"""
from __future__ import annotations

from typing import Iterable, Mapping, Optional, Sequence, Tuple

import torch
import torch.nn as nn


def square_sum(tensors: Sequence[torch.Tensor]) -> float:
    """The sum of squares of every element: per-tensor 2-norms accumulated in float32 (as
    clip_grad_norm_ takes them, whatever the gradients' dtype), squared and summed in float64."""
    norms = [torch.linalg.vector_norm(t, dtype=torch.float32) for t in tensors if t.numel()]
    if not norms:
        return 0.0
    return float(torch.stack([n.to(norms[0].device) for n in norms]).double().square().sum())


class NormShare:
    """This rank's share of the global gradient norm (see the module docstring)."""

    def __init__(self, mesh, param_shards: Mapping[str, object], param_stages: Mapping[str, Sequence[int]],
                 whole: Mapping[str, nn.Parameter], experts: Iterable[str] = ()):
        self.mesh = mesh
        self.param_shards = param_shards
        self.param_stages = param_stages
        self.experts = frozenset(experts)   # expert weights (expert parallelism): name -> this rank's block
        # parameters whose p.grad holds the whole dp-averaged gradient after the dp reduction
        # (every one but those ZeRO shards): name -> this rank's tensor
        self.whole = dict(whole)

    def counts(self, name: str) -> bool:
        """Whether this rank counts `name`'s gradient, as far as tp, ep and pp decide (an expert
        block differs from one ep rank to the next, tp ranks included: no tp rule)."""
        if name not in self.param_shards and name not in self.experts and self.mesh.tp_rank != 0:
            return False
        stages = self.param_stages.get(name)
        return not stages or stages[0] % self.mesh.pp == self.mesh.pp_rank

    def first_replica(self, name: str) -> bool:
        """Whether this rank's whole gradient of `name` is the one counted among the ranks
        holding the same average: dp rank 0, or for an expert weight its edp group's first rank."""
        if name in self.experts:
            return self.mesh.ranks_along("edp")[0] == self.mesh.rank
        return self.mesh.dp_rank == 0

    def of_whole(self) -> float:
        """The whole gradients' part: p.grad after the dp (edp) average, on its first replica."""
        return square_sum([p.grad for name, p in self.whole.items()
                           if p.grad is not None and self.counts(name) and self.first_replica(name)])

    def of_shards(self, reduced: Iterable[Tuple[object, Optional[torch.Tensor]]]) -> float:
        """ZeRO's part: (ShardStep, its reduced row as the step takes it, or None where no rank's
        backward reached the bucket) per bucket; each rank counts its own pieces."""
        pieces = [row[piece.offset:piece.offset + piece.numel] for step, row in reduced if row is not None
                  for piece in step.pieces if self.counts(step.names[piece.index])]
        return square_sum(pieces)

    def of_tables(self, tables: Iterable[nn.Module]) -> float:
        """Host tables' part: each HostEmbedding's row gradients of this step, on the rows this
        rank owns (only the stage looking a table up has any)."""
        if self.mesh.tp_rank != 0:
            return 0.0
        return square_sum([table.row_gradients()[1] for table in tables])
