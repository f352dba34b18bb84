"""The device mesh: each rank's (dp, pp, tp) coordinates and its process groups.

Rank order follows Megatron-LM: tp varies fastest, then dp, then pp,

    rank = pp_rank * (dp * tp) + dp_rank * tp + tp_rank

so the ranks of one tensor-parallel group are neighbours (on one machine, sharing the
fastest links), and pipeline stages, which exchange the least data, are furthest apart.

Expert parallelism (ep > 1) folds into the dp x tp ranks of a pipeline stage, as Megatron-LM
lays it out (ep varies faster than the data parallelism of the experts): number them
flat = dp_rank * tp + tp_rank (their order in the world); they split into groups of ep
consecutive ones ("ep", which exchange tokens and split the experts), and the ranks at the
same place of every such group ("edp", which hold the same experts and sum their gradients):

    ep_rank = flat % ep          ep group:  flat ranks ep * (flat // ep) + [0, ep)
    edp group: flat ranks ep_rank + ep * [0, dp * tp / ep)

At tp = 1, flat is the dp rank.

With expert tensor parallelism (Strategy.expert_tp = etp = tp) each expert's matrices are
split over the tp group too, and the flat ranks decompose as Megatron-core's expert layout
does, etp varying fastest, then ep, then edp:

    flat = edp_rank * (ep * etp) + ep_rank * etp + etp_rank      (etp_rank = tp_rank)
    ep group:  the ep ranks that differ in ep_rank only   (same tp rank, dp ranks in a block of ep)
    edp group: the edp = dp * tp / (ep * etp) ranks that differ in edp_rank only

At etp = 1 this is the layout above.

A Mesh without groups is a "virtual" mesh: the pass pipeline and the planner use it to
compile any rank of any world without a process group.
"""
from __future__ import annotations

import datetime
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import torch.distributed as dist

from graphpar.distributed import groups as distributed

AXES = ("dp", "tp", "pp")
# the two axes inside dp that expert parallelism uses (see the module docstring)
EXPERT_AXES = ("ep", "edp")


def edp_size(dp: int, tp: int, ep: int, etp: int) -> int:
    """The ranks of a stage holding the same pieces of the same experts (expert data parallelism):
    dp x tp folds into ep x etp x edp."""
    return dp * tp // (ep * etp)


def experts_stage(zero: int, edp: int) -> int:
    """The ZeRO stage expert weights (expert parallelism) get: zero=3 shards them over the edp
    group (the ranks holding the same experts) as the dense ones over dp, each experts module's
    weights in buckets of their own, gathered around its experts call (passes/shard_parameters.py
    hands the gathered weights to it). With edp = 1 there is nothing to shard them over: they
    stay whole on the rank, its E/ep experts, in zero=2's chains (over a group of one)."""
    return zero if zero < 3 or edp > 1 else 2


