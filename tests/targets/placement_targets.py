"""Per-rank functions for the host placement tests (run by graphpar.launch), and the
mixed-precision reference they compare with."""
import copy
import functools

import torch
import torch.distributed as dist

import graphpar as gp
from graphpar.runtime.placement.transfers import bytes_moved, reset_bytes_moved
from tests.helpers import adamw, lm_loss, loadable_state, low_precision_copy, tiny_gpt, token_batch


def sgd(lr=0.5):
    return functools.partial(torch.optim.SGD, lr=lr)


def local_slice(tensor, mesh):
    per = tensor.shape[0] // mesh.dp
    return tensor[mesh.dp_rank * per:(mesh.dp_rank + 1) * per]


def _train(model, strategy, steps, optimizer, global_batch=8, with_target=True, **options):
    """`with_target=False` compiles without example_target (traced again at the first step)."""
    x, y = token_batch(batch=global_batch)
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    mesh = gp.Strategy.coerce(strategy)
    dp_rank = (rank // mesh.tp) % mesh.dp  # Megatron order: tp fastest, then dp
    per = global_batch // mesh.dp
    xs, ys = x[dp_rank * per:(dp_rank + 1) * per], y[dp_rank * per:(dp_rank + 1) * per]
    pm = gp.compile(model, strategy, example_inputs=(xs,), example_target=ys if with_target else None,
                    loss_fn=lm_loss, optimizer=optimizer, **options)
    losses = [pm.train_step(xs, target=ys) for _ in range(steps)]
    return pm, losses


def offload_vs_device(strategy: dict, steps: int, tie_weights: bool = True):
    """The same strategy with the optimizer on the device and on the host, each compiled
    with and without example_target: [(losses, full state)] in that order."""
    results = []
    for with_target in (True, False):
        for offload in (False, True):
            model = tiny_gpt(tie_weights=tie_weights)
            pm, losses = _train(model, {**strategy, "offload_optimizer": offload}, steps, adamw(),
                                with_target=with_target,
                                bucket_bytes=4096)  # several buckets: several host steps per train_step
            results.append((losses, loadable_state(pm, model)))
    return results


def mixed_precision(strategy: dict, steps: int, optimizer_name: str):
    optimizer = adamw() if optimizer_name == "adamw" else sgd()
    pm, losses = _train(tiny_gpt(), strategy, steps, optimizer, bucket_bytes=4096)
    return losses, pm.full_state_dict()


def train_mixed_reference(model, batches, loss_fn, optimizer, steps, dtype, loss_scale=1.0,
                          grad_dtype=torch.float32):
    """Single-device mixed precision: the model computes in `dtype` (parameters and buffers
    cast, floating inputs cast) with gradients in `grad_dtype` (graphpar's reduce_dtype), fp32
    master weights take the optimizer step. `loss_scale`:
    a static loss scale (torch.amp.GradScaler's arithmetic at a scale that never overflows):
    backward from loss * scale, the fp32 gradients divided by it."""
    master = copy.deepcopy(model).train()
    compute = low_precision_copy(model, dtype, grad_dtype)
    opt = optimizer(master.parameters())
    losses = []
    for step in range(steps):
        x, y = batches[step % len(batches)]
        x = x.to(dtype) if x.is_floating_point() else x
        for p in compute.parameters():
            p.grad = None
        loss = loss_fn(compute(x), y)
        (loss.float() * loss_scale).backward()
        for pm_, pc in zip(master.parameters(), compute.parameters()):
            pm_.grad = pc.grad.float() / loss_scale
        opt.step()
        with torch.no_grad():
            for pm_, pc in zip(master.parameters(), compute.parameters()):
                pc.copy_(pm_)
        losses.append(loss.item())
    return master, losses


def fp16_zero(steps: int):
    """fp16 compute weights with ZeRO at dp = world size, per stage: the losses, the state after
    `steps` SGD steps, the steps skipped and the loss scale; then one step at a scale far past
    fp16's range on rank 0 only (the other ranks' gradients stay finite), with the state after it."""
    runs = []
    for zero in (1, 2, 3):
        pm, losses = _train(tiny_gpt(), {"dp": dist.get_world_size(), "param_dtype": "fp16", "zero": zero}, steps,
                            sgd(), bucket_bytes=4096)  # several buckets: several shards per rank
        run = {"losses": losses, "state": pm.full_state_dict(), "skipped": pm.loss_scaler.skipped,
               "scale": pm.loss_scaler.scale}
        x, y = token_batch(batch=8)
        if dist.get_rank() == 0:
            pm.loss_scaler.scale = 2.0 ** 40  # rank 0's gradients overflow
        pm.train_step(local_slice(x, pm.mesh), target=local_slice(y, pm.mesh))
        run["overflowed"] = {"state": pm.full_state_dict(), "skipped": pm.loss_scaler.skipped,
                             "scale": pm.loss_scaler.scale}
        runs.append(run)
    return runs


def host_embedding_run(strategy: dict, steps: int, optimizer_name: str):
    """An untied GPT with its token and position tables on the host, compiled with and then
    without example_target: per run, the losses, final state, and the bytes the last step's
    lookups moved (forward rows + backward row gradients)."""
    optimizer = sgd() if optimizer_name == "sgd" else adamw()
    runs = []
    for with_target in (True, False):
        model = tiny_gpt(tie_weights=False)
        pm, losses = _train(model, {**strategy, "offload_embedding": True}, steps - 1, optimizer,
                            with_target=with_target)
        reset_bytes_moved()
        x, y = token_batch(batch=8)
        xs, ys = local_slice(x, pm.mesh), local_slice(y, pm.mesh)
        losses.append(pm.train_step(xs, target=ys))
        moved = bytes_moved()
        runs.append((losses, loadable_state(pm, model), moved, xs))
    return runs
