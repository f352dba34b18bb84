"""Naming the rank at fault when a collective fails.

A collective that fails on one rank says only that it failed: gloo reports "Operation
timed out!" or "Connection closed by peer [127.0.0.1]:port", never which rank was missing.
To name it, every rank keeps two kinds of record in the rendezvous store (the TCPStore at
MASTER_ADDR:MASTER_PORT that both graphpar.launch and torchrun already run):

    beat/<rank>    a heartbeat, rewritten every HEARTBEAT_S by a daemon thread: a counter,
                   the rank's progress (train steps begun, inside a step or between steps)
                   and where its main thread is (file:line in function)
    fault/<rank>   written once, when an exception leaves a train step or the launched
                   function: its one-line summary and whether it is a collective failure

When a rank's own exception is a collective failure, :func:`explain` waits up to GRACE_S for
the others' records to settle and classifies every other rank:

    failed         it recorded an exception of its own: the root cause
    died           its heartbeat counter stopped moving (killed, crashed, frozen)
    never arrived  it is alive and recorded nothing: it is somewhere other than the
                   collective (sleeping, deadlocked, in a branch that skips it)
    gave up too    it recorded a collective failure: a victim like this rank

and raises :class:`PeerFailureError` naming the culprits (failed, else died and never
arrived). The store survives worker deaths under torchrun (the agent hosts it); under
graphpar.launch rank 0 hosts it, and the launcher itself names a dead rank.

The counters compare a rank's heartbeat with itself, so clocks of different machines never
meet. Store operations use short timeouts and every failure to reach the store is reported,
never waited on.
"""
from __future__ import annotations

import atexit
import contextlib
import functools
import json
import os
import sys
import threading
import time
import traceback
import warnings
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.distributed as dist

from graphpar.distributed import groups as distributed

__all__ = ["PeerFailureError", "HEARTBEAT_S", "GRACE_S", "start_monitor", "stop_monitor", "explain",
           "explaining", "guard_step", "is_collective_failure"]

#: Seconds between heartbeats.
HEARTBEAT_S = 1.0
#: Longest wait for the other ranks' records after a collective failed: three heartbeats,
#: so a live rank has certainly beaten in between and a dead one is told apart.
GRACE_S = 3 * HEARTBEAT_S
# A store operation that takes longer means the store (or its host) is gone.
_STORE_TIMEOUT_S = 5.0
_POLL_S = 0.25

# Text gloo, NCCL and c10d put in the RuntimeErrors of failed collectives (timeouts and
# lost peers); torch's DistError subclasses are recognised by type.
_COLLECTIVE_MARKERS = ("timed out", "Timed out", "Connection closed by peer", "Connection reset by peer",
                       "gloo/transport", "NCCL", "Socket Timeout")

_TORCH_DIR = os.path.dirname(torch.__file__)
_SEEN = "_graphpar_fault_seen"


class PeerFailureError(RuntimeError):
    """A collective failed on this rank because of another rank.

    Attributes:
        rank: this rank.
        suspects: the ranks named as the cause (empty when none could be told).
    """

    def __init__(self, message: str, rank: int, suspects: List[int]):
        super().__init__(message)
        self.rank = rank
        self.suspects = list(suspects)


def is_collective_failure(exc: BaseException) -> bool:
    """Whether `exc` is a failed collective (timeout or lost peer) rather than an error of
    this rank's own code."""
    if isinstance(exc, getattr(dist, "DistError", ())):
        return True
    return isinstance(exc, RuntimeError) and any(m in str(exc) for m in _COLLECTIVE_MARKERS)


# ---- progress -----------------------------------------------------------------------------

class _Progress:
    """Train steps this process has begun, and whether one is running now."""

    def __init__(self):
        self.steps = 0
        self.in_step = False

    def describe(self) -> str:
        if self.in_step:
            return f"in step {self.steps}"
        return f"after step {self.steps}, before the next" if self.steps else "before its first step"


progress = _Progress()


def guard_step(train_step: Callable) -> Callable:
    """Decorator for the executors' train_step: counts steps for the heartbeat, publishes an
    exception for the other ranks, and turns a failed collective into PeerFailureError."""

    @functools.wraps(train_step)
    def guarded(*args, **kwargs):
        start_monitor()
        progress.steps += 1
        progress.in_step = True
        try:
            with explaining():
                return train_step(*args, **kwargs)
        finally:
            progress.in_step = False

    return guarded


