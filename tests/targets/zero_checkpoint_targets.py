"""Per-rank functions for tests/multiprocess/checkpoint/test_zero_checkpoint.py: checkpoints
saved under one (dp, tp, zero) and loaded under another (run by graphpar.launch)."""
import os

import torch
import torch.distributed as dist

import graphpar as gp
from graphpar.checkpoint.sharded import load_full_checkpoint
from graphpar.ir.layout import local_shard
from tests.helpers import adamw, dp_slice, lm_loss, token_batch
from tests.targets.checkpoint_targets import fused_gpt

# small gradient buckets (1024 fp32 elements): several shards per rank, parameters cut
# between two ranks
BUCKET_BYTES = 4096
STEPS = 2  # trained before the save


def compile_rank(strategy, global_batch):
    """The fused-q|k|v GPT with a tied head under `strategy`, on this rank's slice of the batch."""
    x, y = token_batch(batch=global_batch)
    xs, ys = dp_slice(x, strategy), dp_slice(y, strategy)
    pm = gp.compile(fused_gpt(), strategy, example_inputs=(xs,), example_target=ys, loss_fn=lm_loss,
                    optimizer=adamw(), bucket_bytes=BUCKET_BYTES)
    return pm, xs, ys


def train_save_step(directory, strategy, global_batch):
    """Train STEPS steps, save `directory`, take one more step: losses, the state saved, the
    loss of that step and the state after it."""
    pm, xs, ys = compile_rank(strategy, global_batch)
    losses = [pm.train_step(xs, target=ys) for _ in range(STEPS)]
    pm.save_checkpoint(directory, extra={"step": STEPS})
    saved = pm.full_state_dict()
    loss = pm.train_step(xs, target=ys)
    return {"losses": losses, "saved": saved, "loss": loss, "stepped": pm.full_state_dict()}


def load_save_step(source, again, strategy, global_batch):
    """Load `source` under `strategy`, compare each optimizer piece this rank holds with the
    checkpoint's whole state, save `again` and take one step."""
    pm, xs, ys = compile_rank(strategy, global_batch)
    extra = pm.load_checkpoint(source)
    loaded = pm.full_state_dict()
    compared, differing = pieces_against(pm, load_full_checkpoint(source).optimizer)
    pm.save_checkpoint(again)
    loss = pm.train_step(xs, target=ys)
    return {"extra": extra, "loaded": loaded, "compared": compared, "differing": differing, "loss": loss,
            "stepped": pm.full_state_dict()}


def pieces_against(pm, whole):
    """This rank's ZeRO pieces of the optimizer state against the same elements of the whole
    (single-device) state: how many elements were compared, and (name, entry) of every piece
    that differs in any bit."""
    shards, tp_rank, tp = dict(pm._shards()), pm.mesh.tp_rank, pm.mesh.tp
    compared, differing = 0, []
    for step in pm._placed.shard_steps:
        for piece, shard in zip(step.pieces, step.shards):
            name = step.names[piece.index]
            for entry, value in pm.optimizer.state[shard].items():
                full = whole[name][entry]
                if value.dim() == 0:  # Adam's step: the same whole scalar on every piece
                    expected = full
                else:
                    spec = shards.get(name)
                    local = local_shard(full, spec, tp_rank, tp) if spec else full
                    expected = local.reshape(-1)[piece.start:piece.stop]
                    compared += value.numel()
                if not torch.equal(value, expected):
                    differing.append((name, entry))
    return compared, differing


def dp4_zero2_to_dp2_tp2_zero1(directory):
    """(dp=4, zero=2) trains, saves A and steps on; the same processes at (dp=2, tp=2, zero=1)
    load A, save B and take that step."""
    first = train_save_step(os.path.join(directory, "A"), gp.Strategy(dp=4, zero=2), 8)
    second = load_save_step(os.path.join(directory, "A"), os.path.join(directory, "B"),
                            gp.Strategy(dp=2, tp=2, zero=1), 8)
    return first, second, dist.get_rank()
