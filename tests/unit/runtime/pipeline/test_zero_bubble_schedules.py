"""The schedules that split backward (graphpar/runtime/pipeline/schedules.py): ZB-H1
("zero-bubble") and ZB-V ("zbv"), as data: checked, simulated with unit forward,
input-gradient (B) and weight-gradient (W) costs, and drawn in three colours.

No model and no torch.distributed: schedules are plain instruction lists.
"""
import xml.etree.ElementTree as ET

import pytest

from graphpar.planner.drawing import timeline_svg
from graphpar.runtime.pipeline.check import check_schedule
from graphpar.runtime.pipeline.chrome_trace import to_chrome_trace
from graphpar.runtime.pipeline.schedules import Instr, ScheduleError, build_eval_schedule, build_schedule
from graphpar.runtime.pipeline.simulate import op_costs_of, simulate, stage_costs_of
from graphpar.strategy import rank_stages, stage_rank

LETTER = {"forward": "F", "backward": "B", "backward_weight": "W"}
CONFIGS = [(name, pp, m, v) for name, v in (("zero-bubble", 1), ("zbv", 2))
           for pp in (2, 3, 4, 8) for m in (1, 2, 3, 4, 8, 16)]


def _compute(instrs):
    return [(LETTER[i.op], i.stage, i.mb) for i in instrs if i.op in LETTER]


def _error(fn, *args, **kwargs) -> str:
    with pytest.raises(ScheduleError) as info:
        fn(*args, **kwargs)
    return str(info.value)


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: "{}-pp{}-m{}".format(*c[:3]))
def test_split_schedules_are_valid_and_run_every_weight_gradient_after_its_backward(cfg):
    name, pp, m, v = cfg
    schedule = build_schedule(name, pp, m, v)
    check_schedule(schedule, pp, m, v, name=name)
    check_schedule(build_eval_schedule(pp, m, v, name), pp, m, v, name=name)
    for rank, instrs in enumerate(schedule):
        order = _compute(instrs)
        stages = rank_stages(rank, pp, pp * v, name)
        assert sorted(order) == sorted((k, s, mb) for k in "BFW" for s in stages for mb in range(m))
        for s in stages:
            for mb in range(m):
                assert order.index(("F", s, mb)) < order.index(("B", s, mb)) < order.index(("W", s, mb))
    # forward 1, input gradient 1, weight gradient 1 per chunk: 3 per microbatch and chunk
    assert simulate(schedule, pp).busy == [3.0 * v * m] * pp


@pytest.mark.parametrize("pp", (2, 4, 8))
@pytest.mark.parametrize("m_per_pp", (1, 2, 4))
def test_zb_h1_idles_a_third_of_1f1b_with_unit_costs(pp, m_per_pp):
    """F = B = W = 1 (1F1B's backward is B + W = 2): 1F1B idles 3 (pp - 1) per rank, ZB-H1
    pp - 1 (the paper's bubble rates (p - 1) / m and (p - 1) / 3m); makespan 3m + pp - 1."""
    m = m_per_pp * pp
    plain = simulate(build_schedule("1f1b", pp, m), pp, forward_cost=1, backward_cost=2, weight_cost=1)
    zero = simulate(build_schedule("zero-bubble", pp, m), pp, forward_cost=1, backward_cost=2, weight_cost=1)
    assert plain.idle == [3.0 * (pp - 1)] * pp
    assert zero.idle == [1.0 * (pp - 1)] * pp
    assert sum(zero.idle) * 3 == sum(plain.idle)
    assert zero.makespan == 3 * m + pp - 1


