"""ZeRO-1 and ZeRO-2 (Strategy.zero) against single-device training, what each rank holds,
checkpoints across zero stages and dp degrees, and the refusals. Start-up dominates these small
runs: every case of one world size runs in one launch (tests/targets/cases.py), CASES below."""
import copy

import pytest
import torch

import graphpar as gp
from graphpar.checkpoint.sharded import load_full_checkpoint
from tests.targets import zero_targets
from tests.targets.cases import SharedLaunches
from tests.helpers import lm_loss, tiny_gpt, token_batch

# Each rank's loss is a mean over its part of the batch and each gradient element is averaged
# over the ranks in a reduce-scatter: the global batch's sums in another order, i.e. float32
# rounding noise (1e-5 on the loss). Parameters and optimizer moments: the AdamW noise bound
# explained in tests/helpers.adamw (1e-4); SGD moves by lr * gradient, well inside it.
LOSS_TOL = 1e-5
PARAM_TOL = 1e-4
STATE_ELEMENTS = {"adamw": 2, "sgd": 1}  # exp_avg + exp_avg_sq; the momentum buffer


def reference(optimizer_name, steps, global_batch):
    """Eager single-device training on the global batch: the model, its losses, its optimizer."""
    model = copy.deepcopy(tiny_gpt()).train()
    opt = zero_targets.optimizer(optimizer_name)(model.parameters())
    x, y = token_batch(batch=global_batch)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = lm_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return model, losses, opt


def check_parity(results, optimizer_name, steps, global_batch, dp):
    model, ref_losses, _ = reference(optimizer_name, steps, global_batch)
    expected = model.state_dict()
    model.eval()
    x, _ = token_batch(batch=global_batch)
    local = global_batch // dp
    for losses, state, out, held in results:
        assert losses == pytest.approx(ref_losses, abs=LOSS_TOL)
        for key, value in expected.items():
            torch.testing.assert_close(state[key], value, atol=PARAM_TOL, rtol=0, msg=key)
        rows = slice(held["dp_rank"] * local, (held["dp_rank"] + 1) * local)
        with torch.no_grad():
            torch.testing.assert_close(out, model(x[rows]), atol=PARAM_TOL, rtol=0)


SHARES = [
    (2, 1, "adamw", 1), (2, 2, "sgd", 1), (2, 3, "adamw", 1),
    (3, 2, "adamw", 1), (3, 3, "sgd", 1),   # uneven: the buckets are padded to a multiple of 3
    (4, 1, "sgd", 1),
    (4, 2, "adamw", 2),   # gradients accumulated over microbatches, reduced after the last
    (4, 3, "adamw", 2)]   # zero=3: reduced every microbatch, the rows summed
WITH_TP = [(2, False), (3, False), (3, True)]
PLANNED = [{"dp": 2, "zero": 1, "param_dtype": "bf16"},
           {"dp": 2, "zero": 2, "param_dtype": "bf16", "offload_optimizer": True}]
DOCUMENTED = [1, 3]
VERIFIED = [1, 2, 3]
BF16_STEPS = 20


def _train(dp, steps, global_batch, optimizer_name="adamw", **strategy):
    return (dp * strategy.get("tp", 1), zero_targets.train,
            (gp.Strategy(dp=dp, **strategy).to_dict(), steps, global_batch, optimizer_name))


def cases(directory):
    """Every launched case of this module: {name: (world size, function, args)}."""
    return {
        **{("share", *c): _train(c[0], 3, 4 * c[0], c[2], zero=c[1], microbatches=c[3]) for c in SHARES},
        **{("tp", *c): _train(2, 3, 8, tp=2, zero=c[0], sequence_parallel=c[1]) for c in WITH_TP},
        "save_reload": (4, zero_targets.save_reload, (str(directory), 2, 8)),
        **{("planned", i): (2, zero_targets.planned_and_held, (s,)) for i, s in enumerate(PLANNED)},
        **{("documented", z): (2, zero_targets.documented_path, (gp.Strategy(dp=2, zero=z).to_dict(), 3, 8))
           for z in DOCUMENTED},
        "lifetimes": (2, zero_targets.gathered_lifetimes, (2,)),
        **{("verify", z): (2, zero_targets.verify_zero, (z,)) for z in VERIFIED},
        "offloaded": _train(2, 3, 8, zero=3, offload_optimizer=True),
        "bf16": _train(2, BF16_STEPS, 8, zero=3, param_dtype=torch.bfloat16),
    }


@pytest.fixture(scope="module")
def launched(directory):
    return SharedLaunches(cases(directory))


