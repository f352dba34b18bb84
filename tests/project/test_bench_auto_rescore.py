"""benchmarks/bench_auto.py --rescore: a report the benchmark wrote is read back (each model
and world's calibration, exactly, and each candidate's measured time) and its candidates are
predicted again with that calibration, so that a change to the time model can be judged
against recorded runs without measuring anything."""
import pathlib
import sys

import pytest

from graphpar.planner import auto
from graphpar.planner.calibration import Calibration, Link

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "benchmarks"))
import bench_auto  # noqa: E402  (benchmarks/ is not a package)

KEY = {"format": 9, "hostname": "test", "cpu": "a CPU", "cores": 2, "torch": "2.13.0", "backend": "gloo", "world_size": 2}


def _calibration() -> Calibration:
    """A calibration whose every field differs from its default, so a field lost on the way
    through the report changes what is predicted."""
    link = Link(1e-4, 1e9)
    return Calibration(key=KEY, width=128, matmul={1: [(16, 5e10), (4096, 8e10)], 2: [(16, 4e10), (4096, 7e10)]},
                       collectives={op: {2: link} for op in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")},
                       p2p=Link(2e-4, 2e9), overlap=0.5, memory_bandwidth=5e9, unit_overhead=1e-4,
                       microbatch_overhead=1e-3, step_overhead=2e-3, unit_step_overhead=5e-4,
                       zero_overhead={1: 1e-5, 2: 1e-4, 3: 2e-4}, speedup={1: 1.5, 2: 1.0}, busy_latency={2: 3e-4},
                       model_flops=4e10, model_overhead=1e-3, seconds=12.5)


def _recorded_run():
    """A report of the GPT at world 2 as bench_auto writes it, every candidate 'measured' 10%
    off its prediction one way or the other (away from the 25% target, so the count of those
    within it cannot change with the table's rounding to 0.1 ms)."""
    calibration = _calibration()
    model, inputs, loss_fn, target = bench_auto.build("gpt")
    result = auto.search(model, 2, inputs, loss_fn=loss_fn, optimizer=bench_auto.OPTIMIZER, example_target=target,
                         calibration=calibration)
    legal = sorted((c for c in result.candidates if not c.reason), key=lambda c: c.cost)
    for i, candidate in enumerate(legal):
        candidate.measured = candidate.cost * (1.1 if i % 2 else 0.9)
    return bench_auto.scored("gpt", 2, calibration, calibration.seconds, legal, [])


def test_a_report_is_predicted_again_with_its_calibration_against_its_measured_times():
    original = _recorded_run()
    again, = bench_auto.rescore(bench_auto.report([original]))
    assert again["calibration"] == original["calibration"]
    assert [c.label() for c in again["legal"]] == [c.label() for c in original["legal"]]
    # the same time model and calibration: the same prediction, to the last bit
    assert [c.cost for c in again["legal"]] == [c.cost for c in original["legal"]]
    # the report writes measured times in ms to 0.1: half of that is the most rounding moves them
    assert [c.measured for c in again["legal"]] == pytest.approx([c.measured for c in original["legal"]], abs=0.5e-4)
    assert again["within"] == original["within"] == len(original["legal"])
    assert again["spearman"] == pytest.approx(original["spearman"], abs=0.05)   # rounding may swap near-ties


def test_a_report_without_its_calibration_is_refused_by_name():
    text = "### gpt, world 2\n\n```text\ncalibration of ...\n```\n\n| dp=2 tp=1 pp=1 microbatches=1 1f1b | 1.0 | 1.0 |"
    with pytest.raises(SystemExit, match="gpt world 2 section has no calibration JSON"):
        bench_auto.recorded(text)


def test_a_calibration_of_another_format_is_refused_by_name():
    text = bench_auto.report([_recorded_run()]).replace('"width": 128', '"width": 128, "a_later_field": 1', 1)
    with pytest.raises(SystemExit, match="gpt world 2 calibration is of format 9, whose fields this checkout"):
        bench_auto.recorded(text)
