"""One rank's measured pipeline step as a Chrome trace (pm.dump writes it; Perfetto opens
it, and graphpar/tools/timeline.py merges the ranks' records into one trace and picture)."""
from __future__ import annotations

import json
import os

from graphpar.runtime.pipeline.chrome_trace import to_chrome_trace
from graphpar.runtime.pipeline.simulate import label


def write_rank_trace(records, directory: str, pp_rank: int) -> str:
    """One rank's last step as a Chrome trace (its row is its pp rank)."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, "timeline.json")
    rows = [(label(i), start, end) for start, end, i in records]
    with open(path, "w") as f:
        json.dump(to_chrome_trace({pp_rank: rows}), f)
    return path
