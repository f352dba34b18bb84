"""Host placement (issue 9) on launched ranks: offloaded optimizer, bf16 compute weights with
fp32 masters and host embeddings under dp, tp and pp, checked against single-device training
from the same weights. Every case of one world size runs in one launch (tests/targets/cases.py),
`cases` below."""

import pytest
import torch

from tests.targets import placement_targets as targets
from tests.targets.cases import SharedLaunches
from tests.helpers import adamw, lm_loss, tiny_gpt, token_batch, train_reference
from tests.unit.runtime.placement.test_placement import OFFLOAD_TOL, PARAM_TOL, _max_diff


# bf16 compute: gradients carry bf16 rounding (relative 2**-8); over dp, tp or pp they are
# summed in another order than on one device, so each SGD step (lr 0.5, |g| <~ 0.1) can
# differ by lr * |g| * 2**-7 ~ 4e-4 per entry, ~1e-3 over 4 steps. A dropped gradient sync or
# master step differs by O(lr * |g|) ~ 5e-2.
BF16_SGD_TOL = 2e-3
OFFLOAD_STEPS, BF16_STEPS, EMBEDDING_STEPS, FP16_STEPS = 5, 4, 4, 4
OFFLOADS = [
    ({}, 1, True), ({"dp": 2}, 2, True), ({"tp": 2}, 2, True), ({"tp": 2}, 2, False),
    ({"pp": 2, "microbatches": 2}, 2, True),
    ({"dp": 2, "zero": 2}, 2, True),   # ZeRO: each rank's fp32 master shard on the host, or its pieces in place
]
BF16 = [
    ({"dp": 2, "param_dtype": "bf16"}, 2),
    ({"tp": 2, "pp": 2, "microbatches": 2, "param_dtype": "bf16", "offload_optimizer": True}, 4),
    # ZeRO: fp32 master shards, gradients reduced in fp32 (closer to the reference than bf16 sums)
    ({"dp": 2, "param_dtype": "bf16", "zero": 1}, 2),
    ({"dp": 2, "param_dtype": "bf16", "zero": 2, "offload_optimizer": True}, 2),
]
EMBEDDINGS = [({}, 1), ({"dp": 4}, 4), ({"dp": 2, "tp": 2}, 4), ({"pp": 2, "microbatches": 2, "offload_optimizer": True}, 2)]


def cases():
    """Every launched case of this module: {name: (world size, function, args)}."""
    return {
        **{("offload", i): (world, targets.offload_vs_device, (strategy, OFFLOAD_STEPS, tie_weights))
           for i, (strategy, world, tie_weights) in enumerate(OFFLOADS)},
        **{("bf16", i): (world, targets.mixed_precision, (strategy, BF16_STEPS, "sgd"))
           for i, (strategy, world) in enumerate(BF16)},
        **{("embedding", i): (world, targets.host_embedding_run, (strategy, EMBEDDING_STEPS, "sgd"))
           for i, (strategy, world) in enumerate(EMBEDDINGS)},
        "fp16_zero": (2, targets.fp16_zero, (FP16_STEPS,)),
    }


@pytest.fixture(scope="module")
def launched():
    return SharedLaunches(cases())


@pytest.mark.parametrize("strategy, world, tie_weights", OFFLOADS)
def test_offload_optimizer_equals_device_optimizer(launched, strategy, world, tie_weights):
    """Each compiled with and without example_target (the same program either way)."""
    steps = OFFLOAD_STEPS
    results = launched(("offload", OFFLOADS.index((strategy, world, tie_weights))))
    x, y = token_batch(batch=8)
    reference, ref_losses = train_reference(tiny_gpt(tie_weights=tie_weights), [(x, y)], lm_loss, adamw(), steps)
    for (device_losses, device_state), (host_losses, host_state) in (pair for runs in results
                                                                     for pair in zip(runs[::2], runs[1::2])):
        assert host_losses == pytest.approx(device_losses, abs=1e-6)
        assert _max_diff(host_state, device_state) < OFFLOAD_TOL
        assert _max_diff(host_state, reference.state_dict()) < PARAM_TOL


