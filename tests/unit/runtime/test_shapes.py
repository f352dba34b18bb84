"""Batches of varying shape in a world of one (graphpar/runtime/shapes.py): each new batch
size or sequence length gets a program of its own, traced once and sharing every stateful
object, and training matches single-device training on the same batches. The multiprocess
twin (tests/multiprocess/runtime/test_shapes.py) takes the same tolerances at tp x pp and dp."""
import functools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import graphpar as gp
from tests.helpers import assert_trains_as, largest_difference, lm_loss, token_batch, train_reference
from tests.targets import shapes_targets as targets

# sequence lengths 16 and 32 in turn, and batch sizes 8, 4 and 6 (microbatches of 4, 2, 3)
SHAPES = [(8, 16), (4, 32), (8, 16), (4, 32), (6, 16)]
# The step's loss: the same float32 sums as eager's in another order (microbatches), a few
# units of 1e-7 relative at a loss of ~4 (a program on other weights is off by > 1e-3)
LOSS_RTOL = 1e-6
# Parameters after 5 SGD steps (lr 0.1, momentum 0.9): gradients agree to float32 rounding of
# sums taken in another order (~1e-7 relative, gradients below 1), times lr and the momentum's
# accumulation (< 5), so ~1e-8 apart; a program stepping other tensors or another momentum
# lands ~1e-3 away (MOVED: the steps move every run's parameters that far)
PARAM_ATOL = 1e-6
MOVED = 1e-3


