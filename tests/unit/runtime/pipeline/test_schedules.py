"""Tests for graphpar.runtime.pipeline: schedules as data (schedules.py), the validator (check.py), the
simulator (simulate.py) and the pictures (chrome_trace.py, graphpar.planner.drawing).

No model and no torch.distributed: schedules are plain instruction lists.
"""

import dataclasses
import json
import pathlib
import xml.etree.ElementTree as ET

import pytest

from graphpar.runtime.pipeline import schedules as sched
from graphpar.runtime.pipeline.check import check_schedule
from graphpar.runtime.pipeline.chrome_trace import to_chrome_trace
from graphpar.runtime.pipeline.schedules import Instr, ScheduleError, build_eval_schedule, build_schedule
from graphpar.runtime.pipeline.simulate import SimResult, simulate
from graphpar.strategy import SCHEDULES
from graphpar.planner.drawing import nice_ticks, timeline_svg
from graphpar.tools.timeline import write_timeline

PPS = (2, 4)
MBS = (1, 4, 8)


def _configs():
    """(name, pp, m, v) for every schedule the brief asks about."""
    for pp in PPS:
        for m in MBS:
            yield "gpipe", pp, m, 1
            yield "1f1b", pp, m, 1
            if m % pp == 0:
                yield "interleaved-1f1b", pp, m, 2


CONFIGS = list(_configs())


def _ids(cfg):
    return "{}-pp{}-m{}-v{}".format(*cfg)


def _compute(rank_instrs):
    """A rank's compute order as ("F"|"B", stage, mb)."""
    return [("F" if i.op == "forward" else "B", i.stage, i.mb) for i in rank_instrs
            if i.op in ("forward", "backward")]


def _error(exc, fn, *args, **kwargs) -> str:
    with pytest.raises(exc) as info:
        fn(*args, **kwargs)
    return str(info.value)


def _assert_names(msg: str, *parts: str) -> None:
    for part in parts:
        assert part in msg, f"{part!r} missing from: {msg}"


# --------------------------------------------------------------------------- #
# Every schedule is valid and runs
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("cfg", CONFIGS, ids=_ids)
def test_schedule_is_valid_and_simulates(cfg):
    name, pp, m, v = cfg
    schedule = build_schedule(name, pp, m, v)
    assert len(schedule) == pp
    check_schedule(schedule, pp, m, v)
    sim = simulate(schedule, pp)
    for rank, instrs in enumerate(schedule):
        assert instrs[-1].op == "step"
        # Every rank does v*m forwards (cost 1) and v*m backwards (cost 2).
        assert sim.busy[rank] == pytest.approx(v * m * 3.0)
        assert len(sim.order[rank]) == 2 * v * m
        # Compute ops on one rank never overlap and move forward in time.
        ends = [0.0] + [end for _, end, _ in sim.order[rank]]
        for (start, end, _), prev_end in zip(sim.order[rank], ends):
            assert prev_end <= start < end


@pytest.mark.parametrize("cfg", CONFIGS, ids=_ids)
def test_bubble_fraction_matches_closed_form(cfg):
    """Bubble with forward_cost=1, backward_cost=2, no p2p latency.

    GPipe and 1F1B: the makespan is (m + p - 1) * (F + B), so the bubble is
    (p - 1) / (m + p - 1).

    Interleaved (costs are per chunk, i.e. per stage): Megatron's paper states a
    bubble time of (p - 1) * (tf + tb) / v against an ideal time of m * (tf + tb),
    where tf, tb are a whole rank's (v chunks') forward/backward time, i.e.
    tf = v * F. In per-chunk units the ideal time is v * m * (F + B) and the bubble
    (p - 1) * (F + B), so the simulated makespan is (v*m + p - 1) * (F + B) and
    bubble_fraction = bubble / (ideal + bubble) = (p - 1) / (v*m + p - 1).
    (The paper's ratio bubble/ideal = (p - 1) / (v*m) is the same quantity
    measured against the ideal time instead of the makespan.) With v = 1 this is
    the GPipe/1F1B formula, so one expression covers all three.
    """
    name, pp, m, v = cfg
    sim = simulate(build_schedule(name, pp, m, v), pp, forward_cost=1.0, backward_cost=2.0, p2p_cost=0.0)
    assert sim.makespan == pytest.approx((v * m + pp - 1) * 3.0, abs=1e-9)
    assert abs(sim.bubble_fraction - (pp - 1) / (v * m + pp - 1)) < 1e-9
    if v == 2:
        paper_ratio = (pp - 1) / (v * m)  # bubble time / ideal time, as in the paper
        ideal = v * m * 3.0
        assert (sim.makespan - ideal) / ideal == pytest.approx(paper_ratio, abs=1e-9)


