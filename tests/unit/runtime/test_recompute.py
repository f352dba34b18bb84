"""Activation recomputation (Strategy.recompute) in a world of one, as ../shared/API.md writes
the path (compile without example_target): every mode trains bit for bit as without
recomputation, keeps what the plan says, and shows its choice in the dump."""
import copy
import dataclasses
import gc
import functools
import logging

import pytest
import torch
import torch.fx
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import graphpar as gp
from graphpar.runtime import ops, recompute as recompute_runtime
from tests import helpers

MODES = ("full", "selective", 0.5)
STEPS = 3
# The plan's activation figure is autograd's saved bytes on fake tensors of the same program:
# equal here, where one microbatch runs at a time; the issue allows 10%.
PLAN_TOL = 0.10


def gpt8():
    return helpers.tiny_gpt(n_layer=8, dropout=0.1)


def train(model, loss_fn, mode, x, y, steps=STEPS, **compile_options):
    """Losses, the gradients of the last step, the state after `steps`, the peak bytes autograd
    saved in the last step, and the compiled module."""
    pm = gp.compile(copy.deepcopy(model), gp.Strategy(recompute=mode), example_inputs=(x,), loss_fn=loss_fn,
                    optimizer=helpers.adamw(), **compile_options)
    losses = [pm.train_step(x, target=y) for _ in range(steps - 1)]
    peak = helpers.peak_saved_bytes(lambda: losses.append(pm.train_step(x, target=y)), pm.parameters())
    grads = {n: p.grad.clone() for n, p in pm.named_parameters()}
    return losses, grads, pm.full_state_dict(), peak, pm


def assert_same_training(got, base, what):
    assert got[0] == base[0], f"{what}: losses"
    for n in base[1]:
        torch.testing.assert_close(got[1][n], base[1][n], atol=0, rtol=0, msg=f"{what}: gradient of {n}")
    for n in base[2]:
        torch.testing.assert_close(got[2][n], base[2][n], atol=0, rtol=0, msg=f"{what}: {n}")


@pytest.fixture(scope="module")
def gpt_runs():
    model, (x, y) = gpt8(), helpers.token_batch(batch=4)
    return model, x, y, {mode: train(model, helpers.lm_loss, mode, x, y) for mode in (None,) + MODES}


@pytest.mark.parametrize("mode", MODES)
def test_gpt_with_dropout_trains_bit_for_bit_as_without(gpt_runs, mode):
    _, _, _, runs = gpt_runs
    assert_same_training(runs[mode], runs[None], f"recompute={mode!r}")


@pytest.mark.parametrize("mode", (None,) + MODES)
def test_saved_bytes_are_the_plans(gpt_runs, mode):
    model, x, y, runs = gpt_runs
    report = gp.plan(model, gp.Strategy(recompute=mode), example_inputs=(x,), loss_fn=helpers.lm_loss,
                     example_target=y, optimizer=helpers.adamw())
    planned = report.ranks[0].activation_peak_bytes
    assert abs(runs[mode][3] - planned) <= PLAN_TOL * planned, (runs[mode][3], planned)


def test_full_keeps_a_quarter_and_a_budget_its_fraction(gpt_runs):
    peaks = {mode: run[3] for mode, run in gpt_runs[3].items()}
    assert peaks["full"] <= peaks[None] / 4, peaks
    assert peaks[0.5] <= 0.5 * peaks[None], peaks
    assert peaks["full"] < peaks[0.5] < peaks["selective"] < peaks[None], peaks


def test_the_plan_reports_the_recompute_cost_and_the_choice(gpt_runs):
    model, x, y, _ = gpt_runs
    plans = {mode: gp.plan(model, gp.Strategy(recompute=mode), example_inputs=(x,), loss_fn=helpers.lm_loss,
                           example_target=y) for mode in (None, "full", "selective")}
    flops = {mode: rep.ranks[0].recompute_flops for mode, rep in plans.items()}
    assert flops[None] == 0 < flops["selective"] < flops["full"], flops
    assert any("recompute='full'" in note and "8 region(s)" in note for note in plans["full"].notes)


