"""The calibrated step-time model (graphpar/planner/time_model.py) term by term, on synthetic
plans and calibrations: nothing is timed here, so every expected value is exact arithmetic
(the tolerances are float rounding, relative 1e-9)."""
import functools
import json

import pytest
import torch

from graphpar.planner import auto, calibrate as calibration_module, time_model
from graphpar.models.gpt import lm_loss
from graphpar.planner.calibration import Calibration, Link
from graphpar.planner.plan import RankPlan, Report, Transfer, report_from, unit_analysis
from graphpar.runtime.pipeline.schedules import build_schedule
from graphpar.runtime.pipeline.simulate import simulate
from graphpar.strategy import Strategy
from tests import helpers
from tests.targets import plan_targets

FLOPS = 1e9
PARAMS = 4_000_000          # parameter bytes per rank: 1M elements
TOKENS = 1000               # tokens per dp rank


def _calibration(alpha=0.0, beta=1e9, unit=0.0, microbatch=0.0, step=0.0, overlap=0.0, memory=float("inf"),
                 p2p=Link(0.0, 1e18), zero=None, speedup=None, busy_latency=None, unit_step=0.0) -> Calibration:
    """A flat calibration: the same throughput at every size, one link for every op."""
    link = Link(alpha, beta)
    return Calibration(key={}, width=8, matmul={1: [(1, FLOPS)], 2: [(1, FLOPS)], 4: [(1, FLOPS)]},
                       collectives={op: {2: link, 4: link} for op in ("all_reduce", "all_gather", "reduce_scatter")},
                       p2p=p2p, overlap=overlap, memory_bandwidth=memory, unit_overhead=unit,
                       microbatch_overhead=microbatch, step_overhead=step, unit_step_overhead=unit_step,
                       zero_overhead=zero or {},
                       speedup=speedup or {}, busy_latency=busy_latency or {})


def _report(dp=1, tp=1, pp=1, m=1, schedule="1f1b", collectives=(), units=2, zero=0, offload=False,
            optimizer_bytes=0, host_bytes=0, recompute_flops=0.0) -> Report:
    """Every rank holds PARAMS bytes and the given transfers; balanced stages of `units` units."""
    strategy = {"dp": dp, "tp": tp, "pp": pp, "microbatches": m, "schedule": schedule, "virtual_stages": 1,
                "zero": zero, "offload_optimizer": offload}
    ranks = []
    for rank in range(dp * tp * pp):
        d, t, p = rank // (tp * pp), rank // pp % tp, rank % pp   # any order: every rank is alike
        ranks.append(RankPlan(rank, d, t, p, [p], PARAMS, PARAMS, optimizer_bytes, 0, host_bytes,
                              list(collectives), recompute_flops=recompute_flops))
    return Report(strategy=strategy, world_size=dp * tp * pp, ranks=ranks, bubble_fraction=0.0,
                  stage_units=[units] * pp)


def _cost(report, calibration, tokens=TOKENS):
    return sum(time_model.step_time(report, tokens, calibration)[k] for k in auto.TERMS)


def test_compute_is_six_flops_per_parameter_per_token_at_the_calibrated_throughput():
    terms = time_model.step_time(_report(), TOKENS, _calibration())
    assert terms["compute"] == pytest.approx(6 * PARAMS / 4 * TOKENS / FLOPS, rel=1e-9)
    assert _cost(_report(), _calibration()) == pytest.approx(terms["compute"], rel=1e-9)


def test_doubling_collective_latency_adds_each_call_once_more():
    transfers = [Transfer("all_reduce", "tp", 4000, 10, "forward"), Transfer("all_reduce", "dp", 8000, 3, "grads"),
                 Transfer("all_reduce", "world", 24, 1, "loss")]
    report = _report(dp=2, tp=2, collectives=transfers)
    calls = sum(t.count for t in transfers)
    for alpha in (1e-4, 3e-4):
        assert (_cost(report, _calibration(alpha=2 * alpha)) - _cost(report, _calibration(alpha=alpha))
                == pytest.approx(calls * alpha, rel=1e-9))


def test_a_collective_sends_its_ring_share_at_the_calibrated_bandwidth():
    report = _report(dp=4, collectives=[Transfer("all_reduce", "dp", 8_000_000, 1, "grads")])
    base = _cost(_report(dp=4), _calibration(beta=1e9))
    assert _cost(report, _calibration(beta=1e9)) - base == pytest.approx(2 * 3 / 4 * 8_000_000 / 1e9, rel=1e-9)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("pp", [2, 4])
