"""graphpar.launch: results by rank, and failures that never hang."""

import time

import pytest
import torch

import graphpar
import graphpar.distributed.launch as launch_module
from graphpar.distributed.launch import LaunchError, launch
from tests.targets import launch_targets as targets


def test_returns_results_by_rank_and_collectives_work():
    results = launch(targets.rank_and_allreduce, world_size=2)
    assert [rank for rank, _ in results] == [0, 1]
    for _, reduced in results:
        assert torch.equal(reduced, torch.full((3,), 2.0))


def test_args_env_and_rank_order():
    # Through the package attribute: `graphpar.launch` names the function, not a module of
    # the same name (the module is graphpar.distributed.launch), after any import order.
    assert graphpar.launch is launch
    results = graphpar.launch(targets.echo_args, 3, args=("x", 10),
                              env={"GRAPHPAR_TEST_MARK": "set"})
    assert results == [("x", 0, 10, "set"), ("x", 1, 20, "set"), ("x", 2, 30, "set")]


def test_exception_on_one_rank_stops_the_blocked_rank():
    start = time.monotonic()
    with pytest.raises(LaunchError) as info:
        launch(targets.raise_on_rank1_while_peer_waits, world_size=2, timeout=60)
    elapsed = time.monotonic() - start
    message = str(info.value)
    assert message.startswith("rank 1 failed: ValueError: boom on rank 1")
    assert "explode_on_rank1" in message  # the child's traceback
    assert "Traceback (most recent call last)" in message
    assert info.value.rank == 1
    assert elapsed < 60  # rank 0 sat in a barrier; it was stopped, not waited for


@pytest.mark.parametrize("how, expected", [("exit", "exited with code 7"),
                                           ("kill", "SIGKILL"), ("crash", "SIGSEGV")])
def test_rank_dying_without_exception(how, expected):
    start = time.monotonic()
    with pytest.raises(LaunchError) as info:
        launch(targets.exit_abruptly_on_rank1, world_size=2, args=(how,), timeout=60)
    message = str(info.value)
    assert message.startswith("rank 1 failed: process ")
    assert expected in message
    assert time.monotonic() - start < 60
    # only a crash has stacks to show: faulthandler's, naming the function that crashed
    assert ("exit_abruptly_on_rank1" in message) == (how == "crash")


def test_rank_that_never_arrives_times_out_the_collective():
    timeout = 5
    start = time.monotonic()
    with pytest.raises(LaunchError) as info:
        launch(targets.rank1_never_arrives, world_size=2, timeout=timeout)
    elapsed = time.monotonic() - start
    # rank 0's all_reduce times out and raises; rank 1 is still asleep.
    assert str(info.value).startswith("rank 0 failed:")
    assert info.value.unfinished == [1]
    assert "ranks [1] had not finished" in str(info.value)
    assert timeout <= elapsed < timeout + 35


def test_ranks_still_running_after_others_returned(monkeypatch):
    monkeypatch.setattr(launch_module, "DEADLINE_GRACE_S", 1.0)
    start = time.monotonic()
    with pytest.raises(LaunchError) as info:
        launch(targets.rank1_never_finishes, world_size=2, timeout=1)
    assert str(info.value).startswith("ranks [1] did not finish within 2 s: "
                                      "probably blocked in a collective")
    assert info.value.unfinished == [1]
    assert time.monotonic() - start < 30
