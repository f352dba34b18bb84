"""Expert parallelism (graphpar/runtime/experts.py, passes/expert_parallel.py) on gloo
against single-device training of the same transformers MoE model on the global batch."""
import functools

import pytest
import torch

import graphpar as gp
from graphpar.distributed.launch import launch
from graphpar.tools.reference import Expected, SingleDeviceReference
from graphpar.tools.verify import NOISE_FACTOR
from tests.helpers import adamw, hf_causal_lm_loss, train_reference
from tests.targets import ep_targets
from tests.targets.cases import SharedLaunches

pytest.importorskip("transformers", reason="transformers is in the test extra")

# Each rank's loss is a mean over its rows and gradients are averaged over dp: the global
# batch's sums in another order (float32 rounding, ~1e-7 relative). Expert outputs come back
# through all-to-all unchanged, but each rank's grouped matmuls see other rows, so sums are
# ordered differently again. Parameters: the AdamW noise bound of test_world_of_one (1e-4).
LOSS_TOL = 1e-5
PARAM_TOL = 1e-4
LOGITS_TOL = 1e-4  # three steps of AdamW noise (1e-4 in the weights) through two layers
# the global gradient norm: a float64 sum of float32 per-tensor norms, of gradients whose sums
# are ordered otherwise (above, ~1e-7 relative each)
NORM_RTOL = 1e-5
# the tiny Mixtral's gradient norms are 1.1 to 1.8 over the three steps: 0.5 clips every step
CLIP = 0.5
STEPS = 3


def sgd():
    return functools.partial(torch.optim.SGD, lr=0.1)


def reference(arch, strategy, optimizer, max_grad_norm=None, batch=8):
    """Eager single-device training of `arch` on the global batch as graphpar trains it
    (graphpar/tools/reference.py, gp.verify's: with param_dtype, a compute copy in it and fp32
    masters; clip_grad_norm_ before each step with max_grad_norm): (losses, state, logits,
    clip_grad_norm_'s total norms), each an Expected with how far param_dtype's rounding alone
    moved it (0 in fp32)."""
    (x, y), loss_fn, _ = ep_targets.task(arch, batch)
    model = ep_targets.BUILDERS[arch]() if arch in ep_targets.BUILDERS else ep_targets.moe_model(arch)
    training = SingleDeviceReference(model, strategy, optimizer)
    losses, norms = [], []
    for _ in range(STEPS):
        losses.append(training.forward_backward((x,), y, loss_fn))
        if max_grad_norm is not None:
            norms.append(training.clip(max_grad_norm))
        training.step()
    logits, = training.evaluate((x,))
    return losses, training.state_dict(), logits, norms


def _close(actual, expected, atol, rtol=0.0):
    """actual against an Expected, as gp.verify compares: within atol + rtol |value|, plus
    NOISE_FACTOR times how far param_dtype's rounding alone moved the reference (with bf16
    weights a correct run rounds otherwise, by about as much again; 0 in fp32)."""
    torch.testing.assert_close(torch.as_tensor(actual, dtype=torch.float64),
                               torch.as_tensor(expected.value, dtype=torch.float64),
                               atol=atol + NOISE_FACTOR * expected.noise, rtol=rtol)


