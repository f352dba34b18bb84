"""Per-rank functions for tests/test_zero.py (run in processes started by graphpar.launch)."""
import functools
import os

import torch
import torch.distributed as dist

import graphpar as gp
from tests.helpers import adamw, dp_slice, lm_loss, loadable_state, tiny_gpt, token_batch


def optimizer(name):
    if name == "adamw":
        return adamw()
    return functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)


def _compile(strategy, global_batch, optimizer_name="adamw", model=None):
    x, y = token_batch(batch=global_batch)
    xs, ys = dp_slice(x, strategy), dp_slice(y, strategy)
    model = model or tiny_gpt()
    pm = gp.compile(model, strategy, example_inputs=(xs,), example_target=ys, loss_fn=lm_loss,
                    optimizer=optimizer(optimizer_name),
                    bucket_bytes=4096)  # small buckets: several reduce-scatters per step
    return pm, model, xs, ys


def _state_elements(pm):
    """Elements of per-element optimizer state this rank holds (scalars such as Adam's step
    left out, as the planner counts)."""
    return sum(t.numel() for state in pm.optimizer.state.values() for t in state.values()
               if torch.is_tensor(t) and t.dim() > 0)


def train(strategy_dict, steps, global_batch, optimizer_name):
    """Losses, the full state, pm(x) on this rank's slice, and what the rank holds."""
    strategy = gp.Strategy.from_dict(strategy_dict)
    pm, model, xs, ys = _compile(strategy, global_batch, optimizer_name)
    losses = [pm.train_step(xs, target=ys) for _ in range(steps)]
    update = pm._placed.shard_steps
    held = {
        "state_elements": _state_elements(pm),
        "owned": sum(step.layout.owned() for step in update),
        "padding": sum(step.layout.padding for step in update),
        "elements": sum(p.numel() for p in pm.parameters()),
        "grads": [p.grad is not None for p in pm.parameters()],
        "dp_rank": pm.mesh.dp_rank,
        "buckets": len(update),
    }
    return losses, loadable_state(pm, model), pm(xs), held


def save_reload(directory, steps, global_batch):
    """(dp=4, zero=2) trains, saves A and steps on; (dp=2, tp=2, zero=0) loads A, saves B and
    steps; (dp=4, zero=2) loads B, saves C and takes the step the first run took."""
    first = gp.Strategy(dp=4, zero=2)
    pm, model, xs, ys = _compile(first, global_batch)
    losses = [pm.train_step(xs, target=ys) for _ in range(steps)]
    pm.save_checkpoint(os.path.join(directory, "A"))
    straight = pm.train_step(xs, target=ys)

    other, _, xo, yo = _compile(gp.Strategy(dp=2, tp=2), global_batch)
    other.load_checkpoint(os.path.join(directory, "A"))
    other.save_checkpoint(os.path.join(directory, "B"))
    other_loss = other.train_step(xo, target=yo)

    again, _, _, _ = _compile(first, global_batch)
    again.load_checkpoint(os.path.join(directory, "B"))
    again.save_checkpoint(os.path.join(directory, "C"))
    resumed = again.train_step(xs, target=ys)
    return losses, straight, other_loss, resumed, pm.full_state_dict(), again.full_state_dict(), dist.get_rank()


def planned_and_held(strategy_dict):
    """One step, then the plan of this module beside what the rank holds and moved."""
    from graphpar.runtime.placement.transfers import bytes_moved, reset_bytes_moved
    strategy = gp.Strategy.from_dict(strategy_dict)
    pm, _, xs, ys = _compile(strategy, 8)
    pm.train_step(xs, target=ys)
    reset_bytes_moved()
    pm.train_step(xs, target=ys)
    moved = bytes_moved()
    plan = pm.report().ranks[dist.get_rank()]
    steps = pm._placed.shard_steps
    held = {
        "param": sum(p.nbytes for p in pm.parameters()),
        "grad": sum(p.grad.nbytes for p in pm.parameters() if p.grad is not None),
        "masters": sum(step.flat.nbytes for step in steps if step.flat is not None),
        "states": sum(t.nbytes for state in pm.optimizer.state.values() for t in state.values()),  # 0-d steps too
        "moved": moved,
    }
    planned = {"param": plan.param_bytes, "grad": plan.grad_bytes, "optimizer": plan.optimizer_bytes,
               "host": plan.host_bytes, "host_moves": {t.op: t.bytes for t in plan.collectives if t.axis == "host"}}
    return planned, held
