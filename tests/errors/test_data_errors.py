"""docs/errors.md, Data helpers (graphpar/tools/data.py):
every entry triggered here and its message checked for the value it names, the rule
and the fix (tests/errors/test_catalogue.py checks that the doc and the cases agree)."""
from __future__ import annotations

import torch
import torch.nn as nn

from graphpar.tools import data
from tests.targets import catalogue_targets as targets
from tests.errors.catalogue import entry_test, expect, registrar


CASES = {}
case = registrar(CASES)


def _pairs(n):
    return [(torch.ones(1), torch.ones(1))] * n


@case("E-data-int-arg")
def _():
    expect(ValueError, lambda: data.shard_indices(8, 2, 0, 0), "batch_size=0 is invalid", "int >= 1", "Fix:")


@case("E-data-dp-rank")
def _():
    expect(ValueError, lambda: data.shard_indices(8, 2, 2, 2), r"dp_rank=2 is invalid: .*\[0, 2\) for dp=2",
           "Fix:.*pm.mesh.dp_rank")


@case("E-data-remainder")
def _():
    expect(ValueError, lambda: data.shard_indices(8, 2, 0, 2, remainder="keep"), "remainder='keep' is invalid",
           "Fix:")


@case("E-data-too-short")
def _():
    expect(ValueError, lambda: data.shard_indices(3, 2, 0, 2), "a dataset of 3 samples is shorter than one global "
           "batch of dp \\* batch_size = 2 \\* 2 = 4", "Fix: use batch_size <= 1")


@case("E-data-iterable")
def _():
    expect(TypeError, lambda: data.DistributedBatches(iter(_pairs(4)), 2, dp=1, dp_rank=0),
           "must be map-style", "Fix:")


@case("E-data-mesh-contradiction")
def _():
    from graphpar.distributed.mesh import Mesh
    expect(ValueError, lambda: data.DistributedBatches(_pairs(4), 2, Mesh(1, 1, 1, 0), dp=2),
           "dp=2 contradicts the mesh, where dp is 1", "Fix:")


@case("E-data-dp-pair")
def _():
    expect(ValueError, lambda: data.DistributedBatches(_pairs(4), 2, dp=2), "dp=2 and dp_rank=None: pass both or "
           "neither", "Fix:")


@case("E-data-no-group")
def _():
    expect(ValueError, lambda: data.evaluate_exact(nn.Identity(), _pairs(4), 2, targets._rows, dp=2, dp_rank=0),
           "dp=2 but torch.distributed is not initialised", "Fix:")


@case("E-data-group-contradiction")
def _(messages):
    for message in messages:
        assert "dp=4, dp_rank=None contradict the process group, which has 2 ranks" in message, message
        assert "Fix: pass the dp group" in message, message


@case("E-data-empty")
def _():
    expect(ValueError, lambda: data.evaluate_exact(nn.Identity(), [], 2, targets._rows),
           "evaluate_exact: the dataset is empty", "Fix:")


@case("E-data-length-differs")
def _(messages):
    for rank, message in enumerate(messages):
        assert f"the ranks' datasets differ in length (from 4 to 5 samples; this rank has {4 + rank})" in message
        assert "Fix: give every rank the whole dataset" in message


@case("E-data-sample-form")
def _():
    expect(ValueError, lambda: data.evaluate_exact(nn.Identity(), [torch.ones(1)] * 4, 2, targets._rows),
           "samples must be \\(input, target\\) pairs, got a collated Tensor", "Fix:")


@case("E-data-metric-shape")
def _():
    expect(ValueError, lambda: data.evaluate_exact(nn.Identity(), _pairs(4), 2, lambda o, t: (o - t).abs().mean()),
           r"metric_sum_fn returned shape \[\], but evaluate_exact needs one row per sample \(2 rows\)",
           "Fix:.*reduction='none'")


test_entry = entry_test(CASES)
