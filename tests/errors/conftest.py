"""The two-rank run whose messages the compile, running and data cases check: one run for
the whole catalogue; and the one four-rank launch of the entries refused there."""
from __future__ import annotations

import pytest

from graphpar.distributed.launch import launch
from tests.targets import catalogue_targets as targets
from tests.targets.cases import SharedLaunches


@pytest.fixture(scope="package")
def two_rank_messages():
    return launch(targets.messages_on_two_ranks, world_size=2)


@pytest.fixture(scope="package")
def four_rank_refusals():
    """Each entry of catalogue_targets.FOUR_RANK_REFUSALS run on four ranks, one launch for all."""
    return SharedLaunches({entry: (4, fn, ()) for entry, fn in targets.FOUR_RANK_REFUSALS.items()})
