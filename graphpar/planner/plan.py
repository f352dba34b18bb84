"""The planner: per-rank memory and communication of a strategy, before anything runs.

    rep = graphpar.plan(model, strategy, example_inputs=(x,), loss_fn=..., optimizer=...,
                        world_size=8)          # no process group; the model may be on meta

It runs the pass pipeline once, for tp rank 0, up to sync_batch_norm: the whole model's
graph with every value's local (tp-sharded) shape. Each unit (layer) is costed once; the
stages of any pp degree are unions of units, and ranks that differ only in their dp or tp
coordinate run the same program, so one analysis serves the whole world. A model whose
main stack holds many identical blocks is analysed with two of them (on a shallow copy of
the model whose block list is cut; the user's model is never changed) and the rest are
copies of the second: planning time does not grow with depth.

    parameters, gradients  local shapes of the parameters each rank's stages read
    optimizer states       elements of state per parameter element and bytes of scalars per
                           parameter tensor, read off the optimizer itself (one step on a
                           small parameter): AdamW 2 and a 4-byte step, SGD with momentum 1,
                           plain SGD 0; elements counted in fp32
    activations            bytes autograd saves for backward in one microbatch of a stage,
                           found by running the program on fake tensors with
                           saved_tensors_hooks (the same autograd, no memory, with
                           Strategy.recompute's regions), held as the rank's schedule holds
                           microbatches (activation_peak)
    transfers per step     every collective and point-to-point transfer the executor issues,
                           from the collective nodes, the cuts, the gradient buckets
"""
from __future__ import annotations

import copy
import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, FrozenSet, List, Optional, Set, Tuple

import torch
import torch.fx

from graphpar.runtime.optimizer import make_optimizer
from graphpar.frontend.compile import lower_rank
from graphpar.runtime.single_stage import forward_only, loss_only
from graphpar.runtime.grad_sync import DEFAULT_BUCKET_BYTES, bucket_spans, summed_gradient_bytes
from graphpar.runtime.shapes import FINGERPRINT_BYTES, checks_replica_shapes
from graphpar.ir import TensorMeta, canonical_keys, last_reader, record
from graphpar.ir.compiled import RecomputePlan
from graphpar.passes.tracing import on_meta
from graphpar.distributed.groups import collective_backend, has_reduce_scatter
from graphpar.distributed.mesh import Mesh, edp_size
from graphpar.passes.partition_policies import Unit, describe_partition, partition
from graphpar.passes.partition_stages import assign_stages, build_units, node_units
from graphpar.passes.expert_parallel import experts_call, experts_modules, find_experts_layers, list_owners
from graphpar.passes.tracing.expert_lists import is_expert_list
from graphpar.planner.expert_plan import ExpertsCallCost, check_routing, expert_moves, experts_call_costs
from graphpar.passes.recompute import apply_recompute
from graphpar.passes.saved_bytes import node_stage, saved_activation_bytes
from graphpar.passes.split_stages import crossings
from graphpar.planner.accounting import OptimizerState, placed_bytes
from graphpar.planner.report_html import mib, plan_html
from graphpar.passes.host_tables import host_embedding_paths
from graphpar.passes.tracing.expert_lists import expert_list_paths
from graphpar.planner.zero_plan import zero_notes, zero_plan
from graphpar.runtime.zero import check_zero_optimizer, zero_active
from graphpar.distributed.mesh import experts_stage
from graphpar.runtime.zero3 import bucket_runs, expert_runs
from graphpar.runtime.pipeline.schedules import build_schedule, splits_backward
from graphpar.runtime.pipeline.simulate import simulate
from graphpar.strategy import Strategy, rank_stages
from graphpar.runtime import collectives
from graphpar.runtime.experts import tp_piece_shape
from graphpar.runtime.recompute import RecomputeRegion
from graphpar.runtime import batch_statistics, sync_batch_norm as sbn

FLOAT64 = 8


@dataclass
class Transfer:
    op: str          # all_reduce | all_gather | reduce_scatter | send | recv
    axis: str        # dp | tp | pp | tied | host | world | edp (expert weights' gradients) | ep (all-to-all)
    bytes: int       # per step, summed over its calls
    count: int       # calls per step
    what: str        # where it comes from


@dataclass
class RankPlan:
    rank: int
    dp_rank: int
    tp_rank: int
    pp_rank: int
    stages: List[int]
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    activation_peak_bytes: int
    host_bytes: int
    collectives: List[Transfer]
    gathered_bytes: int = 0    # zero=3: parameters gathered over dp and in flight at most at once
    recompute_flops: float = 0.0  # Strategy.recompute: forward flops backward runs again, per step
    expert_bytes: int = 0      # Strategy.ep: the bytes of the expert weights it holds (in param_bytes)

    @property
    def total_bytes(self) -> int:
        return (self.param_bytes + self.grad_bytes + self.optimizer_bytes + self.activation_peak_bytes
                + self.gathered_bytes)

    @property
    def transfer_bytes(self) -> int:
        return sum(t.bytes for t in self.collectives)


