"""Distributed checkpoints in one process: atomic saves, clear errors, loads that are all or
nothing (damaged checkpoints and misfits refused before anything changes). Resharding between
strategies and exact resume across ranks: tests/multiprocess/checkpoint/test_checkpoint.py."""
import functools
import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import graphpar as gp
from graphpar.checkpoint.sharded import CheckpointError, load_full_checkpoint
from graphpar.tools.data import DistributedBatches
from graphpar.ir import Shard
from graphpar.ir.layout import local_shard, placement
from tests.targets import checkpoint_targets as targets
from tests.helpers import adamw, lm_loss, tiny_gpt, token_batch


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
            if spec is not None:   # local_shard is built on placement: compare with the rule written out
                blocks = full.split(list(spec.segments), spec.dim) if spec.segments else [full]
                expected = torch.cat([b.chunk(tp, spec.dim)[rank] for b in blocks], spec.dim)
                assert torch.equal(local, expected), (spec, rank)
            chunks = placement(full.shape, spec, rank, tp)
            assert sum(c.sizes[c.dim] for c in chunks) == local.shape[chunks[0].dim]
            for c in chunks:
                region = full[tuple(slice(o, o + s) for o, s in zip(c.offsets, c.sizes))]
                assert torch.equal(local.narrow(c.dim, c.local_start, c.sizes[c.dim]), region), (spec, rank, c)


def _compile_single(model, batch=8, optimizer=adamw(), **strategy):
    x, y = token_batch(batch=batch)
    return gp.compile(model, gp.Strategy(**strategy), example_inputs=(x,), example_target=y, loss_fn=lm_loss,
                      optimizer=optimizer), x, y


def test_kill_mid_save_keeps_the_previous_checkpoint(tmp_path):
    script = f"from tests.targets import checkpoint_targets as t; t.run_stalled_save({str(tmp_path)!r})"
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
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


# ---- loads are all or nothing -----------------------------------------------------------------

def _two_saves(directory):
    """A world of one that trains a step and saves A, then another step and saves B (B is
    the same model's checkpoint from later in the run: a file of it must not pass for A's).
    Returns the module (in B's state), its data and the state each save holds."""
    pm, _, _ = _compile_single(tiny_gpt(dropout=0.1), batch=4)
    data = DistributedBatches(targets.TokenSet(), 4, pm, shuffle=True, seed=3)
    batches, saved = iter(data), {}
    for name in ("A", "B"):
        xs, ys = next(batches)
        pm.train_step(xs, target=ys)
        torch.rand(())  # the loop's own randomness moves torch's RNG on
        pm.save_checkpoint(directory / name, extra={"save": name}, data=data)
        saved[name] = targets.loadable_state(pm, data)
    return pm, data, saved


def damage(directory, kind, name, at=0.5, mask=0xFF, other=None):
    """Damage the file ``name`` of a checkpoint: cut it at fraction ``at`` of its bytes, flip
    the bits ``mask`` of the byte there, delete it, or swap in ``other``'s file of that name."""
    path = directory / name
    content = bytearray(path.read_bytes())
    offset = int(at * len(content))
    if kind == "truncate":
        path.write_bytes(content[:offset])
    elif kind == "flip":
        content[offset] ^= mask
        path.write_bytes(content)
    elif kind == "delete":
        path.unlink()
    else:
        shutil.copyfile(other / name, path)


DAMAGES = [  # what is done to which file of checkpoint A, and how the refusal names it
    ("truncate", "__0_0.distcp", r"__0_0\.distcp has \d+ bytes, the save wrote \d+"),
    ("flip", "__0_0.distcp", r"__0_0\.distcp's contents differ from what the save wrote \(sha256 \w+\.\.\., "
                             r"recorded \w+\.\.\.\)"),
    ("swap", "__0_0.distcp", r"__0_0\.distcp's contents differ from what the save wrote"),
    ("delete", ".metadata", r"\.metadata is missing"),
    ("swap", ".metadata", r"\.metadata's contents differ from what the save wrote"),
    ("truncate", "graphpar.json", r"graphpar\.json is not readable JSON"),
]