def held_piece(key, shape, ep, expert_tp):
    """What a rank holds of expert weight `key` of full `shape`: E/ep experts, and with expert
    tensor parallelism 1/expert_tp of each one's intermediate features (gate_up_proj [E, 2I, H]:
    dim 1; down_proj [E, H, I]: dim 2)."""
    split = 1 if key.endswith("gate_up_proj") else 2
    return tuple(n // ep if d == 0 else n // expert_tp if d == split else n for d, n in enumerate(shape))


def check_parity(results, ref, dp, ep, tp=1, max_grad_norm=None, param_dtype=None, zero=0, expert_tp=1):
    losses, state, logits, norms = ref
    # with param_dtype the loss itself is rounded to it: each rank's (then averaged over dp) here,
    # the global batch's there, half an ulp (eps / 2 relative) each
    loss_rtol = torch.finfo(param_dtype).eps if param_dtype is not None else 0.0
    if max_grad_norm is not None:   # every step clips, and each rank's norm is eager's
        assert min(norm.value for norm in norms) > max_grad_norm
        for run in results:
            for norm, expected in zip(run["norms"], norms, strict=True):
                _close(norm, expected, 0.0, NORM_RTOL)
    rows = logits.value.shape[0] // dp
    experts = {key: held_piece(key, e.value.shape, ep, expert_tp) for key, e in state.items()
               if ep_targets.expert_weight(key)}
    # each rank holds E/ep experts of every expert weight of its stages, with expert_tp 1/tp of
    # each (measured on its programs); together the ranks hold every layer's
    assert set().union(*(run["held"] for run in results)) == set(experts)
    for rank, run in enumerate(results):
        assert run["held"] and run["held"] == {key: experts[key] for key in run["held"]}
        for loss, expected in zip(run["losses"], losses, strict=True):
            _close(loss, expected, LOSS_TOL, loss_rtol)
        for key, expected in state.items():
            assert run["state"][key].dtype == torch.float32, key   # fp32 masters with param_dtype
            _close(run["state"][key], expected, PARAM_TOL)
        dp_rank = rank // tp % dp
        mine = Expected(logits.value[dp_rank * rows:(dp_rank + 1) * rows], logits.noise)
        _close(run["logits"], mine, LOGITS_TOL)
    if zero:
        check_expert_state(results)


def check_expert_state(results):
    """With ZeRO each rank keeps AdamW's two moments for its 1/edp of its E/ep experts' elements
    (ZeRO's buckets of expert weights are sharded over the edp group, the ranks holding the
    same experts): the group's shares add up to its experts' whole."""
    for run in results:
        held = run["expert_state"]
        shares = [results[rank]["expert_state"]["kept"] for rank in held["group"]]
        whole, n = 2 * held["weights"], len(held["group"])
        assert whole > 0 and sum(shares) == whole
        # each bucket is cut into n shards of ceil(total / n): a rank's share is total / n up to
        # n - 1 elements (the last rank's shorter one) per bucket
        assert abs(held["kept"] - whole / n) <= 2 * held["buckets"] * (n - 1)


PARITY = [
    ("mixtral", dict(dp=2, ep=2), adamw), ("mixtral", dict(dp=2, ep=2), sgd), ("mixtral", dict(dp=4, ep=2), adamw),
    ("mixtral", dict(dp=4, ep=4), adamw), ("mixtral", dict(dp=2, pp=2, ep=2, microbatches=2), adamw),
    ("qwen2_moe", dict(dp=2, ep=2), adamw), ("olmoe", dict(dp=4, ep=4), sgd),
    # ep folds into dp x tp: over the tp ranks of each replica (ep2), over all four (ep4), and
    # ep2 x tp2 x pp2 (dp1: the ep group is the two tp ranks of each stage)
    ("mixtral", dict(dp=2, tp=2, ep=2), adamw), ("mixtral", dict(dp=2, tp=2, ep=4), sgd),
    ("mixtral", dict(tp=2, pp=2, ep=2, microbatches=2), adamw), ("mixtral", dict(tp=2, pp=2, ep=2, microbatches=2), sgd),
    # 8 processes: dp2 x tp2 x pp2 with ep2 (expert gradients summed over edp pairs across replicas)
    ("mixtral", dict(dp=2, tp=2, pp=2, ep=2, microbatches=2), adamw),
    ("mixtral", dict(dp=2, tp=2, pp=2, ep=2, microbatches=2), sgd),
    # clipping: each expert weight's gradient counted once, on the first rank of its edp group
    # (dp2 ep2: one rank per edp group; dp2 tp2 ep2: two, across the replicas)
    ("mixtral", dict(dp=2, ep=2), adamw, dict(max_grad_norm=CLIP)),
    ("mixtral", dict(dp=2, tp=2, ep=2), sgd, dict(max_grad_norm=CLIP)),
    # bf16 compute weights (the all-to-alls carry bf16 rows) with fp32 masters, expert masters
    # in buckets of their own (from the first rank of their edp group, reduced over it); the
    # export-traced Mixtral (its casts take their dtypes from a trace in bf16) and the fx-traced TinyMoE
    ("mixtral", dict(dp=2, ep=2, param_dtype=torch.bfloat16), adamw),
    ("tiny_moe", dict(dp=2, ep=2, param_dtype=torch.bfloat16), adamw),
    ("tiny_moe", dict(dp=4, ep=2, param_dtype=torch.bfloat16), sgd),
    ("tiny_moe", dict(dp=2, tp=2, ep=2, param_dtype=torch.bfloat16), adamw,
     dict(max_grad_norm=CLIP, tp_replicate=["head"])),   # its 5 classes do not split over tp=2
    # ZeRO: expert weights' optimizer states (zero=2: and gradients) sharded over their edp
    # group (one rank at dp2 ep2: nothing to split; two at dp4 ep2 and dp2 tp2 ep2), dense
    # ones over dp
    ("mixtral", dict(dp=2, ep=2, zero=1), adamw), ("mixtral", dict(dp=4, ep=2, zero=2), adamw),
    ("mixtral", dict(dp=2, tp=2, ep=2, zero=2), adamw, dict(max_grad_norm=CLIP)),
    ("tiny_moe", dict(dp=4, ep=2, zero=1, param_dtype=torch.bfloat16), adamw),
    # expert tensor parallelism: each expert's matrices split over tp as well; ep=1 (every rank
    # all experts, half of each) and ep=2 (the ep group: the two dp ranks at one tp rank)
    ("mixtral", dict(dp=2, tp=2, expert_tp=2), adamw), ("mixtral", dict(dp=2, tp=2, expert_tp=2), sgd),
    ("mixtral", dict(dp=2, tp=2, ep=2, expert_tp=2), adamw), ("mixtral", dict(dp=2, tp=2, ep=2, expert_tp=2), sgd),
    # with pipeline stages: tp2 x pp2 (every rank all its stage's experts, half of each) and, on
    # 8 processes, ep2 x tp2 x pp2 x dp2
    ("mixtral", dict(tp=2, pp=2, expert_tp=2, microbatches=2), sgd),
    ("mixtral", dict(dp=2, tp=2, pp=2, ep=2, expert_tp=2, microbatches=2), adamw),
    # clipping counts each piece once (ep1: edp pairs across the replicas, first rank counts);
    # ZeRO shards each piece's state over its edp pair, with clipping over the shards
    ("mixtral", dict(dp=2, tp=2, expert_tp=2), sgd, dict(max_grad_norm=CLIP)),
    ("mixtral", dict(dp=2, tp=2, expert_tp=2, zero=1), adamw, dict(max_grad_norm=CLIP)),
    # another architecture (Qwen2-MoE: its shared expert is a dense MLP, split by tp as such) and
    # bf16 compute weights (the tp sums of the pieces in bf16) on the fx-traced TinyMoE, with SGD:
    # each piece's partial output is rounded to bf16 before the sum, a rounding one device does
    # not make, and AdamW's normalised step turns it into a step of up to lr on a router element
    # whose gradient is near zero (one of 32 moved by 0.019 against 0.0115 allowed); SGD's step
    # is proportional to the gradient, so the comparison still sees any wrong piece or sum
    ("qwen2_moe", dict(dp=2, tp=2, ep=2, expert_tp=2), adamw),
    ("tiny_moe", dict(dp=2, tp=2, expert_tp=2, param_dtype=torch.bfloat16), sgd, dict(tp_replicate=["head"]))]


def _options(index):
    """compile's options of PARITY[index] (its fourth entry, if any)."""
    return PARITY[index][3] if len(PARITY[index]) > 3 else {}


@pytest.fixture(scope="module")
def launched():
    """The parity cases of one world size share one launch (tests/targets/cases.py)."""
    return SharedLaunches({index: (gp.Strategy(**strategy).world_size, ep_targets.train_moe,
                                   (arch, gp.Strategy(**strategy).to_dict(), STEPS, optimizer()),
                                   dict(options=_options(index)))
                           for index, (arch, strategy, optimizer, *_) in enumerate(PARITY)})


@pytest.mark.parametrize("index", range(len(PARITY)), ids=[
    f"{arch}-" + "-".join(f"{k}{n}" for k, n in {**strategy, **_options(i)}.items()) + f"-{optimizer.__name__}"
    for i, (arch, strategy, optimizer, *_) in enumerate(PARITY)])
def test_expert_parallel_matches_single_device(launched, index):
    arch, strategy, optimizer, *_ = PARITY[index]
    strategy, clip = gp.Strategy(**strategy), _options(index).get("max_grad_norm")
    check_parity(launched(index), reference(arch, strategy, optimizer(), max_grad_norm=clip), strategy.dp,
                 strategy.ep, strategy.tp, max_grad_norm=clip, param_dtype=strategy.param_dtype, zero=strategy.zero,
                 expert_tp=strategy.expert_tp)


@pytest.mark.parametrize("degrees", [dict(dp=2, ep=2), dict(dp=2, tp=2, ep=2, expert_tp=2)],
                         ids=["dp2-ep2", "dp2-tp2-ep2-expert_tp2"])   # expert_tp: the tp sums of zero rows
def test_an_ep_rank_without_tokens_neither_hangs_nor_recompiles(degrees):
    # the reference's routing leaves experts 2 and 3 (ep rank 1's) without a token: their
    # gradient is exactly zero (the fused weight's gradient is whole; eager AdamW still steps
    # them, by its weight decay alone), the first two experts' is not
    x, y = ep_targets.moe_batch()
    model = ep_targets.starved_mixtral()
    hf_causal_lm_loss(model(x), y).backward()
    for layer in model.model.layers:
        grad = layer.mlp.experts.gate_up_proj.grad
        assert grad[2:].abs().max() == 0 and grad[0].abs().max() > 0 and grad[1].abs().max() > 0
    strategy = gp.Strategy(**degrees)
    results = launch(ep_targets.train_moe, world_size=strategy.world_size,
                     args=("starved_mixtral", degrees, STEPS, adamw()))
    check_parity(results, reference("starved_mixtral", strategy, adamw()), dp=2, ep=2, tp=strategy.tp,
                 expert_tp=strategy.expert_tp)
    assert [run["programs"] for run in results] == [1] * strategy.world_size


@pytest.mark.parametrize("dp, ep, microbatches", [(2, 2, 2), (4, 2, 1)])
def test_tiny_fx_moe_matches_single_device(dp, ep, microbatches, tmp_path):
    strategy = {"dp": dp, "ep": ep, "microbatches": microbatches}
    results = launch(ep_targets.train_tiny_moe, world_size=dp, args=(strategy, STEPS, adamw(), str(tmp_path)))
    x, y = ep_targets.tiny_batch()
    trained, losses = train_reference(ep_targets.tiny_moe(), [(x, y)], torch.nn.functional.cross_entropy, adamw(),
                                      STEPS)
    rows = x.shape[0] // dp
    with torch.no_grad():
        logits = trained.eval()(x)
    for rank, run in enumerate(results):
        assert run["front_end"] == "fx"
        # sharded checkpoints do not describe expert blocks yet: refused on every rank, nothing written
        assert f"save_checkpoint: Strategy.ep={ep} splits expert weights" in run["checkpoint_refused"]
        assert not any(tmp_path.iterdir())
        assert run["losses"] == pytest.approx(losses, abs=LOSS_TOL)
        for key, value in trained.state_dict().items():
            torch.testing.assert_close(run["state"][key], value, atol=PARAM_TOL, rtol=0, msg=key)
        torch.testing.assert_close(run["logits"], logits[rank * rows:(rank + 1) * rows], atol=LOGITS_TOL, rtol=0)


# every transfer of one training step, counted on torch.distributed (all-to-alls by the
# buffer each reads, the plan's unit), against gp.plan given the routing of that step
PLANNED_WORLDS = {2: [dict(dp=2, ep=2)], 4: [dict(dp=4, ep=2), dict(dp=2, pp=2, ep=2, microbatches=2),
                                              dict(dp=2, tp=2, ep=4), dict(tp=2, pp=2, ep=2, microbatches=2),
                                              # ZeRO: expert buckets reduce-scattered and gathered over edp
                                              dict(dp=4, ep=2, zero=2), dict(dp=2, tp=2, ep=2, zero=1),
                                              # expert tensor parallelism: all-reduces over tp, no
                                              # all-to-all at ep=1; ZeRO over edp pairs at ep=1
                                              dict(dp=2, tp=2, expert_tp=2, zero=1),
                                              dict(dp=2, tp=2, ep=2, expert_tp=2),
                                              dict(tp=2, pp=2, expert_tp=2, microbatches=2)]}


def _planned(report, rank):
    totals = {}
    for t in report.ranks[rank].collectives:
        entry = totals.setdefault(t.op, [0, 0])
        entry[0] += t.bytes
        entry[1] += t.count
    return totals


@pytest.mark.parametrize("world", sorted(PLANNED_WORLDS), ids=lambda w: f"world{w}")
def test_all_to_all_bytes_of_each_rank_equal_the_plan_for_its_routing(world):
    strategies = [gp.Strategy(**degrees) for degrees in PLANNED_WORLDS[world]]
    measured = launch(ep_targets.measure_moe, world_size=world, args=("mixtral", [s.to_dict() for s in strategies]))
    x, y = ep_targets.moe_batch()
    for i, strategy in enumerate(strategies):
        routing = measured[0][i]["routing"]
        for run in measured:   # every rank's weights gave the same routing
            assert all(torch.equal(run[i]["routing"][path], index) for path, index in routing.items())
        local = x.shape[0] // strategy.dp
        report = gp.plan(ep_targets.moe_model("mixtral"), strategy, (x[:local],), loss_fn=hf_causal_lm_loss,
                         optimizer=adamw(), example_target=y[:local], routing=routing)
        sent = {sum(t.bytes for t in report.ranks[rank].collectives if t.op == "all_to_all") for rank in range(world)}
        # the routing is uneven: ranks receive different numbers of pairs (at ep=1 none is sent)
        assert len(sent) > 1 if strategy.ep > 1 else sent == {0}
        for rank in range(world):
            m, planned = measured[rank][i], report.ranks[rank]
            assert _planned(report, rank) == m["counts"], (strategy.to_dict(), rank)
            # what the rank holds: E/ep experts, and with ZeRO its shards of their optimizer state
            assert (planned.param_bytes, planned.grad_bytes, planned.optimizer_bytes) == \
                (m["param_bytes"], m["grad_bytes"], m["optimizer_bytes"]), (strategy.to_dict(), rank)
