"""Pipeline timelines as Chrome trace JSON (chrome://tracing and Perfetto open it)."""
from __future__ import annotations

from typing import Mapping, Sequence

from graphpar.runtime.pipeline.simulate import LETTERS, SimResult

__all__ = ["to_chrome_trace"]

# Chrome's reserved colour names (trace_viewer's colour scheme), one per compute kind, by the
# letter that starts a timeline label (simulate.label): forward blue, input gradient mauve,
# weight gradient orange (the SVG timelines' blue, dark blue and orange, as near as it has)
COLOURS = {LETTERS["forward"]: "thread_state_runnable", LETTERS["backward"]: "thread_state_uninterruptible",
           LETTERS["backward_weight"]: "thread_state_iowait"}
KINDS = {letter: kind for kind, letter in LETTERS.items()}


def to_chrome_trace(sim_or_records: SimResult | Sequence | Mapping) -> dict:
    """Chrome trace JSON (``{"traceEvents": [...]}``) that chrome://tracing and Perfetto open.

    Accepts a ``SimResult`` or per-rank records of ``(name, start_s, end_s)``, as
    a list indexed by rank or a ``{rank: records}`` dict. Times are seconds (the
    simulator's unit costs count as seconds) and become microseconds in ``ts``/``dur``.
    Each rank is one thread row of process 0, named by a metadata event. A record named
    like ``simulate.label`` ("F3 s1", "B3 s1", "W3 s1") carries its kind as the event's
    category and a colour of its own: forward, input gradient and weight gradient differ.
    """
    if isinstance(sim_or_records, SimResult):
        per_rank: Mapping = dict(enumerate(sim_or_records.records()))
    elif isinstance(sim_or_records, Mapping):
        per_rank = sim_or_records
    else:
        per_rank = dict(enumerate(sim_or_records))
    events: list[dict] = [{"name": "process_name", "ph": "M", "pid": 0, "tid": 0,
                           "args": {"name": "pipeline"}}]
    for rank, records in sorted(per_rank.items()):
        events.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": int(rank),
                       "args": {"name": f"pp rank {rank}"}})
        for name, start, end in records:
            event = {"name": str(name), "ph": "X", "ts": float(start) * 1e6,
                     "dur": (float(end) - float(start)) * 1e6, "pid": 0, "tid": int(rank)}
            letter = str(name)[:1]
            if letter in KINDS:
                event.update(cat=KINDS[letter], cname=COLOURS[letter])
            events.append(event)
    return {"traceEvents": events, "displayTimeUnit": "ms"}
