"""build_update: the rank's update program, one chain of nodes per gradient bucket.

Built when the optimizer step leaves the default path: with Strategy.offload_optimizer,
or with a low-precision Strategy.param_dtype (fp32 master weights), or with host
embeddings (their row updates). The program is a GraphModule of its own, kept in
ctx.results.update and dumped with the rank's other graphs:

    grads_0 = self.grads_0()                 # device: bucket 0's gradients, flat
    weights_0 = self.update_0(grads_0)       # @host (place_on_host's update_placement): master step
    written_0 = self.write_0(weights_0)      # device: compute weights updated

Buckets follow the data-parallel gradient buckets (reverse model order, bucket_bytes of
gradients in Strategy.gradient_dtype: fp32 unless reduce_dtype is the compute dtype), so a
bucket's step can start as soon as its all-reduce is done.
The master weights are the parameters' fp32 values now, before cast_params lowers the
device copies; lower_placement adds the transfers and the host tables' updates.

With Strategy.zero > 0 and dp > 1 each bucket is a ZeRO chain instead (graphpar/runtime/zero.py):
reduce-scatter of the bucket's gradients, the rank's shard stepped, all-gather of the weights:

    reduce_0 = self.reduce_0()               # launch: during backward, async over dp
    shard_0 = self.shard_0(reduce_0)         # step: this rank's averaged gradient shard
    update_0 = self.update_0(shard_0)        # step: the optimizer steps the rank's pieces
    gather_0 = self.gather_0(update_0)       # step: every rank's shard, over dp, async
    weights_0 = self.weights_0(gather_0)     # write: after backward, waits for it
    write_0 = self.write_0(weights_0)        # write: into the device parameters

With Strategy.zero = 3 the parameters themselves are sharded (graphpar/runtime/zero3.py): each
bucket is an `Unsharded` module holding the rank's shard (kept as program.unsharded, which
passes/shard_parameters.py puts into the rank's program), backward reduce-scatters the
gradients itself, and the chain steps the shard in place; no gather follows the step:

    reduce_0 = self.reduce_0()               # launch: the row backward reduced, every microbatch
    shard_0 = self.shard_0(reduce_0)         # step: averaged over dp
    update_0 = self.update_0(shard_0)        # step: the optimizer steps the rank's pieces
    write_0 = self.write_0(update_0)         # write (fp32 masters only): into the compute shard

With expert parallelism, zero=3's expert buckets (after the dense ones: zero3_runs, one experts
module's weights each) are `Unsharded` over the edp group, the ranks holding the same experts;
at edp = 1 they are the zero=2 chains above over that group of one (mesh.experts_stage).
"""
from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

import torch
import torch.fx
import torch.nn as nn

from graphpar.passes.place_on_host import update_placement
from graphpar.passes.tracing.expert_lists import expert_list_paths
from graphpar.runtime.grad_sync import bucketize
from graphpar.ir.compiled import replica_axis
from graphpar.ir import (NodeRecord, PHASE_LAUNCH, PHASE_STEP, PHASE_WRITE, TensorMeta, fetch_attr, parameter_readers,
                         record, set_record)
from graphpar.runtime.placement.transfers import HOST
from graphpar.runtime.placement.update import GatherGrads, MasterWeights, WriteParams
from graphpar.runtime.zero import (AllGatherParams, GatheredWeights, ReduceScatterGrads, ShardStep, WaitShard,
                                   flatten_bucket, shard_layout, zero_active)
from graphpar.distributed.mesh import experts_stage
from graphpar.runtime.zero3 import TakeReduced, Unsharded, WriteShard, bucket_runs, expert_runs

PASS = "build_update"


def compute_dtype(strategy) -> torch.dtype:
    return strategy.param_dtype or torch.float32


def needs_update_program(strategy, gm: torch.fx.GraphModule, dp: int) -> bool:
    return (zero_active(strategy, dp) or strategy.offload_optimizer or compute_dtype(strategy) != torch.float32
            or any(record(n).placement == "host" for n in gm.graph.nodes if n.op == "get_attr"))


def masters_needed(strategy) -> bool:
    return strategy.offload_optimizer or compute_dtype(strategy) != torch.float32


def _on_this_rank(node: torch.fx.Node, mesh, strategy) -> bool:
    stages = {record(u).stage for u in node.users}
    return None in stages or any(strategy.stage_rank(s) == mesh.pp_rank for s in stages)


