"""Tensor-parallel training of a Hugging Face transformers model (no downloads).

What it shows
    A small, randomly initialised ``transformers.LlamaForCausalLM`` (built from a
    ``LlamaConfig``: grouped-query attention, SwiGLU MLP, RMSNorm, rotary embeddings) is
    compiled with ``gp.Strategy(tp=2)`` on 2 local processes. transformers models cannot be
    traced by ``torch.fx.symbolic_trace``, so this example asks for graphpar's
    ``torch.export`` front end (``tracer="export"``; the default ``"auto"`` falls back to it
    by itself). graphpar finds the attention and MLP projections, shards them Megatron-style
    (column-parallel q/k/v and gate/up, row-parallel o/down, vocab-parallel embedding and
    LM head) and inserts the all-reduces.

What it checks
    The same model is trained eagerly on one device from the same weights on the same
    batches. Per-step losses, the final parameters and the logits of ``pm(x)`` must agree
    within float32 noise, every rank must hold fewer parameters than the full model, and the
    export front end must have been used. Exits 1 otherwise.

How to run
    python examples/transformers_model.py            # 2 layers, 10 steps
    python examples/transformers_model.py --small    # 3 steps (CI)
"""
from __future__ import annotations

import argparse
import copy
import functools
import sys

import torch
import torch.nn.functional as F

import graphpar as gp

# See tests/helpers.py (adamw): eps=1e-6 keeps entries whose gradient is pure rounding noise
# from being amplified by Adam into lr-sized steps, so parameter parity stays meaningful.
OPTIMIZER = functools.partial(torch.optim.AdamW, lr=3e-3, eps=1e-6)
LOSS_TOL, PARAM_TOL, LOGITS_TOL = 1e-4, 5e-4, 1e-4
BATCH, SEQ, VOCAB = 4, 16, 64


def make_model(layers: int):
    import transformers  # only needed by this example (it is in graphpar's test extra)

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        num_hidden_layers=layers, hidden_size=64, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=SEQ, use_cache=False,
        bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return transformers.LlamaForCausalLM(config)


def loss_fn(output, target):
    # transformers returns a CausalLMOutputWithPast; its .logits is [batch, seq, vocab]
    return F.cross_entropy(output.logits.flatten(0, 1), target.flatten())


def batches(steps: int):
    """Random token batches, the same in every process; the last one is also the eval batch."""
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, VOCAB, (BATCH, SEQ), generator=g), torch.randint(0, VOCAB, (BATCH, SEQ), generator=g))
            for _ in range(steps)]


def train_rank(layers: int, steps: int):
    data = batches(steps)
    x, y = data[0]
    pm = gp.compile(make_model(layers), gp.Strategy(tp=2), example_inputs=(x,), example_target=y,
                    loss_fn=loss_fn, optimizer=OPTIMIZER, tracer="export")
    losses = [pm.train_step(x, target=y) for x, y in data]
    logits = pm(data[-1][0]).logits   # eval forward: the full (gathered) output on every rank
    return {"losses": losses, "logits": logits, "state": pm.full_state_dict(),
            "local_params": sum(p.numel() for p in pm.parameters()),
            "front_end": pm.front_end}


def train_eager(layers: int, steps: int):
    model = copy.deepcopy(make_model(layers)).train()
    opt = OPTIMIZER(model.parameters())
    losses = []
    data = batches(steps)
    for x, y in data:
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    with torch.no_grad():
        logits = model.eval()(data[-1][0]).logits
    return losses, logits, model.state_dict()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--small", action="store_true", help="3 steps: a CI run")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args(argv)
    if args.small:
        args.steps = 3
    try:
        import transformers  # noqa: F401
    except ImportError:
        print("this example needs the transformers package: pip install transformers")
        return 1

    results = gp.launch(train_rank, world_size=2, args=(args.layers, args.steps))
    ref_losses, ref_logits, ref_state = train_eager(args.layers, args.steps)
    full_params = sum(p.numel() for p in make_model(args.layers).parameters())

    print(f"LlamaForCausalLM, {args.layers} layers, {full_params:,} parameters, tp=2, "
          f"traced with the {results[0]['front_end']!r} front end")
    for rank, r in enumerate(results):
        print(f"  rank {rank} holds {r['local_params']:,} parameters")
    print("| step | graphpar tp=2 | eager | diff |\n|---:|---:|---:|---:|")
    for step, (a, b) in enumerate(zip(results[0]["losses"], ref_losses)):
        print(f"| {step} | {a:.6f} | {b:.6f} | {abs(a - b):.1e} |")

    failures = []
    for rank, r in enumerate(results):
        if r["front_end"] != "export":
            failures.append(f"rank {rank} traced with {r['front_end']!r}, not 'export'")
        if not r["local_params"] < full_params:
            failures.append(f"rank {rank} holds all {full_params} parameters: nothing was sharded")
        loss_diff = max(abs(a - b) for a, b in zip(r["losses"], ref_losses))
        if loss_diff > LOSS_TOL:
            failures.append(f"rank {rank}: losses differ from eager by {loss_diff:.2e} > {LOSS_TOL}")
        logit_diff = (r["logits"] - ref_logits).abs().max().item()
        if logit_diff > LOGITS_TOL:
            failures.append(f"rank {rank}: logits differ from eager by {logit_diff:.2e} > {LOGITS_TOL}")
        param_diff = max((r["state"][k] - v).abs().max().item() for k, v in ref_state.items())
        if param_diff > PARAM_TOL:
            failures.append(f"rank {rank}: parameters differ from eager by {param_diff:.2e} > {PARAM_TOL}")
    print(f"largest logits difference {(results[0]['logits'] - ref_logits).abs().max().item():.1e}, "
          f"parameter difference "
          f"{max((results[0]['state'][k] - v).abs().max().item() for k, v in ref_state.items()):.1e}")
    if failures:
        print("FAIL: " + "; ".join(failures))
        return 1
    print("PASS: tp=2 training of LlamaForCausalLM matches eager PyTorch")
    return 0


if __name__ == "__main__":
    sys.exit(main())
