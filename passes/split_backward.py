"""split_backward: under a schedule that splits backward (zero-bubble, zbv), the weight
gradient of each layer that can have it on its own becomes work of its own.

    before: linear_4 = linear(layer_norm_1, blocks_0_mlp_fc_weight, blocks_0_mlp_fc_bias)
    after:  linear_4 = graphpar.runtime.split_backward.linear(layer_norm_1, blocks_0_mlp_fc_weight,
                                                              blocks_0_mlp_fc_bias)

The call keeps its name, arguments and record (stamped `split_backward`). At run time
(graphpar/runtime/split_backward.py) its backward computes only the gradient of its input,
the `backward` instruction (B) the previous stage waits for, and queues the weight
gradient for the schedule's `backward_weight` instruction (W) of the same stage and
microbatch, which the schedule runs later, where the pipeline would idle.

Which calls (graphpar.runtime.split_backward.SPLIT_OF): `F.linear` / `aten.linear`,
`aten.addmm` (GPT-2's Conv1D), `aten.mm` (a row-parallel Conv1D's local matmul: under tp
the collectives are nodes of their own, so only the local matmul is split), `F.embedding`
/ `aten.embedding`, where a weight argument reads a trainable parameter (a get_attr node)
and no keyword argument holds a tensor. Left alone, their weight gradients computed in B
as before (correct, only not deferred):

    other ops reading parameters     layer norms, convolutions, a matmul on a transposed weight
    calls inside a recompute region  passes/recompute.py moved them into the region's body,
                                     whose backward runs the body again as a whole
    zero=3 weights                   read from a gathered bucket (passes/shard_parameters.py),
                                     whose whole gradient is reduce-scattered as soon as
                                     backward has it: it cannot wait for W
    host embeddings                  `HostEmbedding` modules (offload_embedding)
    F.embedding with max_norm        it rewrites the table in forward; with sparse=True its
    or sparse=True                   gradient is sparse

No-op under the other schedules: their backward stays one instruction.
"""
from __future__ import annotations

import torch
import torch.fx
import torch.nn.functional as F

from graphpar.ir import stamp
from graphpar.runtime.split_backward import SPLIT_OF, trainable_parameter
from graphpar.strategy import SPLIT_BACKWARD

PASS = "split_backward"

# arguments that keep a call whole when set: (name, position, the default that allows the split)
_KEPT_WHOLE = {
    F.embedding: (("max_norm", 3, None), ("sparse", 6, False)),
    torch.ops.aten.embedding.default: (("sparse", 4, False),),
}


def _argument(node: torch.fx.Node, name: str, position: int, default):
    return node.args[position] if len(node.args) > position else node.kwargs.get(name, default)


def splits(gm: torch.fx.GraphModule, node: torch.fx.Node) -> bool:
    """Whether `node` gets its weight gradient as work of its own."""
    if node.op != "call_function" or node.target not in SPLIT_OF:
        return False
    if any(isinstance(v, torch.fx.Node) for v in node.kwargs.values()):
        return False
    if any(_argument(node, name, position, default) != default
           for name, position, default in _KEPT_WHOLE.get(node.target, ())):
        return False
    weights = SPLIT_OF[node.target].weights
    return any(trainable_parameter(gm, node.args[i]) is not None for i in weights if i < len(node.args))


def split_backward(gm: torch.fx.GraphModule, ctx) -> torch.fx.GraphModule:
    if ctx.strategy.schedule not in SPLIT_BACKWARD:
        return gm
    for node in [n for n in gm.graph.nodes if splits(gm, n)]:
        node.target = SPLIT_OF[node.target]
        stamp(node, PASS)
    return gm
