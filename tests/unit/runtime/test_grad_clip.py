"""Global gradient-norm clipping in a world of one: compile(max_grad_norm=...) trains as eager
training with torch.nn.utils.clip_grad_norm_ before each step, and pm.last_grad_norm is its
total norm (graphpar/runtime/grad_norm.py, grad_divisor.py). The multiprocess twin
(tests/multiprocess/runtime/test_grad_clip.py) takes the same tolerances at tp, pp, dp, ZeRO
and offload."""
import math

import pytest
import torch

import graphpar as gp
from graphpar.distributed.mesh import Mesh
from graphpar.runtime.grad_divisor import GradientDivisor
from tests.helpers import lm_loss, tiny_gpt, token_batch, train_reference_clipped
from tests.targets import clip_targets as targets
from tests.targets import token_targets

# pm.last_grad_norm against clip_grad_norm_'s: norms of the same gradients, which agree to
# float32 rounding of sums taken in another order (~1e-7 relative), each norm itself a float32
# sum (graphpar squares per-tensor norms and adds them in float64, torch takes the norm of the
# norms in float32); measured below 7e-8 at tp2 x pp2. 1e-6 is the bar; a norm counting
# something twice is off by far more (measured on the first step: the tied embedding on both
# stages +25%, the tp-replicated weights on both tp ranks +26%, both dp replicas +41%)
NORM_RTOL = 1e-6
# parameters after 3 clipped SGD steps (lr 0.1): gradients ~1e-7 relative apart, times lr and
# clip coefficients below 1, so ~1e-8 apart; an unclipped run lands ~1e-2 away (CONTRAST)
PARAM_ATOL = 1e-6
# what an unclipped run's parameters must at least differ by, so that a match cannot be an accident
CONTRAST = 1e-3


def assert_matches_clipped_training(run, norms, state):
    assert all(n > targets.MAX_NORM for n in norms)  # every step really clips
    assert run["before"] is None  # no step yet
    assert run["norms"] == pytest.approx(norms, rel=NORM_RTOL, abs=0)
    for key, value in state.items():
        torch.testing.assert_close(run["state"][key], value, atol=PARAM_ATOL, rtol=0, msg=key)


def largest_difference(state, other) -> float:
    return max(float((state[key] - value).abs().max()) for key, value in other.items())


@pytest.mark.parametrize("strategy", [
    dict(microbatches=2),                             # p.grad divided in place by the clipped divisor
    dict(microbatches=2, offload_optimizer=True),     # the update program's host masters step after backward
])
def test_clipped_training_matches_clip_grad_norm(strategy):
    norms, _, state = targets.reference()
    assert_matches_clipped_training(targets.train(gp.Strategy(**strategy).to_dict()), norms, state)


def test_an_unclipped_run_differs_and_an_infinite_max_norm_only_measures():
    """The contrast: without clipping the parameters land far from the clipped reference, so the
    match above cannot be an accident. max_grad_norm=inf measures the norm and never clips."""
    norms, _, clipped = targets.reference()
    unclipped_norms, _, unclipped = targets.reference(max_grad_norm=math.inf)
    assert largest_difference(unclipped, clipped) > CONTRAST
    run = targets.train(gp.Strategy(microbatches=2).to_dict(), max_grad_norm=math.inf)
    assert run["norms"] == pytest.approx(unclipped_norms, rel=NORM_RTOL, abs=0)
    assert run["norms"][0] == pytest.approx(norms[0], rel=NORM_RTOL, abs=0)  # the first step's gradients are alike
    assert largest_difference(run["state"], unclipped) < PARAM_ATOL
    assert targets.train(gp.Strategy().to_dict(), max_grad_norm=None)["norms"] == [None] * targets.STEPS


def test_host_table_rows_count_in_the_norm():
    """offload_embedding: the token and position tables' row gradients live only on the host,
    where the row update divides them by the clipped divisor too."""
    norms, _, state = targets.reference(tie_weights=False)
    run = targets.train(gp.Strategy(offload_embedding=True).to_dict(), model_options={"tie_weights": False})
    assert_matches_clipped_training(run, norms, state)


