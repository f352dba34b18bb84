"""Local multi-process launcher::

    results = graphpar.launch(fn, world_size=8, args=(...,))

starts ``world_size`` processes on this machine with torch.distributed
initialised (gloo on CPU by default), runs ``fn(*args)`` in each and returns
the return values as a list indexed by rank. It is meant for tests, examples
and single-machine experiments; multi-machine jobs use torchrun, and
:func:`run_in_process_group` lets the same ``fn`` run under either.

Why a fork server
    Forking a parent that has already imported torch copies its OpenMP and
    CUDA state and any threads' held locks into the children, which then
    deadlock or crash intermittently. So ranks never fork from the caller:
    they fork from multiprocessing's fork server, a process started once (on
    the first launch) that has imported graphpar, torch and torch._dynamo
    (FORKSERVER_PRELOAD) and run nothing else, which takes importing torch
    (about 1.5 s of CPU per rank) out of every rank's start, and torch._dynamo
    (about 1 s more) out of its first compile. Where there is no fork server
    (Windows) ranks are spawned. Either way a rank starts from a state that
    does not depend on what the caller did, and gets the caller's environment,
    working directory, ``sys.path``, standard output and standard error as
    they are at the call (the fork server itself was started earlier, so these
    are sent along).
    What torch reads from the environment while it is imported is read once,
    when the fork server starts. ``GRAPHPAR_LAUNCH_PRELOAD`` (comma-separated
    module names, read then too) adds modules every rank would import anyway,
    such as a model library. The price: ``fn`` and ``args`` are pickled,
    so ``fn`` must be a module-level function (not a lambda or a nested
    function) in a module that a fresh interpreter with the parent's
    ``sys.path`` can import. Return values are pickled back; tensors in them
    are detached and moved to the CPU.

Why the thread limit
    Each child would otherwise start one intra-op thread per core, so
    ``world_size`` children run ``world_size`` times more threads than cores.
    gloo collectives then wait on ranks whose threads are descheduled, and a
    test that takes a second can take minutes. Each child gets
    ``max(1, cores // world_size)`` threads (``fn`` may raise it again).

How failures are detected
    Every rank has its own pipe back to the parent and sends exactly one
    message: its pickled result or its formatted traceback. The parent waits
    on those pipes and on the process sentinels together, so it wakes the
    moment a rank reports or dies, without polling. A pipe per rank, rather
    than one shared queue, means a rank killed mid-message cannot corrupt or
    block the other ranks' messages.

    * A rank raises: it reports the traceback; the parent stops (SIGTERM,
      then SIGKILL) the other ranks, which are typically blocked in a
      collective waiting for it, and raises :class:`LaunchError`.
    * A rank dies without reporting (``os._exit``, a segfault, the OOM
      killer): its sentinel fires with no message; same, with the exit code
      or signal in place of a traceback, and for a crash (SIGSEGV, SIGABRT...)
      every thread's Python stack as faulthandler wrote it.
    * A rank never arrives at a collective: the others' collectives time out
      after ``timeout`` seconds and they raise, which is the case above;
      their error (graphpar.distributed.faults.PeerFailureError) names the rank that
      never arrived, from the heartbeats every rank keeps in the rendezvous
      store (docs/faults.md).
    * Some ranks return while others never finish (e.g. they wait in a
      collective the returned ranks skipped, with a backend whose timeout does
      not fire): once any rank has returned, the parent allows the rest
      ``timeout`` + :data:`DEADLINE_GRACE_S` seconds after the latest
      return, then dumps their Python stacks to stderr, kills them and raises.

    Before any rank has returned the parent does not bound the run: ``fn``
    may legitimately train for hours, and the collective timeout already
    turns a rank that stopped participating into an error.

Ctrl-C (KeyboardInterrupt) in the parent stops all ranks before re-raising;
the ranks themselves ignore SIGINT so that shutdown happens in one place. A
rank whose parent disappears (killed with SIGKILL) exits by itself within a
second or so instead of lingering.
"""

from __future__ import annotations

