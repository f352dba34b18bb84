"""Pipeline schedules as plain data, and the builders of the named ones.

A schedule says, for every pipeline rank, the exact order in which that rank posts
its compute and communication work for one training (or evaluation) step. It is
pure data: ``build_schedule`` returns ``list[list[Instr]]`` indexed by pp rank, and
nothing here touches torch or torch.distributed, so schedules can be checked,
simulated and drawn without a model.

Stages and ranks
----------------
``pp`` pipeline ranks each hold ``v`` model chunks ("virtual stages"), giving
``S = pp * v`` global stages ``0 .. S-1``. Data flows ``s -> s+1`` forward and
gradients ``s+1 -> s`` backward; stage ``S-1`` computes the loss. Stage ``s``
lives on rank ``s % pp`` (Megatron's interleaved layout: rank ``r`` holds stages
``r, r+pp, r+2pp, ...``), so with ``v == 1`` stage and rank coincide; under
``zbv`` the stages run in a V instead (rank ``r`` holds ``r`` and ``2pp-1-r``).
graphpar.strategy.stage_rank is the rule.

Instructions
------------
``Instr(op, stage, mb, peer=None)``; ``peer`` is the *pp rank* on the other side of
a communication and ``None`` for compute:

=============  =========================================================  ================
op             meaning                                                    exists when
=============  =========================================================  ================
``recv_act``   receive ``mb``'s activations for ``stage`` from stage-1    ``stage > 0``
``forward``    run ``stage``'s forward on ``mb``                          always
``send_act``   send ``mb``'s output activations to stage+1                ``stage < S-1``
``recv_grad``  receive the gradient of ``stage``'s output from stage+1    ``stage < S-1``
``backward``   run ``stage``'s backward on ``mb``; in a split schedule    always
               only the input gradient (B)
``send_grad``  send the gradient of ``stage``'s input to stage-1          ``stage > 0``
``backward_weight``  the weight gradient (W) of ``stage`` on ``mb``, some  split schedules
               time after its ``backward``
``step``       optimizer step (``stage = mb = -1``); last on every rank    training only
=============  =========================================================  ================

Execution semantics (used by ``simulate`` and expected of the executor): a rank
posts its instructions strictly in list order; sends are asynchronous and
buffered (they never block); a receive blocks until the matching send, identified
by ``(kind, source stage, destination stage, mb)``, has been issued. Every
compute op is therefore preceded by the receive it needs and followed by the send
its consumer needs, and the whole schedule is deadlock-free exactly when the
per-rank orders are consistent with the data dependencies.

Schedules
---------
``gpipe``
    Every rank runs all ``m`` forwards, then all ``m`` backwards in reverse
    microbatch order. Simple; every rank keeps all ``m`` microbatches' activations.
``1f1b``
    PipeDream-flush, Megatron-LM's non-interleaved schedule. Rank ``r`` runs
    ``min(pp - r - 1, m)`` warm-up forwards, then alternates one forward / one
    backward, then drains the remaining backwards. Same bubble as GPipe, but rank
    ``r`` never holds more than ``min(pp - r, m)`` microbatches in flight.
``interleaved-1f1b``
    Megatron-LM's ``forward_backward_pipelining_with_interleaving`` with
    ``v > 1`` chunks per rank; needs ``m % pp == 0``. Forward number ``k`` on a
    rank runs chunk ``(k // pp) % v`` on microbatch
    ``(k // (pp*v)) * pp + k % pp`` (groups of ``pp`` microbatches sweep through
    the chunks); backward number ``k`` uses the same microbatch with the chunk
    reversed. Warm-up is ``(pp - r - 1) * 2 + (v - 1) * pp`` forwards (capped at
    ``m * v``), then 1F1B, then cool-down. The bubble shrinks by a factor ``v``.
``zero-bubble``
    ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024). Each backward
    is split (``SPLIT_BACKWARD``): ``backward`` computes only the input gradient, the
    critical path to the previous stage, and ``backward_weight`` the weight gradient,
    which waits. The order is 1F1B's; rank ``r`` runs the weight gradient of its
    ``k``-th backward after its ``(k + r)``-th backward and the last ``r`` at the end,
    where they fill the cool-down that 1F1B leaves idle. With equal forward, input-
    and weight-gradient costs the idle time is a third of 1F1B's (``pp - 1`` forwards
    per rank against ``3 (pp - 1)``). A rank's full activations (forward done, input
    gradient not) are 1F1B's, at most ``pp - r``; rank ``r`` also keeps what its ``r``
    pending weight gradients need (their layers' inputs and output gradients), so with
    stages alike no rank holds more than rank 0, which holds what it does under 1F1B.
``zbv``
    ZB-V (the same paper, section 6): ``v = 2`` chunks per rank in a V, rank ``r``
    holding stage ``r`` (down) and ``2pp - 1 - r`` (up), so rank 0 computes the first
    stage and the loss. Warm-up: ``2(pp - r) - 1`` forwards down, then ``r`` pairs
    (forward up, forward down), then ``pp - r`` rounds of (forward, input gradient,
    weight gradient) up; steady rounds of the same on both chunks; cool-down: ``r``
    input gradients on both chunks, ``pp - r`` (input, weight gradient) down, then the
    weight gradients left, up first. Built for ``max(m, 2pp - 1)`` microbatches (the V
    fills with ``2pp - 1``) and cut to ``m``: dropping whole microbatches keeps every
    dependency in order. With chunks of half a rank's layers and ``m >= 2pp`` a rank
    idles only while the first microbatch comes down the V, ``pp - 1`` chunk forwards:
    half ZB-H1's bubble, holding at most ``2pp`` chunks' activations (1F1B rank 0's).

``build_eval_schedule`` gives the evaluation schedule (receive, forward, send; no
backward, no step) for the same stage layout.

Beside this file
----------------
check.py ``check_schedule`` validates a schedule and raises ``ScheduleError`` with a
precise message; simulate.py ``simulate`` runs an event-driven timing model and returns
a ``SimResult``; chrome_trace.py ``to_chrome_trace`` and
``graphpar.planner.drawing.timeline_svg(sim.order, title)`` visualise it. The schedule
names and their rules are graphpar.strategy's (SCHEDULES, check_schedule_rules).
"""
from __future__ import annotations

