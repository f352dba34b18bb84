"""annotate_shards: a ShardSpec on every tensor value, from the Megatron pattern in the graph.

    before: linear = linear(ln_1, q_weight, q_bias)              # f32[2, 16, 32] [trace]
    after:  linear = linear(ln_1, q_weight, q_bias)              # f32[2, 16, 32] S(2) [annotate_shards]
            q_weight = get_attr[blocks.0.attn.q.weight]          # f32[32, 32] S(0)

Only decides (tag, then apply): the region solver (passes/tp/solver.py) picks column and
row layers, vocab-parallel embeddings and the parallel cross entropy; its plan goes to
ctx.results.tp_plan for rewrite_parallel_layers, insert_collectives and lower_to_rank.
Shapes stay global here. One rewrite comes first: a fused projection whose blocks of heads tp
cannot all split (Falcon-7B's q heads with one shared k/v head) becomes one linear per block
over the blocks of its weight (passes/tp/fused.py), so that the q block can be a column
layer while the k/v blocks stay whole. Linears left replicated are listed in the plan's fallbacks (the
coverage report); Strategy(strict=True) makes any fallback an error. At tp=1 every value
is Replicate. With Strategy(sequence_parallel=True) the values between the TP regions
(row outputs, norms, dropout, residual adds) are then tagged SequenceShard
(passes/tp/sequence.py):

    linear_3 = linear(view_3, proj_weight, proj_bias)     # f32[2, 16, 32] Sq(1)   (was R)
    add_1 = add(add, linear_3)                            # f32[2, 16, 32] Sq(1)
"""
from __future__ import annotations

from graphpar.ir import Replicate, TensorMeta, record, stamp
from graphpar.passes.tp.fused import split_fused_blocks
from graphpar.passes.tp.sequence import solve_sequence
from graphpar.ir.compiled import TPPlan
from graphpar.passes.tp.solver import solve

PASS = "annotate_shards"


def _strict_error(plan: TPPlan) -> ValueError:
    lines = [f"  {module or '<top>'} ({name}): {reason}" for name, module, reason in plan.fallbacks]
    return ValueError(
        f"Strategy(strict=True, tp={plan.tp}): {len(plan.fallbacks)} layer(s) have no sharding rule "
        f"and would be replicated:\n" + "\n".join(lines) +
        "\nFix: use strict=False to accept replication (reported by pm.report()), or list the modules "
        "in compile(..., tp_replicate=[...]) to replicate them on purpose.")


def annotate_shards(gm, ctx):
    tp = ctx.mesh.tp
    if tp > 1:
        split_fused_blocks(gm, tp, PASS)
    plan = solve(gm, tp, ctx.options.tp_replicate) if tp > 1 else TPPlan(tp)
    if ctx.strategy.strict and plan.fallbacks:
        raise _strict_error(plan)
    if tp > 1 and ctx.strategy.sequence_parallel:
        solve_sequence(gm, plan)
    for node in gm.graph.nodes:
        if node.op == "output":
            continue
        rec = record(node)
        spec = plan.specs.get(node.name, Replicate()) if isinstance(rec.value, TensorMeta) else None
        stamp(node, PASS, spec=spec)
    ctx.results.tp_plan = plan
    return gm
