"""graphpar.tools.data on launched dp ranks: evaluate_exact across ranks, and an uneven dataset
trains the same number of steps on every rank. Every case of one world size runs in one launch
(tests/targets/cases.py)."""

import pytest
import torch

from graphpar.tools.data import shard_indices
from tests.targets import data_targets
from tests.targets.cases import SharedLaunches
from tests.unit.tools.test_data import MSE_RTOL, _reference


N, BATCH_SIZE, TRAIN_WORLD, EPOCHS = 37, 4, 2, 2


@pytest.fixture(scope="module")
def launched():
    return SharedLaunches({
        **{("evaluate", world): (world, data_targets.evaluate_dp, (N, BATCH_SIZE)) for world in (2, 3)},
        "train": (TRAIN_WORLD, data_targets.train_epochs_dp, (N, BATCH_SIZE, EPOCHS)),
    })


@pytest.mark.parametrize("world", [2, 3])
def test_evaluate_exact_across_dp_ranks_equals_the_single_process_metric(launched, world):
    ref_mse, ref_accuracy = _reference(37)
    results = launched(("evaluate", world))
    for rank, (mse, accuracy, reads, mismatch) in enumerate(results):
        torch.testing.assert_close(mse, ref_mse, rtol=MSE_RTOL, atol=0)
        assert accuracy == ref_accuracy
        # Each rank read exactly its padded shard (the pad tests show the shards' valid
        # entries cover the dataset once).
        plan = shard_indices(37, world, rank, 4, remainder="pad")
        assert reads == [i for batch in plan.batches for i in batch]
        assert f"ranks' datasets differ in length (from 37 to {37 + world - 1} samples" in mismatch


# ---- training -----------------------------------------------------------------------------

def test_uneven_dataset_trains_the_same_number_of_steps_on_every_rank(launched):
    n, batch_size, world = N, BATCH_SIZE, TRAIN_WORLD
    report = launched("train")
    orders = []
    for epoch in range(2):
        ranks = [r[epoch] for r in report]
        # remainder="drop": floor(37 / (2 * 4)) = 4 steps, the last 5 samples skipped.
        assert [r["steps"] for r in ranks] == [r["len"] for r in ranks] == [n // (world * batch_size)] * world
        reads = [i for r in ranks for i in r["reads"]]
        assert len(reads) == len(set(reads)) == 32
        assert ranks[0]["losses"] == ranks[1]["losses"]  # train_step's global mean
        orders.append(reads)
    assert orders[0] != orders[1]  # set_epoch reshuffled
