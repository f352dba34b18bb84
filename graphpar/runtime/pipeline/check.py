"""Checking a pipeline schedule (graphpar/runtime/pipeline/schedules.py) before it runs.

``check_schedule`` raises ``ScheduleError`` naming the rank, the instruction and the
broken rule: unknown ops, stages on the wrong rank, missing or repeated work (a weight
gradient in a schedule that does not split backward, or one missing in a schedule that
does), a compute op before the receive it needs, unmatched sends and receives, and (by
simulating it) a deadlock.
"""
from __future__ import annotations

import difflib
from collections import Counter
from typing import Sequence

from graphpar.runtime.pipeline.schedules import (COMM_OPS, COMPUTE_OPS, OPS, Instr, ScheduleError, check_count,
                                                 instr_error, message_key, splits_backward, stage_rank)
from graphpar.runtime.pipeline.simulate import simulate
from graphpar.strategy import ONE_F_ONE_B

__all__ = ["check_schedule"]


def _check_instr(rank: int, index: int, ins: Instr, pp: int, m: int, num_stages: int, name: str) -> None:
    """Field-level rules: op known, stage/mb in range, on the right rank, right peer."""
    if not isinstance(ins, Instr):
        raise ScheduleError(f"rank {rank}, instruction #{index}: expected an Instr, got {ins!r}")
    if ins.op not in OPS:
        near = difflib.get_close_matches(str(ins.op), OPS, n=1)
        hint = f" (did you mean {near[0]!r}?)" if near else ""
        raise instr_error(rank, index, ins, f"unknown op {ins.op!r}{hint}; ops are {', '.join(OPS)}")
    if ins.op == "step":
        return
    if not 0 <= ins.stage < num_stages:
        raise instr_error(rank, index, ins, f"stage {ins.stage} is outside 0..{num_stages - 1} (pp*v={num_stages})")
    if not 0 <= ins.mb < m:
        raise instr_error(rank, index, ins, f"microbatch {ins.mb} is outside 0..{m - 1}")
    if stage_rank(ins.stage, pp, name) != rank:
        raise instr_error(rank, index, ins, f"stage {ins.stage} lives on rank {stage_rank(ins.stage, pp, name)} "
                                      f"(graphpar.strategy.stage_rank under {name!r}), not rank {rank}")
    if ins.op in COMPUTE_OPS:
        if ins.peer is not None:
            raise instr_error(rank, index, ins, "compute ops take no peer")
        return
    if ins.op in ("recv_act", "send_grad") and ins.stage == 0:
        raise instr_error(rank, index, ins, "stage 0 has no previous stage to talk to")
    if ins.op in ("send_act", "recv_grad") and ins.stage == num_stages - 1:
        raise instr_error(rank, index, ins, f"the last stage {num_stages - 1} has no next stage to talk to")
    _, src, dst = message_key(ins)
    other = src if ins.op.startswith("recv") else dst
    if ins.peer != stage_rank(other, pp, name):
        raise instr_error(rank, index, ins,
                          f"peer should be rank {stage_rank(other, pp, name)} (the rank of stage {other})")


def _check_step(rank: int, instrs: Sequence[Instr], training: bool) -> None:
    steps = [i for i, ins in enumerate(instrs) if ins.op == "step"]
    if not training:
        if steps:
            raise instr_error(rank, steps[0], instrs[steps[0]], "a forward-only schedule has no optimizer step")
        return
    if steps != [len(instrs) - 1]:
        where = f"at instructions {steps}" if steps else "missing"
        raise ScheduleError(f"rank {rank}: 'step' must appear exactly once, as the last instruction; "
                            f"it is {where} (list has {len(instrs)} instructions)")


def _check_local_order(rank: int, instrs: Sequence[Instr], num_stages: int) -> None:
    """On one rank: recv before compute, compute before send, forward before backward.

    Runs after ``_check_coverage``, so each compute op occurs exactly once.
    """
    seen: set[tuple[str, int, int]] = set()
    for index, ins in enumerate(instrs):
        s, mb = ins.stage, ins.mb
        need = []
        if ins.op == "forward" and s > 0:
            need.append(("recv_act", "its activations have not been received (recv_act must come first)"))
        if ins.op == "send_act":
            need.append(("forward", "the forward has not run yet"))
        if ins.op == "backward":
            need.append(("forward", "the forward has not run yet on this rank"))
            if s < num_stages - 1:
                need.append(("recv_grad", "the next stage's gradient has not been received "
                                          "(recv_grad must come first)"))
        if ins.op in ("send_grad", "backward_weight"):
            need.append(("backward", "the backward has not run yet"))
        for op, why in need:
            if (op, s, mb) not in seen:
                raise instr_error(rank, index, ins, why)
        seen.add((ins.op, s, mb))
    _check_sends_follow(rank, seen, num_stages)