def test_damaged_checkpoint_is_refused_before_anything_changes(tmp_path):
    pm, data, saved = _two_saves(tmp_path)
    before = targets.loadable_state(pm, data)
    for index, (kind, name, refusal) in enumerate(DAMAGES):
        damaged = tmp_path / f"damaged{index}"
        shutil.copytree(tmp_path / "A", damaged)
        damage(damaged, kind, name, other=tmp_path / "B")
        with pytest.raises(CheckpointError, match=rf"^load_checkpoint: the checkpoint at \S+damaged{index} is "
                                                  rf"damaged: {refusal}.*, so nothing was loaded\. Fix: load an "
                                                  rf"earlier checkpoint, or copy this one again"):
            pm.load_checkpoint(damaged, data=data)
        assert_same(targets.loadable_state(pm, data), before, f"{kind} {name}: ")
        with pytest.raises(CheckpointError, match=rf"^load_full_checkpoint: the checkpoint at .* is damaged: "
                                                  rf"{refusal}"):
            load_full_checkpoint(damaged)
    # the manifest checks itself: an edited value (here the world size) is refused too
    forged = tmp_path / "forged"
    shutil.copytree(tmp_path / "A", forged)
    manifest = json.loads((forged / "graphpar.json").read_text())
    (forged / "graphpar.json").write_text(json.dumps({**manifest, "world_size": 2}))
    with pytest.raises(CheckpointError, match=r"is damaged: graphpar\.json's contents differ from what the save "
                                              r"wrote \(its checksum does not match\)"):
        pm.load_checkpoint(forged, data=data)
    assert_same(targets.loadable_state(pm, data), before)
    assert pm.load_checkpoint(tmp_path / "A", data=data) == {"save": "A"}  # the intact one loads, exactly
    assert_same(targets.loadable_state(pm, data), saved["A"])


def test_any_damage_is_refused_or_loads_exactly_the_saved_state(tmp_path):
    pm, data, saved = _two_saves(tmp_path)
    names = sorted(os.listdir(tmp_path / "A"))
    attempts = []

    @settings(max_examples=20, deadline=None)  # a load is ~0.1 s; 20 cover every kind of damage
    @given(kind=st.sampled_from(["truncate", "flip", "delete", "swap"]), name=st.sampled_from(names),
           at=st.floats(0, 1, exclude_max=True), mask=st.integers(1, 255))
    def check(kind, name, at, mask):
        pm.load_checkpoint(tmp_path / "B", data=data)  # the state a refused load must leave
        damaged = tmp_path / f"damaged{len(attempts)}"
        shutil.copytree(tmp_path / "A", damaged)
        damage(damaged, kind, name, at, mask, other=tmp_path / "B")
        try:
            pm.load_checkpoint(damaged, data=data)
            attempts.append("loaded")  # the damage changed nothing that is read (e.g. JSON whitespace)
            assert_same(targets.loadable_state(pm, data), saved["A"], f"{kind} {name} at {at}: ")
        except CheckpointError:  # graphpar's refusal, an Exception; anything else fails the test
            attempts.append("refused")
            assert_same(targets.loadable_state(pm, data), saved["B"], f"{kind} {name} at {at}: ")
        try:
            assert_same(load_full_checkpoint(damaged).model, saved["A"]["model"])
        except CheckpointError:
            pass
        shutil.rmtree(damaged)

    check()
    assert "refused" in attempts


