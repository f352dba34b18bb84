"""passes/split_backward.py on real programs (lower_rank: no processes): which calls get
their weight gradient as work of their own under the schedules that split backward, and
which are left alone."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import graphpar as gp
from graphpar.ir import record
from graphpar.runtime import split_backward as split
from tests import helpers

SPLIT_CALLS = frozenset(split.SPLIT_OF.values())


def _stages(model, loss_fn, strategy, rank=0, world=None, batch=4):
    x, y = helpers.token_batch(batch=batch)
    result = gp.lower_rank(model, strategy, (x,), rank=rank, world_size=world or strategy.world_size,
                           loss_fn=loss_fn, example_target=y)
    return result.compiled.stages


def _split_reads(gm):
    """(function name, weight read) of every split call of a program."""
    reads = []
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in SPLIT_CALLS:
            assert record(node).set_by == "split_backward"
            reads += [(node.target.__name__, node.args[i].target) for i in node.target.weights
                      if i < len(node.args) and isinstance(node.args[i], torch.fx.Node)]
    return reads


def test_transformers_gpt2_splits_every_conv1d_embedding_and_the_tied_head():
    stages = _stages(helpers.hf_gpt2(), helpers.hf_causal_lm_loss,
                     gp.Strategy(pp=2, microbatches=2, schedule="zbv", virtual_stages=2), rank=0)
    assert sorted(stages) == [0, 3]   # the V: rank 0 holds the first and the last stage
    assert _split_reads(stages[0].gm) == [("aten_embedding", "transformer.wte.weight"),
                                          ("aten_embedding", "transformer.wpe.weight")]
    assert _split_reads(stages[3].gm) == [("aten_linear", "transformer.wte.weight")]   # the tied table again
    middle = _stages(helpers.hf_gpt2(), helpers.hf_causal_lm_loss,
                     gp.Strategy(pp=2, microbatches=2, schedule="zbv", virtual_stages=2), rank=1)
    # c_attn, c_proj, c_fc, c_proj: weight and bias each
    assert [name for name, _ in _split_reads(middle[1].gm)] == ["addmm"] * 8


def test_our_gpt_splits_its_linears_and_embeddings():
    stages = _stages(helpers.tiny_gpt(), helpers.lm_loss, gp.Strategy(pp=2, microbatches=2, schedule="zero-bubble"))
    reads = _split_reads(stages[0].gm)
    assert ("embedding", "wte.weight") in reads and ("embedding", "wpe.weight") in reads
    assert {name for name, _ in reads} == {"embedding", "linear"} and len(reads) == 2 + 6 * 2  # q k v proj fc proj
    norms = [n for n in stages[0].gm.graph.nodes if "layer_norm" in n.name and n.op == "call_function"]
    assert norms and not any(n.target in SPLIT_CALLS for n in norms)   # left in backward


@pytest.mark.parametrize("schedule, virtual", [("1f1b", 1), ("gpipe", 1), ("interleaved-1f1b", 2)])
def test_other_schedules_keep_backward_whole(schedule, virtual):
    stages = _stages(helpers.tiny_gpt(n_layer=4), helpers.lm_loss,
                     gp.Strategy(pp=2, microbatches=2, schedule=schedule, virtual_stages=virtual))
    assert not any(_split_reads(program.gm) for program in stages.values())


def test_recomputed_blocks_and_zero3_weights_stay_whole():
    """A recompute region's body runs again in its own backward; a zero=3 weight is a view of
    a gathered bucket whose gradient is reduce-scattered as backward makes it."""
    recomputed = _stages(helpers.tiny_gpt(), helpers.lm_loss,
                         gp.Strategy(pp=2, microbatches=2, schedule="zero-bubble", recompute="full"), rank=1)[1]
    bodies = [m.body for m in recomputed.gm.modules() if hasattr(m, "body")]
    assert bodies and not any(_split_reads(body) for body in bodies)
    assert _split_reads(recomputed.gm) == [("linear", "wte.weight")]   # the tied head, outside the blocks
    sharded = _stages(helpers.tiny_gpt(), helpers.lm_loss,
                      gp.Strategy(dp=2, pp=2, microbatches=2, schedule="zero-bubble", zero=3), rank=0, batch=8)
    assert _split_reads(sharded[0].gm) == []


class _Frozen(nn.Module):
    """An embedding with max_norm (it rewrites the table in forward), a frozen linear and a
    bias given by keyword: all left whole; one plain linear split."""

    def __init__(self):
        super().__init__()
        self.table = nn.Parameter(torch.randn(64, 8))
        self.frozen = nn.Linear(8, 8).requires_grad_(False)
        self.keyword = nn.Linear(8, 8)
        self.head = nn.Linear(8, 64)

    def forward(self, ids):
        h = F.embedding(ids, self.table, max_norm=1.0)
        h = self.frozen(h)
        h = F.linear(h, self.keyword.weight, bias=self.keyword.bias)
        return self.head(h)


def test_calls_that_must_stay_whole_are_left_alone():
    model = _Frozen()
    stages = _stages(model, lambda out, y: F.cross_entropy(out.flatten(0, 1), y.flatten()),
                     gp.Strategy(pp=2, microbatches=2, schedule="zero-bubble", partition=["head"]), rank=1)
    assert _split_reads(stages[1].gm) == [("linear", "head.weight"), ("linear", "head.bias")]
    first = _stages(model, lambda out, y: F.cross_entropy(out.flatten(0, 1), y.flatten()),
                    gp.Strategy(pp=2, microbatches=2, schedule="zero-bubble", partition=["head"]), rank=0)
    assert _split_reads(first[0].gm) == []