@dataclass
class Report:
    strategy: Dict[str, Any]
    world_size: int
    ranks: List[RankPlan]
    bubble_fraction: float
    fallbacks: List[Tuple[str, str, str]] = field(default_factory=list)
    partition: str = ""
    replicated_linears: List[Tuple[str, str]] = field(default_factory=list)   # (module, reason)
    notes: List[str] = field(default_factory=list)   # e.g. ZeRO's padding and shares
    # pm.report(): the microbatch shapes this rank has programs for ({"inputs": [...], "target": [...]})
    shapes: List[Dict[str, Any]] = field(default_factory=list)
    # pipeline units (the model's layers, docs/planner.md) of each stage; at pp = 1 one entry
    stage_units: List[int] = field(default_factory=list)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2, default=str)

    def to_text(self) -> str:
        # zero=3's gathered weights in flight get a column where there are any
        gathered = ("gathered | ", "---:|") if any(r.gathered_bytes for r in self.ranks) else ("", "")
        lines = [f"graphpar plan: world {self.world_size}, dp={self.strategy['dp']} tp={self.strategy['tp']} "
                 f"pp={self.strategy['pp']}, microbatches={self.strategy['microbatches']}, "
                 f"schedule {self.strategy['schedule']}; bubble {self.bubble_fraction:.1%}", "",
                 "| rank | dp tp pp | params | grads | optimizer | activations | " + gathered[0] +
                 "device total | host | transfers/step |",
                 "|---:|---|---:|---:|---:|---:|---:|---:|---:|" + gathered[1]]
        for r in self.distinct_ranks():
            lines.append(f"| {r.rank} | {r.dp_rank} {r.tp_rank} {r.pp_rank} | {_mib(r.param_bytes)} | "
                         f"{_mib(r.grad_bytes)} | {_mib(r.optimizer_bytes)} | {_mib(r.activation_peak_bytes)} | "
                         + (f"{_mib(r.gathered_bytes)} | " if gathered[0] else "") +
                         f"{_mib(r.total_bytes)} | {_mib(r.host_bytes)} | {_mib(r.transfer_bytes)} |")
        if len(self.distinct_ranks()) < len(self.ranks):
            lines.append("(one row per role: ranks not listed hold what a listed rank of their pp rank holds)")
        lines += ["", "transfers per step of rank 0:"]
        lines += [f"  {t.op:<10} {t.axis:<5} {t.count:>5} x  {_mib(t.bytes):>10}  {t.what}"
                  for t in self.ranks[0].collectives]
        if self.fallbacks:
            lines += ["", "layers left replicated (no sharding rule):"]
            lines += [f"  {module or '<top>'} ({name}): {reason}" for name, module, reason in self.fallbacks]
        if self.replicated_linears:
            lines += ["", "linears left whole (replicated): " + ", ".join(m for m, _ in self.replicated_linears)]
        if self.partition:
            lines += ["", self.partition]
        if self.notes:
            lines += [""] + self.notes
        if self.shapes:
            lines += ["", f"programs compiled on this rank, one per microbatch shape ({len(self.shapes)}):"]
            lines += [f"  inputs {s['inputs']}" + (f", target {s['target']}" if s["target"] is not None else "")
                      for s in self.shapes]
        return "\n".join(lines)

    def to_html(self, path: str) -> str:
        """A page with per-rank memory bars and the tables (graphpar/planner/report_html.py)."""
        with open(path, "w") as f:
            f.write(plan_html(self))
        return path

    def distinct_ranks(self) -> List[RankPlan]:
        """One rank per role: the first rank of each pp rank, then every rank whose bytes differ
        from those of each rank listed for its pp rank (ZeRO's uneven shares over dp, uneven
        shards over tp, each rank's all-to-all bytes for its routing under ep)."""
        listed: Dict[int, List[tuple]] = {}
        roles = []
        for r in self.ranks:
            held = (r.param_bytes, r.grad_bytes, r.optimizer_bytes, r.activation_peak_bytes, r.gathered_bytes,
                    r.host_bytes, r.transfer_bytes)
            if held not in listed.setdefault(r.pp_rank, []):
                listed[r.pp_rank].append(held)
                roles.append(r)
        return roles


def _mib(n: int) -> str:
    return f"{mib(n)} MiB"


# ---- optimizer state ------------------------------------------------------------------------
def optimizer_state(optimizer: Optional[Callable]) -> OptimizerState:
    """What the optimizer keeps per parameter tensor: one step on a two-element parameter,
    whose state is elementwise (more than one element, counted in fp32 per parameter element)
    or scalar (0-d tensors such as Adam's step, counted in their own bytes)."""
    if optimizer is None:
        return OptimizerState()
    param = torch.nn.Parameter(torch.zeros(2))
    opt = make_optimizer(optimizer, [param])
    param.grad = torch.ones(2)
    opt.step()
    tensors = [t for t in opt.state[param].values() if isinstance(t, torch.Tensor)]
    return OptimizerState(elements=sum(t.numel() for t in tensors if t.numel() > 1) // 2,
                          scalar_bytes=sum(t.nbytes for t in tensors if t.dim() == 0))


# ---- the analysis of one tagged graph ----------------------------------------------------------
def _nbytes(value, compute: Optional[torch.dtype] = None) -> int:
    """A value's bytes; with `compute` (Strategy.param_dtype), a floating one's in that dtype:
    the analysed program computes in fp32, the rank's program in param_dtype (cast_params)."""
    if not isinstance(value, TensorMeta):
        return 0
    if compute is None or not value.dtype.is_floating_point:
        return value.nbytes
    return value.numel * torch.empty((), dtype=compute).element_size()


def _stage_parameters(gm: torch.fx.GraphModule, names) -> Dict[int, Dict[str, TensorMeta]]:
    """The parameters (not buffers or constants) each stage reads, with local shapes."""
    per_stage: Dict[int, Dict[str, TensorMeta]] = {}
    for node in gm.graph.nodes:
        if node.op != "get_attr" or str(node.target) not in names:
            continue
        for user in node.users:
            per_stage.setdefault(node_stage(user), {})[str(node.target)] = record(node).value
    return per_stage


def _reads_ending(gm: torch.fx.GraphModule, names) -> Dict[int, str]:
    """Per stage, the parameter whose last read in forward (views followed, ir.last_reader)
    comes last among those whose last read lies in that stage: where zero=3's bucket kept for
    backward is found (passes/shard_parameters.py keeps the bucket read last)."""
    order = {node: i for i, node in enumerate(gm.graph.nodes)}
    attrs: Dict[str, List[torch.fx.Node]] = {}
    for node in gm.graph.nodes:
        if node.op == "get_attr" and str(node.target) in names:
            attrs.setdefault(str(node.target), []).append(node)
    ends: Dict[int, Tuple[int, str]] = {}
    for name, nodes in attrs.items():
        last = last_reader(nodes, order, lambda node: True)
        if last is not None and order[last] > ends.get(node_stage(last), (-1, ""))[0]:
            ends[node_stage(last)] = (order[last], name)
    return {stage: name for stage, (_, name) in ends.items()}


# ---- transfers ------------------------------------------------------------------------------

