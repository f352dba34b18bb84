"""compile + ParallelModule on one process against eager single-device training."""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import graphpar as gp
from tests.helpers import (adamw, hf_causal_lm_loss, hf_gpt2, hf_llama, lm_loss, tiny_gpt,
                           token_batch, train_reference)

# Same ops in the same order as eager, so one microbatch agrees to float32 rounding noise;
# microbatches change the order of the gradient sums. Parameters: a gradient entry that is
# only rounding noise (|g| ~ 1e-9, changed by any summation order) moves by up to
# lr * |g| / eps ~ 1e-5 per AdamW step with the tests' eps=1e-6 (helpers.adamw), so 5 steps
# stay under 1e-4, while a wrong gradient moves a parameter by O(lr) = 1e-2.
LOSS_TOL = 1e-5
PARAM_TOL = 1e-4


def _compile(model, x, y, loss_fn=lm_loss, **kwargs):
    strategy = kwargs.pop("strategy", gp.Strategy())
    return gp.compile(model, strategy, example_inputs=(x,), example_target=y, loss_fn=loss_fn,
                      optimizer=adamw(), **kwargs)


def _assert_matches(pm, reference, losses, ref_losses):
    assert losses == pytest.approx(ref_losses, abs=LOSS_TOL)
    full, ref = pm.full_state_dict(), reference.state_dict()
    assert list(full) == list(ref)
    for key in ref:
        torch.testing.assert_close(full[key], ref[key], atol=PARAM_TOL, rtol=0, msg=key)


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_five_adamw_steps_match_eager(tracer):
    model = tiny_gpt()
    x, y = token_batch()
    pm = _compile(model, x, y, tracer=tracer)
    assert pm.front_end == tracer
    losses = [pm.train_step(x, target=y) for _ in range(5)]
    reference, ref_losses = train_reference(model, [(x, y)], lm_loss, adamw(), 5)
    _assert_matches(pm, reference, losses, ref_losses)
    assert losses[-1] < losses[0]


def test_microbatches_accumulate_to_the_full_batch_gradient():
    model = tiny_gpt()
    x, y = token_batch()
    pm = _compile(model, x, y, strategy=gp.Strategy(microbatches=4))
    losses = [pm.train_step(x, target=y) for _ in range(3)]
    reference, ref_losses = train_reference(model, [(x, y)], lm_loss, adamw(), 3)
    _assert_matches(pm, reference, losses, ref_losses)


def test_transformers_gpt2_trains_like_eager():
    model = hf_gpt2()
    x, y = token_batch()
    pm = _compile(model, x, y, loss_fn=hf_causal_lm_loss)
    assert pm.front_end == "export"
    losses = [pm.train_step(x, target=y) for _ in range(3)]
    reference, ref_losses = train_reference(model, [(x, y)], hf_causal_lm_loss, adamw(), 3)
    _assert_matches(pm, reference, losses, ref_losses)
    out = pm(x)
    torch.testing.assert_close(out.logits, reference.eval()(x).logits, atol=1e-5, rtol=0)


def test_the_users_model_is_not_modified():
    model = tiny_gpt()
    before = copy.deepcopy(model.state_dict())
    x, y = token_batch()
    pm = _compile(model, x, y)
    pm.train_step(x, target=y)
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key])


def test_tied_weights_stay_one_parameter():
    model = tiny_gpt()
    x, y = token_batch()
    pm = _compile(model, x, y)
    names = [n for n, _ in pm.named_parameters()]
    assert names == [n for n, _ in model.named_parameters()]  # lm_head.weight is wte.weight
    pm.train_step(x, target=y)
    full = pm.full_state_dict()
    assert torch.equal(full["wte.weight"], full["lm_head.weight"])


def test_eval_uses_eval_mode_and_matches_eager():
    model = tiny_gpt(dropout=0.5)
    x, y = token_batch()
    pm = _compile(model, x, y, strategy=gp.Strategy(microbatches=2))
    expected = copy.deepcopy(model).eval()(x)
    torch.testing.assert_close(pm(x), expected)  # dropout off in evaluation
    torch.testing.assert_close(pm(x[:4]), expected[:4])  # one compiled microbatch
    torch.testing.assert_close(pm(x[:3]), expected[:3])  # a program of its own (graphpar/runtime/shapes.py)


