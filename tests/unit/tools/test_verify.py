"""graphpar.verify on one process: a learning-rate schedule reaches both sides."""
import functools
import math

import torch

import graphpar as gp
from tests.helpers import adamw, lm_loss, tiny_gpt, token_batch

STEPS = 4


def warmup_then_cosine(step: int) -> float:
    """A rate that changes a lot between steps (0.25, 0.5, ... then down a cosine)."""
    return (step + 1) / 4 if step < 3 else 0.5 * (1 + math.cos(math.pi * (step - 3) / STEPS))


SCHEDULE = functools.partial(torch.optim.lr_scheduler.LambdaLR, lr_lambda=warmup_then_cosine)


def _verify(strategy, model, lr_scheduler):
    x, y = token_batch(batch=8)
    return gp.verify(model, strategy, example_inputs=(x,), target=y, loss_fn=lm_loss, optimizer=adamw(),
                     steps=STEPS, lr_scheduler=lr_scheduler)


def test_a_schedule_steps_the_compiled_run_and_the_reference_alike():
    scheduled = _verify({"microbatches": 2}, tiny_gpt(), SCHEDULE)
    plain = _verify({"microbatches": 2}, tiny_gpt(), None)
    assert scheduled.passed, scheduled.message
    # the schedule changed training (so both sides took it, or verify would have failed)
    assert abs(scheduled.losses[-1] - plain.losses[-1]) > 1e-3


def test_host_tables_follow_the_schedule_in_the_reference_too():
    # graphpar's host tables take the scheduled rate from pm.optimizer before every update;
    # the reference's row-wise steps take it from its dense optimizer the same way
    report = _verify({"offload_embedding": True, "offload_optimizer": True}, tiny_gpt(tie_weights=False), SCHEDULE)
    assert report.passed, report.message
