"""Property tests (hypothesis) of shard-spec propagation and pipeline stage partitioning,
on small random models, in one process.

Tensor parallelism: each tp rank's lowered program runs in its own thread; the tp
collectives exchange tensors through a barrier instead of a process group (ThreadedGroup),
so the programs the passes produce run exactly as written, without processes.
Pipeline parallelism: the stage programs of every pp rank run one after another, each
stage fed the values the previous one sends.
"""
from __future__ import annotations

import threading
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import graphpar as gp
from graphpar.runtime import ops
from graphpar.frontend.compile import lower_rank
from graphpar.runtime.single_stage import forward_only
from graphpar.ir import Shard, TensorMeta, record
from graphpar.distributed.mesh import Mesh
from graphpar.runtime import collectives
from graphpar.passes.tp.rules import DivisibilityError
from tests.helpers import best_splits, held_elements

SETTINGS = settings(max_examples=25, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow])
# Sharded matmuls add the same float32 products in another order (a row layer sums tp
# partial dot products): a few ulps of values of size ~1, far below any real mismatch.
ATOL = 1e-5


# ---- random models ---------------------------------------------------------------------------
ELEMENTWISE = {"relu": F.relu, "gelu": F.gelu, "tanh": torch.tanh, "affine": lambda x: x * 0.5 + 1.0}


class Elementwise(nn.Module):
    def __init__(self, name: str):
        super().__init__()
        self.name = name

    def forward(self, x):
        return ELEMENTWISE[self.name](x)


class Chain(nn.Module):
    """Layers in a ModuleList; `skips[i] = j` adds block j's output to block i's (when the
    shapes agree), so values may skip over pipeline cuts: a DAG, not only a chain."""

    def __init__(self, layers, skips=None):
        super().__init__()
        self.blocks = nn.ModuleList(layers)
        self.skips = dict(skips or {})

    def forward(self, x):
        outs = []
        for i, block in enumerate(self.blocks):
            x = block(x)
            j = self.skips.get(i)
            if j is not None and outs[j].shape == x.shape:
                x = x + outs[j]
            outs.append(x)
        return x


@st.composite
def chains(draw, sizes=st.integers(1, 12), min_layers=1, max_layers=6, with_skips=True, with_ties=False):
    """(model, input width): Linear layers of random widths with elementwise ops between,
    (with_skips) residual adds from earlier blocks and (with_ties) every Linear layer sharing
    the weight of the first earlier one of the same shape (a tied weight)."""
    width = draw(sizes)
    first = width
    layers = []
    for _ in range(draw(st.integers(min_layers, max_layers))):
        if draw(st.booleans()):
            out = draw(sizes)
            layers.append(nn.Linear(width, out, bias=draw(st.booleans())))
            width = out
        else:
            layers.append(Elementwise(draw(st.sampled_from(sorted(ELEMENTWISE)))))
    if not any(isinstance(layer, nn.Linear) for layer in layers):
        layers.append(nn.Linear(width, draw(sizes)))
    linears = [layer for layer in layers if isinstance(layer, nn.Linear)]
    for i, later in enumerate(linears):
        earlier = next((e for e in linears[:i] if e.weight.shape == later.weight.shape), None)
        if with_ties and earlier is not None:
            later.weight = earlier.weight
    n = len(layers)
    # long skips (over at least one block) are the ones that cross several pipeline cuts
    skips = {i: draw(st.integers(0, i - 2)) for i in range(2, n) if with_skips and draw(st.booleans())}
    torch.manual_seed(draw(st.integers(0, 2 ** 16)))
    return Chain(layers, skips), first


def linear_sizes(model):
    return {s for m in model.modules() if isinstance(m, nn.Linear) for s in (m.in_features, m.out_features)}


# ---- tensor parallelism in threads -----------------------------------------------------------
class ThreadedGroup:
    """The torch.distributed calls of graphpar/runtime/collectives.py for tp ranks that are threads
    of this process: each collective posts this rank's tensor and waits for the others."""

    ReduceOp = dist.ReduceOp

    def __init__(self, size: int):
        self.size = size
        self.local = threading.local()
        self.slots = [None] * size
        self.barrier = threading.Barrier(size, timeout=30)  # a rank that never arrives fails, not hangs

    def get_rank(self, group=None):
        return self.local.rank

    def get_world_size(self, group=None):
        return self.size

    def _exchange(self, tensor):
        self.slots[self.local.rank] = tensor.detach().clone()
        self.barrier.wait()
        values = list(self.slots)
        self.barrier.wait()  # nobody overwrites a slot before everyone has read it
        return values

    def all_reduce(self, tensor, op=dist.ReduceOp.SUM, group=None):
        values = self._exchange(tensor)
        reduced = torch.stack(values).amax(0) if op == dist.ReduceOp.MAX else torch.stack(values).sum(0)
        with torch.no_grad():
            tensor.copy_(reduced)

    def all_gather(self, parts, tensor, group=None):
        for part, value in zip(parts, self._exchange(tensor)):
            part.copy_(value)


