"""benchmarks/_memory.py: the tensor-byte measurement bench_zero.py reports must find the
known peak of small computations, on the calling thread and on an executor's worker; the
saved-for-backward count (bench_recompute.py, and the tests through tests/helpers) must find
the known peak of what autograd and a cache keep."""
import concurrent.futures
import pathlib
import sys
import threading

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "benchmarks"))
import _memory  # noqa: E402  (benchmarks/ is not a package)

F32 = 4


def test_peak_on_the_calling_thread():
    tracker = _memory.LiveBytes()
    with tracker.tracking():
        a = torch.ones(1000)
        b = a * 2                   # a and b: 8000 bytes
        del a
        c = torch.ones(3000)        # b and c: 16000, the peak
        del b, c
        d = torch.ones(10)
        assert tracker.peak == (1000 + 3000) * F32
        del d
        torch.ones(1)               # d was freed before this op: only its 4 bytes are live
        assert tracker.current == F32


def test_a_view_counts_its_storage_once():
    tracker = _memory.LiveBytes()
    with tracker.tracking():
        a = torch.ones(1000)
        v = a[10:20].clone()        # a new 40-byte storage
        w = a[10:20]                # a view: no new storage
        w.mul_(2)
    assert tracker.peak == (1000 + 10) * F32
    del a, v, w


def test_peak_on_a_worker_thread_started_before_tracking():
    def task():
        e = torch.ones(5000)
        f = e + 1                   # e and f: 40000 bytes
        del e, f
        torch.ones(1)

    submit = concurrent.futures.ThreadPoolExecutor.submit
    with concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="worker") as pool:
        pool.submit(lambda: None).result()      # its thread runs before tracking starts
        tracker = _memory.LiveBytes()
        with tracker.tracking():
            pool.submit(task).result()
        assert tracker.peak == 2 * 5000 * F32
        assert list(tracker.threads) == ["worker_0"]   # only the worker ran ops
        pool.submit(task).result()              # after tracking: submit is restored, nothing counted
        assert tracker.peak == 2 * 5000 * F32
    assert concurrent.futures.ThreadPoolExecutor.submit is submit


def test_a_plain_thread_is_not_seen():
    # The documented limit: a thread that is neither the tracking one nor an executor's.
    tracker = _memory.LiveBytes()
    with tracker.tracking():
        thread = threading.Thread(target=lambda: torch.ones(5000) + 1)
        thread.start()
        thread.join()
    assert tracker.peak == 0


def test_backward_is_seen():
    # autograd runs a CPU backward on the calling thread with that thread's modes. Forward
    # peaks at w, w * 3 and the 4-byte sum (8004 bytes); backward at w, the sum, its 4-byte
    # gradient of ones and the new 4000-byte gradient of w (8008): 4 bytes that only
    # backward's ops allocate.
    w = torch.ones(1000, requires_grad=True)
    tracker = _memory.LiveBytes()
    with tracker.tracking():
        forward = (w * 3).sum()
        assert tracker.peak == 2 * 1000 * F32 + F32
        forward.backward()
    assert torch.equal(w.grad, torch.full((1000,), 3.0))
    assert tracker.peak == 2 * 1000 * F32 + 2 * F32


def test_step_peak_starts_from_what_the_first_step_kept():
    state = {"w": torch.ones(1000)}

    def step():
        tmp = state["w"] * 2        # 4000 bytes more while it lives
        state["w"].add_(tmp)

    baseline, peak, threads = _memory.step_peak(step)
    assert (baseline, peak, threads) == (1000 * F32, 2 * 1000 * F32, [threading.current_thread().name])


def test_distinct_bytes_counts_a_shared_buffer_once():
    flat = torch.zeros(100)
    views = [flat[:30], flat[30:], torch.zeros(5)]
    assert _memory.distinct_bytes(views) == (100 + 5) * F32


def dtensor_peak():
    """In a graphpar.launch child: the peak of doubling a DTensor sharded over 2 ranks."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    whole = distribute_tensor(torch.ones(1000), init_device_mesh("cpu", (2,)), [Shard(0)])
    tracker = _memory.LiveBytes()
    with tracker.tracking():
        doubled = whole * 2
    return tracker.peak, _memory.distinct_bytes([whole, doubled])


def test_a_dtensor_counts_as_its_local_shard():
    # The mode lets DTensor run and sees the ops on its local tensors (FSDP2's parameters
    # are DTensors): each rank holds 500 of the 1000 elements, before and after doubling.
    import graphpar

    assert graphpar.launch(dtensor_peak, world_size=2) == [(2 * 500 * F32, 2 * 500 * F32)] * 2



def test_saved_bytes_count_a_storage_once_while_saved():
    # x * w saves both factors: x (4000 bytes) and w (a parameter, excluded); exp saves its
    # output e (4000); sin saves its input, a view of x: no new bytes.
    w = torch.ones(1000, requires_grad=True)
    saved = _memory.SavedBytes(exclude=[w])
    with saved.counting():
        x = torch.ones(1000, requires_grad=True)
        e = (x * w).exp()
        s = x[500:].sin()
        assert saved.peak == 2 * 1000 * F32
        (e.sum() + s.sum()).backward()
    assert saved.peak == 2 * 1000 * F32


def test_saved_bytes_are_released_with_the_graph():
    # Two graphs one after the other, each saving x twice (one storage, 4000 bytes): the
    # first one's saved tensors are freed by its backward, so the peak is one graph's.
    def step():
        for _ in range(2):
            x = torch.ones(1000, requires_grad=True)
            (x * x).sum().backward()

    assert _memory.peak_saved_bytes(step) == 1000 * F32


def test_kept_bytes_count_until_the_storage_is_freed():
    # A tensor kept outside autograd's saved tensors (torch's selective checkpointing cache)
    # counts from keep() until its storage is freed, and once if autograd saves it too.
    saved = _memory.SavedBytes()
    with saved.counting():
        x = torch.ones(1000, requires_grad=True)
        cache = torch.ones(3000)
        saved.keep(cache)
        saved.keep(cache[:10])            # a view of it: the same storage
        y = x.exp()                       # saves its output: 4000 bytes, 16000 with the cache
        assert saved.peak == (3000 + 1000) * F32
        del cache
        z = y.exp()                       # the cache is freed: y and z, 8000 bytes
        saved.keep(z)                     # saved already: still 8000
        assert saved.peak == (3000 + 1000) * F32
        saved.keep(torch.ones(2500))      # y, z and 10000 bytes: 18000, the cache not among them
        assert saved.peak == (1000 + 1000 + 2500) * F32