def test_interleaving_shrinks_the_bubble():
    plain = simulate(build_schedule("1f1b", 4, 8), 4).bubble_fraction
    inter = simulate(build_schedule("interleaved-1f1b", 4, 8, 2), 4).bubble_fraction
    assert inter < plain


def test_p2p_latency_adds_to_the_critical_path():
    # GPipe: the forward sweep crosses p-1 links and the backward sweep p-1 links back.
    sim = simulate(build_schedule("gpipe", 4, 8), 4, p2p_cost=0.5)
    assert sim.makespan == pytest.approx((8 + 3) * 3.0 + 2 * 3 * 0.5)
    # With one microbatch 1F1B is the same chain of ops.
    sim = simulate(build_schedule("1f1b", 4, 1), 4, p2p_cost=0.5)
    assert sim.makespan == pytest.approx(4 * 3.0 + 2 * 3 * 0.5)
    # In 1F1B's steady state each backward waits on a round trip through the
    # downstream ranks, so latency is exposed more than once: never faster than GPipe.
    one = simulate(build_schedule("1f1b", 4, 8), 4, p2p_cost=0.5).makespan
    assert one > (8 + 3) * 3.0 + 2 * 3 * 0.5


# --------------------------------------------------------------------------- #
# Memory: peak in-flight microbatches
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("pp", PPS)
@pytest.mark.parametrize("m", MBS + (16,))
def test_gpipe_holds_every_microbatch(pp, m):
    assert simulate(build_schedule("gpipe", pp, m), pp).peak_in_flight == [m] * pp


@pytest.mark.parametrize("pp", PPS + (8,))
@pytest.mark.parametrize("m", MBS + (16,))
def test_1f1b_peak_in_flight_is_bounded_by_depth(pp, m):
    peak = simulate(build_schedule("1f1b", pp, m), pp).peak_in_flight
    for r in range(pp):
        assert peak[r] <= pp - r  # independent of m
        assert peak[r] == min(pp - r, m)


@pytest.mark.parametrize("pp, m, v", [(2, 2, 2), (2, 4, 2), (2, 8, 3), (4, 4, 2), (4, 8, 2), (4, 16, 4)])
def test_interleaved_peak_in_flight_is_warmup_plus_one(pp, m, v):
    # Warm-up forwards all stay in flight; the first steady forward adds one more
    # before the first backward retires one. If warm-up takes everything, all m*v are held.
    peak = simulate(build_schedule("interleaved-1f1b", pp, m, v), pp).peak_in_flight
    for r in range(pp):
        warmup = sched.interleaved_warmup(r, pp, m, v)
        assert warmup == min((pp - r - 1) * 2 + (v - 1) * pp, m * v)
        assert peak[r] == min(warmup + 1, m * v)


# --------------------------------------------------------------------------- #
# Orderings
# --------------------------------------------------------------------------- #


def test_gpipe_order():
    for r, instrs in enumerate(build_schedule("gpipe", 2, 3)):
        assert _compute(instrs) == [("F", r, 0), ("F", r, 1), ("F", r, 2),
                                    ("B", r, 2), ("B", r, 1), ("B", r, 0)]


def test_1f1b_order():
    schedule = build_schedule("1f1b", 3, 4)
    assert _compute(schedule[0]) == [("F", 0, 0), ("F", 0, 1), ("F", 0, 2), ("B", 0, 0), ("F", 0, 3),
                                     ("B", 0, 1), ("B", 0, 2), ("B", 0, 3)]
    assert _compute(schedule[2]) == [("F", 2, 0), ("B", 2, 0), ("F", 2, 1), ("B", 2, 1), ("F", 2, 2),
                                     ("B", 2, 2), ("F", 2, 3), ("B", 2, 3)]


