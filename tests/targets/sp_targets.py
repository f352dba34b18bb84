"""Per-rank functions for the sequence-parallel tests (run under graphpar.launch)."""
import torch
import torch.distributed as dist

import graphpar as gp
from tests import helpers
from tests.targets import tp_targets


def train(name, strategy_dict, steps, batch=4, dropout_masks="local"):
    """Train with the strategy; return the losses, this rank's local gradients after step 1
    (before any update) with the shard specs to compare them, the final full state and pm(x)."""
    strategy = gp.Strategy.from_dict(strategy_dict)
    model, loss_fn = tp_targets.build(name, strategy.tp)
    x, y = helpers.token_batch(batch=batch)
    xs, ys = helpers.dp_slice(x, strategy), helpers.dp_slice(y, strategy)
    pm = gp.compile(model, strategy, example_inputs=(xs,), example_target=ys, loss_fn=loss_fn,
                    optimizer=helpers.adamw(), dropout_masks=dropout_masks)
    opt = pm.optimizer
    pm.optimizer = None  # first step: gradients only, compared before any update
    losses = [pm.train_step(xs, target=ys)]
    grads = {n: p.grad.clone() for n, p in pm.named_parameters()}
    pm.optimizer = opt
    if opt is not None:
        opt.step()
    losses += [pm.train_step(xs, target=ys) for _ in range(steps - 1)]
    out = pm(xs)
    out = out.logits if hasattr(out, "logits") else out
    return {"losses": losses, "grads": grads, "shards": dict(pm._shards()), "tp_rank": pm.mesh.tp_rank,
            "dp_rank": pm.mesh.dp_rank, "state": pm.full_state_dict(), "out": out}


def dropout_gpt():
    """tiny GPT with dropout only where sequence parallelism splits the sequence: after the
    embeddings and on both residual branches (attention dropout runs inside sdpa, on heads)."""
    model = helpers.tiny_gpt(dropout=0.2)
    for block in model.blocks:
        block.attn.dropout = 0.0
    return model


def dropout_run(masks, seed=0, steps=2):
    """Losses of a few steps with dropout in the sequence-parallel region (tp = world size;
    one process: tp = 1 without sequence parallelism), and this rank's first keep-mask there."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    x, y = helpers.token_batch(batch=4)
    strategy = gp.Strategy(tp=world, sequence_parallel=world > 1, seed=seed)
    pm = gp.compile(dropout_gpt(), strategy, example_inputs=(x,), example_target=y, loss_fn=helpers.lm_loss,
                    optimizer=helpers.adamw(), dropout_masks=masks)
    mask = _first_dropout_mask(pm, x, y)
    return {"losses": [pm.train_step(x, target=y) for _ in range(steps)], "mask": mask}


def _first_dropout_mask(pm, x, y):
    """Run the training program once, as the executor does, and keep the first dropout's
    keep-mask; the streams are forked so the training that follows draws the same numbers."""
    from graphpar.runtime import ops
    outputs = {}

    class Recorder(torch.fx.Interpreter):
        def run_node(self, n):
            result = super().run_node(n)
            if n.target is ops.dropout and not outputs:
                outputs["mask"] = result != 0
            return result
    streams = {name: torch.Generator().manual_seed(0) for name in pm._rng}
    for name, generator in pm._rng.items():
        streams[name].set_state(generator.get_state())
    with ops.mode(training=True), ops.running_on(pm.mesh), ops.rng_streams(streams), torch.no_grad():
        Recorder(pm.graph_modules[0]).run(x, y)
    return outputs["mask"]


def measure(name, strategy_dict, batch=4):
    """One training step with every all-reduce and all-gather counted (bytes, calls)."""
    strategy = gp.Strategy.from_dict(strategy_dict)
    model, loss_fn = tp_targets.build(name, strategy.tp)
    x, y = helpers.token_batch(batch=batch)
    xs, ys = helpers.dp_slice(x, strategy), helpers.dp_slice(y, strategy)
    pm = gp.compile(model, strategy, example_inputs=(xs,), example_target=ys, loss_fn=loss_fn,
                    optimizer=helpers.adamw())
    counts = {}

    def count(op, nbytes):
        entry = counts.setdefault(op, [0, 0])
        entry[0] += nbytes
        entry[1] += 1
    all_reduce, all_gather = dist.all_reduce, dist.all_gather

    def counting_all_reduce(tensor, *args, **kwargs):
        count("all_reduce", tensor.numel() * tensor.element_size())
        return all_reduce(tensor, *args, **kwargs)

    def counting_all_gather(parts, tensor, *args, **kwargs):
        count("all_gather", sum(p.numel() * p.element_size() for p in parts))   # the gathered tensor
        return all_gather(parts, tensor, *args, **kwargs)
    dist.all_reduce, dist.all_gather = counting_all_reduce, counting_all_gather
    try:
        pm.train_step(xs, target=ys)
    finally:
        dist.all_reduce, dist.all_gather = all_reduce, all_gather
    return {"counts": counts, "rank": dist.get_rank(), "backend": dist.get_backend()}


def run_many(jobs):
    """Several runs in one set of processes (process start-up dominates these small runs):
    jobs are (function name in this module, args)."""
    return [globals()[name](*args) for name, args in jobs]