def assert_matches_eager(run, ref_losses, ref_state):
    assert_trains_as(run, ref_losses, ref_state, LOSS_RTOL, PARAM_ATOL)
    assert largest_difference(run["state"], targets.model().state_dict()) > MOVED
    # pm(x) of the last batch, against the eager model with the trained weights: float32 noise
    expected = targets.reference_output(ref_state, run["evaluated_input"])
    torch.testing.assert_close(run["out"], expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("tracer, strategy", [
    ("fx", dict(microbatches=2)),
    ("export", dict(microbatches=2)),                          # sizes baked into view constants
    ("fx", dict(microbatches=2, offload_optimizer=True)),      # one update program, masters on the host
    ("fx", dict(microbatches=2, recompute="full")),            # each program its own regions
])
def test_each_shape_is_traced_once_and_training_matches_eager(tracer, strategy):
    ref_losses, ref_state = targets.reference(SHAPES)
    run = targets.train(gp.Strategy(**strategy).to_dict(), SHAPES, {"tracer": tracer})
    assert run["traced"] == [1, 2, 2, 2, 3]  # compile's, then [4, 32] and [3, 16] on first sight only
    assert run["evaluated"] == 3             # pm(x) of the last batch runs its training program's shape
    assert run["shapes"] == [{"inputs": [[4, 16]], "target": [[4, 16]]}, {"inputs": [[2, 32]], "target": [[2, 32]]},
                             {"inputs": [[3, 16]], "target": [[3, 16]]}]
    assert_matches_eager(run, ref_losses, ref_state)


def test_pm_x_runs_a_program_that_fits_and_compiles_one_for_a_batch_none_fits():
    model = targets.model()
    x, y = token_batch(12, 16)
    eager = model.eval()(x).detach()
    with targets.counting_traces() as traces:
        pm = gp.compile(model, gp.Strategy(microbatches=2), example_inputs=(x[:8],), example_target=y[:8],
                        loss_fn=lm_loss, optimizer=targets.SGD)
        for rows, traced in ((4, 1), (12, 1), (3, 2), (6, 2)):  # 1, 3 chunks of [4, 16]; a [3, 16] program
            torch.testing.assert_close(pm(x[:rows]), eager[:rows], atol=1e-5, rtol=0)  # float32 noise
            assert len(traces) == traced, rows
        pm.train_step(x[:6], target=y[:6])  # [3, 16] traced again with its loss, which replaces the other
        assert len(traces) == 3
    assert pm.report().shapes == [{"inputs": [[4, 16]], "target": [[4, 16]]},
                                  {"inputs": [[3, 16]], "target": [[3, 16]]}]


def test_the_loss_traced_at_the_first_step_of_a_new_shape():
    """compile without example_target, the first train_step on another shape: the lazy loss
    trace is that shape's program, then compile's shape gets its loss too."""
    shapes = [(4, 32), (8, 16), (4, 32)]
    ref_losses, ref_state = targets.reference(shapes)
    batches = targets.global_batches(shapes)
    with targets.counting_traces() as traces:
        pm = gp.compile(targets.model(), gp.Strategy(microbatches=2), example_inputs=(batches[1][0],),
                        loss_fn=lm_loss, optimizer=targets.SGD)
        losses = [pm.train_step(x, target=y) for x, y in batches]
    assert len(traces) == 3
    assert losses == pytest.approx(ref_losses, rel=LOSS_RTOL, abs=0)
    for key, value in pm.full_state_dict().items():
        torch.testing.assert_close(value, ref_state[key], atol=PARAM_ATOL, rtol=0, msg=key)


def test_a_module_kept_whole_trains_one_set_of_weights_in_every_program():
    """leaf_modules: the module is called, not traced through; every program compiled again
    holds the same weights (a fresh copy of the user's module would hold untrained weights
    the optimizer never steps)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(n, 4, generator=g), torch.randn(n, 2, generator=g)) for n in (4, 2, 4, 6)]
    sgd = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)
    pm = gp.compile(model, gp.Strategy(), example_inputs=(batches[0][0],), loss_fn=F.mse_loss, optimizer=sgd,
                    leaf_modules=["2"])  # no example target: the lazy loss trace compiles again too
    losses = [pm.train_step(x, target=y) for x, y in batches]
    reference, ref_losses = train_reference(model, batches, F.mse_loss, sgd, len(batches))
    assert losses == pytest.approx(ref_losses, rel=LOSS_RTOL, abs=0)
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(pm.full_state_dict()[key], value, atol=PARAM_ATOL, rtol=0, msg=key)


def test_the_report_plans_another_shape_and_lists_the_programs():
    x, y = token_batch(4, 16)
    long_x, long_y = token_batch(4, 32)
    pm = gp.compile(targets.model(), gp.Strategy(), example_inputs=(x,), example_target=y, loss_fn=lm_loss,
                    optimizer=targets.SGD)
    pm.train_step(long_x, target=long_y)
    compiled, longer = pm.report(), pm.report(long_x, target=long_y)
    # twice the tokens: the saved activations grow (attention's scores four times), the weights do not
    assert longer.ranks[0].activation_peak_bytes > 1.9 * compiled.ranks[0].activation_peak_bytes
    assert longer.ranks[0].param_bytes == compiled.ranks[0].param_bytes
    assert "one per microbatch shape (2):\n  inputs [[4, 16]], target [[4, 16]]\n  inputs [[4, 32]]" in compiled.to_text()


def test_each_program_keeps_the_constants_its_trace_baked():
    """A count torch.export bakes into a constant of the traced shape (the target's size): the
    program of [4, 32] divides by its own 128 tokens, not by [4, 16]'s 64 (the programs share
    the model's state, never a trace's constants)."""
    shapes = [(4, 16), (4, 32), (4, 16)]
    ref_losses, ref_state = targets.reference(shapes)  # the mean over every token: the token mean
    batches = targets.global_batches(shapes)
    pm = gp.compile(targets.model(), gp.Strategy(), example_inputs=(batches[0][0],), example_target=batches[0][1],
                    loss_fn=targets.token_sum_of_a_constant, optimizer=targets.SGD)
    losses = [pm.train_step(x, target=y) for x, y in batches]
    assert pm.front_end == "export"
    assert losses == pytest.approx(ref_losses, rel=LOSS_RTOL, abs=0)
    for key, value in pm.full_state_dict().items():
        torch.testing.assert_close(value, ref_state[key], atol=PARAM_ATOL, rtol=0, msg=key)


def test_verify_takes_batches_of_varying_shape():
    """gp.verify(batches=...): the steps take the batches in turn, each shape its own program,
    against the single-device reference on the same batches."""
    (x, y), (long_x, long_y) = targets.global_batches([(8, 16), (4, 32)])
    report = gp.verify(targets.model(), gp.Strategy(microbatches=2), (x,), target=y, loss_fn=lm_loss,
                       batches=[((long_x,), long_y), ((x,), y)], steps=3)
    assert report.passed, report.message
    sgd = functools.partial(torch.optim.SGD, lr=1e-2)  # verify's default optimizer
    _, ref_losses = train_reference(targets.model(), [(long_x, long_y), (x, y)], lm_loss, sgd, 3)
    assert report.reference_losses == pytest.approx(ref_losses, rel=LOSS_RTOL, abs=0)  # its steps took the batches
