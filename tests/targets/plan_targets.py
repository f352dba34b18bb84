"""Per-rank functions for the planner tests: real runs with instrumented transfers."""
import torch
import torch.distributed as dist

import graphpar as gp
from tests import helpers
from tests.targets import pp_targets


def measure(name, strategy_dict, batch=8):
    """One training step with every collective and point-to-point call counted, plus the
    bytes this rank really holds: parameters, gradients, optimizer states."""
    strategy = gp.Strategy.from_dict(strategy_dict)
    model, loss_fn = pp_targets.build(name, strategy.tp)
    x, y = pp_targets.data(name, batch)
    local = batch // strategy.dp
    mesh_dp = (dist.get_rank() // strategy.tp) % strategy.dp
    xs, ys = x[mesh_dp * local:(mesh_dp + 1) * local], y[mesh_dp * local:(mesh_dp + 1) * local]
    pm = gp.compile(model, strategy, example_inputs=(xs,), example_target=ys, loss_fn=loss_fn,
                    optimizer=helpers.adamw(), bucket_bytes=4096)
    pm.train_step(xs, target=ys)  # warm-up: optimizer states exist from here on
    counts = {}
    originals = {}

    def counting(op, fn):
        def wrapper(tensor, *args, **kwargs):
            entry = counts.setdefault(op, [0, 0])
            entry[0] += tensor.numel() * tensor.element_size()
            entry[1] += 1
            return fn(tensor, *args, **kwargs)
        return wrapper
    for op in ("all_reduce", "all_gather", "broadcast"):
        originals[op] = getattr(dist, op)
        setattr(dist, op, counting(op, originals[op]))

    def whole_buffer(op, fn, which):  # ZeRO's: the buffer a reduce-scatter reads, an all-gather fills
        def wrapper(output, input, *args, **kwargs):
            tensor = (output, input)[which]
            entry = counts.setdefault(op, [0, 0])
            entry[0] += tensor.numel() * tensor.element_size()
            entry[1] += 1
            return fn(output, input, *args, **kwargs)
        return wrapper
    for op, which in (("reduce_scatter_single", 1), ("all_gather_single", 0)):
        originals[op] = getattr(dist, op)
        setattr(dist, op, whole_buffer(op, originals[op], which))

    def batched(operations):  # the pipeline posts its sends and receives in batches
        for operation in operations:
            entry = counts.setdefault(operation.op.__name__, [0, 0])
            entry[0] += operation.tensor.numel() * operation.tensor.element_size()
            entry[1] += 1
        return originals["batch_isend_irecv"](operations)
    originals["batch_isend_irecv"] = dist.batch_isend_irecv
    dist.batch_isend_irecv = batched
    try:
        pm.train_step(xs, target=ys)
    finally:
        for op, fn in originals.items():
            setattr(dist, op, fn)
    params = {n: p for n, p in pm.named_parameters()}
    optimizer_bytes = sum(t.numel() * t.element_size() for state in pm.optimizer.state.values()
                          for t in state.values() if isinstance(t, torch.Tensor) and t.dim() > 0)
    return {"counts": counts, "param_bytes": sum(p.numel() * p.element_size() for p in params.values()),
            "grad_bytes": sum(p.grad.numel() * p.grad.element_size() for p in params.values() if p.grad is not None),
            "optimizer_bytes": optimizer_bytes, "rank": dist.get_rank()}


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