def test_1f1b_with_fewer_microbatches_than_warmup():
    # pp=4, m=1: rank 0 would warm up 3 microbatches but only 1 exists.
    schedule = build_schedule("1f1b", 4, 1)
    assert [_compute(instrs) for instrs in schedule] == [[("F", r, 0), ("B", r, 0)] for r in range(4)]


def test_interleaved_order_follows_megatron():
    # pp=2, v=2, m=4, rank 0 holds stages 0 and 2. Warm-up = (2-0-1)*2 + (2-1)*2 = 4.
    # Forward k: chunk (k//2)%2, mb (k//4)*2 + k%2; backward: chunk reversed.
    rank0 = _compute(build_schedule("interleaved-1f1b", 2, 4, 2)[0])
    assert rank0 == [
        ("F", 0, 0), ("F", 0, 1), ("F", 2, 0), ("F", 2, 1),                    # warm-up
        ("F", 0, 2), ("B", 2, 0), ("F", 0, 3), ("B", 2, 1),                    # steady
        ("F", 2, 2), ("B", 0, 0), ("F", 2, 3), ("B", 0, 1),
        ("B", 2, 2), ("B", 2, 3), ("B", 0, 2), ("B", 0, 3),                    # cool-down
    ]
    # Rank 1 (stages 1 and 3) warms up (v-1)*pp = 2 forwards only.
    rank1 = _compute(build_schedule("interleaved-1f1b", 2, 4, 2)[1])
    assert rank1[:4] == [("F", 1, 0), ("F", 1, 1), ("F", 3, 0), ("B", 3, 0)]


def test_stage_layout_and_peers():
    schedule = build_schedule("interleaved-1f1b", 4, 4, 2)
    for rank, instrs in enumerate(schedule):
        for ins in instrs:
            if ins.op == "step":
                continue
            assert ins.stage % 4 == rank
            if ins.op in ("recv_act", "send_grad"):
                assert ins.stage > 0 and ins.peer == (ins.stage - 1) % 4
            if ins.op in ("send_act", "recv_grad"):
                assert ins.stage < 7 and ins.peer == (ins.stage + 1) % 4
    # Stage 0 never receives activations; the loss stage never receives gradients.
    ops = {(i.op, i.stage) for instrs in schedule for i in instrs}
    assert ("recv_act", 0) not in ops and ("send_grad", 0) not in ops
    assert ("send_act", 7) not in ops and ("recv_grad", 7) not in ops


