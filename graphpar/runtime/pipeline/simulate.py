"""An event-driven timing model of a pipeline schedule (graphpar/runtime/pipeline/schedules.py).

``simulate`` runs every rank's list in order with given forward, backward and
point-to-point costs and returns a ``SimResult``: the makespan, each rank's busy time,
the bubble fraction, the peak microbatches in flight and the timed compute ops. A
schedule that cannot finish raises ``ScheduleError`` naming what each rank waits on.
In a schedule that splits backward (``backward_weight`` instructions), a backward's cost
is shared between its input gradient (``backward``) and its weight gradient.
"""
from __future__ import annotations

import heapq
import numbers
import statistics
from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import Mapping, Sequence

from graphpar.errors import invalid
from graphpar.runtime.pipeline.schedules import (COMPUTE_OPS, OPS, Instr, MsgKey, ScheduleError, check_count,
                                                 instr_error, message_key)

__all__ = ["SimResult", "simulate", "stage_costs_of", "op_costs_of", "label", "result_from", "LETTERS"]

# the letter naming each compute op in timelines (chrome_trace.py colours by it)
LETTERS = {"forward": "F", "backward": "B", "backward_weight": "W"}


@dataclass
class SimResult:
    """Timing of one simulated step; times are in the units of the costs given."""

    makespan: float
    busy: list[float]
    bubble_fraction: float
    peak_in_flight: list[int]
    # Per rank: (start, end, Instr) of each compute op, in execution order.
    order: list[list[tuple[float, float, Instr]]] = field(repr=False)

    @property
    def pp(self) -> int:
        return len(self.busy)

    @property
    def idle(self) -> list[float]:
        """Each rank's idle time within the makespan (the bubble, in time units)."""
        return [self.makespan - busy for busy in self.busy]

    def records(self) -> list[list[tuple[str, float, float]]]:
        """Per rank (name, start, end), e.g. ("F3 s1", 2.0, 3.0), for ``to_chrome_trace``."""
        return [[(label(ins), start, end) for start, end, ins in rows] for rows in self.order]


def label(ins: Instr) -> str:
    """A compute op's short name in timelines: "F3 s1" is the forward of microbatch 3 on stage 1,
    "B" its backward (the input gradient alone where the schedule splits), "W" its weight gradient."""
    return f"{LETTERS[ins.op]}{ins.mb} s{ins.stage}"


@dataclass
class _Rank:
    pc: int = 0
    clock: float = 0.0
    busy: float = 0.0
    in_flight: set = field(default_factory=set)
    peak: int = 0
    order: list = field(default_factory=list)


def _check_costs(**costs: float) -> None:
    for name, value in costs.items():
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or value < 0:
            raise invalid(f"{name}={value!r}", f"{name} must be a number >= 0", f"use {name}=1.0")


def _run_compute(state: _Rank, ins: Instr, cost: float) -> None:
    start = state.clock
    state.clock += cost
    state.busy += cost
    state.order.append((start, state.clock, ins))
    key = (ins.stage, ins.mb)
    if ins.op == "forward":
        # In flight = forward done, backward not yet done, per (stage, mb): the
        # activations this rank must keep alive (a pending weight gradient keeps only
        # its layers' inputs and output gradients, not counted here).
        state.in_flight.add(key)
        state.peak = max(state.peak, len(state.in_flight))
    elif ins.op == "backward":
        state.in_flight.discard(key)


def simulate(schedule: Sequence[Sequence[Instr]], pp: int, forward_cost: float = 1.0,
             backward_cost: float = 2.0, p2p_cost: float = 0.0, weight_cost: float | None = None,
             stage_costs: Mapping[tuple, float] | None = None) -> SimResult:
    """Event-driven timing of all ranks running their lists in order.

    Ranks sit in a heap keyed by their clock and the earliest runnable rank posts
    its next instruction. A send stamps its message with the sender's clock and
    wakes the rank waiting for it; a receive finishes at
    ``max(own clock, send time + p2p_cost)`` or parks the rank until the send is
    issued. A forward costs ``forward_cost`` and a whole backward ``backward_cost``;
    where the schedule splits backward, ``weight_cost`` of it (default half) is the
    ``backward_weight`` instruction's and the rest the ``backward``'s, so the defaults
    are unit forward, input-gradient and weight-gradient costs. ``step`` costs 0.
    ``stage_costs`` gives some (op, stage) pairs, or single ops (op, stage, microbatch), a
    cost of their own (the latter first): ``stage_costs_of`` takes the medians per stage from
    a measured timeline, so that stages that differ (the first holding the embedding, the
    last the loss) idle in the simulation as they do when they run, and ``op_costs_of`` each
    op's own duration, which replays a measured step: whatever idle time the measurement
    has beyond the replay's, the executor added (transfers, its python between ops).
    When the heap empties with work left, no rank can progress: ``ScheduleError``
    lists each blocked rank and what it waits on.
    """
    pp = check_count("pp", pp)
    weight_cost = backward_cost / 2 if weight_cost is None else weight_cost
    _check_costs(forward_cost=forward_cost, backward_cost=backward_cost, p2p_cost=p2p_cost, weight_cost=weight_cost)
    if weight_cost > backward_cost:
        raise invalid(f"weight_cost={weight_cost!r} with backward_cost={backward_cost!r}",
                      "the weight gradient is part of the backward, so weight_cost must not exceed backward_cost",
                      f"use weight_cost={backward_cost / 2!r} (half the backward)")
    if len(schedule) != pp:
        raise ScheduleError(f"schedule has {len(schedule)} rank lists, expected pp={pp}")
    split = any(ins.op == "backward_weight" for instrs in schedule for ins in instrs)
    costs = {"forward": forward_cost, "backward": backward_cost - weight_cost if split else backward_cost,
             "backward_weight": weight_cost}
    if stage_costs:
        _check_costs(**{f"stage_costs[{key!r}]": value for key, value in stage_costs.items()})
        costs.update(stage_costs)   # keyed by (op, stage), beside the ops' own
    ranks = [_Rank() for _ in range(pp)]
    mailbox: dict[MsgKey, deque] = defaultdict(deque)  # key -> issue times of unreceived sends
    waiting: dict[MsgKey, list] = defaultdict(list)  # key -> ranks parked on that receive
    ready = [(0.0, r) for r in range(pp)]
    heapq.heapify(ready)
    while ready:
        _, r = heapq.heappop(ready)
        if _advance(r, schedule[r], ranks[r], mailbox, waiting, ready, costs, p2p_cost):
            heapq.heappush(ready, (ranks[r].clock, r))
    blocked = [r for r in range(pp) if ranks[r].pc < len(schedule[r])]
    if blocked:
        raise _deadlock(schedule, ranks, blocked)
    return _result(ranks)


