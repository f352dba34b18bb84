"""Several test cases in one launched world. Start-up (spawning the ranks, importing torch, the
rendezvous) costs more than a small case, so a test module runs all of its cases of one world
size in one launch: `run_cases` on the ranks (launch(run_cases, world_size, args=(cases,))),
`case_results` in each test, which fails with the case's own tracebacks.

A case that raises does not end the launch: the next case runs once every rank has come out of
the failing one. A rank left waiting in a collective that a failing rank never reached would
pair it with the next case's collectives, so if some rank does not come out within half the
collective timeout, every rank stops there and the cases after it report that they did not run.
"""
import os
import traceback
from datetime import timedelta

import pytest
import torch.distributed as dist

from graphpar.distributed import groups
from graphpar.distributed.launch import LaunchError, launch

_KEY = "tests.targets.cases"


def run_cases(cases):
    """cases: [(function, args) or (function, args, kwargs)], run in order on every rank. Per
    case run, ("ok", its value) or ("error", its traceback); a list shorter than `cases` when
    the ranks stopped early."""
    store = _store()
    outcomes = []
    for index, (fn, args, *kwargs) in enumerate(cases):
        try:
            outcomes.append(("ok", fn(*args, **(kwargs[0] if kwargs else {}))))
        except (Exception, pytest.skip.Exception):  # a skip inside a case (importorskip) is its error too
            outcomes.append(("error", f"rank {dist.get_rank()}: {traceback.format_exc()}"))
        if not _every_rank_came_out(store, index):
            break
    return outcomes


def _store():
    # a client of the rendezvous store that init_process_group (env://) started on rank 0
    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                         timeout=timedelta(seconds=groups.DEFAULT_TIMEOUT_S / 2))


def _every_rank_came_out(store, index):
    """Whether every rank finished case `index` and none gave up waiting for the others."""
    keys = [f"{_KEY}/{index}/{rank}" for rank in range(dist.get_world_size())]
    try:
        store.set(keys[dist.get_rank()], "done")
        store.wait(keys)
        return not store.check([f"{_KEY}/stop"])
    except Exception:  # the wait timed out, or the store's host (rank 0) has gone
        try:
            store.set(f"{_KEY}/stop", "stop")
        except Exception:
            pass  # rank 0 returned: the others see the store gone just as this rank did
        return False


def case_results(results, index, what):
    """Each rank's value of case `index` of a run_cases launch (`results`: launch's list), or a
    test failure naming `what` with the tracebacks of the ranks where it raised."""
    values, errors = _split(results, index)
    if errors:
        pytest.fail(f"{what} failed in the shared launch:\n" + "\n".join(errors), pytrace=False)
    return values


def case_errors(results, index, what):
    """Each rank's traceback of case `index`, which must have raised on every rank (a refusal)."""
    values, errors = _split(results, index)
    if values:
        pytest.fail(f"{what} returned on {len(values)} rank(s) instead of raising: {values}", pytrace=False)
    return errors


def _split(results, index):
    """Case `index`'s values and errors over the ranks; a case the ranks never reached is an error."""
    values, errors = [], []
    for rank, outcomes in enumerate(results):
        if index >= len(outcomes):
            errors.append(f"rank {rank}: did not run: the ranks stopped after case {len(outcomes) - 1} "
                          f"(a rank stayed in it; see that case's failure)")
            continue
        status, value = outcomes[index]
        (values if status == "ok" else errors).append(value)
    return values, errors


class SharedLaunches:
    """A test module's cases, {name: (world size, function, args[, kwargs])}: the first test that asks
    for a case launches every case of its world size (run_cases), later ones read the results.
    A launch that fails as a whole (a rank died) fails each of its cases' tests with its error."""

    def __init__(self, cases):
        self.cases = cases
        self.runs = {}

    def __call__(self, name):
        """Each rank's value of case `name` (case_results)."""
        return case_results(*self._launched(name), name)

    def errors(self, name):
        """Each rank's traceback of case `name`, which must raise on every rank (case_errors)."""
        return case_errors(*self._launched(name), name)

    def _launched(self, name):
        world_size = self.cases[name][0]
        if world_size not in self.runs:
            names = [n for n, case in self.cases.items() if case[0] == world_size]
            try:
                results = launch(run_cases, world_size=world_size, args=([self.cases[n][1:] for n in names],))
                self.runs[world_size] = (names, results, None)
            except LaunchError as error:
                self.runs[world_size] = (names, None, error)
        names, results, error = self.runs[world_size]
        if error is not None:
            pytest.fail(f"{name}: the launch of every case of world size {world_size} failed: {error}",
                        pytrace=False)
        return results, names.index(name)
