"""The planner's all-to-all bytes of expert parallelism (Strategy.ep > 1, or expert_tp > 1;
graphpar/runtime/experts.py), for a given routing or, without one, a balanced one.

Per experts layer and microbatch, a rank with T tokens of K experts each (P = T * K pairs,
hidden rows of H elements of size s, routing indices of size i) that receives R pairs from
its ep group (its own included) makes these all-to-alls; bytes are the buffer each reads,
the plan's unit for an all-to-all (graphpar/planner/plan.py Transfer), its own share included:

    forward    the pairs per destination          ep * 8    (int64 counts)
               dispatch: the pairs' hidden rows   P * H * s
               dispatch: their local expert ids   P * i
               combine: the experts' outputs      R * H * s
    backward   combine's gradient, sent back      P * H * s
               dispatch's gradient, sent back     R * H * s  (when the hidden rows need one)

With tp > 1 each tp rank of a replica dispatches 1/tp of its T tokens (T above is that
share), and two all-gathers over tp follow, in the bytes of the buffer each fills:

    forward    every tp rank's pair outputs       T * K * H * s  (T of the whole replica)
    backward   the hidden rows' gradients         T * H * s      (when the hidden rows need one)

With expert tensor parallelism (expert_tp = tp) each tp rank dispatches all T tokens of its
replica (T above is the replica's; at ep = 1 nothing is exchanged and R = P), and two
all-reduces over tp sum the experts' pieces, in the bytes of the buffer each reads:

    forward    the experts' partial outputs       R * H * s
    backward   the received rows' gradients       R * H * s  (when the hidden rows need one)

Only R depends on the routing: the pairs of the ep group's tokens of that microbatch whose
expert lives on this rank. `routing` maps each experts module's path to the top_k_index
[T_global, K] of the global batch (every dp rank's rows in batch order, each dp rank's
tokens a contiguous block, each microbatch a contiguous block of those, each tp rank's
share a contiguous block of that), as
record_routing() takes it from one forward of the model; without it every rank is taken to
receive as many pairs as it sends (R = P), the mean of any routing.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch
import torch.fx

from graphpar.distributed.mesh import Mesh
from graphpar.ir import record
from graphpar.passes.expert_parallel import (check_expert_tp_layout, check_tokens_split, experts_call, experts_modules,
                                             find_experts_layers)
from graphpar.passes.saved_bytes import node_stage

COUNT_BYTES = 8   # torch.bincount's int64 counts


@dataclass(frozen=True)
class ExpertsCallCost:
    """One experts layer's call in one microbatch, as the analysed graph has it."""
    path: str              # the experts module
    experts: int           # E
    tokens: int            # T of one microbatch of one replica
    k: int                 # experts per token
    row_bytes: int         # H * s
    index_bytes: int       # i
    backward_rows: bool    # the hidden rows need a gradient: dispatch's backward runs


def experts_per_layer(model: torch.nn.Module) -> int:
    """The number of experts every experts layer of `model` splits into equal shares (the
    greatest common divisor of theirs); 0 without experts layers."""
    return math.gcd(*(layer.experts for layer in experts_modules(model)))