@pytest.mark.parametrize("strategy, world", BF16)
def test_bf16_parallel_matches_mixed_precision_reference(launched, strategy, world):
    steps = BF16_STEPS
    results = launched(("bf16", BF16.index((strategy, world))))
    x, y = token_batch(batch=8)
    reference, ref_losses = targets.train_mixed_reference(tiny_gpt(), [(x, y)], lm_loss, targets.sgd(), steps,
                                                          torch.bfloat16)
    for losses, state in results:
        # the loss itself is a bf16 value (or a mean of bf16 microbatch losses): 2**-7 relative
        assert losses == pytest.approx(ref_losses, rel=2 ** -6)
        assert _max_diff(state, reference.state_dict()) < BF16_SGD_TOL


# ---- host embeddings ---------------------------------------------------------------------------------
# SGD without momentum or weight decay updates only the rows a batch touched, so row-wise
# updates are the dense update exactly; the split table only regroups the same sums.
EMB_TOL = 1e-6


@pytest.mark.parametrize("strategy, world", EMBEDDINGS)
def test_host_embedding_trains_like_the_dense_embedding(launched, strategy, world):
    steps = EMBEDDING_STEPS
    results = launched(("embedding", EMBEDDINGS.index((strategy, world))))
    x, y = token_batch(batch=8)
    reference, ref_losses = train_reference(tiny_gpt(tie_weights=False), [(x, y)], lm_loss, targets.sgd(), steps)
    n_embd = 32
    for losses, state, moved, xs in (run for runs in results for run in runs):  # with, without target
        assert losses == pytest.approx(ref_losses, abs=1e-5)
        assert _max_diff(state, reference.state_dict()) < EMB_TOL
        if "pp" in strategy:  # the tables live on the first stage; bytes are checked without pp
            continue
        # per step: the batch's unique tokens and its positions, as fp32 rows each way, plus the
        # int64 indices (ids to the host, their positions among the unique rows back)
        rows = torch.unique(xs).numel() + xs.shape[1]
        indices = xs.numel() + xs.shape[1]
        expected = rows * n_embd * 4 + indices * 8
        assert moved == {"to_host": expected, "to_device": expected}
        table_bytes = (64 + 16) * n_embd * 4
        assert expected < table_bytes


# ---- fp16 with ZeRO: the loss scaler sees every full gradient before any shard steps ---------------------
# fp16 gradients carry fp16 rounding (relative 2**-11), and each dp rank computes them on its half
# of the batch, so they round differently from the single device's; each SGD step (lr 0.5,
# |g| <~ 0.1) can differ by lr * |g| * 2**-10 ~ 5e-5 per entry, 2e-4 over 4 steps. A step taken
# with the loss scale left in moves entries by 2**15 times too much, a skipped one by O(lr * |g|).
FP16_SGD_TOL = 2e-4


def test_fp16_with_zero_matches_loss_scaled_reference_and_skips_overflow_together(launched):
    steps = FP16_STEPS
    results = launched("fp16_zero")
    x, y = token_batch(batch=8)
    reference, ref_losses = targets.train_mixed_reference(tiny_gpt(), [(x, y)], lm_loss, targets.sgd(), steps,
                                                          torch.float16, loss_scale=2.0 ** 15)
    for rank, run in ((rank, run) for rank, runs in enumerate(results) for run in runs):  # zero=1, 2, 3
        assert run["skipped"] == 0 and run["scale"] == 2.0 ** 15
        assert run["losses"] == pytest.approx(ref_losses, abs=4e-3)  # fp16 losses: 2**-8 steps near 4
        assert _max_diff(run["state"], reference.state_dict()) < FP16_SGD_TOL
        # rank 0's overflow skips the step on every rank: nothing moves, each rank's scale halves
        overflowed = run["overflowed"]
        assert overflowed["skipped"] == 1 and overflowed["scale"] == (2.0 ** 39 if rank == 0 else 2.0 ** 14)
        assert _max_diff(overflowed["state"], run["state"]) == 0
