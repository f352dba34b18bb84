"""Bytes of tensors on the CPU, measured exactly at the dispatcher: the peak over a training
step, and what a system keeps between steps; and the bytes kept for backward (`SavedBytes`,
at the end of this module).

torch 2.13 has no allocator statistics for the CPU. torch.profiler(profile_memory=True)
records allocations on the profiling thread only, and glibc's mallinfo2 counts every thread
but also what malloc keeps after a free. So the peak is counted here from the tensors
themselves: a TorchDispatchMode (`LiveBytes`) sees every op that runs on a thread it is
pushed on, and keeps a weak reference (StorageWeakRef, which does not keep the memory
alive) to the storage of each tensor the op reads or writes. After each op it adds up the
current size of every storage still alive: the live bytes at that moment; the peak is
the largest such sum. Memory only grows inside an op (its results), so the largest sum at
op ends is the peak, to the byte, of what it sees.

What it sees, and what it does not:
- every op on the threads it is pushed on: the thread that enters `tracking()`, autograd's
  backward (on the CPU it runs on the thread that calls backward, with that thread's
  modes), and tasks submitted to a concurrent.futures.ThreadPoolExecutor while tracking
  (submit is wrapped so that the task runs under the mode on the worker thread). Ops on
  other threads are not seen: gloo's own threads (its send/receive buffers, and any
  tensor it allocates there, such as the flat copy of several tensors it reduces at once),
  and plain threading.Thread threads, whenever started. `threads` names the threads whose
  ops were seen, so a report can say which ones it covered.
- a storage counts from the first op that reads or writes it until it is freed. A storage
  that existed before and is not touched counts only from its first use; `step_peak`
  therefore runs the step twice and reports the second, whose starting set is everything
  the first one touched and kept (a steady state: parameters, gradients, optimizer state,
  buffers a system reuses). Memory a system holds and never touches in a step (a spare
  copy of the model) is not counted.
- tensor subclasses (DTensor): the mode lets the subclass run and sees the ops it runs on
  its local tensors, so the local shards are what is counted. Fake and meta tensors (DTensor
  infers output shapes on FakeTensors) have no memory and count nothing.
- a storage resized outside an op (FSDP2 frees and re-allocates its unsharded parameters
  with UntypedStorage.resize_) shows its new size at the next op's end.
- scratch memory inside one kernel (no tensor), Python objects, and malloc's overhead and
  retention are not tensor bytes and are not counted.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import threading
import weakref
from typing import Callable, Dict, Iterable, Iterator, List, Sequence, Tuple

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import (TorchDispatchMode, is_traceable_wrapper_subclass,
                                         is_traceable_wrapper_subclass_type)
from torch.utils._pytree import tree_leaves


def storages(tensor: torch.Tensor) -> Iterator[torch.UntypedStorage]:
    """The storages that hold `tensor`'s data: its own, or, for a wrapper subclass such as
    DTensor (which has none), those of the tensors inside it."""
    if is_traceable_wrapper_subclass(tensor):
        names, _ = tensor.__tensor_flatten__()
        for inner in (getattr(tensor, name) for name in names):
            if isinstance(inner, torch.Tensor):   # the flattened names may include a mesh
                yield from storages(inner)
    else:
        storage = tensor.untyped_storage()
        if storage.device.type != "meta":   # a FakeTensor (DTensor infers shapes with them) holds none
            yield storage


def distinct_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind `tensors`: a storage shared by several (a flat
    buffer the gradients are views of) counts once, at its whole size."""
    seen: Dict[StorageWeakRef, int] = {}
    for t in tensors:
        for s in storages(t):
            seen[StorageWeakRef(s)] = s.nbytes()
    return sum(seen.values())


class LiveBytes:
    """The live bytes of the storages the ops seen so far touched, and their peak."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._live: Dict[StorageWeakRef, None] = {}   # a dict as an ordered set
        self.current = 0
        self.peak = 0
        self.threads: Dict[str, None] = {}            # names of the threads whose ops were seen

    def _record(self, tensors: Iterable[torch.Tensor]) -> None:
        with self._lock:
            self.threads.setdefault(threading.current_thread().name, None)
            for t in tensors:
                for s in storages(t):
                    self._live.setdefault(StorageWeakRef(s), None)
            self._measure()

    def _measure(self) -> None:
        """Sum the current sizes of the storages still alive, forget the freed ones."""
        total, dead = 0, []
        for ref in self._live:
            storage = torch.UntypedStorage._new_with_weak_ptr(ref.cdata)
            if storage is None:
                dead.append(ref)
            else:
                total += storage.nbytes()
        for ref in dead:
            del self._live[ref]
        self.current = total
        self.peak = max(self.peak, total)

    def reset_peak(self) -> int:
        """Start a new peak from what is alive now; returns that (the new baseline)."""
        with self._lock:
            self._measure()
            self.peak = self.current
            return self.current

    @contextlib.contextmanager
    def on_this_thread(self):
        """Count the ops this thread runs until the block ends."""
        with _Mode(self):
            yield self

    @contextlib.contextmanager
    def tracking(self):
        """Count the ops of this thread and of every task submitted to a ThreadPoolExecutor
        until the block ends (the executor's submit is wrapped meanwhile)."""
        submit = concurrent.futures.ThreadPoolExecutor.submit
        tracker = self

        @functools.wraps(submit)
        def tracked_submit(executor, fn, /, *args, **kwargs):
            def run(*a, **k):
                with tracker.on_this_thread():
                    return fn(*a, **k)
            return submit(executor, run, *args, **kwargs)

        concurrent.futures.ThreadPoolExecutor.submit = tracked_submit
        try:
            with self.on_this_thread():
                yield self
        finally:
            concurrent.futures.ThreadPoolExecutor.submit = submit


class _Mode(TorchDispatchMode):
    """One thread's view into a LiveBytes (a mode instance is pushed on one thread only)."""

    def __init__(self, tracker: LiveBytes) -> None:
        super().__init__()
        self.tracker = tracker

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(is_traceable_wrapper_subclass_type(t) for t in types):
            # a subclass (DTensor): let it run; the ops on its local tensors come back here
            return NotImplemented
        out = func(*args, **(kwargs or {}))
        self.tracker._record(t for t in tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor))
        return out


