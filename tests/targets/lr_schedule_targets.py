"""Per-rank functions for tests/multiprocess/runtime/test_lr_schedule.py (run in processes
started by graphpar.launch), and the scheduled single-device reference they compare with:
a warmup + cosine LambdaLR on pm.optimizer, stepped after every train_step."""
import copy
import functools
import math
import os
import warnings

import torch
import torch.distributed as dist

import graphpar as gp
from graphpar.checkpoint import CheckpointError
from tests.helpers import adamw, dp_slice, lm_loss, loadable_state, low_precision_copy, tiny_gpt, token_batch

STEPS, WARMUP = 6, 2
GLOBAL_BATCH = 8


def warmup_cosine(step: int) -> float:
    """Linear warmup over WARMUP steps, then cosine decay to 0 at STEPS: every step's rate
    differs from its neighbours' (0.5, 1, 1, 0.85, 0.5, 0.15 of the base rate)."""
    if step < WARMUP:
        return (step + 1) / WARMUP
    return 0.5 * (1 + math.cos(math.pi * (step - WARMUP) / (STEPS - WARMUP)))


def sgd():
    """The host tables' optimizer: without momentum or weight decay the row-wise update is the
    dense update exactly (docs/placement.md)."""
    return functools.partial(torch.optim.SGD, lr=0.5)


OPTIMIZERS = {"adamw": adamw, "sgd": sgd}


def model_for(strategy: dict):
    """Host tables need an untied model (a tied LM head keeps its table on the device)."""
    return tiny_gpt(tie_weights=not strategy.get("offload_embedding", False))


def train_reference(model, optimizer, steps, schedule=True, dtype=None):
    """Eager single-device training on the global batch, with the schedule (or without, the
    control): the losses, the rate each step ran at, and the final state. With `dtype`, mixed
    precision as graphpar's param_dtype means it: a copy computing in `dtype` (fp32
    gradients), fp32 masters taking the step, the copy refreshed from them."""
    master = copy.deepcopy(model).train()
    compute = low_precision_copy(model, dtype) if dtype is not None else master
    opt = optimizer(master.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine) if schedule else None
    x, y = token_batch(batch=GLOBAL_BATCH)
    losses, rates = [], []
    for _ in range(steps):
        for p in compute.parameters():
            p.grad = None
        loss = lm_loss(compute(x), y)
        loss.backward()
        if compute is not master:
            for p, c in zip(master.parameters(), compute.parameters()):
                p.grad = c.grad.float()
        rates.append(opt.param_groups[0]["lr"])
        opt.step()
        if scheduler is not None:
            scheduler.step()
        if compute is not master:
            with torch.no_grad():
                for p, c in zip(master.parameters(), compute.parameters()):
                    c.copy_(p)
        losses.append(loss.item())
    return losses, rates, master.state_dict()


def compile_scheduled(strategy: dict, optimizer_name: str):
    """The module on this rank's dp slice, and a warmup + cosine LambdaLR on pm.optimizer."""
    s = gp.Strategy(**strategy)
    x, y = token_batch(batch=GLOBAL_BATCH)
    xs, ys = dp_slice(x, s), dp_slice(y, s)
    pm = gp.compile(model_for(strategy), s, example_inputs=(xs,), example_target=ys, loss_fn=lm_loss,
                    optimizer=OPTIMIZERS[optimizer_name](),
                    bucket_bytes=4096)  # several buckets: several per-bucket steps per train_step
    return pm, torch.optim.lr_scheduler.LambdaLR(pm.optimizer, warmup_cosine), xs, ys


def train(pm, scheduler, xs, ys, steps):
    """`steps` train_steps, the scheduler stepped after each: the losses and the rate each ran at."""
    losses, rates = [], []
    for _ in range(steps):
        rates.append(pm.optimizer.param_groups[0]["lr"])
        losses.append(pm.train_step(xs, target=ys))
        scheduler.step()
    return losses, rates


def scheduled_runs(configs):
    """For each (strategy dict, optimizer name), in one set of processes: the losses, the rates
    and the full state after STEPS scheduled steps."""
    results = []
    for strategy, optimizer_name in configs:
        pm, scheduler, xs, ys = compile_scheduled(strategy, optimizer_name)
        losses, rates = train(pm, scheduler, xs, ys, STEPS)
        results.append((losses, rates, loadable_state(pm, model_for(strategy))))
    return results


def resume_scenarios(directory: str, scenarios, stop_at: int):
    """save_and_resume for each (first, seconds) in one set of processes, each in its own
    directory; then a save that only rank 0 gives its scheduler (its refusal)."""
    runs = [save_and_resume(os.path.join(directory, str(i)), first, seconds, stop_at)
            for i, (first, seconds) in enumerate(scenarios)]
    return runs, _disagreeing_save(directory)


def save_and_resume(directory: str, first: dict, seconds, stop_at: int):
    """Under `first`: STEPS scheduled steps, saved after `stop_at` of them (scheduler included).
    Then, for each strategy in `seconds`, a fresh compile that loads the checkpoint into a new
    scheduler and takes the remaining steps; and, as the control, one that loads without the
    scheduler (the rate stays where the save left it). Returns the uninterrupted run, the
    resumed runs and the control (losses, rates, state), the warnings of the control's load,
    and the rank's scheduler state at the save and after each resumed load."""
    pm, scheduler, xs, ys = compile_scheduled(first, "adamw")
    path = os.path.join(directory, "ck")
    losses, rates = train(pm, scheduler, xs, ys, stop_at)
    pm.save_checkpoint(path, extra={"step": stop_at}, lr_scheduler=scheduler)
    saved_scheduler = scheduler.state_dict()
    more_losses, more_rates = train(pm, scheduler, xs, ys, STEPS - stop_at)
    full = (losses + more_losses, rates + more_rates, pm.full_state_dict())
    resumed = []
    for second in seconds:
        pm, scheduler, xs, ys = compile_scheduled(second, "adamw")  # its constructor moved the rate to step 0's
        assert pm.load_checkpoint(path, lr_scheduler=scheduler) == {"step": stop_at}
        loaded_scheduler = scheduler.state_dict()
        resumed.append((*train(pm, scheduler, xs, ys, STEPS - stop_at), pm.full_state_dict(), loaded_scheduler))
    pm, scheduler, xs, ys = compile_scheduled(first, "adamw")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pm.load_checkpoint(path)
    control = (*train(pm, scheduler, xs, ys, STEPS - stop_at), pm.full_state_dict())
    return full, resumed, control, [str(w.message) for w in caught], saved_scheduler


def _disagreeing_save(directory: str) -> str:
    """A save given lr_scheduler= on rank 0 only: refused on every rank (the message)."""
    pm, scheduler, _, _ = compile_scheduled({"dp": dist.get_world_size()}, "adamw")
    try:
        pm.save_checkpoint(os.path.join(directory, "disagreeing"), lr_scheduler=scheduler if dist.get_rank() == 0
                           else None)
    except CheckpointError as error:
        return str(error)
    return "saved"
