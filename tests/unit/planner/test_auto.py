"""Automatic strategy search: the winner is the brute-force minimum; rejections say why."""
import pytest
import torch

import graphpar as gp
import graphpar.strategy as strategy_module
from graphpar.planner import auto
from graphpar.planner.plan import RankPlan, Report, Transfer, plan
from tests import helpers
from tests.targets import plan_targets


def _key(s):
    return (s.tp, s.pp, s.microbatches, s.schedule, s.virtual_stages, s.dp, s.offload_optimizer, s.zero,
            s.recompute is not None, isinstance(s.recompute, float), str(s.recompute))


def _brute_force(model, x, y, world, budget):
    """(cost, key) of every legal candidate, each planned on its own with graphpar.plan: under
    a budget every layout with every named recompute mode (the search plans them only for the
    layouts over the budget without), and for each layout that meets the budget with
    recompute="full" but not without recomputation its fitted fraction (all of them: the
    search plans only those its bound cannot rule out)."""
    def costed(strategy):
        dp = strategy.dp
        report = plan(model, strategy, (x[:8 // dp],), loss_fn=helpers.lm_loss, optimizer=helpers.adamw(),
                      example_target=y[:8 // dp], world_size=world)
        return report, auto.cost_of(report, x.numel() // dp, auto.DEFAULT_FLOPS, auto.DEFAULT_ALPHA,
                                    auto.DEFAULT_BETA)
    planned = {}
    modes = (None,) if budget is None else (None, *strategy_module.RECOMPUTE_MODES)
    for strategy in auto.candidates(world, 8, modes):
        try:
            planned[_key(strategy)] = (strategy, *costed(strategy))
        except ValueError:
            continue
    fitted = {}
    for key, (strategy, report, terms) in planned.items():
        full = planned.get(key[:8] + (True, False, "full"))
        if (strategy.recompute is not None or budget is None or terms["peak_bytes"] <= budget or full is None
                or full[2]["peak_bytes"] > budget):
            continue
        fraction = auto.fitting_fraction(report, budget)
        if fraction is None:
            continue
        fraction_strategy = gp.Strategy.from_dict({**strategy.to_dict(), "recompute": fraction})
        try:
            _, fraction_terms = costed(fraction_strategy)
        except ValueError:   # below what "full" keeps on some rank: the pass refuses it
            continue
        if fraction_terms["recompute_flops"] < full[2]["recompute_flops"]:   # else it is "full" again
            fitted[_key(fraction_strategy)] = (fraction_strategy, None, fraction_terms)
    brute = []
    for key, (strategy, _, terms) in {**planned, **fitted}.items():
        if budget is not None and terms["peak_bytes"] > budget:
            continue
        brute.append((terms["compute"] + terms["comms"] + terms["bubble"] + terms["host"], key))
    return brute


# The budgeted cases run at world 2: under a budget brute force plans each layout with three
# recompute modes and each fitted fraction on its own (world 8: ~750 plans and ~200 more
# analyses). 400,000 bytes: some layouts fit without recomputation, cheaper ones only with it;
# 170,000: none fits without, some with "selective".
@pytest.mark.parametrize("layers, heads, budget, world", [(4, 4, None, 8), (4, 4, 400_000, 2), (2, 2, 170_000, 2)])
def test_choice_is_the_brute_force_minimum_of_the_cost_model(layers, heads, budget, world):
    model = helpers.tiny_gpt(n_layer=layers, n_head=heads)
    x, y = helpers.token_batch(batch=8)
    result = auto.search(model, world, (x,), loss_fn=helpers.lm_loss, optimizer=helpers.adamw(),
                         example_target=y, memory_budget=budget)
    best_cost, best_key = min(_brute_force(model, x, y, world, budget))
    assert result.best.cost == pytest.approx(best_cost)
    assert _key(result.best.strategy) == best_key
    for candidate in result.candidates:  # every candidate is costed or carries its reason
        assert (candidate.cost is None) == bool(candidate.reason)
    if world > heads:  # a tp degree that cannot split the heads
        reasons = [c.reason for c in result.candidates if heads % c.strategy.tp]
        assert reasons and all("does not divide the number of heads" in r for r in reasons), reasons
    if budget is not None:
        assert any("over the memory budget" in c.reason for c in result.candidates)
        # neither budget leaves the cheapest layouts room for every activation
        assert result.best.strategy.recompute is not None
    else:
        assert all(c.strategy.recompute is None for c in result.candidates)
    assert "winner:" in result.to_text() and result.to_text() == result.to_text()


def test_a_budget_only_offloading_meets_picks_the_host_optimizer():
    """Offloading costs host time and transfers, so without a budget the device optimizer
    wins; with a budget between the two peaks only offloaded candidates are legal."""
    model = helpers.tiny_gpt(n_layer=2, n_head=2)
    x, y = helpers.token_batch(batch=8)
    free = auto.search(model, 2, (x,), loss_fn=helpers.lm_loss, optimizer=helpers.adamw(), example_target=y)
    assert not free.best.strategy.offload_optimizer
    # with a budget recomputation is searched too: the peaks of every recompute mode
    every = auto.search(model, 2, (x,), loss_fn=helpers.lm_loss, optimizer=helpers.adamw(), example_target=y,
                        memory_budget=plan_targets.TOO_SMALL)
    device = min(c.terms["peak_bytes"] for c in every.candidates if not c.strategy.offload_optimizer)
    offloaded = min(c.terms["peak_bytes"] for c in every.candidates if c.strategy.offload_optimizer)
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


# ---- recomputation -------------------------------------------------------------------------------
def test_recomputation_is_searched_only_for_layouts_over_a_budget_and_only_costs_time():
    """Without a budget no recompute candidate is planned, nor with one every layout meets
    (the winner is the budget-free one); under one no layout meets, every layout is planned
    with each mode, and each recompute candidate costs more than its layout without
    recomputation by at least the flops it runs again, for fewer bytes."""
    free = plan_targets.gpt_blocks_search(2)
    assert all(c.strategy.recompute is None for c in free.candidates)
    ample = plan_targets.gpt_blocks_search(2, max(int(c.terms["peak_bytes"]) for c in free.candidates if c.terms))
    assert all(c.strategy.recompute is None for c in ample.candidates)
    assert ample.best.strategy == free.best.strategy and ample.best.cost == free.best.cost
    tight = plan_targets.gpt_blocks_search(2, plan_targets.TOO_SMALL)
    assert tight.best is None
    without = {c.all_but("recompute"): c for c in tight.candidates if c.strategy.recompute is None and c.terms}
    recomputing = [c for c in tight.candidates if c.strategy.recompute is not None and c.terms]
    assert {c.all_but("recompute") for c in recomputing} == set(without)
    assert {c.strategy.recompute for c in recomputing} == set(strategy_module.RECOMPUTE_MODES)

    def total(c):
        return c.terms["compute"] + c.terms["comms"] + c.terms["bubble"] + c.terms["host"]
    for c in recomputing:
        plain = without[c.all_but("recompute")]
        assert c.terms["recompute"] > 0 and c.terms["peak_bytes"] < plain.terms["peak_bytes"], c.label()
        # the same terms summed in another order: equal up to float rounding (1e-12 relative)
        assert total(c) >= (total(plain) + c.terms["recompute"]) * (1 - 1e-12), c.label()


@pytest.mark.parametrize("layout", [dict(dp=2), dict(pp=2, microbatches=2)])
def test_the_cost_charges_the_forward_flops_backward_runs_again(layout):
    model, (x,), loss_fn, y = plan_targets.gpt_blocks()
    local = 8 // layout.get("dp", 1)

    def costed(recompute):
        report = plan(model, gp.Strategy(recompute=recompute, **layout), (x[:local],), loss_fn=loss_fn,
                      optimizer=helpers.adamw(), example_target=y[:local], world_size=2)
        return report, auto.cost_of(report, x[:local].numel(), auto.DEFAULT_FLOPS, auto.DEFAULT_ALPHA,
                                    auto.DEFAULT_BETA)
    plain_report, plain = costed(None)
    report, terms = costed("full")
    work = [6 * r.param_bytes / 4 * x[:local].numel() + r.recompute_flops for r in report.ranks]
    busiest = report.ranks[work.index(max(work))]
    assert busiest.recompute_flops > 0 and plain["recompute"] == 0
    assert terms["compute"] == pytest.approx(max(work) / auto.DEFAULT_FLOPS)
    assert terms["recompute"] == pytest.approx(busiest.recompute_flops / auto.DEFAULT_FLOPS)
    assert terms["compute"] - plain["compute"] == pytest.approx(terms["recompute"])   # same weights, same split
    assert terms["bubble"] >= plain["bubble"]   # the bubble stretches with the compute
    assert [r.param_bytes for r in report.ranks] == [r.param_bytes for r in plain_report.ranks]


def test_a_budget_no_plan_without_recomputation_meets_picks_recomputation_and_says_why():
    every, budget, closest = plan_targets.recompute_only_budget(2)
    tight = plan_targets.gpt_blocks_search(2, budget)
    best = tight.best
    mode = best.strategy.recompute
    assert mode is not None and best.terms["peak_bytes"] <= budget
    assert all(c.reason for c in tight.candidates if c.strategy.recompute is None)
    text = tight.explain()
    over = int(closest.terms["peak_bytes"]) - budget
    assert (f"recompute={mode} because no strategy without recomputation meets the memory budget of {budget:,} "
            f"bytes: the closest, {closest.label()}, is over it by {over:,} bytes; ") in text
    assert f"MFLOP of forward again per step ({best.terms['recompute']:.3g} s)" in text
    plain = next(c for c in tight.candidates if c.all_but("recompute") == best.all_but("recompute")
                 and c.strategy.recompute is None)
    assert (f"recompute=None with the same layout: peak {int(plain.terms['peak_bytes']):,} bytes" in text
            and f"over the memory budget by {int(plain.terms['peak_bytes']) - budget:,} bytes" in text)
    # the budget leaves room for part of the activations: the fitted fraction of the winner's
    # layout recomputes less than "full", which also fits
    full = next(c for c in tight.candidates if c.all_but("recompute") == best.all_but("recompute")
                and c.strategy.recompute == "full")
    assert isinstance(mode, float) and not full.reason and best.terms["recompute"] < full.terms["recompute"]
    assert f"it keeps {mode:g} of its activations, the most that fits the budget (in thousandths)" in text
    assert f"recompute=full with the same layout: peak {int(full.terms['peak_bytes']):,} bytes" in text
    assert f"fits, costs {full.cost - best.cost:+.3g} s/step against the winner (recompute +" in text


def test_a_recompute_winner_beside_plans_that_fit_without_says_what_the_cheapest_of_them_costs():
    """A budget the least peak without recomputation meets exactly: that plan is legal, but a
    layout with less communication and bubble, which fits only with recomputation, is cheaper."""
    every, _, closest = plan_targets.recompute_only_budget(2)
    budget = int(closest.terms["peak_bytes"])
    result = plan_targets.gpt_blocks_search(2, budget)
    assert result.best.strategy.recompute is not None
    cheapest = min((c for c in result.candidates if c.strategy.recompute is None and not c.reason),
                   key=lambda c: c.cost)
    assert (f"recompute={result.best.strategy.recompute} because without recomputation this layout is over the "
            f"memory budget, and the cheapest strategy without recomputation, {cheapest.label()}, costs "
            f"{cheapest.cost - result.best.cost:+.3g} s/step against the winner; ") in result.explain()


def test_recompute_candidates_of_a_model_without_blocks_are_rejected_with_the_reason():
    """one_layer() has no nn.ModuleList or nn.Sequential of blocks: each recompute mode is
    rejected, not planned as a copy of the candidate without recomputation."""
    model, inputs, loss_fn, target = plan_targets.one_layer()
    result = auto.search(model, 2, inputs, loss_fn=loss_fn, example_target=target, optimizer=helpers.adamw(),
                         memory_budget=plan_targets.TOO_SMALL)
    planned = {c.all_but("recompute") for c in result.candidates if c.strategy.recompute is None and c.terms}
    recomputing = [c for c in result.candidates if c.strategy.recompute is not None and c.all_but("recompute") in planned]
    assert recomputing and all(c.reason == f"recompute={c.strategy.recompute} recomputes nothing: the model has no "
                               f"repeated blocks (children of an nn.ModuleList or nn.Sequential) to recompute"
                               for c in recomputing)


def test_the_fixed_constant_cost_counts_a_pipeline_message_once_by_its_send():
    """A message is one send on one rank and one receive on the next: the rank that receives
    waits for the send, it does not send again (exact arithmetic: rel 1e-9)."""
    strategy = {"dp": 1, "tp": 1, "pp": 2, "microbatches": 1, "schedule": "1f1b", "virtual_stages": 1, "zero": 0,
                "offload_optimizer": False}
    messages = [Transfer("send", "pp", 1_000_000, 1, "activations"), Transfer("recv", "pp", 1_000_000, 1, "gradients")]

    def cost(collectives):
        ranks = [RankPlan(p, 0, 0, p, [p], 4000, 4000, 0, 0, 0, list(collectives)) for p in range(2)]
        report = Report(strategy=strategy, world_size=2, ranks=ranks, bubble_fraction=0.0, stage_units=[1, 1])
        return auto.cost_of(report, 100, auto.DEFAULT_FLOPS, auto.DEFAULT_ALPHA, auto.DEFAULT_BETA)["comms"]

    assert cost(messages) - cost([]) == pytest.approx(auto.DEFAULT_ALPHA + 1_000_000 / auto.DEFAULT_BETA, rel=1e-9)
