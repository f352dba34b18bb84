"""The host optimizer step against torch's AdamW on the same parameters, and where the time of
an offloaded training step goes.

Part 1, the step alone: the same fp32 parameters and gradients (--params elements in tensors
of --tensor elements), one AdamW step each, measured in rounds; every round runs every
variant once, in turn, and the ratio to AdamW(fused=True) is taken per round (so load that
comes and goes hits all variants alike), then the median of the rounds:

    torch AdamW (foreach)        torch.optim.AdamW default
    torch AdamW (fused=True)     torch's fused CPU kernel
    graphpar host step, fp32     graphpar.runtime.placement.update.MasterWeights, fp32 compute weights
    graphpar host step + bf16    the same with the fused cast to bf16 compute weights
    fused AdamW, then cast       what a user of torch does for the same bf16 step: widen the
                                 bf16 gradients, AdamW(fused=True), then cast the weights

Part 2, one train_step of a GPT with offload_optimizer=True (and param_dtype bf16), world of
one: the time in forward, backward, transfers (to_host + to_device copies), host steps (the
master updates, in the worker thread, overlapping backward), and what is left to wait for
after backward (finish), measured by wrapping those functions with timers.
"""
from __future__ import annotations

import argparse
import statistics
import time

import _common


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--params", type=int, default=8_000_000, help="parameter elements (part 1)")
    parser.add_argument("--tensor", type=int, default=1_000_000, help="elements per parameter tensor")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps", type=int, default=6, help="train steps timed in part 2")
    _common.add_model_options(parser, layers=4, embd=256, heads=4, vocab=512, seq=64, batch=8)
    return parser.parse_args(argv)


