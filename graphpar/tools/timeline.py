"""Measured pipeline timelines: a Chrome trace (Perfetto opens it) and an SVG drawing.

Each rank records what its executor ran in the last step (pm.timeline()); the records of
all ranks of one pipeline go into one trace and one picture (graphpar/planner/drawing.py, which
draws simulated schedules too), with the measured bubble fraction.
"""
from __future__ import annotations

import json
import os
from typing import Dict, Sequence, Tuple

from graphpar.planner.drawing import timeline_svg
from graphpar.runtime.pipeline.schedules import SimResult, to_chrome_trace


def measured(per_rank: Sequence[Sequence[Tuple[float, float, object]]],
             peaks: Sequence[int] = ()) -> SimResult:
    """A SimResult from measured (start, end, Instr) records of each pp rank."""
    makespan = max((end for rows in per_rank for _, end, _ in rows), default=0.0)
    busy = [sum(end - start for start, end, _ in rows) for rows in per_rank]
    bubble = 1 - sum(busy) / (len(per_rank) * makespan) if makespan else 0.0
    return SimResult(makespan=makespan, busy=busy, bubble_fraction=bubble,
                     peak_in_flight=list(peaks) or [0] * len(per_rank), order=[list(r) for r in per_rank])


def write_timeline(per_rank, directory: str, title: str = "pipeline step (measured)") -> Dict[str, str]:
    os.makedirs(directory, exist_ok=True)
    result = measured(per_rank)
    trace = os.path.join(directory, "timeline.json")
    with open(trace, "w") as f:
        json.dump(to_chrome_trace(result), f)
    picture = os.path.join(directory, "timeline.svg")
    with open(picture, "w") as f:
        f.write(timeline_svg(result.order, f"{title}: bubble {result.bubble_fraction:.1%}", unit="s"))
    return {"trace": trace, "svg": picture, "bubble_fraction": result.bubble_fraction}
