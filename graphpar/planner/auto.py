"""Automatic strategy: enumerate, reject with a reason, rank by a cost model, explain.

    result = graphpar.planner.auto.search(model, world_size=8, example_inputs=(x,), loss_fn=...,
                                  memory_budget=2 * 2**30)
    print(result.to_text())

Candidates: every dp x tp x pp = world size, microbatches that divide the local batch, the
schedules (GPipe, 1F1B; interleaved 1F1B with two chunks per rank where stages allow), the
optimizer on the device or on the host (offload_optimizer), at dp > 1 every ZeRO stage
Strategy accepts with that layout (zero=3 joins when Strategy accepts it; zero > 0 at dp = 1 shards
nothing and is left out), for a model with mixture-of-experts layers every expert-parallel
degree > 1 dividing both dp * tp and the experts per layer that Strategy accepts with the
layout, at each ZeRO stage it accepts with it (planned with balanced routing: graphpar/planner/expert_plan.py), and, only when
there is a memory budget, activation recomputation.
Recomputation only adds compute, so without a budget no recompute candidate can win and none
is planned (each mode is an analysis of its own and a plan of each layout: time spent for
nothing). With a budget, every layout that misses it without recomputation is planned with
"selective" and "full" too (where the layout meets it without, that candidate costs no more
than any recomputing one); then, for the layouts that meet the budget with "full", the
fraction of its activations that fits (recompute=<float>, in thousandths: the pass keeps the
calls that spare the most recompute per byte, so it recomputes no more than "full"), cheapest
first and only while that layout's cost without recomputation, a lower bound of its cost with
any, is below the best legal cost found: a few more analyses, not one per layout.
Each is planned (graphpar.plan; the analysis is shared by every candidate with the same tp
degree, microbatch size and recompute mode) and either rejected with its reason (an illegal
degree, a size tp does not divide, a partition with too few layers, a recompute mode on a
model with no blocks to recompute, over the memory budget) or costed:

    compute  = (6 * (parameter elements on the busiest rank) * (tokens per dp rank)
                + (the busiest rank's recompute_flops)) / flops
               (at zero=3 the weights it computes with: dp times its shard)
               (forward 2, backward 4 FLOPs per parameter per token: the standard estimate;
               recompute_flops: the forward flops its backward runs again per step, as the
               recompute pass counts them; the busiest rank is the one with the most of
               these flops, without recomputation the one with the most parameter bytes)
    comms    = sum over that rank's transfers of (alpha * calls + sent / beta), the host
               transfers (gradients out, weights back) included; `sent` is what the rank
               sends of the plan's bytes over a group of g ranks with ring algorithms:
               all-reduce 2 (g - 1) / g, reduce-scatter and all-gather (g - 1) / g of the
               buffer, a point-to-point or host transfer all of it. So ZeRO-1's
               reduce-scatter and all-gather send what plain dp's all-reduce sends, and
               ZeRO-3's two all-gathers and reduce-scatter 1.5 times it
    bubble   = compute * b / (1 - b), b the schedule's bubble fraction
    host     = 2 * (the most host bytes of a rank) / host_bandwidth: the host step reads and
               writes the masters and optimizer states once (not credited with overlapping
               backward)
    cost     = compute + comms + bubble + host      seconds per step

With a `calibration` (graphpar.auto.calibrate(): this machine's measured throughput, links
and executor overheads) the calibrated time model of graphpar/planner/time_model.py costs
each candidate instead: per-unit, per-microbatch and per-step overheads, the pipeline
simulated with per-stage costs, gradient reduction overlapping the last backward, ZeRO's
and the optimizer step's measured costs (terms compute, overhead, comms, bubble, host).

Peak bytes are the device's (host memory is assumed plentiful), so a memory budget is what
makes offloading win: it costs host time and transfers and saves device bytes.

The lowest cost wins; ties go to the smaller (tp, pp, microbatches) in that order, and no
recomputation before a named mode before a fraction, so the output is deterministic. The
winner is explained term by term against the runner-up; its ZeRO stage against the other
stages of the same layout (over the budget by how many bytes, or what each would cost more or
less) and, when no zero=0 strategy meets the budget, by how much the closest one misses it;
when it recomputes, its recompute mode likewise against the other modes of its layout, and
either by how much the closest strategy without recomputation misses the budget or, when one
meets it, what the cheapest such costs against the winner, with the flops it runs again.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.utils._pytree as pytree

from graphpar.runtime.single_stage import batch_size
from graphpar.runtime.zero import check_zero_optimizer
from graphpar.planner.calibrate import calibrate  # noqa: F401 (graphpar.auto.calibrate)
from graphpar.planner.calibration import SENT_SHARE, Calibration
from graphpar.planner.expert_plan import experts_per_layer
from graphpar.planner.plan import RankPlan, Report, Transfer, unit_analysis, report_from
from graphpar.planner.time_model import TERMS, group_size, step_time
from graphpar.strategy import RECOMPUTE_MODES, ZERO_STAGES, Strategy

DEFAULT_FLOPS = 50e9          # a CPU core's order of magnitude; pass the device's own
DEFAULT_ALPHA = 20e-6         # seconds per collective call (latency)
DEFAULT_BETA = 5e9            # bytes per second (link bandwidth)
DEFAULT_HOST_BANDWIDTH = 10e9  # bytes per second the host step streams (DRAM, a few cores)


# The Strategy fields the search sets, in the order that breaks ties of cost
SEARCHED = ("tp", "pp", "microbatches", "schedule", "virtual_stages", "dp", "offload_optimizer", "zero", "ep",
            "recompute")


def settings_but(strategy: Strategy, name: str) -> Tuple:
    """The searched settings but one."""
    return tuple(getattr(strategy, f) for f in SEARCHED if f != name)


@dataclass
class Candidate:
    strategy: Strategy
    cost: Optional[float] = None
    terms: Dict[str, float] = field(default_factory=dict)
    reason: str = ""           # why it was rejected; empty when it is legal
    fits_at: Optional[float] = None   # recompute=None over the budget: the fraction of its activations that fits
    measured: Optional[float] = None  # seconds per step when it was run (graphpar plan --auto --measure)

    def label(self) -> str:
        s = self.strategy
        return f"dp={s.dp} tp={s.tp} pp={s.pp} microbatches={s.microbatches} {s.schedule}" + (
            f" x{s.virtual_stages}" if s.virtual_stages > 1 else "") + (" offload" if s.offload_optimizer else "") + (
            f" zero={s.zero}" if s.zero else "") + (f" ep={s.ep}" if s.ep > 1 else "") + (
            f" recompute={s.recompute}" if s.recompute is not None else "")

    def all_but(self, name: str) -> Tuple:
        return settings_but(self.strategy, name)

    def layout(self) -> Tuple:
        """Everything but the ZeRO stage."""
        return self.all_but("zero")


@dataclass
class SearchResult:
    best: Optional[Candidate]
    candidates: List[Candidate]
    memory_budget: Optional[int] = None

    def to_text(self) -> str:
        legal = sorted((c for c in self.candidates if not c.reason), key=_order)
        terms = _shown(legal)
        # the recompute share of compute gets a column where some legal strategy recomputes
        recompute = ("of which recompute | ", "---:|") if any(c.terms["recompute"] for c in legal) else ("", "")
        measured = any(c.measured is not None for c in legal)
        model = ("calibrated cost model in graphpar/planner/time_model.py" if "overhead" in terms
                 else "cost model in graphpar/planner/auto.py")
        lines = [f"{len(legal)} legal strategies of {len(self.candidates)}; cost = {' + '.join(terms)} "
                 f"(seconds per step, {model})", "",
                 "| strategy | cost | " + ("measured | error | " if measured else "")
                 + " | ".join(terms[:1]) + " | " + recompute[0] + " | ".join(terms[1:]) + " | peak bytes |",
                 "|---|---:|" + ("---:|---:|" if measured else "") + "---:|" + recompute[1]
                 + "---:|" * (len(terms) - 1) + "---:|"]
        for c in legal:
            t = c.terms
            lines.append(f"| {c.label()} | {c.cost:.4g} | " + (_measured_cells(c) if measured else "")
                         + f"{t[terms[0]]:.4g} | " + (f"{t['recompute']:.4g} | " if recompute[0] else "")
                         + "".join(f"{t[k]:.4g} | " for k in terms[1:]) + f"{int(t['peak_bytes']):,} |")
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
                              for k in _shown(legal))
            lines.append(f"  vs runner-up {second.label()} ({second.cost:.4g} s/step): {diffs}")
        return "\n".join(lines + self._zero_stage() + self._recompute())

    def _zero_stage(self) -> List[str]:
        """Why the winner has its ZeRO stage: the other stages of its layout, and whether any
        zero=0 strategy meets the budget."""
        best = self.best
        lines = []
        if best.strategy.zero:
            closest = self._closest_over_budget(lambda c: c.strategy.zero == 0)
            if closest is not None:
                lines.append(f"  zero={best.strategy.zero} because no zero=0 strategy meets the memory budget of "
                             f"{self.memory_budget:,} bytes: the closest, {closest.label()}, is over it by "
                             f"{int(closest.terms['peak_bytes']) - self.memory_budget:,} bytes")
        for other in sorted(self._same_but("zero"), key=lambda c: c.strategy.zero):
            lines.append(f"  zero={other.strategy.zero} with the same layout: "
                         f"{self._against_best(other, ('comms', 'host'))}")
        return lines

    def _recompute(self) -> List[str]:
        """Why the winner recomputes what it does: the other modes of its layout, and either
        that no strategy without recomputation meets the budget or what the cheapest one that
        does costs against the winner."""
        best = self.best
        mode = best.strategy.recompute
        lines = []
        if mode is not None:
            runs = (f"runs {best.terms['recompute_flops'] / 1e6:.3g} MFLOP of forward again per step "
                    f"({best.terms['recompute']:.3g} s)")
            what = (f"it keeps {mode:g} of its activations, the most that fits the budget (in thousandths), and {runs}"
                    if isinstance(mode, float) else f"it {runs}")
            closest = self._closest_over_budget(lambda c: c.strategy.recompute is None)
            fitting = [c for c in self.candidates if c.strategy.recompute is None and not c.reason]
            if closest is not None:
                lines.append(f"  recompute={mode} because no strategy without recomputation meets the memory budget "
                             f"of {self.memory_budget:,} bytes: the closest, {closest.label()}, is over it by "
                             f"{int(closest.terms['peak_bytes']) - self.memory_budget:,} bytes; {what}")
            elif fitting:   # the winner's own layout without recomputation is over (it would cost less)
                cheapest = min(fitting, key=_order)
                lines.append(f"  recompute={mode} because without recomputation this layout is over the memory "
                             f"budget, and the cheapest strategy without recomputation, {cheapest.label()}, costs "
                             f"{cheapest.cost - best.cost:+.3g} s/step against the winner; {what}")
        for other in sorted(self._same_but("recompute"), key=lambda c: _recompute_order(c.strategy.recompute)):
            lines.append(f"  recompute={other.strategy.recompute} with the same layout: "
                         f"{self._against_best(other, ('recompute',))}")
        return lines

    def _same_but(self, name: str) -> List[Candidate]:
        """The candidates that differ from the winner in setting `name` only."""
        return [c for c in self.candidates if c is not self.best and c.all_but(name) == self.best.all_but(name)]

    def _closest_over_budget(self, kind: Callable[[Candidate], bool]) -> Optional[Candidate]:
        """When every planned candidate of a kind is over the memory budget, the one that
        misses it by the least; None when one meets it (or there is no budget)."""
        planned = [c for c in self.candidates if kind(c) and c.terms]
        if self.memory_budget is None or not planned or not all(c.reason for c in planned):
            return None
        return min(planned, key=lambda c: c.terms["peak_bytes"])

    def _against_best(self, other: Candidate, terms: Tuple[str, ...]) -> str:
        best = self.best
        over = bool(other.terms) and self.memory_budget is not None and other.terms["peak_bytes"] > self.memory_budget
        if other.reason and not over:
            return other.reason
        peak = int(other.terms["peak_bytes"])
        held = f"peak {peak:,} bytes ({peak - int(best.terms['peak_bytes']):+,} against the winner)"
        diffs = ", ".join(f"{k} {other.terms[k] - best.terms[k]:+.3g} s" for k in terms)
        if over:   # planned and costed, but not legal
            return (f"{held}, over the memory budget by {peak - self.memory_budget:,} bytes "
                    f"({diffs}/step against the winner)")
        return f"{held}, fits, costs {other.cost - best.cost:+.3g} s/step against the winner ({diffs})"


def _measured_cells(c: Candidate) -> str:
    """Measured step time and the prediction's error relative to it ("-" where not run)."""
    if c.measured is None:
        return "- | - | "
    return f"{c.measured:.4g} | {(c.cost - c.measured) / c.measured:+.0%} | "