def run_tp_ranks(programs, tp, inputs, backward):
    """Run every rank's program in its own thread; returns per rank (outputs, grads by name)."""
    group = ThreadedGroup(tp)
    results, errors = [None] * tp, []

    def rank_main(rank):
        group.local.rank = rank
        mesh = Mesh(1, tp, 1, rank, groups={"tp": "threads"})
        gm = programs[rank]
        try:
            with ops.running_on(mesh), ops.mode(training=False):
                outputs = gm(*inputs)
                if backward:
                    sum(o.float().pow(2).sum() for o in outputs).backward()
            results[rank] = (outputs, {n: p.grad for n, p in gm.named_parameters()})
        except BaseException as exc:  # noqa: BLE001 - reported by the caller
            errors.append(exc)
            group.barrier.abort()

    with mock.patch.object(collectives, "dist", group):
        threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(tp)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    if errors:
        raise errors[0]
    return results


def lowered_forward(model, tp, rank, x, **options):
    result = lower_rank(model, gp.Strategy(tp=tp), (x,), rank=rank, world_size=tp, **options)
    return forward_only(result.gm, result.ctx.results.program.has_loss), result.ctx.results


def local_slice(full, spec, rank, tp):
    return full if spec is None else full.chunk(tp, dim=spec.dim)[rank]


@SETTINGS
@given(chains(), st.sampled_from([2, 4]), st.integers(1, 3))
def test_tp_plan_runs_like_one_device_or_names_the_size_it_cannot_split(model_and_width, tp, batch):
    model, width = model_and_width
    x = torch.randn(batch, width)
    try:
        programs, results = zip(*[lowered_forward(model, tp, r, x) for r in range(tp)])
    except DivisibilityError as exc:
        size = int(str(exc).split("=")[2].split(" ")[0])  # "tp=<t> does not divide <what>=<n> at ..."
        assert size % tp and size in linear_sizes(model), str(exc)
        assert f"tp={tp} does not divide" in str(exc) and "Fix:" in str(exc)
        return
    expected = model(x)
    expected.pow(2).sum().backward()
    reference = dict(model.named_parameters())
    for rank, (outputs, grads) in enumerate(run_tp_ranks(programs, tp, (x,), backward=True)):
        assert torch.allclose(outputs[0], expected, atol=ATOL), (rank, outputs[0], expected)
        shards = results[rank].param_shards
        for name, grad in grads.items():
            full = reference[name].grad
            want = local_slice(full, shards.get(name), rank, tp)
            assert grad is not None and torch.allclose(grad, want, atol=ATOL), (rank, name)


@SETTINGS
@given(chains(), st.sampled_from([2, 4]))
def test_every_shard_is_in_range_and_divides_evenly(model_and_width, tp):
    model, width = model_and_width
    try:
        result = lower_rank(model, gp.Strategy(tp=tp), (torch.randn(2, width),), rank=0, world_size=tp,
                            until="annotate_shards")
    except DivisibilityError:
        return  # checked in the test above
    sharded = 0
    for node in result.gm.graph.nodes:
        if node.op == "output":
            continue
        rec = record(node)
        if isinstance(rec.spec, Shard):
            assert isinstance(rec.value, TensorMeta)
            rank = len(rec.value.shape)
            assert 0 <= rec.spec.dim < rank, (node.name, rec.spec)
            assert rec.value.shape[rec.spec.dim] % tp == 0, (node.name, rec.value.shape, rec.spec)
            sharded += 1
    # a chain of linear layers whose widths tp divides always gets at least one column layer
    if all(s % tp == 0 for s in linear_sizes(model)) and any(n.op == "call_function" and
                                                             "linear" in str(n.target)
                                                             for n in result.gm.graph.nodes):
        assert sharded > 0


