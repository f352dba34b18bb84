"""fp32 gradients for low-precision weights (issue 17) in one process: with param_dtype set,
each microbatch's gradient is added into p.grad in Strategy.gradient_dtype (fp32 unless
reduce_dtype is the compute dtype) exactly as eager autograd adds it for a bf16 model whose
parameters have that grad_dtype. The launched twin (tests/multiprocess/runtime/test_reduce_dtype.py)
covers the dp reductions, ZeRO and the effect on training."""
import pytest
import torch

import graphpar as gp
from tests.helpers import low_precision_copy
from tests.targets import reduce_dtype_targets as targets

MICROBATCHES = 8


def _accumulated(reduce_dtype):
    """p.grad of graphpar and of eager autograd after one step of MICROBATCHES microbatches."""
    x, y = targets.batch(1, MICROBATCHES)
    strategy = gp.Strategy(microbatches=MICROBATCHES, param_dtype="bf16", reduce_dtype=reduce_dtype)
    # no optimizer: train_step computes the gradients and steps nothing
    pm = gp.compile(targets.TwoLayers(), strategy, example_inputs=(x,), example_target=y, loss_fn=targets.mse)
    pm.train_step(x, target=y)
    eager = low_precision_copy(targets.TwoLayers(), torch.bfloat16, strategy.gradient_dtype)
    for xm, ym in zip(x.chunk(MICROBATCHES), y.chunk(MICROBATCHES)):
        (targets.mse(eager(xm.bfloat16()), ym) / MICROBATCHES).backward()  # the mean form's scaling
    return dict(pm.named_parameters()), dict(eager.named_parameters())


@pytest.mark.parametrize("reduce_dtype, grad_dtype", [(None, torch.float32), ("bf16", torch.bfloat16)])
def test_microbatch_gradients_accumulate_in_the_reduce_dtype_as_eager_autograd_does(reduce_dtype, grad_dtype):
    compiled, eager = _accumulated(reduce_dtype)
    for name, p in compiled.items():
        assert p.dtype == torch.bfloat16 and p.grad.dtype == grad_dtype, name
        # the same bf16 ops per microbatch, added in the same order in the same dtype: equal
        torch.testing.assert_close(p.grad, eager[name].grad, rtol=0, atol=0, msg=name)


def test_fp32_and_bf16_accumulation_differ_on_this_batch():
    """So that the equality above could not hold by accident of the data."""
    fp32, _ = _accumulated(None)
    bf16, _ = _accumulated("bf16")
    assert any(not torch.equal(fp32[name].grad, bf16[name].grad.float()) for name in fp32)