import numbers
from collections import Counter
from dataclasses import dataclass
from typing import Any, Iterable

from graphpar.errors import invalid
from graphpar.strategy import (GPIPE, INTERLEAVED, ONE_F_ONE_B, SPLIT_BACKWARD, ZBV, ZERO_BUBBLE,
                               check_schedule_name, check_schedule_rules, rank_stages, stage_rank)

__all__ = ["OPS", "Instr", "ScheduleError", "build_schedule", "build_eval_schedule", "stage_rank", "check_count",
           "splits_backward"]

COMPUTE_OPS = ("forward", "backward", "backward_weight")
COMM_OPS = ("recv_act", "send_act", "recv_grad", "send_grad")
OPS = ("recv_act", "forward", "send_act", "recv_grad", "backward", "send_grad", "backward_weight", "step")


class ScheduleError(RuntimeError):
    """A schedule is malformed, mismatched or deadlocks."""


@dataclass(frozen=True)
class Instr:
    """One posted operation; see the module docstring for the op table."""

    op: str
    stage: int
    mb: int
    peer: int | None = None

    def __str__(self) -> str:
        if self.op == "step":
            return "step"
        if self.op in COMPUTE_OPS:
            return f"{self.op}(stage {self.stage}, mb {self.mb})"
        direction = "from" if self.op.startswith("recv") else "to"
        return f"{self.op}(stage {self.stage}, mb {self.mb}, {direction} rank {self.peer})"


STEP = Instr("step", -1, -1)


def check_count(name: str, value: Any) -> int:
    """`value` as an int if it is one >= 1 (pp, microbatches, virtual_stages)."""
    # bool is an int subclass; pp=True is almost certainly a bug, so reject it.
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise invalid(f"{name}={value!r}", f"{name} must be an int >= 1, got {type(value).__name__}",
                       f"pass an int such as {name}=1")
    if value < 1:
        raise invalid(f"{name}={value!r}", f"{name} must be >= 1", f"use {name}=1 or more")
    return int(value)



# (kind, source stage, destination stage, mb) identifies one message.
MsgKey = tuple[str, int, int, int]


def message_key(ins: Instr) -> tuple[MsgKey, int, int]:
    """(key, rank that sends it, rank that receives it) for a communication op."""
    s = ins.stage
    if ins.op == "send_act":
        src, dst, kind = s, s + 1, "act"
    elif ins.op == "recv_act":
        src, dst, kind = s - 1, s, "act"
    elif ins.op == "send_grad":
        src, dst, kind = s, s - 1, "grad"
    else:  # recv_grad
        src, dst, kind = s + 1, s, "grad"
    return (kind, src, dst, ins.mb), src, dst


def instr_error(rank: int, index: int, ins: Instr, problem: str) -> ScheduleError:
    """The error about instruction #index of `rank`'s list."""
    return ScheduleError(f"rank {rank}, instruction #{index} {ins}: {problem}")


