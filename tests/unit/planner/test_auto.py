"""Automatic strategy search: the winner is the brute-force minimum; rejections say why."""
import pytest

import graphpar as gp
from graphpar.planner import auto
from graphpar.planner.plan import plan
from tests import helpers


@pytest.mark.parametrize("layers, heads, budget", [(4, 4, None), (4, 4, 400_000), (2, 2, 300_000)])
def test_choice_is_the_brute_force_minimum_of_the_cost_model(layers, heads, budget):
    model = helpers.tiny_gpt(n_layer=layers, n_head=heads)
    x, y = helpers.token_batch(batch=8)
    result = auto.search(model, 8, (x,), loss_fn=helpers.lm_loss, optimizer=helpers.adamw(),
                         example_target=y, memory_budget=budget)
    brute = []
    for dp, tp, pp, m, schedule, virtual, offload in auto.candidates(8, 8):
        strategy = gp.Strategy(dp=dp, tp=tp, pp=pp, microbatches=m, schedule=schedule, virtual_stages=virtual,
                               offload_optimizer=offload)
        try:
            report = plan(model, strategy, (x[:8 // dp],), loss_fn=helpers.lm_loss, optimizer=helpers.adamw(),
                          example_target=y[:8 // dp], world_size=8)
        except ValueError:
            continue
        terms = auto.cost_of(report, x.numel() // dp, auto.DEFAULT_FLOPS, auto.DEFAULT_ALPHA, auto.DEFAULT_BETA)
        if budget is not None and terms["peak_bytes"] > budget:
            continue
        cost = terms["compute"] + terms["comms"] + terms["bubble"] + terms["host"]
        brute.append((cost, (tp, pp, m, schedule, virtual, dp, offload)))
    best_cost, best_key = min(brute)
    assert result.best.cost == pytest.approx(best_cost)
    s = result.best.strategy
    assert (s.tp, s.pp, s.microbatches, s.schedule, s.virtual_stages, s.dp, s.offload_optimizer) == best_key
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