def rank_parameters(gm: torch.fx.GraphModule, ctx) -> Dict[str, torch.fx.Node]:
    """This rank's trainable device parameters, each with the node reading it (its get_attr,
    or an expert weight's experts call), in the order backward finishes them (the reverse of
    the model's order, as data-parallel buckets use)."""
    nodes = {str(n.target): n for n in gm.graph.nodes
             if n.op == "get_attr" and record(n).update_placement is not None and record(n).placement == "device"
             and _on_this_rank(n, ctx.mesh, ctx.strategy)}
    nodes.update(_expert_weights(gm, ctx))
    order = [k for k in reversed(list(ctx.model.state_dict(keep_vars=True))) if k in nodes]
    return {k: nodes[k] for k in dict.fromkeys(order)}


def _expert_weights(gm: torch.fx.GraphModule, ctx) -> Dict[str, torch.fx.Node]:
    """The trained expert weights of this rank's stages (expert parallelism): passes/expert_parallel.py
    put one call of the rank's experts module where their get_attrs were; the module holds them."""
    weights = {}
    for node in gm.graph.nodes:
        stage = record(node).stage if node.op == "call_module" else None
        if node.op != "call_module" or (stage is not None and ctx.strategy.stage_rank(stage) != ctx.mesh.pp_rank):
            continue
        for name, p in gm.get_submodule(str(node.target)).named_parameters(prefix=str(node.target)):
            if name in ctx.results.expert_shards and p.requires_grad:
                weights[name] = node
    return weights


def _update_placement(node: torch.fx.Node, strategy) -> str:
    """Where a parameter's update runs: its get_attr's update_placement; an expert weight's,
    whose get_attr expert_parallel replaced by its experts call, by place_on_host's rule."""
    return update_placement(strategy) if node.op == "call_module" else record(node).update_placement


def _node(graph, name: str, args, bucket: int, phase: str, value, placement: str) -> torch.fx.Node:
    node = graph.call_module(name, args)
    set_record(node, NodeRecord(value=value, placement=placement, bucket=bucket, phase=phase, set_by=PASS))
    return node


def _bucket(root, graph, k: int, names: List[str], params, placement: str, strategy) -> None:
    device, dtype = HOST if placement == "host" else params[0].device, compute_dtype(strategy)
    root.add_module(f"grads_{k}", GatherGrads(params))
    root.add_module(f"update_{k}", MasterWeights(names, params, device, dtype))
    root.add_module(f"write_{k}", WriteParams(params))
    numel = sum(p.numel() for p in params)
    flat = TensorMeta((numel,), dtype)
    grads = _node(graph, f"grads_{k}", (), k, PHASE_STEP, TensorMeta((numel,), strategy.gradient_dtype), "device")
    weights = _node(graph, f"update_{k}", (grads,), k, PHASE_STEP, flat, placement)
    _node(graph, f"write_{k}", (weights,), k, PHASE_WRITE, flat, "device")


def _zero_bucket(root, graph, k: int, names: List[str], params, placement: str, ctx) -> None:
    # zero=3 at edp = 1 leaves expert weights whole on the rank, as zero=2 does (docs/zero.md,
    # "With expert parallelism"): experts_stage
    mesh, dtype = ctx.mesh, compute_dtype(ctx.strategy)
    stage = experts_stage(ctx.strategy.zero, mesh.edp)   # zero=1, 2 as they are; zero=3 only here at edp = 1
    axis = replica_axis(names[0], ctx.results.expert_shards)   # replica_runs: one axis per bucket
    layout = shard_layout([p.numel() for p in params], mesh, axis)
    masters = (HOST if placement == "host" else params[0].device) if masters_needed(ctx.strategy) else None
    weights = flatten_bucket(params, layout) if masters is None else None  # gathered into in place
    root.add_module(f"reduce_{k}", ReduceScatterGrads(params, layout, mesh, stage, axis))
    root.add_module(f"shard_{k}", WaitShard(params, layout, mesh, stage, axis))
    root.add_module(f"update_{k}", ShardStep(params, layout, mesh, stage, names, masters, dtype, axis=axis,
                                             weights=weights))
    root.add_module(f"gather_{k}", AllGatherParams(params, layout, mesh, stage, axis, weights))
    root.add_module(f"weights_{k}", GatheredWeights(params, layout, mesh, stage, axis))
    row = TensorMeta((layout.shard + layout.flags,), ctx.strategy.gradient_dtype)
    shard = TensorMeta((layout.shard,), dtype)
    gathered = TensorMeta((layout.shard * layout.dp,), dtype)
    value = _node(graph, f"reduce_{k}", (), k, PHASE_LAUNCH, row, "device")
    value = _node(graph, f"shard_{k}", (value,), k, PHASE_STEP, row, "device")
    value = _node(graph, f"update_{k}", (value,), k, PHASE_STEP, shard, placement)
    value = _node(graph, f"gather_{k}", (value,), k, PHASE_STEP, gathered, "device")
    value = _node(graph, f"weights_{k}", (value,), k, PHASE_WRITE, gathered, "device")
    if weights is None:  # fp32 masters: the gathered compute weights are copied into the parameters
        root.add_module(f"write_{k}", WriteParams(params))
        _node(graph, f"write_{k}", (value,), k, PHASE_WRITE, gathered, "device")