def test_zb_h1_order():
    """Rank r runs the weight gradient of its k-th backward after its (k + r)-th one."""
    schedule = build_schedule("zero-bubble", 2, 4)
    assert _compute(schedule[0]) == [("F", 0, 0), ("F", 0, 1), ("B", 0, 0), ("W", 0, 0), ("F", 0, 2), ("B", 0, 1),
                                     ("W", 0, 1), ("F", 0, 3), ("B", 0, 2), ("W", 0, 2), ("B", 0, 3), ("W", 0, 3)]
    assert _compute(schedule[1]) == [("F", 1, 0), ("B", 1, 0), ("F", 1, 1), ("B", 1, 1), ("W", 1, 0), ("F", 1, 2),
                                     ("B", 1, 2), ("W", 1, 1), ("F", 1, 3), ("B", 1, 3), ("W", 1, 2), ("W", 1, 3)]


@pytest.mark.parametrize("pp", (2, 4, 8))
@pytest.mark.parametrize("m", (1, 3, 4, 8, 16))
def test_zb_h1_keeps_1f1b_activations_and_at_most_r_pending_weight_gradients(pp, m):
    zero = build_schedule("zero-bubble", pp, m)
    assert simulate(zero, pp).peak_in_flight == simulate(build_schedule("1f1b", pp, m), pp).peak_in_flight
    for rank, instrs in enumerate(zero):
        pending = most = 0
        for kind, _, _ in _compute(instrs):
            pending += {"B": 1, "W": -1}.get(kind, 0)
            most = max(most, pending)
        # the weight gradient of a backward runs right after the r-th next backward
        assert most == min(rank + 1, m)