def test_evaluation_is_unchanged(gpt_runs):
    _, x, _, runs = gpt_runs
    with torch.no_grad():
        torch.testing.assert_close(runs["full"][4](x), runs[None][4](x), atol=0, rtol=0)


class _Draws(TorchDispatchMode):
    """Counts the random draws made at torch's dispatcher."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += recompute_runtime.draws(func, args, kwargs or {})
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("mode", MODES)
def test_the_backward_draws_no_dropout_mask_again(gpt_runs, mode):
    """Every mode keeps the blocks' dropout masks (and the attention's seed), so a step draws
    what the step without recomputation draws, no more; the plan says so."""
    model, x, y, runs = gpt_runs
    counts = {}
    for key in (None, mode):
        with _Draws() as draws:
            runs[key][4].train_step(x, target=y)
        counts[key] = draws.count
    assert counts[mode] == counts[None] > 0, counts
    report = gp.plan(model, gp.Strategy(recompute=mode), example_inputs=(x,), loss_fn=helpers.lm_loss)
    # 8 blocks: the attention's seed and its mask, the two residual dropouts
    assert any("its dropout masks (32 kept" in note for note in report.notes), report.notes


def test_a_draw_the_plan_did_not_see_is_refused_not_replayed_out_of_order():
    body = torch.fx.symbolic_trace(lambda x: x * torch.rand(x.shape) + torch.rand(x.shape))
    region = recompute_runtime.RecomputeRegion(body)
    with recompute_runtime.profiling() as found:
        region(torch.randn(3, requires_grad=True))
    first_draw = next(i.call for i in found[region] if recompute_runtime.draws(i.func, i.args, i.kwargs))
    region.saves, region.masks = frozenset({first_draw}), True
    with pytest.raises(RuntimeError, match=r"draws and was not seen when the region was planned.*Fix:"):
        region(torch.randn(3, requires_grad=True))


def test_transformers_llama_trains_bit_for_bit_as_without():
    model, (x, y) = helpers.hf_llama(n_layer=3, attention_dropout=0.1), helpers.token_batch(batch=4)
    base = train(model, helpers.hf_causal_lm_loss, None, x, y)
    for mode in MODES:
        got = train(model, helpers.hf_causal_lm_loss, mode, x, y)
        assert_same_training(got, base, f"LLaMA recompute={mode!r}")
        assert got[3] < base[3]


def test_the_dump_marks_what_backward_runs_again(tmp_path):
    model, (x, y) = helpers.tiny_gpt(dropout=0.1), helpers.token_batch(batch=4)
    gp.compile(model, gp.Strategy(recompute="selective"), example_inputs=(x,), example_target=y,
               loss_fn=helpers.lm_loss, dump=str(tmp_path))
    index = gp.list_passes().index("recompute")
    text = (tmp_path / "rank0" / f"{index:02d}_recompute.py").read_text()
    compile(text, "dump", "exec")
    assert "self.recompute_0(" in text and "def recompute_1(" in text
    assert "saved (addmm) blocks.0.attn.q [recompute]" in text
    assert "recomputed blocks.0.ln_1 [recompute]" in text


def test_a_budget_no_recompute_reaches_is_refused_before_training():
    model, (x, y) = helpers.tiny_gpt(), helpers.token_batch(batch=4)
    with pytest.raises(ValueError, match=r"recompute=0.01 cannot be met.*Fix: a budget of at least recompute=0\.\d+"):
        gp.compile(model, gp.Strategy(recompute=0.01), example_inputs=(x,), example_target=y, loss_fn=helpers.lm_loss)


class _NormBlock(nn.Module):
    """A block whose BatchNorm updates its running statistics: they must move once per step."""

    def __init__(self):
        super().__init__()
        self.fc, self.bn, self.out = nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 8)

    def forward(self, x):
        return x + self.out(torch.relu(self.bn(self.fc(x))))


def _three(block):
    """Three `block`s in a row with a batch for them and their MSE loss, seeded."""
    torch.manual_seed(0)
    return nn.Sequential(*[block() for _ in range(3)]), torch.randn(16, 8), torch.randn(16, 8), F.mse_loss


def test_state_updates_run_once_between_regions():
    model, x, y, loss_fn = _three(_NormBlock)
    base = train(model, loss_fn, None, x, y)
    got = train(model, loss_fn, "full", x, y)
    assert_same_training(got, base, "BatchNorm blocks")
    assert got[2]["0.bn.num_batches_tracked"] == STEPS
    regions = [m for gm in got[4].graph_modules for name, m in gm.named_children() if name.startswith("recompute_")]
    # per block the run after its BatchNorm (relu, out, add); the one before it is a lone linear,
    # too small to be a region; no region holds a BatchNorm
    assert len(regions) == 3
    assert all(n.target not in (ops.batch_norm, ops.count_batch) for r in regions for n in r.body.graph.nodes)


def test_a_model_without_blocks_trains_as_before_and_says_so(caplog):
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    with caplog.at_level(logging.WARNING, logger="graphpar"):
        pm = gp.compile(_Plain(), gp.Strategy(recompute="full"), example_inputs=(x,), loss_fn=torch.nn.functional.mse_loss)
    assert "no repeated blocks" in caplog.text
    assert pm.train_step(x, target=y) > 0


class _Plain(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return self.fc(x)


def test_verify_checks_a_recompute_strategy():
    model, (x, y) = helpers.tiny_gpt(), helpers.token_batch(batch=4)
    report = gp.verify(model, gp.Strategy(recompute="selective"), (x,), y, loss_fn=helpers.lm_loss,
                       optimizer=functools.partial(torch.optim.SGD, lr=1e-2))
    assert report.passed, report


# each family once, the modes alternating over them (both modes are tested on every family
# the GPT and LLaMA tests above cover; here what matters is each family's graph)
ARCH_MODES = {arch: ("full", "selective")[i % 2] for i, arch in enumerate(helpers.HF_ARCHITECTURES)}


@pytest.mark.parametrize("arch", ARCH_MODES)
def test_transformers_architectures_train_as_without_and_keep_less(arch):
    """Models graphpar did not write: each family's blocks recomputed."""
    model, mode = helpers.hf_model(arch), ARCH_MODES[arch]
    x, y = helpers.token_batch(batch=2)
    base = train(model, helpers.hf_causal_lm_loss, None, x, y, steps=2)
    got = train(model, helpers.hf_causal_lm_loss, mode, x, y, steps=2)
    assert_same_training(got, base, f"{arch} recompute={mode!r}")
    assert got[3] < base[3], (arch, mode, got[3], base[3])


