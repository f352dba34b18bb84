"""graphpar behaves as eager PyTorch does, or refuses clearly (issue #14): parameters that
get no gradient are not stepped, the fx front end keeps buffer updates and hooks (or hands
over to export), compile leaves the user's model alone, each module's training flag is
followed, one train_step runs at a time, and ranks out of step are named."""
import copy
import pytest
import torch
import torch.nn as nn

import graphpar as gp
from graphpar.passes.tracing import TraceError
from tests.targets import eager_targets
from tests.targets.eager_targets import mse


# Every comparison below is one process against eager on the same batches: the same ops in
# the same order give the same float32 results up to summation order inside kernels (and
# dp's split of the batch), i.e. rounding noise; parameters: the AdamW bound explained in
# tests/helpers.adamw (1e-4). A parameter that must not move is compared exactly.
LOSS_TOL = 1e-5
PARAM_TOL = 1e-4


def eager_training(model, data):
    """Eager AdamW (eager_targets.optimizer) on `data`, the model's own training flags kept."""
    model = copy.deepcopy(model)
    opt = eager_targets.optimizer(model.parameters())
    losses = []
    for x, y in data:
        opt.zero_grad(set_to_none=True)
        loss = mse(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return model, losses


def assert_matches(state, losses, reference, ref_losses):
    assert losses == pytest.approx(ref_losses, abs=LOSS_TOL)
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(state[key], value, atol=PARAM_TOL, rtol=0, msg=key)


# ---- item 2: parameters that get no gradient are not stepped -----------------------------------
def _check_partly_used(state, losses):
    model = eager_targets.partly_used()
    reference, ref_losses = eager_training(model, eager_targets.batches())
    assert_matches(state, losses, reference, ref_losses)
    for name in ("side", "frozen", "unused"):  # not stepped at all: bit-identical
        for key in ("weight", "bias"):
            assert torch.equal(state[f"{name}.{key}"], model.state_dict()[f"{name}.{key}"]), f"{name}.{key}"


@pytest.mark.parametrize("strategy", [{"offload_optimizer": True}])
def test_parameters_without_gradient_are_not_stepped(strategy):
    data = eager_targets.batches()
    pm = gp.compile(eager_targets.partly_used(), gp.Strategy(**strategy), (data[0][0],), loss_fn=mse,
                    example_target=data[0][1], optimizer=eager_targets.optimizer)
    losses = [pm.train_step(x, target=y) for x, y in data]
    _check_partly_used(pm.full_state_dict(), losses)


# ---- item 3: buffer updates, hooks, and the user's model left alone -----------------------------
class Counting(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 2)
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        self.steps.add_(1)
        return self.fc(x) * self.steps


def test_in_place_buffer_update_runs_every_step():
    tracer = "fx"  # torch.export already did: test_compile_and_training_leave_the_model_identical
    torch.manual_seed(0)
    model = Counting()
    data = eager_targets.batches()
    pm = gp.compile(model, gp.Strategy(), (data[0][0],), loss_fn=mse, example_target=data[0][1],
                    optimizer=eager_targets.optimizer, tracer=tracer)
    assert model.steps.item() == 0  # compile never runs the user's model for real
    losses = [pm.train_step(x, target=y) for x, y in data]
    reference, ref_losses = eager_training(model, data)
    assert_matches(pm.full_state_dict(), losses, reference, ref_losses)


class Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(4, 8), nn.ReLU())
        self.out = nn.Linear(8, 2)

    def forward(self, x):
        return self.out(self.inner(x))


HOOKS = {
    "leaf forward": lambda m: m.out.register_forward_hook(lambda mod, args, out: out * 2),
    "leaf pre": lambda m: m.inner[0].register_forward_pre_hook(lambda mod, args: (args[0] - 1,)),
    "inner forward": lambda m: m.inner.register_forward_hook(lambda mod, args, out: out + 1),
    "root pre": lambda m: m.register_forward_pre_hook(lambda mod, args: (args[0] * 3,)),
}


def test_forward_hooks_run_as_in_eager():
    """Hooks on leaves (which symbolic_trace would drop: export is used), on an inner module
    and on the root, all at once."""
    torch.manual_seed(0)
    model = Stack()
    for register in HOOKS.values():
        register(model)
    data = eager_targets.batches(steps=2)
    pm = gp.compile(model, gp.Strategy(), (data[0][0],), loss_fn=mse, example_target=data[0][1],
                    optimizer=eager_targets.optimizer)
    assert pm.front_end == "export"
    torch.testing.assert_close(pm(data[0][0]), model(data[0][0]), atol=1e-6, rtol=0)  # same ops, one process
    losses = [pm.train_step(x, target=y) for x, y in data]
    reference, ref_losses = eager_training(model, data)
    assert_matches(pm.full_state_dict(), losses, reference, ref_losses)