def test_instr_is_frozen_and_printable():
    ins = Instr("recv_act", 3, 1, 0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        ins.mb = 2
    assert str(ins) == "recv_act(stage 3, mb 1, from rank 0)"
    assert str(Instr("forward", 3, 1)) == "forward(stage 3, mb 1)"


# --------------------------------------------------------------------------- #
# Forward-only (evaluation)
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("pp", PPS)
@pytest.mark.parametrize("m", MBS + (3,))
@pytest.mark.parametrize("v", (1, 2))
def test_eval_schedule_is_valid(pp, m, v):
    schedule = build_eval_schedule(pp, m, v)
    assert {i.op for instrs in schedule for i in instrs} <= {"recv_act", "forward", "send_act"}
    check_schedule(schedule, pp, m, v)
    check_schedule(schedule, pp, m, v, training=False)
    sim = simulate(schedule, pp)
    assert sim.busy == [v * m * 1.0] * pp
    # Nothing is ever released by a backward: every forward stays "in flight".
    assert sim.peak_in_flight == [v * m] * pp


def test_eval_schedule_matches_the_training_forward_order():
    # With m % pp == 0 the evaluation order is the training schedule's forward order.
    for name, v in (("1f1b", 1), ("interleaved-1f1b", 2)):
        train = build_schedule(name, 4, 8, v)
        evals = build_eval_schedule(4, 8, v)
        for r in range(4):
            assert _compute(evals[r]) == [c for c in _compute(train[r]) if c[0] == "F"]


def test_eval_schedule_is_not_a_training_schedule():
    msg = _error(ScheduleError, check_schedule, build_eval_schedule(2, 4), 2, 4, training=True)
    _assert_names(msg, "backward(stage 0, mb 0)", "appears 0 times")


# --------------------------------------------------------------------------- #
# Argument validation
# --------------------------------------------------------------------------- #


def test_unknown_schedule_name_suggests_the_closest():
    msg = _error(ValueError, build_schedule, "1F1b-interleaved", 2, 4, 2)
    _assert_names(msg, "schedule='1F1b-interleaved'", "must be one of", "'interleaved-1f1b'")
    msg = _error(ValueError, build_schedule, "gpip", 2, 4)
    _assert_names(msg, "'gpip'", "did you mean", "'gpipe'")
    msg = _error(ValueError, build_schedule, "zigzag", 2, 4)
    _assert_names(msg, "'zigzag'", "'gpipe', '1f1b', 'interleaved-1f1b'")
    assert SCHEDULES == ("gpipe", "1f1b", "interleaved-1f1b", "zero-bubble", "zbv")


@pytest.mark.parametrize("field, args", [
    ("pp", (0, 4, 1)), ("microbatches", (2, 0, 1)), ("virtual_stages", (2, 4, 0)),
])
def test_counts_must_be_positive(field, args):
    msg = _error(ValueError, build_schedule, "1f1b", *args)
    _assert_names(msg, f"{field}=0", ">= 1", "Fix:")
    msg = _error(ValueError, build_eval_schedule, *args)
    _assert_names(msg, f"{field}=0", ">= 1")


def test_counts_must_be_ints():
    _assert_names(_error(ValueError, build_schedule, "1f1b", 2.0, 4), "pp=2.0", "float")
    _assert_names(_error(ValueError, build_schedule, "1f1b", True, 4), "pp=True", "bool")


def test_interleaved_needs_virtual_stages():
    msg = _error(ValueError, build_schedule, "interleaved-1f1b", 2, 4, 1)
    _assert_names(msg, "virtual_stages=1", "virtual_stages > 1", "virtual_stages=2", "'1f1b'")


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_virtual_stages_only_with_interleaved(name):
    msg = _error(ValueError, build_schedule, name, 2, 4, 2)
    _assert_names(msg, "virtual_stages=2", repr(name), "only used by", "'interleaved-1f1b'", "virtual_stages=1")


def test_interleaved_needs_a_multiple_of_pp():
    msg = _error(ValueError, build_schedule, "interleaved-1f1b", 4, 6, 2)
    _assert_names(msg, "microbatches=6", "pp=4", "multiple of pp", "microbatches=4 or microbatches=8")
    msg = _error(ValueError, build_schedule, "interleaved-1f1b", 4, 1, 2)
    _assert_names(msg, "microbatches=1", "use microbatches=4")


def test_interleaved_needs_two_ranks():
    msg = _error(ValueError, build_schedule, "interleaved-1f1b", 1, 4, 2)
    _assert_names(msg, "pp=1", "at least two pipeline ranks")


def test_simulate_rejects_negative_costs():
    msg = _error(ValueError, simulate, build_schedule("1f1b", 2, 2), 2, forward_cost=-1)
    _assert_names(msg, "forward_cost=-1", ">= 0")


# --------------------------------------------------------------------------- #
# Broken schedules
# --------------------------------------------------------------------------- #


def _swap(instrs, a, b):
    instrs = list(instrs)
    instrs[a], instrs[b] = instrs[b], instrs[a]
    return instrs


def _index(instrs, op, stage, mb):
    return next(i for i, ins in enumerate(instrs) if (ins.op, ins.stage, ins.mb) == (op, stage, mb))


def test_swapped_receives_deadlock():
    # 1F1B pp=2, m=4: rank 0 sends mb 2's activations only after B(0). Swapping
    # recv_grad(mb 0) with recv_grad(mb 2) makes it wait for a gradient that rank 1
    # cannot produce without those activations.
    schedule = build_schedule("1f1b", 2, 4)
    r0 = schedule[0]
    schedule[0] = _swap(r0, _index(r0, "recv_grad", 0, 0), _index(r0, "recv_grad", 0, 2))
    msg = _error(ScheduleError, simulate, schedule, 2)
    _assert_names(msg, "deadlock", "rank 0 waits", "recv_grad(stage 0, mb 2, from rank 1)",
                  "rank 1 waits", "recv_act(stage 1, mb 2, from rank 0)", "not reached")
    # The validator finds the root cause first: a backward without its gradient.
    msg = _error(ScheduleError, check_schedule, schedule, 2, 4)
    _assert_names(msg, "rank 0", "backward(stage 0, mb 0)", "recv_grad must come first")


def test_locally_valid_but_crossed_order_deadlocks_in_check():
    # Each rank is fine on its own, but rank 1 wants mb 1 first while rank 0 wants
    # mb 0's gradient before it sends mb 1.
    f = lambda s, mb: sched._forward(s, mb, 2, 2)  # noqa: E731
    b = lambda s, mb: sched._backward(s, mb, 2, 2)  # noqa: E731
    schedule = [
        f(0, 0) + b(0, 0) + f(0, 1) + b(0, 1) + [sched.STEP],
        f(1, 1) + b(1, 1) + f(1, 0) + b(1, 0) + [sched.STEP],
    ]
    msg = _error(ScheduleError, check_schedule, schedule, 2, 2)
    _assert_names(msg, "deadlock", "rank 0 waits", "recv_grad(stage 0, mb 0", "rank 1 waits",
                  "recv_act(stage 1, mb 1")


def test_missing_send_is_a_mismatch():
    schedule = build_schedule("gpipe", 2, 2)
    schedule[0] = [i for i in schedule[0] if (i.op, i.mb) != ("send_act", 1)]
    msg = _error(ScheduleError, check_schedule, schedule, 2, 2)
    _assert_names(msg, "forward(stage 0, mb 1)", "never followed by send_act")
    msg = _error(ScheduleError, simulate, schedule, 2)
    _assert_names(msg, "rank 1 waits", "recv_act(stage 1, mb 1, from rank 0)", "never sends it")


def test_duplicate_receive_is_a_mismatch():
    schedule = build_schedule("gpipe", 2, 2)
    extra = Instr("recv_act", 1, 0, 0)
    schedule[1] = [extra] + schedule[1]
    msg = _error(ScheduleError, check_schedule, schedule, 2, 2)
    _assert_names(msg, "act message of mb 0 from stage 0 to stage 1", "sent 1 time(s) and received 2")


@pytest.mark.parametrize("mutate, expect", [
    (lambda s: s[0].insert(0, Instr("forward", 1, 0)), "stage 1 lives on rank 1"),
    (lambda s: s[0].insert(0, Instr("forward", 0, 9)), "microbatch 9 is outside 0..1"),
    (lambda s: s[0].insert(0, Instr("fwd", 0, 0)), "unknown op 'fwd'"),
    (lambda s: s[1].__setitem__(0, Instr("recv_act", 1, 0, 1)), "peer should be rank 0"),
    (lambda s: s[0].pop(), "'step' must appear exactly once"),
    (lambda s: s[1].insert(0, s[1].pop()), "'step' must appear exactly once, as the last"),
    (lambda s: s[0].insert(len(s[0]) - 1, s[0][0]), "forward(stage 0, mb 0) appears 2 times"),
    (lambda s: s.pop(), "expected pp=2"),
])
def test_malformed_schedules_are_reported(mutate, expect):
    schedule = [list(instrs) for instrs in build_schedule("1f1b", 2, 2)]
    mutate(schedule)
    _assert_names(_error(ScheduleError, check_schedule, schedule, 2, 2), expect)


# --------------------------------------------------------------------------- #
# Visualisation
# --------------------------------------------------------------------------- #


def test_chrome_trace_round_trips():
    sim = simulate(build_schedule("1f1b", 2, 4), 2)
    trace = json.loads(json.dumps(to_chrome_trace(sim)))
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(events) == sum(len(rows) for rows in sim.order)
    for e in events:
        assert set(e) >= {"name", "ph", "ts", "dur", "pid", "tid"}
        assert e["dur"] > 0
    first = min((e for e in events if e["tid"] == 1), key=lambda e: e["ts"])
    assert first["name"] == "F0 s1" and first["ts"] == pytest.approx(1e6)  # starts after rank 0's F0
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M" and e["name"] == "thread_name"}
    assert names == {"pp rank 0", "pp rank 1"}


def test_chrome_trace_from_records():
    records = {0: [("forward", 0.0, 0.5)], 3: [("backward", 0.5, 1.5)]}
    events = [e for e in to_chrome_trace(records)["traceEvents"] if e["ph"] == "X"]
    assert events == [
        {"name": "forward", "ph": "X", "ts": 0.0, "dur": 5e5, "pid": 0, "tid": 0},
        {"name": "backward", "ph": "X", "ts": 5e5, "dur": 1e6, "pid": 0, "tid": 3},
    ]
    assert to_chrome_trace([[("x", 1.0, 2.0)]])["traceEvents"][-1]["ts"] == 1e6


SVG = "{http://www.w3.org/2000/svg}"


def _boxes(svg: ET.Element, rank: int):
    group = svg.find(f"{SVG}g[@class='rank rank-{rank}']")
    return [(float(r.get("x")), float(r.get("width")), r.get("class")) for r in group.iter(f"{SVG}rect")]


def test_timeline_svg_draws_every_instruction_at_its_time():
    sim = simulate(build_schedule("interleaved-1f1b", 4, 8, 2), 4)
    svg = ET.fromstring(timeline_svg(sim.order, "interleaved 1F1B pp=4 m=8 v=2"))
    assert svg.find(f"{SVG}text[@class='title']").text == "interleaved 1F1B pp=4 m=8 v=2"
    px_per_unit = 1000 / sim.makespan  # the drawing area is 1000 px wide whatever the span
    for rank, rows in enumerate(sim.order):
        boxes = _boxes(svg, rank)
        assert [kind for _, _, kind in boxes] == [ins.op for _, _, ins in rows]
        for (x, width, _), (start, end, _) in zip(boxes, rows):
            # positions are written with 2 decimals
            assert x == pytest.approx(90 + start * px_per_unit, abs=0.01)
            assert width == pytest.approx((end - start) * px_per_unit, abs=0.01)
    legend = [r.get("class") for r in svg.iter(f"{SVG}rect") if r.get("class", "").startswith("legend")]
    assert legend == ["legend forward", "legend backward"]
    ticks = [t.text for t in svg.iter(f"{SVG}text") if t.get("text-anchor") == "middle" and t.text[0].isdigit()]
    assert ticks[0] == "0" and len(ticks) >= 5


def test_measured_timeline_svg_names_seconds_and_bubble(tmp_path):
    rows = [[(0.0, 0.5, Instr("forward", 0, 0)), (1.0, 2.0, Instr("backward", 0, 0))],
            [(0.5, 1.0, Instr("forward", 1, 0)), (1.0, 1.5, Instr("backward", 1, 0))]]
    written = write_timeline(rows, str(tmp_path))
    svg = ET.parse(written["svg"]).getroot()
    # busy 1.5 + 1.0 of 2 ranks x 2.0 s
    assert written["bubble_fraction"] == pytest.approx(1 - 2.5 / 4)
    assert svg.find(f"{SVG}text[@class='title']").text.endswith("bubble 37.5%")
    assert any(t.text == "0.5s" for t in svg.iter(f"{SVG}text"))
    assert json.loads(pathlib.Path(written["trace"]).read_text())["traceEvents"]


def test_nice_ticks():
    assert nice_ticks(10) == [0, 2, 4, 6, 8, 10]
    assert nice_ticks(0.037) == pytest.approx([0, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.035])
    assert nice_ticks(0) == [0.0]


def test_sim_result_records():
    sim = simulate(build_schedule("gpipe", 2, 1), 2)
    assert isinstance(sim, SimResult) and sim.pp == 2
    assert sim.records() == [[("F0 s0", 0.0, 1.0), ("B0 s0", 4.0, 6.0)],
                             [("F0 s1", 1.0, 2.0), ("B0 s1", 2.0, 4.0)]]
