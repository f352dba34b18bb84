"""sync_batch_norm: under data parallelism, batch norm uses statistics of the global batch.

    before: bn = graphpar.runtime.ops.batch_norm(x, running_mean, running_var, w, b, 0.1, 1e-05)
    after:  bn = graphpar.runtime.sync_batch_norm.sync_batch_norm(x, running_mean, running_var, w, b,
                                                          0.1, 1e-05, 'dp')

Without it each replica normalises with its own slice of the batch and keeps its own running
statistics, so dp > 1 would not match single-device training on the global batch. No-op at
dp = 1. The collective is named by mesh axis; the executor binds the axis to its group.

What cannot match is refused, at any dp: a batch norm in training with microbatches > 1
(each microbatch would be normalised with its own rows' statistics, and one microbatch's
backward starts before the next one's forward), and at dp > 1 a batch norm kept as module
code (no running statistics, or momentum=None: ir.md), which this pass does not synchronise.
A frozen batch norm (`module.eval()`) uses its running statistics and is neither.
"""
from __future__ import annotations

from typing import List, Tuple

import torch.fx
import torch.nn as nn

from graphpar.runtime import ops
from graphpar.ir import record, stamp
from graphpar.runtime.sync_batch_norm import sync_batch_norm as sync_op

PASS = "sync_batch_norm"


class BatchStatisticsError(ValueError):
    pass


def sync_batch_norm(gm, ctx):
    _check_batch_statistics(gm, ctx)
    if ctx.mesh.dp == 1:
        return gm
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is ops.batch_norm:
            node.target = sync_op
            node.args = tuple(node.args) + ("dp",)
            stamp(node, PASS)
    return gm


def _training_batch_norms(gm: torch.fx.GraphModule, model: nn.Module) -> Tuple[List[str], List[str]]:
    """Module paths of the batch norms in training mode: (lowered to ops.batch_norm, left as
    module code)."""
    lowered, kept = [], []
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is ops.batch_norm:
            path, found = record(node).module_path, lowered
        elif node.op == "call_module" and isinstance(gm.get_submodule(node.target), nn.modules.batchnorm._BatchNorm):
            path, found = str(node.target), kept
        else:
            continue
        if model.get_submodule(path).training and path not in found:
            found.append(path)
    return lowered, kept


def _check_batch_statistics(gm: torch.fx.GraphModule, ctx) -> None:
    microbatches = ctx.strategy.microbatches
    lowered, kept = _training_batch_norms(gm, ctx.model)
    training = lowered + kept
    if microbatches > 1 and training:
        raise BatchStatisticsError(
            f"Strategy.microbatches={microbatches} with batch norm {', '.join(map(repr, training))} in training: each "
            f"microbatch would be normalised with the statistics of its own rows, not the batch's as one device "
            f"normalises it. Fix: use microbatches=1, freeze the batch norms (module.eval(): running statistics), or "
            f"a per-sample norm (LayerNorm, GroupNorm).")
    if ctx.mesh.dp > 1 and kept:
        raise BatchStatisticsError(
            f"Strategy(dp={ctx.mesh.dp}) with batch norm {', '.join(map(repr, kept))} kept as module code "
            f"(track_running_stats=False or momentum=None): it would normalise each rank's rows with their own "
            f"statistics, which graphpar synchronises over dp only for batch norms with running statistics and a "
            f"momentum. Fix: track_running_stats=True with a momentum, freeze it (module.eval()), or dp=1.")
