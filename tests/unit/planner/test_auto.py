"""Automatic strategy search: the winner is the brute-force minimum; rejections say why."""
import pytest
import torch

import graphpar.strategy as strategy_module
from graphpar.planner import auto
from graphpar.planner.plan import plan
from tests import helpers
from tests.targets import plan_targets


def _key(s):
    return (s.tp, s.pp, s.microbatches, s.schedule, s.virtual_stages, s.dp, s.offload_optimizer, s.zero)


@pytest.mark.parametrize("layers, heads, budget", [(4, 4, None), (4, 4, 400_000), (2, 2, 300_000)])
def test_choice_is_the_brute_force_minimum_of_the_cost_model(layers, heads, budget):
    model = helpers.tiny_gpt(n_layer=layers, n_head=heads)
    x, y = helpers.token_batch(batch=8)
    result = auto.search(model, 8, (x,), loss_fn=helpers.lm_loss, optimizer=helpers.adamw(),
                         example_target=y, memory_budget=budget)
    brute = []
    for strategy in auto.candidates(8, 8):
        dp = strategy.dp
        try:
            report = plan(model, strategy, (x[:8 // dp],), loss_fn=helpers.lm_loss, optimizer=helpers.adamw(),
                          example_target=y[:8 // dp], world_size=8)
        except ValueError:
            continue
        terms = auto.cost_of(report, x.numel() // dp, auto.DEFAULT_FLOPS, auto.DEFAULT_ALPHA, auto.DEFAULT_BETA)
        if budget is not None and terms["peak_bytes"] > budget:
            continue
        cost = terms["compute"] + terms["comms"] + terms["bubble"] + terms["host"]
        brute.append((cost, _key(strategy)))
    best_cost, best_key = min(brute)
    assert result.best.cost == pytest.approx(best_cost)
    assert _key(result.best.strategy) == best_key
    for candidate in result.candidates:  # every candidate is costed or carries its reason
        assert (candidate.cost is None) == bool(candidate.reason)
    if heads == 2:  # tp=4 and tp=8 cannot split 2 heads
        reasons = [c.reason for c in result.candidates if c.strategy.tp == 4]
        assert reasons and all("does not divide the number of heads" in r for r in reasons), reasons
    if budget is not None:
        assert any("over the memory budget" in c.reason for c in result.candidates)
    assert "winner:" in result.to_text() and result.to_text() == result.to_text()


def test_a_budget_only_offloading_meets_picks_the_host_optimizer():
    """Offloading costs host time and transfers, so without a budget the device optimizer
    wins; with a budget between the two peaks only offloaded candidates are legal."""
    model = helpers.tiny_gpt(n_layer=2, n_head=2)
    x, y = helpers.token_batch(batch=8)
    free = auto.search(model, 2, (x,), loss_fn=helpers.lm_loss, optimizer=helpers.adamw(), example_target=y)
    assert not free.best.strategy.offload_optimizer
    device = min(c.terms["peak_bytes"] for c in free.candidates if not c.strategy.offload_optimizer)
    offloaded = min(c.terms["peak_bytes"] for c in free.candidates if c.strategy.offload_optimizer)
    assert offloaded < device
    budget = (device + offloaded) // 2
    tight = auto.search(model, 2, (x,), loss_fn=helpers.lm_loss, optimizer=helpers.adamw(), example_target=y,
                        memory_budget=budget)
    assert tight.best.strategy.offload_optimizer and tight.best.terms["host"] > 0
    assert all("over the memory budget" in c.reason for c in tight.candidates if not c.strategy.offload_optimizer)


def test_the_zero_stage_is_searched_and_a_budget_no_replica_meets_picks_zero_and_says_why():
    free, budget, closest = plan_targets.zero_only_budget(4)
    # without a budget, ZeRO only adds calls: plain dp wins, and the explanation says what the
    # other stages of its layout would save and cost
    assert free.best.strategy.zero == 0 and free.best.strategy.dp == 4
    text = free.explain()
    for zero in strategy_module.ZERO_STAGES[1:]:
        assert f"zero={zero} with the same layout: peak" in text
    assert text.count("fits, costs +") == len(strategy_module.ZERO_STAGES) - 1
    tight = plan_targets.one_layer_search(4, budget)
    best = tight.best.strategy
    assert best.zero > 0 and tight.best.terms["peak_bytes"] <= budget
    assert all(c.reason for c in tight.candidates if c.strategy.zero == 0)
    over = int(closest.terms["peak_bytes"]) - budget
    assert (f"zero={best.zero} because no zero=0 strategy meets the memory budget of {budget:,} bytes: the "
            f"closest, {closest.label()}, is over it by {over:,} bytes") in tight.explain()
    same = next(c for c in tight.candidates if c.layout() == tight.best.layout() and c.strategy.zero == 0)
    assert (f"zero=0 with the same layout: peak {int(same.terms['peak_bytes']):,} bytes" in tight.explain()
            and f"over the memory budget by {int(same.terms['peak_bytes']) - budget:,} bytes" in tight.explain())


def test_candidates_are_the_zero_stages_strategy_accepts():
    def stages(world):
        found = {}
        for s in auto.candidates(world, 8):
            found.setdefault((s.dp, s.pp), set()).add(s.zero)
        return found

    def accepted(**layout):
        ok = set()
        for zero in strategy_module.ZERO_STAGES:
            try:
                strategy_module.Strategy(zero=zero, **layout)
                ok.add(zero)
            except ValueError:
                pass
        return ok
    built = stages(4)
    # zero > 0 at dp=1 shards nothing; a stage Strategy refuses (a combination not built yet)
    # is no candidate, and joins when Strategy accepts it
    assert built[(1, 1)] == {0} and built[(4, 1)] == {0, 1, 2, 3} == accepted(dp=4)
    assert built[(2, 2)] == accepted(dp=2, pp=2)


def test_zero_is_not_a_candidate_for_an_optimizer_it_cannot_shard():
    """zero > 0 steps pieces of parameters: an optimizer compile would refuse is rejected with
    compile's reason, not costed."""
    model, inputs, loss_fn, target = plan_targets.one_layer()
    result = auto.search(model, 2, inputs, loss_fn=loss_fn, example_target=target,
                         optimizer=lambda params: torch.optim.Adafactor(params, lr=1e-2))
    zeroed = [c for c in result.candidates if c.strategy.zero]
    assert zeroed and all("is refused: ZeRO steps each rank's flat shard" in c.reason for c in zeroed)
    assert result.best.strategy.zero == 0
