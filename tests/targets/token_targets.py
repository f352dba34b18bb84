"""Token-weighted losses (graphpar/runtime/grad_divisor.py): the padded batch, the losses and
the runs of tests/unit/runtime/test_token_weighted.py and its multiprocess twin (these run
inside graphpar.launch children too)."""
import functools

import torch
import torch.nn.functional as F

import graphpar as gp
from tests.helpers import dp_slice, tiny_gpt, token_batch, train_reference

IGNORE = -100
GLOBAL_BATCH = 8
# real (not ignore_index) tokens of each sample of the global batch, sequence length 16; a
# chunk of two samples is one microbatch of one dp rank at dp=2 with 2 microbatches (and one
# microbatch of a world of one with 4): each chunk pads differently, 19, 10, 28 and 19 real
# tokens of 32, so a per-chunk mean weights a token of the 10-token chunk about twice
REAL_TOKENS = (3, 16, 9, 1, 16, 12, 5, 14)
# plain SGD: no optimizer state amplifies float rounding (Adam's division by sqrt(v) does), so
# parameters after a few steps keep the gradients' relative agreement, ~1e-7
SGD = functools.partial(torch.optim.SGD, lr=0.1)


def padded_batch():
    """(ids, targets) of the global batch, each sample's targets after REAL_TOKENS ignored."""
    x, y = token_batch(batch=GLOBAL_BATCH)
    y = y.clone()
    for sample, real in enumerate(REAL_TOKENS):
        y[sample, real:] = IGNORE
    return x, y


def token_sum(logits, target):
    """The token-weighted form: the summed cross entropy of the real tokens, and their count."""
    loss_sum = F.cross_entropy(logits.flatten(0, 1), target.flatten(), ignore_index=IGNORE, reduction="sum")
    return loss_sum, (target != IGNORE).sum()


def token_mean(logits, target):
    """The mean over the real tokens of whatever batch it is given (a microbatch under graphpar)."""
    return F.cross_entropy(logits.flatten(0, 1), target.flatten(), ignore_index=IGNORE)


LOSSES = {"token_sum": token_sum, "token_mean": token_mean}


def reference(steps):
    """Single-device eager training on the whole global batch with the token mean: (losses,
    state dict)."""
    model, losses = train_reference(tiny_gpt(), [padded_batch()], token_mean, SGD, steps)
    return losses, model.state_dict()


def train(strategy_dict, steps, loss_name, options=None):
    """This rank's losses and the full state after `steps` train_steps on its dp slice
    (`options`: compile's keyword options, a dict, as launch passes only positional args)."""
    options = options or {}
    strategy = gp.Strategy.from_dict(strategy_dict)
    x, y = padded_batch()
    xs, ys = dp_slice(x, strategy), dp_slice(y, strategy)
    pm = gp.compile(tiny_gpt(), strategy, example_inputs=(xs,), example_target=ys, loss_fn=LOSSES[loss_name],
                    optimizer=SGD, **options)
    losses = [pm.train_step(xs, target=ys) for _ in range(steps)]
    return {"losses": losses, "state": pm.full_state_dict(), "roles": sorted(set(pm.compiled.tp_plan.roles.values())),
            "program": pm.compiled.program.loss_outputs, "out": pm(xs), "dp_rank": pm.mesh.dp_rank}


def reference_output(state, dp_rank, dp):
    """The eager model with `state`, evaluated on dp rank `dp_rank`'s slice of the batch."""
    model = tiny_gpt()
    model.load_state_dict(state)
    x, _ = padded_batch()
    local = GLOBAL_BATCH // dp
    with torch.no_grad():
        return model.eval()(x[dp_rank * local:(dp_rank + 1) * local])


def train_both(strategy_dict, steps):
    """The token-weighted run and, on the same data, the per-microbatch mean (one launch)."""
    return {name: train(strategy_dict, steps, name) for name in LOSSES}