def _grad_size(strategy) -> int:
    """The bytes of a gradient element (Strategy.gradient_dtype, whatever the weights' dtype)."""
    return torch.empty((), dtype=strategy.gradient_dtype).element_size()


def _dp_transfers(params: Dict[str, TensorMeta], dp: int, grad_size: int, bucket_bytes: int, order: List[str],
                  axis: str = "dp", what: str = "gradient buckets") -> List[Transfer]:
    """Gradient buckets filled in the executor's order: the model's parameters reversed."""
    if dp == 1:
        return []
    trained = [params[name] for name in reversed(order) if name in params and params[name].requires_grad]
    if not trained:
        return []
    buckets = len(bucket_spans([meta.numel * grad_size for meta in trained], bucket_bytes))
    summed = sum(summed_gradient_bytes(meta.numel * grad_size, meta.numel) for meta in trained)
    return [Transfer("all_reduce", axis, summed, buckets, what)]


WHOLE = 0   # expert_weights: an expert module's weight, held whole by its ep rank


def expert_weights(model: torch.nn.Module, strategy: Strategy) -> Dict[str, int]:
    """Canonical name -> E of each expert weight Strategy.ep (or expert_tp) splits (empty when
    neither does), or WHOLE for a weight of an expert module (the list layout) that ep rank 0
    holds: every ep rank holds as many as it, of the same shapes (other_ranks_experts: the rest)."""
    if not strategy.splits_experts:
        return {}
    keys = canonical_keys(model)
    weights = {}
    for layer in experts_modules(model):
        owners = list_owners(layer, strategy.ep) if layer.keys else {}
        for name in layer.params:
            full = f"{layer.path}.{name}"
            if owners.get(full, 0) == 0:
                weights[keys.get(full, full)] = WHOLE if owners else layer.experts
    return weights


def other_ranks_experts(model: torch.nn.Module, strategy: Strategy) -> Set[str]:
    """The weights of the list layout's expert modules that ep rank 0 does not hold."""
    if not strategy.splits_experts:
        return set()
    keys = canonical_keys(model)
    return {keys.get(name, name) for layer in experts_modules(model) if layer.keys
            for name, rank in list_owners(layer, strategy.ep).items() if rank != 0}