def step_peak(step: Callable[[], object]) -> Tuple[int, int, List[str]]:
    """(live bytes at the start of a step, peak live bytes during it, the threads whose ops
    were counted), the bytes of tensors on this process. `step` runs twice under tracking;
    the numbers are the second run's, whose start holds what the first one kept (see the
    module docstring)."""
    tracker = LiveBytes()
    with tracker.tracking():
        step()
        baseline = tracker.reset_peak()
        step()
        return baseline, tracker.peak, list(tracker.threads)


# ---- what a step keeps for backward ------------------------------------------------------------

class _Handle:
    """What the pack hook hands autograd for a saved tensor: when autograd frees it (the
    saved tensor is released), the storage has one holder fewer."""
    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


def _unpack(handle):
    return handle.tensor if isinstance(handle, _Handle) else handle


class SavedBytes:
    """The bytes a step keeps for backward, and their peak (`peak`), while `counting()`.

    What autograd saves: every tensor packed by torch.autograd.graph.saved_tensors_hooks,
    each storage counted once however many tensors or views of it are saved, from its first
    save until the last of them is released (autograd frees the packed handle); the storages
    of `exclude` (the parameters) not at all. This is the figure gp.plan's
    activation_peak_bytes predicts. What a system keeps for backward outside autograd's
    saved tensors, where the hooks cannot see it (torch's selective activation checkpointing
    caches the outputs its policy saves in its own dispatch mode), it reports with `keep`:
    counted the same way, each storage once, from that call until the storage is freed.
    The peak is exact: bytes are only added at a save or a keep, where it is taken."""

    def __init__(self, exclude: Sequence[torch.Tensor] = ()) -> None:
        self._skip = {StorageWeakRef(t.untyped_storage()) for t in exclude}
        self._holders: Dict[StorageWeakRef, List[int]] = {}   # storage -> [packed handles alive, bytes]
        self._kept: Dict[StorageWeakRef, int] = {}            # storage -> bytes, until it is freed
        self.peak = 0

    @contextlib.contextmanager
    def counting(self):
        """Count what autograd saves until the block ends (the hooks stay on the handles
        packed meanwhile, which unpack themselves after it)."""
        with torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack):
            yield self

    def keep(self, tensor: torch.Tensor) -> None:
        ref = StorageWeakRef(tensor.untyped_storage())
        if ref not in self._skip:
            self._kept[ref] = tensor.untyped_storage().nbytes()
            self._measure()

    def _pack(self, tensor: torch.Tensor):
        ref = StorageWeakRef(tensor.untyped_storage())
        if ref in self._skip:
            return tensor
        entry = self._holders.setdefault(ref, [0, tensor.untyped_storage().nbytes()])
        entry[0] += 1
        handle = _Handle(tensor)
        weakref.finalize(handle, self._release, ref)
        self._measure()
        return handle

    def _release(self, ref: StorageWeakRef) -> None:
        entry = self._holders[ref]
        entry[0] -= 1
        if entry[0] == 0:
            del self._holders[ref]

    def held(self) -> int:
        """The bytes held now: the saved storages with a handle alive and the kept ones not
        yet freed (a storage both saved and kept counts once)."""
        for ref in [r for r in self._kept if r.expired()]:
            del self._kept[ref]
        held = {ref: entry[1] for ref, entry in self._holders.items()}
        held.update(self._kept)
        return sum(held.values())

    def _measure(self) -> None:
        self.peak = max(self.peak, self.held())


def peak_saved_bytes(step: Callable[[], object], exclude: Sequence[torch.Tensor] = ()) -> int:
    """Runs step() and returns the most bytes autograd held for backward at any one time
    (SavedBytes: each storage once while saved, the storages of `exclude` not at all)."""
    saved = SavedBytes(exclude)
    with saved.counting():
        step()
    return saved.peak
