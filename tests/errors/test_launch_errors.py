"""docs/errors.md, Launch and process groups (graphpar/distributed/launch.py,
graphpar/distributed/groups.py):
every entry triggered here and its message checked for the value it names, the rule
and the fix (tests/errors/test_catalogue.py checks that the doc and the cases agree)."""
from __future__ import annotations

import importlib
import threading

import pytest

from graphpar.distributed.launch import LaunchError, launch
from tests.targets import catalogue_targets as targets
from tests.targets import launch_targets
from tests.errors.catalogue import entry_test, expect, registrar

# launches with 1-second timeouts (E-launch-hang): alone on the machine, after the rest of ./run tests
pytestmark = pytest.mark.serial


CASES = {}
case = registrar(CASES)
launch_module = importlib.import_module("graphpar.distributed.launch")
distributed_module = importlib.import_module("graphpar.distributed.groups")


@case("E-launch-world-size")
def _():
    expect(ValueError, lambda: launch(launch_targets.echo_args, world_size=0), "world_size must be an int >= 1, got 0")


@case("E-launch-timeout")
def _():
    expect(ValueError, lambda: launch(launch_targets.echo_args, world_size=1, timeout=-1),
           r"timeout must be a positive.* number of seconds, got -1")


@case("E-launch-fn-type")
def _():
    expect(TypeError, lambda: launch(3, world_size=1), "fn must be callable, got 3")


@case("E-launch-interactive")
def _(monkeypatch):
    def interactive():
        return 0
    interactive.__module__ = "__main__"
    interactive.__qualname__ = "interactive"
    monkeypatch.delattr(importlib.import_module("__main__"), "__file__", raising=False)
    expect(ValueError, lambda: launch(interactive, world_size=1), "fn 'interactive' was defined interactively",
           "module level in a .py file")


@case("E-launch-pickle-fn")
def _():
    expect(ValueError, lambda: launch(lambda: 0, world_size=1), "cannot be pickled", "module level")


@case("E-launch-pickle-args")
def _():
    expect(ValueError, lambda: launch(targets.take, world_size=1, args=(threading.Lock(),)),
           "args for 'take' cannot be pickled", "Fix: pass picklable arguments")


@case("E-launch-env")
def _():
    expect(ValueError, lambda: launch(targets.take, world_size=1, args=(1,), env={"A": 1}),
           r"env must map str to str, got \{'A': 1\}")


@case("E-launch-rank-failed")
def _():
    error = expect(LaunchError, lambda: launch(launch_targets.raise_on_rank1_while_peer_waits, world_size=2,
                                               timeout=60),
                   "rank 1 failed: ValueError: boom on rank 1", "Traceback")
    assert error.count("explode_on_rank1") >= 1


@case("E-launch-rank-died")
def _():
    expect(LaunchError, lambda: launch(launch_targets.exit_abruptly_on_rank1, world_size=2, args=("exit",),
                                       timeout=60),
           "rank 1 failed: process exited with code 7")


@case("E-launch-hang")
def _(monkeypatch):
    monkeypatch.setattr(launch_module, "DEADLINE_GRACE_S", 1.0)
    expect(LaunchError, lambda: launch(launch_targets.rank1_never_finishes, world_size=2, timeout=1),
           r"ranks \[1\] did not finish within 2 s: probably blocked in a collective")


@case("E-launch-unpickle")
def _():
    expect(LaunchError, lambda: launch(targets.take, world_size=1, args=(targets.Unpicklable(),)),
           "rank 0 could not unpickle fn/args", "refuses to be unpickled", "importable in a fresh interpreter")


@case("E-launch-return-pickle")
def _():
    expect(LaunchError, lambda: launch(targets.return_a_lock, world_size=1),
           "the return value of 'return_a_lock' on rank 0 cannot be pickled back to the parent")


@case("E-launch-timeout-env")
def _(monkeypatch):
    monkeypatch.setenv("GRAPHPAR_TIMEOUT_S", "soon")
    expect(ValueError, distributed_module._timeout_from_env, "GRAPHPAR_TIMEOUT_S='soon' is not a positive number",
           "Fix:")
    for out_of_range in ("1e30", "0.0001"):  # gloo overflows, or rounds to no timeout at all
        monkeypatch.setenv("GRAPHPAR_TIMEOUT_S", out_of_range)
        expect(ValueError, distributed_module._timeout_from_env, f"GRAPHPAR_TIMEOUT_S='{out_of_range}' is not a "
               "positive number of seconds between 0.001 and 1e\\+09", "Fix: set it to e.g. GRAPHPAR_TIMEOUT_S=120")


@case("E-launch-no-env")
def _(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    expect(RuntimeError, launch_module.init_process_group_from_env,
           "cannot initialise torch.distributed: environment variables .* are not set", "torchrun|launch")


test_entry = entry_test(CASES)