def test_optimizer_of_another_class_is_refused_before_anything_changes(tmp_path):
    sgd = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)
    two_groups = lambda params: adamw()([{"params": params[:1]}, {"params": params[1:]}])  # noqa: E731
    modules = {}
    for name, optimizer in (("sgd", sgd), ("adamw", adamw()), ("adamw2", two_groups)):
        pm, x, y = _compile_single(tiny_gpt(), batch=4, optimizer=optimizer)
        pm.train_step(x, target=y)
        pm.save_checkpoint(tmp_path / name)
        modules[name] = pm
    sgd_class, adamw_class = "torch.optim.sgd.SGD", "torch.optim.adamw.AdamW"
    for into, saved, refusal in (
            ("adamw", "sgd", rf"holds the state of a {sgd_class} optimizer, and this module's optimizer is a "
                             rf"{adamw_class}; .*Fix: compile with optimizer= building a {sgd_class} .*or load only "
                             rf"the weights: pm\.load_full_state_dict\(load_full_checkpoint\(path\)\.model\)"),
            ("sgd", "adamw", rf"holds the state of a {adamw_class} optimizer, and this module's optimizer is a "
                             rf"{sgd_class}; "),
            ("adamw2", "adamw", r"the checkpoint's optimizer has 1 param group\(s\), this rank's has 2\. Fix:")):
        pm = modules[into]
        before = targets.loadable_state(pm)
        with pytest.raises(CheckpointError, match=rf"^load_checkpoint: .*{refusal}"):
            pm.load_checkpoint(tmp_path / saved)
        assert_same(targets.loadable_state(pm), before, f"{saved} into {into}: ")
    # the fix the message gives works
    modules["adamw"].load_full_state_dict(load_full_checkpoint(tmp_path / "sgd").model)
    assert_same(modules["adamw"].full_state_dict(), modules["sgd"].full_state_dict())


def test_data_position_that_does_not_fit_is_refused_before_anything_changes(tmp_path):
    pm, data, saved = _two_saves(tmp_path)
    other_order = DistributedBatches(targets.TokenSet(), 4, pm, shuffle=True, seed=4)
    before = targets.loadable_state(pm, other_order)
    with pytest.raises(CheckpointError, match=r"^DistributedBatches\.load_state_dict: the saved position is in "
                                              r"another sample order: seed=3 \(here 4\)\. Fix:"):
        pm.load_checkpoint(tmp_path / "A", data=other_order)
    assert_same(targets.loadable_state(pm, other_order), before)


def test_load_full_state_dict_checks_every_shape_before_writing():
    pm, _, _ = _compile_single(tiny_gpt(), batch=4)
    before = pm.full_state_dict()
    other = {key: value + 1 for key, value in tiny_gpt().state_dict().items()}
    other["ln_f.bias"] = torch.zeros(7)  # after every block's weights in the model's order
    with pytest.raises(ValueError, match=r"'ln_f\.bias' has shape \[7\], the model expects \[32\]\. Fix:"):
        pm.load_full_state_dict(other)
    assert_same(pm.full_state_dict(), before)


def test_meta_model_refuses_to_return_or_save_weights_until_they_are_loaded(tmp_path):
    real = tiny_gpt()
    with torch.device("meta"):
        meta = tiny_gpt()
    pm, _, _ = _compile_single(meta, batch=4)
    refusal = (r"^the model was compiled on the meta device and has no weights yet, so {} would read "
               r"uninitialised memory\. Fix: pm\.load_full_state_dict\(state_dict\) or pm\.load_checkpoint\(path\) "
               r"first\.")
    with pytest.raises(RuntimeError, match=refusal.format(r"full_state_dict\(\)")):
        pm.full_state_dict()
    with pytest.raises(RuntimeError, match=refusal.format("save_checkpoint")):
        pm.save_checkpoint(tmp_path / "ck")
    assert os.listdir(tmp_path) == []  # nothing written
    pm.load_full_state_dict(real.state_dict())
    assert_same(pm.full_state_dict(), real.state_dict())
    pm.save_checkpoint(tmp_path / "ck")
    assert_same(load_full_checkpoint(tmp_path / "ck").model, real.state_dict())
    # compiled without example_target, the first train_step traces again: still no weights
    x, y = token_batch(batch=4)
    lazy = gp.compile(meta, gp.Strategy(), example_inputs=(x,), loss_fn=lm_loss, optimizer=adamw())
    with pytest.raises(RuntimeError, match=refusal.format("train_step")):
        lazy.train_step(x, target=y)
    lazy.load_checkpoint(tmp_path / "ck")  # a checkpoint gives a meta model its weights too
    assert_same(lazy.full_state_dict(), real.state_dict())
    assert lazy.train_step(x, target=y) == pm.train_step(x, target=y)
