"""docs/errors.md, Running (graphpar/runtime/module.py, graphpar/runtime/single_stage.py):
every entry triggered here and its message checked for the value it names, the rule
and the fix (tests/errors/test_catalogue.py checks that the doc and the cases agree)."""
from __future__ import annotations

import re

import torch
import torch.nn as nn
import torch.nn.functional as F

import graphpar as gp
from tests.targets import catalogue_targets, eager_targets
from tests.errors.catalogue import entry_test, expect, registrar
from tests.errors.models import SGD, ScalarOut, TwoInputs, lower, mlp, mse_pm, x4


CASES = {}
case = registrar(CASES)


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
    for message in messages:  # pp=2: refused before any stage runs, on every rank
        assert re.search(r"train_step: a batch of a new shape \(microbatch inputs \[4, 5\], target \[4, 2\]\) "
                         r"needs a program of its own, and compiling the model for it failed \(TraceError: .*"
                         r"must have same reduction dim.*compiled so far are for \(inputs \[4, 4\], target "
                         r"\[4, 2\]\)\. Fix: pass batches the model accepts", message), message
    pm = mse_pm()
    expect(ValueError, lambda: pm(torch.randn(3, 5)), r"pm\(x\): a batch of a new shape \(microbatch inputs \[3, 5\]\)",
           "Only sizes the parameters do not fix may vary", "Fix:")


@case("E-run-dtype")
def _():
    pm = mse_pm()
    expect(ValueError, lambda: pm.train_step(x4().double(), target=torch.randn(4, 2)),
           r"input 0 has shape \[4, 4\] and dtype torch.float64.*compiled for torch.float32", "the dtype differs",
           r"Fix: convert the batch, e\.g\. x\.to\(torch\.float32\)")
    expect(ValueError, lambda: pm(x4(2).double()), r"input 0 has shape \[2, 4\] and dtype torch.float64")
    expect(ValueError, lambda: pm.train_step(x4(), target=torch.randn(4, 2).double()), r"target has shape \[4, 2\] "
           r"and dtype torch.float64")


@case("E-run-replica-shapes")
def _(messages):
    for rank, message in enumerate(messages):  # pp=2: both stages refuse the step before it runs
        assert re.search(r"train_step: the ranks of data-parallel replica 0 \(ranks \[0, 1\]: tp=1 x pp=2, which run "
                         r"one program together\) were given batches of different shapes: ranks \[0\] / \[1\] differ; "
                         rf"this rank \({rank}\) got inputs \[\[{4 + 4 * rank}, 4\]\], target \[\[{4 + 4 * rank}, 2\]\]",
                         message), message
        assert "Fix: give every rank of a replica the same batch shapes" in message, message


@case("E-run-shape-bound")
def _():
    pm = gp.compile(mlp(), gp.Strategy(), (x4(),), loss_fn=F.mse_loss, example_target=torch.randn(4, 2),
                    optimizer=SGD, max_shapes=2)
    pm.train_step(x4(2), target=torch.randn(2, 2))  # the second shape
    expect(ValueError, lambda: pm.train_step(x4(3), target=torch.randn(3, 2)),
           r"train_step: a batch of a new shape \(microbatch inputs \[3, 4\], target \[3, 2\]\) needs a program of "
           r"its own, but this ParallelModule already keeps max_shapes=2 program\(s\), one per microbatch shape seen: "
           r"\(inputs \[4, 4\], target \[4, 2\]\); \(inputs \[2, 4\], target \[2, 2\]\)",
           r"Fix: pad batches to a few fixed shapes.*max_shapes=3\) or more")
    pm.train_step(x4(2), target=torch.randn(2, 2))  # a shape seen runs on
    pm(x4(8))  # 2 microbatches of [4, 4]: no new program (past the bound one would be refused)
    expect(ValueError, lambda: pm(x4(3)), r"pm\(x\): a batch of a new shape \(microbatch inputs \[3, 4\]\)",
           "max_shapes=2")


@case("E-run-shape-layout")
def _(messages):
    for message in messages:
        assert re.search(r"pm\(x\): compiled for a new shape \(microbatch inputs \[2, 4\]\) without the loss, as "
                         r"pm\(x\) has no target, while train_step's programs have it; traced without the loss, the "
                         r"parameter '0\.weight' would change layout \(tensor parallelism cuts it as Shard", message), message
        assert "Fix: evaluate batches of a shape train_step has compiled" in message, message


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


@case("E-run-pipeline-pending")
def _(messages):
    for rank, message in enumerate(messages):   # rank r holds stage r; its mb 0 weight gradient was dropped
        assert (f"pipeline rank {rank}: the schedule ended with weight gradients of (stage, microbatch) [({rank}, 0)] "
                f"not run and 0 local messages not received") in message, message
        assert "Fix: check the schedule with graphpar.runtime.pipeline.check.check_schedule(" in message, message


@case("E-run-token-count")
def _(messages):
    rule = (r"loss_fn's counts sum to 0 over every microbatch and dp rank this step; graphpar divides the loss sum "
            r"and the gradients by that total, so it must be positive and finite")
    for message in messages:  # dp=2: every rank refuses the step together
        assert re.search(rule, message), message
        assert "Fix: skip such batches before train_step" in message, message
    for strategy in (gp.Strategy(microbatches=2), gp.Strategy(microbatches=2, offload_optimizer=True)):
        pm = catalogue_targets.token_weighted_mlp(strategy)
        weights = {k: v.clone() for k, v in pm.full_state_dict().items()}
        expect(ValueError, lambda pm=pm: pm.train_step(x4(), target=torch.zeros(4, 2)), rule)
        assert all(torch.equal(weights[k], v) for k, v in pm.full_state_dict().items())  # no step was taken
        assert not pm.optimizer.state
        target = torch.zeros(4, 2)
        target[3, 1] = 1.0  # one real token, in the second microbatch only: the step is taken
        pm.train_step(x4(), target=target)
        assert not all(torch.equal(weights[k], v) for k, v in pm.full_state_dict().items())
        assert pm.optimizer.state


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


@case("E-verify-batches")
def _():
    expect(TypeError, lambda: gp.verify(mlp(), gp.Strategy(), (x4(),), target=torch.randn(4, 2), loss_fn=F.mse_loss,
                                        batches=[((x4(),), torch.randn(4, 2)), (x4(2), torch.randn(2, 2))]),
           r"graphpar.verify\(batches=\.\.\.\): batches\[1\] holds inputs of type Tensor, but each batch is an "
           r"\(inputs, target\) pair", r"Fix: batches=\[\(\(x,\), y\), \.\.\.\]")


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


test_entry = entry_test(CASES)
