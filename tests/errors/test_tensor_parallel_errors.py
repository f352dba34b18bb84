"""docs/errors.md, Tensor parallelism and dropout streams (passes/annotate_shards.py,
passes/rewrite_parallel_layers.py, passes/insert_collectives.py, passes/assign_rng_streams.py,
passes/tp/):
every entry triggered here and its message checked for the value it names, the rule
and the fix (tests/errors/test_catalogue.py checks that the doc and the cases agree)."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

import graphpar as gp
from tests.errors.catalogue import entry_test, expect, registrar
from tests.errors.models import CumsumMLP, FusedQKV, lower, mlp, x4


CASES = {}
case = registrar(CASES)


@case("E-tp-strict")
def _():
    expect(ValueError, lambda: lower(CumsumMLP(), gp.Strategy(tp=2, strict=True), 2),
           r"Strategy\(strict=True, tp=2\): 1 layer\(s\) have no sharding rule", r"up \(linear\): .*cumsum.* at mix",
           "Fix: use strict=False.*tp_replicate")
    lower(CumsumMLP(), gp.Strategy(tp=2), 2)  # not strict: replicated and reported instead


@case("E-tp-divisibility")
def _():
    from graphpar.passes.tp.rules import DivisibilityError
    expect(DivisibilityError, lambda: lower(mlp(), gp.Strategy(tp=3), 3),
           r"tp=3 does not divide in_features=8 at 2 \(linear_1\)", "splits it into tp equal parts",
           r"Fix: use a tp that divides 8 \(one of \[1, 2, 4, 8\]\).*tp_replicate")


@case("E-tp-cross-entropy-reduction")
def _():
    model = nn.Sequential(nn.Linear(4, 8))
    def loss(output, target):  # a per-sample loss, summed afterwards: the 'none' reduction reaches the rewrite
        return F.cross_entropy(output, target, reduction="none").sum()
    expect(ValueError, lambda: lower(model, gp.Strategy(tp=2), 2, loss_fn=loss,
                                     example_target=torch.randint(0, 8, (4,))),
           "cross entropy at .* uses reduction='none'", "computes the mean or the sum",
           r"Fix:.*reduction='mean', or reduction='sum' in a token-weighted loss_fn returning \(loss_sum, count\)")


@case("E-tp-fused-output")
def _():
    expect(ValueError, lambda: lower(FusedQKV(), gp.Strategy(tp=2), 2), r"output 1 \(\w+\) is sharded by fused blocks",
           "Fix:")


@case("E-tp-dropout-masks")
def _():
    expect(ValueError, lambda: gp.compile(mlp(), gp.Strategy(), (x4(),), dropout_masks="global"),
           "dropout_masks='global' is not a mask mode", "Fix:")


@case("E-tp-collective-outside")
def _():
    gm = lower(mlp(), gp.Strategy(tp=2), 2).gm
    expect(RuntimeError, lambda: gm(x4()), "collective on axis 'tp' ran outside a graphpar executor",
           "Fix: run compiled programs through ParallelModule")


test_entry = entry_test(CASES)
