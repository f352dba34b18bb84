"""Automatic strategy: enumerate, reject with a reason, rank by a cost model, explain.

    result = graphpar.planner.auto.search(model, world_size=8, example_inputs=(x,), loss_fn=...,
                                  memory_budget=2 * 2**30)
    print(result.to_text())

Candidates: every dp x tp x pp = world size, microbatches that divide the local batch, the
schedules (GPipe, 1F1B; interleaved 1F1B with two chunks per rank where stages allow), the
optimizer on the device or on the host (offload_optimizer), and at dp > 1 every ZeRO stage
Strategy accepts with that layout (zero=3 joins when Strategy accepts it; zero > 0 at dp = 1 shards
nothing and is left out).
Each is planned (graphpar.plan; the analysis is shared by every candidate with the same tp
degree and microbatch size) and either rejected with its reason (an illegal degree, a size
tp does not divide, a partition with too few layers, over the memory budget) or costed:

    compute  = 6 * (parameter elements on the busiest rank) * (tokens per dp rank) / flops
               (at zero=3 the weights it computes with: dp times its shard)
               (forward 2, backward 4 FLOPs per parameter per token: the standard estimate)
    comms    = sum over that rank's transfers of (alpha * calls + sent / beta), the host
               transfers (gradients out, weights back) included; `sent` is what the rank
               sends of the plan's bytes over a group of g ranks with ring algorithms:
               all-reduce 2 (g - 1) / g, reduce-scatter and all-gather (g - 1) / g of the
               buffer, a point-to-point or host transfer all of it. So ZeRO-1's
               reduce-scatter and all-gather send what plain dp's all-reduce sends, and
               ZeRO-3's two all-gathers and reduce-scatter 1.5 times it
    bubble   = compute * b / (1 - b), b the schedule's bubble fraction
    host     = 2 * (the rank's host bytes) / host_bandwidth: the host step reads and writes
               the masters and optimizer states once (not credited with overlapping backward)
    cost     = compute + comms + bubble + host      seconds per step

Peak bytes are the device's (host memory is assumed plentiful), so a memory budget is what
makes offloading win: it costs host time and transfers and saves device bytes.

The lowest cost wins; ties go to the smaller (tp, pp, microbatches) in that order, so the
output is deterministic. The winner is explained term by term against the runner-up, and its
ZeRO stage against the other stages of the same layout (over the budget by how many bytes,
or what each would cost more or less), and, when no zero=0 strategy meets the budget, by how
much the closest one misses it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.utils._pytree as pytree

from graphpar.runtime.single_stage import batch_size
from graphpar.runtime.zero import check_zero_optimizer
from graphpar.planner.plan import RankPlan, Report, Transfer, unit_analysis, report_from
from graphpar.strategy import ZERO_STAGES, Strategy

DEFAULT_FLOPS = 50e9          # a CPU core's order of magnitude; pass the device's own
DEFAULT_ALPHA = 20e-6         # seconds per collective call (latency)
DEFAULT_BETA = 5e9            # bytes per second (link bandwidth)
DEFAULT_HOST_BANDWIDTH = 10e9  # bytes per second the host step streams (DRAM, a few cores)


@dataclass
class Candidate:
    strategy: Strategy
    cost: Optional[float] = None
    terms: Dict[str, float] = field(default_factory=dict)
    reason: str = ""           # why it was rejected; empty when it is legal

    def label(self) -> str:
        s = self.strategy
        return f"dp={s.dp} tp={s.tp} pp={s.pp} microbatches={s.microbatches} {s.schedule}" + (
            f" x{s.virtual_stages}" if s.virtual_stages > 1 else "") + (" offload" if s.offload_optimizer else "") + (
            f" zero={s.zero}" if s.zero else "")

    def layout(self) -> Tuple:
        """Everything but the ZeRO stage."""
        s = self.strategy
        return (s.dp, s.tp, s.pp, s.microbatches, s.schedule, s.virtual_stages, s.offload_optimizer)


@dataclass
class SearchResult:
    best: Optional[Candidate]
    candidates: List[Candidate]
    memory_budget: Optional[int] = None

    def to_text(self) -> str:
        legal = sorted((c for c in self.candidates if not c.reason), key=_order)
        lines = [f"{len(legal)} legal strategies of {len(self.candidates)}; cost = compute + comms + bubble "
                 f"(seconds per step, cost model in graphpar/planner/auto.py)", "",
                 "| strategy | cost | compute | comms | bubble | host | peak bytes |",
                 "|---|---:|---:|---:|---:|---:|---:|"]
        for c in legal:
            t = c.terms
            lines.append(f"| {c.label()} | {c.cost:.4g} | {t['compute']:.4g} | {t['comms']:.4g} | "
                         f"{t['bubble']:.4g} | {t['host']:.4g} | {int(t['peak_bytes']):,} |")
        rejected = [c for c in self.candidates if c.reason]
        if rejected:
            lines += ["", "rejected:"] + [f"  {c.label()}: {c.reason}" for c in rejected]
        lines += ["", self.explain()]
        return "\n".join(lines)

    def explain(self) -> str:
        if self.best is None:
            return "no legal strategy: see the reasons above."
        legal = sorted((c for c in self.candidates if not c.reason), key=_order)
        lines = [f"winner: {self.best.label()} at {self.best.cost:.4g} s/step"]
        if len(legal) > 1:
            second = legal[1]
            diffs = ", ".join(f"{k} {self.best.terms[k] - second.terms[k]:+.3g} s"
                              for k in ("compute", "comms", "bubble", "host"))
            lines.append(f"  vs runner-up {second.label()} ({second.cost:.4g} s/step): {diffs}")
        return "\n".join(lines + self._zero_stage())

    def _zero_stage(self) -> List[str]:
        """Why the winner has its ZeRO stage: the other stages of its layout, and whether any
        zero=0 strategy meets the budget."""
        best = self.best
        lines = []
        unsharded = [c for c in self.candidates if c.strategy.zero == 0 and c.terms]
        if best.strategy.zero and self.memory_budget is not None and unsharded and all(
                c.reason for c in unsharded):
            closest = min(unsharded, key=lambda c: c.terms["peak_bytes"])
            lines.append(f"  zero={best.strategy.zero} because no zero=0 strategy meets the memory budget of "
                         f"{self.memory_budget:,} bytes: the closest, {closest.label()}, is over it by "
                         f"{int(closest.terms['peak_bytes']) - self.memory_budget:,} bytes")
        for other in sorted((c for c in self.candidates if c.layout() == best.layout() and c is not best),
                            key=lambda c: c.strategy.zero):
            lines.append(f"  zero={other.strategy.zero} with the same layout: {self._against_best(other)}")
        return lines

    def _against_best(self, other: Candidate) -> str:
        best = self.best
        if not other.terms:
            return other.reason
        peak = int(other.terms["peak_bytes"])
        held = f"peak {peak:,} bytes ({peak - int(best.terms['peak_bytes']):+,} against the winner)"
        comms = f"comms {other.terms['comms'] - best.terms['comms']:+.3g} s"
        if other.reason:   # over the budget: planned and costed, but not legal
            return (f"{held}, over the memory budget by {peak - self.memory_budget:,} bytes "
                    f"({comms}/step against the winner)")
        host = f"host {other.terms['host'] - best.terms['host']:+.3g} s"
        return f"{held}, fits, costs {other.cost - best.cost:+.3g} s/step against the winner ({comms}, {host})"


def _order(c: Candidate) -> Tuple:
    s = c.strategy
    return (c.cost, s.tp, s.pp, s.microbatches, s.schedule, s.virtual_stages, s.dp, s.offload_optimizer, s.zero)


def _divisors(n: int) -> List[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidates(world_size: int, global_batch: int) -> List[Strategy]:
    found = []
    for tp in _divisors(world_size):
        for pp in _divisors(world_size // tp):
            dp = world_size // (tp * pp)
            local = global_batch // dp if global_batch % dp == 0 else 0
            for m in (_divisors(local) if local else [1]):
                for schedule, virtual in _schedules(pp, m):
                    for offload in (False, True):
                        layout = dict(dp=dp, tp=tp, pp=pp, microbatches=m, schedule=schedule,
                                      virtual_stages=virtual, offload_optimizer=offload)
                        found += _with_zero_stages(layout)
    return found


def _with_zero_stages(layout: Dict[str, Any]) -> List[Strategy]:
    """The layout at every ZeRO stage Strategy accepts with it (a stage it refuses, not built
    yet or not with this layout, is no candidate; zero > 0 at dp = 1 shards nothing)."""
    found = [Strategy(**layout)]
    for zero in ZERO_STAGES[1:] if layout["dp"] > 1 else ():
        try:
            found.append(Strategy(zero=zero, **layout))
        except ValueError:
            continue
    return found


def _schedules(pp: int, m: int) -> List[Tuple[str, int]]:
    if pp == 1:
        return [("1f1b", 1)] if m == 1 else []
    options = [("gpipe", 1), ("1f1b", 1)]
    if m % pp == 0:
        options.append(("interleaved-1f1b", 2))
    return options


# What a rank sends of a collective's bytes (the plan's: the buffer reduced, read or filled)
# over g ranks with the ring algorithms.
_SENT_SHARE = {"all_reduce": lambda g: 2 * (g - 1) / g, "reduce_scatter": lambda g: (g - 1) / g,
               "all_gather": lambda g: (g - 1) / g}


def sent_bytes(transfer: Transfer, strategy: Dict[str, Any], world_size: int) -> float:
    """The bytes a rank sends for one of its transfers (point-to-point and host ones: all)."""
    share = _SENT_SHARE.get(transfer.op)
    if share is None:
        return float(transfer.bytes)
    # a tied weight is summed over the pp ranks that read it: two for an embedding tied to the head
    group = {"dp": strategy["dp"], "tp": strategy["tp"], "world": world_size, "tied": 2}[transfer.axis]
    return transfer.bytes * share(group)


def cost_of(report: Report, tokens_per_dp_rank: int, flops: float, alpha: float, beta: float,
            host_bandwidth: float = DEFAULT_HOST_BANDWIDTH) -> Dict[str, float]:
    busiest: RankPlan = max(report.ranks, key=lambda r: r.param_bytes)
    sharded = report.strategy["dp"] if report.strategy["zero"] == 3 else 1   # zero=3 computes with gathered weights
    elements = busiest.param_bytes * sharded / 4
    compute = 6 * elements * tokens_per_dp_rank / flops
    comms = sum(alpha * t.count + sent_bytes(t, report.strategy, report.world_size) / beta
                for t in busiest.collectives)
    bubble = compute * report.bubble_fraction / (1 - report.bubble_fraction)
    host = 2 * max(r.host_bytes for r in report.ranks) / host_bandwidth
    peak = max(r.total_bytes for r in report.ranks)
    return {"compute": compute, "comms": comms, "bubble": bubble, "host": host, "peak_bytes": float(peak)}


def search(model: torch.nn.Module, world_size: int, example_inputs, loss_fn: Optional[Callable] = None,
           optimizer: Optional[Callable] = None, example_target: Any = None, memory_budget: Optional[int] = None,
           flops: float = DEFAULT_FLOPS, alpha: float = DEFAULT_ALPHA, beta: float = DEFAULT_BETA,
           host_bandwidth: float = DEFAULT_HOST_BANDWIDTH, **options) -> SearchResult:
    """example_inputs / example_target: the GLOBAL batch (every candidate splits it over dp)."""
    flat, spec = pytree.tree_flatten(tuple(example_inputs))
    global_batch = batch_size(flat, "example_inputs")
    tokens = sum(t.numel() for t in flat if isinstance(t, torch.Tensor))
    analyses: Dict[Tuple[int, int], Any] = {}
    results = []
    for strategy in candidates(world_size, global_batch):
        candidate = Candidate(strategy)
        results.append(candidate)
        dp, tp, m = strategy.dp, strategy.tp, strategy.microbatches
        if global_batch % dp:
            candidate.reason = f"the global batch of {global_batch} does not split over dp={dp}"
            continue
        local = [_slice(v, global_batch // dp) for v in flat]
        try:
            check_zero_optimizer(optimizer, strategy)   # zero > 0 steps pieces: elementwise optimizers only
            key = (tp, global_batch // dp // m)
            if key not in analyses:
                analyses[key] = unit_analysis(model, candidate.strategy, pytree.tree_unflatten(local, spec), loss_fn,
                                          _slice(example_target, global_batch // dp), world_size, options)
            report = report_from(analyses[key], model, candidate.strategy, world_size, optimizer, options)
        except (ValueError, NotImplementedError) as exc:
            candidate.reason = str(exc).splitlines()[0]
            continue
        candidate.terms = cost_of(report, tokens // dp, flops, alpha, beta, host_bandwidth)
        if memory_budget is not None and candidate.terms["peak_bytes"] > memory_budget:
            peak = int(candidate.terms["peak_bytes"])
            candidate.reason = (f"over the memory budget by {peak - memory_budget:,} bytes: {peak:,} bytes on the "
                                f"busiest rank > {memory_budget:,}")
            continue
        candidate.cost = sum(candidate.terms[k] for k in ("compute", "comms", "bubble", "host"))
    legal = sorted((c for c in results if not c.reason), key=_order)
    return SearchResult(legal[0] if legal else None, results, memory_budget)


def _slice(value, n: int):
    if isinstance(value, torch.Tensor) and value.dim() > 0:
        return value[:n]
    return value