def test_zbv_runs_two_chunks_per_rank_in_a_v():
    pp = 4
    assert [rank_stages(r, pp, 8, "zbv") for r in range(pp)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    schedule = build_schedule("zbv", pp, 8, 2)
    for rank, instrs in enumerate(schedule):
        for ins in instrs:
            if ins.op != "step":
                assert stage_rank(ins.stage, pp, "zbv") == rank
    # the V's turn (stage 3 to 4) stays on rank 3; rank 0 computes the first stage and the loss
    assert Instr("send_act", 3, 0, 3) in schedule[3] and Instr("recv_grad", 3, 0, 3) in schedule[3]
    assert {i.stage for i in schedule[0] if i.op == "forward"} == {0, 7}
    # rank 0 starts with 2pp - 1 forwards of its first chunk
    assert _compute(schedule[0])[:8] == [("F", 0, mb) for mb in range(7)] + [("F", 7, 0)]


@pytest.mark.parametrize("pp", (2, 4, 8))
@pytest.mark.parametrize("m", (1, 4, 8, 16))
def test_zbv_holds_no_more_than_1f1b_and_idles_less_than_zb_h1(pp, m):
    """A zbv chunk is half a rank's layers: costs and activations per chunk are halves. Each
    rank holds at most 2pp chunk-microbatches, the pp whole ones 1F1B's rank 0 holds. Once
    the V fills (m >= 2pp) a rank idles only while the first microbatch comes down to it,
    pp - 1 chunk forwards: half ZB-H1's pp - 1 rank forwards."""
    zbv = simulate(build_schedule("zbv", pp, m, 2), pp, forward_cost=0.5, backward_cost=1.0)
    assert max(zbv.peak_in_flight) <= 2 * pp
    if m >= 2 * pp:
        zero = simulate(build_schedule("zero-bubble", pp, m), pp)
        assert zbv.idle == [0.5 * (pp - 1)] * pp
        assert sum(zbv.idle) * 2 == sum(zero.idle)


def test_check_refuses_misplaced_weight_gradients():
    zero = [list(instrs) for instrs in build_schedule("zero-bubble", 2, 2)]
    _assert = lambda msg, *parts: [pytest.fail(f"{p!r} missing from: {msg}") for p in parts if p not in msg]  # noqa: E731
    # a schedule that does not split backward has no weight-gradient instructions
    _assert(_error(check_schedule, zero, 2, 2), "backward_weight(stage 0, mb 0)", "schedule '1f1b' runs each weight")
    # one split schedule missing one
    missing = [list(instrs) for instrs in zero]
    missing[1].remove(Instr("backward_weight", 1, 1))
    _assert(_error(check_schedule, missing, 2, 2, name="zero-bubble"), "backward_weight(stage 1, mb 1) appears 0 times")
    # one before its backward
    early = [list(instrs) for instrs in zero]
    early[0].remove(Instr("backward_weight", 0, 0))
    early[0].insert(0, Instr("backward_weight", 0, 0))
    _assert(_error(check_schedule, early, 2, 2, name="zero-bubble"), "rank 0, instruction #0 backward_weight",
            "the backward has not run yet")
    # a zbv stage on the looping layout's rank
    _assert(_error(check_schedule, build_schedule("interleaved-1f1b", 2, 2, 2), 2, 2, 2, name="zbv"),
            "stage 2 lives on rank 1", "under 'zbv'")


def test_weight_cost_is_part_of_the_backward():
    with pytest.raises(ValueError, match=r"weight_cost=3.*backward_cost=2.*must not exceed"):
        simulate(build_schedule("zero-bubble", 2, 2), 2, weight_cost=3)
    # schedules that do not split backward do not see it
    assert simulate(build_schedule("1f1b", 2, 4), 2, weight_cost=0.5).makespan == 15.0


def test_timelines_draw_forward_input_and_weight_gradients_in_three_colours():
    sim = simulate(build_schedule("zero-bubble", 2, 4), 2)
    assert sim.records()[1][:5] == [("F0 s1", 1.0, 2.0), ("B0 s1", 2.0, 3.0), ("F1 s1", 3.0, 4.0),
                                    ("B1 s1", 4.0, 5.0), ("W0 s1", 5.0, 6.0)]
    events = [e for e in to_chrome_trace(sim)["traceEvents"] if e["ph"] == "X"]
    colours = {e["cat"]: e["cname"] for e in events}
    assert set(colours) == {"forward", "backward", "backward_weight"} and len(set(colours.values())) == 3
    svg = ET.fromstring(timeline_svg(sim.order, "ZB-H1"))
    fills = {r.get("class"): r.get("fill") for r in svg.iter("{http://www.w3.org/2000/svg}rect") if r.get("class")}
    assert len({fills["forward"], fills["backward"], fills["backward_weight"]}) == 3
    assert "legend backward_weight" in fills


def test_stage_costs_give_stages_their_own_durations():
    """GPipe, pp=2, m=2, stage 1's forward twice as long: rank 1 runs F 1-3, 3-5 and B 5-7,
    7-9; rank 0 F 0-1, 1-2, then B of microbatch 1 on its gradient at 7 (7-9) and of 0 (9-11)."""
    schedule = build_schedule("gpipe", 2, 2)
    sim = simulate(schedule, 2, stage_costs={("forward", 1): 2.0})
    assert sim.makespan == 11.0 and sim.busy == [6.0, 8.0]
    assert [(start, end) for start, end, _ in sim.order[1]] == [(1.0, 3.0), (3.0, 5.0), (5.0, 7.0), (7.0, 9.0)]
    # the medians of a timeline's (op, stage) durations: a measured step simulated again
    assert stage_costs_of(sim.order) == {("forward", 0): 1.0, ("forward", 1): 2.0, ("backward", 0): 2.0,
                                         ("backward", 1): 2.0}
    assert simulate(schedule, 2, stage_costs=stage_costs_of(sim.order)).order == sim.order
    # one op of its own (before its stage's cost): microbatch 1's forward on stage 0 takes 3,
    # and the replay of a step with each op's own duration is that step
    slow = simulate(schedule, 2, stage_costs={("forward", 1): 2.0, ("forward", 0, 1): 3.0})
    assert slow.order[0][1][:2] == (1.0, 4.0) and slow.makespan == 12.0   # rank 1: F 1-3, 4-6, B 6-8, 8-10
    assert simulate(schedule, 2, stage_costs=op_costs_of(slow.order)).order == slow.order
    with pytest.raises(ValueError, match=r"stage_costs\[\('forward', 1\)\]=-1"):
        simulate(schedule, 2, stage_costs={("forward", 1): -1})
