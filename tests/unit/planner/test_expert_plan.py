"""gp.plan with Strategy(ep=...) (graphpar/planner/plan.py): expert bytes per rank and the
expert gradients' all-reduce, against what lower_rank's program of each rank holds."""
import pytest
import torch
import torch.nn.functional as F

import graphpar as gp
from graphpar.frontend.compile import lower_rank
from graphpar.planner.plan import EP_NOTE
from tests.targets import ep_targets

BATCH = (torch.randn(6, 8), torch.randint(0, 5, (6,)))


def held_bytes(strategy, rank):
    compiled = lower_rank(ep_targets.tiny_moe(), strategy, (BATCH[0],), rank=rank, world_size=strategy.world_size,
                          loss_fn=F.cross_entropy, example_target=BATCH[1]).compiled
    return sum(p.numel() * p.element_size() for p in compiled.gm.parameters())


@pytest.mark.parametrize("dp, ep", [(2, 2), (4, 2), (4, 4)])
def test_plan_counts_each_ranks_share_of_the_experts(dp, ep):
    strategy = gp.Strategy(dp=dp, ep=ep)
    report = gp.plan(ep_targets.tiny_moe(), strategy, (BATCH[0],), loss_fn=F.cross_entropy, example_target=BATCH[1])
    model = ep_targets.tiny_moe()
    experts = sum(p.numel() * 4 for n, p in model.named_parameters() if n.startswith("experts."))
    dense = sum(p.numel() * 4 for n, p in model.named_parameters() if not n.startswith("experts."))
    assert EP_NOTE in report.notes
    for rank in range(dp):
        plan = report.ranks[rank]
        assert plan.param_bytes == held_bytes(strategy, rank) == dense + experts // ep
        assert plan.grad_bytes == plan.param_bytes
        summed = {t.axis: t.bytes for t in plan.collectives if t.op == "all_reduce" and "gradient" in t.what}
        # each gradient plus its usage flag (graphpar/runtime/grad_sync.py): 3 dense and 2 expert weights
        assert summed["dp"] == dense + 4 * 3
        if dp // ep > 1:
            assert summed["edp"] == experts // ep + 4 * 2
        else:
            assert "edp" not in summed   # every rank holds experts of its own: nothing to average


def test_plan_without_ep_counts_every_expert():
    report = gp.plan(ep_targets.tiny_moe(), gp.Strategy(dp=2), (BATCH[0],), loss_fn=F.cross_entropy,
                     example_target=BATCH[1])
    assert report.ranks[0].param_bytes == sum(p.numel() * 4 for p in ep_targets.tiny_moe().parameters())
    assert EP_NOTE not in report.notes