@contextlib.contextmanager
def explaining():
    """Raise what :func:`explain` makes of an exception leaving the block."""
    try:
        yield
    except Exception as exc:
        explained = explain(exc)
        if explained is exc:
            raise
        raise explained


# ---- where a thread is ---------------------------------------------------------------------

def _short(filename: str) -> str:
    cwd = os.getcwd() + os.sep
    if filename.startswith(cwd):
        return filename[len(cwd):]
    return os.sep.join(filename.split(os.sep)[-2:])


def _innermost_own_frame(frames: List[traceback.FrameSummary]) -> str:
    """The innermost frame outside torch and this module: the code that called the
    collective, or the code a stalled rank is stuck in."""
    for frame in reversed(frames):
        if not frame.filename.startswith(_TORCH_DIR) and frame.filename != __file__:
            return f"{_short(frame.filename)}:{frame.lineno} in {frame.name}"
    return "unknown location"


def _where_main_thread() -> str:
    """Where the main thread is: its innermost frame outside torch and this module."""
    frames = _main_thread_frames()
    return _innermost_own_frame(frames) if frames else "unknown location"


def _main_thread_frames() -> List[traceback.FrameSummary]:
    """The main thread's stack, outermost first, copied out of its frames at once.

    Two earlier readings broke training, each intermittently:
    - sys._current_frames() with the source lines looked up (traceback.extract_stack): the
      file reads release the GIL while this thread holds the main thread's frame objects, and
      a frame object held when its function returns becomes the owner of the function's
      locals. A tensor kept alive a moment too long changes what torch does: torch.export's
      non-strict tracing got a detached copy of torch.arange's result that it never recorded
      ("fake tensor in the exported program constant's list"). Here nothing between taking
      the frames and dropping them releases the GIL, and the main thread cannot return from
      a Python function without it.
    - faulthandler.dump_traceback(all_threads=True) walks the interpreter's thread list
      without its lock. gloo's worker threads enter Python to drop objects carried in their
      thread-local state (saved-tensor hooks), and a thread entering Python is linked into
      the list before it is initialised: the walk read one and the rank died of SIGSEGV.
      sys._current_frames() holds the list's lock while it reads."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    stack = []
    while frame is not None:
        stack.append((frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name))
        frame = frame.f_back
    return [traceback.FrameSummary(filename, lineno, name, lookup_line=False)
            for filename, lineno, name in reversed(stack)]


def _where_raised(exc: BaseException) -> str:
    return _innermost_own_frame(traceback.extract_tb(exc.__traceback__))


def _summary(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")


# ---- the monitor ---------------------------------------------------------------------------

@dataclass
class _Peer:
    rank: int
    beat: Optional[Dict[str, Any]]     # latest heartbeat record
    fault: Optional[Dict[str, Any]]    # fault record, if it published one
    alive: Optional[bool]              # heartbeat moved during the wait; None: not checked

    def state(self) -> str:
        if self.fault is not None:
            return "gave up too" if self.fault["collective"] else "failed"
        if self.beat is None:
            return "no record"
        if self.alive is None:
            return "silent"   # not watched long enough to tell (the cause was known at once)
        return "never arrived" if self.alive else "died"

    def describe(self) -> str:
        state = self.state()
        if self.fault is not None:
            verb = "also gave up" if state == "gave up too" else "failed"
            return (f"rank {self.rank} {verb}: {self.fault['summary']} ({self.fault['progress']}, at "
                    f"{self.fault['where']})")
        if state == "no record":
            return f"rank {self.rank} never published a heartbeat (it has not joined the fault monitor)"
        where = f"{self.beat['progress']}, at {self.beat['where']}"
        if state == "died":
            return f"rank {self.rank} died or froze: its heartbeat stopped ({where} when last seen)"
        if state == "silent":
            return f"rank {self.rank} has reported nothing yet ({where})"
        return f"rank {self.rank} never arrived: it is alive but has not joined the collective ({where})"


class _Monitor:
    def __init__(self, store, rank: int, world_size: int, address: str, group_key=None):
        self.store = store
        self.group_key = group_key     # _group_key() of the default process group it serves
        self.rank = rank
        self.world_size = world_size
        self.address = address
        self._lock = threading.Lock()   # one store client, shared with the heartbeat thread
        self._beats = 0
        self._stop = threading.Event()
        self._beat()   # a record exists before anything can fail
        self._thread = threading.Thread(target=self._run, name="graphpar-heartbeat", daemon=True)
        self._thread.start()

    # ---- writing
    def _beat(self) -> None:
        self._beats += 1
        record = {"beats": self._beats, "progress": progress.describe(),
                  "where": _where_main_thread()}
        with self._lock:
            self.store.set(f"beat/{self.rank}", json.dumps(record))

    def _run(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            if not self.serves_current_group():
                return   # the process group this monitor served is gone
            try:
                self._beat()
            except Exception:
                return   # the store is gone (its host exited): nothing left to tell anyone

    def serves_current_group(self) -> bool:
        return self.group_key is not None and _group_key() == self.group_key

    def stop(self) -> None:
        """Stop and join the heartbeat thread. Must happen before the interpreter exits: a
        store client torn down under a thread still using it aborts the process (SIGABRT)."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=_STORE_TIMEOUT_S + HEARTBEAT_S)
        # Release the store client now, not whenever a garbage collection (perhaps during
        # interpreter shutdown) gets to it.
        self.store = None

    def publish(self, exc: BaseException, collective: bool) -> None:
        record = {"summary": _summary(exc), "collective": collective, "progress": progress.describe(),
                  "where": _where_raised(exc)}
        with self._lock:
            self.store.set(f"fault/{self.rank}", json.dumps(record))
            self.store.add("faults", 1)
            if not collective:
                self.store.add("errors", 1)

    # ---- reading
    def _get(self, key: str) -> Optional[Dict[str, Any]]:
        with self._lock:
            if not self.store.check([key]):
                return None
            return json.loads(self.store.get(key))

    def _counts(self) -> tuple:
        with self._lock:
            return self.store.add("faults", 0), self.store.add("errors", 0)

    def peers(self) -> List[_Peer]:
        """Every other rank's records after waiting, at most GRACE_S, until either some rank
        published an error of its own (the cause is known) or every rank published a fault."""
        others = [r for r in range(self.world_size) if r != self.rank]
        before = {r: self._get(f"beat/{r}") for r in others}
        start = time.monotonic()
        while time.monotonic() - start < GRACE_S:
            faults, errors = self._counts()
            if errors or faults >= self.world_size:
                break
            time.sleep(_POLL_S)
        # Fewer than two heartbeats apart, a stopped counter proves nothing.
        checked = time.monotonic() - start >= 2 * HEARTBEAT_S
        peers = []
        for r in others:
            beat = self._get(f"beat/{r}")
            alive = None
            if checked and beat is not None:
                alive = before[r] is None or beat["beats"] != before[r]["beats"]
            peers.append(_Peer(r, beat, self._get(f"fault/{r}"), alive))
        return peers


