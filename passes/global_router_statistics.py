"""global_router_statistics: under data parallelism, a mixture-of-experts load-balancing loss
uses the token fractions and router probabilities of the global batch.

    before: div = aten.div.Tensor(router_prob_sum, 128.0)      # this rank's rows
    after:  div = graphpar.runtime.batch_statistics.batch_mean(router_prob_sum, 128.0, 'dp')
                                                                # every dp rank's rows in training

The loss (Switch Transformer's, which every `transformers` MoE model computes in its own
copy of `load_balancing_loss_func` when `output_router_logits=True`) is E times the sum
over experts of (fraction of the token slots routed to the expert) times (mean router
probability of the expert). Each is a sum over the batch's rows divided by their count;
the product of two means is not linear in the batch, so averaging each rank's loss over dp
(all data parallelism does) is not the single-device loss. This pass turns each statistic's
division into a mean over every dp rank's rows: its sum and its row count (a constant of the
trace, equal on every dp rank, or a tensor when an attention mask weights the rows) summed
over dp in training, so every rank computes the global batch's loss; `pm(x)`, this rank's
batch, keeps its own rows' (graphpar/runtime/batch_statistics.py).

Found by where the trace says the nodes come from: the nodes of a call of
`load_balancing_loss_func` (a frame of their stack trace is in it, or calls it: torch.export
records the function's own frame in some processes and stops at the line that calls it in
others), among them the divisions of a 1-D per-expert sum. A call whose divisions are not of that form is refused, as are what
cannot be exact: microbatches > 1 (each microbatch's statistics are of its rows only, and
the backward of one starts before the forward of the next) and a token-weighted loss
(`(loss_sum, count)`: train_step divides by the global count, not by dp). No-op at dp = 1.
"""
from __future__ import annotations

from typing import List

import torch
import torch.fx

from graphpar.ir import TensorMeta, record, stamp
from graphpar.runtime.batch_statistics import batch_mean

PASS = "global_router_statistics"
LOSS_FUNCTION = "load_balancing_loss_func"   # transformers' name, in every MoE model's module


class RouterStatisticsError(ValueError):
    pass


def global_router_statistics(gm: torch.fx.GraphModule, ctx) -> torch.fx.GraphModule:
    dp = ctx.mesh.dp
    region = [n for n in gm.graph.nodes if n.op == "call_function" and _called_from(n, LOSS_FUNCTION)]
    if dp == 1 or not region:
        return gm
    statistics = [n for n in region if n.target is torch.ops.aten.div.Tensor and _per_expert(n.args[0])]
    _check(region, statistics, ctx)
    for division in statistics:
        division.target, division.args = batch_mean, (*division.args, "dp")
        stamp(division, PASS)
    gm.graph.lint()
    gm.recompile()
    return gm


def _called_from(node: torch.fx.Node, function: str) -> bool:
    lines = (node.meta.get("stack_trace") or "").strip().splitlines()
    return any(line.rstrip().endswith(f", in {function}") or f"{function}(" in line for line in lines)


def _per_expert(value) -> bool:
    return isinstance(value, torch.fx.Node) and isinstance(record(value).value, TensorMeta) and \
        len(record(value).value.shape) == 1 and record(value).value.dtype.is_floating_point


def _check(region: List[torch.fx.Node], statistics: List[torch.fx.Node], ctx) -> None:
    where = f"the load-balancing loss ({LOSS_FUNCTION}, output_router_logits=True) of {type(ctx.model).__name__}"
    fix = "or train without it (output_router_logits=False, or a loss_fn that does not add aux_loss)"
    if len(statistics) != 2:
        raise RouterStatisticsError(
            f"{where} at dp={ctx.mesh.dp}: its traced code ({len(region)} nodes) has {len(statistics)} divisions of a "
            f"per-expert sum by a row count where the Switch loss has 2 (token fractions, router probabilities), so "
            f"it cannot be made the global batch's, and averaging each rank's over dp is not the single-device loss. "
            f"Fix: use dp=1, {fix}.")
    if ctx.strategy.microbatches > 1:
        raise RouterStatisticsError(
            f"{where} with microbatches={ctx.strategy.microbatches}: each microbatch's token fractions and router "
            f"probabilities would be of its rows only, and its product of the two is not that of the global batch "
            f"(the backward of one microbatch starts before the next one's forward). Fix: use microbatches=1, {fix}.")
    if ctx.results.program.loss_count:
        raise RouterStatisticsError(
            f"{where} in a token-weighted loss ((loss_sum, count)): train_step divides gradients by the global "
            f"count, so the global batch's load-balancing term cannot be weighted as one device weights it. "
            f"Fix: return the mean loss from loss_fn, {fix}.")