def _shown(candidates: List[Candidate]) -> Tuple[str, ...]:
    """The terms to show: overhead only where the calibrated model gave some."""
    return tuple(k for k in TERMS if k != "overhead" or any(c.terms.get(k) for c in candidates))


def _recompute_order(mode) -> Tuple:
    """No recomputation first, then the modes by name, then a fraction."""
    return (mode is not None, isinstance(mode, float), str(mode))


def _order(c: Candidate) -> Tuple:
    key = [getattr(c.strategy, f) for f in SEARCHED]
    key[-1] = _recompute_order(key[-1])
    return (c.cost, *key)


def _divisors(n: int) -> List[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidates(world_size: int, global_batch: int, recompute: Tuple = (None,), experts: int = 0) -> List[Strategy]:
    """Every layout, with every ZeRO stage and every mode of `recompute`, and for a model with
    `experts` per MoE layer every expert-parallel degree."""
    found = []
    for tp in _divisors(world_size):
        for pp in _divisors(world_size // tp):
            dp = world_size // (tp * pp)
            local = global_batch // dp if global_batch % dp == 0 else 0
            for m in (_divisors(local) if local else [1]):
                for schedule, virtual in _schedules(pp, m):
                    for offload in (False, True):
                        for mode in recompute:
                            layout = dict(dp=dp, tp=tp, pp=pp, microbatches=m, schedule=schedule,
                                          virtual_stages=virtual, offload_optimizer=offload, recompute=mode)
                            found += _with_zero_stages(layout) + _with_expert_degrees(layout, experts)
    return found


def _with_expert_degrees(layout: Dict[str, Any], experts: int) -> List[Strategy]:
    """The layout at every ep > 1 that divides dp * tp and the experts per layer, with every
    ZeRO stage, where Strategy accepts it."""
    found = []
    for ep in _divisors(math.gcd(layout["dp"] * layout["tp"], experts))[1:] if experts else ():
        try:
            Strategy(ep=ep, **layout)
        except ValueError:
            continue
        found += _with_zero_stages({**layout, "ep": ep})
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


def sent_bytes(transfer: Transfer, strategy: Dict[str, Any], world_size: int) -> float:
    """The bytes a rank sends for one of its transfers (point-to-point and host ones: all)."""
    share = SENT_SHARE.get(transfer.op)
    if share is None:
        return float(transfer.bytes)
    return transfer.bytes * share(group_size(transfer, strategy, world_size))


def cost_of(report: Report, tokens_per_dp_rank: int, flops: float, alpha: float, beta: float,
            host_bandwidth: float = DEFAULT_HOST_BANDWIDTH, calibration: Optional[Calibration] = None
            ) -> Dict[str, float]:
    """The terms of a plan's cost: with a calibration the calibrated model
    (graphpar/planner/time_model.py), without one the fixed-constant model above."""
    if calibration is not None:
        return _with_bytes(step_time(report, tokens_per_dp_rank, calibration), report)
    sharded = report.strategy["dp"] if report.strategy["zero"] == 3 else 1   # zero=3 computes with gathered weights

    def step_flops(rank: RankPlan) -> float:
        return 6 * rank.param_bytes * sharded / 4 * tokens_per_dp_rank + rank.recompute_flops

    busiest = max(report.ranks, key=step_flops)   # without recomputation: the most parameter bytes
    compute = step_flops(busiest) / flops
    comms = sum(alpha * t.count + sent_bytes(t, report.strategy, report.world_size) / beta
                for t in busiest.collectives if t.op != "recv")   # a receive: the time of its send
    bubble = compute * report.bubble_fraction / (1 - report.bubble_fraction)
    host = 2 * max(r.host_bytes for r in report.ranks) / host_bandwidth
    peak = max(r.total_bytes for r in report.ranks)
    return {"compute": compute, "comms": comms, "bubble": bubble, "host": host, "overhead": 0.0,
            "peak_bytes": float(peak), "recompute": busiest.recompute_flops / flops,
            "recompute_flops": busiest.recompute_flops}


def _with_bytes(terms: Dict[str, float], report: Report) -> Dict[str, float]:
    """The calibrated terms with the plan's peak bytes and recompute flops beside them."""
    busiest = max(report.ranks, key=lambda r: r.recompute_flops)
    return {**terms, "peak_bytes": float(max(r.total_bytes for r in report.ranks)),
            "recompute_flops": busiest.recompute_flops}


def search(model: torch.nn.Module, world_size: int, example_inputs, loss_fn: Optional[Callable] = None,
           optimizer: Optional[Callable] = None, example_target: Any = None, memory_budget: Optional[int] = None,
           flops: float = DEFAULT_FLOPS, alpha: float = DEFAULT_ALPHA, beta: float = DEFAULT_BETA,
           host_bandwidth: float = DEFAULT_HOST_BANDWIDTH, calibration: Optional[Calibration] = None,
           **options) -> SearchResult:
    """example_inputs / example_target: the GLOBAL batch (every candidate splits it over dp).
    calibration: a Calibration (graphpar.auto.calibrate()) for the calibrated time model;
    without one the fixed constants flops, alpha, beta and host_bandwidth cost each candidate."""
    flat, spec = pytree.tree_flatten(tuple(example_inputs))
    global_batch = batch_size(flat, "example_inputs")
    tokens = sum(t.numel() for t in flat if isinstance(t, torch.Tensor))
    analyses: Dict[Tuple[int, int, Any], Any] = {}

    def planned(strategy: Strategy) -> Candidate:
        candidate = Candidate(strategy)
        dp, tp, m = strategy.dp, strategy.tp, strategy.microbatches
        if global_batch % dp:
            candidate.reason = f"the global batch of {global_batch} does not split over dp={dp}"
            return candidate
        local = [_slice(v, global_batch // dp) for v in flat]
        try:
            check_zero_optimizer(optimizer, strategy)   # zero > 0 steps pieces: elementwise optimizers only
            # what the recompute pass outlines and keeps; with ep, the experts layers' calls
            key = (tp, global_batch // dp // m, strategy.recompute, strategy.ep > 1)
            if key not in analyses:
                analyses[key] = unit_analysis(model, strategy, pytree.tree_unflatten(local, spec), loss_fn,
                                              _slice(example_target, global_batch // dp), world_size, options)
            report = report_from(analyses[key], model, strategy, world_size, optimizer, options)
        except (ValueError, NotImplementedError) as exc:
            candidate.reason = str(exc).splitlines()[0]
            return candidate
        if strategy.recompute is not None and analyses[key][1].results.recompute is None:
            candidate.reason = (f"recompute={strategy.recompute} recomputes nothing: the model has no repeated blocks "
                                f"(children of an nn.ModuleList or nn.Sequential) to recompute")
            return candidate
        candidate.terms = cost_of(report, tokens // dp, flops, alpha, beta, host_bandwidth, calibration)
        if memory_budget is not None and candidate.terms["peak_bytes"] > memory_budget:
            peak = int(candidate.terms["peak_bytes"])
            candidate.reason = (f"over the memory budget by {peak - memory_budget:,} bytes: {peak:,} bytes on the "
                                f"busiest rank > {memory_budget:,}")
            if strategy.recompute is None:
                candidate.fits_at = fitting_fraction(report, memory_budget)
            return candidate
        candidate.cost = _terms_sum(candidate)
        return candidate

    results = [planned(s) for s in candidates(world_size, global_batch, experts=experts_per_layer(model))]
    if memory_budget is not None:
        results += [planned(s) for s in recompute_candidates(results, world_size, global_batch, memory_budget)]
        results += _fitted_budgets(results, planned)
    legal = sorted((c for c in results if not c.reason), key=_order)
    return SearchResult(legal[0] if legal else None, results, memory_budget)


def recompute_candidates(planned: List[Candidate], world_size: int, global_batch: int,
                         memory_budget: int) -> List[Strategy]:
    """Each named recompute mode of the layouts that `planned` (the candidates without
    recomputation) shows over the budget. Where the layout without recomputation meets it,
    that candidate costs no more than any with recomputation, which only adds compute."""
    over = {c.all_but("recompute") for c in planned if c.terms and c.terms["peak_bytes"] > memory_budget}
    return [s for s in candidates(world_size, global_batch, RECOMPUTE_MODES) if settings_but(s, "recompute") in over]


def fitting_fraction(report: Report, memory_budget: int) -> Optional[float]:
    """The largest fraction of its activations, in thousandths, with which every rank of the
    plan would meet the budget (what it holds besides activations unchanged); None when even
    none would."""
    fractions = [(memory_budget - (r.total_bytes - r.activation_peak_bytes)) / r.activation_peak_bytes
                 for r in report.ranks if r.activation_peak_bytes]
    fraction = math.floor(min(fractions, default=0.0) * 1000) / 1000
    return fraction if fraction > 0 else None


def _fitted_budgets(planned: List[Candidate], plan_one: Callable[[Strategy], Candidate]) -> List[Candidate]:
    """recompute=<fraction> for the layouts that fit the budget with "full" but not without
    recomputation: the fraction of the activations that fits, which recomputes no more than
    "full" (the pass saves the calls that spare the most recompute per byte). Branch and bound:
    a layout is tried only while its cost without recomputation, a lower bound of its cost with
    any, is below the best legal cost so far, cheapest first, so few are planned."""
    best = min((c.cost for c in planned if not c.reason), default=math.inf)
    full = {c.all_but("recompute"): c for c in planned if c.strategy.recompute == "full" and not c.reason}
    options = sorted((c for c in planned if c.strategy.recompute is None and c.fits_at is not None
                      and c.all_but("recompute") in full), key=lambda c: (_terms_sum(c), _order(c)[1:]))
    found = []
    for without in options:
        if _terms_sum(without) >= best:
            break
        fitted = plan_one(Strategy.from_dict({**without.strategy.to_dict(), "recompute": without.fits_at}))
        found.append(fitted)
        if not fitted.reason and (fitted.terms["recompute_flops"]
                                  >= full[without.all_but("recompute")].terms["recompute_flops"]):
            fitted.cost, fitted.reason = None, (f"recompute={without.fits_at} keeps no more than recompute=full: "
                                                f"no call the pass could keep fits in the room it leaves")
        if not fitted.reason:
            best = min(best, fitted.cost)
    return found


def _terms_sum(c: Candidate) -> float:
    """The cost of a costed candidate, legal or over the budget."""
    return sum(c.terms[k] for k in TERMS)


def _slice(value, n: int):
    if isinstance(value, torch.Tensor) and value.dim() > 0:
        return value[:n]
    return value