def test_a_step_leaves_nothing_of_its_regions_behind():
    """The forward of a region that keeps calls builds a graph it never backpropagates: what that
    graph saved must go with it (a saved output holding its own node would never be freed)."""
    model, (x, y) = helpers.tiny_gpt(n_layer=2, dropout=0.1), helpers.token_batch(batch=4)
    pm = gp.compile(model, gp.Strategy(recompute="selective"), example_inputs=(x,), example_target=y,
                    loss_fn=helpers.lm_loss, optimizer=helpers.adamw())
    tracker, alive = helpers.LiveBytes(), []
    with tracker.tracking():
        for _ in range(4):
            pm.train_step(x, target=y)
            gc.collect()
            alive.append(tracker.reset_peak())
    assert alive[3] == alive[1], alive   # after the optimizer state exists, nothing grows


# ---- what the replay skips ---------------------------------------------------------------------

class _Matmuls(TorchDispatchMode):
    """Counts the matmuls computed at torch's dispatcher."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func.overloadpacket.__name__ in ("mm", "addmm", "bmm")
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("mode", MODES)
def test_the_replay_skips_the_calls_backward_reads_nothing_of(gpt_runs, mode):
    """In each block the MLP's output projection, its dropout and the residual add make only the
    block's output, whose value backward never reads: after the replay that watches them (the
    first of each block), the replay skips them, one matmul per block fewer."""
    model, x, y, runs = gpt_runs
    pm, counts = runs[mode][4], {}
    for replay in ("watched", "planned"):
        if replay == "watched":
            recompute_runtime._PLANS.clear()
        with _Matmuls() as matmuls:
            pm.train_step(x, target=y)
        counts[replay] = matmuls.count
    assert counts["watched"] - counts["planned"] == 8, counts   # 8 blocks, one MLP projection each
    report = gp.plan(model, gp.Strategy(recompute=mode), example_inputs=(x,), loss_fn=helpers.lm_loss,
                     example_target=y)
    assert any("32 call(s) skipped in the replay" in note for note in report.notes), report.notes


class _ReadBlock(nn.Module):
    """A block whose values past its last matmul are read again inside it: by a tanh (which saves
    its result), by a layer norm (which saves its input), by a scaled copy the block returns as
    well. Nothing of it may be skipped but the final add."""

    def __init__(self):
        super().__init__()
        self.fc, self.proj, self.norm = nn.Linear(8, 16), nn.Linear(16, 8), nn.LayerNorm(8)

    def forward(self, x):
        h = torch.tanh(self.proj(torch.relu(self.fc(x))) * 2)
        return x + self.norm(h)


def test_values_read_again_in_the_region_are_computed():
    model, x, y, loss_fn = _three(_ReadBlock)
    base = train(model, loss_fn, None, x, y)
    for mode in MODES:
        got = train(model, loss_fn, mode, x, y)
        assert_same_training(got, base, f"recompute={mode!r}")
        regions = [m for gm in got[4].graph_modules for name, m in gm.named_children() if name.startswith("recompute_")]
        assert len(regions) == 3
        for region in regions:
            (plan,) = recompute_runtime._PLANS[region].values()
            assert [str(plan.funcs[i]) for i in plan.zeros] == ["aten.add.Tensor"], (mode, plan)


def _region_and_inputs():
    """A region computing tanh(x @ w) @ w: the first matmul feeds the tanh, which saves its result."""
    body = torch.fx.symbolic_trace(lambda x, w: (torch.tanh(x @ w) @ w,))
    torch.manual_seed(0)
    return recompute_runtime.RecomputeRegion(body), torch.randn(4, 4, requires_grad=True), torch.randn(4, 4, requires_grad=True)


def _grads(region, x, w):
    x.grad = w.grad = None
    region(x, w)[0].sum().backward()
    return x.grad.clone(), w.grad.clone()


@pytest.mark.parametrize("wrongly_skipped", ("aten.mm.default", "aten.tanh.default"))
def test_a_replay_that_reads_a_skipped_value_computes_everything_again(wrongly_skipped):
    """The plan is checked as the replay runs: here one made to skip the first matmul (which the
    tanh reads) or the tanh (whose result autograd saves). The replay is refused, runs again
    computing everything, gradients exact, and the region is watched anew."""
    region, x, w = _region_and_inputs()
    expected = torch.autograd.grad(torch.tanh(x @ w).matmul(w).sum(), (x, w))
    assert all(torch.equal(a, b) for a, b in zip(_grads(region, x, w), expected))   # watched
    ((key, plan),) = recompute_runtime._PLANS[region].items()
    assert [str(plan.funcs[i]) for i in plan.zeros] == ["aten.mm.default"]           # the last one
    wrong = next(i for i, f in enumerate(plan.funcs) if str(f) == wrongly_skipped)
    recompute_runtime._PLANS[region][key] = dataclasses.replace(
        plan, zeros={**plan.zeros, wrong: next(iter(plan.zeros.values()))})
    assert all(torch.equal(a, b) for a, b in zip(_grads(region, x, w), expected))
    assert recompute_runtime._PLANS[region][key] == plan   # watched again: the right plan
