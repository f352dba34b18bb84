"""tp=2 training step time: graphpar against torch DTensor and a hand-written Megatron TP.

    .venv/bin/python benchmarks/bench_tensor_parallel.py [--rounds 12 --steps 3 --layers 4 ...]

One graphpar.launch starts 2 gloo ranks (1 intra-op thread each). Each rank builds the
same GPT (graphpar.models.gpt, same seed, so the same initial weights; tied embedding and
LM head) and the same batch (tensor parallelism: both ranks see the whole batch), and
trains four tensor-parallel versions of it side by side with AdamW (lr 1e-3):

    graphpar      gp.compile(model, Strategy(tp=2), ...) of the unmodified model
    DTensor       torch.distributed.tensor.parallel.parallelize_module on a copy:
                  ColwiseParallel for attn.q/k/v and mlp.fc, RowwiseParallel for
                  attn.proj and mlp.proj; the token embedding RowwiseParallel (vocab
                  rows sharded, output all-reduced), the LM head ColwiseParallel with
                  logits left sharded on the vocab (Shard(-1)) and the loss computed
                  under loss_parallel(), the head re-tied to the embedding's sharded
                  weight. Same layout as graphpar's (which shards the vocab the same
                  way). The model's attention views q/k/v with its full head count and
                  the output with the full width, so for DTensor each attention module
                  gets its local head count (n_head/2) and a forward that is the
                  model's own except for `.view(b, t, -1)` at the end (same math).
    DTensor + PrepareModuleInput
                  the same plan plus PrepareModuleInput(Replicate -> Replicate,
                  use_local_output=False) on each attention module, so q, k and v read
                  one DTensor and their input gradients are all-reduced once, not once
                  per projection (what the plain plan does: 2 more all-reduces a layer).
    hand-written  a Megatron-style module defined in this file: column/row parallel
                  linears with the explicit f (identity forward, all-reduce backward)
                  and g (all-reduce forward, identity backward) autograd functions,
                  a vocab-parallel embedding, an LM head on the embedding's shard and
                  Megatron's vocab-parallel cross entropy (3 all-reduces), loaded from
                  the same weights. Collectives are in place, as in Megatron.

Timing: each round runs every variant in turn (the order rotates every round): --warmup
untimed steps, then --steps timed steps, each after a barrier, so a step's time is the
slower rank's. A step is zero_grad + forward + loss + backward + AdamW step + the loss as
a Python float. Reported: the median over all timed steps, and ratios as the median over
rounds of (round median / round median of the reference), which cancels most of what the
rest of the machine does during a round. Also reported, as views less sensitive to other
load on the machine: the ratio of the fastest steps, and the CPU time per step
(time.process_time of the rank's process, gloo's threads included, and time.thread_time
of its main thread: compute and Python overhead; mean of the ranks, median over steps).

Collectives: after timing, one more step of each variant runs with counters on. The
counts in the table come from a TorchDispatchMode that sees every collective at the
dispatcher: torch.ops.c10d.* (what torch.distributed.all_reduce etc. call; graphpar and
the hand-written version) and torch.ops._c10d_functional.* (what DTensor calls;
wait_tensor and _wrap_tensor_autograd are not counted). Like torch's CommDebugMode it
returns NotImplemented for DTensor arguments, so DTensor desugars first and the mode sees
the collectives it issues, forward and backward. As a cross-check,
torch.distributed.{all_reduce, all_gather, all_gather_into_tensor, reduce_scatter,
reduce_scatter_tensor, _all_gather_base, _reduce_scatter_base, broadcast, all_to_all,
all_to_all_single} are wrapped and their calls listed. Bytes are the size of the tensor
reduced (all-reduce), of the gathered result (all-gather) or of the input
(reduce-scatter), per rank.

Parameter memory: bytes of this rank's local parameters (DTensor: the local shards),
each shared (tied) parameter counted once; optimizer state is 2x that for AdamW.

Nothing is written to disk.
"""
from __future__ import annotations

import argparse
import copy
import functools
import statistics
import threading
import time
import types
from typing import Callable, Dict, List

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import _common
import graphpar as gp
from graphpar.models.gpt import GPT, lm_loss, num_parameters

