"""gp.plan with Strategy(ep=...) (graphpar/planner/plan.py, expert_plan.py): expert bytes per
rank, the expert gradients' all-reduce, against what lower_rank's program of each rank holds,
and the all-to-all bytes of a routing (tests/multiprocess/runtime/test_experts.py checks them
against real runs)."""
import re

import pytest
import torch
import torch.nn.functional as F

import graphpar as gp
from graphpar.frontend.compile import lower_rank
from graphpar.planner import auto
from graphpar.planner.expert_plan import record_routing
from graphpar.runtime.experts import expert_capacity, first_pairs
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
    assert any(note.startswith("ep: ") for note in report.notes)
    for rank in range(dp):
        plan = report.ranks[rank]
        assert plan.param_bytes == held_bytes(strategy, rank) == dense + experts // ep
        assert plan.expert_bytes == experts // ep
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
    assert report.ranks[0].expert_bytes == 0
    assert not any(note.startswith("ep: ") for note in report.notes)
    assert not any(t.op == "all_to_all" for t in report.ranks[0].collectives)


def _exchanged(report, rank):
    return [(t.bytes, t.count) for t in report.ranks[rank].collectives if t.op == "all_to_all"]


def test_all_to_all_bytes_follow_the_routing():
    # TinyMoE at dp=2, ep=2: 3 tokens per rank, k=2, rows of 8 fp32, int64 indices. Every pair
    # of both ranks goes to expert 0 (rank 0's): rank 0 receives 12 pairs, rank 1 none.
    strategy = gp.Strategy(dp=2, ep=2)
    routing = {"experts": torch.tensor([[0, 0]] * 6)}
    report = gp.plan(ep_targets.tiny_moe(), strategy, (BATCH[0][:3],), loss_fn=F.cross_entropy,
                     example_target=BATCH[1][:3], routing=routing)
    pairs, row, index = 6, 8 * 4, 8
    # the input x needs no gradient, so dispatch's backward does not run: 4 calls after the counts
    for rank, received in ((0, 12), (1, 0)):
        assert _exchanged(report, rank) == [(2 * 8, 1), ((2 * pairs + received) * row + pairs * index, 4)]
    balanced = gp.plan(ep_targets.tiny_moe(), strategy, (BATCH[0][:3],), loss_fn=F.cross_entropy,
                       example_target=BATCH[1][:3])
    assert _exchanged(balanced, 1) == [(2 * 8, 1), ((3 * pairs) * row + pairs * index, 4)]
    assert "balanced routing" in balanced.notes[-1] and "the given routing" in report.notes[-1]


@pytest.mark.parametrize("strategy", [gp.Strategy(tp=2, ep=2), gp.Strategy(dp=2, tp=2, ep=2)], ids=["tp2-ep2", "dp2-tp2-ep2"])
def test_the_plan_lists_every_rank_that_holds_or_sends_its_own_bytes(strategy):
    # each tp rank dispatches its half of the tokens: with 6 of 8 tokens routed to expert 0,
    # the two tp ranks' all-to-all bytes differ, so both get a row; their dp twins do not
    batch = 8 // strategy.dp
    routing = {"experts": torch.tensor([[0, 0]] * 6 + [[1, 1]] * 2)}
    report = gp.plan(ep_targets.tiny_moe(), strategy, (torch.randn(batch, 8),), loss_fn=F.cross_entropy,
                     example_target=torch.randint(0, 5, (batch,)), routing=routing, tp_replicate=["head"])

    def held(r):
        return r.param_bytes, r.grad_bytes, r.optimizer_bytes, r.activation_peak_bytes, r.host_bytes, r.transfer_bytes

    roles = report.distinct_ranks()
    assert {r.tp_rank for r in roles} == {0, 1} and len({held(r) for r in roles}) == len(roles)
    assert all(any(held(r) == held(role) for role in roles) for r in report.ranks)
    rows = [line for line in report.to_text().splitlines() if re.match(r"\| \d+ \|", line)]
    assert [int(row.split("|")[1]) for row in rows] == [r.rank for r in roles]


def test_record_routing_is_the_routers_top_k():
    model = ep_targets.tiny_moe()
    routing = record_routing(model, BATCH[0])
    assert list(routing) == ["experts"]
    torch.testing.assert_close(routing["experts"], model.router(BATCH[0]).softmax(-1).topk(2, dim=-1).indices,
                               rtol=0, atol=0)


@pytest.mark.parametrize("routing, message", [
    ({"router": torch.zeros(6, 2, dtype=torch.long)}, "unknown: ['router'], missing: ['experts']"),
    ({"experts": torch.zeros(3, 2, dtype=torch.long)}, "int64[3, 2], but a routing holds the integer top_k_index "
                                                        "of the global batch: [6, 2]"),
    ({"experts": torch.zeros(6, 2)}, "float32[6, 2]")])
