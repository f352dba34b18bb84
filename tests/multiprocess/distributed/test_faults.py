"""Faults that never hang (issue #7).

A rank that raises, is killed or never arrives in the middle of a train step ends the run on
every rank with a nonzero exit and an error naming that rank, within the collective timeout
+ 30 s, under graphpar.launch and under torchrun. The faults are injected at step 3 of a
real compiled tiny GPT (tests/targets/fault_targets.py): inside the last pipeline stage's
forward (a leaf module of the stage program) or just before a step.

Every run here is bounded twice: by the behaviour under test (the collective timeout), and
by a hard limit of the test itself (SIGALRM around launch, a killed process tree around
torchrun), so a regression fails instead of hanging the suite.
"""
import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from graphpar.distributed.launch import LaunchError, launch
from tests.targets import fault_targets

# the collective timeout and how long detection takes are asserted: alone on the machine
pytestmark = pytest.mark.serial


# Collective timeout of these runs: far above a tiny GPT step (~0.1 s) and the compile skew
# between ranks (~1 s) on 2 shared cores, small enough to keep the file fast.
TIMEOUT_S = 6
# The bound, from the moment of the fault to the end of the run.
ACCEPT_S = TIMEOUT_S + 30
# The test's own bound on a whole run: process start-up and compile (~5 s) plus ACCEPT_S,
# with room for a loaded machine.
HARD_LIMIT_S = ACCEPT_S + 40
# A rank's collective may have started waiting a little before the faulty rank stamped its
# fault time (it posted its receive first); one second covers that on a loaded machine.
STAMP_SLACK_S = 1.0

REPO = Path(__file__).resolve().parents[3]
SCRIPT = REPO / "tests" / "targets" / "fault_scripts" / "train_with_fault.py"


class HardLimit(Exception):
    pass


@contextlib.contextmanager
def hard_limit(seconds):
    """Interrupt the main thread after `seconds` (launch then stops its ranks and re-raises)."""
    def expire(signum, frame):
        raise HardLimit(f"the run did not end within the test's hard limit of {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def seconds_since_fault(stamps: Path, rank) -> float:
    return time.time() - float((stamps / f"rank{rank}").read_text())


def launch_with_fault(how, where, pp, dp, stamps, rank=1):
    with hard_limit(HARD_LIMIT_S), pytest.raises(LaunchError) as info:
        launch(fault_targets.train_with_fault, world_size=pp * dp, args=(how, where, pp, dp, rank),
               timeout=TIMEOUT_S, env={"GRAPHPAR_FAULT_STAMPS": str(stamps)})
    return info.value, seconds_since_fault(stamps, rank)


# ---- graphpar.launch ---------------------------------------------------------------------

def test_launch_exception_in_a_stage_forward(tmp_path):
    error, elapsed = launch_with_fault("raise", "forward", pp=2, dp=1, stamps=tmp_path)
    message = str(error)
    assert message.startswith("rank 1 failed: InjectedFault: injected fault on rank 1 in a "
                              "pipeline stage's forward"), message
    assert error.rank == 1
    # raised from the stage program that the pipeline executor ran
    assert "pipeline/executor.py" in message and "in forward" in message
    assert elapsed < ACCEPT_S


def test_launch_rank_killed_in_a_stage_forward(tmp_path):
    error, elapsed = launch_with_fault("kill", "forward", pp=2, dp=1, stamps=tmp_path)
    assert str(error).startswith("rank 1 failed: process was killed by SIGKILL"), str(error)
    assert error.rank == 1
    assert elapsed < ACCEPT_S


def test_launch_rank_that_never_arrives_in_a_stage_forward(tmp_path):
    # dp=2 x pp=2: rank 3 (stage 1 of the second replica) stalls. Its pp peer (rank 1) and
    # dp peer (rank 2) time out waiting for it, and rank 0 waiting for rank 1: whichever
    # reports first must name rank 3, not a rank that merely waited.
    error, elapsed = launch_with_fault("stall", "forward", pp=2, dp=2, stamps=tmp_path, rank=3)
    message = str(error)
    assert re.match(r"rank [012] failed: PeerFailureError: rank 3 never arrived", message), message
    assert "rank 3 never arrived: it is alive" in message and "in step 3" in message
    assert "fault_targets.py" in message              # where rank 3 is stuck
    assert f"(now {TIMEOUT_S} s)" in message          # launch(timeout=) reached the dp and pp waits
    assert 3 in error.unfinished
    assert TIMEOUT_S - STAMP_SLACK_S <= elapsed < ACCEPT_S


# ---- torchrun ----------------------------------------------------------------------------

def _descendants(pid):
    """Every process below `pid` (torchrun starts its workers in new sessions, so killing its
    process group would leave them running)."""
    children = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def torchrun_with_fault(how, where, pp, dp, stamps):
    env = {**os.environ, "GRAPHPAR_TIMEOUT_S": str(TIMEOUT_S), "GRAPHPAR_FAULT_STAMPS": str(stamps)}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", str(pp * dp), str(SCRIPT), how, where, str(pp), str(dp)]
    proc = subprocess.Popen(command, env=env, cwd=stamps, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        output, _ = proc.communicate(timeout=HARD_LIMIT_S)
    except subprocess.TimeoutExpired:
        for pid in _descendants(proc.pid) + [proc.pid]:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"torchrun did not end within {HARD_LIMIT_S} s:\n{output[-4000:]}")
    return proc.returncode, output, seconds_since_fault(stamps, rank=1)


def finished(output):
    return re.search(r"^trained: losses", output, re.M) is not None


def root_cause(output):
    """torchrun's "Root Cause (first observed failure)" block of its failure summary."""
    match = re.search(r"Root Cause \(first observed failure\):\n(.*?)\n=+", output, re.S)
    assert match, output[-4000:]
    return match.group(1)


def test_torchrun_exception_in_a_stage_forward(tmp_path):
    code, output, elapsed = torchrun_with_fault("raise", "forward", pp=2, dp=1, stamps=tmp_path)
    assert code != 0 and not finished(output)
    cause = root_cause(output)
    # the error file run_in_process_group writes puts the exception in torchrun's summary
    assert re.search(r"rank\s*: 1 \(local_rank: 1\)", cause), cause
    assert "InjectedFault: injected fault on rank 1 in a pipeline stage's forward" in cause
    assert elapsed < ACCEPT_S


def test_torchrun_rank_killed_in_a_stage_forward(tmp_path):
    code, output, elapsed = torchrun_with_fault("kill", "forward", pp=2, dp=1, stamps=tmp_path)
    assert code != 0 and not finished(output)
    cause = root_cause(output)
    assert re.search(r"rank\s*: 1 \(local_rank: 1\)", cause), cause
    assert "Signal 9 (SIGKILL)" in cause
    assert elapsed < ACCEPT_S


def test_torchrun_rank_that_never_arrives_before_a_step(tmp_path):
    code, output, elapsed = torchrun_with_fault("stall", "before_step", pp=1, dp=2, stamps=tmp_path)
    assert code != 0 and not finished(output)
    cause = root_cause(output)
    # torchrun blames rank 0, the first to exit; rank 0's error (its error file) names rank 1
    assert re.search(r"rank\s*: 0 \(local_rank: 0\)", cause), cause
    assert "PeerFailureError: rank 1 never arrived" in cause
    assert "rank 1 never arrived: it is alive" in cause and "after step 2, before the next" in cause
    assert f"(now {TIMEOUT_S} s)" in cause             # GRAPHPAR_TIMEOUT_S reached the dp group's waits
    assert TIMEOUT_S - STAMP_SLACK_S <= elapsed < ACCEPT_S