_monitor: Optional[_Monitor] = None
_started_for: Any = None   # _group_key() at the latest start_monitor, whatever its outcome


def _group_key() -> Any:
    """Identifies the current default process group without keeping it alive (a group
    destroyed late, at interpreter shutdown, can abort the process)."""
    if not dist.is_initialized():
        return None
    return (id(dist.group.WORLD), os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT"))


def start_monitor() -> None:
    """Start this rank's heartbeat, once per default process group; a no-op without one (or in
    a world of one). Called by graphpar.distributed.launch.init_process_group_from_env and at every
    train step, so process groups the user created are covered too."""
    global _monitor, _started_for
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    if _started_for is not None and _started_for == _group_key():
        return   # started, or failed to start (and warned), for this group already
    stop_monitor()
    _started_for = _group_key()
    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not host or not port:
        return   # not an env:// rendezvous: no store we know how to reach
    # One namespace per torchrun attempt (its agent store outlives restarts) and per launch
    # (each has its own port).
    prefix = (f"graphpar/faults/{os.environ.get('TORCHELASTIC_RUN_ID', port)}/"
              f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/")
    try:
        client = dist.TCPStore(host, int(port), is_master=False, wait_for_workers=False,
                               timeout=timedelta(seconds=_STORE_TIMEOUT_S))
        _monitor = _Monitor(dist.PrefixStore(prefix, client), dist.get_rank(), dist.get_world_size(),
                            f"{host}:{port}", _started_for)
    except Exception as exc:
        warnings.warn(f"graphpar: no fault monitor on rank {dist.get_rank()} ({_summary(exc)}); a failed "
                      f"collective will not name the rank at fault", RuntimeWarning)


def stop_monitor() -> None:
    """Stop this rank's heartbeat (before destroying the process group; also at exit)."""
    global _monitor, _started_for
    _started_for = None
    if _monitor is not None:
        _monitor.stop()
        _monitor = None


atexit.register(stop_monitor)


def explain(exc: BaseException) -> BaseException:
    """What this rank should raise instead of `exc`: a PeerFailureError naming the ranks at
    fault when `exc` is a failed collective, else `exc` itself. Either way `exc` is
    published for the other ranks first (once, however many layers call this)."""
    if getattr(exc, _SEEN, False) or _monitor is None:
        return exc
    try:
        setattr(exc, _SEEN, True)
    except AttributeError:
        pass
    collective = is_collective_failure(exc)
    try:
        _monitor.publish(exc, collective)
        if not collective:
            return exc
        peers = _monitor.peers()
    except Exception as store_error:
        if not collective:
            return exc
        return _unreachable(exc, store_error)
    return _diagnosis(exc, peers)


def _unreachable(exc: BaseException, store_error: BaseException) -> PeerFailureError:
    me = _monitor.rank
    message = (f"a collective failed on rank {me} ({_summary(exc)}) and the other ranks' fault records "
               f"cannot be read: the rendezvous store at {_monitor.address} is unreachable "
               f"({_summary(store_error)}). Under graphpar.launch rank 0 hosts that store, so rank 0 has "
               f"probably died. Fix: look for the first rank that failed in the launcher's report.")
    return _as_explanation(PeerFailureError(message, me, []), exc)


def _diagnosis(exc: BaseException, peers: List[_Peer]) -> PeerFailureError:
    me = _monitor.rank
    timeout = distributed.DEFAULT_TIMEOUT_S
    by_state: Dict[str, List[_Peer]] = {}
    for peer in peers:
        by_state.setdefault(peer.state(), []).append(peer)
    mine = (f"rank {me} (this rank): {_summary(exc)} ({progress.describe()}, at {_where_raised(exc)})")
    if "failed" in by_state:
        culprits = by_state["failed"]
        head = (f"{_ranks(culprits)} failed first, so the collective on rank {me} could not complete")
        fix = (f"Fix: the error on {_ranks(culprits)} is the cause; see its traceback (graphpar.launch "
               f"reports it; under torchrun it is in that rank's output).")
    else:
        culprits = by_state.get("died", []) + by_state.get("never arrived", []) + by_state.get("no record", [])
        if culprits:
            head = f"{_ranks(culprits)} never arrived at the collective rank {me} waited in"
            fix = (f"Fix: find out why {_ranks(culprits)} stopped where shown: a crash (check its output "
                   f"and the system log; the out-of-memory killer sends SIGKILL), a deadlock, a slow "
                   f"input pipeline, or a collective skipped in a rank-dependent branch. If it was only "
                   f"slow, raise the collective timeout (now {timeout:g} s) with GRAPHPAR_TIMEOUT_S or "
                   f"graphpar.launch(timeout=...).")
        else:
            head = ("no rank failed or stalled: every rank gave up waiting, which happens when ranks "
                    "call different collectives")
            fix = ("Fix: make every rank run the same collectives in the same order (no collective "
                   "inside a rank-dependent branch).")
    lines = [head + ".", mine] + [peer.describe() for peer in peers] + [fix]
    return _as_explanation(PeerFailureError("\n".join(lines), me, [peer.rank for peer in culprits]), exc)


def _as_explanation(error: PeerFailureError, exc: BaseException) -> PeerFailureError:
    error.__cause__ = exc   # the original traceback prints first, as with `raise ... from exc`
    setattr(error, _SEEN, True)
    return error


def _ranks(peers: List[_Peer]) -> str:
    numbers = [str(p.rank) for p in peers]
    return f"rank {numbers[0]}" if len(numbers) == 1 else f"ranks {', '.join(numbers)}"
