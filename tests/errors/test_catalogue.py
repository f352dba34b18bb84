"""The bad-input catalogue (docs/errors.md): every entry is triggered here and its message
checked for the value it names, the rule and the fix; the ids in the doc and the cases here
must be the same set, so neither can drift from the other."""
from __future__ import annotations

import functools
import importlib
import pathlib
import re
import threading

import pytest
import torch
import torch.fx
import torch.nn as nn
import torch.nn.functional as F

import graphpar as gp
from graphpar.tools import data
from graphpar.frontend.compile import lower_rank
from graphpar.ir import record, stamp, tensor_meta
from graphpar.distributed.launch import LaunchError, launch
from graphpar.passes.partition_policies import Unit, balance, partition
from graphpar.passes.manager import make_pass, register_pass, unregister_pass
from graphpar.runtime.pipeline.check import check_schedule
from graphpar.runtime.pipeline.schedules import ScheduleError, build_schedule
from graphpar.passes.tracing import TraceError
from graphpar.ir.validate import GraphValidationError
from tests.targets import catalogue_targets as targets
from tests.targets import eager_targets
from tests.targets import launch_targets

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "errors.md"
# Sections other engineers append and own; their rows need no id here.
OTHERS_SECTIONS = ("Checkpoints", "Faults")
launch_module = importlib.import_module("graphpar.distributed.launch")
distributed_module = importlib.import_module("graphpar.distributed.groups")

CASES = {}


def case(entry_id):
    def register(fn):
        assert entry_id not in CASES, entry_id
        CASES[entry_id] = fn
        return fn
    return register


def expect(exc_type, fn, *patterns) -> str:
    """Run fn, require exc_type, and every regex in patterns in its message."""
    with pytest.raises(exc_type) as info:
        fn()
    message = str(info.value)
    for pattern in patterns:
        assert re.search(pattern, message, re.S), f"{pattern!r} not in:\n{message}"
    return message


# ---- models --------------------------------------------------------------------------------
def mlp() -> nn.Module:
    return targets.mlp()


def x4(batch=4):
    return torch.randn(batch, 4)


def mse_pm(batch=4, **strategy):
    return gp.compile(mlp(), gp.Strategy(**strategy), (x4(batch),), loss_fn=F.mse_loss,
                      example_target=torch.randn(batch, 2))


class Gate(nn.Module):
    def forward(self, x):
        if x.sum() > 0:  # Python control flow on a tensor value: untraceable
            return x
        return -x


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.gate = Gate()

    def forward(self, x):
        return self.gate(self.fc(x))


class CumsumMLP(nn.Module):
    """A column and a row layer with an op between them that has no sharding rule."""

    def __init__(self):
        super().__init__()
        self.up = nn.Linear(4, 8)
        self.mix = Mix()
        self.down = nn.Linear(8, 4)

    def forward(self, x):
        return self.down(self.mix(self.up(x)))


class Mix(nn.Module):
    def forward(self, x):
        return torch.cumsum(x, dim=-1)


class FusedQKV(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(4, 12)
        self.proj = nn.Linear(4, 4)

    def forward(self, x):
        qkv = self.qkv(x)
        q, k, v = qkv.split(4, dim=-1)
        return self.proj(q * k + v), qkv


class TwoInputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, a, b):
        return self.fc(a) + self.fc(b).sum()


