"""docs/errors.md, Pipeline parallelism (passes/partition_stages.py, passes/split_stages.py,
passes/partition_policies.py, graphpar/runtime/pipeline/):
every entry triggered here and its message checked for the value it names, the rule
and the fix (tests/errors/test_catalogue.py checks that the doc and the cases agree)."""
from __future__ import annotations

import torch

import graphpar as gp
from graphpar.passes.partition_policies import Unit, balance, partition
from graphpar.runtime.pipeline.check import check_schedule
from graphpar.runtime.pipeline.schedules import ScheduleError, build_schedule
from graphpar.runtime.pipeline.shm_transport import transport_from_env
from tests.errors.catalogue import entry_test, expect, registrar
from tests.errors.models import Bare, SizeAcrossCut, lower, mlp


CASES = {}
case = registrar(CASES)


@case("E-pp-too-many-stages")
def _():
    expect(ValueError, lambda: lower(mlp(), gp.Strategy(pp=4), 4), "stages=4 with 3 units is invalid",
           "Fix: use at most 3 stages")


@case("E-pp-no-units")
def _():
    expect(ValueError, lambda: lower(Bare(), gp.Strategy(pp=2), 2), "cannot partition a model with no units",
           "Fix:.*pp=1")


@case("E-pp-type-regex-none")
def _():
    expect(ValueError, lambda: lower(mlp(), gp.Strategy(pp=2, partition="type:Conv"), 2),
           "the regex 'Conv' matches none of the module types present \\(Linear, ReLU\\)",
           "Fix:.*partition='type:Linear'")


@case("E-pp-path-unknown")
def _():
    expect(ValueError, lambda: lower(mlp(), gp.Strategy(pp=2, partition=["9"]), 2),
           "'9' is not the path of any pipeline unit", "Fix:")


@case("E-pp-path-first-unit")
def _():
    expect(ValueError, lambda: lower(mlp(), gp.Strategy(pp=2, partition=["0"]), 2), "'0' is the first unit",
           "Fix: drop '0'")


@case("E-pp-path-order")
def _():
    expect(ValueError, lambda: lower(mlp(), gp.Strategy(pp=3, partition=["2", "1"]), 3),
           "entries must follow execution order", r"Fix: reorder them: partition=\['1', '2'\]")


@case("E-pp-profile-meta")
def _():
    with torch.device("meta"):
        model = mlp()
    expect(ValueError, lambda: lower(model, gp.Strategy(pp=2, partition="profile"), 2),
           "partition='profile'.*meta device", "Fix: use partition='parameters'")


@case("E-pp-profile-zero")
def _():
    units = [Unit(f"l{i}", "Linear", 4, True, 0.0) for i in range(3)]
    expect(ValueError, lambda: partition(units, 2, "profile"), "all 3 units have seconds == 0",
           "Fix:.*partition='parameters'")


@case("E-pp-cut-non-tensor")
def _():
    expect(ValueError, lambda: lower(SizeAcrossCut(), gp.Strategy(pp=2), 2, tracer="fx"),
           r"size \(a non-tensor value such as an int read off a shape, from a\) crosses a pipeline cut but is not a single tensor", "Fix: move the cut")


@case("E-schedule-arg")
def _():
    expect(ValueError, lambda: build_schedule("1f1b", 0, 2), "pp=0 is invalid", ">= 1")


@case("E-schedule-name")
def _():
    expect(ValueError, lambda: build_schedule("1f1c", 2, 2), "schedule='1f1c' is invalid", "unknown schedule",
           "Fix:.*'1f1b'")


@case("E-schedule-combination")
def _():
    expect(ValueError, lambda: build_schedule("interleaved-1f1b", 2, 4, 1),
           "schedule='interleaved-1f1b' with virtual_stages=1 is invalid", "Fix:")


@case("E-schedule-malformed")
def _():
    schedule = build_schedule("1f1b", 2, 2)
    broken = [schedule[0], [i for i in schedule[1] if i.op != "step"]]
    expect(ScheduleError, lambda: check_schedule(broken, 2, 2), "rank 1: 'step' must appear exactly once")


@case("E-balance-args")
def _():
    expect(ValueError, lambda: balance([1, 2], 3), "balance needs 1 <= stages <= len\\(weights\\)", "stages=3")
    expect(ValueError, lambda: balance([1, -2], 1), "weight 1 is -2", "non-negative")


@case("E-pp-transport-env")
def _(monkeypatch):
    monkeypatch.setenv("GRAPHPAR_PIPELINE_TRANSPORT", "shared")
    expect(ValueError, transport_from_env, "GRAPHPAR_PIPELINE_TRANSPORT='shared' is invalid: the pipeline's "
           "transport must be one of 'gloo', 'shm'", "Fix: set GRAPHPAR_PIPELINE_TRANSPORT=gloo")


test_entry = entry_test(CASES)
