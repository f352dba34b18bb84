"""Per-rank functions for tests/multiprocess/runtime/test_recompute.py: each case trains with
every Strategy.recompute mode and without it, in one launched world (start-up dominates)."""

import graphpar as gp
from tests import helpers

STEPS = 2
# dropout everywhere the models have it: the masks must be replayed, not drawn again
DROPOUT = 0.1


def build(name):
    """The model and its loss; each builder seeds, so each call gives the same weights."""
    if name == "gpt":
        return helpers.tiny_gpt(n_layer=4, dropout=DROPOUT), helpers.lm_loss
    if name == "hf_llama":
        return helpers.hf_llama(n_layer=4, attention_dropout=DROPOUT), helpers.hf_causal_lm_loss
    raise ValueError(name)


def run(name, strategy, steps=STEPS, measure=False):
    """Trains one compile; the losses, this rank's gradients (after the last step) and
    parameters (after every step), the peak bytes autograd saved in the last step and the
    plan's activation figure for this rank."""
    model, loss_fn = build(name)
    strategy = gp.Strategy.coerce(strategy)
    x, y = helpers.token_batch(batch=4 * strategy.dp)
    xs, ys = helpers.dp_slice(x, strategy), helpers.dp_slice(y, strategy)
    pm = gp.compile(model, strategy, example_inputs=(xs,), example_target=ys, loss_fn=loss_fn,
                    optimizer=helpers.adamw())
    losses = [pm.train_step(xs, target=ys) for _ in range(steps - 1)]
    peak = helpers.peak_saved_bytes(lambda: losses.append(pm.train_step(xs, target=ys)), helpers.held_parameters(pm))
    out = {"losses": losses,
           "grads": {n: p.grad.clone() for n, p in pm.named_parameters() if p.grad is not None},
           "params": {n: p.detach().clone() for n, p in pm.named_parameters()},
           "peak": peak}
    if measure:
        report = gp.plan(model, strategy, example_inputs=(xs,), loss_fn=loss_fn, example_target=ys,
                         world_size=strategy.world_size, optimizer=helpers.adamw())
        out["planned"] = report.ranks[pm.mesh.rank].activation_peak_bytes
        out["notes"] = report.notes
    return out


def train_modes(cases):
    """cases: (model name, strategy dict, modes, measure); per case, per mode, run()."""
    return [{mode: run(name, {**strategy, "recompute": mode}, measure=measure) for mode in modes}
            for name, strategy, modes, measure in cases]
