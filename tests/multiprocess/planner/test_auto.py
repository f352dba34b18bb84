"""The strategy search's ZeRO and recompute choices, trained: a budget no zero=0 plan meets
picks a ZeRO plan, one no plan without recomputation meets picks a recompute plan, and each
plan trains as single-device training does. Both plans train in one launch
(tests/targets/cases.py), after the searches that chose them."""
import pytest
import torch

from tests import helpers
from tests.targets import plan_targets
from tests.targets.cases import SharedLaunches

STEPS = 4
# Each rank's loss is the mean over its half of the batch and each gradient element is
# averaged over the ranks in a reduce-scatter: the global batch's sums in another order, i.e.
# float32 rounding noise (1e-5 on a loss of order 1). Weights: the AdamW noise bound explained
# in tests/helpers.adamw (1e-4), as tests/multiprocess/runtime/test_zero.py.
LOSS_TOL = 1e-5
PARAM_TOL = 1e-4


@pytest.fixture(scope="module")
def chosen():
    """The plan each search picks under its budget, at world 2."""
    _, zero_budget, _ = plan_targets.zero_only_budget(2)
    _, recompute_budget, _ = plan_targets.recompute_only_budget(2)
    return {"zero": (plan_targets.one_layer_search(2, zero_budget).best, zero_budget),
            "recompute": (plan_targets.gpt_blocks_search(2, recompute_budget).best, recompute_budget)}


@pytest.fixture(scope="module")
def launched(chosen):
    return SharedLaunches({
        "zero": (2, plan_targets.train_one_layer, (chosen["zero"][0].strategy.to_dict(), STEPS)),
        "recompute": (2, plan_targets.train_gpt_blocks, (chosen["recompute"][0].strategy.to_dict(), STEPS)),
    })


def test_a_budget_no_replica_meets_picks_a_zero_plan_that_trains_with_parity(chosen, launched):
    chosen, _ = chosen["zero"]
    assert chosen.strategy.zero > 0 and chosen.strategy.dp == 2
    results = launched("zero")
    model, (x,), loss_fn, y = plan_targets.one_layer()
    reference, ref_losses = helpers.train_reference(model, [(x, y)], loss_fn, helpers.adamw(), STEPS)
    for losses, state in results:
        assert losses == pytest.approx(ref_losses, abs=LOSS_TOL)
        for key, value in reference.state_dict().items():
            torch.testing.assert_close(state[key], value, atol=PARAM_TOL, rtol=0, msg=key)


def test_a_budget_no_plan_without_recomputation_meets_picks_a_recompute_plan_that_trains_with_parity(chosen, launched):
    """The tiny GPT with 4 blocks, dropout 0 (so eager training is the reference), at world 2.
    Recomputation adds no rounding of its own: the backward replays the forward's ops on the
    same inputs, and on CPU they give the same bits; the tolerances are those of the plan's
    dp and ZeRO split, as above."""
    chosen, budget = chosen["recompute"]
    assert chosen.strategy.recompute is not None and chosen.terms["peak_bytes"] <= budget
    assert chosen.strategy.pp == 1, chosen.label()   # dp=2 (see the explanation in docs/planner.md)
    results = launched("recompute")
    model, (x,), loss_fn, y = plan_targets.gpt_blocks()
    reference, ref_losses = helpers.train_reference(model, [(x, y)], loss_fn, helpers.adamw(), STEPS)
    for losses, state, regions in results:
        assert regions == len(model.blocks), regions   # at pp=1 every rank recomputes every block
        assert losses == pytest.approx(ref_losses, abs=LOSS_TOL)
        for key, value in reference.state_dict().items():
            torch.testing.assert_close(state[key], value, atol=PARAM_TOL, rtol=0, msg=key)
