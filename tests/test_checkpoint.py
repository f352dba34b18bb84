"""Distributed checkpoints: resharding between strategies, atomic saves, exact resume, clear errors."""
import glob
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

import graphpar as gp
from graphpar.checkpoint import CheckpointError, load_full_checkpoint, placement
from graphpar.data import DistributedBatches
from graphpar.ir import Shard
from graphpar.launch import launch
from graphpar.tp.layout import local_shard
from tests import checkpoint_targets as targets
from tests.helpers import adamw, lm_loss, tiny_gpt, token_batch

# One step after a reshard against the same step in the old layout: the moments and weights
# going in are bit-identical, only the step's own sums run in another order (tp partial sums,
# dp all-reduce), i.e. float32 rounding noise; parameters then get the AdamW noise bound
# explained in tests/helpers.adamw (1e-4), the loss stays within 1e-5.
PARAM_TOL = 1e-4
LOSS_TOL = 1e-5


def assert_same(actual, expected, msg=""):
    """Exact equality, tensor by tensor (nested dicts of tensors and plain values)."""
    assert actual.keys() == expected.keys(), msg
    for key, value in expected.items():
        if isinstance(value, dict):
            assert_same(actual[key], value, f"{msg}{key}/")
        elif torch.is_tensor(value):
            assert torch.equal(actual[key], value), f"{msg}{key}"
        else:
            assert actual[key] == value, f"{msg}{key}"


def test_placement_pieces_are_the_local_shard():
    full = torch.arange(24 * 6.).reshape(24, 6)
    for spec in (None, Shard(0), Shard(1), Shard(0, (8, 8, 8)), Shard(0, (12, 6, 6))):
        tp = 1 if spec is None else 2 if spec.dim == 1 else 3 if spec.segments == (12, 6, 6) else 2
        for rank in range(tp):
            local = full if spec is None else local_shard(full, spec, rank, tp)
            chunks = placement(full.shape, spec, rank, tp)
            assert sum(c.sizes[c.dim] for c in chunks) == local.shape[chunks[0].dim]
            for c in chunks:
                region = full[tuple(slice(o, o + s) for o, s in zip(c.offsets, c.sizes))]
                assert torch.equal(local.narrow(c.dim, c.local_start, c.sizes[c.dim]), region), (spec, rank, c)


def _compile_single(model, batch=8, **strategy):
    x, y = token_batch(batch=batch)
    return gp.compile(model, gp.Strategy(**strategy), example_inputs=(x,), example_target=y, loss_fn=lm_loss,
                      optimizer=adamw()), x, y


def test_tp2_pp2_to_tp1_exact_and_steps_on(tmp_path):
    steps = 2
    results = launch(targets.train_save_step, world_size=4,
                     args=(str(tmp_path), gp.Strategy(tp=2, pp=2, microbatches=2), "fused", steps))
    losses, saved, stepped = results[0]
    ck = load_full_checkpoint(tmp_path / "ck")
    assert ck.layout == {"dp": 1, "tp": 2, "pp": 2} and ck.extra == {"step": steps}
    assert_same(ck.model, saved)

    # optimizer state against single-device training: the moments are sums of gradients that
    # tp computes in another order, off by ~1e-8 where they are ~1e-2; a piece stored at the
    # wrong place would be off by the moments' own size, so 1e-6 separates the two
    x, y = token_batch(batch=8)
    reference = targets.fused_gpt()
    opt = adamw()(reference.parameters())
    for _ in range(steps):
        opt.zero_grad()
        lm_loss(reference(x), y).backward()
        opt.step()
    for name, p in reference.named_parameters():
        assert ck.optimizer[name]["step"] == steps
        for entry in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(ck.optimizer[name][entry], opt.state[p][entry], atol=1e-6, rtol=0,
                                       msg=f"{name} {entry}")
    adamw()(reference.parameters()).load_state_dict(ck.optimizer_state_dict(reference))  # torch's format

    pm, x, y = _compile_single(targets.fused_gpt())
    assert pm.load_checkpoint(tmp_path / "ck") == {"step": steps}
    assert_same(pm.full_state_dict(), saved)
    pm.save_checkpoint(tmp_path / "ck1")  # tp1's own checkpoint holds exactly what tp2 x pp2 saved
    again = load_full_checkpoint(tmp_path / "ck1")
    assert_same(again.model, ck.model)
    assert_same(again.optimizer, ck.optimizer)
    assert again.optimizer_groups == ck.optimizer_groups

    loss = pm.train_step(x, target=y)
    assert loss == pytest.approx(losses[-1], abs=LOSS_TOL)
    for key, value in stepped.items():
        torch.testing.assert_close(pm.full_state_dict()[key], value, atol=PARAM_TOL, rtol=0, msg=key)


