"""Dropout RNG under tensor parallelism: per-rank streams in TP regions, shared ones outside.
The runs share one launch (tests/targets/cases.py): a run again in the same processes starts
from torch's global RNG where the first left it, so equal losses show that the masks come from
Strategy.seed alone."""
import pytest

from tests.targets import tp_targets
from tests.targets.cases import SharedLaunches

RUNS = {"first": (0, "local"), "again": (0, "local"), "other_seed": (1, "local"), "tp_invariant": (0, "tp_invariant")}


@pytest.fixture(scope="module")
def launched():
    return SharedLaunches({name: (2, tp_targets.dropout_losses, args) for name, args in RUNS.items()})


def test_local_streams_are_reproducible_and_agree_across_tp_ranks(launched):
    first, again, other_seed = launched("first"), launched("again"), launched("other_seed")
    assert first[0] == first[1]          # replicated values dropped alike on both tp ranks
    assert first == again                # reproducible from Strategy.seed
    assert first[0] != other_seed[0]     # and the seed matters


def test_tp_invariant_masks_give_the_same_losses_at_tp1_and_tp2(launched):
    tp1 = tp_targets.dropout_losses(0, "tp_invariant")
    tp2 = launched("tp_invariant")
    # same masks; the row-parallel sum order differs: float32 rounding noise
    assert tp2[0] == pytest.approx(tp1, abs=1e-5)
    local = launched("first")  # the same run as the first of the test above
    assert local[0] != pytest.approx(tp1, abs=1e-5)  # the per-rank streams do depend on tp