# ---- part 1: the step alone --------------------------------------------------------------------
def _params(args, torch):
    g = torch.Generator().manual_seed(0)
    sizes = [args.tensor] * (args.params // args.tensor)
    params = [torch.nn.Parameter(torch.randn(n, generator=g)) for n in sizes]
    grads = [torch.randn(n, generator=g) * 1e-3 for n in sizes]
    return params, grads


def _torch_step(torch, fused: bool, cast: bool, args):
    """torch's AdamW; with `cast`, the mixed-precision step: bf16 gradients in, bf16 weights out."""
    params, grads = _params(args, torch)
    opt = torch.optim.AdamW(params, lr=1e-3, fused=fused or None, foreach=None if fused else True)
    low = [torch.empty(p.shape, dtype=torch.bfloat16) for p in params] if cast else []
    grads = [g.to(torch.bfloat16) for g in grads] if cast else grads

    def step():
        for p, g in zip(params, grads):
            p.grad = g.float()
        opt.step()
        for lp, p in zip(low, params):
            lp.copy_(p.detach())
    return step


def _graphpar_step(torch, dtype, args):
    import functools
    from graphpar.runtime.placement.transfers import HOST
    from graphpar.runtime.placement.update import MasterWeights, build_optimizer
    params, grads = _params(args, torch)
    bucket = MasterWeights([f"p{i}" for i in range(len(params))], params, HOST, dtype)
    build_optimizer(functools.partial(torch.optim.AdamW, lr=1e-3), [bucket], host=True)
    flat = torch.cat(grads).to(dtype)
    return lambda: bucket(flat)


def step_rounds(args) -> dict:
    import torch
    variants = {
        "torch AdamW (foreach)": _torch_step(torch, False, False, args),
        "torch AdamW (fused=True)": _torch_step(torch, True, False, args),
        "graphpar host step, fp32": _graphpar_step(torch, torch.float32, args),
        "graphpar host step + bf16 cast": _graphpar_step(torch, torch.bfloat16, args),
        "fused AdamW, then bf16 cast": _torch_step(torch, True, True, args),
    }
    times = {name: [] for name in variants}
    for name, fn in variants.items():  # warm-up: allocate state, first-touch pages
        fn()
    for _ in range(args.rounds):
        for name, fn in variants.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return times


# ---- part 2: where an offloaded step's time goes -----------------------------------------------
class _Timers:
    """Wraps functions with timers summing per label; `restore` puts the originals back."""

    def __init__(self):
        self.totals = {}
        self._originals = []

    def wrap(self, owner, name: str, label: str):
        original = getattr(owner, name)
        self._originals.append((owner, name, original))
        totals = self.totals

        def timed(*a, **k):
            start = time.perf_counter()
            try:
                return original(*a, **k)
            finally:
                totals[label] = totals.get(label, 0.0) + time.perf_counter() - start
        setattr(owner, name, timed)

    def restore(self) -> None:
        for owner, name, original in reversed(self._originals):
            setattr(owner, name, original)


def breakdown(args, dtype_name: str) -> dict:
    import torch
    import graphpar as gp
    from graphpar.runtime.placement import runner, transfers, update
    model = _common.gpt(args)
    x, y = _common.token_batch(args, seed=1)
    loss_fn = lambda out, t: torch.nn.functional.cross_entropy(out.flatten(0, 1).float(), t.flatten())  # noqa: E731
    pm = gp.compile(model, gp.Strategy(offload_optimizer=True, param_dtype=dtype_name), example_inputs=(x,),
                    example_target=y, loss_fn=loss_fn,
                    optimizer=lambda p: torch.optim.AdamW(p, lr=1e-4), bucket_bytes=4 * 2**20)
    pm.train_step(x, target=y)
    timers = _Timers()
    timers.wrap(transfers, "_copy", "transfers")
    timers.wrap(update.MasterWeights, "forward", "host steps")
    timers.wrap(runner.UpdateRunner, "finish", "finish (after backward)")
    timers.wrap(torch.Tensor, "backward", "backward")
    gm = pm._executor._loss_gm
    timers.wrap(type(gm), "__call__", "forward")
    steps = []
    try:
        for _ in range(args.steps):
            start = time.perf_counter()
            pm.train_step(x, target=y)
            steps.append(time.perf_counter() - start)
    finally:
        timers.restore()
    params = sum(p.numel() for p in pm.parameters())
    result = {k: v / args.steps for k, v in timers.totals.items()}
    result["step"] = statistics.median(steps)
    result["params"] = params
    result["buckets"] = len(pm._placed.buckets)
    return result


def report(args, times: dict, parts: dict, load_before: str, load_after: str) -> str:
    reference = "torch AdamW (fused=True)"
    ratios = {name: statistics.median(t / r for t, r in zip(times[name], times[reference])) for name in times}
    ms = lambda t: f"{t * 1e3:.1f}"  # noqa: E731
    lines = [
        "## Host optimizer: graphpar's host step vs torch AdamW",
        "",
        f"{args.params / 1e6:.1f} M fp32 parameters in tensors of {args.tensor / 1e6:.1f} M, one AdamW step "
        f"(lr 1e-3) per variant per round, {args.rounds} rounds after one warm-up step each.",
        "",
        "| variant | median step (ms) | min (ms) | IQR (ms) | per-round ratio to fused AdamW (median) |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, t in times.items():
        lines.append(f"| {name} | {ms(statistics.median(t))} | {ms(min(t))} | {ms(_common.iqr(t))} | "
                     f"{ratios[name]:.3f} |")
    lines += ["", "## Where an offloaded train_step's time goes", "",
              f"GPT {args.layers} layers, n_embd {args.embd}, vocab {args.vocab}, seq {args.seq}, batch "
              f"{args.batch}; offload_optimizer=True, buckets of 4 MiB; mean per step over {args.steps} steps "
              f"(host steps run in a worker thread during backward, so the parts overlap and do not add up).",
              "", "| param_dtype | parameters | buckets | step (ms) | forward | backward | transfers | "
              "host steps | finish (after backward) |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for dtype_name, p in parts.items():
        lines.append(f"| {dtype_name} | {p['params'] / 1e6:.2f} M | {p['buckets']} | {ms(p['step'])} | "
                     f"{ms(p.get('forward', 0))} | {ms(p.get('backward', 0))} | {ms(p.get('transfers', 0))} | "
                     f"{ms(p.get('host steps', 0))} | {ms(p.get('finish (after backward)', 0))} |")
    lines += ["", f"- graphpar's host step (fp32) / torch AdamW(fused=True): **{ratios['graphpar host step, fp32']:.3f}**; "
              f"/ torch AdamW default (foreach): "
              f"{statistics.median(a / b for a, b in zip(times['graphpar host step, fp32'], times['torch AdamW (foreach)'])):.3f}",
              f"- graphpar's update + bf16 cast (bucket by bucket) / fused AdamW then a separate cast: "
              f"{statistics.median(a / b for a, b in zip(times['graphpar host step + bf16 cast'], times['fused AdamW, then bf16 cast'])):.3f}",
              "", f"Machine: {_common.machine()}. Load average before / after: {load_before} / {load_after}.",
              f"Reproduce: `{_common.command('bench_host_optimizer.py')}`"]
    return "\n".join(lines)


def main(argv=None) -> None:
    import torch
    torch.set_num_threads(_common.usable_cores())
    args = parse_args(argv)
    load_before = _common.load_average()
    times = step_rounds(args)
    parts = {name: breakdown(args, name) for name in ("float32", "bfloat16")}
    print(report(args, times, parts, load_before, _common.load_average()))


if __name__ == "__main__":
    main()
