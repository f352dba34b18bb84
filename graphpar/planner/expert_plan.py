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

With Strategy.expert_capacity_factor, P is the pairs this rank keeps (graphpar/runtime/experts.py:
each expert takes the first ceil(factor * T * K / E) pairs of a replica's T tokens, the rest are
dropped before the dispatch); the all-gathers over tp carry every pair, dropped ones as zeros.

Only P (with a capacity) and R depend on the routing; R is the pairs of the ep group's tokens
of that microbatch whose expert lives on this rank (and which their expert kept). `routing` maps each experts module's path to the top_k_index
[T_global, K] of the global batch (every dp rank's rows in batch order, each dp rank's
tokens a contiguous block, each microbatch a contiguous block of those, each tp rank's
share a contiguous block of that), as
record_routing() takes it from one forward of the model; without it every rank is taken to
receive as many pairs as it sends (R = P), the mean of any routing, and each expert to get
T * K / E of a replica's pairs (so a capacity drops pairs only below that).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch
import torch.fx

from graphpar.distributed.mesh import Mesh
from graphpar.ir import record
from graphpar.passes.expert_parallel import (ExpertParallelError, check_expert_tp_layout, check_tokens_split,
                                             experts_call, experts_modules, find_experts_layers)
from graphpar.passes.saved_bytes import node_stage
from graphpar.runtime.experts import expert_capacity, first_pairs

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
    greatest common divisor of theirs); 0 without experts layers, or with a container of
    experts that expert parallelism refuses (compile with ep > 1 says why: E-ep-list-*)."""
    try:
        return math.gcd(*(layer.experts for layer in experts_modules(model)))
    except ExpertParallelError:
        return 0


def experts_call_costs(gm: torch.fx.GraphModule, model: torch.nn.Module,
                       strategy) -> Dict[int, List[ExpertsCallCost]]:
    """Unit (the stage tag analyse_units gives each node) -> its experts layers' calls."""
    found: Dict[int, List[ExpertsCallCost]] = {}
    for layer in find_experts_layers(model, gm):
        call = experts_call(gm, layer)
        check_tokens_split(call, strategy)
        check_expert_tp_layout(model.get_submodule(layer.path), layer, strategy.expert_tp)
        hidden, index = record(call.hidden).value, record(call.top_k_index).value
        tokens, k = index.shape[:2]   # (the list layout's one-hot mask: [T, K, E])
        cost = ExpertsCallCost(layer.path, layer.experts, tokens, k, _row_bytes(hidden, tokens, strategy),
                               index.nbytes // index.numel, hidden.requires_grad)
        found.setdefault(node_stage(call.output), []).append(cost)
    return found


def _row_bytes(hidden, tokens: int, strategy) -> int:
    """The bytes of one hidden row the all-to-alls carry: the graph is analysed in fp32, the
    rows travel in the compute dtype (Strategy.param_dtype)."""
    dtype = strategy.param_dtype if strategy.param_dtype is not None and hidden.dtype.is_floating_point else hidden.dtype
    return hidden.numel // tokens * torch.empty((), dtype=dtype).element_size()


def record_routing(model: torch.nn.Module, *inputs, strategy=None, **kwargs) -> Dict[str, torch.Tensor]:
    """Experts module path -> the top_k_index it was called with in one forward of `model`
    on real `inputs` (no gradient): the routing gp.plan(routing=...) counts. With a `strategy`
    whose expert_capacity_factor is set, each experts call drops what graphpar drops (the
    global rows cut into the dp * microbatches blocks a replica routes at a time), so that
    the later layers route the hidden rows graphpar computes."""
    factor = getattr(strategy, "expert_capacity_factor", None)
    routing: Dict[str, torch.Tensor] = {}
    handles = []
    for layer in experts_modules(model):
        def keep(module, args, call_kwargs, path=layer.path, experts=layer.experts):
            index = args[1] if len(args) > 1 else call_kwargs["top_k_index"]
            routing[path] = index.detach().clone()
            if factor is None:
                return None
            blocks = index.split(index.shape[0] // (strategy.dp * strategy.microbatches))
            kept = torch.cat([first_pairs(block, experts, expert_capacity(*block.shape, experts, factor))
                              for block in blocks]).view_as(index)
            if len(args) > 2:
                return (*args[:2], args[2] * kept, *args[3:]), call_kwargs
            return args, {**call_kwargs, "top_k_weights": call_kwargs["top_k_weights"] * kept}
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


def _exchanged(cost: ExpertsCallCost, routing, strategy, mesh: Mesh, microbatch: int) -> Tuple[int, int]:
    """(pairs this rank sends, pairs its experts get) in one microbatch: of the tokens it
    dispatches (its tp share, or with expert_tp its replica's all), those kept past the
    capacity (all without Strategy.expert_capacity_factor); from each rank of its ep group,
    the kept ones whose expert is in its block."""
    tokens = _dispatched(cost, strategy)
    split = strategy.tp if strategy.expert_tp == 1 else 1   # the ranks a replica's pairs are dispatched from
    factor = strategy.expert_capacity_factor
    capacity = None if factor is None else expert_capacity(cost.tokens, cost.k, cost.experts, factor)
    if routing is None or strategy.ep == 1:   # balanced: each expert gets T * K / E of a replica's pairs
        pairs = tokens * cost.k if capacity is None else min(tokens * cost.k, cost.experts * capacity // split)
        return pairs, pairs
    share = cost.experts // strategy.ep
    index = routing[cost.path]
    sent = received = 0
    for member in mesh.ranks_along("ep"):
        dp_rank, tp_rank = Mesh(strategy.dp, strategy.tp, strategy.pp, member).dp_rank, member % strategy.tp
        start = (dp_rank * strategy.microbatches + microbatch) * cost.tokens
        replica = index[start:start + cost.tokens]
        kept = torch.ones_like(replica, dtype=torch.bool) if capacity is None else \
            first_pairs(replica, cost.experts, capacity).view_as(replica)
        first = tp_rank * tokens if split > 1 else 0
        rows = slice(first, first + tokens)
        block = torch.div(replica[rows], share, rounding_mode="floor")
        received += int(((block == mesh.ep_rank) & kept[rows]).sum())
        if member == mesh.rank:
            sent = int(kept[rows].sum())
    return sent, received


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
        if strategy.tp > 1 and not pieces:
            gathered += strategy.microbatches * cost.tokens * cost.row_bytes * (cost.k + cost.backward_rows)
            gathers += strategy.microbatches * (1 + cost.backward_rows)
        for microbatch in range(strategy.microbatches):
            pairs, received = _exchanged(cost, routing, strategy, mesh, microbatch)
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

