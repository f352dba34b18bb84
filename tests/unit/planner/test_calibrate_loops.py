"""How the calibration sizes its timing loops (graphpar/planner/calibrate._loop_size), on a
clock that only the timed function moves: the counts are exact, nothing is timed."""
import pytest
import torch.distributed as dist

from graphpar.planner import calibrate


class _Clock:
    """perf_counter for calibrate: advances only when the timed call runs."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self):
        return self.now


@pytest.fixture
def clock(monkeypatch):
    """A one-rank gloo group (the loops' barrier and all-reduce) and the fake clock."""
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    fake = _Clock()
    monkeypatch.setattr(calibrate, "time", fake)
    yield fake
    dist.destroy_process_group()


@pytest.mark.parametrize("per_call, min_seconds, expected_calls", [
    (0.001, 0.02, 24),        # 1 call: 1 ms, so 1.2 x 20 calls
    (0.03, 0.02, 1),          # one call is already long enough
    (0.003, 0.1, 40),         # 1.2 x 33.3, rounded up
])
def test_loop_size_jumps_to_the_count_the_last_loop_says_is_enough(clock, per_call, min_seconds, expected_calls):
    def call():
        clock.now += per_call
    calls, seconds = calibrate._loop_size(call, min_seconds)
    assert calls == expected_calls
    assert seconds == pytest.approx(per_call, rel=1e-6)   # the loop time is all-reduced in float32: its rounding
    assert calls * seconds >= min_seconds


def test_loop_size_grows_at_most_loop_growth_times_a_loop(clock):
    """A call the timer sees as free (the first, say, warming a cache) grows the loop by
    LOOP_GROWTH, not to an unbounded count."""
    costs = iter([0.0, 0.0] + [0.001] * 10_000)   # the warm-up and the first loop look free

    def call():
        clock.now += next(costs)
    calls, _ = calibrate._loop_size(call, 0.05)
    # 1 call (free) -> LOOP_GROWTH calls (0.256 s, long enough)
    assert calls == calibrate.LOOP_GROWTH


def test_loop_size_takes_another_loop_when_calls_slow_down(clock):
    """A loop sized from a fast call that then runs short of min_seconds is followed by a longer one."""
    costs = iter([0.001, 0.01] + [0.001] * 10_000)   # warm-up, then 1 call of 10 ms, then 1 ms calls

    def call():
        clock.now += next(costs)
    calls, seconds = calibrate._loop_size(call, 0.05)
    # 10 ms per call -> ceil(1.2 x 5) = 6 calls of 1 ms (short) -> ceil(6 x 1.2 x 50 / 6) = 60 calls
    assert (calls, seconds) == (60, pytest.approx(0.001, rel=1e-6))   # float32 rounding, as above