def _expert_share(name: str, meta: TensorMeta, strategy, experts: Dict[str, int]) -> TensorMeta:
    """What a rank holds of an expert weight: E/ep of its experts (dim 0), with expert_tp its
    tp piece of each (graphpar/runtime/experts.py tp_piece); an expert module's weight whole."""
    if experts[name] == WHOLE:
        return meta
    shape = tp_piece_shape(name, (meta.shape[0] // strategy.ep, *meta.shape[1:]), strategy.expert_tp)
    return TensorMeta(shape, meta.dtype, meta.requires_grad)


def ep_note(routing, strategy: Strategy) -> str:
    factor = strategy.expert_capacity_factor
    capped = "" if factor is None else (
        f", each expert taking at most ceil({factor:g} * T * K / E) pairs of a replica's microbatch "
        f"(expert_capacity_factor; the rest dropped, not sent)")
    return ("ep: each rank holds E/ep experts of every expert weight (with expert_tp, its tp piece of "
            "each; counted above, expert_bytes); the "
            "all-to-all bytes of dispatch and combine are counted for "
            + ("the given routing" if routing is not None else
               "balanced routing (each rank receives as many token-expert pairs as it sends); "
               "gp.plan(routing=record_routing(model, x, strategy=strategy)) counts a real one") + capped)


def _crossing_bytes(gm, num_stages: int, compute: Optional[torch.dtype]) -> Dict[int, Tuple[List[int], List[int]]]:
    """For each cut b (into stage b): the byte sizes of the activations and of the gradients
    crossing it in one microbatch (one message per tensor)."""
    result = {}
    for b, nodes in crossings(gm, num_stages).items():
        values = [record(n).value for n in nodes]
        result[b] = ([_nbytes(v, compute) for v in values],
                     [_nbytes(v, compute) for v in values if isinstance(v, TensorMeta) and v.requires_grad])
    return result


def _messages(op: str, sizes: List[int], m: int, what: str) -> List[Transfer]:
    return [Transfer(op, "pp", sum(sizes) * m, len(sizes) * m, what)] if sizes else []


def _p2p(stages: List[int], cuts, num_stages: int, m: int, strategy: Strategy) -> List[Transfer]:
    """The point-to-point messages of a pp rank's stages; neighbours on one rank (the V's turn
    under zbv) hand values over in memory and send nothing."""
    transfers = []
    for stage in stages:
        if stage > 0 and strategy.stage_rank(stage - 1) != strategy.stage_rank(stage):
            act, grad = cuts[stage]
            transfers += _messages("recv", act, m, f"activations into stage {stage}")
            transfers += _messages("send", grad, m, f"gradients from stage {stage}")
        if stage < num_stages - 1 and strategy.stage_rank(stage + 1) != strategy.stage_rank(stage):
            act, grad = cuts[stage + 1]
            transfers += _messages("send", act, m, f"activations from stage {stage}")
            transfers += _messages("recv", grad, m, f"gradients into stage {stage}")
    return transfers


def _loss(strategy: Strategy, counted: bool, clipped: bool) -> List[Transfer]:
    """One all-reduce over the world: the loss, the step number and its square, in float64
    (graphpar/runtime/module.py ParallelModule._global_mean); before the optimizer step one
    more with a (loss_sum, count) loss, the token count (graphpar/runtime/grad_divisor.py), and
    one with max_grad_norm, the sum of the gradients' squares (graphpar/runtime/grad_norm.py);
    with tp or pp, first an all-gather of each rank's batch-shape fingerprint
    (graphpar/runtime/shapes.py check_replica_shapes)."""
    if strategy.world_size == 1:
        return []
    shapes = [Transfer("all_gather", "world", FINGERPRINT_BYTES * strategy.world_size, 1,
                       "each rank's batch shapes, checked alike in its replica before the step")]
    count = [Transfer("all_reduce", "world", FLOAT64, 1, "the token count of a (loss_sum, count) loss")]
    norm = [Transfer("all_reduce", "world", FLOAT64, 1, "the global gradient norm (max_grad_norm)")]
    return [*(shapes if checks_replica_shapes(strategy.tp, strategy.pp) else []),
            Transfer("all_reduce", "world", 3 * FLOAT64, 1, "the step's loss and the step-number check"),
            *(count if counted else []), *(norm if clipped else [])]


# ---- units: the analysis that stages are built from ------------------------------------------------
@dataclass
class UnitStats:
    """What one unit (a layer, see passes/partition_stages.py) costs per microbatch."""
    unit: Unit
    params: Dict[str, TensorMeta]          # parameters it reads (tp-local shapes)
    saved: int                             # bytes autograd saves for backward
    tp: List[Tuple[str, str, int]]         # (op, what, bytes) of each tp collective
    dp_statistics: List[Tuple[str, int]]   # (what, bytes) of batch statistics' all-reduces over dp
    cut_before: Tuple[List[int], List[int]] = ((), ())   # (activations, gradients) entering it
    weights_saved: FrozenSet[str] = frozenset()          # parameters autograd saves (zero=3 regathers them)
    recompute_flops: float = 0.0                         # forward flops its backward runs again
    experts: Tuple[ExpertsCallCost, ...] = ()            # its experts layers' calls (Strategy.ep)
    read_last: Optional[str] = None                      # of the parameters whose last read is in it, the last


# Sequence-parallel collectives: (forward op, backward op) on the full tensor. Bytes are
# those of the full (unsplit) tensor for every op: what an all-gather produces and what a
# reduce-scatter reads (gloo runs a reduce-scatter as an all-reduce of those bytes).
# scatter_to also takes the tp plan's local slices (BLOOM's alibi): the same costs.
_SEQUENCE_OPS = {
    collectives.reduce_scatter: ("reduce_scatter", "all_gather"),
    collectives.gather_to: ("all_gather", "reduce_scatter"),
    collectives.scatter_to: (None, "all_gather"),
    collectives.gather_from: ("all_gather", None),
}


def _sequence_sizes(node, compute: Optional[torch.dtype], in_region: bool = False) -> List[Tuple[str, str, int]]:
    if not in_region and node.target is collectives.gather_from and all(u.op == "output" for u in node.users):
        return []   # gathers a model output for pm(x): not in the training program
    value = record(node).value
    full = max(_nbytes(value, compute), _nbytes(record(node.args[0]).value, compute))  # a gather's output, a scatter's input
    forward, backward = _SEQUENCE_OPS[node.target]
    name = node.target.__name__
    sizes = [(forward, f"forward {forward.replace('_', '-')} ({name})", full)] if forward else []
    if backward and value.requires_grad:
        sizes.append((backward, f"backward {backward.replace('_', '-')} ({name})", full))
    return sizes


def _tp_sizes(nodes, compute: Optional[torch.dtype], in_region: bool = False) -> List[Tuple[str, str, int]]:
    """(op, what, bytes) of the tp collectives of `nodes` (those of a recompute region's body
    when `in_region`: its outputs are read after the region, not returned by the program)."""
    sizes = []
    for node in nodes:
        if node.target is collectives.reduce_from:
            sizes.append(("all_reduce", "forward all-reduce (reduce_from)", _nbytes(record(node).value, compute)))
        elif node.target is collectives.copy_to and record(node).value.requires_grad:
            sizes.append(("all_reduce", "backward all-reduce (copy_to)", _nbytes(record(node).value, compute)))
        elif node.target in _SEQUENCE_OPS:
            sizes += _sequence_sizes(node, compute, in_region)
        elif node.target is collectives.parallel_cross_entropy:
            logits = record(node.args[0]).value
            reductions = 4 if node.args[3] > 0 else 3  # max, sum of exps, target logit (+ mean)
            sizes += [("all_reduce", "parallel cross entropy", logits.numel // logits.shape[-1] * 4)] * reductions
    return sizes


def _replayed_sizes(training: torch.fx.GraphModule, compute: Optional[torch.dtype]) -> Dict[int, List[Tuple[str, str, int]]]:
    """Unit -> the forward collectives of its recompute regions, which each replay issues
    again in backward (docs/recompute.md, "Collectives are re-issued")."""
    sizes: Dict[int, List[Tuple[str, str, int]]] = {}
    for node in training.graph.nodes:
        if node.op == "call_module" and isinstance(training.get_submodule(node.target), RecomputeRegion):
            body = training.get_submodule(node.target).body
            sizes.setdefault(node_stage(node), []).extend(
                (op, f"{what} again in the recompute replay", n) for op, what, n in _tp_sizes(body.graph.nodes, compute, in_region=True)
                if what.startswith("forward"))
    return sizes


def _dp_statistics_sizes(nodes) -> List[Tuple[str, int]]:
    """(what, bytes) of each all-reduce over dp of a batch statistic, in training."""
    sizes = []
    for node in nodes:
        if node.target is sbn.sync_batch_norm:
            channels = record(node).value.shape[1]
            sizes += [("SyncBatchNorm statistics", (2 * channels + 1) * FLOAT64),   # forward
                      ("SyncBatchNorm statistics", 2 * channels * FLOAT64)]        # backward
        elif node.target is batch_statistics.batch_mean:
            total, count = node.args[:2]
            sizes.append(("load-balancing loss statistics", _nbytes(record(total).value, None)))
            if isinstance(count, torch.fx.Node):   # a row count weighted by a mask: a tensor
                sizes.append(("load-balancing loss statistics", _nbytes(record(count).value, None)))
    return sizes


def _training_program(gm, ctx, model, units: List[Unit],
                      weights: Dict[str, int]) -> Tuple[torch.fx.GraphModule, Optional[RecomputePlan]]:
    """The program train_step runs (the loss only), on a copy, with Strategy.recompute's regions
    outlined as the recompute pass does (per unit here, each unit being a stage). A budget is
    weighed on the whole model: a surrogate's unit counts for the blocks it stands for."""
    program = ctx.results.program
    training = loss_only(gm, program.loss_outputs) if program.has_loss else forward_only(gm, 0)
    if ctx.strategy.recompute is None:
        return training, None
    inputs, meta = ctx.graph_inputs(), on_meta(model)
    count = {i: weights.get(u.path, 1) for i, u in enumerate(units)}
    # the experts layers expert_parallel turns into calls (after this program is taken): the
    # compile's regions stop at those calls, and its budget counts them as the calls' stand-ins
    # (passes/recompute.py experts_stand_ins), so the planner's do as well
    layers = find_experts_layers(model, training) if ctx.strategy.splits_experts else []
    calls = [experts_call(training, layer).replaced for layer in layers]

    def measure(program) -> int:
        saved = saved_activation_bytes(program, inputs, ctx.mesh, meta, _experts_stand_ins(program, layers))[0]
        return sum(count.get(stage, 1) * size for stage, size in saved.items())
    return training, apply_recompute(training, model, ctx.strategy.recompute, measure, weights, calls)


def _experts_stand_ins(program, layers) -> Dict[torch.fx.Node, Optional[torch.fx.Node]]:
    """Each experts layer's traced nodes counted as the call that replaces them at compile
    (passes/recompute.py experts_stand_ins): none of their own saves, the routing weights kept."""
    found = [experts_call(program, layer) for layer in layers]
    return {**{n: None for call in found for n in call.region}, **{call.output: call.top_k_weights for call in found}}


def analyse_units(gm, model, ctx, weights: Optional[Dict[str, int]] = None) -> List[UnitStats]:
    """Tag every node with its unit (as if each unit were a stage) and cost each unit; what
    Strategy.recompute chose goes to ctx.results.recompute, as the pass leaves it. `weights`:
    how many blocks a surrogate's unit stands for."""
    units_of_nodes = node_units(gm, model)
    units = build_units(gm, model, units_of_nodes)
    assign_stages(gm, units_of_nodes, {u.path: i for i, u in enumerate(units)}, len(units) - 1)
    names = {name for name, _ in model.named_parameters()}
    # zero=3 keeps the bucket read last gathered into backward, of the weights it gathers (expert
    # weights only at edp > 1: mesh.experts_stage)
    whole = set(expert_weights(model, ctx.strategy)) if _experts_whole(ctx.strategy) else set()
    params, reads_ending = _stage_parameters(gm, names), _reads_ending(gm, names - whole)
    inputs = ctx.graph_inputs()
    training, recomputed = _training_program(gm, ctx, model, units, weights or {})
    saved, weights_saved = saved_activation_bytes(training, inputs, ctx.mesh, on_meta(model))
    ctx.results.recompute = recomputed
    flops = recomputed.flops if recomputed is not None else {}
    compute = ctx.strategy.param_dtype
    cuts = _crossing_bytes(gm, len(units), compute) if len(units) > 1 else {}
    experts = experts_call_costs(gm, model, ctx.strategy) if ctx.strategy.splits_experts else {}
    by_unit: Dict[int, List[torch.fx.Node]] = {}
    for node in gm.graph.nodes:
        if node.op == "call_function":
            by_unit.setdefault(node_stage(node), []).append(node)
    replayed = _replayed_sizes(training, compute)
    return [UnitStats(unit, params.get(i, {}), saved.get(i, 0),
                      _tp_sizes(by_unit.get(i, []), compute) + replayed.get(i, []),
                      _dp_statistics_sizes(by_unit.get(i, [])), cuts.get(i, ([], [])), frozenset(weights_saved.get(i, ())),
                      flops.get(unit.path, 0.0), tuple(experts.get(i, ())), reads_ending.get(i))
            for i, unit in enumerate(units)]


# ---- repeated blocks share one analysis -------------------------------------------------------
SURROGATE_BLOCKS = 2


def repeated_blocks(model: torch.nn.Module) -> Optional[Tuple[str, torch.nn.ModuleList]]:
    """The model's main stack of identical blocks (same class, same parameter shapes); never
    the experts of a mixture-of-experts layer (a list of experts is called once, as a whole)."""
    best = None
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.ModuleList) or len(module) <= SURROGATE_BLOCKS + 1 or \
                is_expert_list(module):
            continue
        shapes = [[(k, tuple(t.shape)) for k, t in child.state_dict().items()] for child in module]
        if any(type(c) is not type(module[0]) for c in module) or any(s != shapes[0] for s in shapes):
            continue
        size = sum(t.numel() for t in module.parameters())
        if best is None or size > best[2]:
            best = (name, module, size)
    return (best[0], best[1]) if best else None


def _renamed(stats: UnitStats, prefix_from: str, prefix_to: str) -> UnitStats:
    def rename(name: str) -> str:
        return prefix_to + name[len(prefix_from):] if name.startswith(prefix_from) else name
    unit = dataclasses.replace(stats.unit, path=rename(stats.unit.path),
                               tied=tuple((rename(n), size) for n, size in stats.unit.tied))
    return dataclasses.replace(stats, unit=unit, params={rename(n): m for n, m in stats.params.items()},
                               weights_saved=frozenset(rename(n) for n in stats.weights_saved),
                               experts=tuple(dataclasses.replace(c, path=rename(c.path)) for c in stats.experts),
                               read_last=rename(stats.read_last) if stats.read_last else None)


def expand(stats: List[UnitStats], container: str, blocks: int) -> List[UnitStats]:
    """The whole model's units from a surrogate with SURROGATE_BLOCKS blocks: block 0 as
    analysed, every later block as the surrogate's block 1 (same cut before it)."""
    first = next(i for i, s in enumerate(stats) if s.unit.path == f"{container}.0")
    second = stats[first + 1]
    middle = [_renamed(second, f"{container}.1", f"{container}.{i}") for i in range(1, blocks)]
    return stats[:first + 1] + middle + stats[first + SURROGATE_BLOCKS:]


def _with_fewer_blocks(model: torch.nn.Module, name: str, keep: int) -> torch.nn.Module:
    """A shallow copy of `model` whose ModuleList at `name` holds only its first `keep` blocks:
    the modules on the path are copied (sharing their parameters), the user's model is not
    touched, so planning is safe while another thread trains or plans the same model."""
    def shallow(module):
        clone = copy.copy(module)
        clone._modules = type(module._modules)(module._modules)
        return clone
    root = parent = shallow(model)
    parts = name.split(".") if name else []
    for part in parts:
        parent._modules[part] = shallow(parent._modules[part])
        parent = parent._modules[part]
    parent._modules = type(parent._modules)(list(parent._modules.items())[:keep])
    return root


def unit_analysis(model, strategy, example_inputs, loss_fn, example_target, world_size, options):
    def run(traced, weights=None):
        result = lower_rank(traced, strategy, example_inputs, rank=0, world_size=world_size, loss_fn=loss_fn,
                            example_target=example_target, until="sync_batch_norm", snapshots=False, **options)
        return analyse_units(result.gm, traced, result.ctx, weights), result.ctx
    found = repeated_blocks(model)
    if found is None:
        return run(model)
    name, container = found
    stats, ctx = run(_with_fewer_blocks(model, name, SURROGATE_BLOCKS), {f"{name}.1": len(container) - 1})
    return expand(stats, name, len(container)), ctx


# ---- entry points -------------------------------------------------------------------------------
def activation_peak(strategy: Strategy, pp_rank: int, saved: Dict[int, int]) -> int:
    """The most bytes a pp rank holds for backward at once: its schedule walked in order, each
    forward adding its stage's bytes for one microbatch (`saved`), each backward releasing
    them (a split backward: its weight gradient, an upper bound, since the input gradient
    already lets go of all but the split layers' inputs). At pp = 1 a microbatch's backward
    follows its forward: one is held at a time."""
    if strategy.pp == 1:
        return saved.get(0, 0)
    live = peak = 0
    for instr in build_schedule(strategy.schedule, strategy.pp, strategy.microbatches, strategy.virtual_stages)[pp_rank]:
        if instr.op == "forward":
            live += saved.get(instr.stage, 0)
            peak = max(peak, live)
        elif instr.op == ("backward_weight" if splits_backward(strategy.schedule) else "backward"):
            live -= saved.get(instr.stage, 0)
    return peak


def _stage_of(bounds: List[int], n: int) -> List[int]:
    stage_of_unit = []
    for stage, start in enumerate(bounds):
        end = bounds[stage + 1] if stage + 1 < len(bounds) else n
        stage_of_unit += [stage] * (end - start)
    return stage_of_unit


def _compute_metas(params: Dict[str, TensorMeta], strategy, tables) -> Dict[str, TensorMeta]:
    """The device parameters as the program holds them: host tables out, floats in param_dtype."""
    dtype = strategy.param_dtype or torch.float32
    return {n: TensorMeta(m.shape, dtype if m.dtype.is_floating_point else m.dtype, m.requires_grad)
            for n, m in params.items() if n not in tables}


def _rank_plan(stats, stage_of_unit, bounds, pp_rank, strategy, states, bucket, order, tables, world, experts,
               elsewhere, containers=()):
    num_stages, m = strategy.pp * strategy.virtual_stages, strategy.microbatches
    stages = rank_stages(pp_rank, strategy.pp, num_stages, strategy.schedule)
    mine = [s for s, stage in zip(stats, stage_of_unit) if stage in stages]
    traced = {name: _expert_share(name, meta, strategy, experts) if name in experts else meta
              for s in mine for name, meta in s.params.items() if name not in elsewhere}
    params = _compute_metas(traced, strategy, tables)
    tp = {}
    for s in mine:
        for op, what, size in s.tp:
            tp.setdefault((op, what), []).append(size)
    transfers = [Transfer(op, "tp", sum(v) * m, len(v) * m, what) for (op, what), v in tp.items()]
    statistics: Dict[str, List[int]] = {}
    for s in mine:
        for what, size in s.dp_statistics:
            statistics.setdefault(what, []).append(size)
    transfers += [Transfer("all_reduce", "dp", sum(sizes) * m, len(sizes) * m, what) for what, sizes in statistics.items()]
    cuts = {b: stats[bounds[b]].cut_before for b in range(1, num_stages)}
    transfers += _p2p(stages, cuts, num_stages, m, strategy)
    reading: Dict[str, set] = {}   # parameter -> the stages that read it
    for s, stage in zip(stats, stage_of_unit):
        for name in s.params:
            reading.setdefault(name, set()).add(stage)
    zero3 = zero_active(strategy, strategy.dp) and strategy.zero == 3
    tied = [n for n, read in reading.items() if len({s % strategy.pp for s in read}) > 1 and n in params]
    if tied:
        # zero=3 sums each copy's reduced row (its shard of a bucket of its own, with its flag)
        size = _grad_size(strategy)
        sizes = ([(-(-params[n].numel // strategy.dp) + 1) * size for n in tied] if zero3
                 else [summed_gradient_bytes(params[n].numel * size, params[n].numel) for n in tied])
        transfers.append(Transfer("all_reduce", "tied", sum(sizes), len(tied), "tied weights across stages"))
    # zero=3 gathers the dense weights and, at edp > 1, the expert weights (mesh.experts_stage),
    # each in runs of their own
    trained = [name for name in reversed(order) if name in params and params[name].requires_grad]
    runs = bucket_runs([n for n in trained if n not in experts], reading, strategy.stage_rank) if zero3 else None
    expert_stage = experts_stage(strategy.zero, _edp(strategy))
    expert_runs_ = (expert_runs([n for n in trained if n in experts], _edp(strategy), containers)
                    if expert_stage == 3 else None)
    weights_saved = {name for s in mine for name in s.weights_saved}
    # zero=3 at pp = 1 keeps the bucket read last gathered into backward (shard_parameters)
    kept = next((s.read_last for s in reversed(mine) if s.read_last), None) if strategy.pp == 1 else None
    # expert weights: their own buckets, summed (or, with ZeRO, sharded) over the ranks holding
    # the same experts (edp); the dense ones over dp
    owned = {n: p for n, p in params.items() if n in experts}
    dense = {n: p for n, p in params.items() if n not in experts}
    zero, expert_zero = None, None
    if zero_active(strategy, strategy.dp):
        zero = zero_plan(dense, order, bucket, strategy, states, runs, weights_saved, kept=kept)
        expert_zero = (zero_plan(owned, order, bucket, dataclasses.replace(strategy, zero=expert_stage), states,
                                 expert_runs_, weights_saved, shards=_edp(strategy), kept=kept) if owned else None)
    transfers += (_dp_transfers(owned, _edp(strategy), _grad_size(strategy), bucket, order, "edp",
                                "expert gradient buckets") if expert_zero is None
                  else _zero_transfers(expert_zero, "edp"))
    transfers += (_dp_transfers(dense, strategy.dp, _grad_size(strategy), bucket, order) if zero is None
                  else _zero_transfers(zero, "dp"))
    transfers += world
    placed = placed_bytes(traced, strategy, states, {n: t for n, t in tables.items() if n in traced},
                          strategy.dp, bucket)
    moves = placed.moves if zero is None else [m for m in zero.moves if m[0] in ("to_host", "to_device")]
    transfers += [Transfer(op, "host", size, count, what) for op, size, count, what in moves]
    saved = {}
    for s, stage in zip(stats, stage_of_unit):
        saved[stage] = saved.get(stage, 0) + s.saved
    # analysed in fp32: a lower param_dtype scales the (almost all floating) saved tensors
    scale = torch.empty((), dtype=strategy.param_dtype or torch.float32).element_size() / 4
    activations = int(activation_peak(strategy, pp_rank, saved) * scale)
    if zero is not None:  # optimizer states differ per rank (padding): one entry per dp x tp rank
        note = f"pp rank {pp_rank}: {zero.note}" if strategy.pp > 1 else zero.note  # each shards its own stages
        plans = [(zero, strategy.tp)] + ([(expert_zero, strategy.ep * strategy.expert_tp)]
                                         if expert_zero is not None else [])
        return (stages, sum(z.param for z, _ in plans), sum(z.grad for z, _ in plans),
                _per_flat_rank(plans, "optimizer", strategy), activations, _per_flat_rank(plans, "host", strategy),
                transfers, [note], zero.gathered + _expert_in_flight(expert_zero))
    return (stages, placed.param, placed.grad, placed.optimizer, activations, placed.host, transfers,
            zero_notes(strategy), 0)


def _experts_whole(strategy) -> bool:
    """Whether the expert weights stay whole on the rank at zero=3 (edp = 1: mesh.experts_stage)."""
    return experts_stage(strategy.zero, _edp(strategy)) < 3


def _expert_in_flight(expert_zero) -> int:
    """zero=3 with expert weights sharded over edp: an experts module's buckets are gathered
    around its call while the next module's may be prefetched (its gather starts right after the
    previous bucket's wait), beside the dense buckets in flight: counted as the two largest
    experts modules on top of the dense figure, an estimate, not an exact peak."""
    return expert_zero.runs_in_flight if expert_zero is not None else 0


def _edp(strategy) -> int:
    return edp_size(strategy.dp, strategy.tp, strategy.ep, strategy.expert_tp)


def _zero_transfers(zero, axis: str) -> List[Transfer]:
    return [Transfer(op, axis, size, count, what) for op, size, count, what in zero.moves
            if op in ("reduce_scatter", "all_gather")]


def _per_flat_rank(plans, field: str, strategy) -> List[int]:
    """Per dp x tp rank `flat` of a stage, the bytes of `field` (a list per shard) its shards
    add up to: (plan, stride) pairs, shard flat // stride (dp shards: flat // tp; expert
    weights' edp shards: flat // (ep * expert_tp))."""
    return [sum(getattr(z, field)[flat // stride] for z, stride in plans) for flat in range(strategy.dp * strategy.tp)]


def plan(model: torch.nn.Module, strategy, example_inputs, loss_fn: Optional[Callable] = None,
         optimizer: Optional[Callable] = None, world_size: Optional[int] = None,
         example_target: Any = None, routing: Optional[Dict[str, torch.Tensor]] = None, backend: Optional[str] = None,
         **options) -> Report:
    """`backend`: the torch.distributed backend to plan the collectives for (default: the
    initialised process group's, else the one graphpar.launch would pick)."""
    strategy = Strategy.coerce(strategy)
    if strategy.partition == "profile":
        raise ValueError("graphpar.plan runs nothing, so partition='profile' has no layer times to balance. "
                         "Fix: plan with partition='parameters' (or 'uniform'); compile measures profiles.")
    check_zero_optimizer(optimizer, strategy)
    world_size = world_size or strategy.world_size
    analysis = unit_analysis(model, strategy, example_inputs, loss_fn, example_target, world_size, options)
    return report_from(analysis, model, strategy, world_size, optimizer, options, routing, backend)


def _host_tables(model, strategy) -> Dict[str, TensorMeta]:
    """Parameter name -> full-size meta of each table offload_embedding puts on the host."""
    keys = canonical_keys(model)
    found = {}
    for path in host_embedding_paths(model, strategy.offload_embedding, warn=False):
        key = f"{path}.weight" if path else "weight"
        weight = model.get_submodule(path).weight
        found[keys.get(key, key)] = TensorMeta(tuple(weight.shape), weight.dtype, True)
    return found


def report_from(analysis, model, strategy: Strategy, world_size: int, optimizer, options,
                routing: Optional[Dict[str, torch.Tensor]] = None, backend: Optional[str] = None) -> Report:
    """The report of one strategy from a unit analysis. The analysis depends only on the tp
    degree and the microbatch shape, so the strategy search reuses it across dp, pp and
    schedules. `routing`: the experts layers' top_k_index of the global batch (expert_plan.py).
    `backend`: the one the collectives run on (None: collective_backend())."""
    backend = backend or collective_backend()
    stats, ctx = analysis
    num_stages = strategy.pp * strategy.virtual_stages
    units = [s.unit for s in stats]
    bounds = partition(units, num_stages, strategy.partition) if num_stages > 1 else [0]
    stage_of_unit = _stage_of(bounds, len(units))
    states = optimizer_state(optimizer)
    bucket = options.get("bucket_bytes", DEFAULT_BUCKET_BYTES)
    order = list(dict.fromkeys(canonical_keys(model).values()))
    tables = _host_tables(model, strategy)
    # the all-reduces over the world every rank takes part in
    world = _loss(strategy, ctx.results.program.loss_count, options.get("max_grad_norm") is not None)
    experts = expert_weights(model, strategy)
    check_routing(routing, [c for s in stats for c in s.experts], strategy)
    elsewhere = other_ranks_experts(model, strategy)   # (the rank plans count ep rank 0's expert modules)
    per_pp_rank = {r: _rank_plan(stats, stage_of_unit, bounds, r, strategy, states, bucket, order, tables, world,
                                 experts, elsewhere, expert_list_paths(model))
                   for r in range(strategy.pp)}
    # forward flops run again per step: each stage's units, every microbatch
    recomputed = {r: strategy.microbatches * sum(s.recompute_flops for s, stage in zip(stats, stage_of_unit)
                                                 if stage % strategy.pp == r) for r in range(strategy.pp)}
    experts_of = {r: _experts_of(stats, stage_of_unit, per_pp_rank[r][0], experts, strategy)
                  for r in range(strategy.pp)}
    ranks = []
    for rank in range(world_size):
        mesh = Mesh(strategy.dp, strategy.tp, strategy.pp, rank, ep=strategy.ep, etp=strategy.expert_tp)
        stages, params_b, grads_b, opt_b, act_b, host_b, transfers, _, gathered = per_pp_rank[mesh.pp_rank]
        calls, expert_bytes = experts_of[mesh.pp_rank]
        # each rank's own: its all-to-alls depend on its tokens' routing
        exchanged = [Transfer(*move) for move in expert_moves(calls, routing, strategy, mesh)] if calls else []
        ranks.append(RankPlan(rank, mesh.dp_rank, mesh.tp_rank, mesh.pp_rank, stages, params_b, grads_b,
                              _of_rank(opt_b, mesh), act_b, _of_rank(host_b, mesh),
                              [run for t in transfers + exchanged for run in _as_run(t, backend, strategy)],
                              gathered, recomputed[mesh.pp_rank], expert_bytes))
    tp_plan = ctx.results.tp_plan
    return Report(strategy=_strategy_dict(strategy), world_size=world_size, ranks=ranks,
                  bubble_fraction=bubble_fraction(strategy),
                  fallbacks=list(tp_plan.fallbacks) if tp_plan else [],
                  partition=describe_partition(units, bounds, strategy.partition) if num_stages > 1 else "",
                  replicated_linears=list(tp_plan.replicated_linears) if tp_plan else [],
                  stage_units=[end - start for start, end in zip(bounds, bounds[1:] + [len(units)])],
                  notes=list(dict.fromkeys(note for entry in per_pp_rank.values() for note in entry[7]))
                  + ([ctx.results.recompute.explain()] if ctx.results.recompute is not None else [])
                  + ([ep_note(routing, strategy)] if experts else []))


def _as_run(transfer: Transfer, backend: str, strategy: Strategy) -> List[Transfer]:
    """The transfers a backend without a reduce-scatter of its own (gloo;
    graphpar.distributed.groups.has_reduce_scatter) runs for one: ZeRO's gradient rows (axis dp
    or edp) as point-to-point messages, each rank sending every other rank its row and receiving
    its own from each (zero._exchange_rows: (N-1)/N of the buffer each way, nothing over a group
    of one); sequence parallelism's (axis tp) as an all-reduce of the same buffer. The plan names
    what runs."""
    if transfer.op != "reduce_scatter" or has_reduce_scatter(backend):
        return [transfer]
    if transfer.axis == "tp":
        return [dataclasses.replace(transfer, op="all_reduce",
                                    what=f"{transfer.what}; an all-reduce of its buffer on {backend}, which has no "
                                         f"reduce-scatter of its own")]
    group = strategy.dp if transfer.axis == "dp" else _edp(strategy)
    if group == 1:
        return []
    what = f"{transfer.what}; on {backend}, which has no reduce-scatter of its own, a row to each other rank"
    return [Transfer(op, transfer.axis, transfer.bytes // group * (group - 1), transfer.count * (group - 1), what)
            for op in ("send", "recv")]


def _experts_of(stats, stage_of_unit, stages, experts: Dict[str, int], strategy):
    """A pp rank's experts layers' calls and the bytes of the expert weights it holds (in the
    compute dtype, as param_bytes counts them)."""
    mine = [s for s, stage in zip(stats, stage_of_unit) if stage in stages]
    held = {n: _expert_share(n, meta, strategy, experts) for s in mine for n, meta in s.params.items() if n in experts}
    return [c for s in mine for c in s.experts], sum(m.nbytes for m in _compute_metas(held, strategy, {}).values())


def _of_rank(value, mesh) -> int:
    """A byte count shared by every dp x tp rank, or (ZeRO) a list with one per dp x tp rank."""
    return value[mesh.flat_rank] if isinstance(value, list) else value


def bubble_fraction(strategy: Strategy) -> float:
    """Idle share of the schedule with backward = 2 x forward (split: input and weight
    gradients one forward each), from the schedule itself."""
    if strategy.pp == 1:
        return 0.0
    schedule = build_schedule(strategy.schedule, strategy.pp, strategy.microbatches, strategy.virtual_stages)
    return simulate(schedule, strategy.pp).bubble_fraction


def _strategy_dict(strategy: Strategy) -> Dict[str, Any]:
    d = {k: getattr(strategy, k) for k in ("dp", "tp", "pp", "microbatches", "schedule", "virtual_stages",
                                           "sequence_parallel", "offload_optimizer", "zero", "ep",
                                           "expert_tp", "expert_capacity_factor")}
    d["partition"] = str(strategy.partition)
    d["offload_embedding"] = strategy.offload_embedding if isinstance(strategy.offload_embedding, bool) else list(
        strategy.offload_embedding)
    for name in ("param_dtype", "reduce_dtype"):
        dtype = getattr(strategy, name)
        d[name] = str(dtype).replace("torch.", "") if dtype else None
    return d
