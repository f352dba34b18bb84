"""Per-rank functions for tests/multiprocess/runtime/test_zero_models.py: ZeRO on the built-in
GPT and on `transformers` models, many cases per launched world (start-up dominates)."""
import torch
import torch.distributed as dist

import graphpar as gp
from tests import helpers
from tests.targets.zero_targets import optimizer

# per-rank batch; the global batch is LOCAL_BATCH * dp
LOCAL_BATCH = 2
# small gradient buckets (1024 fp32 elements): several reduce-scatters per step, and
# parameters cut between two ranks' shards
BUCKET_BYTES = 4096


def build(name):
    """The model and its loss; every builder seeds, so each call gives the same weights."""
    builders = {
        "gpt": lambda: (helpers.tiny_gpt(), helpers.lm_loss),
        # grouped-query attention: 4 query heads share 2 key/value heads
        "hf_llama": lambda: (helpers.hf_llama(n_head=4, n_kv_head=2), helpers.hf_causal_lm_loss),
        # wte and lm_head are one tied parameter
        "hf_gpt2": lambda: (helpers.hf_gpt2(), helpers.hf_causal_lm_loss),
    }
    return builders[name]()


def logits(out):
    return out.logits if hasattr(out, "logits") else out


def train(name, zero, optimizer_name, steps):
    """One case in this world (dp = world size): losses, the full state, pm(x) on this rank's
    slice, the eager model loaded from that state on the same slice, and what the rank holds."""
    dp = dist.get_world_size()
    model, loss_fn = build(name)
    x, y = helpers.token_batch(batch=LOCAL_BATCH * dp)
    strategy = gp.Strategy(dp=dp, zero=zero)
    xs, ys = helpers.dp_slice(x, strategy), helpers.dp_slice(y, strategy)
    pm = gp.compile(model, strategy, example_inputs=(xs,), example_target=ys, loss_fn=loss_fn,
                    optimizer=optimizer(optimizer_name), bucket_bytes=BUCKET_BYTES)
    losses = [pm.train_step(xs, target=ys) for _ in range(steps)]
    state = helpers.loadable_state(pm, model)
    eager = build(name)[0].eval()
    eager.load_state_dict(state)
    with torch.no_grad():
        eager_out = logits(eager(xs))
    return {"losses": losses, "state": state, "out": logits(pm(xs)), "eager_out": eager_out,
            "dp_rank": pm.mesh.dp_rank, "held": held(pm)}


def held(pm):
    """Per bucket: its parameters' sizes and, per piece this rank steps, (parameter index,
    start, stop, the numel of each per-element optimizer state entry). Also whether each
    parameter kept its gradient."""
    optimizer_state = pm.optimizer.state
    buckets = []
    for step in pm._placed.shard_steps:
        pieces = [(piece.index, piece.start, piece.stop,
                   {key: value.numel() for key, value in optimizer_state.get(shard, {}).items()
                    if torch.is_tensor(value) and value.dim() > 0})
                  for piece, shard in zip(step.pieces, step.shards)]
        buckets.append({"numels": step.layout.numels, "pieces": pieces})
    # every per-element state tensor the optimizer holds, wherever it is keyed
    state_elements = sum(value.numel() for entries in optimizer_state.values() for value in entries.values()
                         if torch.is_tensor(value) and value.dim() > 0)
    return {"buckets": buckets, "state_elements": state_elements,
            "elements": sum(step.layout.total for step in pm._placed.shard_steps),  # the rank's share, whole
            "held_parameter_elements": sum(p.numel() for p in helpers.held_parameters(pm)),
            "grads": [p.grad is not None for p in pm.parameters()]}


def run_cases(cases, steps):
    """Every (model name, zero, optimizer name) case, one after another, in this world."""
    return [train(name, zero, optimizer_name, steps) for name, zero, optimizer_name in cases]