def experts_call_costs(gm: torch.fx.GraphModule, model: torch.nn.Module,
                       strategy) -> Dict[int, List[ExpertsCallCost]]:
    """Unit (the stage tag analyse_units gives each node) -> its experts layers' calls."""
    found: Dict[int, List[ExpertsCallCost]] = {}
    for layer in find_experts_layers(model, gm):
        call = experts_call(gm, layer)
        check_tokens_split(call, strategy)
        check_expert_tp_layout(model.get_submodule(layer.path), layer, strategy.expert_tp)
        hidden, index = record(call.hidden).value, record(call.top_k_index).value
        tokens, k = index.shape
        cost = ExpertsCallCost(layer.path, layer.experts, tokens, k, hidden.nbytes // tokens,
                               index.nbytes // index.numel, hidden.requires_grad)
        found.setdefault(node_stage(call.output), []).append(cost)
    return found


def record_routing(model: torch.nn.Module, *inputs, **kwargs) -> Dict[str, torch.Tensor]:
    """Experts module path -> the top_k_index it was called with in one forward of `model`
    on real `inputs` (no gradient): the routing gp.plan(routing=...) counts."""
    routing: Dict[str, torch.Tensor] = {}
    handles = []
    for layer in experts_modules(model):
        def keep(module, args, call_kwargs, path=layer.path):
            index = args[1] if len(args) > 1 else call_kwargs["top_k_index"]
            routing[path] = index.detach().clone()
        handles.append(model.get_submodule(layer.path).register_forward_pre_hook(keep, with_kwargs=True))
    try:
        with torch.no_grad():
            model(*inputs, **kwargs)
    finally:
        for handle in handles:
            handle.remove()
    return routing


def check_routing(routing: Optional[Dict[str, torch.Tensor]], costs: List[ExpertsCallCost], strategy) -> None:
    """A routing names every experts layer and gives each the indices of the global batch."""
    if routing is None:
        return
    paths = {cost.path for cost in costs}
    unknown = sorted(set(routing) - paths)
    missing = sorted(paths - set(routing))
    if unknown or missing:
        raise ValueError(
            f"gp.plan(routing=...) names {sorted(routing)}, but the experts layers Strategy.ep splits are "
            f"{sorted(paths)}: a routing gives one top_k_index per experts layer (unknown: {unknown}, "
            f"missing: {missing}). Fix: pass graphpar.planner.expert_plan.record_routing(model, x) of the "
            f"global batch x.")
    for cost in costs:
        index = routing[cost.path]
        rows = cost.tokens * strategy.microbatches * strategy.dp
        if tuple(index.shape) != (rows, cost.k) or index.dtype.is_floating_point:
            raise ValueError(
                f"gp.plan(routing=...)[{cost.path!r}] is {index.dtype}{list(index.shape)}, but a routing holds "
                f"the integer top_k_index of the global batch: [{rows}, {cost.k}] ({cost.tokens} tokens per "
                f"microbatch x {strategy.microbatches} microbatches x dp={strategy.dp}, {cost.k} experts each). "
                f"Fix: record it with record_routing(model, x) on the whole batch the dp ranks split.")


def _received(cost: ExpertsCallCost, routing, strategy, mesh: Mesh, microbatch: int) -> int:
    """Pairs this rank's experts get in one microbatch: from each dp rank of its ep group,
    those whose expert is in its block."""
    tokens = _dispatched(cost, strategy)
    if routing is None or strategy.ep == 1:
        return tokens * cost.k
    share = cost.experts // strategy.ep
    index = routing[cost.path]
    total = 0
    for member in mesh.ranks_along("ep"):
        dp_rank, tp_rank = Mesh(strategy.dp, strategy.tp, strategy.pp, member).dp_rank, member % strategy.tp
        start = (dp_rank * strategy.microbatches + microbatch) * cost.tokens
        start += tp_rank * tokens if strategy.expert_tp == 1 else 0
        block = torch.div(index[start:start + tokens], share, rounding_mode="floor")
        total += int((block == mesh.ep_rank).sum())
    return total


def _dispatched(cost: ExpertsCallCost, strategy) -> int:
    """The tokens a rank dispatches per call: its 1/tp share with whole experts, its replica's
    all with expert tensor parallelism."""
    return cost.tokens // strategy.tp if strategy.expert_tp == 1 else cost.tokens


def expert_moves(costs: List[ExpertsCallCost], routing, strategy,
                 mesh: Mesh) -> List[Tuple[str, str, int, int, str]]:
    """(op, axis, bytes, calls, what) of a rank's transfers for its experts layers in one
    training step (its stages' experts layers `costs`, every microbatch)."""
    if not costs:
        return []
    counts = rows = calls = gathered = gathers = summed = sums = 0
    pieces = strategy.expert_tp > 1
    for cost in costs:
        pairs = _dispatched(cost, strategy) * cost.k
        if strategy.tp > 1 and not pieces:
            gathered += strategy.microbatches * cost.tokens * cost.row_bytes * (cost.k + cost.backward_rows)
            gathers += strategy.microbatches * (1 + cost.backward_rows)
        for microbatch in range(strategy.microbatches):
            received = _received(cost, routing, strategy, mesh, microbatch)
            if pieces:
                summed += received * cost.row_bytes * (1 + cost.backward_rows)
                sums += 1 + cost.backward_rows
            if strategy.ep == 1:
                continue
            counts += strategy.ep * COUNT_BYTES
            rows += (2 * pairs + received) * cost.row_bytes + pairs * cost.index_bytes
            calls += 4
            if cost.backward_rows:
                rows += received * cost.row_bytes
                calls += 1
    routed = "the given routing" if routing is not None else "balanced routing: each rank receives what it sends"
    per = len(costs) * strategy.microbatches
    moves = [("all_to_all", "ep", counts, per, "expert token counts per rank"),
             ("all_to_all", "ep", rows, calls, f"expert dispatch and combine, forward and backward ({routed})")]
    return ((moves if strategy.ep > 1 else [])
            + ([("all_gather", "tp", gathered, gathers, "expert outputs of each tp rank's tokens (and their "
                 "gradients)")] if gathers else [])
            + ([("all_reduce", "tp", summed, sums, "expert tensor parallelism: the experts' partial outputs "
                 f"(and the received rows' gradients) summed over tp ({routed})")] if sums else []))