GP, DT, DT_PMI, HW = "graphpar", "DTensor", "DTensor + PrepareModuleInput", "hand-written"
VARIANTS = (GP, DT, DT_PMI, HW)
LOSS_TOL = 1e-4


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    _common.add_model_options(parser, layers=4, embd=256, heads=8, vocab=1024, seq=128, batch=8)
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per variant per round")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per variant per round")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--profile", action="store_true",
                        help="also profile one step of each variant (torch.profiler, rank 0) and "
                             "print the top operators")
    return parser.parse_args(argv)


# ---- hand-written Megatron-style tensor parallelism ---------------------------------------

class _CopyToTP(torch.autograd.Function):
    """f: identity forward, all-reduce of the gradient backward (enters a TP region)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    """g: all-reduce forward (partial sums -> full), identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Megatron's cross entropy over logits sharded on the vocabulary (mean over rows)."""

    @staticmethod
    def forward(ctx, logits, target, group, start):
        rows = logits.shape[-1]
        maximum = logits.max(dim=-1).values
        dist.all_reduce(maximum, op=dist.ReduceOp.MAX, group=group)
        logits = logits - maximum.unsqueeze(-1)
        outside = (target < start) | (target >= start + rows)
        local = (target - start).masked_fill(outside, 0)
        predicted = logits.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        dist.all_reduce(predicted, group=group)
        exp = logits.exp_()
        sum_exp = exp.sum(dim=-1)
        dist.all_reduce(sum_exp, group=group)
        loss = (sum_exp.log() - predicted).mean()
        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local, outside)
        return loss

    @staticmethod
    def backward(ctx, grad):
        softmax, local, outside = ctx.saved_tensors
        grad_logits = softmax.clone()
        grad_logits.scatter_add_(-1, local.unsqueeze(-1), -(~outside).to(softmax.dtype).unsqueeze(-1))
        grad_logits.mul_(grad / softmax.shape[0])
        return grad_logits, None, None, None


class ColumnParallelLinear(nn.Module):
    """Output features split across ranks; the input is replicated (f in front)."""

    def __init__(self, full: nn.Linear, rank: int, world: int, group):
        super().__init__()
        n = full.out_features // world
        self.weight = nn.Parameter(full.weight.detach()[rank * n:(rank + 1) * n].clone())
        self.bias = nn.Parameter(full.bias.detach()[rank * n:(rank + 1) * n].clone())
        self.group = group

    def forward(self, x, entered: bool = False):
        if not entered:
            x = _CopyToTP.apply(x, self.group)
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """Input features split across ranks; partial sums all-reduced (g), then the bias."""

    def __init__(self, full: nn.Linear, rank: int, world: int, group):
        super().__init__()
        n = full.in_features // world
        self.weight = nn.Parameter(full.weight.detach()[:, rank * n:(rank + 1) * n].clone())
        self.bias = nn.Parameter(full.bias.detach().clone())
        self.group = group

    def forward(self, x):
        return _ReduceFromTP.apply(F.linear(x, self.weight), self.group) + self.bias


class _TPAttention(nn.Module):
    def __init__(self, full, rank, world, group):
        super().__init__()
        self.n_head, self.head_dim = full.n_head // world, full.head_dim
        self.q, self.k, self.v = (ColumnParallelLinear(getattr(full, n), rank, world, group) for n in "qkv")
        self.proj = RowParallelLinear(full.proj, rank, world, group)
        self.group = group

    def forward(self, x):
        b, t, _ = x.shape
        x = _CopyToTP.apply(x, self.group)  # one f for the three projections
        q, k, v = (m(x, entered=True).view(b, t, self.n_head, self.head_dim).transpose(1, 2)
                   for m in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).contiguous().view(b, t, -1))


class _TPBlock(nn.Module):
    def __init__(self, full, rank, world, group):
        super().__init__()
        self.ln_1, self.ln_2 = copy.deepcopy(full.ln_1), copy.deepcopy(full.ln_2)
        self.attn = _TPAttention(full.attn, rank, world, group)
        self.fc = ColumnParallelLinear(full.mlp.fc, rank, world, group)
        self.proj = RowParallelLinear(full.mlp.proj, rank, world, group)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.proj(F.gelu(self.fc(self.ln_2(x))))


