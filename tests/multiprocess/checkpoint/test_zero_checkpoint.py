"""Checkpoints of ZeRO runs (Strategy.zero) loaded under another dp, tp and zero stage, and at
one process: the weights and the optimizer state exactly, then training goes on as the run
that saved them did. Also what each rank writes of a ZeRO checkpoint."""
import math

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

import graphpar as gp
from graphpar.checkpoint.sharded import load_full_checkpoint
from graphpar.distributed.launch import launch
from tests.helpers import adamw, lm_loss, token_batch
from tests.targets import zero_checkpoint_targets as targets
from tests.targets.checkpoint_targets import fused_gpt
from tests.unit.checkpoint.test_checkpoint import assert_same

# One step after a reshard against the same step in the saving layout: the weights and
# moments going in are bit-identical, only the step's own sums run in another order (tp
# partial sums, the dp reduction), i.e. float32 rounding noise; parameters then get the AdamW
# noise bound explained in tests/helpers.adamw (1e-4), the loss stays within 1e-5.
PARAM_TOL = 1e-4
LOSS_TOL = 1e-5
# The gathered moments against single-device training's: sums of the same gradients in
# another order, off by ~1e-8 where they are ~1e-2; a piece put at the wrong place would be
# off by the moments' own size.
MOMENT_TOL = 1e-6


def _check_resumed(before, after):
    """`after` loaded what `before` saved, exactly, and its next step is `before`'s."""
    assert after["extra"] == {"step": targets.STEPS}
    assert_same(after["loaded"], before["saved"])
    assert after["compared"] > 0 and after["differing"] == []
    assert after["loss"] == pytest.approx(before["loss"], abs=LOSS_TOL)
    for key, value in before["stepped"].items():
        torch.testing.assert_close(after["stepped"][key], value, atol=PARAM_TOL, rtol=0, msg=key)


def _check_same_checkpoint(path, other):
    first, second = load_full_checkpoint(path), load_full_checkpoint(other)
    assert_same(second.model, first.model)
    assert_same(second.optimizer, first.optimizer)
    assert second.optimizer_groups == first.optimizer_groups


def _check_against_single_device(path, global_batch):
    """The checkpoint's optimizer state, gathered whole from the shards, is single-device
    training's (padding and piece boundaries put nowhere)."""
    ck = load_full_checkpoint(path)
    batch = token_batch(batch=global_batch)
    reference = fused_gpt()
    opt = adamw()(reference.parameters())
    for _ in range(targets.STEPS):
        opt.zero_grad()
        lm_loss(reference(batch[0]), batch[1]).backward()
        opt.step()
    for name, p in reference.named_parameters():
        assert float(ck.optimizer[name]["step"]) == targets.STEPS
        for entry in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(ck.optimizer[name][entry], opt.state[p][entry], atol=MOMENT_TOL, rtol=0,
                                       msg=f"{name} {entry}")


def _bytes_written(path):
    """From DCP's metadata: per file, the bytes of model and optimizer tensors it holds; per
    model/optimizer entry, the elements stored; and the largest such entry and the bytes of
    the other tensor entries (RNG states, each held by some ranks only)."""
    metadata = FileSystemReader(str(path)).read_metadata()
    per_file, stored, largest, other = {}, {}, 0, 0
    for index, info in metadata.storage_data.items():
        entry = metadata.state_dict_metadata[index.fqn]
        if not isinstance(entry, TensorStorageMetadata):
            continue
        chunk = next(c for c in entry.chunks if c.offsets == index.offset)
        size = math.prod(chunk.sizes) * entry.properties.dtype.itemsize
        if not index.fqn.startswith(("model/", "optim/")):
            other += size
            continue
        per_file[info.relative_path] = per_file.get(info.relative_path, 0) + size
        stored[index.fqn] = stored.get(index.fqn, 0) + math.prod(chunk.sizes)
        largest = max(largest, size)
    return per_file, stored, largest, other, metadata


def _check_each_rank_writes_a_share(path, dp):
    """Every element is written once (not by every dp rank), and each rank writes about 1/dp
    of the bytes: DCP gives each entry to the rank whose plan is smallest so far, so every
    rank ends within one entry (plus the RNG states only it holds) of the mean."""
    per_file, stored, largest, other, metadata = _bytes_written(path)
    for fqn, elements in stored.items():
        assert elements == math.prod(metadata.state_dict_metadata[fqn].size), fqn
    assert sorted(per_file) == [f"__{rank}_0.distcp" for rank in range(dp)]
    mean = sum(per_file.values()) / dp
    for name, size in per_file.items():
        assert abs(size - mean) <= largest + other, (name, size, mean)


def test_dp4_zero2_loads_at_dp2_tp2_zero1_and_at_one_process(tmp_path):
    results = launch(targets.dp4_zero2_to_dp2_tp2_zero1, world_size=4, args=(str(tmp_path),))
    for first, second, _ in results:
        _check_resumed(first, second)
    _check_same_checkpoint(tmp_path / "A", tmp_path / "B")
    _check_against_single_device(tmp_path / "A", 8)
    _check_each_rank_writes_a_share(tmp_path / "A", 4)

    # one process, no zero: the whole optimizer state of every parameter, exactly
    first = results[0][0]
    x, y = token_batch(batch=8)
    pm = gp.compile(fused_gpt(), gp.Strategy(), example_inputs=(x,), example_target=y, loss_fn=lm_loss,
                    optimizer=adamw())
    assert pm.load_checkpoint(tmp_path / "A") == {"step": targets.STEPS}
    assert_same(pm.full_state_dict(), first["saved"])
    ck = load_full_checkpoint(tmp_path / "A")
    for name, p in pm.named_parameters():
        assert_same(pm.optimizer.state[p], ck.optimizer[name], f"{name}: ")
    pm.save_checkpoint(tmp_path / "C")
    _check_same_checkpoint(tmp_path / "A", tmp_path / "C")
    assert pm.train_step(x, target=y) == pytest.approx(first["loss"], abs=LOSS_TOL)
    for key, value in first["stepped"].items():
        torch.testing.assert_close(pm.full_state_dict()[key], value, atol=PARAM_TOL, rtol=0, msg=key)


def test_dp3_zero1_uneven_shards_load_at_dp2_zero2(tmp_path):
    global_batch = 6
    saved = launch(targets.train_save_step, world_size=3,
                   args=(str(tmp_path / "A"), gp.Strategy(dp=3, zero=1), global_batch))
    loaded = launch(targets.load_save_step, world_size=2,
                    args=(str(tmp_path / "A"), str(tmp_path / "B"), gp.Strategy(dp=2, zero=2), global_batch))
    for after in loaded:
        _check_resumed(saved[0], after)
    _check_same_checkpoint(tmp_path / "A", tmp_path / "B")
    _check_against_single_device(tmp_path / "A", global_batch)
    _check_each_rank_writes_a_share(tmp_path / "A", 3)