def stage_costs_of(order: Sequence[Sequence[tuple[float, float, Instr]]]) -> dict[tuple[str, int], float]:
    """The median duration of each (op, stage) in timed compute ops (a measured timeline of
    every rank, as ``result_from`` takes it): ``simulate``'s ``stage_costs``."""
    durations: dict[tuple[str, int], list[float]] = defaultdict(list)
    for rows in order:
        for start, end, ins in rows:
            durations[(ins.op, ins.stage)].append(end - start)
    return {key: statistics.median(values) for key, values in durations.items()}


def op_costs_of(order: Sequence[Sequence[tuple[float, float, Instr]]]) -> dict[tuple[str, int, int], float]:
    """The duration of each compute op (op, stage, microbatch) in a measured timeline of every
    rank: ``simulate``'s ``stage_costs`` for a replay of that step."""
    return {(ins.op, ins.stage, ins.mb): end - start for rows in order for start, end, ins in rows}


def _advance(r: int, instrs: Sequence[Instr], state: _Rank, mailbox, waiting, ready,
             costs: dict, p2p_cost: float) -> bool:
    """Post rank r's next instruction. True if r can go on, False if done or parked."""
    if state.pc >= len(instrs):
        return False
    ins = instrs[state.pc]
    if ins.op in COMPUTE_OPS:
        _run_compute(state, ins, costs.get((ins.op, ins.stage, ins.mb), costs.get((ins.op, ins.stage), costs[ins.op])))
    elif ins.op in ("send_act", "send_grad"):
        key = message_key(ins)[0]
        mailbox[key].append(state.clock)
        for parked in waiting.pop(key, ()):
            # The receiver re-tries the receive it is parked on (at max of both clocks).
            heapq.heappush(ready, (state.clock, parked))
    elif ins.op in ("recv_act", "recv_grad"):
        key = message_key(ins)[0]
        if not mailbox[key]:
            waiting[key].append(r)
            return False
        # neighbour stages on one rank (the V's turn under zbv) hand over in memory
        state.clock = max(state.clock, mailbox[key].popleft() + (0.0 if ins.peer == r else p2p_cost))
    elif ins.op != "step":
        raise instr_error(r, state.pc, ins, f"unknown op {ins.op!r}; ops are {', '.join(OPS)}")
    state.pc += 1
    return True


def _deadlock(schedule, ranks: list[_Rank], blocked: list[int]) -> ScheduleError:
    lines = []
    for r in blocked:
        ins = schedule[r][ranks[r].pc]
        lines.append(f"rank {r} waits at instruction #{ranks[r].pc} on {ins}{_sender_hint(schedule, ranks, ins)}")
    done = [r for r in range(len(ranks)) if r not in blocked]
    tail = f"; ranks {done} finished" if done else ""
    return ScheduleError("schedule deadlocks, no rank can progress: " + "; ".join(lines) + tail)


def _sender_hint(schedule, ranks: list[_Rank], ins: Instr) -> str:
    """Where the awaited send sits on its rank, so the cycle can be read off the message."""
    if ins.op not in ("recv_act", "recv_grad") or ins.peer is None or not 0 <= ins.peer < len(schedule):
        return ""
    key = message_key(ins)[0]
    for index, other in enumerate(schedule[ins.peer]):
        if other.op in ("send_act", "send_grad") and message_key(other)[0] == key and index >= ranks[ins.peer].pc:
            return f" (rank {ins.peer} sends it at its instruction #{index}, not reached)"
    return f" (rank {ins.peer} never sends it)"


def _result(ranks: list[_Rank]) -> SimResult:
    # a rank's clock also counts the waits after its last compute op
    return result_from([s.order for s in ranks], [s.peak for s in ranks], max((s.clock for s in ranks), default=0.0))


def result_from(order: Sequence[Sequence[tuple[float, float, Instr]]], peaks: Sequence[int] = (),
                makespan: float | None = None) -> SimResult:
    """The SimResult of per-rank timed compute ops (start, end, Instr), simulated or measured;
    the makespan is the last op's end unless given."""
    if makespan is None:
        makespan = max((end for rows in order for _, end, _ in rows), default=0.0)
    busy = [sum(end - start for start, end, _ in rows) for rows in order]
    capacity = len(order) * makespan
    bubble = 1.0 - sum(busy) / capacity if capacity > 0 else 0.0
    return SimResult(makespan=makespan, busy=busy, bubble_fraction=bubble,
                     peak_in_flight=list(peaks) or [0] * len(order), order=[list(rows) for rows in order])