class MegatronGPT(nn.Module):
    """The GPT of graphpar.models.gpt (separate q/k/v, GELU MLP, tied head, no dropout),
    Megatron-style: vocab-parallel embedding and head, column/row parallel blocks."""

    def __init__(self, full: GPT, group):
        super().__init__()
        c = full.config
        assert c.tie_weights and not c.fused_qkv and c.mlp == "gelu" and c.kv_heads == c.n_head
        assert c.dropout == 0.0
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        rows = c.vocab_size // world
        self.start, self.rows, self.group = rank * rows, rows, group
        self.wte = nn.Parameter(full.wte.weight.detach()[rank * rows:(rank + 1) * rows].clone())
        self.wpe = nn.Parameter(full.wpe.weight.detach().clone())
        self.blocks = nn.ModuleList(_TPBlock(b, rank, world, group) for b in full.blocks)
        self.ln_f = copy.deepcopy(full.ln_f)

    def forward(self, idx, target):
        outside = (idx < self.start) | (idx >= self.start + self.rows)
        emb = F.embedding((idx - self.start).masked_fill(outside, 0), self.wte)
        emb = _ReduceFromTP.apply(emb.masked_fill(outside.unsqueeze(-1), 0.0), self.group)
        x = emb + self.wpe[: idx.shape[1]]
        for block in self.blocks:
            x = block(x)
        logits = F.linear(_CopyToTP.apply(self.ln_f(x), self.group), self.wte)
        return _VocabParallelCrossEntropy.apply(logits.flatten(0, 1), target.flatten(), self.group,
                                                self.start)


# ---- DTensor -----------------------------------------------------------------------------

def _local_head_attention_forward(self, x):
    """CausalSelfAttention.forward (separate q/k/v, no kv grouping, no dropout) with this
    rank's heads: n_head is the local count and the output view takes the local width."""
    b, t, _ = x.size()
    q, k, v = self.q(x), self.k(x), self.v(x)
    q = q.view(b, t, self.n_head, self.head_dim).transpose(1, 2)
    k = k.view(b, t, self.n_kv_head, self.head_dim).transpose(1, 2)
    v = v.view(b, t, self.n_kv_head, self.head_dim).transpose(1, 2)
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    y = y.transpose(1, 2).contiguous().view(b, t, -1)
    return self.resid_drop(self.proj(y))


def dtensor_model(model: GPT, world: int, shared_attn_input: bool = False):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   parallelize_module)

    mesh = init_device_mesh("cpu", (world,))
    plan = {"wte": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
            "lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)}
    for i in range(len(model.blocks)):
        for name in ("attn.q", "attn.k", "attn.v", "mlp.fc"):
            plan[f"blocks.{i}.{name}"] = ColwiseParallel()
        for name in ("attn.proj", "mlp.proj"):
            plan[f"blocks.{i}.{name}"] = RowwiseParallel()
        if shared_attn_input:
            # One Replicate DTensor feeds q, k and v: their input gradients add up as one
            # Partial DTensor, all-reduced once (not once per projection).
            plan[f"blocks.{i}.attn"] = PrepareModuleInput(
                input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),), use_local_output=False)
    parallelize_module(model, mesh, plan)
    # Both were sharded Shard(0) on the vocab, as separate copies: tie them again.
    model.lm_head.weight = model.wte.weight
    for block in model.blocks:
        attn = block.attn
        attn.n_head //= world
        attn.n_kv_head //= world
        attn.forward = types.MethodType(_local_head_attention_forward, attn)
    return model


def _dtensor_step(model, opt, x, y) -> float:
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import loss_parallel

    opt.zero_grad(set_to_none=True)
    with loss_parallel():
        loss = lm_loss(model(x), y)
        loss.backward()
    opt.step()
    loss = loss.detach()
    if isinstance(loss, DTensor):
        loss = loss.full_tensor()  # Replicate: no communication
    return float(loss)


def _hand_step(model, opt, x, y) -> float:
    opt.zero_grad(set_to_none=True)
    loss = model(x, y)
    loss.backward()
    opt.step()
    return float(loss.detach())


# ---- collective counting -----------------------------------------------------------------

_PY_COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "_all_gather_base",
                   "reduce_scatter", "reduce_scatter_tensor", "_reduce_scatter_base", "broadcast",
                   "all_to_all", "all_to_all_single")
_SKIP_FUNCTIONAL = {"wait_tensor", "_wrap_tensor_autograd"}


def _nbytes(t) -> int:
    if isinstance(t, torch.Tensor):
        return t.numel() * t.element_size()
    if isinstance(t, (list, tuple)):
        return sum(_nbytes(v) for v in t)
    return 0


