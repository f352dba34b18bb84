"""Per-rank functions for the planner tests: real runs with instrumented transfers."""
import contextlib

import torch
import torch.distributed as dist
import torch.nn as nn

import graphpar as gp
from graphpar.planner import auto
from graphpar.runtime.pipeline import shm_transport
from graphpar.runtime.recompute import RecomputeRegion
from tests import helpers
from tests.targets import pp_targets


# The plan's unit for each torch.distributed call graphpar can make: the bytes of the buffer an
# all-reduce or broadcast reduces or sends, that an all-gather fills and that a reduce-scatter
# or all-to-all reads (graphpar/planner/plan.py, Transfer), named as the plan names the op.
# Every call that moves data is wrapped, so a transfer the plan leaves out shows up as an
# entry it does not have; object collectives have no tensor: they count calls, at 0 bytes.
def _nbytes(value) -> int:
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return value.numel() * value.element_size()


_COUNTED = {  # torch.distributed function: (the plan's op, which argument its bytes are)
    "all_reduce": ("all_reduce", 0), "broadcast": ("broadcast", 0), "reduce": ("reduce", 0),
    "all_gather": ("all_gather", 0), "all_gather_single": ("all_gather", 0),
    "all_gather_into_tensor": ("all_gather", 0),
    "reduce_scatter": ("reduce_scatter", 1), "reduce_scatter_single": ("reduce_scatter", 1),
    "reduce_scatter_tensor": ("reduce_scatter", 1),
    "all_to_all": ("all_to_all", 1), "all_to_all_single": ("all_to_all", 1),
    "gather": ("gather", 0), "scatter": ("scatter", 1),
    "send": ("send", 0), "recv": ("recv", 0),
    "all_gather_object": ("all_gather_object", None), "broadcast_object_list": ("broadcast_object_list", None),
    "gather_object": ("gather_object", None), "scatter_object_list": ("scatter_object_list", None),
    "send_object_list": ("send_object_list", None), "recv_object_list": ("recv_object_list", None),
}


@contextlib.contextmanager
def counted_transfers():
    """{plan op: [bytes, calls]} of every torch.distributed call made inside the block."""
    counts, originals = {}, {}

    def add(op, nbytes):
        entry = counts.setdefault(op, [0, 0])
        entry[0] += nbytes
        entry[1] += 1

    def counting(op, which, fn):
        def wrapper(*args, **kwargs):
            add(op, 0 if which is None else _nbytes(args[which]))
            return fn(*args, **kwargs)
        return wrapper

    # The pipeline posts its sends and receives in batches of P2POp(dist.isend | dist.irecv),
    # which refuses any other function: isend and irecv are counted here, not wrapped.
    def batched(operations):
        for operation in operations:
            add({"isend": "send", "irecv": "recv"}[operation.op.__name__], _nbytes(operation.tensor))
        return originals["batch_isend_irecv"](operations)

    # With GRAPHPAR_PIPELINE_TRANSPORT=shm the pipeline's messages between ranks of one host go
    # through shared memory instead (graphpar/runtime/pipeline/shm_transport.py): counted there.
    channels = shm_transport.SharedMemoryChannels
    in_memory = {"send": channels.send, "receive": channels.receive}

    def sent(self, peer, tag, tensor):
        add("send", _nbytes(tensor))
        return in_memory["send"](self, peer, tag, tensor)

    def received(self, peer, tag, buffer, what):
        add("recv", _nbytes(buffer))
        return in_memory["receive"](self, peer, tag, buffer, what)

    for name, (op, which) in _COUNTED.items():
        originals[name] = getattr(dist, name)
        setattr(dist, name, counting(op, which, originals[name]))
    originals["batch_isend_irecv"] = dist.batch_isend_irecv
    dist.batch_isend_irecv = batched
    channels.send, channels.receive = sent, received
    try:
        yield counts
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
        channels.send, channels.receive = in_memory["send"], in_memory["receive"]