@SETTINGS
@given(chains(sizes=st.sampled_from([4, 8, 12]), max_layers=5, with_skips=False))
def test_divisible_linear_chains_need_no_fallback_in_strict_mode(model_and_width):
    # (a residual add of a sharded and a replicated value is a real fallback, hence no skips)
    model, width = model_and_width
    lower_rank(model, gp.Strategy(tp=4, strict=True), (torch.randn(2, width),), rank=0, world_size=4)


# ---- pipeline stages ---------------------------------------------------------------------------
POLICIES = st.sampled_from(["uniform", "parameters", "type:Linear", "list"])


def stage_plan(model, width, stages, policy):
    strategy = gp.Strategy(pp=stages, partition=policy)
    result = lower_rank(model, strategy, (torch.randn(2, width),), rank=0, world_size=stages,
                        until="partition_stages")
    return result.gm, result.ctx.results.stage_plan


def computed(gm):
    return [n for n in gm.graph.nodes if n.op in ("call_function", "call_method", "call_module")]


@st.composite
def partitions(draw):
    # two widths only, so that skip connections often match shapes and cross several cuts
    model, width = draw(chains(sizes=st.sampled_from([3, 4]), min_layers=3, max_layers=7, with_ties=True))
    units = len(model.blocks)
    stages = draw(st.integers(2, 4))
    policy = draw(POLICIES)
    if policy == "list":
        starts = sorted(draw(st.sets(st.integers(1, max(units - 1, 1)), min_size=stages - 1,
                                     max_size=stages - 1))) if units > stages - 1 else []
        policy = [f"blocks.{i}" for i in starts] or "uniform"
    return model, width, stages, policy


@SETTINGS
@given(partitions())
def test_stages_are_contiguous_nonempty_and_values_only_flow_forward(case):
    model, width, stages, policy = case
    if len(model.blocks) < stages:
        with pytest.raises(ValueError, match=f"stages={stages} with {len(model.blocks)} units is invalid"):
            stage_plan(model, width, stages, policy)
        return
    gm, plan = stage_plan(model, width, stages, policy)
    stage_of = {n: record(n).stage for n in computed(gm)}
    assert all(isinstance(s, int) and 0 <= s < stages for s in stage_of.values())
    for node in computed(gm):  # a value is read at its own stage or later, never earlier
        for source in node.all_input_nodes:
            if source in stage_of:
                assert stage_of[source] <= stage_of[node], (source.name, node.name)
    # units (the blocks) are contiguous and every stage holds at least one
    unit_stage = [plan.stage_of_unit[u.path] for u in plan.units]
    assert unit_stage == sorted(unit_stage) and set(unit_stage) == set(range(stages))
    for node in computed(gm):
        path = record(node).module_path
        if path.startswith("blocks."):
            assert stage_of[node] == plan.stage_of_unit[".".join(path.split(".")[:2])]
    if isinstance(policy, list):  # explicit lists place every cut exactly where they say
        assert [plan.units[b].path for b in plan.bounds[1:]] == policy
    if policy == "parameters":
        # parameter balance is optimal: a stage holds every parameter its blocks read, a
        # tied one on every stage that reads it (brute force over all cuts)
        reads = [{id(p): p.numel() for p in model.get_submodule(u.path).parameters()} for u in plan.units]
        ends = plan.bounds[1:] + [len(reads)]
        loads = [held_elements(reads, a, b) for a, b in zip(plan.bounds, ends)]
        best, optimal = best_splits(len(reads), stages, lambda a, b: held_elements(reads, a, b))
        assert max(loads) == best and plan.bounds == max(optimal), (loads, best, plan.bounds, optimal)


@SETTINGS
@given(partitions())
def test_stage_programs_run_in_sequence_reproduce_the_model(case):
    model, width, stages, policy = case
    if len(model.blocks) < stages:
        return  # the error is checked above
    x = torch.randn(2, width)
    programs = {}
    for rank in range(stages):
        result = lower_rank(model, gp.Strategy(pp=stages, partition=policy), (x,), rank=rank, world_size=stages)
        programs.update(result.ctx.results.stages)
    assert sorted(programs) == list(range(stages))  # every stage is on exactly one rank
    values = {"input_0": x}
    with torch.no_grad(), ops.mode(training=False):
        for stage in range(stages):
            program = programs[stage]
            out = program.gm(*[values[name] for name in program.inputs + program.receives])
            if program.is_last:
                result = out
            else:
                assert [tuple(t.shape) for t in out] == [tuple(m.shape) for m in program.send_meta]
                values.update(zip(program.sends, out))
                assert program.sends == programs[stage + 1].receives
    assert torch.allclose(result[0], model(x), atol=ATOL)
