"""Host placement (issue 9): offloaded optimizer, low-precision compute weights with fp32
masters, host embeddings; checked against single-device training from the same weights, in
one process (the dp, tp and pp runs: tests/multiprocess/runtime/placement/test_placement.py)."""
import functools
import warnings

import pytest
import torch

import graphpar as gp
from graphpar.runtime.placement import update as update_module
from graphpar.runtime.placement.transfers import HOST
from tests.targets import placement_targets as targets
from tests.helpers import adamw, lm_loss, tiny_gpt, token_batch, train_reference


# The host step runs torch's fused AdamW kernel, the device step its foreach one: the same
# formula with other fused multiply-adds, so parameters differ by float32 rounding of one
# update (~1e-7 here) per step; 5 steps stay far below 1e-6, while a wrong or skipped update
# moves entries by O(lr) = 1e-2.
OFFLOAD_TOL = 1e-6
# Against single-device training: the data/tensor/pipeline parity tests' bound (AdamW on
# float32 rounding noise, see tests/helpers.adamw).
PARAM_TOL = 2e-4


def _max_diff(a, b):
    return max((a[k].float() - b[k].float()).abs().max().item() for k in b)


def test_bf16_with_fp32_masters_equals_mixed_precision_reference_on_one_rank():
    # One rank computes exactly what the eager bf16 model computes, and both masters take the
    # same fused AdamW step on the same fp32 gradients: equal up to the fused/foreach rounding.
    steps = 4
    x, y = token_batch(batch=8)
    losses, state = targets.mixed_precision({"param_dtype": "bf16", "offload_optimizer": True}, steps, "adamw")
    reference, ref_losses = targets.train_mixed_reference(tiny_gpt(), [(x, y)], lm_loss, adamw(), steps,
                                                          torch.bfloat16)
    assert losses == ref_losses
    assert _max_diff(state, reference.state_dict()) < OFFLOAD_TOL


def _compile(strategy, **options):
    x, y = token_batch(batch=8)
    return gp.compile(tiny_gpt(), strategy, example_inputs=(x,), example_target=y, loss_fn=lm_loss,
                      optimizer=adamw(), **options), x, y


def test_masters_and_states_live_on_the_host_and_device_weights_are_bf16():
    pm, x, y = _compile({"offload_optimizer": True, "param_dtype": torch.bfloat16}, bucket_bytes=4096)
    pm.train_step(x, target=y)
    device = {id(p) for p in pm.parameters()}
    assert all(p.dtype == torch.bfloat16 for p in pm.parameters())
    masters = [p for group in pm.optimizer.param_groups for p in group["params"]]
    assert len(masters) == len(list(pm.parameters()))
    for master in masters:
        assert master.device == HOST and master.dtype == torch.float32 and id(master) not in device
        state = pm.optimizer.state[master]
        assert {"exp_avg", "exp_avg_sq"} <= set(state)
        assert all(t.device == HOST and t.dtype == torch.float32 for t in state.values())


def test_update_program_shows_placement_and_transfers(tmp_path):
    pm, x, y = _compile({"offload_optimizer": True}, bucket_bytes=4096)
    program = pm._placed.program
    nodes = {n.name: n for n in program.graph.nodes}
    buckets = len(program.buckets)
    assert buckets > 1
    for k in range(buckets):
        assert nodes[f"update_{k}"].meta["graphpar"].placement == "host"
        assert nodes[f"grads_{k}"].meta["graphpar"].placement == "device"
        # lower_placement put one transfer each way around every host update
        assert nodes[f"update_{k}"].args[0].target.__name__ == "to_host"
        assert nodes[f"write_{k}"].args[0].target.__name__ == "to_device"
    pm.dump(str(tmp_path))
    code = "".join(p.read_text() for p in tmp_path.rglob("*update*.py"))
    assert "to_host" in code and "to_device" in code and "update_0" in code


def test_device_update_has_no_transfers():
    pm, x, y = _compile({"param_dtype": torch.bfloat16})
    targets_ = [getattr(n.target, "__name__", n.target) for n in pm._placed.program.graph.nodes]
    assert "to_host" not in targets_ and "to_device" not in targets_


def test_host_steps_start_during_backward(monkeypatch):
    """A bucket's host step is submitted before backward has produced every gradient."""
    events = []
    from graphpar.runtime.placement import runner
    submit = runner.UpdateRunner._submit
    monkeypatch.setattr(runner.UpdateRunner, "_submit", lambda self, k: (events.append(("step", k)), submit(self, k)))
    pm, x, y = _compile({"offload_optimizer": True}, bucket_bytes=4096)
    first = next(pm.parameters())  # the embedding: its gradient is the last one backward makes
    first.register_post_accumulate_grad_hook(lambda p: events.append(("last grad", None)))
    pm.train_step(x, target=y)
    assert events.index(("step", 0)) < events.index(("last grad", None))
    assert [e for e in events if e[0] == "step"] == [("step", k) for k in range(len(pm._placed.program.buckets))]