def _storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors`: at zero=1/2 in fp32 a bucket's
    parameters are views of one flat buffer (padding included), counted once, whole."""
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


def held_bytes(pm):
    """What this rank holds between steps: parameters, gradients, and the optimizer's bytes:
    every state tensor (the 0-d `step` of each tensor stepped included) and the storages of
    its parameters that are not model parameters' (the fp32 master shards, padding included;
    in fp32 a ZeRO piece is a view of its model parameter, which is counted as a parameter).
    Parameters count as the storages behind them (_storage_bytes)."""
    params = list(pm.parameters())
    held = helpers.held_parameters(pm)
    model = {p.untyped_storage().data_ptr() for p in held}
    masters = {}
    for group in pm.optimizer.param_groups:
        for p in group["params"]:
            storage = p.untyped_storage()
            if storage.data_ptr() not in model:
                masters[storage.data_ptr()] = storage.nbytes()
    states = sum(_nbytes(t) for state in pm.optimizer.state.values() for t in state.values()
                 if isinstance(t, torch.Tensor))
    return {"param_bytes": _storage_bytes(held),
            "grad_bytes": sum(_nbytes(p.grad) for p in params if p.grad is not None),
            "optimizer_bytes": states + sum(masters.values())}


def measure(name, strategy_dict, batch=8):
    """One training step with every transfer counted, after a warm-up step (the optimizer's
    states exist from there on), and the bytes this rank holds after it."""
    strategy = gp.Strategy.from_dict(strategy_dict)
    model, loss_fn = pp_targets.build(name, strategy.tp)
    x, y = pp_targets.data(name, batch)
    local = batch // strategy.dp
    mesh_dp = (dist.get_rank() // strategy.tp) % strategy.dp
    xs, ys = x[mesh_dp * local:(mesh_dp + 1) * local], y[mesh_dp * local:(mesh_dp + 1) * local]
    pm = gp.compile(model, strategy, example_inputs=(xs,), example_target=ys, loss_fn=loss_fn,
                    optimizer=helpers.adamw(), bucket_bytes=4096)
    pm.train_step(xs, target=ys)
    with counted_transfers() as counts:
        pm.train_step(xs, target=ys)
    return {"counts": counts, "rank": dist.get_rank(), **held_bytes(pm)}


def measure_many(cases, batch=8):
    """measure() of each (model name, strategy dict) in one set of processes (process start-up
    dominates these runs); every case fills the world."""
    return [measure(name, strategy_dict, batch) for name, strategy_dict in cases]


# An embedding table bigger than a block (512 x 32 = 16,384 elements against ~12,700 for a
# GPT block), so where the tied table is counted decides the balance; 4 layers for pp=4.
TIED_VOCAB = 512
TIED_MODELS = {
    "gpt": lambda: (helpers.tiny_gpt(vocab_size=TIED_VOCAB, n_layer=4), helpers.lm_loss),
    "hf_gpt2": lambda: (helpers.hf_gpt2(n_layer=4, vocab_size=TIED_VOCAB), helpers.hf_causal_lm_loss),
    "hf_llama": lambda: (helpers.hf_llama(n_layer=4, vocab_size=TIED_VOCAB, tie_word_embeddings=True),
                         helpers.hf_causal_lm_loss),
}


def held_param_bytes(strategy_dicts):
    """(rank, {model: bytes of the parameters this rank holds after compiling each strategy}),
    every tied model in one set of processes (process start-up dominates these runs)."""
    x, y = helpers.token_batch(batch=2, vocab=TIED_VOCAB)
    held = {}
    for name, build in TIED_MODELS.items():
        model, loss_fn = build()
        for strategy in strategy_dicts:
            pm = gp.compile(model, gp.Strategy.from_dict(strategy), example_inputs=(x,), example_target=y,
                            loss_fn=loss_fn)
            held.setdefault(name, []).append(sum(p.numel() * p.element_size() for _, p in pm.named_parameters()))
    return dist.get_rank(), held


# ---- a model only dp can split, for the strategy search's ZeRO choice ------------------------
class MatmulLayer(nn.Module):
    """A layer tensor parallelism has no rule for (its weight is used by torch.matmul, not an
    nn.Linear), so tp replicates it."""

    def __init__(self, width):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(width, width) / width ** 0.5)

    def forward(self, x):
        return torch.tanh(x @ self.weight) @ self.weight.t()


class OneLayer(nn.Module):
    """One pipeline unit (pp > 1 is refused) that tp replicates: of dp, tp and pp only dp
    splits it, so when no replica fits a memory budget ZeRO is the one way to fit."""

    def __init__(self, width):
        super().__init__()
        self.layer = MatmulLayer(width)

    def forward(self, x):
        return self.layer(x)


def one_layer(width=256, batch=8):
    """graphpar plan's MODEL_SPEC factory: (model, example_inputs, loss_fn, example_target),
    the inputs and target a global batch (for --auto)."""
    torch.manual_seed(0)
    model = OneLayer(width)
    g = torch.Generator().manual_seed(1)
    return model, (torch.randn(batch, width, generator=g),), nn.functional.mse_loss, torch.randn(batch, width,
                                                                                                  generator=g)


def train_one_layer(strategy_dict, steps):
    """one_layer() trained under the strategy on each rank's share of the global batch: the
    losses and the whole weights after the steps."""
    pm, losses = _trained(one_layer, strategy_dict, steps)
    return losses, pm.full_state_dict()


def _trained(build, strategy_dict, steps):
    """The compiled module of build()'s model after `steps` train_steps on each rank's share
    of its global batch, and the losses."""
    strategy = gp.Strategy.from_dict(strategy_dict)
    model, (x,), loss_fn, y = build()
    xs, ys = helpers.dp_slice(x, strategy), helpers.dp_slice(y, strategy)
    pm = gp.compile(model, strategy, example_inputs=(xs,), example_target=ys, loss_fn=loss_fn,
                    optimizer=helpers.adamw())
    return pm, [pm.train_step(xs, target=ys) for _ in range(steps)]


def one_layer_search(world, budget=None):
    model, inputs, loss_fn, target = one_layer()
    return auto.search(model, world, inputs, loss_fn=loss_fn, optimizer=helpers.adamw(), example_target=target,
                       memory_budget=budget)


def zero_only_budget(world):
    """(the search without a budget, a budget between the least peak of any ZeRO plan of
    one_layer() and that of any zero=0 plan, the zero=0 candidate with the least peak)."""
    free = one_layer_search(world)
    legal = [c for c in free.candidates if c.terms]
    unsharded = min((c for c in legal if c.strategy.zero == 0), key=lambda c: c.terms["peak_bytes"])
    sharded = min((c for c in legal if c.strategy.zero > 0), key=lambda c: c.terms["peak_bytes"])
    assert sharded.terms["peak_bytes"] < unsharded.terms["peak_bytes"], (sharded.label(), unsharded.label())
    return free, int(sharded.terms["peak_bytes"] + unsharded.terms["peak_bytes"]) // 2, unsharded


# ---- a model whose activations outweigh its weights, for the search's recompute choice --------
def gpt_blocks(batch=8):
    """graphpar plan's MODEL_SPEC factory: the tiny GPT with 4 blocks to recompute (dropout 0,
    so that eager training is the reference) and a global batch of 8 sequences of 16 tokens,
    whose saved activations (~570 KB per 4 sequences) outweigh the weights (~57,000)."""
    model = helpers.tiny_gpt(n_layer=4)
    x, y = helpers.token_batch(batch=batch)
    return model, (x,), helpers.lm_loss, y


def gpt_blocks_search(world, budget=None):
    model, inputs, loss_fn, target = gpt_blocks()
    return auto.search(model, world, inputs, loss_fn=loss_fn, optimizer=helpers.adamw(), example_target=target,
                       memory_budget=budget)


# A budget no candidate meets: every layout misses it without recomputation, so the search
# plans each with every recompute mode too (and rejects them all, costed)
TOO_SMALL = 1


def recompute_only_budget(world):
    """(the search with every recompute mode planned, a budget that no plan of
    gpt_blocks() without recomputation meets and some recompute plan does, the candidate
    without recomputation with the least peak). The budget lies three quarters of the way from
    the least peak of a recompute plan to that of a plan without: room to keep part of the
    activations, so that a fitted fraction can beat recompute="full"."""
    every = gpt_blocks_search(world, TOO_SMALL)
    without = min((c for c in every.candidates if c.terms and c.strategy.recompute is None),
                  key=lambda c: c.terms["peak_bytes"])
    recomputing = min((c for c in every.candidates if c.terms and c.strategy.recompute is not None),
                      key=lambda c: c.terms["peak_bytes"])
    low, high = int(recomputing.terms["peak_bytes"]), int(without.terms["peak_bytes"])
    assert low < high, (recomputing.label(), without.label())
    return every, low + 3 * (high - low) // 4, without


def train_gpt_blocks(strategy_dict, steps):
    """gpt_blocks() trained under the strategy on each rank's share of the global batch: the
    losses, the whole weights after the steps, and the recompute regions of this rank's
    programs (so that a test sees the plan recompute, not train as without)."""
    pm, losses = _trained(gpt_blocks, strategy_dict, steps)
    regions = sum(isinstance(m, RecomputeRegion) for gm in pm.graph_modules for m in gm.modules())
    return losses, pm.full_state_dict(), regions
