"""fp32 gradients for bf16 weights (issue 17) on launched ranks: with param_dtype=bf16 the
gradients accumulate over microbatches and reduce over dp in fp32 (Strategy.reduce_dtype=None),
which keeps training close to fp32 training where bf16 accumulation drifts away; and the
gradients and their reductions really are fp32, or bf16 with reduce_dtype=bf16, at every ZeRO
stage. One launch runs every case (process start-up dominates these small runs)."""
import pytest
import torch

import graphpar as gp
from graphpar.distributed.launch import launch
from tests.targets import reduce_dtype_targets as targets

DP = 2
STEPS = 20
# Each microbatch of a dp rank holds the same samples, so each adds the same bf16 gradient h to
# the running sum: the case where the accumulation dtype matters most. A bf16 sum of k such
# terms keeps 8 significant bits, so from k = 64 on every addition is rounded by up to h/8,
# from k = 128 on by up to h/4 - the same rounding every step (the data repeat), so the weights
# drift; an fp32 sum is exact to 2**-24. With fewer microbatches the bf16 rounding of the sum
# is no larger than that of each microbatch's own bf16 gradient, which both runs share, and
# the two runs cannot be told apart by their losses.
MICROBATCHES = 128
FP32 = dict(dp=DP, microbatches=MICROBATCHES)
LOSS_RUNS = {"fp32": FP32,
             "fp32 gradients": dict(FP32, param_dtype="bf16"),
             "bf16 gradients": dict(FP32, param_dtype="bf16", reduce_dtype="bf16")}
# the ZeRO stages' own reductions, two microbatches (zero=3 reduce-scatters each)
SHARDED = dict(dp=DP, microbatches=2, param_dtype="bf16")
ZERO_RUNS = {"zero1": dict(SHARDED, zero=1), "zero3": dict(SHARDED, zero=3),
             "zero3 bf16 gradients": dict(SHARDED, zero=3, reduce_dtype="bf16")}
# The bar: bf16 weights with fp32 gradients stay within 1% of fp32 training's loss at
# every step (measured here: at most 0.13%, the bf16 rounding of the weights in the forward).
WITHIN = 0.01
# bf16 gradients land on average at least this many times further from the fp32 losses than
# fp32 gradients (measured: 6 times, 0.29% against 0.048%); with the accumulation in bf16
# under another name, both would be the same run, 1 time.
FURTHER = 3


@pytest.fixture(scope="module")
def runs():
    cases = ([(gp.Strategy(**s).to_dict(), STEPS) for s in LOSS_RUNS.values()]
             + [(gp.Strategy(**s).to_dict(), 2) for s in ZERO_RUNS.values()])
    results = launch(targets.train_many, world_size=DP, args=(cases,))
    return [dict(zip([*LOSS_RUNS, *ZERO_RUNS], rank)) for rank in results]


def _distances(losses, reference):
    return [abs(a - b) / b for a, b in zip(losses, reference)]


def test_fp32_gradients_keep_bf16_weights_within_1_percent_of_fp32_and_closer_than_bf16_gradients(runs):
    for rank in runs:  # train_step's loss is the global mean: the same on every rank
        fp32 = rank["fp32"]["losses"]
        near = _distances(rank["fp32 gradients"]["losses"], fp32)
        far = _distances(rank["bf16 gradients"]["losses"], fp32)
        assert len(fp32) == STEPS and max(near) < WITHIN, near
        assert sum(far) > FURTHER * sum(near), (near, far)


def _gradient_reductions(run):
    """(op, dtype, elements) of the step's gradient reductions: every reduction but the float64
    all-reduce of the loss (graphpar/runtime/module.py, ParallelModule._global_mean)."""
    return [r for r in run["reductions"] if r[1] != torch.float64]


def test_gradients_and_their_reductions_are_fp32_unless_reduce_dtype_says_bf16(runs):
    params = list(targets.TwoLayers().parameters())
    elements, tensors = sum(p.numel() for p in params), len(params)
    # one bucket (the default 25 MB): the flat gradients and one usage flag per parameter;
    # ZeRO's reduction reads dp rows of the rank's shard and the flags: on gloo, which has no
    # reduce-scatter of its own, each rank sends every other rank its row (zero._exchange_rows)
    flat = elements + tensors
    row = -(-elements // DP) + tensors
    sent = [("isend", torch.float32, row)] * (DP - 1)   # one row to each other rank
    expected = {
        "fp32": ([("all_reduce", torch.float32, flat)], torch.float32, torch.float32),
        "fp32 gradients": ([("all_reduce", torch.float32, flat)], torch.bfloat16, torch.float32),
        "bf16 gradients": ([("all_reduce", torch.bfloat16, flat)], torch.bfloat16, torch.bfloat16),
        # zero=1 keeps each gradient whole (fp32, its own shard replaced by the dp average)
        "zero1": (sent, torch.bfloat16, torch.float32),
        # zero=3 reduces every microbatch's gradients and keeps none; its programs hold
        # no parameter of a bucket, only the gathers of its bf16 shards
        "zero3": (sent * 2, None, None),
        "zero3 bf16 gradients": ([("isend", torch.bfloat16, row)] * (DP - 1) * 2, None, None),
    }
    for rank in runs:
        for name, (reductions, weight, grad) in expected.items():
            run = rank[name]
            assert _gradient_reductions(run) == reductions, name
            assert set(run["weights"].values()) == ({weight} if weight else set()), name
            assert set(run["grads"].values()) == ({grad} if grad else set()), name
