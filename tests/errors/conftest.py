"""The two-rank run whose messages the compile, running and data cases check: one run for
the whole catalogue."""
from __future__ import annotations

import pytest

from graphpar.distributed.launch import launch
from tests.targets import catalogue_targets as targets


@pytest.fixture(scope="package")
def two_rank_messages():
    return launch(targets.messages_on_two_ranks, world_size=2)
