"""docs/errors.md, Tracing (passes/tracing/):
every entry triggered here and its message checked for the value it names, the rule
and the fix (tests/errors/test_catalogue.py checks that the doc and the cases agree)."""
from __future__ import annotations

import functools

import torch
import torch.nn as nn
import torch.nn.functional as F

import graphpar as gp
from graphpar.passes.tracing import TraceError
from tests.errors.catalogue import entry_test, expect, expect_untouched, registrar
from tests.errors.models import Branchy, compile_mse, mlp, mse_pm, x4


CASES = {}
case = registrar(CASES)


@case("E-trace-front-end-name")
def _():
    expect(ValueError, lambda: gp.compile(mlp(), gp.Strategy(), (x4(),), tracer="jit"),
           "tracer='jit' is not a front end", "Fix:")


@case("E-trace-untraceable")
def _():
    site = r"in module 'gate' at Gate\.forward .*errors/models\.py:\d+: if x\.sum\(\) > 0"
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
    expect_untouched(ValueError, lambda m: compile_mse(m, loss_fn=lambda out, y: (
        F.mse_loss(out, y, reduction="none"), torch.ones((), dtype=torch.int64))),
        r"returned \(loss_sum, count\) whose loss_sum is f32\[4, 2\]", "must be a floating scalar",
        r"Fix: .*reduction='sum'")


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
    message = expect_untouched(ValueError, lambda m: compile_mse(m, loss_fn=lambda out, y: (
        F.mse_loss(out, y, reduction="sum"), y.new_tensor(8.0), y.new_tensor(1.0))),
        "returned a tuple of 3 values; graphpar accepts a floating scalar tensor",
        r"or a pair \(loss_sum, count\)", r"Fix: return one tensor, .* or the pair \(loss_sum, count\)")
    trace_fix_absent(message)
    expect(ValueError, lambda: gp.compile(mlp(), gp.Strategy(), (x4(),), loss_fn=lambda out, y: [out.sum()],
                                          example_target=torch.randn(4, 2), tracer="export"),
           "returned a list of 1 values", "Fix:")


def _sum_and(count_of):
    """A token-weighted mse loss_fn whose count is count_of(output, target)."""
    return lambda out, y: (F.mse_loss(out, y, reduction="sum"), count_of(out, y))


@case("E-loss-count")
def _():
    rule = (r"the count must be a scalar tensor of an integer or floating dtype \(not bool\) that does not depend "
            r"on the parameters: graphpar divides the loss sum and the gradients by its total")
    for tracer in ("fx", "export"):  # a Python number: a constant under both front ends
        message = expect_untouched(ValueError, lambda m, tracer=tracer: compile_mse(
                                       m, loss_fn=_sum_and(lambda out, y: 8), tracer=tracer),
                                   r"returned \(loss_sum, count\) whose count is the constant 8", rule,
                                   r"Fix: count the real tokens as a tensor, e\.g\. \(target != ignore_index\)\.sum\(\)")
        trace_fix_absent(message)
    expect_untouched(ValueError, lambda m: compile_mse(m, loss_fn=_sum_and(lambda out, y: (y > 0).sum(dim=1))),
                     r"whose count is i64\[4\]", rule)
    expect_untouched(ValueError, lambda m: compile_mse(m, loss_fn=_sum_and(lambda out, y: (y > 0).any())),
                     r"whose count is b8\[\]", rule)
    expect_untouched(ValueError, lambda m: compile_mse(m, loss_fn=_sum_and(lambda out, y: out.abs().sum())),
                     r"whose count depends on the parameters \(it requires grad\)", rule,
                     r"Fix: detach it, e\.g\. count\.detach\(\)")


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


test_entry = entry_test(CASES)
