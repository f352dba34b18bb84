"""graphpar.verify's single-device reference: eager fp32 training, or mixed precision as
graphpar trains it, with the same training in fp32 beside it to size rounding's own effect."""
import torch

import graphpar as gp
from graphpar.tools.reference import SingleDeviceReference
from tests.helpers import adamw, lm_loss, tiny_gpt, token_batch, train_reference
from tests.targets.placement_targets import train_mixed_reference

STEPS = 3


def _train(strategy, loss_scale=1.0):
    x, y = token_batch(batch=4)
    reference = SingleDeviceReference(tiny_gpt(), gp.Strategy.coerce(strategy), adamw())
    losses = []
    for _ in range(STEPS):
        losses.append(reference.forward_backward((x,), y, lm_loss, loss_scale))
        reference.step()
    return reference, losses, (x, y)


def test_without_param_dtype_it_is_eager_training_exactly():
    reference, losses, batch = _train({})
    eager, eager_losses = train_reference(tiny_gpt(), [batch], lm_loss, adamw(), STEPS)
    assert reference.exact is None
    assert [e.value for e in losses] == eager_losses and all(e.noise == 0.0 for e in losses)
    state = reference.state_dict()
    assert all(torch.equal(state[k].value, v) for k, v in eager.state_dict().items())


def test_bf16_is_the_mixed_precision_reference_and_measures_its_own_rounding():
    reference, losses, batch = _train({"param_dtype": "bf16"})
    masters, mixed_losses = train_mixed_reference(tiny_gpt(), [batch], lm_loss, adamw(), STEPS, torch.bfloat16)
    assert [e.value for e in losses] == mixed_losses
    state = reference.state_dict()
    assert all(torch.equal(state[k].value, v) for k, v in masters.state_dict().items())
    assert all(p.dtype == torch.bfloat16 for p in reference.run.compute.parameters())
    assert all(p.grad.dtype == torch.float32 for p in reference.run.compute.parameters())
    # the fp32 run beside it differs by bf16 rounding: more than zero, far less than the values
    assert all(0 < e.noise < 0.05 * abs(e.value) for e in losses)


def test_reduce_dtype_param_dtype_accumulates_gradients_in_bf16():
    reference, losses, batch = _train({"param_dtype": "bf16", "reduce_dtype": "bf16"})
    masters, mixed_losses = train_mixed_reference(tiny_gpt(), [batch], lm_loss, adamw(), STEPS, torch.bfloat16,
                                                  grad_dtype=torch.bfloat16)
    assert [e.value for e in losses] == mixed_losses
    assert all(p.grad.dtype == torch.bfloat16 for p in reference.run.compute.parameters())


def test_fp16_divides_the_loss_scale_out_and_skips_the_steps_it_is_told():
    reference, _, _ = _train({"param_dtype": "fp16"}, loss_scale=2.0 ** 10)
    masters, _ = train_mixed_reference(tiny_gpt(), [token_batch(batch=4)], lm_loss, adamw(), STEPS, torch.float16,
                                       loss_scale=2.0 ** 10)
    state = reference.state_dict()
    assert all(torch.equal(state[k].value, v) for k, v in masters.state_dict().items())
    before = {k: e.value.clone() for k, e in state.items()}
    x, y = token_batch(batch=4)
    reference.forward_backward((x,), y, lm_loss, 2.0 ** 10)
    reference.step(skip=True)  # the step the compiled run's loss scaler skipped
    assert all(torch.equal(reference.state_dict()[k].value, v) for k, v in before.items())
