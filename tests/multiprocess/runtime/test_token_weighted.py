"""Token-weighted losses across ranks: padding that differs per microbatch and per dp rank
trains as single-device training on the whole batch with the token mean (the tolerances are
the unit twin's, explained there). Every case runs in one launch (tests/targets/cases.py)."""
import pytest
import torch

import graphpar as gp
from tests.targets import token_targets as targets
from tests.targets.cases import SharedLaunches
from tests.helpers import largest_difference
from tests.unit.runtime.test_token_weighted import CONTRAST, STEPS, assert_matches_token_mean


WITH_TP_AND_ZERO = [
    dict(dp=2, tp=2, microbatches=2),            # the vocab-parallel cross entropy, reduction='sum'
    dict(dp=2, pp=2, microbatches=2, zero=1),    # ZeRO's update program: shard steps after backward
    dict(dp=2, tp=2, microbatches=2, zero=3),    # gradients reduce-scattered every microbatch, divided at the step
    dict(dp=2, tp=2, microbatches=2, sequence_parallel=True),  # the loss over sequence-sharded activations
]


@pytest.fixture(scope="module")
def launched():
    return SharedLaunches({
        "both": (4, targets.train_both, (gp.Strategy(dp=2, pp=2, microbatches=2).to_dict(), STEPS)),
        **{i: (4, targets.train, (gp.Strategy(**strategy).to_dict(), STEPS, "token_sum",
                                  {"bucket_bytes": 4096}))  # several buckets
           for i, strategy in enumerate(WITH_TP_AND_ZERO)},
    })


def test_dp2_pp2_two_microbatches_match_token_mean_training_and_a_per_microbatch_mean_does_not(launched):
    results = launched("both")
    ref_losses, ref_state = targets.reference(STEPS)
    for rank in results:
        assert_matches_token_mean(rank["token_sum"], ref_losses, ref_state)
        # pm(x) on the last stage's evaluation program, without the loss sum and the count;
        # logits of weights 1e-8 apart, through 2 layers: float32 noise, ~1e-7
        expected = targets.reference_output(ref_state, rank["token_sum"]["dp_rank"], 2)
        torch.testing.assert_close(rank["token_sum"]["out"], expected, atol=1e-5, rtol=0)
        # the same data and strategy with loss_fn meaning over each microbatch of each dp rank
        per_microbatch = rank["token_mean"]
        assert abs(per_microbatch["losses"][0] - ref_losses[0]) > CONTRAST
        assert largest_difference(per_microbatch["state"], ref_state) > CONTRAST


@pytest.mark.parametrize("strategy", WITH_TP_AND_ZERO)
def test_token_weighted_training_with_tp_and_zero(launched, strategy):
    results = launched(WITH_TP_AND_ZERO.index(strategy))
    ref_losses, ref_state = targets.reference(STEPS)
    for rank in results:
        assert_matches_token_mean(rank, ref_losses, ref_state)
        if strategy.get("tp", 1) > 1:  # the logits were never gathered for the loss
            assert "parallel_cross_entropy" in rank["roles"]