import faulthandler
import io
import os
import pickle
import signal
import sys
import tempfile
import threading
import time
import traceback
import warnings
from datetime import timedelta
from multiprocessing import reduction
from multiprocessing.connection import wait as _wait_for_any
from typing import Any, Callable, Mapping, NamedTuple, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from . import groups as _gp_dist
from . import faults as _faults

__all__ = ["launch", "LaunchError", "run_in_process_group", "init_process_group_from_env", "DEADLINE_GRACE_S"]

#: Seconds, on top of the collective timeout, that ranks still running are
#: given after the latest rank returned, before launch declares them hung.
DEADLINE_GRACE_S = 30.0

# Long enough to run a few finalisers, short enough not to be noticed when a
# rank is wedged in native code and ignores SIGTERM.
_TERMINATE_GRACE_S = 3.0

# Ranks that returned still destroy their process group and run atexit hooks;
# a hang there should not lose the results they already sent.
_EXIT_GRACE_S = 30.0

_STACK_DUMP_SIGNAL = getattr(signal, "SIGUSR1", None)

#: Comma-separated modules the fork server imports besides graphpar, read when it starts.
PRELOAD_ENV = "GRAPHPAR_LAUNCH_PRELOAD"
# what the fork server imports before forking any rank: graphpar, and torch._dynamo, which
# torch imports on a rank's first compile (its fake tensors and export) and which took about
# 1 s of CPU per rank and launch there (sympy and some 800 modules)
FORKSERVER_PRELOAD = ("graphpar", "torch._dynamo")


class LaunchError(RuntimeError):
    """A rank failed, died or hung under :func:`launch`.

    Attributes:
        rank: the rank reported first (the likely root cause), or ``None``
            when no rank failed but some never finished.
        failures: ``{rank: details}`` for every rank that failed by itself;
            details is its traceback, or the exit code/signal if it died.
        unfinished: ranks that were still running when launch stopped them.
    """

    def __init__(
        self,
        message: str,
        rank: int | None = None,
        failures: Mapping[int, str] | None = None,
        unfinished: Sequence[int] = (),
    ):
        super().__init__(message)
        self.rank = rank
        self.failures = dict(failures or {})
        self.unfinished = list(unfinished)