@pytest.mark.parametrize("dp, zero, optimizer_name, microbatches", SHARES)
def test_zero_matches_single_device_and_each_rank_holds_its_share(launched, dp, zero, optimizer_name, microbatches):
    steps, global_batch = 3, 4 * dp
    results = launched(("share", dp, zero, optimizer_name, microbatches))
    check_parity(results, optimizer_name, steps, global_batch, dp)
    held = [r[3] for r in results]
    elements = held[0]["elements"]
    assert held[0]["buckets"] > 1
    # every element of every parameter is owned by exactly one rank, and stepped there only
    assert sum(h["owned"] for h in held) == elements
    for h in held:
        assert h["state_elements"] == STATE_ELEMENTS[optimizer_name] * h["owned"]
        assert h["owned"] <= -(-elements // dp) + h["buckets"]  # 1/dp of the whole, up to one per bucket
        # zero=1 keeps the full gradients, zero=2 frees them once they are in the reduce buffer;
        # zero=3's parameters are the pieces the optimizer steps, which keep no gradient
        assert h["grads"] == [zero == 1] * len(h["grads"])
        # zero=3 holds its shard of each bucket, padding included, and no whole parameter
        assert h["held_parameter_elements"] == (h["shard"] if zero == 3 else elements)
        if zero < 3:
            # fp32: each bucket's parameters are views of one flat buffer of dp * shard elements,
            # which the all-gathers fill
            assert all(count == 1 and held_elements == padded for count, held_elements, padded in h["bucket_storages"])
    if dp == 3:
        assert held[0]["padding"] > 0


@pytest.mark.parametrize("zero, sequence_parallel", WITH_TP)
def test_zero_with_tensor_parallelism_matches_single_device(launched, zero, sequence_parallel):
    steps, global_batch = 3, 8
    results = launched(("tp", zero, sequence_parallel))
    check_parity(results, "adamw", steps, global_batch, 2)
    held = [r[3] for r in results]
    for tp_rank in range(2):  # each tp rank's shards are split over its two dp ranks
        ranks = [h for i, h in enumerate(held) if i % 2 == tp_rank]
        assert sum(h["owned"] for h in ranks) == ranks[0]["elements"]


def test_checkpoints_move_between_zero_stages_and_dp_degrees_exactly(launched, directory):
    tmp_path = directory
    steps, global_batch = 2, 8
    results = launched("save_reload")
    a, b, c = (load_full_checkpoint(tmp_path / name) for name in "ABC")
    for later in (b, c):  # (dp=4, zero=3) -> (dp=2, tp=2, zero=1) -> (dp=4, zero=3), bit for bit
        for key, value in a.model.items():
            assert torch.equal(later.model[key], value), key
        assert later.optimizer.keys() == a.optimizer.keys()
        for name, state in a.optimizer.items():
            assert later.optimizer[name].keys() == state.keys(), name
            for entry, value in state.items():
                assert torch.equal(later.optimizer[name][entry], value), (name, entry)
    # the sharded state, gathered whole, is the single-device optimizer's
    model, ref_losses, opt = reference("adamw", steps, global_batch)
    for name, p in model.named_parameters():
        for entry in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(a.optimizer[name][entry], opt.state[p][entry], atol=PARAM_TOL, rtol=0,
                                       msg=f"{name} {entry}")
        assert float(a.optimizer[name]["step"]) == steps
    for losses, straight, other_loss, resumed, stepped, stepped_after, rank in results:
        assert losses == pytest.approx(ref_losses, abs=LOSS_TOL)
        # the same state going in: the next step agrees in every layout
        assert resumed == straight and other_loss == pytest.approx(straight, abs=LOSS_TOL)
        for key, value in stepped.items():
            assert torch.equal(stepped_after[key], value), key
    # and in one process, with no parallelism at all: the same model and optimizer state
    x, y = token_batch(batch=global_batch)
    single = gp.compile(tiny_gpt(), gp.Strategy(), example_inputs=(x,), example_target=y, loss_fn=lm_loss,
                        optimizer=zero_targets.optimizer("adamw"))
    single.load_checkpoint(str(tmp_path / "A"))
    single.save_checkpoint(str(tmp_path / "D"))
    d = load_full_checkpoint(tmp_path / "D")
    for key, value in a.model.items():
        assert torch.equal(d.model[key], value), key
    for name, state in a.optimizer.items():
        for entry, value in state.items():
            assert torch.equal(d.optimizer[name][entry], value), (name, entry)
    assert single.train_step(x, target=y) == pytest.approx(results[0][1], abs=LOSS_TOL)


def test_zero_at_dp_1_is_plain_training():
    x, y = token_batch(batch=4)
    pm = gp.compile(tiny_gpt(), gp.Strategy(zero=2), example_inputs=(x,), example_target=y, loss_fn=lm_loss,
                    optimizer=zero_targets.optimizer("adamw"))
    assert pm._placed.program is None  # nothing to shard over: no update program
    model, ref_losses, _ = reference("adamw", 2, 4)
    assert [pm.train_step(x, target=y) for _ in range(2)] == pytest.approx(ref_losses, abs=LOSS_TOL)


@pytest.mark.parametrize("strategy", PLANNED)
def test_plan_bytes_with_master_shards_equal_what_each_rank_holds(launched, strategy):
    for planned, held in launched(("planned", PLANNED.index(strategy))):
        assert planned["param"] == held["param"] and planned["grad"] == held["grad"]
        if strategy.get("offload_optimizer"):
            assert planned["optimizer"] == 0
            assert planned["host"] == held["masters"] + held["states"] + held["moved"]["to_host"]
            assert planned["host_moves"] == held["moved"]
        else:
            assert planned["optimizer"] == held["masters"] + held["states"] and planned["host"] == 0


@pytest.mark.parametrize("zero", VERIFIED)
def test_verify_checks_zero_against_single_device(launched, zero):
    # zero=1: each rank's own pieces of p.grad against the reference's averaged gradient;
    # zero=2 and 3: no full gradient is kept, so the parameters after the steps are compared.
    # verify runs inside the shared launch (tests/multiprocess/tools/test_verify.py checks that
    # it starts its own processes when called outside one)
    for report in launched(("verify", zero)):
        assert report.passed, report.problems
        assert (report.max_grad_error > 0) == (zero == 1)  # compared (float32 rounding) only where kept


@pytest.mark.parametrize("zero", DOCUMENTED)
def test_zero_on_the_documented_path_without_example_target_and_from_the_meta_device(launched, zero):
    steps, global_batch = 3, 8
    results = launched(("documented", zero))
    model, ref_losses, _ = reference("adamw", steps, global_batch)
    for runs in results:
        for losses, state in runs:
            assert losses == pytest.approx(ref_losses, abs=LOSS_TOL)
            for key, value in model.state_dict().items():
                torch.testing.assert_close(state[key], value, atol=PARAM_TOL, rtol=0, msg=key)


def test_zero3_frees_each_bucket_after_its_last_forward_use_and_gathers_it_again_for_backward(launched):
    steps = 2
    for held in launched("lifetimes"):
        buckets, (kept_node,) = held["buckets"], held["keep_nodes"]  # exactly one bucket is kept
        kept = int(kept_node.removeprefix("zero3_").removesuffix(".keep"))
        assert buckets > 3
        # autograd kept no gathered buffer: when backward starts only the kept bucket's is alive
        assert held["after_forward"] == [[kept]] * steps
        # when a gather arrives graphpar holds only that bucket and the one it follows (the
        # next one is in flight, prefetched)
        assert len(held["most_alive"]) == 2
        assert held["gathers"]["forward"] == {k: steps for k in range(buckets)}
        # backward gathers every other bucket again once: every bucket of this model holds a
        # weight autograd saved (a linear's or a layer norm's)
        assert held["gathers"]["backward"] == {k: steps for k in range(buckets) if k != kept}


def test_zero3_gathers_the_bucket_forward_reads_last_once_per_step_not_twice(launched):
    """The tiny GPT's head reads the tied embedding last: its bucket stays gathered from forward
    into backward, which reads it first, so it is all-gathered once per step, not twice."""
    steps = 2
    for held in launched("lifetimes"):
        (kept_node,) = held["keep_nodes"]
        kept = int(kept_node.removeprefix("zero3_").removesuffix(".keep"))
        assert kept == held["buckets"] - 1  # buckets go in reverse model order: the embedding's is last
        assert held["gathers"]["forward"][kept] == steps
        assert kept not in held["gathers"]["backward"]


def test_zero3_with_offloaded_optimizer_matches_single_device(launched):
    steps, global_batch = 3, 8
    results = launched("offloaded")
    check_parity(results, "adamw", steps, global_batch, 2)
    for _, _, _, held in results:  # the device keeps its weight shards only; masters live on the host
        assert held["held_parameter_elements"] == held["shard"]


def test_zero3_in_bfloat16_stays_within_one_percent_of_fp32_training(launched):
    steps, global_batch = BF16_STEPS, 8
    results = launched("bf16")
    _, ref_losses, _ = reference("adamw", steps, global_batch)
    for losses, _, _, _ in results:
        # bf16 weights and activations (8 bits of mantissa, relative rounding 2**-9 per op)
        # with fp32 masters and fp32 gradient reduction: the bound, 1% of the loss
        assert losses == pytest.approx(ref_losses, rel=0.01)