def test_batchnorm_running_statistics_follow_eager():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(144, 5))
    x, y = torch.randn(8, 3, 8, 8), torch.randint(0, 5, (8,))
    pm = gp.compile(model, gp.Strategy(), example_inputs=(x,), example_target=y,
                    loss_fn=F.cross_entropy, optimizer=adamw())
    losses = [pm.train_step(x, target=y) for _ in range(3)]
    reference, ref_losses = train_reference(model, [(x, y)], F.cross_entropy, adamw(), 3)
    _assert_matches(pm, reference, losses, ref_losses)
    assert pm.full_state_dict()["1.num_batches_tracked"].item() == 3
    torch.testing.assert_close(pm(x), reference.eval()(x), atol=1e-5, rtol=0)
    assert pm.full_state_dict()["1.num_batches_tracked"].item() == 3  # eval does not count


def test_loss_traced_at_first_step_when_no_example_target():
    model = tiny_gpt()
    x, y = token_batch()
    pm = gp.compile(model, gp.Strategy(), example_inputs=(x,), loss_fn=lm_loss, optimizer=adamw())
    out_before = pm(x)
    losses = [pm.train_step(x, target=y) for _ in range(2)]
    reference, ref_losses = train_reference(model, [(x, y)], lm_loss, adamw(), 2)
    _assert_matches(pm, reference, losses, ref_losses)
    assert out_before.shape == (8, 16, 64)


def test_model_computing_its_own_loss():
    model = hf_llama()
    x, y = token_batch()
    # transformers models return .loss when given labels; loss_fn=None uses it
    pm = gp.compile(model, gp.Strategy(), example_inputs=(x, None, None, None, None, y),
                    optimizer=adamw())
    loss = pm.train_step(x, None, None, None, None, y)
    expected = copy.deepcopy(model)(x, labels=y).loss.item()
    assert loss == pytest.approx(expected, abs=LOSS_TOL)


def test_state_dict_round_trip_and_bad_state_dicts():
    model = tiny_gpt()
    x, y = token_batch()
    pm = _compile(model, x, y)
    other = tiny_gpt()
    torch.nn.init.normal_(other.wte.weight)
    pm.load_full_state_dict(other.state_dict())
    assert torch.equal(pm.full_state_dict()["lm_head.weight"], other.wte.weight)
    model.load_state_dict(pm.full_state_dict())
    bad = dict(other.state_dict())
    bad.pop("ln_f.bias")
    bad["extra.weight"] = torch.zeros(1)
    with pytest.raises(ValueError, match="missing 1 keys: ln_f.bias.*unexpected 1: extra.weight"):
        pm.load_full_state_dict(bad)
    wrong = dict(other.state_dict())
    wrong["ln_f.bias"] = torch.zeros(7)
    with pytest.raises(ValueError, match=r"'ln_f.bias' has shape \[7\].*\[32\]"):
        pm.load_full_state_dict(wrong)


def test_meta_model_compiles_and_trains_after_loading_weights():
    real = tiny_gpt()
    with torch.device("meta"):
        meta = tiny_gpt()
    x, y = token_batch()
    pm = _compile(meta, x, y)
    with pytest.raises(RuntimeError, match="meta device.*load_full_state_dict"):
        pm.train_step(x, target=y)
    pm.load_full_state_dict(real.state_dict())
    losses = [pm.train_step(x, target=y) for _ in range(2)]
    reference, ref_losses = train_reference(real, [(x, y)], lm_loss, adamw(), 2)
    _assert_matches(pm, reference, losses, ref_losses)


def test_a_batch_microbatches_do_not_divide_and_a_bare_example_are_refused():
    model = tiny_gpt()
    x, y = token_batch()
    pm = _compile(model, x, y, strategy=gp.Strategy(microbatches=2))
    with pytest.raises(ValueError, match=r"microbatches=2"):
        pm.train_step(x[:3], target=y[:3])
    with pytest.raises(TypeError, match="example_inputs=\\(x,\\)"):
        gp.compile(model, gp.Strategy(), example_inputs=x)