class CollectiveCounter(TorchDispatchMode):
    """Counts collectives two ways while active (one step):

    dispatcher  a TorchDispatchMode seeing torch.ops.c10d.* (what torch.distributed.*
                calls) and torch.ops._c10d_functional.* (what DTensor calls). Like
                torch's CommDebugMode it returns NotImplemented for DTensor arguments, so
                DTensor desugars first and the mode sees the collectives it issues.
    API         wrappers around torch.distributed.all_reduce, all_gather, ... (the calls
                graphpar and the hand-written version make), a cross-check.
    """

    _installed = False
    _active: "CollectiveCounter | None" = None
    _local = threading.local()

    def __init__(self):
        super().__init__()
        self.calls: List[tuple] = []      # dispatcher: (namespace.op, bytes)
        self.api_calls: List[tuple] = []  # torch.distributed.* API: (name, bytes)

    @classmethod
    def install(cls) -> None:
        if cls._installed:
            return
        cls._installed = True
        from torch.distributed import distributed_c10d as c10d
        for name in _PY_COLLECTIVES:
            original = getattr(c10d, name, None)
            if original is None:
                continue
            wrapper = cls._wrap(name, original)
            setattr(c10d, name, wrapper)
            if getattr(dist, name, None) is original:
                setattr(dist, name, wrapper)

    @classmethod
    def _wrap(cls, name, original):
        @functools.wraps(original)
        def wrapper(*args, **kwargs):
            counter = cls._active
            depth = getattr(cls._local, "depth", 0)
            if counter is not None and depth == 0:  # not the calls one API makes to another
                counter.api_calls.append((name, _nbytes(args[0]) if args else 0))
            cls._local.depth = depth + 1
            try:
                return original(*args, **kwargs)
            finally:
                cls._local.depth = depth
        return wrapper

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        kwargs = kwargs or {}
        if isinstance(func, torch._ops.HigherOrderOperator):
            return func(*args, **kwargs)
        if any(t is not torch.Tensor and issubclass(t, torch.Tensor) for t in types_):
            return NotImplemented  # let DTensor run and issue its collectives
        ns, op = func.namespace, func._opname
        counted = (op not in _SKIP_FUNCTIONAL if ns == "_c10d_functional"
                   else op not in ("barrier", "monitored_barrier_") if ns == "c10d" else False)
        if counted:
            # c10d ops take the output (list) first for gathers, the tensor(s) otherwise
            size = _nbytes(args[0]) if args else 0
            if ns == "_c10d_functional" and op.startswith("all_gather") and len(args) > 1 \
                    and isinstance(args[1], int):
                size *= args[1]  # functional all-gather: input x group size
            self.calls.append((f"{ns}.{op}", size))
        return func(*args, **kwargs)

    def __enter__(self):
        CollectiveCounter._active = self
        return super().__enter__()

    def __exit__(self, *exc):
        CollectiveCounter._active = None
        return super().__exit__(*exc)


# ---- per rank ----------------------------------------------------------------------------

def _local_param_bytes(params) -> int:
    seen, total = set(), 0
    for p in params:
        if id(p) in seen:
            continue
        seen.add(id(p))
        local = p.to_local() if hasattr(p, "to_local") else p
        total += local.numel() * local.element_size()
    return total


