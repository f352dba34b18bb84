"""Per-rank functions for the data-parallel tests (run in processes started by graphpar.launch)."""
import torch
import torch.distributed as dist

import graphpar as gp
from tests.helpers import adamw, lm_loss, tiny_gpt, token_batch


def train_gpt_dp(steps: int, microbatches: int, global_batch: int, seed_per_rank: bool):
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(rank if seed_per_rank else 0)
    model = tiny_gpt() if not seed_per_rank else _differently_seeded_gpt(rank)
    x, y = token_batch(batch=global_batch)
    local = global_batch // world
    xs, ys = x[rank * local:(rank + 1) * local], y[rank * local:(rank + 1) * local]
    pm = gp.compile(model, gp.Strategy(dp=world, microbatches=microbatches), example_inputs=(xs,),
                    example_target=ys, loss_fn=lm_loss, optimizer=adamw(),
                    bucket_bytes=4096)  # small buckets: several all-reduces in flight per step
    losses = [pm.train_step(xs, target=ys) for _ in range(steps)]
    return losses, pm.full_state_dict(), len(pm._executor.grad_sync.buckets)


def _differently_seeded_gpt(rank):
    model = tiny_gpt()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(rank)  # replicas must be overwritten by the first replica's weights
    return model


def mismatched_shapes():
    rank = dist.get_rank()
    x, y = token_batch(batch=4 + 2 * rank)
    gp.compile(tiny_gpt(), gp.Strategy(dp=2), example_inputs=(x,), example_target=y, loss_fn=lm_loss)


def bn_cnn():
    # Convolutions before batch norm have no bias (as in ResNet): BN cancels a bias, whose
    # gradient is then pure rounding noise that Adam would amplify to +-lr per step.
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 3, bias=False), torch.nn.BatchNorm2d(4), torch.nn.ReLU(),
        torch.nn.Conv2d(4, 4, 3, bias=False), torch.nn.BatchNorm2d(4), torch.nn.ReLU(),
        torch.nn.Flatten(), torch.nn.Linear(4 * 4 * 4, 5))


def bn_batch(global_batch=8):
    g = torch.Generator().manual_seed(3)
    return torch.randn(global_batch, 3, 8, 8, generator=g) * 2 + 1, torch.randint(0, 5, (global_batch,), generator=g)


def train_bn_cnn_dp(steps: int, tracer: str, zero: int = 0):
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = bn_batch()
    local = x.shape[0] // world
    xs, ys = x[rank * local:(rank + 1) * local], y[rank * local:(rank + 1) * local]
    pm = gp.compile(bn_cnn(), gp.Strategy(dp=world, zero=zero), example_inputs=(xs,), example_target=ys,
                    loss_fn=torch.nn.functional.cross_entropy, optimizer=adamw(), tracer=tracer,
                    bucket_bytes=512)  # several buckets at zero=3: gathers interleave with the convolutions
    losses = [pm.train_step(xs, target=ys) for _ in range(steps)]
    return losses, pm.full_state_dict(), pm(xs)