# --------------------------------------------------------------------------- #
# Building blocks: each compute op is wrapped in the receive it needs and the
# send its consumer needs, so ordering decisions are made on compute ops only.
# --------------------------------------------------------------------------- #


def _forward(stage: int, mb: int, pp: int, num_stages: int, name: str = ONE_F_ONE_B) -> list[Instr]:
    out = []
    if stage > 0:
        out.append(Instr("recv_act", stage, mb, stage_rank(stage - 1, pp, name)))
    out.append(Instr("forward", stage, mb))
    if stage < num_stages - 1:
        out.append(Instr("send_act", stage, mb, stage_rank(stage + 1, pp, name)))
    return out


def _backward(stage: int, mb: int, pp: int, num_stages: int, name: str = ONE_F_ONE_B) -> list[Instr]:
    out = []
    if stage < num_stages - 1:
        out.append(Instr("recv_grad", stage, mb, stage_rank(stage + 1, pp, name)))
    out.append(Instr("backward", stage, mb))
    if stage > 0:
        out.append(Instr("send_grad", stage, mb, stage_rank(stage - 1, pp, name)))
    return out


def _weight(stage: int, mb: int, pp: int, num_stages: int, name: str = ONE_F_ONE_B) -> list[Instr]:
    return [Instr("backward_weight", stage, mb)]  # local: needs the stage's own backward only


_BUILDING_BLOCKS = {"F": _forward, "B": _backward, "W": _weight}


def _expand(order: Iterable[tuple[str, int, int]], pp: int, num_stages: int, name: str) -> list[Instr]:
    """Turn a rank's ("F"|"B"|"W", stage, mb) compute order into instructions; `name` (the
    schedule) places the stages on ranks."""
    out: list[Instr] = []
    for kind, stage, mb in order:
        out += _BUILDING_BLOCKS[kind](stage, mb, pp, num_stages, name)
    return out


def _one_f_one_b(warmup: int, total: int, fwd, bwd) -> list[tuple[str, int, int]]:
    """warm-up forwards, steady (one forward, one backward), cool-down backwards.

    ``fwd(k)``/``bwd(k)`` give the (stage, mb) of this rank's k-th forward/backward.
    Shared by 1F1B (fixed stage) and interleaved 1F1B (chunk varies with k).
    """
    steady = total - warmup
    order = [("F", *fwd(k)) for k in range(warmup)]
    for k in range(steady):
        # Forward first: the backward of microbatch k may need this very forward
        # (the last stage's first backward follows its own forward immediately).
        order += [("F", *fwd(warmup + k)), ("B", *bwd(k))]
    order += [("B", *bwd(k)) for k in range(steady, total)]
    return order


def _gpipe_rank(r: int, pp: int, m: int) -> list[tuple[str, int, int]]:
    return [("F", r, mb) for mb in range(m)] + [("B", r, mb) for mb in reversed(range(m))]


def _1f1b_rank(r: int, pp: int, m: int) -> list[tuple[str, int, int]]:
    # A rank must forward pp - r - 1 extra microbatches before the first gradient
    # can come back from the last stage; fewer if there are not that many.
    warmup = min(pp - r - 1, m)
    return _one_f_one_b(warmup, m, lambda k: (r, k), lambda k: (r, k))