@pytest.mark.parametrize("model_name", ["hf_gpt2"])  # fused pieces: covered by tp2 x pp2 above
def test_dp4_to_dp2_tp2_exact_and_steps_on(tmp_path, model_name):
    if model_name == "hf_gpt2":
        pytest.importorskip("transformers", reason="transformers is in the test extra")
    steps = 2
    results = launch(targets.reshard_dp4_to_dp2tp2, world_size=4, args=(str(tmp_path), model_name, steps))
    for (losses, saved, stepped), (extra, loaded, loss, after) in results:
        assert extra == {"step": steps}
        assert_same(loaded, saved)
        assert loss == pytest.approx(losses[-1], abs=LOSS_TOL)
        for key, value in stepped.items():
            torch.testing.assert_close(after[key], value, atol=PARAM_TOL, rtol=0, msg=key)
    first, second = load_full_checkpoint(tmp_path / "ck"), load_full_checkpoint(tmp_path / "ck2")
    assert_same(second.model, first.model)
    assert_same(second.optimizer, first.optimizer)
    assert first.optimizer["transformer.h.0.attn.c_attn.weight" if model_name == "hf_gpt2"
                           else "blocks.0.attn.qkv.weight"]["step"] == steps


def test_resume_follows_the_uninterrupted_run_exactly(tmp_path):
    stop_at = 7  # inside the second epoch (5 global batches per epoch), so the position matters
    for (full_losses, full_draws), (losses, draws), (resumed_losses, resumed_draws) in launch(
            targets.resume, world_size=2, args=(str(tmp_path), stop_at)):
        assert len(full_losses) == 10
        # same layout, same data, same dropout masks: the same float operations, bit for bit
        assert losses == full_losses[:stop_at] and draws == full_draws[:stop_at]
        assert resumed_losses == full_losses[stop_at:]
        assert resumed_draws == full_draws[stop_at:]


def test_kill_mid_save_keeps_the_previous_checkpoint(tmp_path):
    script = f"from tests import checkpoint_targets as t; t.run_stalled_save({str(tmp_path)!r})"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    child = subprocess.Popen([sys.executable, "-c", script], cwd=root, start_new_session=True,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "stalled").exists():
            assert child.poll() is None, child.stderr.read().decode()[-3000:]
            assert time.monotonic() < deadline, "the save never reached the stall"
            time.sleep(0.2)
    finally:
        os.killpg(child.pid, signal.SIGKILL)  # the launcher and both ranks, mid-save
        child.wait()
    staging = (tmp_path / "stalled").read_text()
    assert os.path.basename(staging).startswith("ck.tmp-")
    assert glob.glob(os.path.join(staging, "*.distcp")) and not os.path.exists(os.path.join(staging, ".metadata"))

    pm, _, _ = _compile_single(tiny_gpt(), batch=4)
    assert pm.load_checkpoint(tmp_path / "ck") == {"name": "A"}
    assert_same(pm.full_state_dict(), torch.load(tmp_path / "A.pt"))
    with pytest.raises(CheckpointError, match=r"ck\.tmp-\w+ is not a complete graphpar checkpoint: it has no "
                                              r"graphpar\.json.*interrupted.*Fix: load an earlier"):
        pm.load_checkpoint(staging)
    with pytest.raises(CheckpointError, match=r"is not a complete graphpar checkpoint"):
        load_full_checkpoint(staging)
    shutil.copytree(staging, tmp_path / "new.tmp-0")  # as if the first save to "new" had been killed
    with pytest.raises(CheckpointError, match=r"no checkpoint at .*new\. A save to it was interrupted .*"
                                              r"new\.tmp-0, which cannot be loaded\. Fix:"):
        pm.load_checkpoint(tmp_path / "new")
    pm.save_checkpoint(tmp_path / "ck")  # the next complete save clears the dead stage
    assert not os.path.exists(staging)


