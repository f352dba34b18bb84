"""Global gradient-norm clipping (graphpar/runtime/grad_norm.py): the batch, the reference and
the runs of tests/unit/runtime/test_grad_clip.py and its multiprocess twin (these run inside
graphpar.launch children too)."""
import functools

import torch

import graphpar as gp
from tests.helpers import dp_slice, lm_loss, tiny_gpt, token_batch, train_reference_clipped

STEPS = 3
# the tiny GPT's gradient norm on this batch is 1.21, 0.85 and 0.69 over the three clipped
# steps: every step clips, the first to less than half
MAX_NORM = 0.5
# plain SGD: no optimizer state amplifies float rounding, and (unlike Adam, which divides the
# gradient's scale out again) the clipped step is clip_coef times the unclipped one
SGD = functools.partial(torch.optim.SGD, lr=0.1)


def reference(max_grad_norm=MAX_NORM, **model_options):
    """Single-device eager training on the whole batch with clip_grad_norm_ before each step:
    (total norms, losses, state dict)."""
    model, losses, norms = train_reference_clipped(tiny_gpt(**model_options), [token_batch()], lm_loss, SGD, STEPS,
                                                   max_grad_norm)
    return norms, losses, model.state_dict()


def train(strategy_dict, max_grad_norm=MAX_NORM, options=None, model_options=None):
    """This rank's pm.last_grad_norm after each of STEPS train_steps on its dp slice, and the
    full state after them (`options`: compile's other keyword options, a dict)."""
    strategy = gp.Strategy.from_dict(strategy_dict)
    x, y = token_batch()
    xs, ys = dp_slice(x, strategy), dp_slice(y, strategy)
    pm = gp.compile(tiny_gpt(**(model_options or {})), strategy, example_inputs=(xs,), example_target=ys,
                    loss_fn=lm_loss, optimizer=SGD, max_grad_norm=max_grad_norm, **(options or {}))
    before = pm.last_grad_norm
    norms, losses = [], []
    for _ in range(STEPS):
        losses.append(pm.train_step(xs, target=ys))
        norms.append(pm.last_grad_norm)
    return {"before": before, "norms": norms, "losses": losses, "state": pm.full_state_dict()}


def train_each(strategy_dicts):
    """One launch, several strategies: each's run, in order."""
    return [train(strategy) for strategy in strategy_dicts]
