"""ZeRO (Strategy.zero) against single-device training on the built-in GPT and on
`transformers` LLaMA (grouped-query attention) and GPT-2 (tied embeddings), with AdamW and
SGD with momentum, at dp = 2, 3 and 4: losses, full_state_dict and pm(x), and that each rank's
optimizer state is exactly its share. One launched world per dp runs every case
(tests/targets/zero_models_targets.py): process start-up dominates these small runs."""
import functools

import pytest
import torch

from graphpar.distributed.launch import launch
from tests import helpers
from tests.targets import zero_models_targets as targets
from tests.targets.zero_targets import optimizer

pytest.importorskip("transformers", reason="transformers is in the test extra")

ZERO_STAGES = (1, 2, 3)
DPS = (2, 3, 4)
MODELS = ("gpt", "hf_llama", "hf_gpt2")
OPTIMIZERS = ("adamw", "sgd")
CASES = [(name, zero, optimizer_name) for name in MODELS for zero in ZERO_STAGES for optimizer_name in OPTIMIZERS]
STEPS = 3
# elements of per-element optimizer state per parameter element: exp_avg + exp_avg_sq; SGD's momentum buffer
STATE_ELEMENTS = {"adamw": 2, "sgd": 1}

# Each rank's loss is a mean over its part of the batch and each gradient element is averaged
# over the ranks by a reduce-scatter: the global batch's sums in another order, i.e. float32
# rounding noise (1e-5 on a loss near 4; seen: below 1e-6).
LOSS_TOL = 1e-5
# Parameters after the steps. AdamW: the noise bound explained in tests/helpers.adamw (an entry
# whose gradient is only rounding noise moves by up to lr * |g| / eps ~ 1e-5 per step; seen:
# 1e-5), while a wrong or missing step moves entries by O(lr) = 1e-2. SGD (lr 0.1, momentum
# 0.9) moves by lr times the summed gradients, whose rounding noise is ~1e-8 here (seen: 1e-7).
PARAM_TOL = {"adamw": 1e-4, "sgd": 1e-6}
# pm(x) against the reference's outputs: a logit sums 32 products of weights off by PARAM_TOL
# with activations of size ~1, so one order above PARAM_TOL for SGD (seen: 6e-6 and 2e-7)
OUT_TOL = {"adamw": 1e-4, "sgd": 1e-5}
# pm(x) against the eager model loaded from pm's own full_state_dict: the same weights and the
# same ops, so at most a sum in another order in the traced program (seen: equal bit for bit)
SAME_WEIGHTS_OUT_TOL = 1e-5


@pytest.fixture(scope="module", params=DPS, ids=lambda dp: f"dp{dp}")
def world(request):
    dp = request.param
    return dp, launch(targets.run_cases, world_size=dp, args=(CASES, STEPS))


@functools.lru_cache(maxsize=None)
def reference(name, optimizer_name, dp):
    """Eager single-device training on the global batch: the model after STEPS steps (in
    eval mode), its losses."""
    model, loss_fn = targets.build(name)
    batch = helpers.token_batch(batch=targets.LOCAL_BATCH * dp)
    trained, losses = helpers.train_reference(model, [batch], loss_fn, optimizer(optimizer_name), STEPS)
    return trained.eval(), losses


def _case(world, case):
    dp, per_rank = world
    return dp, [results[CASES.index(case)] for results in per_rank]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_matches_single_device(world, case):
    dp, results = _case(world, case)
    name, _, optimizer_name = case
    model, ref_losses = reference(name, optimizer_name, dp)
    expected = model.state_dict()
    x, _ = helpers.token_batch(batch=targets.LOCAL_BATCH * dp)
    for r in results:
        assert r["losses"] == pytest.approx(ref_losses, abs=LOSS_TOL)
        assert r["state"].keys() == expected.keys()
        for key, value in expected.items():
            torch.testing.assert_close(r["state"][key], value, atol=PARAM_TOL[optimizer_name], rtol=0, msg=key)
        rows = x[r["dp_rank"] * targets.LOCAL_BATCH:(r["dp_rank"] + 1) * targets.LOCAL_BATCH]
        with torch.no_grad():
            torch.testing.assert_close(r["out"], targets.logits(model(rows)), atol=OUT_TOL[optimizer_name], rtol=0)
        torch.testing.assert_close(r["out"], r["eager_out"], atol=SAME_WEIGHTS_OUT_TOL, rtol=0)


def _expected_owned(numels, dp, rank):
    """The layout docs/zero.md promises: the bucket padded to dp equal shards of
    ceil(total / dp), rank r owning [r * shard, (r + 1) * shard) of the real elements."""
    total = sum(numels)
    shard = -(-total // dp)
    return max(0, min(total, (rank + 1) * shard) - rank * shard)


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_each_rank_holds_only_its_share(world, case):
    dp, results = _case(world, case)
    _, zero, optimizer_name = case
    held = [r["held"] for r in sorted(results, key=lambda r: r["dp_rank"])]
    elements = held[0]["elements"]
    buckets = [b["numels"] for b in held[0]["buckets"]]
    assert len(buckets) > 1 and all(h["elements"] == elements for h in held)
    assert sum(map(sum, buckets)) == elements  # every trained element is in one bucket
    assert all([b["numels"] for b in h["buckets"]] == buckets for h in held)  # the same buckets on every rank
    for rank, h in enumerate(held):
        owned = 0
        for numels, bucket in zip(buckets, h["buckets"]):
            bucket_owned = sum(stop - start for _, start, stop, _ in bucket["pieces"])
            assert bucket_owned == _expected_owned(numels, dp, rank)
            for index, start, stop, state in bucket["pieces"]:
                assert 0 <= start < stop <= numels[index]
                # each per-element state entry is exactly the piece, not the whole parameter
                assert len(state) == STATE_ELEMENTS[optimizer_name]
                assert all(n == stop - start for n in state.values()), state
            owned += bucket_owned
        # and the optimizer holds nothing else: 1/dp of the whole, give or take the padding
        assert h["state_elements"] == STATE_ELEMENTS[optimizer_name] * owned
        shards = sum(-(-sum(numels) // dp) for numels in buckets)
        padding = shards * dp - elements
        assert shards - padding <= owned <= shards
        # zero=1 keeps every full gradient; zero=2 frees each once it is in the reduce buffer;
        # zero=3's parameters are the pieces the optimizer steps, which keep none
        assert h["grads"] == [zero == 1] * len(h["grads"])
        # zero=3 holds its shard of each bucket (padding included) and no whole parameter
        assert h["held_parameter_elements"] == (shards if zero == 3 else elements)
    # every element of every parameter is stepped on exactly one rank
    for k, numels in enumerate(buckets):
        for index, n in enumerate(numels):
            covered = sorted((start, stop) for h in held for i, start, stop, _ in h["buckets"][k]["pieces"]
                             if i == index)
            assert covered[0][0] == 0 and covered[-1][1] == n, (k, index, covered)
            assert all(a[1] == b[0] for a, b in zip(covered, covered[1:])), (k, index, covered)
