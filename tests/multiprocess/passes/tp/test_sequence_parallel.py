"""Sequence parallelism (Strategy(sequence_parallel=True)) on gloo against single-device
training from the same state_dict, its dropout masks and its plan."""
import functools

import pytest
import torch

import graphpar as gp
from graphpar.distributed.launch import launch
from tests import helpers
from tests.targets import sp_targets, tp_targets
from tests.multiprocess.passes.tp.test_tensor_parallel import FIRST_LOSS_TOL, check_parity


STEPS = 3
# The bounds of test_tensor_parallel (imported with its check), for the same reasons:
# sequence parallelism changes only where sums are split (a reduce-scatter adds the same
# partial products as the all-reduce), so losses, gradients and outputs agree to float32
# rounding noise; see the comment on the bounds there.


def _sp(**degrees):
    return gp.Strategy(sequence_parallel=True, **degrees).to_dict()


WORLD2 = [("train", ("gpt", _sp(tp=2), STEPS)), ("train", ("hf_gpt2", _sp(tp=2), STEPS)),
          ("train", ("hf_llama", _sp(tp=2), STEPS)),
          ("measure", ("gpt", _sp(tp=2, microbatches=2))), ("measure", ("hf_gpt2", _sp(tp=2))),
          ("dropout_run", ("local",)), ("dropout_run", ("local",)), ("dropout_run", ("local", 1)),
          ("dropout_run", ("tp_invariant",))]
WORLD4 = [("train", ("gpt", _sp(tp=4), STEPS)), ("train", ("gpt", _sp(dp=2, tp=2), STEPS)),
          ("train", ("gpt", _sp(tp=2, pp=2, microbatches=2), STEPS)),
          # export-traced: its norm weights' copy_to (their gradients all-reduced over tp) must
          # run inside their layers, not at the top of the graph where export puts the weights
          ("train", ("hf_llama", _sp(tp=2, pp=2, microbatches=2), STEPS))]


@pytest.fixture(scope="module")
def world2():
    return launch(sp_targets.run_many, world_size=2, args=(WORLD2,))


@pytest.fixture(scope="module")
def world4():
    return launch(sp_targets.run_many, world_size=4, args=(WORLD4,))


@functools.lru_cache(maxsize=None)
def _reference(name, tp):
    return tp_targets.reference(name, tp, STEPS)


def _check_parity(results, name, tp, dp=1):
    check_parity(results, _reference(name, tp), tp, dp, norms=True)


@pytest.mark.parametrize("index, name", [(0, "gpt"), (1, "hf_gpt2"), (2, "hf_llama")])
def test_tp2_matches_single_device(world2, index, name):
    _check_parity([ranks[index] for ranks in world2], name, 2)


@pytest.mark.parametrize("index, name, degrees", [(0, "gpt", dict(tp=4)), (1, "gpt", dict(dp=2, tp=2)),
                                                  (2, "gpt", dict(tp=2, pp=2)), (3, "hf_llama", dict(tp=2, pp=2))],
                         ids=["tp4", "dp2xtp2", "pp2xtp2", "hf_llama-pp2xtp2"])
def test_other_meshes_match_single_device(world4, index, name, degrees):
    results = [ranks[index] for ranks in world4]
    _check_parity(results, name, degrees["tp"], degrees.get("dp", 1))


def test_dropout_masks_per_tp_rank_and_reproducible(world2):
    first, again, other_seed, invariant = ([ranks[i] for ranks in world2] for i in (5, 6, 7, 8))
    # local streams: each tp rank drops its own positions with its own draws
    assert not torch.equal(first[0]["mask"], first[1]["mask"])
    assert [r["losses"] for r in first] == [r["losses"] for r in again]   # reproducible from the seed
    assert first[0]["losses"] != other_seed[0]["losses"]                  # and the seed matters
    # tp_invariant: the ranks' masks are the pieces of the tp = 1 mask, so the losses are tp = 1's
    alone = sp_targets.dropout_run("tp_invariant")
    assert torch.equal(torch.cat([r["mask"] for r in invariant], dim=1), alone["mask"])
    # same masks; the row-parallel sums are split differently: float32 rounding noise
    assert invariant[0]["losses"] == pytest.approx(alone["losses"], abs=FIRST_LOSS_TOL)
    assert first[0]["losses"] != pytest.approx(alone["losses"], abs=FIRST_LOSS_TOL)


@pytest.mark.parametrize("index, name, microbatches", [(3, "gpt", 2), (4, "hf_gpt2", 1)])
def test_plan_counts_the_sequence_parallel_collectives(world2, index, name, microbatches):
    model, loss_fn = tp_targets.build(name, 2)
    x, y = helpers.token_batch(batch=4)
    strategy = gp.Strategy(tp=2, sequence_parallel=True, microbatches=microbatches)
    planned = {backend: _planned_totals(gp.plan(model, strategy, (x,), loss_fn=loss_fn, example_target=y,
                                                backend=backend))
               for backend in ("nccl", "gloo")}
    # per microbatch, 2 blocks: reduce-scatters 5 forward (4 row layers, the embedding) + 5 backward
    # (of the 5 all-gathers before column layers); all-gathers the same 10 + the backward of
    # the position embeddings' split; per step one more, the ranks' batch-shape fingerprints
    nccl = planned["nccl"]
    assert (nccl["reduce_scatter"][1], nccl["all_gather"][1]) == (10 * microbatches, 11 * microbatches + 1)
    # gloo has no reduce-scatter of its own: the plan names the all-reduce of the same full tensor
    assert "reduce_scatter" not in planned["gloo"]
    assert planned["gloo"]["all_reduce"] == [nccl["all_reduce"][0] + nccl["reduce_scatter"][0],
                                             nccl["all_reduce"][1] + nccl["reduce_scatter"][1]]
    for ranks in world2:
        measured = ranks[index]
        assert measured["backend"] == "gloo"
        assert measured["counts"]["all_reduce"] == planned["gloo"]["all_reduce"]
        assert measured["counts"]["all_gather"] == planned["gloo"]["all_gather"]


def _planned_totals(report):
    """{op: [bytes, calls]} of rank 0's planned transfers."""
    planned = {}
    for t in report.ranks[0].collectives:
        entry = planned.setdefault(t.op, [0, 0])
        entry[0] += t.bytes
        entry[1] += t.count
    return planned
