"""graphpar.tools.data in one process: dataset sharding across dp ranks, DistributedBatches and
evaluate_exact (on launched dp ranks: tests/multiprocess/tools/test_data.py)."""
import itertools

import pytest
import torch
import torch.nn.functional as F

from graphpar.tools.data import DistributedBatches, ShardPlan, evaluate_exact, shard_indices
from graphpar.distributed.mesh import Mesh
from tests.targets.data_targets import RegressionSet, correct, squared_error, tiny_regressor


# Small enough to enumerate, and covering n below, at and above one global batch, dp=1,
# batch_size=1 and lengths that do and do not divide.
GRID = [(n, dp, b) for n, dp, b in itertools.product([0, 1, 5, 8, 13, 37], [1, 2, 3, 4], [1, 2, 4])]


def _plans(n, dp, b, **kwargs):
    return [shard_indices(n, dp, r, b, **kwargs) for r in range(dp)]


def _valid_indices(plans):
    return [i for plan in plans for batch, flags in zip(plan.batches, plan.valid)
            for i, ok in zip(batch, flags) if ok]


# ---- shard_indices ----------------------------------------------------------------------

@pytest.mark.parametrize("shuffle", [False, True])
def test_drop_reads_each_sample_at_most_once_in_equal_full_batches(shuffle):
    for n, dp, b in GRID:
        if n < dp * b:
            continue  # an error, tested below
        plans = _plans(n, dp, b, shuffle=shuffle, seed=7)
        seen = [i for plan in plans for batch in plan.batches for i in batch]
        assert len(seen) == len(set(seen)), (n, dp, b)
        assert {len(plan) for plan in plans} == {n // (dp * b)}
        assert all(len(batch) == b for plan in plans for batch in plan.batches)
        assert all(all(flags) for plan in plans for flags in plan.valid)
        assert plans[0].dropped == n % (dp * b) == n - len(seen)


@pytest.mark.parametrize("shuffle", [False, True])
def test_pad_covers_every_sample_exactly_once_among_valid_entries(shuffle):
    for n, dp, b in GRID:
        plans = _plans(n, dp, b, remainder="pad", shuffle=shuffle, seed=7)
        assert sorted(_valid_indices(plans)) == list(range(n)), (n, dp, b)
        assert {len(plan) for plan in plans} == {-(-n // (dp * b))}
        assert all(len(batch) == b for plan in plans for batch in plan.batches)
        assert sum(plan.num_valid for plan in plans) == n


def test_each_step_deals_consecutive_samples_and_pads_from_the_start():
    # n=11, dp=2, b=3: steps take 6 samples; rank 1 takes the second half of each step.
    plan = shard_indices(11, 2, 1, 3, remainder="pad")
    assert plan.batches == [[3, 4, 5], [9, 10, 0]]
    assert plan.valid == [[True, True, True], [True, True, False]]
    assert shard_indices(11, 2, 0, 3).batches == [[0, 1, 2]]


def test_shuffle_is_one_permutation_shared_by_the_ranks_and_changes_with_the_epoch():
    def global_order(epoch, seed=5):
        plans = _plans(37, 3, 4, remainder="pad", shuffle=True, seed=seed, epoch=epoch)
        # Re-interleave the ranks' batches step by step: agreeing ranks rebuild one order.
        return [i for step in zip(*(p.batches for p in plans)) for batch in step for i in batch][:37]

    first = global_order(0)
    assert sorted(first) == list(range(37)) and first != list(range(37))
    assert global_order(0) == first  # same seed and epoch: the same order on every call
    assert global_order(1) != first
    assert global_order(0, seed=6) != first
    # seed and epoch are not simply added (DistributedSampler's seed + epoch collides).
    assert global_order(1, seed=0) != global_order(0, seed=1)


def test_masked_mean_is_exact_where_a_padded_mean_is_skewed():
    # What DistributedSampler-style padding does to a metric: the repeats count twice.
    values = torch.arange(37, dtype=torch.float64)
    plans = _plans(37, 2, 4, remainder="pad")
    every_entry = [i for plan in plans for batch in plan.batches for i in batch]
    assert values[every_entry].mean() != values.mean()  # 40 entries, 3 repeats of 0, 1, 2
    assert values[_valid_indices(plans)].mean() == values.mean()


@pytest.mark.parametrize("call, message", [
    (lambda: shard_indices(37, 2, 0, 0), r"batch_size=0 is invalid: it must be an int >= 1\. Fix"),
    (lambda: shard_indices(37, 2, 0, 32),
     r"37 samples is shorter than one global batch of dp \* batch_size = 2 \* 32 = 64 .*zero batches"
     r"\. Fix: use batch_size <= 18"),
    (lambda: shard_indices(1, 2, 0, 1), r"Fix: use fewer dp ranks than samples, or remainder=\"pad\""),
    (lambda: shard_indices(37, 2, 0, 4, remainder="last"),
     r"remainder='last' is invalid: it must be one of \('drop', 'pad'\).*Fix"),
    (lambda: shard_indices(37, 2, 2, 4), r"dp_rank=2 is invalid: it must be an int in \[0, 2\)"),
    (lambda: shard_indices(37, 2, 0, 4, shuffle=True, epoch=-1), r"epoch=-1 is invalid"),
])
def test_bad_arguments_name_the_value_the_rule_and_a_fix(call, message):
    with pytest.raises(ValueError, match=message):
        call()


# ---- DistributedBatches -----------------------------------------------------------------

def test_distributed_batches_read_only_their_shard_in_equal_numbers():
    lengths, reads = set(), []
    for rank in range(3):
        data = RegressionSet(37)
        batches = DistributedBatches(data, 4, dp=3, dp_rank=rank)
        xs = [x for x, _ in batches]
        lengths.add(len(batches))
        assert len(xs) == len(batches) and all(x.shape == (4, 3) for x in xs)
        assert sorted(data.reads) == sorted(i for b in batches.plan().batches for i in b)
        reads += data.reads
    assert lengths == {37 // 12}
    assert len(reads) == len(set(reads)) == 36


def test_distributed_batches_take_dp_from_a_mesh_and_follow_set_epoch():
    mesh = Mesh(dp=2, tp=1, pp=1, rank=1)
    batches = DistributedBatches(RegressionSet(37), 4, mesh, shuffle=True)
    assert (batches.dp, batches.dp_rank) == (2, 1)
    first = batches.plan().batches
    batches.set_epoch(1)
    assert batches.plan().batches != first
    with pytest.raises(ValueError, match="dp=4 contradicts the mesh, where dp is 2"):
        DistributedBatches(RegressionSet(37), 4, mesh, dp=4)


def test_padded_batches_come_with_their_mask():
    batches = DistributedBatches(RegressionSet(37), 4, dp=2, dp_rank=1, remainder="pad")
    masks = [valid for _, valid in batches.masked()]
    # 5 global batches of 8 cover positions 0..39; rank 1's last slots are 36..39, of which
    # only sample 36 exists.
    assert len(masks) == 5 and masks[-1].tolist() == [True, False, False, False]
    assert masks[0].dtype == torch.bool


# ---- evaluate_exact ---------------------------------------------------------------------

def _reference(n):
    """The single-process metrics on the whole dataset, as a user would compute them."""
    data = RegressionSet(n)
    with torch.no_grad():
        out = tiny_regressor()(data.x)
    return F.mse_loss(out, data.y).item(), correct(out, data.y).double().mean().item()


# Per-element squared errors are the same float32 numbers in every setup (up to the rounding
# of a matmul over a different batch size); only the order and precision of the final sum
# differ: F.mse_loss adds 74 float32 values, evaluate_exact adds them in float64, in shard
# order, across ranks. float32's relative resolution is 6e-8, so 1e-6 is a few ulps of the
# float32 reference's own rounding. Accuracy is a ratio of integer counts: exact.
MSE_RTOL = 1e-6


def test_evaluate_exact_in_one_process_matches_the_whole_dataset_metric():
    data, model = RegressionSet(37), tiny_regressor()
    ref_mse, ref_accuracy = _reference(37)
    torch.testing.assert_close(evaluate_exact(model, data, 4, squared_error), ref_mse,
                               rtol=MSE_RTOL, atol=0)
    assert evaluate_exact(model, data, 5, correct) == ref_accuracy


def test_evaluate_exact_rejects_a_reduced_metric():
    with pytest.raises(ValueError, match=r"metric_sum_fn returned shape \[\].*reduction='none'"):
        evaluate_exact(tiny_regressor(), RegressionSet(9), 4, F.mse_loss)


def test_shard_plan_is_a_plain_dataclass():
    plan = shard_indices(5, 1, 0, 2)
    assert isinstance(plan, ShardPlan) and len(plan) == 2 and plan.dropped == 1