def test_a_token_weighted_loss_is_clipped_on_the_token_mean_gradient():
    """(loss_sum, count): the norm is of the gradient divided by the global count."""
    x, y = token_targets.padded_batch()
    model, losses, norms = train_reference_clipped(tiny_gpt(), [(x, y)], token_targets.token_mean, targets.SGD,
                                                   targets.STEPS, targets.MAX_NORM)
    pm = gp.compile(tiny_gpt(), gp.Strategy(microbatches=4), example_inputs=(x,), example_target=y,
                    loss_fn=token_targets.token_sum, optimizer=targets.SGD, max_grad_norm=targets.MAX_NORM)
    run = {"before": pm.last_grad_norm, "norms": [], "state": None}
    for _ in range(targets.STEPS):
        pm.train_step(x, target=y)
        run["norms"].append(pm.last_grad_norm)
    run["state"] = pm.full_state_dict()
    assert_matches_clipped_training(run, norms, model.state_dict())


# fp16 compute weights: the gradients carry fp16 rounding (2**-11 relative per element), which
# mostly averages out in the norm: it agrees with the fp32 one to ~1e-5 (measured 1.3e-5), and
# 1e-3 leaves room for other fp16 kernels; a norm of the loss-scaled gradients is 2**15 times larger
FP16_NORM_RTOL = 1e-3


def test_fp16_clips_the_unscaled_norm_and_an_overflowing_step_is_neither_clipped_nor_stepped():
    x, y = token_batch()
    norms, _, _ = targets.reference()
    pm = gp.compile(tiny_gpt(), gp.Strategy(param_dtype=torch.float16), example_inputs=(x,), example_target=y,
                    loss_fn=lm_loss, optimizer=targets.SGD, max_grad_norm=targets.MAX_NORM)
    pm.train_step(x, target=y)
    assert pm.loss_scaler.skipped == 0 and pm.loss_scaler.scale == 2.0 ** 15
    assert pm.last_grad_norm == pytest.approx(norms[0], rel=FP16_NORM_RTOL)
    before = pm.full_state_dict()
    pm.loss_scaler.scale = 2.0 ** 40  # past fp16's range: the gradients overflow
    pm.train_step(x, target=y)
    assert pm.loss_scaler.skipped == 1 and pm.last_grad_norm == math.inf
    assert largest_difference(pm.full_state_dict(), before) == 0


def test_the_divisor_follows_clip_grad_norm_on_any_norm():
    """clip_grad_norm_'s rule (error_if_nonfinite=False): a norm under max_norm leaves the
    divisor alone; an infinite one multiplies the gradients by 0 (divides by inf); a nan one
    makes them nan."""
    def divisor_after(square_sum, loss_scale=4.0):
        divisor = GradientDivisor(Mesh(1, 1, 1, 0), microbatches=1, counted=False, timeout_s=1.0, max_grad_norm=2.0)
        divisor.clip(square_sum, loss_scale)
        return divisor
    small = divisor_after((1.0 * 4.0) ** 2)  # norm 1 once the loss scale 4 is divided out
    assert (small.grad_norm, small.value(4.0)) == (1.0, 4.0)
    large = divisor_after((8.0 * 4.0) ** 2)  # norm 8: the gradients times 2 / (8 + 1e-6)
    assert large.grad_norm == 8.0 and large.value(4.0) == pytest.approx(4.0 * (8.0 + 1e-6) / 2.0, rel=1e-15)
    assert divisor_after(math.inf).value(4.0) == math.inf
    assert math.isnan(divisor_after(math.nan).value(4.0))
    reset = divisor_after((8.0 * 4.0) ** 2)
    reset.begin_step()
    assert (reset.grad_norm, reset.value(4.0)) == (None, 4.0)  # each step clips afresh


def test_the_plan_counts_the_norm_all_reduce_and_verify_clips_its_reference():
    x, y = token_batch()
    strategy = gp.Strategy(dp=2, pp=2)
    for max_grad_norm, expected in ((None, 0), (1.0, 1)):
        plan = gp.plan(tiny_gpt(), strategy, (x[:4],), loss_fn=lm_loss, example_target=y[:4],
                       max_grad_norm=max_grad_norm)
        for rank in plan.ranks:
            norm = [t for t in rank.collectives if "gradient norm" in t.what]
            assert len(norm) == expected, rank.collectives
            assert all(t.op == "all_reduce" and t.axis == "world" and t.bytes == 8 for t in norm)
    verify = dict(example_inputs=(x,), target=y, loss_fn=lm_loss, optimizer=targets.SGD, steps=2)
    report = gp.verify(tiny_gpt(), gp.Strategy(microbatches=2), max_grad_norm=targets.MAX_NORM, **verify)
    assert report.passed, report.message
    assert report.grad_norms == pytest.approx(report.reference_grad_norms, rel=NORM_RTOL, abs=0)
    assert len(report.grad_norms) == 2 and report.grad_norms[0] > targets.MAX_NORM