def _check_sends_follow(rank: int, seen: set, num_stages: int) -> None:
    # A compute op whose consumer lives elsewhere must ship its result.
    for op, s, mb in sorted(x for x in seen if x[0] in COMPUTE_OPS):
        if op == "forward" and s < num_stages - 1 and ("send_act", s, mb) not in seen:
            raise ScheduleError(f"rank {rank}: forward(stage {s}, mb {mb}) is never followed by send_act")
        if op == "backward" and s > 0 and ("send_grad", s, mb) not in seen:
            raise ScheduleError(f"rank {rank}: backward(stage {s}, mb {mb}) is never followed by send_grad")


def _check_coverage(schedule: Sequence[Sequence[Instr]], pp: int, m: int, num_stages: int,
                    training: bool, name: str) -> None:
    """Every (stage, mb) forward (and backward when training, and its weight gradient when
    `name` splits backward) exactly once, on its rank."""
    split = training and splits_backward(name)
    ops = ("forward", "backward", "backward_weight") if split else ("forward", "backward") if training else ("forward",)
    counts = Counter((ins.op, ins.stage, ins.mb) for instrs in schedule for ins in instrs)
    stray = sorted(key for key in counts if key[0] == "backward_weight") if not split else []
    if stray:
        _, s, mb = stray[0]
        raise ScheduleError(f"backward_weight(stage {s}, mb {mb}): schedule {name!r} runs each weight gradient "
                            f"inside its backward, so it has no backward_weight instructions")
    for op in ops:
        for s in range(num_stages):
            for mb in range(m):
                n = counts[(op, s, mb)]
                if n != 1:
                    raise ScheduleError(f"{op}(stage {s}, mb {mb}) appears {n} times; it must appear exactly "
                                        f"once, on rank {stage_rank(s, pp, name)}")
    if not training and counts and any(op == "backward" for op, _, _ in counts):
        raise ScheduleError("a forward-only schedule must not contain backward ops")


def _check_matching(schedule: Sequence[Sequence[Instr]]) -> None:
    """Every send has exactly one receive on its peer with the same message key, and back."""
    sends: Counter = Counter()
    recvs: Counter = Counter()
    for instrs in schedule:
        for ins in instrs:
            if ins.op in COMM_OPS:
                key, _, _ = message_key(ins)
                (sends if ins.op.startswith("send") else recvs)[key] += 1
    for key in sorted(set(sends) | set(recvs)):
        kind, src, dst, mb = key
        if sends[key] != 1 or recvs[key] != 1:
            raise ScheduleError(f"{kind} message of mb {mb} from stage {src} to stage {dst} is sent "
                                f"{sends[key]} time(s) and received {recvs[key]} time(s); each must be exactly 1")


def check_schedule(schedule: Sequence[Sequence[Instr]], pp: int, m: int, v: int = 1,
                   training: bool | None = None, name: str = ONE_F_ONE_B) -> None:
    """Raise ``ScheduleError`` unless ``schedule`` is a valid, deadlock-free schedule.

    ``training=None`` infers the kind: a schedule with any backward or step is a
    training schedule (needs every backward and a final step), else forward-only.
    ``name`` is the schedule the instructions stand for: it places the stages on ranks
    and says whether weight gradients are instructions of their own.
    The last check runs ``simulate`` so that a well-formed but mis-ordered
    schedule (e.g. two receives swapped) is reported as the deadlock it causes.
    """
    pp, m, v = check_count("pp", pp), check_count("microbatches", m), check_count("virtual_stages", v)
    if len(schedule) != pp:
        raise ScheduleError(f"schedule has {len(schedule)} rank lists, expected pp={pp}")
    if training is None:
        training = any(ins.op in ("backward", "step") for instrs in schedule for ins in instrs
                       if isinstance(ins, Instr))
    num_stages = pp * v
    for rank, instrs in enumerate(schedule):
        for index, ins in enumerate(instrs):
            _check_instr(rank, index, ins, pp, m, num_stages, name)
    # Missing or duplicated work is the most basic error, so it is reported first.
    _check_coverage(schedule, pp, m, num_stages, training, name)
    for rank, instrs in enumerate(schedule):
        _check_step(rank, instrs, training)
        _check_local_order(rank, instrs, num_stages)
    _check_matching(schedule)
    simulate(schedule, pp)