def rank_main(args: argparse.Namespace) -> dict:
    torch.set_num_threads(1)
    world = dist.get_world_size()
    model = _common.gpt(args)
    x, y = _common.token_batch(args, seed=1234)  # the same on every rank: TP ranks share the batch
    optimizer = functools.partial(torch.optim.AdamW, lr=1e-3)

    pm = gp.compile(copy.deepcopy(model), gp.Strategy(tp=world), example_inputs=(x,), example_target=y,
                    loss_fn=lm_loss, optimizer=optimizer)
    group = pm.mesh.group("tp")
    dt = dtensor_model(copy.deepcopy(model), world)
    dt_opt = optimizer(dt.parameters())
    dtp = dtensor_model(copy.deepcopy(model), world, shared_attn_input=True)
    dtp_opt = optimizer(dtp.parameters())
    hw = MegatronGPT(model, group)
    hw_opt = optimizer(hw.parameters())

    steps: Dict[str, Callable[[], float]] = {
        GP: lambda: pm.train_step(x, target=y),
        DT: lambda: _dtensor_step(dt, dt_opt, x, y),
        DT_PMI: lambda: _dtensor_step(dtp, dtp_opt, x, y),
        HW: lambda: _hand_step(hw, hw_opt, x, y),
    }
    param_bytes = {GP: _local_param_bytes(p for _, p in pm.named_parameters()),
                   DT: _local_param_bytes(dt.parameters()), DT_PMI: _local_param_bytes(dtp.parameters()),
                   HW: _local_param_bytes(hw.parameters())}

    # Step 0 of each variant, from the same weights on the same batch: the loss check.
    losses = {name: [steps[name]()] for name in VARIANTS}
    times: Dict[str, List[List[float]]] = {name: [] for name in VARIANTS}
    cpu: Dict[str, List[float]] = {name: [] for name in VARIANTS}
    thread_cpu: Dict[str, List[float]] = {name: [] for name in VARIANTS}
    for round_ in range(args.rounds):
        shift = round_ % len(VARIANTS)
        for name in VARIANTS[shift:] + VARIANTS[:shift]:
            this_round = []
            for i in range(args.warmup + args.steps):
                dist.barrier()
                start, start_cpu, start_thread = time.perf_counter(), time.process_time(), time.thread_time()
                loss = steps[name]()
                elapsed, elapsed_cpu = time.perf_counter() - start, time.process_time() - start_cpu
                elapsed_thread = time.thread_time() - start_thread
                losses[name].append(loss)
                if i >= args.warmup:
                    this_round.append(elapsed)
                    cpu[name].append(elapsed_cpu)
                    thread_cpu[name].append(elapsed_thread)
            times[name].append(this_round)

    CollectiveCounter.install()
    collectives = {}
    for name in VARIANTS:
        dist.barrier()
        with CollectiveCounter() as counter:
            losses[name].append(steps[name]())
        collectives[name] = {"dispatcher": counter.calls, "api": counter.api_calls}

    profiles = {}
    if args.profile:
        profiles = _profile(steps) if dist.get_rank() == 0 else {}
        if dist.get_rank() != 0:
            for name in VARIANTS:  # keep the peer in step with rank 0's profiled steps
                steps[name]()
    return {"times": times, "cpu": cpu, "thread_cpu": thread_cpu, "losses": losses, "param_bytes": param_bytes, "collectives": collectives,
            "params": num_parameters(model), "profiles": profiles}


def _profile(steps) -> Dict[str, str]:
    from torch.profiler import ProfilerActivity, profile

    out = {}
    for name in VARIANTS:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            steps[name]()
        out[name] = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18)
    return out


# ---- report ------------------------------------------------------------------------------

def _slower_rank(results: List[dict], name: str) -> List[List[float]]:
    """Per round, per step: the slower rank's time."""
    return [_common.slowest_rank(r["times"][name][k] for r in results)
            for k in range(len(results[0]["times"][name]))]


def summarize(results: List[dict]) -> dict:
    rounds = {name: _slower_rank(results, name) for name in VARIANTS}
    flat = {name: [t for rnd in rounds[name] for t in rnd] for name in VARIANTS}
    round_median = {name: [statistics.median(rnd) for rnd in rounds[name]] for name in VARIANTS}

    def ratio(a, b):
        return _common.median_ratio(round_median[a], round_median[b])

    losses = results[0]["losses"]
    collectives = {}
    for name in VARIANTS:
        calls = results[0]["collectives"][name]["dispatcher"]
        api = results[0]["collectives"][name]["api"]
        by_op: Dict[str, List[int]] = {}
        for op, size in calls:
            by_op.setdefault(op, []).append(size)
        api_by_op: Dict[str, List[int]] = {}
        for op, size in api:
            api_by_op.setdefault(f"torch.distributed.{op}", []).append(size)
        collectives[name] = {"count": len(calls), "bytes": sum(c[1] for c in calls), "by_op": by_op,
                             "api_by_op": api_by_op,
                             "same_on_ranks": all(r["collectives"][name] == results[0]["collectives"][name]
                                                  for r in results)}
    def cpu_median(key):
        return {n: statistics.median(statistics.mean(ts) for ts in zip(*(r[key][n] for r in results)))
                for n in VARIANTS}

    cpu, thread = cpu_median("cpu"), cpu_median("thread_cpu")
    fastest = {n: min(flat[n]) for n in VARIANTS}
    return {
        "cpu": cpu, "thread": thread,
        "alt": {n: {ref: (cpu[n] / cpu[ref], thread[n] / thread[ref], fastest[n] / fastest[ref])
                    for ref in (HW, DT, DT_PMI)} for n in VARIANTS},
        "median": {n: statistics.median(flat[n]) for n in VARIANTS},
        "min": {n: min(flat[n]) for n in VARIANTS},
        "iqr": {n: _common.iqr(flat[n]) for n in VARIANTS},
        "to_hw": {n: ratio(n, HW) for n in VARIANTS},
        "to_dt": {n: ratio(n, DT) for n in VARIANTS},
        "to_dtp": {n: ratio(n, DT_PMI) for n in VARIANTS},
        "loss0": {n: losses[n][0] for n in VARIANTS},
        "loss_gap0": {n: abs(losses[n][0] - losses[GP][0]) for n in VARIANTS},
        "loss_gap_all": {n: max(abs(a - b) for a, b in zip(losses[n], losses[GP])) for n in VARIANTS},
        "loss_last": {n: losses[n][-1] for n in VARIANTS},
        "steps_trained": len(losses[GP]),
        "param_bytes": [r["param_bytes"] for r in results],
        "collectives": collectives,
    }


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f}"


