"""Data parallelism on gloo against single-device training on the global batch. Every case of
one world size runs in one launch (tests/targets/cases.py), `cases` below; the refusal of
mismatched shapes is a launch of its own (it tests launch's report of a failing rank)."""
import pytest
import torch

from graphpar.distributed.launch import LaunchError, launch
from tests.targets import dp_targets
from tests.targets.cases import SharedLaunches
from tests.helpers import adamw, lm_loss, tiny_gpt, token_batch, train_reference

# Each rank's loss is a mean over its half of the batch and gradients are averaged across
# ranks: the same sums as the global batch in another order, i.e. float32 rounding noise.
# Parameters: the AdamW noise bound explained in test_world_of_one (1e-4).
LOSS_TOL = 1e-5
PARAM_TOL = 1e-4
STEPS, GLOBAL_BATCH = 3, 8
WORLDS = [(2, 1), (4, 2)]
BATCH_NORMS = [("fx", 0), ("export", 0), ("fx", 3), ("export", 3)]


def cases():
    """Every launched case of this module: {name: (world size, function, args)}."""
    return {
        **{("dp", world): (world, dp_targets.train_gpt_dp, (STEPS, microbatches, GLOBAL_BATCH, True))
           for world, microbatches in WORLDS},
        **{("bn", tracer, zero): (2, dp_targets.train_bn_cnn_dp, (STEPS, tracer, zero)) for tracer, zero in BATCH_NORMS},
    }


@pytest.fixture(scope="module")
def launched():
    return SharedLaunches(cases())


@pytest.mark.parametrize("world, microbatches", WORLDS)
def test_dp_matches_global_batch_training(launched, world, microbatches):
    steps, global_batch = STEPS, GLOBAL_BATCH
    results = launched(("dp", world))
    x, y = token_batch(batch=global_batch)
    reference, ref_losses = train_reference(tiny_gpt(), [(x, y)], lm_loss, adamw(), steps)
    expected = reference.state_dict()
    for losses, state, buckets in results:
        assert buckets > 1
        assert losses == pytest.approx(ref_losses, abs=LOSS_TOL)
        for key, value in expected.items():
            torch.testing.assert_close(state[key], value, atol=PARAM_TOL, rtol=0, msg=key)


def test_ranks_with_different_batch_shapes_fail_clearly():
    with pytest.raises(LaunchError, match=r"rank 1 called graphpar.compile with a different example input shapes"):
        launch(dp_targets.mismatched_shapes, world_size=2)


@pytest.mark.parametrize("tracer, zero", BATCH_NORMS)
def test_sync_batch_norm_matches_global_batch(launched, tracer, zero):
    steps = STEPS
    results = launched(("bn", tracer, zero))
    x, y = dp_targets.bn_batch()
    reference, ref_losses = train_reference(dp_targets.bn_cnn(), [(x, y)],
                                            torch.nn.functional.cross_entropy, adamw(), steps)
    expected = reference.state_dict()
    reference.eval()
    for rank, (losses, state, out) in enumerate(results):
        assert losses == pytest.approx(ref_losses, abs=LOSS_TOL)
        for key, value in expected.items():  # running_mean / running_var / counters included
            torch.testing.assert_close(state[key], value, atol=PARAM_TOL, rtol=0, msg=key)
        torch.testing.assert_close(out, reference(x[rank * 4:(rank + 1) * 4]), atol=1e-4, rtol=0)