def test_fx_refuses_a_hooked_leaf():
    torch.manual_seed(0)
    model = Stack()
    HOOKS["leaf forward"](model)
    with pytest.raises(TraceError, match=r"drop the forward hooks of leaf module\(s\) \['out'\].*tracer='export'"):
        gp.compile(model, gp.Strategy(), (torch.randn(2, 4),), tracer="fx")


class Mixed(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 8)
        self.bn = nn.BatchNorm1d(8)
        self.drop = nn.Dropout(0.5)
        self.out = nn.Linear(8, 2)
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        self.steps.add_(1)
        return self.out(self.drop(self.bn(self.fc(x))))


def _snapshot(model):
    return ({k: v.clone() for k, v in model.state_dict().items()},
            {p: m.training for p, m in model.named_modules()},
            {p: (dict(m._forward_hooks), dict(m._forward_pre_hooks)) for p, m in model.named_modules()},
            {k: p.requires_grad for k, p in model.named_parameters()})


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_compile_and_training_leave_the_model_identical(tracer):
    torch.manual_seed(0)
    model = Mixed()
    model.bn.eval()  # frozen for fine-tuning: one module's flag differs from its parent's
    model.register_forward_hook(lambda mod, args, out: out)  # hooks are kept, not consumed
    before = _snapshot(model)
    data = eager_targets.batches(steps=2)
    pm = gp.compile(model, gp.Strategy(), (data[0][0],), loss_fn=mse, example_target=data[0][1],
                    optimizer=eager_targets.optimizer, tracer=tracer)
    for x, y in data:
        pm.train_step(x, target=y)
    pm(data[0][0])
    after = _snapshot(model)
    assert after[1:] == before[1:]
    for key, value in before[0].items():
        assert torch.equal(after[0][key], value), key


# ---- item 5: each module's training flag -------------------------------------------------------
def _bn_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Dropout(0.5), nn.ReLU(), nn.Linear(8, 2))


@pytest.mark.parametrize("tracer", ["fx", "export"])
@pytest.mark.parametrize("setting", ["model.eval()", "bn.eval()"])
def test_train_step_follows_each_module_training_flag(setting, tracer):
    model = _bn_model()
    model.eval() if setting == "model.eval()" else model[1].eval()
    if setting == "bn.eval()":
        model[2].p = 0.0  # dropout stays on: its masks come from graphpar's streams, not eager's
    data = eager_targets.batches()
    pm = gp.compile(model, gp.Strategy(), (data[0][0],), loss_fn=mse, example_target=data[0][1],
                    optimizer=eager_targets.optimizer, tracer=tracer)
    losses = [pm.train_step(x, target=y) for x, y in data]
    reference, ref_losses = eager_training(model, data)
    assert_matches(pm.full_state_dict(), losses, reference, ref_losses)
    assert torch.equal(pm.full_state_dict()["1.running_mean"], torch.zeros(8))  # frozen statistics


def test_pm_train_and_eval_set_every_module_flag():
    model = _bn_model()
    model[2].p = 0.0
    model[1].eval()
    data = eager_targets.batches(steps=4)
    pm = gp.compile(model, gp.Strategy(), (data[0][0],), loss_fn=mse, example_target=data[0][1],
                    optimizer=eager_targets.optimizer)
    reference = copy.deepcopy(model)
    opt = eager_targets.optimizer(reference.parameters())
    for i, (x, y) in enumerate(data):
        mode = i % 2 == 0
        assert pm.train(mode) is pm
        reference.train(mode)
        loss = pm.train_step(x, target=y)
        opt.zero_grad(set_to_none=True)
        expected = mse(reference(x), y)
        expected.backward()
        opt.step()
        assert loss == pytest.approx(expected.item(), abs=LOSS_TOL)
    assert pm.eval() is pm
    state = pm.full_state_dict()
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(state[key], value, atol=PARAM_TOL, rtol=0, msg=key)


# ---- item 7: one train_step at a time ----------------------------------------------------------
def test_a_second_thread_is_refused_while_train_step_runs():
    data = eager_targets.batches(steps=1)
    x, y = data[0]
    pm = gp.compile(_bn_model(), gp.Strategy(), (x,), loss_fn=mse, example_target=y,
                    optimizer=eager_targets.optimizer)
    with eager_targets.train_step_held(pm, x, y):
        with pytest.raises(RuntimeError, match=r"train_step was called on thread 'MainThread' while train_step "
                                               r"is running on thread 'first'.*one train_step or pm\(x\) at a time"):
            pm.train_step(x, target=y)
        with pytest.raises(RuntimeError, match=r"pm\(x\) was called"):
            pm(x)
    assert pm._steps == 1  # the refused call was not counted as a step
    pm.train_step(x, target=y)  # and the module works on afterwards


# ---- item 8: ranks out of step: E-run-step-mismatch in tests/errors/test_running_errors.py ---------
