"""docs/errors.md, Strategy (graphpar/strategy.py):
every entry triggered here and its message checked for the value it names, the rule
and the fix (tests/errors/test_catalogue.py checks that the doc and the cases agree)."""
from __future__ import annotations

import torch

import graphpar as gp
from tests.errors.catalogue import entry_test, expect, registrar
from tests.errors.models import identity_pass, mlp, mse_pm, x4


CASES = {}
case = registrar(CASES)


@case("E-strategy-int-type")
def _():
    expect(ValueError, lambda: gp.Strategy(tp=2.0), r"Strategy\.tp=2\.0 is invalid", "positive int", r"Fix:.*tp=2")


@case("E-strategy-positive")
def _():
    expect(ValueError, lambda: gp.Strategy(pp=0), r"Strategy\.pp=0 is invalid", "positive int", "Fix:.*pp=1")


@case("E-strategy-bool")
def _():
    expect(ValueError, lambda: gp.Strategy(strict="yes"), r"Strategy\.strict='yes' is invalid", "must be a bool",
           "Fix:")


@case("E-strategy-schedule-name")
def _():
    expect(ValueError, lambda: gp.Strategy(schedule="1f1c"), r"schedule='1f1c' is invalid", "must be one of",
           "Fix:.*'1f1b'")


@case("E-strategy-seed")
def _():
    expect(ValueError, lambda: gp.Strategy(seed=-1), r"seed=-1 is invalid", "non-negative int", "Fix:")


@case("E-strategy-param-dtype")
def _():
    expect(ValueError, lambda: gp.Strategy(param_dtype=torch.int8), r"param_dtype=torch\.int8 is invalid",
           "torch.bfloat16", "Fix:")


@case("E-strategy-reduce-dtype")
def _():
    expect(ValueError, lambda: gp.Strategy(param_dtype="bf16", reduce_dtype=torch.int8),
           r"reduce_dtype=torch\.int8 is invalid", "torch.bfloat16", "Fix:")
    expect(ValueError, lambda: gp.Strategy(reduce_dtype="bf16"),
           r"reduce_dtype=torch\.bfloat16 with param_dtype=None is invalid", r"fp32 or in the compute dtype",
           r"Fix: use reduce_dtype=None \(fp32 gradients\), or set param_dtype=torch\.bfloat16")


@case("E-strategy-partition-type")
def _():
    expect(ValueError, lambda: gp.Strategy(partition=3), r"partition=3 is invalid", "list of module paths",
           "Fix:")


@case("E-strategy-partition-policy")
def _():
    expect(ValueError, lambda: gp.Strategy(partition="paramters"), r"partition='paramters' is invalid",
           "'uniform', 'parameters'", "Fix:.*'parameters'")


@case("E-strategy-partition-regex")
def _():
    expect(ValueError, lambda: gp.Strategy(partition="type:("), r"partition='type:\(' is invalid",
           "does not compile", "Fix:")


@case("E-strategy-path-list")
def _():
    expect(ValueError, lambda: gp.Strategy(partition=["a", "a"], pp=3), r"partition=\['a', 'a'\] is invalid",
           "more than once", "Fix:")


@case("E-strategy-offload-embedding")
def _():
    expect(ValueError, lambda: gp.Strategy(offload_embedding=3), r"offload_embedding=3 is invalid",
           "True, False, or a list", "Fix:")


@case("E-strategy-passes-type")
def _():
    expect(ValueError, lambda: gp.Strategy(passes=identity_pass), "passes=.* is invalid",
           "tuple or list of passes", r"Fix:.*passes=\(")


@case("E-strategy-pass-path")
def _():
    expect(ValueError, lambda: gp.Strategy(passes=("pkg.mod.fn",)), r"passes\[0\]='pkg\.mod\.fn'",
           "package.module:function", "Fix:")


@case("E-strategy-pass-dict")
def _():
    expect(ValueError, lambda: gp.Strategy(passes=({"name": "p", "target": "a:b", "colour": 1},)),
           r"passes\[0\] has unknown key", "colour", "Fix:")


@case("E-strategy-pass-object")
def _():
    expect(ValueError, lambda: gp.Strategy(passes=(3,)), r"passes\[0\]=3 has type int", "callable", "Fix:")


@case("E-strategy-interleaved-chunks")
def _():
    expect(ValueError, lambda: gp.Strategy(pp=2, microbatches=2, schedule="interleaved-1f1b"),
           r"schedule='interleaved-1f1b' with virtual_stages=1 is invalid", "Fix:.*virtual_stages=2")


@case("E-strategy-virtual-schedule")
def _():
    expect(ValueError, lambda: gp.Strategy(pp=2, virtual_stages=2), "virtual_stages=2 with schedule='1f1b' is invalid",
           "Fix:.*interleaved-1f1b")