def test_the_bubble_is_pp_minus_one_microbatch_turns_and_shrinks_with_more_microbatches(schedule, pp):
    """Balanced stages, free messages: the step is (m + pp - 1) turns of one microbatch's
    forward and backward, so the bubble is (pp - 1) / m of the compute."""
    bubbles = []
    for m in (pp, 2 * pp, 4 * pp):
        terms = time_model.step_time(_report(pp=pp, m=m, schedule=schedule), TOKENS, _calibration())
        assert terms["bubble"] == pytest.approx((pp - 1) / m * terms["compute"], rel=1e-9)
        bubbles.append(terms["bubble"])
    assert bubbles == sorted(bubbles, reverse=True)


def test_a_point_to_point_message_costs_its_latency_on_the_critical_path():
    """1F1B at pp=2, m=1: forward on stage 0, its activations to stage 1, forward and backward
    there, the gradient back, backward on stage 0: two messages in a row."""
    send = [Transfer("send", "pp", 1000, 2, "activations"), Transfer("recv", "pp", 1000, 2, "gradients")]
    free = _cost(_report(pp=2, collectives=send), _calibration())
    slow = _cost(_report(pp=2, collectives=send), _calibration(p2p=Link(1e-3, 1e18)))
    assert slow - free == pytest.approx(2 * 1e-3, rel=1e-9)


def test_a_message_alone_costs_its_calibrated_time_at_the_speed_of_its_two_ends():
    """The point-to-point link is calibrated with every rank's pair sending at once. 1F1B at
    pp=4 with one microbatch sends its 6 messages one after the other, each with only its two
    ends busy: with a speedup of 2 for 2 ranks, each costs half its calibrated time. At dp=2 x
    pp=2 both pipelines send at once, 4 ranks busy: the calibrated time."""
    speedup = {1: 2.0, 2: 2.0, 4: 1.0}
    send = [Transfer("send", "pp", 1000, 2, "activations"), Transfer("recv", "pp", 1000, 2, "gradients")]
    for (dp, pp, messages, speed) in ((1, 4, 6, 2.0), (2, 2, 2, 1.0)):
        report = _report(dp=dp, pp=pp, collectives=send)
        free = _cost(report, _calibration(speedup=speedup))
        slow = _cost(report, _calibration(speedup=speedup, p2p=Link(1e-3, 1e18)))
        assert slow - free == pytest.approx(messages * 1e-3 / speed, rel=1e-9)


def test_a_message_in_a_full_pipeline_costs_its_time_at_the_speed_of_the_ranks_the_pipeline_keeps_busy():
    """1F1B at pp=4 with 16 microbatches of forward 1 and backward 2 and free messages: each
    rank is busy 16 x 3 of (16 + 3) x 3, so 4 x 16 / 19 ranks are busy on average, and a
    message costs its calibrated time at the speed of that many (the speedup interpolated
    linearly between 2 and 4 ranks)."""
    speedup = {1: 2.0, 2: 2.0, 4: 1.0}
    full = simulate(build_schedule("1f1b", 4, 16, 1), 4, 1.0, 2.0)
    busy = 4 * 16 / 19
    expected = 1e-3 / (2.0 + (busy - 2) / 2 * (1.0 - 2.0))
    assert time_model.message_seconds(1e-3, full, 1, _calibration(speedup=speedup).speed) == pytest.approx(
        expected, rel=1e-9)
    assert time_model.message_seconds(1e-3, full, 1, _calibration().speed) == 1e-3   # no speedup: as calibrated


def test_overheads_are_per_unit_and_per_microbatch_on_every_turn_and_per_step_once():
    unit, microbatch, step = 1e-4, 3e-4, 5e-3
    for m in (1, 4):
        report = _report(m=m, units=6)
        terms = time_model.step_time(report, TOKENS, _calibration(unit=unit, microbatch=microbatch, step=step))
        assert terms["overhead"] == pytest.approx(m * (6 * unit + microbatch) + step, rel=1e-9)


def test_gradient_reduction_hides_behind_the_last_backward_by_the_calibrated_overlap():
    compute = 6 * PARAMS / 4 * TOKENS / FLOPS
    backward = 4 / 6 * compute
    grads = Transfer("all_reduce", "dp", 1, 1, "grads")
    for reduce_seconds in (backward / 2, 2 * backward):   # shorter and longer than the backward
        calibration = dict(alpha=reduce_seconds, beta=1e18)
        report = _report(dp=2, collectives=[grads])
        exposed = {overlap: time_model.step_time(report, TOKENS, _calibration(overlap=overlap, **calibration))["comms"]
                   for overlap in (0.0, 0.5, 1.0)}
        assert exposed[0.0] == pytest.approx(reduce_seconds, rel=1e-9)
        for overlap in (0.5, 1.0):
            assert exposed[overlap] == pytest.approx(reduce_seconds - overlap * min(reduce_seconds, backward), rel=1e-9)