def test_a_routing_that_does_not_fit_is_refused(routing, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        gp.plan(ep_targets.tiny_moe(), gp.Strategy(dp=2, ep=2), (BATCH[0][:3],), loss_fn=F.cross_entropy,
                example_target=BATCH[1][:3], routing=routing)


# ---- the strategy search (graphpar/planner/auto.py) ------------------------------------------------
def test_the_search_enumerates_every_expert_degree_strategy_accepts():
    def degrees(experts):
        found = {}
        for s in auto.candidates(4, 8, experts=experts):
            found.setdefault((s.dp, s.tp, s.pp), set()).add(s.ep)
        return found
    # ep divides dp * tp and the experts per layer; at dp * tp = 1 there is nothing to split
    assert degrees(4)[(4, 1, 1)] == {1, 2, 4} and degrees(4)[(2, 2, 1)] == {1, 2, 4}
    assert degrees(4)[(2, 1, 2)] == degrees(4)[(1, 2, 2)] == {1, 2} and degrees(4)[(1, 1, 4)] == {1}
    assert degrees(6)[(4, 1, 1)] == {1, 2}
    assert {ep for layout in degrees(0).values() for ep in layout} == {1}
    # every ZeRO stage joins ep where there are dp ranks to shard over, and the host optimizer
    # and every recompute mode join it
    moe = [s for s in auto.candidates(4, 8, (None, "full"), experts=4) if s.ep > 1]
    assert moe and {s.recompute for s in moe} == {None, "full"}
    assert {s.offload_optimizer for s in moe} == {False, True}
    assert {s.zero for s in moe if s.dp > 1} == {0, 1, 2, 3} and {s.zero for s in moe if s.dp == 1} == {0}


def test_the_search_plans_and_costs_expert_parallel_candidates():
    result = auto.search(ep_targets.tiny_moe(), 2, (BATCH[0],), loss_fn=F.cross_entropy, example_target=BATCH[1])
    by_label = {c.label(): c for c in result.candidates}
    split, whole = by_label["dp=2 tp=1 pp=1 microbatches=1 1f1b ep=2"], by_label["dp=2 tp=1 pp=1 microbatches=1 1f1b"]
    assert not split.reason and split.cost is not None
    experts = sum(p.numel() * 4 for n, p in ep_targets.tiny_moe().named_parameters() if n.startswith("experts."))
    # half the experts: their parameters and gradients (no optimizer given)
    assert whole.terms["peak_bytes"] - split.terms["peak_bytes"] == 2 * experts // 2


def test_a_capacity_keeps_each_experts_first_pairs_in_token_order():
    # pairs t*K + k: expert 0 is chosen by tokens 0, 1, 2 and 3, expert 1 by 0, 2 and 3, expert
    # 2 by 1; with 2 pairs per expert (ceil(0.75 * 4 * 2 / 3) = 2) each keeps its first two
    index = torch.tensor([[0, 1], [0, 2], [1, 0], [0, 1]])
    capacity = expert_capacity(4, 2, 3, 0.75)
    assert capacity == 2
    assert first_pairs(index, 3, capacity).tolist() == [True, True, True, True, True, False, False, False]
    assert first_pairs(index, 3, 4).all()   # capacity T: nothing drops


def test_the_plan_without_a_routing_drops_only_below_the_mean_load():
    # TinyMoE, a local batch of T = 6 tokens, K = 2 experts each, over E = 4 experts: balanced
    # routing gives each expert T * K / E = 3 pairs. f = 1 (3 per expert) drops nothing; f = 0.5
    # (ceil(1.5) = 2 per expert) keeps 8 of the 12 pairs. Each pair sent
    # costs its row (8 fp32) in dispatch, combine and combine's gradient (the input rows need no
    # gradient) and its int64 expert id; the counts exchange, ep * 8 bytes, stays
    def sent(factor):
        strategy = gp.Strategy(dp=2, ep=2, expert_capacity_factor=factor)
        report = gp.plan(ep_targets.tiny_moe(), strategy, (BATCH[0],), loss_fn=F.cross_entropy,
                         example_target=BATCH[1])
        assert ("expert_capacity_factor" in report.notes[-1]) == (factor is not None)
        return sum(t.bytes for t in report.ranks[0].collectives if t.op == "all_to_all")
    per_pair, counts = 3 * 8 * 4 + 8, 2 * 8
    assert sent(None) == sent(1.0) == counts + 12 * per_pair
    assert sent(0.5) == counts + 8 * per_pair
