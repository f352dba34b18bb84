"""Measured pipeline timelines: a Chrome trace (Perfetto opens it) and an SVG drawing.

Each rank records what its executor ran in the last step (pm.timeline()); the records of
all ranks of one pipeline go into one trace and one picture (graphpar/planner/drawing.py, which
draws simulated schedules too), with the measured bubble fraction.
"""
from __future__ import annotations

import json
import os
from typing import Dict

from graphpar.planner.drawing import timeline_svg
from graphpar.runtime.pipeline.chrome_trace import to_chrome_trace
from graphpar.runtime.pipeline.simulate import result_from


def write_timeline(per_rank, directory: str, title: str = "pipeline step (measured)") -> Dict[str, str]:
    os.makedirs(directory, exist_ok=True)
    result = result_from(per_rank)
    trace = os.path.join(directory, "timeline.json")
    with open(trace, "w") as f:
        json.dump(to_chrome_trace(result), f)
    picture = os.path.join(directory, "timeline.svg")
    with open(picture, "w") as f:
        f.write(timeline_svg(result.order, f"{title}: bubble {result.bubble_fraction:.1%}", unit="s"))
    return {"trace": trace, "svg": picture, "bubble_fraction": result.bubble_fraction}
