"""Distributed checkpoints across launched ranks: resharding between strategies (with and
without host placement), exact resume, a damaged piece refused on every rank. Every case of one
world size runs in one launch (tests/targets/cases.py), `cases` below, each in its own folder."""
import re

import pytest
import torch

import graphpar as gp
from graphpar.checkpoint.sharded import load_full_checkpoint
from tests.targets import checkpoint_targets as targets
from tests.targets.cases import SharedLaunches
from tests.helpers import adamw, lm_loss, token_batch
from tests.unit.checkpoint.test_checkpoint import _compile_single, assert_same


# One step after a reshard against the same step in the old layout: the moments and weights
# going in are bit-identical, only the step's own sums run in another order (tp partial sums,
# dp all-reduce), i.e. float32 rounding noise; parameters then get the AdamW noise bound
# explained in tests/helpers.adamw (1e-4), the loss stays within 1e-5.
PARAM_TOL = 1e-4
LOSS_TOL = 1e-5
STEPS = 2
RESUME_AT = 7  # inside the second epoch (5 global batches per epoch), so the position matters
RESHARDS = [
    # the host optimizer's fp32 masters and AdamW moments carry over to a device optimizer
    ({"dp": 2, "offload_optimizer": True}, {"tp": 2}, "fused", "adamw"),
    # host tables (split over dp) come back as device embeddings, and the other way round
    ({"dp": 2, "offload_embedding": True}, {"tp": 2}, "untied", "sgd"),
    ({"tp": 2}, {"dp": 2, "offload_embedding": True, "offload_optimizer": True}, "untied", "sgd"),
    # the same layout: a resume, exact, the host tables' lazy-Adam moments included
    ({"dp": 2, "offload_embedding": True, "offload_optimizer": True},
     {"dp": 2, "offload_embedding": True, "offload_optimizer": True}, "untied", "adamw"),
    # ZeRO's host master shards and sharded moments, gathered whole, carry over to tp
    ({"dp": 2, "zero": 2, "offload_optimizer": True}, {"tp": 2}, "fused", "adamw"),
    # ZeRO with bf16 compute: a resume in the same layout is exact (fp32 master shards)
    ({"dp": 2, "zero": 1, "param_dtype": "bf16"}, {"dp": 2, "zero": 1, "param_dtype": "bf16"}, "untied", "adamw"),
]


def cases(directory):
    """Every launched case of this module: {name: (world size, function, args)}; each case
    writes under directory / its folder()."""
    return {
        "tp2_pp2": (4, targets.train_save_step, (
            folder(directory, "tp2_pp2"), gp.Strategy(tp=2, pp=2, microbatches=2), "fused", STEPS)),
        "dp4_hf_gpt2": (4, targets.reshard_dp4_to_dp2tp2, (folder(directory, "dp4_hf_gpt2"), "hf_gpt2", STEPS)),
        "resume": (2, targets.resume, (folder(directory, "resume"), RESUME_AT)),
        **{("host", i): (2, targets.reshard_host_placement, (folder(directory, f"host{i}"), *reshard))
           for i, reshard in enumerate(RESHARDS)},
        "damaged": (2, targets.refuse_damaged_piece, (folder(directory, "damaged"),)),
    }


def folder(directory, name):
    (directory / name).mkdir(exist_ok=True)
    return str(directory / name)


@pytest.fixture(scope="module")
def launched(directory):
    return SharedLaunches(cases(directory))


def test_tp2_pp2_to_tp1_exact_and_steps_on(launched, directory):
    steps, tmp_path = STEPS, directory / "tp2_pp2"
    results = launched("tp2_pp2")
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
def test_dp4_to_dp2_tp2_exact_and_steps_on(launched, directory, model_name):
    if model_name == "hf_gpt2":
        pytest.importorskip("transformers", reason="transformers is in the test extra")
    steps, tmp_path = STEPS, directory / f"dp4_{model_name}"
    results = launched(f"dp4_{model_name}")
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


def test_resume_follows_the_uninterrupted_run_exactly(launched):
    stop_at = RESUME_AT
    for (full_losses, full_draws), (losses, draws), (resumed_losses, resumed_draws) in launched("resume"):
        assert len(full_losses) == 10
        # same layout, same data, same dropout masks: the same float operations, bit for bit
        assert losses == full_losses[:stop_at] and draws == full_draws[:stop_at]
        assert resumed_losses == full_losses[stop_at:]
        assert resumed_draws == full_draws[stop_at:]


@pytest.mark.parametrize("first, second, model_name, optimizer_name", RESHARDS)
def test_checkpoints_reshard_with_host_placement(launched, first, second, model_name, optimizer_name):
    results = launched(("host", RESHARDS.index((first, second, model_name, optimizer_name))))
    for (saved, loss, stepped), (loaded, loss_after, stepped_after) in results:
        assert_same(loaded, saved)
        if first == second:
            assert loss_after == loss
            assert_same(stepped_after, stepped)
        assert loss_after == pytest.approx(loss, abs=LOSS_TOL)
        for key, value in stepped.items():
            torch.testing.assert_close(stepped_after[key], value, atol=PARAM_TOL, rtol=0, msg=key)


def test_damaged_piece_is_refused_on_every_rank(launched):
    for rank, (refusal, before, after) in enumerate(launched("damaged")):
        assert refusal is not None and re.search(r"the checkpoint at \S+ck is damaged: __0_0\.distcp's contents "
                                                 r"differ from what the save wrote", refusal), (rank, refusal)
        assert_same(after, before, f"rank {rank}: ")