def test_the_optimizer_step_streams_states_and_weights_on_the_device_and_the_host_when_offloaded():
    memory = 1e9
    device = time_model.step_time(_report(optimizer_bytes=8 * PARAMS // 4 * 4), TOKENS, _calibration(memory=memory))
    assert device["host"] == pytest.approx((2 * 8 * PARAMS + 3 * PARAMS) / memory, rel=1e-9)
    sharded = time_model.step_time(_report(dp=2, zero=1, optimizer_bytes=PARAMS), TOKENS, _calibration(memory=memory))
    assert sharded["host"] == pytest.approx((2 * PARAMS + 3 * PARAMS / 2) / memory, rel=1e-9)
    offloaded = time_model.step_time(_report(offload=True, host_bytes=3 * PARAMS), TOKENS, _calibration(memory=memory))
    assert offloaded["host"] == pytest.approx(2 * 3 * PARAMS / memory, rel=1e-9)


def test_zero3_computes_with_the_gathered_weights_and_pays_its_calibrated_work_per_unit_per_microbatch():
    plain = time_model.step_time(_report(dp=2), TOKENS, _calibration())
    zero3 = time_model.step_time(_report(dp=2, zero=3, units=5), TOKENS, _calibration(zero={3: 1e-3}))
    assert zero3["compute"] == pytest.approx(2 * plain["compute"], rel=1e-9)
    assert zero3["overhead"] == pytest.approx(5 * 1e-3, rel=1e-9)
    # its gathers repeat every microbatch, and so does its work; another stage's work is once per step
    four = time_model.step_time(_report(dp=2, zero=3, units=5, m=4), TOKENS, _calibration(zero={3: 1e-3}))
    assert four["overhead"] == pytest.approx(4 * 5 * 1e-3, rel=1e-9)
    zero1 = time_model.step_time(_report(dp=2, zero=1, units=5, m=4), TOKENS, _calibration(zero={1: 1e-3}))
    assert zero1["overhead"] == pytest.approx(5 * 1e-3, rel=1e-9)


def test_zero3_gathers_and_scatters_run_inside_the_ops_at_the_busy_latency_and_hide_nothing():
    """zero=3's weight gathers and gradient rows (gloo's reduce-scatter) are issued between
    computations every microbatch: the busy latency per call, as tp's, and none of it hidden
    behind backward by the overlap; at zero=1 the same gathers (after the step) cost the
    plain link's latency and the rows hide behind backward (an overlap of 1)."""
    calls = 12
    transfers = [Transfer("all_gather", "dp", 0, calls, "weights (zero=3)"),
                 Transfer("send", "dp", 0, calls, "gradient rows (zero=3)")]
    alpha, busy = 1e-4, 5e-4
    for zero, expected in ((3, 2 * calls * busy), (1, calls * alpha)):
        report = _report(dp=2, zero=zero, collectives=transfers)
        calibration = _calibration(alpha=alpha, busy_latency={2: busy}, overlap=1.0, p2p=Link(1e-5, 1e18))
        assert time_model.step_time(report, TOKENS, calibration)["comms"] == pytest.approx(expected, rel=1e-9)


def test_recomputation_adds_its_flops_to_the_backward():
    terms = time_model.step_time(_report(recompute_flops=2e9), TOKENS, _calibration())
    base = time_model.step_time(_report(), TOKENS, _calibration())
    assert terms["compute"] - base["compute"] == pytest.approx(2e9 / FLOPS, rel=1e-9)
    assert terms["recompute"] == pytest.approx(2e9 / FLOPS, rel=1e-9)


def test_throughput_is_interpolated_in_log_rows_and_the_model_throughput_scales_with_the_tp_matmuls():
    calibration = _calibration()
    calibration.matmul = {1: [(16, 1e9), (256, 5e9)], 2: [(16, 0.5e9), (256, 2.5e9)]}
    assert calibration.flops(64, 1) == pytest.approx(3e9, rel=1e-9)      # halfway in log2: 4 of 8
    assert calibration.flops(8, 1) == 1e9 and calibration.flops(1024, 1) == 5e9
    calibration.model_flops = 2e9
    assert calibration.flops(64, 1) == pytest.approx(2e9, rel=1e-9)
    assert calibration.flops(64, 2) == pytest.approx(1e9, rel=1e-9)


def test_speed_with_fewer_ranks_computing_is_interpolated_linearly_between_the_counts_measured():
    calibration = _calibration(speedup={1: 2.0, 4: 1.0})
    assert calibration.speed(2) == pytest.approx(2.0 - 1 / 3, rel=1e-9)
    assert calibration.speed(0.5) == 2.0 and calibration.speed(8) == 1.0
    assert _calibration().speed(1) == 1.0          # nothing measured: every rank's speed together


def test_a_pipeline_rank_alone_computes_at_its_speed_alone_and_pays_the_executors_overheads_as_calibrated():
    """1F1B at pp=2 with one microbatch runs its four ops one after the other: each alone, so
    with a speedup of 2 alone every op's compute and its units' work per step take half as
    long; the executor's overheads per unit and per stage call do not change (they are fitted
    from pipeline steps whose ranks ran them about as fast as a rank alone)."""
    calibration = dict(unit=1e-3, microbatch=2e-3, unit_step=4e-3)
    report = _report(pp=2, m=1)
    together = time_model.step_time(report, TOKENS, _calibration(**calibration))
    alone = time_model.step_time(report, TOKENS, _calibration(speedup={1: 2.0, 2: 1.0}, **calibration))
    assert alone["compute"] == pytest.approx(together["compute"] / 2, rel=1e-9)
    executor = 2 * (2 * 1e-3 + 2e-3)           # per stage: 2 units and its call, one microbatch
    units_work = 2 * 2 * 4e-3                   # the units' work per step, on each stage's rank
    assert together["overhead"] == pytest.approx(executor / 2 + units_work / 2, rel=1e-9)  # the slowest rank's own
    assert alone["overhead"] == pytest.approx(executor / 2 + units_work / 4, rel=1e-9)
    saved = _cost(report, _calibration(**calibration)) - _cost(report, _calibration(speedup={1: 2.0, 2: 1.0},
                                                                                    **calibration))
    assert saved == pytest.approx((together["compute"] * 2 + units_work) / 2, rel=1e-9)   # both ranks' ops, halved


def test_the_executors_overheads_cost_more_where_ops_run_beside_each_other():
    """With nothing to compute, 1F1B at pp=2 with 8 microbatches overlaps most of its ops:
    with a speedup of 2 alone those cost up to twice their calibrated executor overhead, an
    op alone (the first forward, the last backward) its calibrated one."""
    report = _report(pp=2, m=8)
    empty = dict(unit=1e-3, microbatch=2e-3)
    plain = time_model.step_time(report, 0, _calibration(**empty))
    shared = time_model.step_time(report, 0, _calibration(speedup={1: 2.0, 2: 1.0}, **empty))
    assert plain["overhead"] < shared["overhead"] < 2 * plain["overhead"]
    assert _cost(report, _calibration(speedup={1: 2.0, 2: 1.0}, **empty), 0) > _cost(report, _calibration(**empty), 0)


def test_the_speed_alone_matters_less_as_microbatches_fill_the_bubble_and_not_at_all_without_a_pipeline():
    speedup = {1: 2.0, 2: 1.0}
    saved = []
    for m in (1, 2, 8):
        report = _report(pp=2, m=m)
        saved.append(1 - _cost(report, _calibration(speedup=speedup)) / _cost(report, _calibration()))
    assert saved[0] == pytest.approx(0.5, rel=1e-9) and saved[0] > saved[1] > saved[2] > 0
    assert _cost(_report(dp=2), _calibration(speedup=speedup)) == pytest.approx(_cost(_report(dp=2), _calibration()),
                                                                               rel=1e-9)


def test_a_tp_collective_between_computations_costs_the_busy_latency_per_call_and_a_dp_one_does_not():
    tp_calls, dp_calls = 10, 3
    transfers = [Transfer("all_reduce", "tp", 4000, tp_calls, "forward"),
                 Transfer("all_reduce", "dp", 8000, dp_calls, "grads")]
    report = _report(dp=2, tp=2, collectives=transfers)
    alpha, busy = 1e-4, 5e-4
    plain = _cost(report, _calibration(alpha=alpha))
    assert _cost(report, _calibration(alpha=alpha, busy_latency={2: busy})) - plain == pytest.approx(
        tp_calls * (busy - alpha), rel=1e-9)
    # under the tight loop's too: it is what all-reduces between computations took
    assert plain - _cost(report, _calibration(alpha=alpha, busy_latency={2: alpha / 2})) == pytest.approx(
        tp_calls * alpha / 2, rel=1e-9)


def test_a_zero3_gather_between_computations_costs_the_larger_of_its_own_latency_and_the_busy_one():
    """The busy latency was timed on all-reduces: an all-gather inside the ops (zero=3's)
    takes it where it exceeds the all-gather's own, its own where not."""
    calibration = _calibration(alpha=1e-4, busy_latency={2: 5e-4})
    assert calibration.busy_link("all_gather", 2).alpha == 5e-4
    calibration.busy_latency = {2: 5e-5}
    assert calibration.busy_link("all_gather", 2).alpha == 1e-4
    assert calibration.busy_link("all_reduce", 2).alpha == 5e-5


def test_the_search_ranks_by_the_calibrated_cost():
    model, inputs, loss_fn, target = plan_targets.gpt_blocks()
    calibration = _calibration(alpha=1e-4, unit=1e-4, microbatch=5e-4, step=1e-3, overlap=0.5, memory=5e9)
    result = auto.search(model, 2, inputs, loss_fn=loss_fn, optimizer=helpers.adamw(), example_target=target,
                         calibration=calibration)
    legal = [c for c in result.candidates if not c.reason]
    assert result.best.cost == min(c.cost for c in legal)
    for c in legal:
        assert c.cost == pytest.approx(sum(c.terms[k] for k in auto.TERMS), rel=1e-9)
    assert "overhead" in result.to_text() and "time_model.py" in result.to_text()


# ---- the calibration's cache -------------------------------------------------------------------
def _fake_ranks(world):
    link = Link(1e-5, 1e9)
    rank = {"matmul": {1: [(16, 1e9)]}, "collectives": {"all_reduce": {world: link}}, "p2p": link, "overlap": 0.5,
            "memory_bandwidth": 1e10, "model_steps": {}, "unit_overhead": 1e-4, "microbatch_overhead": 2e-4, "unit_step_overhead": 3e-4,
            "step_overhead": 1e-3, "zero_steps": {}, "speedup": {1: 1.0}, "busy_latency": {}}
    return [rank] * world


def test_calibration_is_cached_per_machine_and_torch_version_and_measured_again_when_they_change(tmp_path,
                                                                                                  monkeypatch):
    monkeypatch.setenv("GRAPHPAR_CACHE", str(tmp_path))
    launched = []

    def fake_launch(fn, world_size, args, backend):
        launched.append(world_size)
        return _fake_ranks(world_size)

    monkeypatch.setattr(calibration_module, "launch", fake_launch)
    first = calibration_module.calibrate(2)
    assert launched == [2] and first.unit_overhead == 1e-4
    again = calibration_module.calibrate(2)
    assert launched == [2] and again == first                 # read back from the cache, nothing run
    assert json.loads(calibration_module.cache_path(first.key).read_text())["key"] == first.key
    monkeypatch.setattr(torch, "__version__", "0.0.0-other")
    calibration_module.calibrate(2)
    assert launched == [2, 2]                                 # a new torch: measured again
    monkeypatch.setattr(calibration_module.socket, "gethostname", lambda: "another-machine")
    calibration_module.calibrate(2)
    assert launched == [2, 2, 2]                              # a new machine too
    calibration_module.calibrate(4)
    assert launched == [2, 2, 2, 4]                           # and another world size
    calibration_module.calibrate(2, refresh=True)
    assert launched == [2, 2, 2, 4, 2]
    calibration_module.calibrate(2, optimizer=functools.partial(torch.optim.SGD, lr=0.1))
    assert launched == [2, 2, 2, 4, 2, 2]                     # another optimizer: its steps differ
    calibration_module.calibrate(2, optimizer=functools.partial(torch.optim.SGD, lr=0.1))
    assert launched == [2, 2, 2, 4, 2, 2]                     # the same one again (no addresses in the key)


def test_calibrate_refuses_an_optimizer_it_cannot_hand_to_the_ranks_before_running_anything(monkeypatch):
    monkeypatch.setattr(calibration_module, "launch", pytest.fail)
    with pytest.raises(ValueError, match="cannot be pickled for the ranks.*functools.partial"):
        calibration_module.calibrate(2, optimizer=lambda params: torch.optim.SGD(params, lr=0.1), refresh=True)


@pytest.mark.parametrize("ranks, cores, expected", [(2, 2, 1.0), (4, 2, 3.0), (3, 4, 1.0)])
def test_loops_give_their_least_unless_the_ranks_outnumber_the_cores_then_their_median(monkeypatch, ranks, cores,
                                                                                       expected):
    """Where ranks share cores the least is a loop run while the others happened not to."""
    monkeypatch.setattr(calibration_module.dist, "get_world_size", lambda: ranks)
    monkeypatch.setattr(calibration_module, "_cores", lambda: cores)
    assert calibration_module._typical([5.0, 1.0, 3.0, 4.0, 2.0]) == expected


def test_calibrate_refuses_a_bad_world_size_before_running_anything():
    with pytest.raises(ValueError, match="world_size=0 must be a positive integer"):
        calibration_module.calibrate(0)


def test_the_overheads_are_the_least_squares_fits_through_the_tiny_steps():
    """The tiny GPT's step times made by the time model's own arithmetic (a step's overhead,
    each unit's per microbatch and per step, each stage call's; 1F1B's m + pp - 1 turns and
    interleaved 1F1B's m v + pp - 1; ZeRO's extra against zero=0): the fit gives back
    exactly what went in (float rounding, rel 1e-9)."""
    unit, unit_step, microbatch, step, world = 2e-4, 7e-4, 5e-4, 3e-3, 4
    extra = {1: 1e-3, 2: 2e-3, 3: 7e-3}
    seconds = {("dp", blocks): step + (blocks + 4) * (unit + unit_step) + microbatch
               for blocks in calibration_module.OVERHEAD_BLOCKS}
    seconds.update({("zero", z): 0.05 + extra.get(z, 0.0) for z in (0, 1, 2, 3)})
    seconds.update({("pp", m): step + (m + world - 1) * ((world + 4) / world * unit + microbatch)
                    for m in calibration_module.OVERHEAD_MICROBATCHES})
    m, v = calibration_module.INTERLEAVED_MICROBATCHES, calibration_module.INTERLEAVED_VIRTUAL
    units = calibration_module._interleaved_blocks(world) + 4
    seconds[("interleaved", m)] = step + (m * v + world - 1) * (units / (world * v) * unit + microbatch)
    found = calibration_module.overheads_from(world, seconds)
    assert found["unit_overhead"] == pytest.approx(unit, rel=1e-9)
    assert found["unit_step_overhead"] == pytest.approx(unit_step, rel=1e-9)
    assert found["microbatch_overhead"] == pytest.approx(microbatch, rel=1e-9)
    assert found["step_overhead"] == pytest.approx(step, rel=1e-9)
    assert found["zero_steps"] == pytest.approx(extra, rel=1e-9)


@pytest.mark.parametrize("speedup", [{}, {1: 2.0, 2: 2.0, 4: 1.0}])
def test_the_pipeline_overheads_leave_out_what_their_messages_add(speedup):
    """Tiny pipeline steps made by the simulator with messages of 0.4 ms as calibrated, each
    at the speed of the ranks busy while it is in flight (the time model's
    message_seconds; with a speedup of 2 for 2 ranks the emptier pipelines' messages cost
    less): the fit takes their share out and gives back the unit's and the call's overheads
    that went in (refitted until settled: rel 1e-6, the settling bound over costs of 1e-4 s
    and float rounding); kept in, they inflate the call's (by 5% and 20% here)."""
    world, unit, call, step, message = 4, 2e-4, 5e-4, 3e-3, 4e-4
    seconds = {("dp", blocks): 1e-2 + (blocks + 4) * 1e-3 for blocks in calibration_module.OVERHEAD_BLOCKS}
    seconds.update({("zero", z): 0.05 for z in (0, 1, 2, 3)})
    speed = _calibration(speedup=speedup).speed
    for key, schedule, _, stage_units in calibration_module._tiny_pipelines(world):
        cost = stage_units * unit + call
        first = simulate(schedule, world, cost / 3, 2 * cost / 3, p2p_cost=message)
        at_speed = time_model.message_seconds(message, first, 1, speed)
        seconds[key] = step + simulate(schedule, world, cost / 3, 2 * cost / 3, p2p_cost=at_speed).makespan
    found = calibration_module.overheads_from(world, seconds, message, speedup)
    assert found["unit_overhead"] == pytest.approx(unit, rel=1e-6)
    assert found["microbatch_overhead"] == pytest.approx(call, rel=1e-6)
    assert calibration_module.overheads_from(world, seconds)["microbatch_overhead"] > 1.04 * call


def test_a_units_step_overhead_is_paid_once_per_step_however_many_microbatches():
    """unit_step_overhead (a unit's optimizer step and gradients) adds units x itself to a
    step at 1 and at 4 microbatches alike, where the per-microbatch unit overhead adds 4
    times as much at 4 (float rounding, rel 1e-9)."""
    for m in (1, 4):
        base = _cost(_report(m=m, units=3), _calibration())
        per_step = _cost(_report(m=m, units=3), _calibration(unit_step=1e-3))
        per_microbatch = _cost(_report(m=m, units=3), _calibration(unit=1e-3))
        assert per_step - base == pytest.approx(3e-3, rel=1e-9)
        assert per_microbatch - base == pytest.approx(3e-3 * m, rel=1e-9)


@pytest.mark.parametrize("pp, units", [(1, 6), (2, 3), (4, 2)])
def test_the_models_overhead_is_paid_per_microbatch_each_stage_its_units_share(pp, units):
    """model_overhead is one microbatch of the whole model: at pp = 1 a step pays it m times;
    in a pipeline each stage pays its units' share per microbatch, so the busiest rank pays
    1 / pp of it per turn, on the (m + pp - 1) turns of a balanced 1F1B step (free messages;
    float rounding, rel 1e-9)."""
    overhead = 2e-3
    for m in (pp, 4 * pp):
        report = _report(pp=pp, m=m, units=units)
        extra = _cost(report, _with_model_overhead(overhead)) - _cost(report, _calibration())
        assert extra == pytest.approx((m + pp - 1) * overhead / pp, rel=1e-9)


def _with_model_overhead(seconds):
    calibration = _calibration()
    calibration.model_overhead = seconds
    return calibration


def test_zero_work_per_unit_is_the_measured_extra_less_what_the_model_counts_over_the_units():
    """Planned for real (the tiny GPT, no timing): each second more measured is 1 / units
    more per unit; slower all-gathers leave less of the same measurement to ZeRO's own work
    (its gathers count for more of it); the result is never negative."""
    units = calibration_module.ZERO_BLOCKS + 4
    fast, slow = _calibration(alpha=1e-5, beta=1e10), _calibration(alpha=1e-5, beta=1e10)
    slow.collectives["all_gather"] = {2: Link(1e-5, 1e8)}   # zero=3's gathers slower; zero=0 gathers nothing

    def per_unit(calibration, seconds):
        return calibration_module.zero_overhead(calibration, {3: seconds}, 2, 8, "gloo",
                                                 calibration_module.DEFAULT_OPTIMIZER)[3]

    assert per_unit(fast, 1.0) - per_unit(fast, 0.5) == pytest.approx(0.5 / units, rel=1e-9)
    assert per_unit(slow, 1.0) < per_unit(fast, 1.0)
    assert per_unit(slow, 0.0) == 0.0            # the gathers alone would take longer than measured


def _model_calibration(seconds_at, split_extra=None):
    """model_terms of the tiny GPT (2 blocks, width 8) at world 2, its steps' seconds
    `seconds_at(tokens)` at each batch calibrate times (no timing); with `split_extra`, the
    largest batch in microbatches of one sequence too, that many seconds slower."""
    model, x = calibration_module._tiny_gpt(2, 8)
    steps = {"dp": [(b * x.shape[1], seconds_at(b * x.shape[1])) for b in calibration_module.MODEL_BATCHES]}
    if split_extra is not None:
        tokens, seconds = steps["dp"][-1]
        steps["microbatches"] = [(tokens, seconds + split_extra)]
    calibration = _calibration(alpha=1e-5, beta=1e9, unit=1e-4, memory=1e10)
    calibration_module.model_terms(calibration, (model, (x,), lm_loss, x), steps, 2, "gloo",
                                   calibration_module.DEFAULT_OPTIMIZER)
    return calibration, model, x


def _planned(model, x, strategy):
    return report_from(unit_analysis(model, strategy, (x,), lm_loss, x, 2, {}), model, strategy, 2,
                       calibration_module.DEFAULT_OPTIMIZER, {}, backend="gloo")


def test_the_models_throughput_is_the_slope_and_its_work_per_step_what_the_steps_take_beyond_the_model():
    """Steps of 3 ms plus 1 us per token: the throughput is the plan's 6 flops per parameter
    per token over 1 us; the time model then gives back each step's time (a line through a
    line: float rounding, rel 1e-9) with the model's work per step making up what its other
    terms miss; a second more of every step is a second more of it; steps faster than the
    other terms give leave it at 0. Without a step in microbatches, none per microbatch."""
    calibration, model, x = _model_calibration(lambda tokens: 3e-3 + 1e-6 * tokens)
    report = _planned(model, x, Strategy(dp=2))
    assert calibration.model_flops == pytest.approx(6 * report.ranks[0].param_bytes / 4 / 1e-6, rel=1e-9)
    assert 0 < calibration.step_overhead < 3e-3 and calibration.model_overhead == 0.0
    for b in calibration_module.MODEL_BATCHES:
        tokens = b * x.shape[1]
        assert _cost(report, calibration, tokens) == pytest.approx(3e-3 + 1e-6 * tokens, rel=1e-9)
    slower, _, _ = _model_calibration(lambda tokens: 1.0 + 3e-3 + 1e-6 * tokens)
    assert slower.step_overhead == pytest.approx(calibration.step_overhead + 1.0, rel=1e-9)
    faster, _, _ = _model_calibration(lambda tokens: 1e-9 * tokens)
    assert faster.step_overhead == 0.0


def test_the_models_overhead_per_microbatch_is_what_a_microbatch_more_takes_beyond_the_model():
    """The largest batch (4 sequences) in 4 microbatches: 3 ms more of that step is 1 ms more
    per microbatch; the time model then gives back both that step's time and the
    one-microbatch steps' (float rounding, rel 1e-9); a split step no slower than the other
    terms give leaves it at 0."""
    line = lambda tokens: 0.2 + 1e-6 * tokens   # noqa: E731  (0.2 s a step: room for the per-step work left)
    calibration, model, x = _model_calibration(line, split_extra=0.1)
    more, _, _ = _model_calibration(line, split_extra=0.103)
    assert more.model_overhead - calibration.model_overhead == pytest.approx(1e-3, rel=1e-9)
    tokens = calibration_module.MODEL_BATCHES[-1] * x.shape[1]
    split = _planned(model, x, calibration_module._microbatch_step(2, calibration_module.MODEL_BATCHES[-1]))
    assert _cost(split, calibration, tokens) == pytest.approx(line(tokens) + 0.1, rel=1e-9)
    for b in calibration_module.MODEL_BATCHES:
        assert _cost(_planned(model, x, Strategy(dp=2)), calibration, b * x.shape[1]) == pytest.approx(
            line(b * x.shape[1]), rel=1e-9)
    none, _, _ = _model_calibration(line, split_extra=0.0)
    assert none.model_overhead == 0.0


def test_the_models_tp_step_sets_the_busy_latency_that_gives_back_its_time():
    """The tiny GPT planned at tp = 2 (no timing): a step 1 ms per tp call slower than the
    time model gives raises every group's busy latency by 1 ms, and the time model then
    gives back the step's time (float rounding, rel 1e-9); a step faster than the other
    terms allow leaves the timed group's at 0, and none below."""
    model, x = calibration_module._tiny_gpt(2, 8)
    calibration = _calibration(alpha=1e-5, beta=1e9, unit=1e-4, memory=1e10, busy_latency={2: 2e-4, 4: 3e-4})
    report = _planned(model, x, Strategy(tp=2))
    calls = sum(t.count for t in report.ranks[0].collectives if t.axis == "tp")
    assert calls > 0
    seconds = _cost(report, calibration, x.numel()) + calls * 1e-3
    found = calibration_module.tp_latency(calibration, report, x.numel(), seconds)
    assert found == pytest.approx({2: 2e-4 + 1e-3, 4: 3e-4 + 1e-3}, rel=1e-9)
    calibration.busy_latency = found
    assert _cost(report, calibration, x.numel()) == pytest.approx(seconds, rel=1e-9)
    faster = calibration_module.tp_latency(calibration, report, x.numel(), 0.0)
    assert faster[2] == 0.0 and faster[4] >= 0.0


def test_the_models_tp_step_gives_back_its_time_when_its_all_reduces_beat_the_tight_loop():
    """The tight loop of every rank at once timed 1 ms a call, the matmul and all-reduce
    0.2 ms; the model's tp step ran as 0.6 ms a call would: its group's busy latency comes
    out at 0.6 ms, under the loop's, and the time model gives back the step's time (float
    rounding, rel 1e-9). A group the step did not time (4 ranks) gets the same 0.4 ms more
    over the larger of its busy and loop latencies: the loop still bounds it."""
    model, x = calibration_module._tiny_gpt(2, 8)
    report = _planned(model, x, Strategy(tp=2))
    calibration = _calibration(alpha=1e-3, beta=1e9, unit=1e-4, memory=1e10, busy_latency={2: 6e-4})
    seconds = _cost(report, calibration, x.numel())
    calibration.busy_latency = {2: 2e-4, 4: 2e-4}
    calibration.busy_latency = calibration_module.tp_latency(calibration, report, x.numel(), seconds)
    assert calibration.busy_latency == pytest.approx({2: 6e-4, 4: 1e-3 + 4e-4}, rel=1e-9)
    assert _cost(report, calibration, x.numel()) == pytest.approx(seconds, rel=1e-9)


def test_a_noisy_speedup_is_made_monotone_never_below_one_and_never_above_a_smaller_count():
    # as many cores as ranks: no share of the cores to add
    assert calibration_module.monotone_speedup({1: 1.37, 2: 1.51, 4: 1.0}, 4, 4) == {1: 1.51, 2: 1.51, 4: 1.0}
    assert calibration_module.monotone_speedup({1: 3.9, 2: 0.9, 4: 1.0}, 4, 4) == {1: 3.9, 2: 1.0, 4: 1.0}


def test_a_speedup_is_at_least_the_share_of_the_cores_the_ranks_computing_get():
    # 4 ranks on 2 cores get half a core each; 1 or 2 of them a whole one: 2x at least
    assert calibration_module.monotone_speedup({1: 1.8, 2: 1.7, 4: 1.0}, 4, 2) == {1: 2.0, 2: 2.0, 4: 1.0}
    assert calibration_module.monotone_speedup({1: 2.3, 2: 2.1, 4: 1.0}, 4, 2) == {1: 2.3, 2: 2.1, 4: 1.0}
    # 8 ranks on 2 cores: 4 of them a half each against a quarter
    assert calibration_module.monotone_speedup({1: 3.0, 2: 3.0, 4: 1.5, 8: 1.0}, 8, 2) == {1: 4.0, 2: 4.0, 4: 2.0, 8: 1.0}
    # no more ranks than cores: every rank has a core of its own, nothing to add
    assert calibration_module.monotone_speedup({1: 1.1, 2: 1.0}, 2, 2) == {1: 1.1, 2: 1.0}
