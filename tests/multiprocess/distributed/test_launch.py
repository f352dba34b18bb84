"""graphpar.launch: results by rank, and failures that never hang."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import graphpar
import graphpar.distributed.launch as launch_module
from graphpar.distributed.launch import LaunchError, launch
from tests.targets import launch_targets as targets

# timeouts of a few seconds, and how long a failing launch takes, are asserted: alone on the machine
pytestmark = pytest.mark.serial


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


def test_ranks_see_the_environment_as_it_is_at_the_call(monkeypatch):
    # Ranks fork from a fork server started by an earlier launch: what the caller changed
    # since must still reach them, set and unset alike.
    launch(targets.rank_and_allreduce, world_size=1)
    monkeypatch.setenv("GRAPHPAR_TEST_LATE", "late")
    monkeypatch.delenv("GRAPHPAR_TEST_GONE", raising=False)
    os.environ["GRAPHPAR_TEST_GONE"] = "here"
    launch(targets.rank_and_allreduce, world_size=1)
    del os.environ["GRAPHPAR_TEST_GONE"]
    names = ("GRAPHPAR_TEST_LATE", "GRAPHPAR_TEST_GONE")
    assert launch(targets.environment, world_size=2, args=(names,)) == [
        {"GRAPHPAR_TEST_LATE": "late", "GRAPHPAR_TEST_GONE": None}] * 2


def test_ranks_write_to_the_callers_output_at_the_call(capfd):
    # pytest points file descriptors 1 and 2 at a new file for each test; the fork server
    # was started under another test's, so the ranks must be given the current ones.
    launch(targets.print_rank, world_size=2)
    out, err = capfd.readouterr()
    assert [line for line in out.splitlines() if line.startswith("stdout of")] == [
        "stdout of rank 0", "stdout of rank 1"], out
    assert [line for line in err.splitlines() if line.startswith("stderr of")] == [
        "stderr of rank 0", "stderr of rank 1"], err


def test_ranks_exit_when_the_caller_is_killed(tmp_path):
    script = Path(__file__).parents[3] / "tests" / "targets" / "fault_scripts" / "launch_then_sleep.py"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    caller = subprocess.Popen([sys.executable, str(script), str(tmp_path)], env=env)
    try:
        pid_files = [tmp_path / f"rank{rank}.pid" for rank in range(2)]
        deadline = time.monotonic() + 60  # starting the caller and its fork server under load
        while not all(f.exists() and f.read_text() for f in pid_files):
            assert time.monotonic() < deadline, "the ranks never started"
            time.sleep(0.2)
        pids = [int(f.read_text()) for f in pid_files]
    finally:
        caller.send_signal(signal.SIGKILL)
        caller.wait()
    # The watch thread wakes when the pipe from the caller closes; 30 s allows for a loaded machine.
    deadline = time.monotonic() + 30
    while any(_alive(pid) for pid in pids):
        assert time.monotonic() < deadline, f"ranks {[p for p in pids if _alive(p)]} outlived their caller"
        time.sleep(0.2)


@pytest.mark.parametrize("preload, expected", [("", "False"), ("xml.dom.minidom", "True")])
def test_modules_named_in_the_preload_variable_are_imported_before_ranks_start(preload, expected):
    # A fresh caller: the variable is read when its fork server starts. xml.dom.minidom is
    # a module nothing in graphpar or torch imports.
    script = Path(__file__).parents[3] / "tests" / "targets" / "fault_scripts" / "launch_with_preload.py"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), GRAPHPAR_LAUNCH_PRELOAD=preload)
    done = subprocess.run([sys.executable, str(script), "xml.dom.minidom"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == expected


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # An exited rank whose parent (the fork server) has not reaped it yet is a zombie.
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


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
