"""sync_batch_norm: under data parallelism, batch norm uses statistics of the global batch.

    before: bn = graphpar.runtime.ops.batch_norm(x, running_mean, running_var, w, b, 0.1, 1e-05)
    after:  bn = graphpar.runtime.sync_batch_norm.sync_batch_norm(x, running_mean, running_var, w, b,
                                                          0.1, 1e-05, 'dp')

Without it each replica normalises with its own slice of the batch and keeps its own running
statistics, so dp > 1 would not match single-device training on the global batch. No-op at
dp = 1. The collective is named by mesh axis; the executor binds the axis to its group.
"""
from __future__ import annotations

from graphpar.runtime import ops
from graphpar.ir import stamp
from graphpar.runtime.sync_batch_norm import sync_batch_norm as sync_op

PASS = "sync_batch_norm"


def sync_batch_norm(gm, ctx):
    if ctx.mesh.dp == 1:
        return gm
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is ops.batch_norm:
            node.target = sync_op
            node.args = tuple(node.args) + ("dp",)
            stamp(node, PASS)
    return gm