def _zero3_bucket(root, graph, k: int, names: List[str], params, placement: str, ctx) -> Unsharded:
    mesh, dtype = ctx.mesh, compute_dtype(ctx.strategy)
    axis = replica_axis(names[0], ctx.results.expert_shards)   # zero3_runs: one axis per bucket
    layout = shard_layout([p.numel() for p in params], mesh, axis)
    masters = (HOST if placement == "host" else params[0].device) if masters_needed(ctx.strategy) else None
    bucket = Unsharded(k, layout, names, [tuple(p.shape) for p in params], dtype, params[0].device, mesh,
                       ctx.strategy.gradient_dtype, axis)
    root.add_module(f"reduce_{k}", TakeReduced(bucket))
    root.add_module(f"shard_{k}", WaitShard([], layout, mesh, 3, axis))
    root.add_module(f"update_{k}", ShardStep(params, layout, mesh, 3, names, masters, dtype, unsharded=bucket,
                                             axis=axis))
    row = TensorMeta((layout.shard + layout.flags,), ctx.strategy.gradient_dtype)
    shard = TensorMeta((layout.shard,), dtype)
    value = _node(graph, f"reduce_{k}", (), k, PHASE_LAUNCH, row, "device")
    value = _node(graph, f"shard_{k}", (value,), k, PHASE_STEP, row, "device")
    value = _node(graph, f"update_{k}", (value,), k, PHASE_STEP, shard, placement)
    if masters is not None:
        root.add_module(f"write_{k}", WriteShard(bucket))
        _node(graph, f"write_{k}", (value,), k, PHASE_WRITE, shard, "device")
    return bucket


def check_one_local_stage(gm: torch.fx.GraphModule, ctx) -> None:
    """zero=3 gathers a bucket inside one stage's program: a weight that two stages of one pp
    rank read (virtual stages) cannot be gathered for both. Checked for every pp rank, so that
    every rank refuses alike."""
    trained = {str(n.target) for n in gm.graph.nodes if n.op == "get_attr" and record(n).update_placement is not None}
    for name, stages in parameter_readers(gm).items():
        if name not in trained:
            continue
        for pp_rank in range(ctx.mesh.pp):
            local = sorted(s for s in stages if ctx.strategy.stage_rank(s) == pp_rank)
            if len(local) > 1:
                raise ValueError(
                    f"Strategy.zero=3: the parameter {name!r} is read by pipeline stages {local}, which "
                    f"all run on pp rank {pp_rank} (virtual_stages={ctx.strategy.virtual_stages}); ZeRO-3 gathers "
                    f"a bucket inside one stage's program, so a weight two stages of one rank read is not built "
                    f"yet. Fix: a partition that keeps its readers in one stage, virtual_stages=1 (for zbv: "
                    f"schedule='zero-bubble'), or zero=2.")


def replica_runs(names: List[str], expert_shards) -> List[List[str]]:
    """The dense weights, then the expert weights (expert parallelism), each in the given
    order: a bucket is reduced over one group (dp, or edp for experts), so never mixes them;
    GradientSync's own buckets come in this order too."""
    runs = ([n for n in names if replica_axis(n, expert_shards) == "dp"],
            [n for n in names if replica_axis(n, expert_shards) == "edp"])
    return [run for run in runs if run]