def launch(
    fn: Callable[..., Any],
    world_size: int,
    args: Sequence[Any] = (),
    backend: str | None = "gloo",
    timeout: float | None = None,
    env: Mapping[str, str] | None = None,
) -> list[Any]:
    """Run ``fn(*args)`` in ``world_size`` local processes; return results by rank.

    Each process has torch.distributed initialised with ``backend`` (``None``
    picks nccl when CUDA is available, else gloo) and a collective timeout of
    ``timeout`` seconds (default :data:`graphpar.distributed.groups.DEFAULT_TIMEOUT_S`),
    and the environment torchrun would give it (``RANK``, ``WORLD_SIZE``,
    ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``),
    plus ``env``. ``world_size=1`` still starts one process, so behaviour
    does not change with the size.

    ``fn`` and ``args`` are pickled into fresh processes (see "Why a fork server"), so
    ``fn`` must be a module-level function of an importable module, or of a
    script that calls launch under ``if __name__ == "__main__":``. Return
    values are pickled back (tensors arrive detached, on the CPU).

    Each rank gets the caller's ``os.environ`` as it is at the call, then
    ``env``, once it runs: after torch was imported (in the fork server, at
    the first launch), so variables torch reads while it is imported (e.g.
    ``OMP_NUM_THREADS``) must be in ``os.environ`` before the first launch.

    A rank blocked in a collective raises after ``timeout``, which ends the
    launch. Once some rank has returned, the others get ``timeout`` +
    :data:`DEADLINE_GRACE_S` seconds (after the latest return) to finish
    before they are declared hung; before that, ``fn`` may run as long as
    it needs.

    Raises:
        ValueError: before starting anything, if ``world_size`` is not an
            int >= 1 or ``fn``/``args`` cannot be pickled.
        LaunchError: if a rank raised (message ``"rank 3 failed:
            ValueError: ..."`` followed by its traceback), died, or never
            finished; the other ranks are stopped first.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    timeout_s = _resolve_timeout(timeout)
    payload = _pickle_job(fn, args)
    extra_env = _check_env(env)

    ctx = _context()
    parent = _Parent(dict(os.environ), _ParentFd(1), _ParentFd(2))
    port = _gp_dist.find_free_port()
    threads = max(1, _available_cpus() // world_size)
    procs: list[Any] = []
    conns: list[Any] = []
    crash_dir = tempfile.TemporaryDirectory(prefix="graphpar-crash-")
    crash_logs = [os.path.join(crash_dir.name, f"rank{rank}.txt") for rank in range(world_size)]
    try:
        for rank in range(world_size):
            reader, writer = ctx.Pipe(duplex=False)
            conns.append(reader)
            proc = ctx.Process(
                target=_worker,
                args=(rank, world_size, port, backend, timeout_s, threads,
                      extra_env, payload, writer, parent, crash_logs[rank]),
                name=f"graphpar-rank{rank}",
            )
            procs.append(proc)
            try:
                proc.start()
            finally:
                # Only the child may hold the write end: then a dead child
                # reads as EOF instead of a pipe that might still be written.
                writer.close()
        return _Supervisor(procs, conns, crash_logs).run(timeout_s)
    except BaseException:
        # KeyboardInterrupt included: never leave ranks running behind us.
        _stop(procs)
        raise
    finally:
        for conn in conns:
            conn.close()
        crash_dir.cleanup()


_REQUIRED_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def init_process_group_from_env(
    backend: str | None = None, timeout_s: float | None = None
) -> None:
    """Initialise torch.distributed from the variables torchrun sets.

    Reads ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` (and
    ``LOCAL_RANK`` for picking the GPU). ``backend=None`` picks ``"nccl"`` when
    CUDA is available and ``"gloo"`` otherwise. ``timeout_s`` (default
    :data:`graphpar.distributed.groups.DEFAULT_TIMEOUT_S`) bounds every collective, so a rank
    that never
    arrives makes the others raise instead of waiting forever; a given
    ``timeout_s`` becomes that default, so the groups graphpar
    creates later (dp, tp, pp) and its waits use the same bound. Starts the
    heartbeat that lets a failed collective name the rank at fault
    (graphpar/distributed/faults.py).

    Does nothing if the default process group already exists, so it is safe
    to call from library code that may run under an already set-up launcher.
    """
    if dist.is_initialized():
        return
    missing = [name for name in _REQUIRED_ENV if name not in os.environ]
    if missing:
        raise RuntimeError(
            f"cannot initialise torch.distributed: environment variables "
            f"{missing} are not set; start the script with torchrun or run "
            f"the function through graphpar.launch(...)"
        )
    if backend is None:
        backend = _gp_dist.default_backend()
    if timeout_s is not None:
        _gp_dist.set_timeout(timeout_s)
    if backend == "nccl":
        # Without this every rank defaults to cuda:0 and NCCL either
        # deadlocks or fails with a confusing duplicate-GPU error.
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(
        backend=backend,
        init_method="env://",
        rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
        timeout=timedelta(seconds=_gp_dist.DEFAULT_TIMEOUT_S),
    )
    _faults.start_monitor()


def run_in_process_group(fn: Callable[..., Any], *args: Any, timeout: float | None = None) -> Any:
    """Call ``fn(*args)``, first joining the process group torchrun describes.

    For scripts started with ``torchrun``: if torch.distributed is not yet
    initialised and ``RANK``/``WORLD_SIZE`` are set, initialise it with
    :func:`init_process_group_from_env`. Without those
    variables ``fn`` simply runs as a single process, so the same script
    works under torchrun, under :func:`launch`, and as plain ``python``.

    ``timeout`` (seconds; default ``GRAPHPAR_TIMEOUT_S`` or 120) bounds every
    collective and process group graphpar creates. If ``fn`` raises, the
    exception is published to the other ranks, a failed collective becomes a
    :class:`graphpar.distributed.faults.PeerFailureError` naming the rank at fault, and
    what is raised is written to torchrun's error file, so torchrun's failure
    summary shows it.
    """
    if timeout is not None:
        _gp_dist.set_timeout(_resolve_timeout(timeout))
    if not dist.is_initialized() and "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        init_process_group_from_env()
    _faults.start_monitor()
    call = _call_explained
    if "TORCHELASTIC_ERROR_FILE" in os.environ:
        # torchrun's summary prints an error file's message as the failed
        # rank's "traceback"; without one it shows only the exit code.
        from torch.distributed.elastic.multiprocessing.errors import record

        call = record(call)
    return call(fn, args)


def _call_explained(fn: Callable[..., Any], args: Sequence[Any]) -> Any:
    with _faults.explaining():
        return fn(*args)


# --------------------------------------------------------------------------
# parent side


def _resolve_timeout(timeout: float | timedelta | None) -> float:
    if timeout is None:
        # Read at call time so tests and callers can adjust the module value.
        return float(_gp_dist.DEFAULT_TIMEOUT_S)
    if isinstance(timeout, timedelta):
        timeout = timeout.total_seconds()
    return _gp_dist.check_timeout(timeout)


def _pickle_job(fn: Callable[..., Any], args: Sequence[Any]) -> bytes:
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {fn!r}")
    name = getattr(fn, "__qualname__", None) or repr(fn)
    if getattr(fn, "__module__", None) == "__main__" and not getattr(
        sys.modules.get("__main__"), "__file__", None
    ):
        # pickle accepts it, but a rank has no interactive __main__
        # to find it in and would die while unpickling.
        raise ValueError(
            f"fn {name!r} was defined interactively (in __main__ without a "
            f"file); the ranks (fresh processes) cannot import it. Define it at module "
            f"level in a .py file."
        )
    try:
        pickle.dumps(fn)
    except Exception as exc:
        raise ValueError(
            f"fn {name!r} cannot be pickled ({type(exc).__name__}: {exc}); "
            f"launch starts fresh processes that must import it by name, so "
            f"define it at module level (not a lambda or nested function)."
        ) from exc
    try:
        return pickle.dumps((fn, tuple(args)), protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:
        raise ValueError(
            f"args for {name!r} cannot be pickled ({type(exc).__name__}: {exc}). Fix: pass "
            f"picklable arguments (tensors, numbers, strings, containers of them) and build "
            f"anything else (locks, open files, process groups) inside fn."
        ) from exc


def _check_env(env: Mapping[str, str] | None) -> dict[str, str]:
    env = dict(env or {})
    bad = {k: v for k, v in env.items() if not isinstance(k, str) or not isinstance(v, str)}
    if bad:
        raise ValueError(f"env must map str to str, got {bad!r}")
    return env


def _available_cpus() -> int:
    # The affinity mask, not os.cpu_count(): containers and taskset often
    # give us fewer cores than the machine has.
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return os.cpu_count() or 1


class _Failure(NamedTuple):
    summary: str  # one line: "ValueError: boom" or "process exited with code 7 ..."
    details: str  # the traceback, or the same text as summary for deaths


class _Supervisor:
    """Collects each rank's single message and notices ranks that die."""

    def __init__(self, procs: list[Any], conns: list[Any], crash_logs: Sequence[str]):
        self.procs = procs
        self.crash_logs = crash_logs  # where each rank's faulthandler writes if it crashes
        self.results: dict[int, Any] = {}
        # Insertion order is detection order: the first entry is reported as
        # the root cause, the rest are usually its consequences.
        self.failures: dict[int, _Failure] = {}
        self._conn_of = dict(enumerate(conns))
        self._rank_of_conn = {conn: rank for rank, conn in enumerate(conns)}
        self._rank_of_sentinel = {p.sentinel: rank for rank, p in enumerate(procs)}

    def run(self, timeout_s: float) -> list[Any]:
        world_size = len(self.procs)
        limit = timeout_s + DEADLINE_GRACE_S
        deadline: float | None = None
        while len(self.results) < world_size:
            wait_s = None if deadline is None else max(0.0, deadline - time.monotonic())
            returned_before = len(self.results)
            self._poll(wait_s)
            if self.failures:
                # Collect failures that happened at the same moment before
                # the stop below turns every survivor into a killed process.
                self._poll(0)
                _stop(self.procs)
                self._poll(0, sentinels=False)
                raise self._failure_error()
            if len(self.results) > returned_before:
                deadline = time.monotonic() + limit
            elif deadline is not None and time.monotonic() >= deadline:
                raise self._hang_error(limit, timeout_s)
        self._reap_finished()
        return [self.results[rank] for rank in range(world_size)]

    def _poll(self, timeout: float | None, sentinels: bool = True) -> None:
        waitables = list(self._rank_of_conn)
        if sentinels:
            waitables += list(self._rank_of_sentinel)
        if not waitables:
            return
        known = list(self.failures)
        ready = _wait_for_any(waitables, timeout)
        for obj in ready:
            if obj in self._rank_of_conn:
                self._receive(self._rank_of_conn[obj])
        deaths = []
        for obj in ready:
            rank = self._rank_of_sentinel.pop(obj, None) if sentinels else None
            if rank is None:
                continue
            conn = self._conn_of.get(rank)
            if conn is not None and conn.poll(0):
                # Reported just before exiting: not a silent death.
                self._receive(rank)
            if rank not in self.results and rank not in self.failures:
                deaths.append(rank)
        if deaths:
            # A rank dying silently makes its peers' collectives fail a few
            # milliseconds later; if both show up in one wake-up, the death
            # is the cause, so it goes before the errors reported alongside.
            reported = dict(self.failures)
            self.failures = {r: reported[r] for r in known}
            for rank in deaths:
                self.procs[rank].join(timeout=5)
                reason = _describe_exit(self.procs[rank].exitcode)
                self.failures[rank] = _Failure(reason, _crash_dump(self.crash_logs[rank]) or reason)
            for rank, failure in reported.items():
                self.failures.setdefault(rank, failure)

    def _receive(self, rank: int) -> None:
        conn = self._conn_of.pop(rank)
        del self._rank_of_conn[conn]
        try:
            data = conn.recv_bytes()
        except (EOFError, OSError):
            return  # died without reporting; its sentinel tells the rest
        try:
            message = pickle.loads(data)
        except Exception as exc:
            self.failures[rank] = _Failure(
                f"{type(exc).__name__}: the parent could not unpickle what rank "
                f"{rank} sent: {exc}",
                traceback.format_exc(),
            )
            return
        if message[0] == "ok":
            self.results[rank] = message[2]
        else:
            _, _, tb, type_name, text = message
            self.failures[rank] = _Failure(f"{type_name}: {text}", tb)

    def _unfinished(self) -> list[int]:
        return [r for r in range(len(self.procs))
                if r not in self.results and r not in self.failures]

    def _failure_error(self) -> LaunchError:
        first, *others = self.failures
        failure = self.failures[first]
        lines = [f"rank {first} failed: {failure.summary}"]
        if others:
            lines.append(f"ranks {others} also failed (often as a consequence):")
            lines += [f"  rank {r}: {self.failures[r].summary}" for r in others]
        unfinished = self._unfinished()
        if unfinished:
            lines.append(f"ranks {unfinished} had not finished and were stopped")
        if failure.details != failure.summary:
            lines += ["", f"traceback of rank {first}:", failure.details.rstrip()]
        else:
            lines.append("(no Python traceback: see that rank's stderr output)")
        return LaunchError(
            "\n".join(lines),
            rank=first,
            failures={r: f.details for r, f in self.failures.items()},
            unfinished=unfinished,
        )

    def _hang_error(self, limit: float, timeout_s: float) -> LaunchError:
        stuck = self._unfinished()
        dumped = _dump_stacks([self.procs[r] for r in stuck])
        _stop(self.procs)
        message = (
            f"ranks {stuck} did not finish within {limit:g} s: probably blocked "
            f"in a collective; ranks {sorted(self.results)} had already "
            f"returned, so a collective they skipped (e.g. inside a "
            f"rank-dependent branch) can never complete. If the ranks were "
            f"only slow, pass a larger timeout= (now {timeout_s:g} s; launch "
            f"waits timeout + {DEADLINE_GRACE_S:g} s after the latest return)."
        )
        if dumped:
            message += " Their Python stacks were dumped to stderr above."
        return LaunchError(message, rank=None, failures={}, unfinished=stuck)

    def _reap_finished(self) -> None:
        deadline = time.monotonic() + _EXIT_GRACE_S
        for proc in self.procs:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
        lingering = [r for r, p in enumerate(self.procs) if p.is_alive()]
        _stop(self.procs)
        problems = []
        if lingering:
            problems.append(f"ranks {lingering} did not exit within "
                            f"{_EXIT_GRACE_S:g} s and were killed")
        problems += [
            f"rank {r} then exited with code {p.exitcode}"
            for r, p in enumerate(self.procs)
            if r not in lingering and p.exitcode not in (0, None)
        ]
        if problems:
            # The results are complete; a messy shutdown deserves a warning,
            # not the loss of the run.
            warnings.warn(
                "graphpar.launch: all ranks returned their results, but "
                + "; ".join(problems),
                RuntimeWarning,
                stacklevel=4,
            )


def _describe_exit(exitcode: int | None) -> str:
    if exitcode is None:
        what = "process stopped responding"
    elif exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = "signal"
        what = f"process was killed by {name} ({-exitcode})"
    else:
        what = f"process exited with code {exitcode}"
    what += " without reporting a result or a Python exception"
    if exitcode == -getattr(signal, "SIGKILL", 9):
        what += " (SIGKILL often comes from the out-of-memory killer)"
    return what


def _dump_stacks(procs: list[Any]) -> bool:
    if _STACK_DUMP_SIGNAL is None:
        return False
    sent = False
    for proc in procs:
        if proc.is_alive():
            try:
                os.kill(proc.pid, _STACK_DUMP_SIGNAL)
                sent = True
            except OSError:
                pass
    if sent:
        time.sleep(0.5)  # faulthandler writes from the signal handler at once
    return sent


def _stop(procs: list[Any]) -> None:
    alive = [p for p in procs if p.is_alive()]
    for proc in alive:
        proc.terminate()
    deadline = time.monotonic() + _TERMINATE_GRACE_S
    for proc in alive:
        proc.join(timeout=max(0.0, deadline - time.monotonic()))
    for proc in alive:
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=5)


def _context() -> Any:
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    # Read when the fork server starts (the first launch); later calls change nothing.
    ctx.set_forkserver_preload([*FORKSERVER_PRELOAD, *_extra_preload()])
    return ctx


def _extra_preload() -> list[str]:
    # Modules every rank would import (a model library): imported once in the fork server
    # instead of once per rank. One that fails to import there is skipped by multiprocessing
    # and imported by the ranks as usual.
    return [name.strip() for name in os.environ.get(PRELOAD_ENV, "").split(",") if name.strip()]


class _ParentFd:
    """One of the parent's file descriptors, duplicated into the rank as the rank starts."""

    def __init__(self, fd: int):
        self.fd = fd

    def __reduce__(self):
        # DupFd only works while multiprocessing pickles a starting process's arguments,
        # which is when this is pickled; in the rank it unpickles as a handle to the copy.
        return _identity, (reduction.DupFd(self.fd),)


class _Parent(NamedTuple):
    """What a rank takes from its parent at the call: a fork server's child would
    otherwise have the fork server's, as they were when it started."""

    environ: dict[str, str]
    stdout: Any  # a _ParentFd, a handle to its copy once in the rank
    stderr: Any

    def adopt(self) -> None:
        for handle, fd in ((self.stdout, 1), (self.stderr, 2)):
            copy = handle.detach()
            os.dup2(copy, fd)
            os.close(copy)
        os.environ.clear()
        os.environ.update(self.environ)


# --------------------------------------------------------------------------
# child side


def _worker(
    rank: int,
    world_size: int,
    port: int,
    backend: str | None,
    timeout_s: float,
    threads: int,
    extra_env: dict[str, str],
    payload: bytes,
    conn: Any,
    parent: "_Parent",
    crash_log: str,
) -> None:
    # The parent decides when everybody stops; a Ctrl-C in the terminal
    # reaches it too.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    parent.adopt()
    # A crash (SIGSEGV, SIGABRT...) leaves no Python exception to report: faulthandler writes
    # every thread's stack where the parent reads it into the LaunchError (CI logs show
    # the error, not each rank's stderr). The file stays open for the process's lifetime.
    faulthandler.enable(open(crash_log, "w"), all_threads=True)
    _exit_when_orphaned()
    if _STACK_DUMP_SIGNAL is not None:
        faulthandler.register(_STACK_DUMP_SIGNAL, all_threads=True)
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    os.environ.update(extra_env)
    torch.set_num_threads(threads)

    ok = False
    try:
        try:
            fn, args = pickle.loads(payload)
        except Exception as exc:
            raise RuntimeError(
                f"rank {rank} could not unpickle fn/args ({type(exc).__name__}: "
                f"{exc}); the function's module must be importable in a fresh "
                f"interpreter with the parent's sys.path"
            ) from exc
        init_process_group_from_env(backend, timeout_s)
        result = fn(*args)
        try:
            message = _dumps_result(("ok", rank, result))
        except Exception as exc:
            raise TypeError(
                f"the return value of {getattr(fn, '__qualname__', fn)!r} on rank "
                f"{rank} cannot be pickled back to the parent: {exc}"
            ) from exc
        ok = True
    except BaseException as exc:  # SystemExit/KeyboardInterrupt are failures too
        # Before reporting: once the parent hears of a failure it stops every
        # rank, so this is the last moment to tell the others (and to ask them
        # which rank a failed collective waited for).
        message = _dumps_error(rank, _faults.explain(exc))
    try:
        conn.send_bytes(message)
    except OSError:
        pass  # the parent is gone; nobody is left to tell
    conn.close()
    if ok and dist.is_initialized():
        # Only after success: after a failure the parent is about to stop
        # every rank anyway, and tearing down a group whose peers are gone
        # can itself block.
        _faults.stop_monitor()
        dist.destroy_process_group()
    # sys.exit rather than an exception: multiprocessing would print a second
    # copy of the traceback the parent already shows.
    sys.exit(0 if ok else 1)


def _crash_dump(path: str) -> str:
    """What faulthandler wrote when the rank crashed (every thread's stack), or "" if nothing."""
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return ""
    return f"faulthandler's dump of the rank's threads when it crashed:\n{text}" if text else ""


def _exit_when_orphaned() -> None:
    # The parent holds the other end of this pipe until it has reaped the rank (spawned or
    # forked from the fork server alike), so it reads as closed only once the parent is gone.
    sentinel = mp.parent_process().sentinel

    def watch() -> None:
        _wait_for_any([sentinel])
        os._exit(1)

    threading.Thread(target=watch, name="graphpar-parent-watch", daemon=True).start()


def _identity(obj: Any) -> Any:
    return obj


class _ResultPickler(pickle.Pickler):
    # Plain pickle (not torch.multiprocessing's shared-memory reductions): the
    # rank exits right after sending, and shared tensors would depend on its
    # lifetime. CUDA or autograd-attached tensors would drag a device or a
    # graph into the parent, so they arrive as plain CPU tensors.
    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor) and (obj.requires_grad or obj.device.type != "cpu"):
            return _identity, (obj.detach().cpu(),)
        return NotImplemented


def _dumps_result(message: tuple) -> bytes:
    buffer = io.BytesIO()
    _ResultPickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(message)
    return buffer.getvalue()


def _dumps_error(rank: int, exc: BaseException) -> bytes:
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    try:
        text = str(exc)
    except Exception:
        text = "<str() of the exception failed>"
    return pickle.dumps(("error", rank, tb, type(exc).__name__, text))