class ScalarOut(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        return self.fc(x).sum()


class Bare(nn.Module):
    """Parameters but no submodule: nothing to split into pipeline units."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 4))

    def forward(self, x):
        return (x @ self.w) @ self.w


class WithSize(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        h = self.fc(x)
        return h, h.size(0)


class SizeAcrossCut(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = WithSize()
        self.b = nn.Linear(4, 4)

    def forward(self, x):
        h, n = self.a(x)
        return self.b(h).reshape(n, -1)


def lower(model, strategy, world_size, example=None, **options):
    return lower_rank(model, strategy, (example if example is not None else x4(),), rank=0,
                      world_size=world_size, **options)


def identity_pass(gm, ctx):
    return gm


# ---- Strategy ------------------------------------------------------------------------------
@case("E-strategy-int-type")
def _():
    expect(ValueError, lambda: gp.Strategy(tp=2.0), r"Strategy\.tp=2\.0 is invalid", "positive int", r"Fix:.*tp=2")


@case("E-strategy-positive")
def _():
    expect(ValueError, lambda: gp.Strategy(pp=0), r"Strategy\.pp=0 is invalid", "positive int", "Fix:.*pp=1")


@case("E-strategy-bool")
def _():
    expect(ValueError, lambda: gp.Strategy(strict="yes"), r"Strategy\.strict='yes' is invalid", "must be a bool",
           "Fix:")


@case("E-strategy-schedule-name")
def _():
    expect(ValueError, lambda: gp.Strategy(schedule="1f1c"), r"schedule='1f1c' is invalid", "must be one of",
           "Fix:.*'1f1b'")


@case("E-strategy-seed")
def _():
    expect(ValueError, lambda: gp.Strategy(seed=-1), r"seed=-1 is invalid", "non-negative int", "Fix:")


@case("E-strategy-param-dtype")
def _():
    expect(ValueError, lambda: gp.Strategy(param_dtype=torch.int8), r"param_dtype=torch\.int8 is invalid",
           "torch.bfloat16", "Fix:")


@case("E-strategy-partition-type")
def _():
    expect(ValueError, lambda: gp.Strategy(partition=3), r"partition=3 is invalid", "list of module paths",
           "Fix:")


@case("E-strategy-partition-policy")
def _():
    expect(ValueError, lambda: gp.Strategy(partition="paramters"), r"partition='paramters' is invalid",
           "'uniform', 'parameters'", "Fix:.*'parameters'")


@case("E-strategy-partition-regex")
def _():
    expect(ValueError, lambda: gp.Strategy(partition="type:("), r"partition='type:\(' is invalid",
           "does not compile", "Fix:")


@case("E-strategy-path-list")
def _():
    expect(ValueError, lambda: gp.Strategy(partition=["a", "a"], pp=3), r"partition=\['a', 'a'\] is invalid",
           "more than once", "Fix:")


@case("E-strategy-offload-embedding")
def _():
    expect(ValueError, lambda: gp.Strategy(offload_embedding=3), r"offload_embedding=3 is invalid",
           "True, False, or a list", "Fix:")


@case("E-strategy-passes-type")
def _():
    expect(ValueError, lambda: gp.Strategy(passes=identity_pass), "passes=.* is invalid",
           "tuple or list of passes", r"Fix:.*passes=\(")


@case("E-strategy-pass-path")
def _():
    expect(ValueError, lambda: gp.Strategy(passes=("pkg.mod.fn",)), r"passes\[0\]='pkg\.mod\.fn'",
           "package.module:function", "Fix:")


@case("E-strategy-pass-dict")
def _():
    expect(ValueError, lambda: gp.Strategy(passes=({"name": "p", "target": "a:b", "colour": 1},)),
           r"passes\[0\] has unknown key", "colour", "Fix:")


@case("E-strategy-pass-object")
def _():
    expect(ValueError, lambda: gp.Strategy(passes=(3,)), r"passes\[0\]=3 has type int", "callable", "Fix:")


@case("E-strategy-interleaved-chunks")
def _():
    expect(ValueError, lambda: gp.Strategy(pp=2, microbatches=2, schedule="interleaved-1f1b"),
           r"schedule='interleaved-1f1b' with virtual_stages=1 is invalid", "Fix:.*virtual_stages=2")


@case("E-strategy-virtual-schedule")
def _():
    expect(ValueError, lambda: gp.Strategy(pp=2, virtual_stages=2), "virtual_stages=2 with schedule='1f1b' is invalid",
           "Fix:.*interleaved-1f1b")


@case("E-strategy-interleaved-pp")
def _():
    expect(ValueError, lambda: gp.Strategy(schedule="interleaved-1f1b", virtual_stages=2),
           "with pp=1 is invalid", "Fix:.*pp")


@case("E-strategy-interleaved-microbatches")
def _():
    expect(ValueError, lambda: gp.Strategy(pp=2, microbatches=3, virtual_stages=2, schedule="interleaved-1f1b"),
           "microbatches=3 with pp=2 and virtual_stages=2 is invalid", "multiple", "Fix:.*microbatches=(2|4)")


@case("E-strategy-partition-count")
def _():
    expect(ValueError, lambda: gp.Strategy(pp=2, partition=["0", "2"]), r"partition=\['0', '2'\] with pp=2 is invalid",
           "exactly 1", "Fix:.*drop the first entry")


@case("E-strategy-sequence-parallel")
def _():
    expect(ValueError, lambda: gp.Strategy(sequence_parallel=True), "sequence_parallel=True with tp=1 is invalid",
           "Fix:.*tp")


@case("E-strategy-degree")
def _():
    expect(ValueError, lambda: gp.Strategy(dp=2, tp=2).check_world_size(6),
           r"Strategy\(dp=2, tp=2, pp=1\) does not fit the world size", "= 4, but world_size=6", r"Fix: use dp=3")
    expect(ValueError, lambda: gp.Strategy(tp=4).check_world_size(6), "world_size=6",
           "Fix: tp\\*pp=4 does not divide 6")
    # and at compile, in a single process (a world of one)
    expect(ValueError, lambda: gp.compile(mlp(), gp.Strategy(tp=2), (x4(),)), "world_size=1", "Fix:")


@case("E-strategy-world-size-arg")
def _():
    expect(ValueError, lambda: gp.Strategy().check_world_size(0), "world_size=0 is invalid", "positive int", "Fix:")


@case("E-strategy-microbatch-divisibility")
def _():
    expect(ValueError, lambda: gp.compile(mlp(), gp.Strategy(microbatches=3), (x4(4),)),
           "microbatches=3 is invalid", "local batch 4 is not divisible by microbatches=3", "Fix:.*microbatches=(2|4)")
    pm = mse_pm(4, microbatches=2)
    expect(ValueError, lambda: pm.train_step(x4(5), target=torch.randn(5, 2)),
           "local batch 5 is not divisible by microbatches=2", "Fix:")


@case("E-strategy-local-batch-arg")
def _():
    expect(ValueError, lambda: gp.Strategy().check_batch(0), "local_batch=0 is invalid", "positive int", "Fix:")


@case("E-strategy-to-dict-pass")
def _():
    expect(ValueError, lambda: gp.Strategy(passes=(lambda gm, ctx: gm,)).to_dict(), "cannot serialise passes",
           "lambda", "Fix:")


@case("E-strategy-unknown-key")
def _():
    expect(ValueError, lambda: gp.Strategy.from_dict({"micro_batches": 2}), "unknown key", "micro_batches",
           "Fix:.*microbatches")


@case("E-strategy-from-dict-type")
def _():
    expect(TypeError, lambda: gp.Strategy.from_dict([1]), "from_dict expected a dict, got list", "Fix:")


@case("E-strategy-coerce-type")
def _():
    expect(TypeError, lambda: gp.compile(mlp(), 3, (x4(),)), "Strategy.coerce expected a graphpar.Strategy or a dict, "
           "got int", "Fix:")


@case("E-strategy-seed-range")
def _():
    expect(ValueError, lambda: gp.Strategy(seed=2**64), r"seed=18446744073709551616 is invalid", "64 bits",
           r"offset of up to 2718 at tp=1, pp=1, so seed must be at most 18446744073709548897", r"Fix: use seed=0")
    # the bound leaves room for the largest stream offset at this tp and pp
    expect(ValueError, lambda: gp.Strategy(seed=2**64 - 2719, pp=2), "offset of up to 3718 at tp=1, pp=2", "Fix:")


# ---- compile -------------------------------------------------------------------------------
@case("E-compile-model-type")
def _():
    expect(TypeError, lambda: gp.compile(lambda x: x, gp.Strategy(), (x4(),)), "needs a torch.nn.Module, got function")


@case("E-compile-bare-tensor")
def _():
    expect(TypeError, lambda: gp.compile(mlp(), gp.Strategy(), x4()), "got a bare tensor", r"Fix: example_inputs=\(x,\)")


@case("E-compile-example-type")
def _():
    expect(TypeError, lambda: gp.compile(mlp(), gp.Strategy(), ()), "non-empty tuple", "got tuple", "Fix:")


def host_compile(offload, optimizer=None, tie_weights=False):
    from tests.helpers import lm_loss, tiny_gpt, token_batch
    x, y = token_batch(batch=4)
    return lambda: gp.compile(tiny_gpt(tie_weights=tie_weights), gp.Strategy(offload_embedding=offload), (x,),
                              loss_fn=lm_loss, example_target=y, optimizer=optimizer)


@case("E-host-embedding-missing")
def _():
    expect(ValueError, host_compile(["wtee"]), r"offload_embedding names 'wtee', which is not a module",
           r"Fix: use one of its embedding modules: \['wte', 'wpe'\]")


@case("E-host-embedding-type")
def _():
    expect(ValueError, host_compile(["blocks.0.mlp"]), r"names 'blocks.0.mlp', a \w+; only nn.Embedding",
           r"Fix: use one of \['wte', 'wpe'\]")


@case("E-host-embedding-tied")
def _():
    expect(ValueError, host_compile(["wte"], tie_weights=True), r"names 'wte', whose weight is tied",
           r"Fix: untie the weights or leave 'wte' on the device")


@case("E-host-embedding-optimizer")
def _():
    expect(ValueError, host_compile(True, functools.partial(torch.optim.RMSprop, lr=0.1)),
           r"row-wise update, which graphpar has for SGD, Adagrad, Adam and AdamW, not RMSprop",
           r"Fix: use one of those, or offload_embedding=False")


@case("E-host-embedding-decay")
def _():
    expect(ValueError, host_compile(True, functools.partial(torch.optim.SGD, lr=0.1, weight_decay=0.1)),
           r"SGD\(weight_decay=0.1\) would decay every row", r"Fix: weight_decay=0")
    expect(ValueError, host_compile(True, functools.partial(torch.optim.Adam, lr=0.1, weight_decay=0.1)),
           r"Adam\(weight_decay=0.1\) \(L2 in the gradient\) has no row-wise form", r"Fix: use AdamW or weight_decay=0")


@case("E-compile-rank-mismatch")
def _(messages):
    for message in messages:  # rank 1 passed seed=1, rank 0 seed=0: both ranks raise, neither hangs
        assert re.search(r"rank 1 called graphpar.compile with a different strategy than rank 0 \(.*'seed': 1.* vs "
                         r".*'seed': 0", message), message
        assert "Fix: every rank must pass the same Strategy" in message, message


@case("E-compile-batch-dims")
def _():
    expect(ValueError, lambda: gp.compile(TwoInputs(), gp.Strategy(), (x4(4), x4(3))),
           r"every tensor input must share its first \(batch\) dimension", r"\[\(3,\), \(4,\)\]", "Fix:")


@case("E-compile-mesh-rank")
def _():
    from graphpar.distributed.mesh import Mesh
    expect(ValueError, lambda: Mesh(dp=1, tp=2, pp=1, rank=2), "rank 2 is outside a world of 2", "Fix:")


def expect_untouched(exc_type, call, *patterns, model=None) -> str:
    """expect() for call(model): the refused compile left the model's weights, buffers and
    training flags as they were (checked on a model in eval mode, so a flag set is seen)."""
    model = (model or mlp()).eval()
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    message = expect(exc_type, lambda: call(model), *patterns)
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())
    assert not any(m.training for m in model.modules())
    return message


def compile_mse(model, loss_fn=F.mse_loss, **options):
    return gp.compile(model, gp.Strategy(), (x4(),), loss_fn=loss_fn, example_target=torch.randn(4, 2), **options)


SGD = functools.partial(torch.optim.SGD, lr=0.1)


@case("E-compile-optimizer-factory")
def _():
    expect_untouched(TypeError, lambda m: compile_mse(m, optimizer=torch.optim.SGD(m.parameters(), lr=0.1)),
                     r"optimizer=SGD\(\.\.\.\) is an optimizer instance", r"factory callable\(params\)",
                     r"Fix: pass a factory, e\.g\. optimizer=functools\.partial\(torch\.optim\.AdamW")
    expect(TypeError, lambda: compile_mse(mlp(), optimizer=3), "optimizer=3 is not callable", "Fix:")


@case("E-compile-optimizer-result")
def _():
    expect_untouched(TypeError, lambda m: compile_mse(m, optimizer=lambda params: None),
                     "the optimizer factory .*lambda.* returned None, not a torch.optim.Optimizer",
                     r"Fix: return the optimizer")


@case("E-compile-optimizer-params")
def _():
    # issue #14 item 1: an optimizer over the user's model trained nothing, silently
    expect_untouched(ValueError, lambda m: compile_mse(m, optimizer=lambda params: SGD(m.parameters())),
                     r"returned a SGD over 4 tensor\(s\), 0 of them among the 4 parameter\(s\) graphpar gave it",
                     "must step exactly those", r"Fix: build the optimizer from the factory's argument")
    expect(ValueError, lambda: compile_mse(mlp(), optimizer=lambda params: SGD(list(params)[:1])),
           r"over 1 tensor\(s\), 1 of them among the 4", "Fix:")


@case("E-compile-optimizer-closure")
def _():
    expect_untouched(ValueError, lambda m: compile_mse(m, optimizer=torch.optim.LBFGS),
                     r"optimizer LBFGS needs a closure in step\(closure\)", "no closure",
                     r"Fix: use an optimizer whose step\(closure=None\) has a default")


@case("E-compile-module-name")
def _():
    # issue #14 item 9: a name that matches no module did nothing, silently
    expect_untouched(ValueError, lambda m: gp.compile(m, gp.Strategy(), (x4(),), leaf_modules=["00"]),
                     "leaf_modules names '00', which is not a module of Sequential", "would do nothing",
                     "Fix: did you mean '0'")
    expect_untouched(ValueError, lambda m: gp.compile(m, gp.Strategy(), (x4(),), tp_replicate=["fc"]),
                     "tp_replicate names 'fc', which is not a module of Sequential",
                     r"Fix: use paths from model.named_modules\(\), e.g. \['0', '1', '2'\]")
    expect(ValueError, lambda: gp.compile(mlp(), gp.Strategy(), (x4(),), leaf_modules=[nn.Conv2d]),
           "leaf_modules names the class Conv2d, of which Sequential has no module", "Fix:")


@case("E-compile-backward-hook")
def _():
    # a backward hook graphpar would never call trained silently without it (both front ends)
    def compile_hooked(model):
        model[0].register_full_backward_hook(lambda module, grad_input, grad_output: None)
        return gp.compile(model, gp.Strategy(), (x4(),))
    expect_untouched(ValueError, compile_hooked, r"module\(s\) \['0'\] of Sequential have backward hooks",
                     "would never call", "Fix: remove the hooks before graphpar.compile")
    model = mlp()
    model[2].weight.register_hook(lambda grad: grad * 2)
    expect(ValueError, lambda: gp.compile(model, gp.Strategy(), (x4(),), tracer="export"),
           r"parameter\(s\) \['2.weight'\] of Sequential have backward hooks", "Fix:")


@case("E-compile-module-list-type")
def _():
    expect_untouched(TypeError, lambda m: gp.compile(m, gp.Strategy(), (x4(),), leaf_modules="0"),
                     "leaf_modules='0' is a string, but leaf_modules takes a list of module paths",
                     r"Fix: leaf_modules=\['0'\]")
    expect(TypeError, lambda: gp.compile(mlp(), gp.Strategy(), (x4(),), tp_replicate=[nn.Linear]),
           r"tp_replicate entry .*Linear.* is a type; entries must be module paths \(str\)", "Fix:")


@case("E-compile-device")
def _():
    expect_untouched(ValueError, lambda m: gp.compile(m, gp.Strategy(), (x4(),), device="gpu"),
                     "device='gpu' is not a torch device", "Fix: device='cpu'")
    if torch.cuda.is_available():
        expect(ValueError, lambda: gp.compile(mlp(), gp.Strategy(), (x4(),), device="cuda:99"),
               "device='cuda:99' names GPU 99, but this machine has", "Fix:")
    else:
        expect_untouched(ValueError, lambda m: gp.compile(m, gp.Strategy(), (x4(),), device="cuda"),
                         r"device='cuda' asks for CUDA, but torch.cuda.is_available\(\) is False",
                         "Fix: device='cpu', or leave device out")


@case("E-compile-dump-dir")
def _(tmp_path, monkeypatch):
    file = tmp_path / "notes.txt"
    file.write_text("")
    expect_untouched(ValueError, lambda m: gp.compile(m, gp.Strategy(), (x4(),), dump=str(file)),
                     "dump=.*notes.txt' is not a directory: .* is a file", r"Fix: give a directory path.*notes_dump")
    monkeypatch.setenv("GRAPHPAR_DUMP", str(file / "inside"))
    expect(ValueError, lambda: gp.compile(mlp(), gp.Strategy(), (x4(),)), "GRAPHPAR_DUMP=.* is not a directory",
           "Fix:")
    assert not any(tmp_path.glob("rank*"))  # refused before any pass wrote its dump


@case("E-compile-bucket-bytes")
def _():
    expect_untouched(ValueError, lambda m: compile_mse(m, bucket_bytes="25MB"),
                     "bucket_bytes='25MB' is invalid: it must be a positive int number of bytes",
                     r"Fix: bucket_bytes=25 \* 2\*\*20")
    expect(ValueError, lambda: compile_mse(mlp(), bucket_bytes=0), "bucket_bytes=0 is invalid", "Fix:")


@case("E-compile-empty-batch")
def _():
    expect_untouched(ValueError, lambda m: gp.compile(m, gp.Strategy(), (torch.randn(0, 4),)),
                     r"example_inputs: the batch is empty \(0 samples\)", "Fix: skip empty batches")
    pm = mse_pm()
    expect(ValueError, lambda: pm.train_step(torch.randn(0, 4), target=torch.randn(0, 2)),
           r"train_step: the batch is empty", "Fix:")


# ---- tracing -------------------------------------------------------------------------------
@case("E-trace-front-end-name")
def _():
    expect(ValueError, lambda: gp.compile(mlp(), gp.Strategy(), (x4(),), tracer="jit"),
           "tracer='jit' is not a front end", "Fix:")


@case("E-trace-untraceable")
def _():
    site = r"in module 'gate' at Gate\.forward .*test_error_catalogue\.py:\d+: if x\.sum\(\) > 0"
    fx = expect(TraceError, lambda: gp.compile(Branchy(), gp.Strategy(), (x4(),), tracer="fx"),
                "could not trace Branchy", "fx: TraceError", site,
                r"Fix: use tracer='export'.*leaf_modules=\['gate'\]")
    assert "export:" not in fx  # only the forced front end was tried
    expect(TraceError, lambda: gp.compile(Branchy(), gp.Strategy(), (x4(),)),
           "fx: TraceError", "export: .*data-dependent", site, r"Fix: keep module 'gate' opaque.*leaf_modules=\['gate'\]")
    # the fix works: the leaf keeps the data-dependent branch out of the graph
    pm = gp.compile(Branchy(), gp.Strategy(), (x4(),), leaf_modules=["gate"])
    assert pm(x4()).shape == (4, 4)


@case("E-trace-loss-not-scalar")
def _():
    expect(ValueError, lambda: gp.compile(mlp(), gp.Strategy(), (x4(),), loss_fn=functools.partial(
        F.mse_loss, reduction="none"), example_target=torch.randn(4, 2)),
        "loss_fn must return a floating scalar", r"f32\[4, 2\]|\[4, 2\]", r"Fix: .*\.mean\(\)")


def trace_fix_absent(message: str) -> None:
    """A loss or target mistake is not reported as a model that cannot be traced."""
    assert "leaf_modules" not in message and "could not trace" not in message, message


@case("E-loss-fn-class")
def _():
    message = expect_untouched(ValueError, lambda m: gp.compile(
        m, gp.Strategy(), (x4(),), loss_fn=nn.CrossEntropyLoss, example_target=torch.randint(0, 2, (4,))),
        "loss_fn=CrossEntropyLoss is a class, not a loss", r"Fix: pass an instance, loss_fn=CrossEntropyLoss\(\)")
    trace_fix_absent(message)


@case("E-loss-fn-arity")
def _():
    def loss_of(output):
        return output.mean()
    message = expect_untouched(ValueError, lambda m: gp.compile(m, gp.Strategy(), (x4(),), loss_fn=loss_of,
                                                                 example_target=torch.randn(4, 2)),
                               r"loss_fn=.*loss_of\(output\) cannot be called as loss_fn\(output, target\)",
                               "Fix: take exactly the model's output and the target")
    trace_fix_absent(message)
    # also when the target only comes at the first train_step
    expect(ValueError, lambda: gp.compile(mlp(), gp.Strategy(), (x4(),), loss_fn=loss_of), "cannot be called as")


@case("E-loss-tuple")
def _():
    message = expect_untouched(ValueError, lambda m: compile_mse(m, loss_fn=lambda out, y: (F.mse_loss(out, y), 4)),
                               "returned a tuple of 2 values; graphpar accepts a floating scalar tensor",
                               r"\(loss_sum, count\) form", "Fix: return one tensor")
    trace_fix_absent(message)
    expect(ValueError, lambda: gp.compile(mlp(), gp.Strategy(), (x4(),), loss_fn=lambda out, y: [out.sum()],
                                          example_target=torch.randn(4, 2), tracer="export"),
           "returned a list of 1 values", "Fix:")


@case("E-loss-target-type")
def _():
    message = expect_untouched(ValueError, lambda m: gp.compile(m, gp.Strategy(), (x4(),), loss_fn=F.cross_entropy,
                                                                 example_target=[0, 1, 0, 1]),
                               r"example_target is a list holding int values \(\[0, 1, 0, 1\]\)",
                               "must be a tensor", r"Fix: example_target=torch.tensor\(")
    trace_fix_absent(message)
    pm = mse_pm()
    expect(ValueError, lambda: pm.train_step(x4(), target=torch.randn(4, 2).tolist()),
           "target is a list holding float values", r"Fix: target=torch.tensor\(")


@case("E-loss-target-batch")
def _():
    message = expect_untouched(ValueError, lambda m: gp.compile(m, gp.Strategy(), (x4(4),), loss_fn=F.mse_loss,
                                                                 example_target=torch.randn(3, 2)),
                               r"example_target has shape \[3, 2\], but the inputs' batch is 4",
                               "first dimension must be the batch size", "Fix: pass the target of the same 4 samples")
    trace_fix_absent(message)
    pm = gp.compile(mlp(), gp.Strategy(), (x4(),), loss_fn=F.mse_loss)  # the loss is traced at the first step
    trace_fix_absent(expect(ValueError, lambda: pm.train_step(x4(), target=torch.randn(3, 2)),
                            r"target has shape \[3, 2\], but the inputs' batch is 4", "Fix:"))


@case("E-loss-failed")
def _():
    message = expect_untouched(ValueError, lambda m: gp.compile(m, gp.Strategy(), (x4(),), loss_fn=F.cross_entropy,
                                                                 example_target=torch.randn(4)),
                               r"loss_fn=cross_entropy failed on the model's output f32\[4, 2\] and the target of "
                               r"shape \[4\] and dtype torch.float32", "the model alone traces",
                               "fx: RuntimeError: .*int64", r"Fix: .*class indices as torch.long for cross_entropy")
    trace_fix_absent(message)


@case("E-trace-fx-leaf-hook")
def _():
    model = mlp()
    model[2].register_forward_hook(lambda module, args, out: out * 2)
    expect(TraceError, lambda: gp.compile(model, gp.Strategy(), (x4(),), tracer="fx"),
           r"fx: TypeError: symbolic_trace would drop the forward hooks of leaf module\(s\) \['2'\]",
           r"Fix: tracer='export' \(or 'auto'\)")
    assert gp.compile(model, gp.Strategy(), (x4(),)).front_end == "export"  # the fix works

# ---- tensor parallelism --------------------------------------------------------------------
@case("E-tp-strict")
def _():
    expect(ValueError, lambda: lower(CumsumMLP(), gp.Strategy(tp=2, strict=True), 2),
           r"Strategy\(strict=True, tp=2\): 1 layer\(s\) have no sharding rule", r"up \(linear\): .*cumsum.* at mix",
           "Fix: use strict=False.*tp_replicate")
    lower(CumsumMLP(), gp.Strategy(tp=2), 2)  # not strict: replicated and reported instead


@case("E-tp-divisibility")
def _():
    from graphpar.passes.tp.rules import DivisibilityError
    expect(DivisibilityError, lambda: lower(mlp(), gp.Strategy(tp=3), 3),
           r"tp=3 does not divide in_features=8 at 2 \(linear_1\)", "splits it into tp equal parts",
           r"Fix: use a tp that divides 8 \(one of \[1, 2, 4, 8\]\).*tp_replicate")


@case("E-tp-cross-entropy-reduction")
def _():
    model = nn.Sequential(nn.Linear(4, 8))
    loss = functools.partial(F.cross_entropy, reduction="sum")
    expect(ValueError, lambda: lower(model, gp.Strategy(tp=2), 2, loss_fn=loss,
                                     example_target=torch.randint(0, 8, (4,))),
           "cross entropy at .* uses reduction='sum'", "Fix:.*reduction='mean'")


@case("E-tp-fused-output")
def _():
    expect(ValueError, lambda: lower(FusedQKV(), gp.Strategy(tp=2), 2), r"output 1 \(\w+\) is sharded by fused blocks",
           "Fix:")


@case("E-tp-dropout-masks")
def _():
    expect(ValueError, lambda: gp.compile(mlp(), gp.Strategy(), (x4(),), dropout_masks="global"),
           "dropout_masks='global' is not a mask mode", "Fix:")


@case("E-tp-collective-outside")
def _():
    gm = lower(mlp(), gp.Strategy(tp=2), 2).gm
    expect(RuntimeError, lambda: gm(x4()), "collective on axis 'tp' ran outside a graphpar executor",
           "Fix: run compiled programs through ParallelModule")


# ---- pipeline parallelism ------------------------------------------------------------------
@case("E-pp-too-many-stages")
def _():
    expect(ValueError, lambda: lower(mlp(), gp.Strategy(pp=4), 4), "stages=4 with 3 units is invalid",
           "Fix: use at most 3 stages")


@case("E-pp-no-units")
def _():
    expect(ValueError, lambda: lower(Bare(), gp.Strategy(pp=2), 2), "cannot partition a model with no units",
           "Fix:.*pp=1")


@case("E-pp-type-regex-none")
def _():
    expect(ValueError, lambda: lower(mlp(), gp.Strategy(pp=2, partition="type:Conv"), 2),
           "the regex 'Conv' matches none of the module types present \\(Linear, ReLU\\)",
           "Fix:.*partition='type:Linear'")


@case("E-pp-path-unknown")
def _():
    expect(ValueError, lambda: lower(mlp(), gp.Strategy(pp=2, partition=["9"]), 2),
           "'9' is not the path of any pipeline unit", "Fix:")


@case("E-pp-path-first-unit")
def _():
    expect(ValueError, lambda: lower(mlp(), gp.Strategy(pp=2, partition=["0"]), 2), "'0' is the first unit",
           "Fix: drop '0'")


@case("E-pp-path-order")
def _():
    expect(ValueError, lambda: lower(mlp(), gp.Strategy(pp=3, partition=["2", "1"]), 3),
           "entries must follow execution order", r"Fix: reorder them: partition=\['1', '2'\]")


@case("E-pp-profile-meta")
def _():
    with torch.device("meta"):
        model = mlp()
    expect(ValueError, lambda: lower(model, gp.Strategy(pp=2, partition="profile"), 2),
           "partition='profile'.*meta device", "Fix: use partition='parameters'")


@case("E-pp-profile-zero")
def _():
    units = [Unit(f"l{i}", "Linear", 4, True, 0.0) for i in range(3)]
    expect(ValueError, lambda: partition(units, 2, "profile"), "all 3 units have seconds == 0",
           "Fix:.*partition='parameters'")


@case("E-pp-cut-non-tensor")
def _():
    expect(ValueError, lambda: lower(SizeAcrossCut(), gp.Strategy(pp=2), 2, tracer="fx"),
           r"size \(a non-tensor value such as an int read off a shape, from a\) crosses a pipeline cut but is not a single tensor", "Fix: move the cut")


@case("E-schedule-arg")
def _():
    expect(ValueError, lambda: build_schedule("1f1b", 0, 2), "pp=0 is invalid", ">= 1")


@case("E-schedule-name")
def _():
    expect(ValueError, lambda: build_schedule("1f1c", 2, 2), "schedule='1f1c' is invalid", "unknown schedule",
           "Fix:.*'1f1b'")


@case("E-schedule-combination")
def _():
    expect(ValueError, lambda: build_schedule("interleaved-1f1b", 2, 4, 1),
           "schedule='interleaved-1f1b' with virtual_stages=1 is invalid", "Fix:")


@case("E-schedule-malformed")
def _():
    schedule = build_schedule("1f1b", 2, 2)
    broken = [schedule[0], [i for i in schedule[1] if i.op != "step"]]
    expect(ScheduleError, lambda: check_schedule(broken, 2, 2), "rank 1: 'step' must appear exactly once")


@case("E-balance-args")
def _():
    expect(ValueError, lambda: balance([1, 2], 3), "balance needs 1 <= stages <= len\\(weights\\)", "stages=3")
    expect(ValueError, lambda: balance([1, -2], 1), "weight 1 is -2", "non-negative")


# ---- pass pipeline -------------------------------------------------------------------------
def compile_with_pass(fn):
    return gp.compile(mlp(), gp.Strategy(passes=(make_pass(fn, name="under_test", after="trace"),)), (x4(),))


@case("E-pass-duplicate")
def _():
    expect(ValueError, lambda: register_pass(name="trace")(identity_pass), r"register_pass\(name='trace'\)",
           "already in the pipeline", "Fix:")


@case("E-pass-unregister")
def _():
    expect(ValueError, lambda: unregister_pass("no_such_pass"), r"unregister_pass\('no_such_pass'\)",
           "no registered user pass", "Fix:")


@case("E-pass-both-anchors")
def _():
    expect(ValueError, lambda: make_pass(identity_pass, name="p", after="trace", before="split_stages"),
           "pass 'p': give after= or before=, not both", "Fix: keep one anchor")


@case("E-pass-not-callable")
def _():
    expect(TypeError, lambda: make_pass(3, name="p"), r"a pass must be callable fn\(gm, ctx\) -> gm, got 3", "Fix:")


@case("E-pass-before-trace")
def _():
    strategy = gp.Strategy(passes=(make_pass(identity_pass, name="p", before="trace"),))
    expect(ValueError, lambda: gp.list_passes(strategy), "pass 'p' is anchored before='trace'", "Fix:.*after='trace'")


@case("E-pass-unknown-anchor")
def _():
    strategy = gp.Strategy(passes=(make_pass(identity_pass, name="p", after="trcae"),))
    expect(ValueError, lambda: gp.list_passes(strategy), "pass 'p' is anchored after='trcae', which is not in the "
           "pipeline", "Fix:")


@case("E-pass-requires")
def _():
    strategy = gp.Strategy(passes=(make_pass(identity_pass, name="p", after="trace", requires=("stage_plan",)),))
    expect(ValueError, lambda: gp.list_passes(strategy), r"pass 'p' requires ctx.results.stage_plan",
           "'partition_stages' produces", "Fix: anchor 'p' after='partition_stages'")


@case("E-pass-declares")
def _():
    expect(ValueError, lambda: make_pass(identity_pass, name="p", produces=("tp_plans",)),
           "pass 'p': produces names 'tp_plans', which is neither a result field", "Fix:.*'tp_plan'")


@case("E-pass-result-missing")
def _():
    expect(KeyError, lambda: mse_pm().compiled.extra(Gate), "no pass left a result of type Gate", "Fix:")


@case("E-pass-import")
def _():
    expect(ValueError, lambda: gp.compile(mlp(), gp.Strategy(passes=("tests.no_such_module:fn",)), (x4(),)),
           "entry 'tests.no_such_module:fn' could not be imported", "Fix:")


@case("E-pass-return-type")
def _():
    expect(TypeError, lambda: compile_with_pass(lambda gm, ctx: None), "pass 'under_test' returned NoneType",
           "Fix:")


def _first_op(gm):
    return next(n for n in gm.graph.nodes if n.op == "call_function")


def _use_before_definition(gm, ctx):
    last = [n for n in gm.graph.nodes if n.op == "call_function"][-1]
    with gm.graph.inserting_before(_first_op(gm)):
        node = gm.graph.call_function(torch.neg, (last,))
    node.meta["graphpar"] = record(last)
    return gm


@case("E-graph-lint")
def _():
    expect(GraphValidationError, lambda: compile_with_pass(_use_before_definition),
           "after pass 'under_test': the graph fails torch.fx lint: Argument 'linear_1' of Node 'neg' was used before "
           "it has been defined", "Fix:")


def _untupled_output(gm, ctx):
    output = next(n for n in gm.graph.nodes if n.op == "output")
    output.args = (output.args[0][0],)
    return gm


@case("E-graph-output")
def _():
    expect(GraphValidationError, lambda: compile_with_pass(_untupled_output),
           "after pass 'under_test': the graph must end in one output returning a flat tuple", "Fix:")


def _no_record(gm, ctx):
    first = _first_op(gm)
    with gm.graph.inserting_after(first):
        gm.graph.call_function(torch.neg, (first,))
    return gm


@case("E-graph-no-record")
def _():
    expect(GraphValidationError, lambda: compile_with_pass(_no_record),
           r"after pass 'under_test': node 'neg' \(call_function neg\) has no graphpar record", "Fix:.*copy_record")


def _bad_stage(gm, ctx):
    first = _first_op(gm)
    first.meta["graphpar"] = record(first).replace("under_test", stage=-1)
    return gm


@case("E-graph-record-field")
def _():
    expect(GraphValidationError, lambda: compile_with_pass(_bad_stage), "has stage -1", "Fix:")


def _update_placement_on_an_op(gm, ctx):
    stamp(_first_op(gm), "under_test", update_placement="host")
    return gm


@case("E-graph-update-field")
def _():
    expect(GraphValidationError, lambda: compile_with_pass(_update_placement_on_an_op),
           r"after pass 'under_test': node .*has update_placement 'host' but is not the get_attr of a trainable "
           r"parameter", "Fix:")


def _step_without_bucket(gm, ctx):
    stamp(next(iter(ctx.results.update.graph.nodes)), "under_test", bucket=None)
    return gm


@case("E-graph-update-program")
def _():
    strategy = gp.Strategy(offload_optimizer=True,
                           passes=(make_pass(_step_without_bucket, name="under_test", after="build_update"),))
    expect(GraphValidationError, lambda: lower_rank(mlp(), strategy, (x4(),), rank=0, world_size=1),
           r"after pass 'under_test': node 'grads_0' \(call_module grads_0\) is a step with no bucket", "Fix:")


def _missing_attr(gm, ctx):
    first = _first_op(gm)
    with gm.graph.inserting_before(first):
        node = gm.graph.create_node("get_attr", "no_such_weight")
    node.meta["graphpar"] = record(first)
    return gm


@case("E-graph-missing-attr")
def _():
    expect(GraphValidationError, lambda: compile_with_pass(_missing_attr), "the graph fails torch.fx lint: "
           "Node no_such_weight target no_such_weight references nonexistent attribute", "Fix:.*get_attr target")


@case("E-ir-no-record")
def _():
    graph = torch.fx.Graph()
    node = graph.placeholder("x")
    expect(KeyError, lambda: record(node), "node 'x' \\(placeholder x\\) has no graphpar record", "Fix:.*copy_record")


@case("E-ir-not-tensor")
def _():
    gm = lower(WithSize(), gp.Strategy(), 1, tracer="fx").gm
    size = next(n for n in gm.graph.nodes if n.op in ("call_method", "call_function") and "size" in str(n.target))
    expect(TypeError, lambda: tensor_meta(size), f"node '{size.name}' is not a single tensor value: a non-tensor value such as an int",
           r"Fix: read record\(node\)\.value")


def raising_pass(gm, ctx):
    raise KeyError("no such node")


@case("E-pass-raised")
def _():
    from graphpar.passes.manager import UserPassError
    message = expect_untouched(UserPassError, lambda m: gp.compile(m, gp.Strategy(passes=(raising_pass,)), (x4(),)),
                               r"user pass 'raising_pass' \(tests\.test_error_catalogue\.raising_pass\) raised "
                               r"KeyError: 'no such node'", r"Fix: correct the pass.*unregister_pass\('raising_pass'\)")
    assert "leaf_modules" not in message


# ---- running -------------------------------------------------------------------------------
@case("E-run-lazy-target")
def _():
    pm = gp.compile(mlp(), gp.Strategy(), (x4(),), loss_fn=F.mse_loss)
    expect(ValueError, lambda: pm.train_step(x4()), r"train_step\(x\) needs target=\.\.\. because compile was given "
           "a loss_fn", r"Fix:|target=")


@case("E-run-lazy-layout")
def _(messages):
    for message in messages:
        assert re.search(r"compile had no example_target.*the parameter '0\.weight' would change layout "
                         r"\(tensor parallelism cuts it as replicated instead of Shard", message), message
        assert "Fix: pass example_target=" in message, message


@case("E-collective-shape")
def _(messages):
    for message in messages:  # every rank raises the same error, naming the tensor and the ranks
        assert re.search(r"full_state_dict: tensor '2\.weight' does not have one full shape on every rank.*"
                         r"\[2, 8\] on rank 0.*\[3, 8\] on rank 1", message), message
        assert "Fix: compile the same model with the same Strategy on every rank" in message, message


@case("E-run-needs-target")
def _():
    pm = mse_pm()
    expect(ValueError, lambda: pm.train_step(x4()), r"needs target=\.\.\.: the model was compiled with a loss_fn",
           r"Fix: pm\.train_step\(x, target=y\)")


@case("E-run-no-loss")
def _():
    pm = gp.compile(mlp(), gp.Strategy(), (x4(),))
    expect(ValueError, lambda: pm.train_step(x4()), "train_step needs a loss", "Fix:.*loss_fn=")


@case("E-run-structure")
def _():
    pm = mse_pm()
    expect(ValueError, lambda: pm.train_step((x4(),), target=torch.randn(4, 2)),
           "train_step inputs have structure", "Fix: pass inputs shaped like example_inputs")


@case("E-run-batch-dims")
def _():
    pm = gp.compile(TwoInputs(), gp.Strategy(), (x4(), x4()), loss_fn=F.mse_loss, example_target=torch.randn(4, 2))
    expect(ValueError, lambda: pm.train_step(x4(4), x4(2), target=torch.randn(4, 2)),
           r"train_step: every tensor input must share its first \(batch\) dimension", "Fix:")


@case("E-run-shape")
def _(messages):
    for message in messages:  # pp=2: checked before any stage runs, on every rank
        assert re.search(r"input 0 has shape \[4, 5\].*batches of shape \[4, 4\].*Fix:", message), message
    pm = mse_pm()
    expect(ValueError, lambda: pm.train_step(torch.randn(4, 5), target=torch.randn(4, 2)),
           r"input 0 has shape \[4, 5\].*compiled for torch.float32 batches of shape \[4, 4\]",
           "Fix: pass this DP rank's batch")
    expect(ValueError, lambda: pm.train_step(x4(), target=torch.randn(4, 3)), r"target has shape \[4, 3\]", "Fix:")


@case("E-run-dtype")
def _():
    pm = mse_pm()
    expect(ValueError, lambda: pm.train_step(x4().double(), target=torch.randn(4, 2)),
           r"input 0 has shape \[4, 4\] and dtype torch.float64.*compiled for torch.float32", "the dtype differs",
           r"Fix: convert the batch, e\.g\. x\.to\(torch\.float32\)")


@pytest.fixture(scope="module")
def two_rank_messages():
    return launch(targets.messages_on_two_ranks, world_size=2)


@case("E-run-global-batch")
def _(messages):
    for message in messages:
        assert re.search(r"input 0 has shape \[8, 4\].*8 samples is the global batch \(dp=2 x 4\)", message), message
        assert re.search(r"Fix: pass the local batch of 4 samples, e\.g\. x\.chunk\(2\)\[pm\.mesh\.dp_rank\]",
                         message), message


@case("E-run-local-batch")
def _(messages):
    for message in messages:
        assert re.search(r"compiled for 8 = dp=2 x 4 samples, so compile was given the global batch", message), message
        assert re.search(r"Fix: compile with this DP rank's batch of 4 samples", message), message


@case("E-eval-microbatch-split")
def _():
    pm = mse_pm(4, microbatches=2)
    expect(ValueError, lambda: pm(x4(3)), r"pm\(x\): the batch of 3 does not split into the compiled microbatch size 2",
           "Fix: pass a multiple of 2 samples")


@case("E-eval-scalar-output")
def _():
    pm = gp.compile(ScalarOut(), gp.Strategy(microbatches=2), (x4(),))
    expect(ValueError, lambda: pm(x4()), "output with no batch dimension cannot be evaluated in several microbatches",
           "Fix:")


@case("E-run-meta-weights")
def _():
    with torch.device("meta"):
        model = mlp()
    pm = gp.compile(model, gp.Strategy(), (x4(),), loss_fn=F.mse_loss, example_target=torch.randn(4, 2))
    expect(RuntimeError, lambda: pm.train_step(x4(), target=torch.randn(4, 2)), "compiled on the meta device",
           "so train_step would read uninitialised memory", r"Fix: pm\.load_full_state_dict")
    expect(RuntimeError, pm.full_state_dict, r"so full_state_dict\(\) would read uninitialised memory",
           r"Fix: pm\.load_full_state_dict\(state_dict\) or pm\.load_checkpoint\(path\) first")


@case("E-run-concurrent")
def _():
    pm = mse_pm()
    x, y = x4(), torch.randn(4, 2)
    with eager_targets.train_step_held(pm, x, y):
        expect(RuntimeError, lambda: pm.train_step(x, target=y),
               r"train_step was called on thread 'MainThread' while train_step is running on thread 'first'",
               r"one train_step or pm\(x\) at a time", "Fix: call it from one thread")


@case("E-run-step-mismatch")
def _(messages):
    for message in messages:
        assert "ranks are out of step: rank(s) [1] at train_step 2; rank(s) [0] at train_step 3" in message, message
        assert "Fix: when train_step raises on a rank, stop every rank" in message, message


@case("E-load-keys")
def _():
    pm = mse_pm()
    other = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2), nn.Linear(2, 2)).state_dict()
    expect(ValueError, lambda: pm.load_full_state_dict(other), "the state dict does not match the compiled model",
           r"missing 0 keys; unexpected 2: 3\.bias, 3\.weight", "Fix:")


@case("E-load-shape")
def _():
    pm = mse_pm()
    other = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2)).state_dict()
    expect(ValueError, lambda: pm.load_full_state_dict(other), r"'0\.weight' has shape \[6, 4\], the model expects "
           r"\[8, 4\]", "Fix: load a checkpoint of this model")


@case("E-pipeline-until")
def _():
    expect(ValueError, lambda: lower(mlp(), gp.Strategy(), 1, until="tarce"), r"run_pipeline\(until='tarce'\): "
           "no such pass", "'trace'")


@case("E-plan-profile")
def _():
    expect(ValueError, lambda: gp.plan(mlp(), gp.Strategy(pp=2, partition="profile"), (x4(),), world_size=2),
           "graphpar.plan runs nothing, so partition='profile'", "Fix:.*'parameters'")


@case("E-run-target-positional")
def _():
    pm = mse_pm()
    weights = [p.clone() for p in pm.parameters()]
    expect(ValueError, lambda: pm.train_step(x4(), torch.randn(4, 2)),
           "train_step got 2 positional arguments, but the model takes 1; the last looks like the target",
           r"Fix: pm\.train_step\(x, target=y\)")
    assert all(torch.equal(a, b) for a, b in zip(weights, pm.parameters()))


@case("E-run-no-grad")
def _():
    pm = gp.compile(mlp(), gp.Strategy(), (x4(),), loss_fn=F.mse_loss, example_target=torch.randn(4, 2),
                    optimizer=SGD)
    weights = [p.clone() for p in pm.parameters()]
    for mode in (torch.no_grad, torch.inference_mode):
        with mode():
            expect(RuntimeError, lambda: pm.train_step(x4(), target=torch.randn(4, 2)),
                   r"train_step was called with gradients disabled \(inside torch.no_grad\(\)",
                   "Fix: call train_step outside that block")
    assert all(torch.equal(a, b) for a, b in zip(weights, pm.parameters()))


# ---- data helpers --------------------------------------------------------------------------
def _pairs(n):
    return [(torch.ones(1), torch.ones(1))] * n


@case("E-data-int-arg")
def _():
    expect(ValueError, lambda: data.shard_indices(8, 2, 0, 0), "batch_size=0 is invalid", "int >= 1", "Fix:")


@case("E-data-dp-rank")
def _():
    expect(ValueError, lambda: data.shard_indices(8, 2, 2, 2), r"dp_rank=2 is invalid: .*\[0, 2\) for dp=2",
           "Fix:.*pm.mesh.dp_rank")


@case("E-data-remainder")
def _():
    expect(ValueError, lambda: data.shard_indices(8, 2, 0, 2, remainder="keep"), "remainder='keep' is invalid",
           "Fix:")


@case("E-data-too-short")
def _():
    expect(ValueError, lambda: data.shard_indices(3, 2, 0, 2), "a dataset of 3 samples is shorter than one global "
           "batch of dp \\* batch_size = 2 \\* 2 = 4", "Fix: use batch_size <= 1")


@case("E-data-iterable")
def _():
    expect(TypeError, lambda: data.DistributedBatches(iter(_pairs(4)), 2, dp=1, dp_rank=0),
           "must be map-style", "Fix:")


@case("E-data-mesh-contradiction")
def _():
    from graphpar.distributed.mesh import Mesh
    expect(ValueError, lambda: data.DistributedBatches(_pairs(4), 2, Mesh(1, 1, 1, 0), dp=2),
           "dp=2 contradicts the mesh, where dp is 1", "Fix:")


@case("E-data-dp-pair")
def _():
    expect(ValueError, lambda: data.DistributedBatches(_pairs(4), 2, dp=2), "dp=2 and dp_rank=None: pass both or "
           "neither", "Fix:")


@case("E-data-no-group")
def _():
    expect(ValueError, lambda: data.evaluate_exact(nn.Identity(), _pairs(4), 2, targets._rows, dp=2, dp_rank=0),
           "dp=2 but torch.distributed is not initialised", "Fix:")


@case("E-data-group-contradiction")
def _(messages):
    for message in messages:
        assert "dp=4, dp_rank=None contradict the process group, which has 2 ranks" in message, message
        assert "Fix: pass the dp group" in message, message


@case("E-data-empty")
def _():
    expect(ValueError, lambda: data.evaluate_exact(nn.Identity(), [], 2, targets._rows),
           "evaluate_exact: the dataset is empty", "Fix:")


@case("E-data-length-differs")
def _(messages):
    for rank, message in enumerate(messages):
        assert f"the ranks' datasets differ in length (from 4 to 5 samples; this rank has {4 + rank})" in message
        assert "Fix: give every rank the whole dataset" in message


@case("E-data-sample-form")
def _():
    expect(ValueError, lambda: data.evaluate_exact(nn.Identity(), [torch.ones(1)] * 4, 2, targets._rows),
           "samples must be \\(input, target\\) pairs, got a collated Tensor", "Fix:")


@case("E-data-metric-shape")
def _():
    expect(ValueError, lambda: data.evaluate_exact(nn.Identity(), _pairs(4), 2, lambda o, t: (o - t).abs().mean()),
           r"metric_sum_fn returned shape \[\], but evaluate_exact needs one row per sample \(2 rows\)",
           "Fix:.*reduction='none'")


# ---- launch --------------------------------------------------------------------------------
@case("E-launch-world-size")
def _():
    expect(ValueError, lambda: launch(launch_targets.echo_args, world_size=0), "world_size must be an int >= 1, got 0")


@case("E-launch-timeout")
def _():
    expect(ValueError, lambda: launch(launch_targets.echo_args, world_size=1, timeout=-1),
           r"timeout must be a positive.* number of seconds, got -1")


@case("E-launch-fn-type")
def _():
    expect(TypeError, lambda: launch(3, world_size=1), "fn must be callable, got 3")


@case("E-launch-interactive")
def _(monkeypatch):
    def interactive():
        return 0
    interactive.__module__ = "__main__"
    interactive.__qualname__ = "interactive"
    monkeypatch.delattr(importlib.import_module("__main__"), "__file__", raising=False)
    expect(ValueError, lambda: launch(interactive, world_size=1), "fn 'interactive' was defined interactively",
           "module level in a .py file")


@case("E-launch-pickle-fn")
def _():
    expect(ValueError, lambda: launch(lambda: 0, world_size=1), "cannot be pickled", "module level")


@case("E-launch-pickle-args")
def _():
    expect(ValueError, lambda: launch(targets.take, world_size=1, args=(threading.Lock(),)),
           "args for 'take' cannot be pickled", "Fix: pass picklable arguments")


@case("E-launch-env")
def _():
    expect(ValueError, lambda: launch(targets.take, world_size=1, args=(1,), env={"A": 1}),
           r"env must map str to str, got \{'A': 1\}")


@case("E-launch-rank-failed")
def _():
    error = expect(LaunchError, lambda: launch(launch_targets.raise_on_rank1_while_peer_waits, world_size=2,
                                               timeout=60),
                   "rank 1 failed: ValueError: boom on rank 1", "Traceback")
    assert error.count("explode_on_rank1") >= 1


@case("E-launch-rank-died")
def _():
    expect(LaunchError, lambda: launch(launch_targets.exit_abruptly_on_rank1, world_size=2, args=("exit",),
                                       timeout=60),
           "rank 1 failed: process exited with code 7")


@case("E-launch-hang")
def _(monkeypatch):
    monkeypatch.setattr(launch_module, "DEADLINE_GRACE_S", 1.0)
    expect(LaunchError, lambda: launch(launch_targets.rank1_never_finishes, world_size=2, timeout=1),
           r"ranks \[1\] did not finish within 2 s: probably blocked in a collective")


@case("E-launch-unpickle")
def _():
    expect(LaunchError, lambda: launch(targets.take, world_size=1, args=(targets.Unpicklable(),)),
           "rank 0 could not unpickle fn/args", "refuses to be unpickled", "importable in a fresh interpreter")


@case("E-launch-return-pickle")
def _():
    expect(LaunchError, lambda: launch(targets.return_a_lock, world_size=1),
           "the return value of 'return_a_lock' on rank 0 cannot be pickled back to the parent")


@case("E-launch-timeout-env")
def _(monkeypatch):
    monkeypatch.setenv("GRAPHPAR_TIMEOUT_S", "soon")
    expect(ValueError, distributed_module._timeout_from_env, "GRAPHPAR_TIMEOUT_S='soon' is not a positive number",
           "Fix:")
    for out_of_range in ("1e30", "0.0001"):  # gloo overflows, or rounds to no timeout at all
        monkeypatch.setenv("GRAPHPAR_TIMEOUT_S", out_of_range)
        expect(ValueError, distributed_module._timeout_from_env, f"GRAPHPAR_TIMEOUT_S='{out_of_range}' is not a "
               "positive number of seconds between 0.001 and 1e\\+09", "Fix: set it to e.g. GRAPHPAR_TIMEOUT_S=120")


@case("E-launch-no-env")
def _(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    expect(RuntimeError, launch_module.init_process_group_from_env,
           "cannot initialise torch.distributed: environment variables .* are not set", "torchrun|launch")


# ---- command line --------------------------------------------------------------------------
def cli(capsys, *argv):
    from graphpar.tools.cli import main
    try:
        code = main(list(argv))
    except SystemExit as exit_:
        code = exit_.code
    return code, capsys.readouterr().err


@case("E-cli-user-error")
def _(capsys):
    code, err = cli(capsys, "plan", "--tp", "3", "--layers", "1")
    assert code == 1
    assert err.startswith("graphpar plan: error: tp=3 does not divide") and "Fix:" in err
    assert "Traceback" not in err


@case("E-cli-n-embd")
def _(capsys):
    code, err = cli(capsys, "plan", "--n-embd", "30")
    assert code == 2 and "--n-embd 30 must be a multiple of the 4 attention heads; try --n-embd 32" in err


@case("E-cli-batch-dp")
def _(capsys):
    code, err = cli(capsys, "plan", "--batch-size", "5", "--dp", "2")
    assert code == 2 and "--batch-size 5 must split evenly over --dp 2 ranks; try --batch-size 6" in err


@case("E-cli-model-spec")
def _(capsys, tmp_path):
    code, err = cli(capsys, "dump", "nocolon", "--out", str(tmp_path))
    assert code == 1 and "MODEL_SPEC 'nocolon' is neither 'gpt' nor 'module.path:factory'" in err and "Fix:" in err
    code, err = cli(capsys, "dump", "tests.no_such_module:factory", "--out", str(tmp_path))
    assert code == 1 and "could not be imported" in err


# ---- the catalogue and the tests correspond one to one ---------------------------------------
def doc_ids():
    """(ids of every table row in the sections this file covers, rows there without an id)."""
    ids, missing, section = [], [], ""
    for line in DOC.read_text().splitlines():
        if line.startswith("## "):
            section = line[3:]
        if not line.startswith("| ") or line.startswith("| id ") or any(s in section for s in OTHERS_SECTIONS):
            continue
        match = re.match(r"\| `(E-[a-z0-9-]+)` \|", line)
        if match:
            ids.append(match.group(1))
        elif not line.startswith("| message start"):
            missing.append(line[:80])
    return ids, missing


def test_every_catalogue_row_has_an_id_and_ids_are_unique():
    ids, missing = doc_ids()
    assert not missing, f"rows of docs/errors.md without an id: {missing}"
    assert len(ids) == len(set(ids)), sorted(i for i in ids if ids.count(i) > 1)


def test_catalogue_and_tests_name_the_same_entries():
    ids = set(doc_ids()[0])
    assert not ids - set(CASES), f"catalogue entries with no test: {sorted(ids - set(CASES))}"
    assert not set(CASES) - ids, f"tests of entries missing from docs/errors.md: {sorted(set(CASES) - ids)}"


@pytest.mark.parametrize("entry", sorted(CASES))
def test_entry(entry, request):
    fn = CASES[entry]
    names = fn.__code__.co_varnames[:fn.__code__.co_argcount]
    fixtures = {"messages": lambda: [m[entry] for m in request.getfixturevalue("two_rank_messages")]}
    fn(*[fixtures[name]() if name in fixtures else request.getfixturevalue(name) for name in names])