def zero3_runs(names: List[str], readers, stage_rank, expert_shards, edp: int,
               containers: Sequence[str] = ()) -> List[List[str]]:
    """zero=3's runs: the dense weights as bucket_runs keeps them (one stage's weights each, a
    tied weight alone), then the expert weights: sharded over edp (edp > 1), one run per experts
    module (`containers`: the list layout's), gathered around its call alone; whole on the rank
    (edp = 1, experts_stage), one run."""
    dense = [n for n in names if replica_axis(n, expert_shards) == "dp"]
    experts = [n for n in names if replica_axis(n, expert_shards) == "edp"]
    return bucket_runs(dense, readers, stage_rank) + expert_runs(experts, edp, containers)


def _bucketed_parameters(gm: torch.fx.GraphModule, ctx, runs=None) -> List[Tuple[List[nn.Parameter], List[str], str]]:
    """This rank's trained parameters in buckets of bucket_bytes of their gradients (in
    Strategy.gradient_dtype): per bucket its parameters, their names and where its update
    runs (the first parameter's placement).
    `runs` (names, in bucket order) keeps parameters of different runs in different buckets;
    by default dense and expert weights (replica_runs)."""
    nodes = rank_parameters(gm, ctx)
    params = {name: fetch_attr(gm, name) for name in nodes}
    names = {id(p): name for name, p in params.items()}
    size = torch.empty((), dtype=ctx.strategy.gradient_dtype).element_size()
    runs = runs or (lambda names: replica_runs(names, ctx.results.expert_shards))
    buckets = [bucket for run in runs(list(nodes))
               for bucket in bucketize([params[name] for name in run], ctx.options.bucket_bytes, size)]
    return [(bucket, [names[id(p)] for p in bucket], _update_placement(nodes[names[id(bucket[0])]], ctx.strategy))
            for bucket in buckets]


def build_update(gm: torch.fx.GraphModule, ctx) -> torch.fx.GraphModule:
    previous = ctx.previous.update if ctx.previous is not None else None
    if previous is not None:  # compiled again (with the loss): same parameters, same state
        ctx.results.update = previous
        return gm
    if not needs_update_program(ctx.strategy, gm, ctx.mesh.dp):
        return gm
    root, graph = nn.Module(), torch.fx.Graph()
    chains: List[Tuple[List[nn.Parameter], List[str], str]] = []
    unsharded: List[Unsharded] = []
    if zero_active(ctx.strategy, ctx.mesh.dp) and ctx.strategy.zero == 3:
        check_one_local_stage(gm, ctx)
        readers, experts = parameter_readers(gm), ctx.results.expert_shards
        containers = expert_list_paths(ctx.model)
        chains = _bucketed_parameters(gm, ctx, lambda names: zero3_runs(names, readers, ctx.strategy.stage_rank,
                                                                       experts, ctx.mesh.edp, containers))
        for k, (bucket, names, placement) in enumerate(chains):
            if replica_axis(names[0], experts) == "edp" and experts_stage(3, ctx.mesh.edp) < 3:
                # whole on the rank (edp = 1): a zero=2 chain over edp
                _zero_bucket(root, graph, k, names, bucket, placement, ctx)
            else:
                unsharded.append(_zero3_bucket(root, graph, k, names, bucket, placement, ctx))
    elif zero_active(ctx.strategy, ctx.mesh.dp):
        chains = _bucketed_parameters(gm, ctx)
        for k, (bucket, names, placement) in enumerate(chains):
            _zero_bucket(root, graph, k, names, bucket, placement, ctx)
    elif masters_needed(ctx.strategy):
        chains = _bucketed_parameters(gm, ctx)
        for k, (bucket, names, placement) in enumerate(chains):
            _bucket(root, graph, k, names, bucket, placement, ctx.strategy)
    # the device parameters of each bucket, for the runner (zero=3: the shard, all there is)
    shards = {b.index: [b.shard] for b in unsharded}
    buckets = [shards.get(k, bucket) for k, (bucket, _, _) in enumerate(chains)]
    graph.output(None)
    program = torch.fx.GraphModule(root, graph, class_name="GraphparUpdate")
    program.buckets = buckets
    program.unsharded = unsharded  # zero=3's buckets, which shard_parameters puts into the rank's program
    ctx.results.update = program
    return gm