def test_loading_another_model_names_the_difference(tmp_path):
    pm, _, _ = _compile_single(tiny_gpt(), batch=4)
    pm.save_checkpoint(tmp_path / "ck")
    deeper, _, _ = _compile_single(tiny_gpt(n_layer=3), batch=4)
    with pytest.raises(CheckpointError, match=r"does not fit the compiled model \(missing 16 key\(s\): "
                                              r"blocks\.2\.ln_1\.weight.*Fix: compile the model the checkpoint"):
        deeper.load_checkpoint(tmp_path / "ck")
    wider, _, _ = _compile_single(tiny_gpt(n_embd=64), batch=4)
    with pytest.raises(CheckpointError, match=r"shape/dtype mismatch\(es\): wte\.weight is \[64, 32\] "
                                              r"torch\.float32 in the checkpoint, \[64, 64\] torch\.float32"):
        wider.load_checkpoint(tmp_path / "ck")
    untied, _, _ = _compile_single(tiny_gpt(tie_weights=False), batch=4)
    with pytest.raises(CheckpointError, match=r"weights tied differently: wte\.weight, lm_head\.weight"):
        untied.load_checkpoint(tmp_path / "ck")
    with pytest.raises(CheckpointError, match=r"no checkpoint at .*elsewhere\. Fix: check the path"):
        pm.load_checkpoint(tmp_path / "elsewhere")
    with pytest.raises(CheckpointError, match=r"holds no data position .*Fix: load it without data="):
        pm.load_checkpoint(tmp_path / "ck", data=DistributedBatches(targets.TokenSet(), 4, pm))


def test_save_refuses_bad_input(tmp_path):
    pm, _, _ = _compile_single(tiny_gpt(), batch=4)
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("keep me")
    with pytest.raises(CheckpointError, match=r"notes exists and is not a graphpar checkpoint .*Fix: save to a new"):
        pm.save_checkpoint(tmp_path / "notes")
    assert (tmp_path / "notes" / "todo.txt").read_text() == "keep me"
    with pytest.raises(CheckpointError, match=r"extra=list is not a dict\. Fix:"):
        pm.save_checkpoint(tmp_path / "ck", extra=[1])


def test_data_position_carries_over_to_another_dp():
    data = targets.TokenSet(n=40)
    four = [DistributedBatches(data, 2, dp=4, dp_rank=r, shuffle=True, seed=3) for r in range(4)]
    for batches in four:
        batches.set_epoch(1)
        iterator = batches.masked()
        for _ in range(3):  # three global batches of 8: 24 samples read
            next(iterator)
    state = four[0].state_dict()
    assert state["samples_done"] == 24 and all(b.state_dict() == state for b in four)
    order = DistributedBatches(data, 40, dp=1, dp_rank=0, shuffle=True, seed=3)
    order.set_epoch(1)
    expected = order.plan().batches[0][24:28]  # the next global batch of dp2 x 2 samples
    firsts = []
    for rank in range(2):
        batches = DistributedBatches(data, 2, dp=2, dp_rank=rank, shuffle=True, seed=3)
        batches.load_state_dict(state)
        batches.set_epoch(1)  # the training loop's usual call keeps the restored position
        x, _ = next(iter(batches))
        firsts.append(x)
    assert torch.equal(torch.cat(firsts), torch.stack([data[i][0] for i in expected]))
    with pytest.raises(ValueError, match=r"24 samples were read, not a multiple of .* = 16\. Fix:"):
        DistributedBatches(data, 8, dp=2, dp_rank=0, shuffle=True, seed=3).load_state_dict(state)
    with pytest.raises(ValueError, match=r"another sample order: seed=3 \(here 4\)"):
        DistributedBatches(data, 2, dp=2, dp_rank=0, shuffle=True, seed=4).load_state_dict(state)


@pytest.mark.parametrize("first, second, model_name, optimizer_name", [
    # the host optimizer's fp32 masters and AdamW moments carry over to a device optimizer
    ({"dp": 2, "offload_optimizer": True}, {"tp": 2}, "fused", "adamw"),
    # host tables (split over dp) come back as device embeddings, and the other way round
    ({"dp": 2, "offload_embedding": True}, {"tp": 2}, "untied", "sgd"),
    ({"tp": 2}, {"dp": 2, "offload_embedding": True, "offload_optimizer": True}, "untied", "sgd"),
    # the same layout: a resume, exact, the host tables' lazy-Adam moments included
    ({"dp": 2, "offload_embedding": True, "offload_optimizer": True},
     {"dp": 2, "offload_embedding": True, "offload_optimizer": True}, "untied", "adamw"),
])
def test_checkpoints_reshard_with_host_placement(tmp_path, first, second, model_name, optimizer_name):
    results = launch(targets.reshard_host_placement, world_size=2,
                     args=(str(tmp_path), first, second, model_name, optimizer_name))
    for (saved, loss, stepped), (loaded, loss_after, stepped_after) in results:
        assert_same(loaded, saved)
        if first == second:
            assert loss_after == loss
            assert_same(stepped_after, stepped)
        assert loss_after == pytest.approx(loss, abs=LOSS_TOL)
        for key, value in stepped.items():
            torch.testing.assert_close(stepped_after[key], value, atol=PARAM_TOL, rtol=0, msg=key)