def _interleaved_mb(k: int, pp: int, v: int) -> int:
    # The k-th op of a rank belongs to group k // (pp*v) of pp microbatches.
    return (k // (pp * v)) * pp + k % pp


def _interleaved_chunk(k: int, pp: int, v: int, forward: bool) -> int:
    # Megatron's get_model_chunk_id: pp consecutive ops per chunk; backward
    # walks the chunks in reverse (the last chunk's gradients arrive first).
    chunk = (k // pp) % v
    return chunk if forward else v - 1 - chunk


def _interleaved_rank(r: int, pp: int, m: int, v: int) -> list[tuple[str, int, int]]:
    total = m * v
    # Megatron: the (v-1)*pp term fills every chunk but the last for one group;
    # the 2*(pp-r-1) term lets the later ranks' first backwards come back.
    warmup = min((pp - r - 1) * 2 + (v - 1) * pp, total)

    def fwd(k: int) -> tuple[int, int]:
        return _interleaved_chunk(k, pp, v, True) * pp + r, _interleaved_mb(k, pp, v)

    def bwd(k: int) -> tuple[int, int]:
        return _interleaved_chunk(k, pp, v, False) * pp + r, _interleaved_mb(k, pp, v)

    return _one_f_one_b(warmup, total, fwd, bwd)


def _zero_bubble_rank(r: int, pp: int, m: int) -> list[tuple[str, int, int]]:
    """ZB-H1: 1F1B with each weight gradient run ``r`` backwards late (the last ``r`` at
    the end), so that later ranks send input gradients up sooner and fill the cool-down."""
    order: list[tuple[str, int, int]] = []
    done = 0   # backwards so far
    for kind, stage, mb in _1f1b_rank(r, pp, m):
        order.append((kind, stage, mb))
        if kind == "B":
            done += 1
            if done > r:
                order.append(("W", stage, done - 1 - r))  # 1F1B runs backwards in microbatch order
    return order + [("W", r, mb) for mb in range(max(m - r, 0), m)]


def _zbv_rank(r: int, pp: int, m: int) -> list[tuple[str, int, int]]:
    """ZB-V's phases (module docstring) for rank r over max(m, 2pp - 1) microbatches, cut to m."""
    n = max(m, 2 * pp - 1)
    down, up = r, 2 * pp - 1 - r
    taken: Counter = Counter()   # (kind, stage) -> microbatches given out so far, in order
    order: list[tuple[str, int, int]] = []

    def run(*ops: tuple[str, int]) -> None:
        for kind, stage in ops:
            order.append((kind, stage, taken[kind, stage]))
            taken[kind, stage] += 1

    for _ in range(2 * (pp - r) - 1):
        run(("F", down))
    for _ in range(r):
        run(("F", up), ("F", down))
    for _ in range(pp - r):
        run(("F", up), ("B", up), ("W", up))
    while taken["F", down] < n or taken["F", up] < taken["F", down]:
        if taken["F", down] < n:
            run(("F", down))
        run(("B", down), ("W", down), ("F", up), ("B", up), ("W", up))
    for _ in range(r):
        run(("B", down), ("B", up))
    for _ in range(pp - r):
        run(("B", down), ("W", down))
    while taken["W", up] < n:
        run(("W", up))
    while taken["W", down] < n:
        run(("W", down))
    return [(kind, stage, mb) for kind, stage, mb in order if mb < m]


def splits_backward(name: str) -> bool:
    """Whether schedule `name` runs weight gradients as instructions of their own."""
    return name in SPLIT_BACKWARD


def interleaved_warmup(r: int, pp: int, m: int, v: int) -> int:
    """Warm-up forwards of rank ``r`` in the interleaved schedule (for tests and docs)."""
    return min((pp - r - 1) * 2 + (v - 1) * pp, m * v)


def build_schedule(name: str, pp: int, microbatches: int, virtual_stages: int = 1) -> list[list[Instr]]:
    """The training schedule ``name`` for ``pp`` ranks: one instruction list per pp rank."""
    name = check_schedule_name(name, owner="")
    pp = check_count("pp", pp)
    m = check_count("microbatches", microbatches)
    v = check_count("virtual_stages", virtual_stages)
    check_schedule_rules(name, pp, m, v, owner="")
    builders = {GPIPE: lambda r: _gpipe_rank(r, pp, m), ONE_F_ONE_B: lambda r: _1f1b_rank(r, pp, m),
                INTERLEAVED: lambda r: _interleaved_rank(r, pp, m, v), ZERO_BUBBLE: lambda r: _zero_bubble_rank(r, pp, m),
                ZBV: lambda r: _zbv_rank(r, pp, m)}
    return [_expand(builders[name](r), pp, pp * v, name) + [STEP] for r in range(pp)]


def build_eval_schedule(pp: int, microbatches: int, virtual_stages: int = 1,
                        name: str = ONE_F_ONE_B) -> list[list[Instr]]:
    """Evaluation schedule: receive, forward, send for every (stage, mb); no backward, no step.
    The training schedule's `name` places the stages (stage_rank).

    Ranks visit their (chunk, mb) pairs sorted by (mb // pp, chunk, mb), a chunk being
    the rank's stages in increasing order: groups of pp microbatches sweep through the
    chunks. That is Megatron's interleaved forward order when ``m % pp == 0`` (and plain
    microbatch order when v == 1), and it works for any ``m`` and either placement:
    every dependency goes from a smaller key to a larger one (a stage's chunk is never
    below its predecessor's), so no rank can wait on work behind its own position.
    """
    pp = check_count("pp", pp)
    m = check_count("microbatches", microbatches)
    v = check_count("virtual_stages", virtual_stages)
    out = []
    for r in range(pp):
        stages = rank_stages(r, pp, pp * v, name)
        keys = sorted(((mb // pp, chunk, mb) for chunk in range(v) for mb in range(m)))
        out.append(_expand((("F", stages[chunk], mb) for _, chunk, mb in keys), pp, pp * v, name))
    return out