@dataclass
class Mesh:
    dp: int
    tp: int
    pp: int
    rank: int
    groups: Dict[str, Any] = field(default_factory=dict)   # axis -> ProcessGroup (real runs)
    ep: int = 1   # expert-parallel degree, a divisor of dp * tp
    etp: int = 1  # expert tensor-parallel degree (Strategy.expert_tp): 1 or tp

    def __post_init__(self):
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside a world of {self.world_size} "
                             f"(dp={self.dp} x tp={self.tp} x pp={self.pp}). Fix: use a rank in "
                             f"[0, {self.world_size}), or degrees whose product covers it.")

    @property
    def group_ranks(self) -> Dict[str, List[int]]:
        """Axis -> the ranks of this rank's group along it. Computed when asked: a mesh is
        built for every rank of a planned world, and listing its groups costs dp + tp + pp."""
        return {axis: self.ranks_along(axis) for axis in AXES}

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def dp_rank(self) -> int:
        return (self.rank // self.tp) % self.dp

    @property
    def pp_rank(self) -> int:
        return self.rank // (self.tp * self.dp)

    @property
    def flat_rank(self) -> int:
        """This rank's place among the dp x tp ranks of its pipeline stage."""
        return self.dp_rank * self.tp + self.tp_rank

    @property
    def ep_rank(self) -> int:
        return self.flat_rank // self.etp % self.ep

    @property
    def edp(self) -> int:
        """The number of ranks holding the same pieces of the same experts (expert data parallelism)."""
        return edp_size(self.dp, self.tp, self.ep, self.etp)

    @property
    def edp_rank(self) -> int:
        return self.flat_rank // (self.ep * self.etp)

    def rank_at(self, dp_rank: int, pp_rank: int, tp_rank: int) -> int:
        return pp_rank * (self.dp * self.tp) + dp_rank * self.tp + tp_rank

    def ranks_along(self, axis: str) -> List[int]:
        """The ranks that share every coordinate with this rank except `axis` (or, for the
        expert axes, the dp x tp ranks of its ep or edp group)."""
        if axis in EXPERT_AXES:
            first, stride, size = ((self.flat_rank - self.ep_rank * self.etp, self.etp, self.ep) if axis == "ep"
                                   else (self.flat_rank % (self.ep * self.etp), self.ep * self.etp, self.edp))
            flats = [first + i * stride for i in range(size)]
            return [self.rank_at(f // self.tp, self.pp_rank, f % self.tp) for f in flats]
        coords = {"dp": self.dp_rank, "pp": self.pp_rank, "tp": self.tp_rank}
        sizes = {"dp": self.dp, "pp": self.pp, "tp": self.tp}
        ranks = []
        for i in range(sizes[axis]):
            coords[axis] = i
            ranks.append(self.rank_at(coords["dp"], coords["pp"], coords["tp"]))
        return ranks

    def group(self, axis: str) -> Optional[Any]:
        return self.groups.get(axis)

    def describe(self) -> str:
        return (f"rank {self.rank}/{self.world_size}: dp {self.dp_rank}/{self.dp}, "
                f"pp {self.pp_rank}/{self.pp}, tp {self.tp_rank}/{self.tp}")


def all_groups_along(dp: int, tp: int, pp: int, axis: str, ep: int = 1, etp: int = 1) -> List[List[int]]:
    """Every group of `axis` in the world, in a fixed order (new_group is collective)."""
    seen, groups = set(), []
    for rank in range(dp * tp * pp):
        ranks = Mesh(dp, tp, pp, rank, ep=ep, etp=etp).ranks_along(axis)
        if tuple(ranks) not in seen:
            seen.add(tuple(ranks))
            groups.append(ranks)
    return groups


def build_mesh(strategy, rank: int, world_size: int, with_groups: bool) -> Mesh:
    """The mesh of this rank; with_groups creates the process groups of each axis.

    torch.distributed.new_group must be called by every rank for every group in the same
    order, so each rank creates all groups and keeps the ones it belongs to.
    """
    strategy.check_world_size(world_size)
    mesh = Mesh(strategy.dp, strategy.tp, strategy.pp, rank, ep=strategy.ep, etp=strategy.expert_tp)
    if with_groups and world_size > 1:
        # at ep = 1 (experts split over tp only) no tokens cross ranks: no ep group
        expert_axes = tuple(a for a in EXPERT_AXES if strategy.ep > 1 or a == "edp") if strategy.splits_experts else ()
        for axis in AXES + expert_axes:
            _add_groups(mesh, strategy, axis, axis)
        if strategy.zero in (1, 2) and strategy.dp > 1:
            # ZeRO-1/2's weight all-gathers are issued by the update's worker thread while
            # backward's thread issues reduce-scatters: each thread gets its own dp group, so
            # each group sees its collectives in one order on every rank
            _add_groups(mesh, strategy, "dp", DP_WEIGHTS)
        edp = edp_size(strategy.dp, strategy.tp, strategy.ep, strategy.expert_tp)
        if strategy.zero and strategy.dp > 1 and strategy.splits_experts and experts_stage(strategy.zero, edp) < 3:
            # expert weights sharded over their edp group as at zero=1/2 (the same reason); at
            # zero=3 with edp > 1 they are gathered before their use, on the edp group itself
            _add_groups(mesh, strategy, "edp", EDP_WEIGHTS)
    return mesh


# the second group over the dp axis (ZeRO-1/2's weight all-gathers), and over the edp axis
# (expert weights'); WEIGHTS_GROUP: a sharding axis -> its second group
DP_WEIGHTS = "dp_weights"
EDP_WEIGHTS = "edp_weights"
WEIGHTS_GROUP = {"dp": DP_WEIGHTS, "edp": EDP_WEIGHTS}


def _add_groups(mesh: Mesh, strategy, axis: str, name: str) -> None:
    for ranks in all_groups_along(strategy.dp, strategy.tp, strategy.pp, axis, strategy.ep, strategy.expert_tp):
        group = dist.new_group(ranks, timeout=datetime.timedelta(seconds=distributed.DEFAULT_TIMEOUT_S))
        if mesh.rank in ranks:
            mesh.groups[name] = group