def test_missing_fused_kernel_warns_and_still_trains(monkeypatch):
    monkeypatch.setattr(update_module, "fused_adam_available", lambda: False)
    with pytest.warns(RuntimeWarning, match=r"no fused CPU Adam kernel.*slower.*Fix: use torch>=2.4"):
        pm, x, y = _compile({"offload_optimizer": True})
    for _ in range(3):
        pm.train_step(x, target=y)
    reference, _ = train_reference(tiny_gpt(), [(x, y)], lm_loss, adamw(), 3)
    assert _max_diff(pm.full_state_dict(), reference.state_dict()) < PARAM_TOL


def test_fused_kernel_is_used_when_available():
    assert update_module.fused_adam_available()  # torch 2.13 CPU has it: the check must say so
    pm, x, y = _compile({"offload_optimizer": True})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no slow-path warning
        pm.train_step(x, target=y)
    assert all(b.kernel is update_module.fused_adam_step for b in pm._placed.buckets)


def test_full_state_dict_round_trip_with_bf16_compute():
    pm, x, y = _compile({"offload_optimizer": True, "param_dtype": "bf16"})
    pm.train_step(x, target=y)
    state = pm.full_state_dict()
    assert all(v.dtype == torch.float32 for v in state.values())  # the masters, not bf16 copies
    fresh, _, _ = _compile({"offload_optimizer": True, "param_dtype": "bf16"})
    fresh.load_full_state_dict(state)
    assert _max_diff(fresh.full_state_dict(), state) == 0
    assert all(torch.equal(p, state[name].to(torch.bfloat16)) for name, p in fresh.named_parameters())


def test_host_tables_are_not_device_parameters():
    x, y = token_batch(batch=8)
    pm = gp.compile(tiny_gpt(tie_weights=False), {"offload_embedding": ["wte"]}, example_inputs=(x,),
                    example_target=y, loss_fn=lm_loss, optimizer=targets.sgd())
    names = dict(pm.named_parameters())
    assert "wte.weight" not in names and "wpe.weight" in names
    table = pm._placed.tables["wte.weight"].table
    assert table.device == HOST and table.grad is None
    pm.train_step(x, target=y)
    assert table.grad is None  # row gradients only, never a dense one


def test_offload_embedding_errors_name_the_module_and_the_fix():
    x, y = token_batch(batch=8)
    cases = [
        (tiny_gpt(), ["wte"], r"'wte', whose weight is tied .* Fix: untie"),
        (tiny_gpt(tie_weights=False), ["blocks"], r"'blocks', a ModuleList; only nn.Embedding"),
        (tiny_gpt(tie_weights=False), ["nope"], r"'nope', which is not a module of the model. Fix: use one of"),
    ]
    for model, paths, message in cases:
        with pytest.raises(ValueError, match=message):
            gp.compile(model, {"offload_embedding": paths}, example_inputs=(x,), example_target=y, loss_fn=lm_loss)
    with pytest.raises(ValueError, match=r"row-wise update.*not RMSprop. Fix"):
        gp.compile(tiny_gpt(tie_weights=False), {"offload_embedding": True}, example_inputs=(x,),
                   example_target=y, loss_fn=lm_loss, optimizer=functools.partial(torch.optim.RMSprop, lr=0.1))


# ---- the plan's bytes ------------------------------------------------------------------------------------
@pytest.mark.parametrize("strategy", [
    {"param_dtype": "bf16", "offload_optimizer": True}, {"param_dtype": "bf16"}, {"offload_optimizer": True},
    {"param_dtype": "bf16", "reduce_dtype": "bf16", "offload_optimizer": True},
])
def test_plan_bytes_equal_what_the_rank_holds(strategy):
    from graphpar.runtime.placement.transfers import bytes_moved, reset_bytes_moved
    pm, x, y = _compile(strategy)
    reset_bytes_moved()
    pm.train_step(x, target=y)
    moved = bytes_moved()
    plan = pm.report().ranks[0]
    params = list(pm.parameters())
    buckets = pm._placed.buckets
    masters = sum(b.flat.nbytes for b in buckets)
    states = sum(t.nbytes for st in pm.optimizer.state.values() for t in st.values())  # AdamW's 0-d step too
    copies = sum(b.compute.nbytes for b in buckets if b.compute is not b.flat)
    assert plan.param_bytes == sum(p.nbytes for p in params)
    assert plan.grad_bytes == sum(p.grad.nbytes for p in params)
    if strategy.get("offload_optimizer"):
        assert plan.optimizer_bytes == 0
        assert plan.host_bytes == masters + states + copies + moved["to_host"]
        host_moves = {t.op: t.bytes for t in plan.collectives if t.axis == "host"}
        assert host_moves == moved
    else:
        assert plan.optimizer_bytes == masters + states and plan.host_bytes == 0


