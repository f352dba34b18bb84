"""The strategy search's ZeRO and recompute choices, trained: a budget no zero=0 plan meets
picks a ZeRO plan, one no plan without recomputation meets picks a recompute plan, and each
plan trains as single-device training does."""
import pytest
import torch

from graphpar.distributed.launch import launch
from tests import helpers
from tests.targets import plan_targets

STEPS = 4
# Each rank's loss is the mean over its half of the batch and each gradient element is
# averaged over the ranks in a reduce-scatter: the global batch's sums in another order, i.e.
# float32 rounding noise (1e-5 on a loss of order 1). Weights: the AdamW noise bound explained
# in tests/helpers.adamw (1e-4), as tests/multiprocess/runtime/test_zero.py.
LOSS_TOL = 1e-5
PARAM_TOL = 1e-4


def test_a_budget_no_replica_meets_picks_a_zero_plan_that_trains_with_parity():
    _, budget, _ = plan_targets.zero_only_budget(2)
    chosen = plan_targets.one_layer_search(2, budget).best
    assert chosen.strategy.zero > 0 and chosen.strategy.dp == 2
    results = launch(plan_targets.train_one_layer, world_size=2, args=(chosen.strategy.to_dict(), STEPS))
    model, (x,), loss_fn, y = plan_targets.one_layer()
    reference, ref_losses = helpers.train_reference(model, [(x, y)], loss_fn, helpers.adamw(), STEPS)
    for losses, state in results:
        assert losses == pytest.approx(ref_losses, abs=LOSS_TOL)
        for key, value in reference.state_dict().items():
            torch.testing.assert_close(state[key], value, atol=PARAM_TOL, rtol=0, msg=key)


def test_a_budget_no_plan_without_recomputation_meets_picks_a_recompute_plan_that_trains_with_parity():
    """The tiny GPT with 4 blocks, dropout 0 (so eager training is the reference), at world 2.
    Recomputation adds no rounding of its own: the backward replays the forward's ops on the
    same inputs, and on CPU they give the same bits; the tolerances are those of the plan's
    dp and ZeRO split, as above."""
    _, budget, _ = plan_targets.recompute_only_budget(2)
    chosen = plan_targets.gpt_blocks_search(2, budget).best
    assert chosen.strategy.recompute is not None and chosen.terms["peak_bytes"] <= budget
    assert chosen.strategy.pp == 1, chosen.label()   # dp=2 (see the explanation in docs/planner.md)
    results = launch(plan_targets.train_gpt_blocks, world_size=2, args=(chosen.strategy.to_dict(), STEPS))
    model, (x,), loss_fn, y = plan_targets.gpt_blocks()
    reference, ref_losses = helpers.train_reference(model, [(x, y)], loss_fn, helpers.adamw(), STEPS)
    for losses, state, regions in results:
        assert regions == len(model.blocks), regions   # at pp=1 every rank recomputes every block
        assert losses == pytest.approx(ref_losses, abs=LOSS_TOL)
        for key, value in reference.state_dict().items():
            torch.testing.assert_close(state[key], value, atol=PARAM_TOL, rtol=0, msg=key)
