"""Wiring of a pipeline-parallel rank: stage programs for training and evaluation, the
tied-weight groups, and the executor (graphpar/runtime/pipeline/executor.py).

Tied weights (an embedding on the first stage, the LM head reading the same table on the
last) exist once per stage that reads them; their gradients are summed over a group of the
ranks holding those stages (same dp and tp coordinates) before the data-parallel average,
so every copy takes the same optimizer step. torch's pipelining front end copies the tied
weight and leaves each copy with only its own stage's gradient: a silent wrong result.
"""
from __future__ import annotations

import dataclasses
import datetime
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from graphpar.distributed import groups as distributed
from graphpar.ir.compiled import CompiledRank
from graphpar.runtime.grad_divisor import GradientDivisor
from graphpar.runtime.single_stage import forward_only, loss_only
from graphpar.runtime.pipeline.executor import PipelineExecutor
from graphpar.runtime import zero3


def _projected(program, gm, input_names):
    names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    return dataclasses.replace(program, gm=gm, inputs=[n for n in names if n in input_names])


def stage_programs(stages, loss_outputs: int, input_names) -> Tuple[Dict, Dict]:
    """(training, evaluation) program of each local stage: the last stage returns only the
    loss (or (loss_sum, count)) for training, and only the model outputs (no loss, no target)
    for evaluation."""
    train, evaluate = {}, {}
    for stage, program in stages.items():
        if program.is_last:
            train[stage] = (_projected(program, loss_only(program.gm, loss_outputs), input_names) if loss_outputs
                            else program)
            evaluate[stage] = _projected(program, forward_only(program.gm, loss_outputs), input_names)
        else:
            train[stage] = evaluate[stage] = program
    return train, evaluate


def tied_groups(param_stages: Mapping[str, Sequence[int]], local_params: Dict[str, torch.nn.Parameter],
                mesh, stage_rank: Callable[[int], int]) -> List[Tuple[torch.nn.Parameter, object]]:
    """Process groups summing the gradients of weights read by stages on several pp ranks
    (`stage_rank`: the pp rank of a stage, Strategy.stage_rank).

    new_group is collective over the whole world: every rank creates every group, in the same
    order, and keeps those it belongs to."""
    if not (dist.is_available() and dist.is_initialized()):
        return []
    timeout = datetime.timedelta(seconds=distributed.DEFAULT_TIMEOUT_S)
    result = []
    for name in sorted(param_stages):
        pp_ranks = sorted({stage_rank(s) for s in param_stages[name]})
        if len(pp_ranks) < 2:
            continue
        for dp_rank in range(mesh.dp):
            for tp_rank in range(mesh.tp):
                ranks = [mesh.rank_at(dp_rank, p, tp_rank) for p in pp_ranks]
                group = dist.new_group(ranks, timeout=timeout)
                if mesh.rank in ranks and name in local_params:
                    result.append((local_params[name], group))
    return result


def pipeline_executor(compiled: CompiledRank, grad_sync, rng, divisor: GradientDivisor,
                      tied: Optional[List[Tuple[torch.nn.Parameter, object]]] = None) -> PipelineExecutor:
    """The executor of one program. `tied`: the tied-weight groups an earlier program of the
    same parameters made (a program for another input shape; new_group is collective over
    the world, and the other ranks are not compiling then)."""
    loss_outputs, input_names, mesh = compiled.program.loss_outputs, list(compiled.input_names), compiled.mesh
    train, evaluate = stage_programs(compiled.stages, loss_outputs, input_names)
    if tied is None:
        local = {name: p for prog in train.values() for name, p in prog.gm.named_parameters()}
        # zero=3: a weight read on several pp ranks is alone in its bucket, whose shard stands for it
        local.update({b.names[0]: b.shard for prog in train.values() for b in zero3.buckets_of(prog.gm)
                      if len(b.names) == 1})
        tied = tied_groups(compiled.param_stages, local, mesh, compiled.strategy.stage_rank)
    executor = PipelineExecutor(train, compiled.stage_plan.num_stages, compiled.strategy, mesh, divisor, grad_sync,
                                tied, rng, distributed.DEFAULT_TIMEOUT_S, input_names, compiled.program.loss_count)
    executor.eval_programs = evaluate
    executor.output_metas = list(compiled.output_meta)[loss_outputs:]
    executor.micro_batch = _micro_batch(compiled.example_inputs)
    return executor


def _micro_batch(example_inputs) -> int:
    flat = torch.utils._pytree.tree_flatten(example_inputs)[0]
    return next(t.shape[0] for t in flat if isinstance(t, torch.Tensor) and t.dim() > 0)
