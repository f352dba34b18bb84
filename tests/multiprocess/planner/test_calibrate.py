"""`graphpar plan --auto --calibrate --measure` as a user runs it: a real calibration of this
machine (world 2 on gloo, into a fresh cache) and two candidates run. Nothing here asserts a
time's value, only that each is measured, shown and cached."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from graphpar.planner.measure import measure_steps
from graphpar.strategy import Strategy

TIMEOUT_S = 400  # a calibration (23-49 s at world 2 and 4) and two short runs, on 2 busy cores


def test_plan_auto_calibrate_measure_prints_predicted_beside_measured_and_caches_the_calibration(tmp_path):
    command = [sys.executable, "-m", "graphpar.tools.cli", "plan", "--auto", "--world-size", "2", "--calibrate",
               "--measure", "2", "tests.targets.plan_targets:gpt_blocks"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT_S,
                            env={**os.environ, "GRAPHPAR_CACHE": str(tmp_path)})
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.startswith("calibration of ")
    assert "| strategy | cost | measured | error | compute | overhead | comms | bubble | host |" in result.stdout
    rows = [line for line in result.stdout.splitlines() if line.startswith("| dp=")]
    timed = [re.match(r"\| [^|]+ \| ([\d.e-]+) \| ([\d.e-]+) \| ([+-]\d+)% \|", row) for row in rows[:2]]
    assert all(timed), rows[:2]
    assert all(float(m.group(2)) > 0 for m in timed)
    assert rows[2:] and all(" | - | - | " in row for row in rows[2:])           # the others were not run
    (cached,) = tmp_path.glob("calibration-*.json")
    key = json.loads(cached.read_text())["key"]
    assert key["world_size"] == 2 and key["backend"] == "gloo" and key["model"]


def test_measure_steps_refuses_strategies_of_several_world_sizes():
    with pytest.raises(ValueError, match="span world sizes \\[1, 2\\]"):
        measure_steps(None, [Strategy(), Strategy(dp=2)], ())