@case("E-strategy-interleaved-pp")
def _():
    expect(ValueError, lambda: gp.Strategy(schedule="interleaved-1f1b", virtual_stages=2),
           "with pp=1 is invalid", "Fix:.*pp")


@case("E-strategy-zbv-chunks")
def _():
    expect(ValueError, lambda: gp.Strategy(pp=2, microbatches=4, schedule="zbv", virtual_stages=3),
           "schedule='zbv' with virtual_stages=3 is invalid", "exactly two chunks", "Fix: set virtual_stages=2")


@case("E-strategy-interleaved-microbatches")
def _():
    expect(ValueError, lambda: gp.Strategy(pp=2, microbatches=3, virtual_stages=2, schedule="interleaved-1f1b"),
           "microbatches=3 with pp=2 and virtual_stages=2 is invalid", "multiple", "Fix:.*microbatches=(2|4)")


@case("E-strategy-partition-count")
def _():
    expect(ValueError, lambda: gp.Strategy(pp=2, partition=["0", "2"]), r"partition=\['0', '2'\] with pp=2 is invalid",
           "exactly 1", "Fix:.*drop the first entry")


@case("E-strategy-sequence-parallel")
def _():
    expect(ValueError, lambda: gp.Strategy(sequence_parallel=True), "sequence_parallel=True with tp=1 is invalid",
           "Fix:.*tp")


@case("E-strategy-degree")
def _():
    expect(ValueError, lambda: gp.Strategy(dp=2, tp=2).check_world_size(6),
           r"Strategy\(dp=2, tp=2, pp=1\) does not fit the world size", "= 4, but world_size=6", r"Fix: use dp=3")
    expect(ValueError, lambda: gp.Strategy(tp=4).check_world_size(6), "world_size=6",
           "Fix: tp\\*pp=4 does not divide 6")
    # and at compile, in a single process (a world of one)
    expect(ValueError, lambda: gp.compile(mlp(), gp.Strategy(tp=2), (x4(),)), "world_size=1", "Fix:")


@case("E-strategy-world-size-arg")
def _():
    expect(ValueError, lambda: gp.Strategy().check_world_size(0), "world_size=0 is invalid", "positive int", "Fix:")


@case("E-strategy-microbatch-divisibility")
def _():
    expect(ValueError, lambda: gp.compile(mlp(), gp.Strategy(microbatches=3), (x4(4),)),
           "microbatches=3 is invalid", "local batch 4 is not divisible by microbatches=3", "Fix:.*microbatches=(2|4)")
    pm = mse_pm(4, microbatches=2)
    expect(ValueError, lambda: pm.train_step(x4(5), target=torch.randn(5, 2)),
           "local batch 5 is not divisible by microbatches=2", "Fix:")


@case("E-strategy-local-batch-arg")
def _():
    expect(ValueError, lambda: gp.Strategy().check_batch(0), "local_batch=0 is invalid", "positive int", "Fix:")


@case("E-strategy-to-dict-pass")
def _():
    expect(ValueError, lambda: gp.Strategy(passes=(lambda gm, ctx: gm,)).to_dict(), "cannot serialise passes",
           "lambda", "Fix:")


@case("E-strategy-unknown-key")
def _():
    expect(ValueError, lambda: gp.Strategy.from_dict({"micro_batches": 2}), "unknown key", "micro_batches",
           "Fix:.*microbatches")


@case("E-strategy-from-dict-type")
def _():
    expect(TypeError, lambda: gp.Strategy.from_dict([1]), "from_dict expected a dict, got list", "Fix:")


@case("E-strategy-coerce-type")
def _():
    expect(TypeError, lambda: gp.compile(mlp(), 3, (x4(),)), "Strategy.coerce expected a graphpar.Strategy or a dict, "
           "got int", "Fix:")


@case("E-strategy-seed-range")
def _():
    expect(ValueError, lambda: gp.Strategy(seed=2**64), r"seed=18446744073709551616 is invalid", "64 bits",
           r"offset of up to 2718 at tp=1, pp=1, so seed must be at most 18446744073709548897", r"Fix: use seed=0")
    # the bound leaves room for the largest stream offset at this tp and pp
    expect(ValueError, lambda: gp.Strategy(seed=2**64 - 2719, pp=2), "offset of up to 3718 at tp=1, pp=2", "Fix:")


@case("E-strategy-zero")
def _():
    expect(ValueError, lambda: gp.Strategy(zero="2"), r"Strategy.zero='2' is invalid", "zero must be the int 0",
           "Fix: use zero=2")
    expect(ValueError, lambda: gp.Strategy(zero=4), r"Strategy.zero=4 is invalid", "Fix: use zero=0")


@case("E-strategy-zero-not-built")
def _():
    expect(ValueError, lambda: gp.Strategy(zero=2, offload_embedding=True), "with offload_embedding=True is invalid",
           "Fix: use offload_embedding=False with zero")


test_entry = entry_test(CASES)