def _sizes(sizes: List[int]) -> str:
    parts = {}
    for s in sizes:
        parts[s] = parts.get(s, 0) + 1
    return ", ".join(f"{count}x {_size(s)}" for s, count in sorted(parts.items(), reverse=True))


def _size(n: int) -> str:
    return f"{n / 2**20:g} MiB" if n >= 2**20 else f"{n / 2**10:g} KiB" if n >= 1024 else f"{n} B"


def report(args, results: List[dict], s: dict, load_before: str, load_after: str) -> str:
    ms = lambda t: f"{t * 1e3:.1f}"  # noqa: E731
    pb = s["param_bytes"]
    lines = [
        "## Tensor parallelism: graphpar vs DTensor vs hand-written Megatron (tp=2, gloo)",
        "",
        f"GPT {args.layers} layers, n_embd {args.embd}, {args.heads} heads, vocab {args.vocab}, "
        f"seq {args.seq}, batch {args.batch} (the same batch on both ranks), "
        f"{results[0]['params'] / 1e6:.2f} M parameters (tied embedding/head), fp32, AdamW. "
        f"{args.rounds} rounds x ({args.warmup} warmup + {args.steps} timed steps) per variant, "
        f"order rotated per round; a step's time is the slower rank's.",
        "",
        "| variant | median step (ms) | min (ms) | IQR (ms) | ratio to hand-written | ratio to DTensor "
        "| ratio to DTensor + PMI | params per rank (MiB, rank 0 / rank 1) | collectives per step "
        "| collective MiB per step |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name in VARIANTS:
        c = s["collectives"][name]
        lines.append(
            f"| {name} | {ms(s['median'][name])} | {ms(s['min'][name])} | {ms(s['iqr'][name])} | "
            f"{s['to_hw'][name]:.3f} | {s['to_dt'][name]:.3f} | {s['to_dtp'][name]:.3f} | "
            f"{_mib(pb[0][name])} / {_mib(pb[-1][name])} | {c['count']} | {_mib(c['bytes'])} |")
    lines += [
        "",
        "The same ratios by other statistics (less sensitive to other load on the machine):",
        "",
        "| variant | process CPU ms / step | main-thread CPU ms / step | fastest step (ms) "
        "| ratio to hand-written (process CPU / thread CPU / fastest) | ratio to DTensor (same) "
        "| ratio to DTensor + PMI (same) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name in VARIANTS:
        cells = [" / ".join(f"{v:.3f}" for v in s["alt"][name][ref]) for ref in (HW, DT, DT_PMI)]
        lines.append(f"| {name} | {ms(s['cpu'][name])} | {ms(s['thread'][name])} | {ms(s['min'][name])} | "
                     + " | ".join(cells) + " |")
    lines += ["", "CPU times: median over steps of the mean of the two ranks; process CPU includes "
              "gloo's threads, main-thread CPU is compute and Python overhead only."]
    gp_c, hw_c, dt_c = (s["collectives"][n] for n in (GP, HW, DT))
    full_bytes = results[0]["params"] * 4
    lines += [
        "",
        "Ratios: median over rounds of (variant's round median / reference's round median).",
        "",
        "Targets (wall: median of per-round ratios; CPU: process / main-thread CPU time ratios):",
        _target("faster than DTensor", s, DT, lambda r: r < 1.0),
        _target("faster than DTensor + PrepareModuleInput", s, DT_PMI, lambda r: r < 1.0),
        _target("within 5% of hand-written", s, HW, lambda r: r <= 1.05),
        f"- no more collectives than hand-written: {gp_c['count']} vs {hw_c['count']} "
        f"({_mib(gp_c['bytes'])} vs {_mib(hw_c['bytes'])} MiB) -> "
        f"{'met' if gp_c['count'] <= hw_c['count'] and gp_c['bytes'] <= hw_c['bytes'] else 'MISSED'}",
    ]
    noise = max(s["iqr"][n] / s["median"][n] for n in VARIANTS)
    if noise > 0.2:
        lines.append(f"- note: wall times are noisy in this run (an IQR up to {noise:.0%} of the median; "
                     f"load average {load_before} at the start): trust the CPU-time ratios more.")
    lines += [
        "",
        "Step-0 loss (same weights, same batch), |difference| to graphpar (tolerance "
        f"{LOSS_TOL:g}):",
    ]
    for name in VARIANTS:
        gap = s["loss_gap0"][name]
        lines.append(f"- {name}: {s['loss0'][name]:.6f} (|diff| {gap:.2e}, "
                     f"{'ok' if gap <= LOSS_TOL else 'FAIL'}); largest |diff| over all "
                     f"{s['steps_trained']} steps {s['loss_gap_all'][name]:.2e}; last loss "
                     f"{s['loss_last'][name]:.6f}")
    lines += ["", "Collectives in one step (rank 0), at the dispatcher [and torch.distributed.* calls]:"]
    for name in VARIANTS:
        c = s["collectives"][name]
        same = "" if c["same_on_ranks"] else " (rank 1 differs!)"
        detail = "; ".join(f"{op}: {_sizes(sizes)}" for op, sizes in c["by_op"].items()) or "none seen"
        api = "; ".join(f"{op}: {_sizes(sizes)}" for op, sizes in c["api_by_op"].items()) or "none"
        lines.append(f"- {name}{same}: {detail} [{api}]")
    lines += [
        "",
        "Layout: all four shard the same way: q/k/v/fc column-parallel, attn.proj/mlp.proj "
        "row-parallel, the tied token embedding / LM head vocab-parallel (graphpar: "
        "vocab_parallel_embedding + parallel_cross_entropy; DTensor: RowwiseParallel embedding, "
        "ColwiseParallel head with Shard(-1) logits under loss_parallel(); hand-written: "
        "Megatron's masked lookup + vocab-parallel cross entropy); position embedding and "
        f"LayerNorms replicated. Unsharded model: {_mib(full_bytes)} MiB of parameters.",
        "DTensor needed the attention adjusted (local head count, `.view(b, t, -1)`): the model's "
        "forward views with the full head count and width.",
        "",
        *_common.reproduce_lines("2 ranks x 1 thread", load_before, load_after, "bench_tensor_parallel.py",
                                 cpu_count=True),
    ]
    profiles = results[0].get("profiles") or {}
    for name, table in profiles.items():
        lines += ["", f"### profile of one step, rank 0: {name}", "", "```", table, "```"]
    return "\n".join(lines)


def _target(what: str, s: dict, ref: str, ok: Callable[[float], bool]) -> str:
    wall = s["to_hw" if ref == HW else "to_dt" if ref == DT else "to_dtp"][GP]
    cpu, thread, _ = s["alt"][GP][ref]
    verdicts = [ok(wall), ok(cpu), ok(thread)]
    verdict = "met" if all(verdicts) else "MISSED" if not any(verdicts) else "mixed"
    text = (f"- {what}: graphpar/{ref} wall **{wall:.3f}**, CPU {cpu:.3f} / {thread:.3f} -> "
            f"{verdict}")
    return text


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.embd % args.heads or args.heads % 2 or args.vocab % 2:
        raise SystemExit("heads and vocab must be even and n_embd a multiple of heads for tp=2")
    results, load_before, load_after = _common.launch(rank_main, world_size=2, args=(args,))
    print(report(args, results, summarize(results), load_before, load_after))


if __name__ == "__main__":
    main()
