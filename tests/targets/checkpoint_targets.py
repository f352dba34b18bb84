"""Per-rank functions for tests/multiprocess/checkpoint/test_checkpoint.py (run in processes started by graphpar.launch)."""
import copy
import os
import time

import torch
import torch.distributed as dist
from torch.utils.data import Dataset

import graphpar as gp
from graphpar.checkpoint import sharded as checkpoint
from graphpar.tools.data import DistributedBatches
from tests.helpers import adamw, hf_causal_lm_loss, hf_gpt2, lm_loss, tiny_gpt, token_batch


def fused_gpt():
    """Fused q|k|v with grouped-query attention: blocks of unequal size (32, 16, 16), so a tp
    shard is three separate pieces of the full weight; the LM head is tied to the embedding,
    which under pp lives on the first and the last stage."""
    return tiny_gpt(fused_qkv=True, n_kv_head=2)


def _compile(model, strategy, x, y, loss_fn):
    """Compile on this rank's dp slice of the global batch (x, y)."""
    local = x.shape[0] // strategy.dp
    dp_rank = (dist.get_rank() // strategy.tp) % strategy.dp  # graphpar.distributed.mesh's rank order
    xs, ys = x[dp_rank * local:(dp_rank + 1) * local], y[dp_rank * local:(dp_rank + 1) * local]
    return gp.compile(model, strategy, example_inputs=(xs,), example_target=ys, loss_fn=loss_fn,
                      optimizer=adamw()), xs, ys


def train_save_step(directory, strategy, model_name, steps):
    """Train `steps` steps, save, then one more step: the run that never changes layout."""
    model, loss_fn = _model(model_name)
    x, y = token_batch(batch=8)
    pm, xs, ys = _compile(model, strategy, x, y, loss_fn)
    losses = [pm.train_step(xs, target=ys) for _ in range(steps)]
    pm.save_checkpoint(os.path.join(directory, "ck"), extra={"step": steps})
    saved = pm.full_state_dict()
    losses.append(pm.train_step(xs, target=ys))
    return losses, saved, pm.full_state_dict()


def reshard_dp4_to_dp2tp2(directory, model_name, steps):
    """dp4 trains, saves and steps on; dp2 x tp2 (the same processes) loads, saves again and
    takes the same step."""
    first = train_save_step(directory, gp.Strategy(dp=4), model_name, steps)
    model, loss_fn = _model(model_name)
    x, y = token_batch(batch=8)
    pm, xs, ys = _compile(model, gp.Strategy(dp=2, tp=2), x, y, loss_fn)
    extra = pm.load_checkpoint(os.path.join(directory, "ck"))
    loaded = pm.full_state_dict()
    pm.save_checkpoint(os.path.join(directory, "ck2"))
    loss = pm.train_step(xs, target=ys)
    return first, (extra, loaded, loss, pm.full_state_dict())


def _model(name):
    if name == "hf_gpt2":
        return hf_gpt2(), hf_causal_lm_loss
    return fused_gpt(), lm_loss


# ---- exact resume ------------------------------------------------------------------------

class TokenSet(Dataset):
    def __init__(self, n=40):
        self.x, self.y = token_batch(batch=n, seed=5)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


RESUME_BATCH, RESUME_EPOCHS = 4, 2


def _dropout_run(steps_before_save=None, directory=None, resume_from=None):
    """Train RESUME_EPOCHS epochs of TokenSet with dropout, shuffled; optionally save after
    `steps_before_save` steps and stop, or start from a checkpoint. Returns the losses and
    one draw of torch's global RNG per step (the loop's own randomness, e.g. augmentation)."""
    torch.manual_seed(0)
    x, y = token_batch(batch=RESUME_BATCH)
    pm = gp.compile(tiny_gpt(dropout=0.2), gp.Strategy(dp=2, seed=7), example_inputs=(x,), example_target=y,
                    loss_fn=lm_loss, optimizer=adamw())
    batches = DistributedBatches(TokenSet(), RESUME_BATCH, pm, shuffle=True, seed=3)
    step = 0
    if resume_from is not None:
        torch.manual_seed(1234)  # a new process: torch's RNG is not where the saved run left it
        step = pm.load_checkpoint(resume_from, data=batches)["step"]
    losses, draws = [], []
    for epoch in range(batches.epoch, RESUME_EPOCHS):
        batches.set_epoch(epoch)
        for xs, ys in batches:
            losses.append(pm.train_step(xs, target=ys))
            draws.append(float(torch.rand(())))
            step += 1
            if step == steps_before_save:
                pm.save_checkpoint(os.path.join(directory, "ck"), extra={"step": step}, data=batches)
                return losses, draws
    return losses, draws


def resume(directory, stop_at):
    full = _dropout_run()
    before = _dropout_run(steps_before_save=stop_at, directory=directory)
    after = _dropout_run(resume_from=os.path.join(directory, "ck"))
    return full, before, after


# ---- kill mid-save -----------------------------------------------------------------------

def save_then_stall(directory):
    """Save checkpoint A, then save B over it and stall in the middle of that save (after the
    shards are written, before metadata and marker) until the test kills the processes."""
    x, y = token_batch(batch=4)
    pm, xs, ys = _compile(tiny_gpt(), gp.Strategy(dp=2), x, y, lm_loss)
    pm.train_step(xs, target=ys)
    path = os.path.join(directory, "ck")
    pm.save_checkpoint(path, extra={"name": "A"})
    state = pm.full_state_dict()
    if dist.get_rank() == 0:
        torch.save(state, os.path.join(directory, "A.pt"))
    pm.train_step(xs, target=ys)
    checkpoint._before_metadata = _stall
    pm.save_checkpoint(path, extra={"name": "B"})


def _stall(staging):
    with open(os.path.join(os.path.dirname(staging), "stalled"), "w") as f:
        f.write(staging)
    time.sleep(600)


def run_stalled_save(directory):
    gp.launch(save_then_stall, world_size=2, args=(directory,))


def reshard_host_placement(directory, first: dict, second: dict, model_name: str, optimizer_name: str):
    """Train and save under `first` (host placement), load under `second` in the same
    processes: what each saw, and one more step from each."""
    import functools
    x, y = token_batch(batch=8)
    optimizer = adamw() if optimizer_name == "adamw" else functools.partial(torch.optim.SGD, lr=0.5)
    results = []
    for index, strategy in enumerate((gp.Strategy(**first), gp.Strategy(**second))):
        model = fused_gpt() if model_name == "fused" else tiny_gpt(tie_weights=False)
        local = x.shape[0] // strategy.dp
        dp_rank = (dist.get_rank() // strategy.tp) % strategy.dp
        xs, ys = x[dp_rank * local:(dp_rank + 1) * local], y[dp_rank * local:(dp_rank + 1) * local]
        pm = gp.compile(model, strategy, example_inputs=(xs,), example_target=ys, loss_fn=lm_loss,
                        optimizer=optimizer)
        if index == 0:
            for _ in range(2):
                pm.train_step(xs, target=ys)
            pm.save_checkpoint(os.path.join(directory, "ck"))
        else:
            pm.load_checkpoint(os.path.join(directory, "ck"))
        state = pm.full_state_dict()
        loss = pm.train_step(xs, target=ys)
        results.append((state, loss, pm.full_state_dict()))
    return results


# ---- a damaged piece, refused on every rank ------------------------------------------------

def refuse_damaged_piece(directory):
    """tp2 saves, steps on, then loads its checkpoint with one piece damaged: the piece that
    only rank 1 verifies (the ranks split the checksums), so rank 0 refuses only if the ranks
    agree. Returns each rank's refusal and its state before and after the load."""
    x, y = token_batch(batch=4)
    pm, xs, ys = _compile(tiny_gpt(), gp.Strategy(tp=2), x, y, lm_loss)
    pm.train_step(xs, target=ys)
    path = os.path.join(directory, "ck")
    pm.save_checkpoint(path)
    pm.train_step(xs, target=ys)  # the state moves on, so a load would change it
    before = loadable_state(pm)
    if dist.get_rank() == 0:
        files = sorted(name for name in os.listdir(path) if name != checkpoint.MARKER)  # those the manifest lists
        victim = files[1::2][0]  # the first of rank 1's share (load_checkpoint splits them so)
        with open(os.path.join(path, victim), "r+b") as f:
            f.seek(os.path.getsize(os.path.join(path, victim)) // 2)
            byte = f.read(1)[0]
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte ^ 0xFF]))
    dist.barrier()
    try:
        pm.load_checkpoint(path)
        refusal = None
    except checkpoint.CheckpointError as error:
        refusal = str(error)
    return refusal, before, loadable_state(pm)


def loadable_state(pm, data=None):
    """A copy of all a load may change: weights, optimizer state (its step counter too) and
    hyperparameters, graphpar's and torch's RNG, the data position."""
    return {"model": pm.full_state_dict(), "optimizer": copy.deepcopy(pm.optimizer.state_dict()),
            "streams": {name: g.get_state() for name, g in pm._rng.items()}, "torch_rng": torch.get_rng_state(),
            "data": data.state_dict() if data is not None else {}}