@pytest.mark.parametrize("reduce_dtype, grad", [(None, 4), ("bf16", 2)])
def test_closed_forms_18_or_16_bytes_per_parameter_and_6_or_4_on_the_device_with_offload(reduce_dtype, grad):
    # mixed-precision AdamW: 2 (bf16 weights) + grad + 4 (fp32 masters) + 8 (states) bytes per
    # parameter: 18 with fp32 gradients (Megatron's figure), 16 with bf16 ones
    x, y = token_batch(batch=8)
    n = sum(p.numel() for p in tiny_gpt().parameters())
    steps = 4 * len(list(tiny_gpt().parameters()))  # AdamW's 0-d fp32 step, one per parameter
    strategy = {"param_dtype": "bf16", "reduce_dtype": reduce_dtype}
    on_device = gp.plan(tiny_gpt(), strategy, example_inputs=(x,), example_target=y,
                        loss_fn=lm_loss, optimizer=adamw()).ranks[0]
    assert on_device.param_bytes + on_device.grad_bytes + on_device.optimizer_bytes == (14 + grad) * n + steps
    offloaded = gp.plan(tiny_gpt(), {**strategy, "offload_optimizer": True}, example_inputs=(x,),
                        example_target=y, loss_fn=lm_loss, optimizer=adamw()).ranks[0]
    assert (offloaded.param_bytes, offloaded.grad_bytes, offloaded.optimizer_bytes) == (2 * n, grad * n, 0)
    assert offloaded.host_bytes == (4 + 8 + grad + 2) * n + steps


# ---- fp16: dynamic loss scaling --------------------------------------------------------------------------
def test_fp16_with_loss_scaling_matches_the_unscaled_reference():
    # Scaling by a power of two is exact in floating point, except for fp16 gradients that the
    # unscaled reference flushes to zero or subnormals and the scaled run keeps: those differ by
    # up to lr * 2**-14 ~ 3e-5 per entry per SGD step (fp16's smallest normal is 2**-14).
    x, y = token_batch(batch=8)
    pm = gp.compile(tiny_gpt(), {"param_dtype": "fp16", "offload_optimizer": True}, example_inputs=(x,),
                    example_target=y, loss_fn=lm_loss, optimizer=targets.sgd())
    losses = [pm.train_step(x, target=y) for _ in range(4)]
    reference, ref_losses = targets.train_mixed_reference(tiny_gpt(), [(x, y)], lm_loss, targets.sgd(), 4,
                                                          torch.float16)
    assert pm.loss_scaler.skipped == 0
    assert losses == pytest.approx(ref_losses, abs=4e-3)  # fp16 losses: 2**-8 steps near 4
    assert _max_diff(pm.full_state_dict(), reference.state_dict()) < 2e-4


def test_fp16_overflow_skips_the_step_and_halves_the_scale():
    x, y = token_batch(batch=8)
    pm = gp.compile(tiny_gpt(), {"param_dtype": torch.float16}, example_inputs=(x,), example_target=y,
                    loss_fn=lm_loss, optimizer=adamw())
    pm.train_step(x, target=y)
    pm.loss_scaler.scale = 2.0 ** 40  # far past fp16's range: the gradients overflow
    before = pm.full_state_dict()
    pm.train_step(x, target=y)
    assert pm.loss_scaler.skipped == 1 and pm.loss_scaler.scale == 2.0 ** 39
    assert _max_diff(pm.full_state_dict(), before) == 0
    assert all(torch.isfinite(p).all() for p in pm.parameters())


def test_adamw_host_tables_match_lazy_adam_and_verify_knows_it():
    """Adam/AdamW on a host table is lazy (row-wise) Adam: gp.verify's reference updates the
    same tables with torch.optim.SparseAdam on the rows its dense gradient touched, the rest
    of the model with AdamW, and the compiled run must agree with it exactly (the row
    gradients are the dense gradient's nonzero rows, summed in the same order)."""
    x, y = token_batch(batch=8)
    report = gp.verify(tiny_gpt(tie_weights=False), {"offload_embedding": True, "offload_optimizer": True},
                       example_inputs=(x,), target=y, loss_fn=lm_loss, optimizer=adamw(), steps=3)
    assert report.passed, report.problems
    assert report.max_param_error < OFFLOAD_TOL


def test_fp16_checkpoint_resumes_with_the_loss_scale(tmp_path):
    x, y = token_batch(batch=8)

    def compiled():
        return gp.compile(tiny_gpt(), {"param_dtype": "fp16", "offload_optimizer": True}, example_inputs=(x,),
                          example_target=y, loss_fn=lm_loss, optimizer=adamw())
    pm = compiled()
    pm.train_step(x, target=y)
    pm.loss_scaler.scale = 2.0 ** 40
    pm.train_step(x, target=y)  # overflows: skipped, scale halved
    pm.save_checkpoint(str(tmp_path / "ck"))
    saved = dict(vars(pm.loss_scaler))
    losses = [pm.train_step(x, target=y) for _ in range(12)]  # skips until the scale fits again
    resumed = compiled()
    resumed.load_checkpoint(str(tmp_path / "ck"))
    assert vars(resumed.loss_scaler) == saved and saved["scale"] == 2.0 ** 39
    assert [resumed.train_step(x, target=y) for _ in range(12)] == losses
    assert vars(resumed.loss_scaler) == vars(pm.loss_scaler)
