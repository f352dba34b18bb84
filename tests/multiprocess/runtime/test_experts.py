"""Expert parallelism (graphpar/runtime/experts.py, passes/expert_parallel.py) on gloo
against single-device training of the same transformers MoE model on the global batch."""
import functools
import math
from dataclasses import replace

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
# Strategy.expert_capacity_factor: each expert takes ceil(f * T * K / E) pairs of a replica's
# microbatch of T tokens. The tiny Mixtral's K / E = 1/2: f = 0.75 takes 12 of each replica's
# 64 pairs per expert at dp2 (T = 32), 6 of 32 at dp4 (exact in float, no ceil at a rounding
# edge), below the busiest expert's load in every step, so pairs are dropped; f = E / K = 2 lets
# an expert take every token (a token picks an expert once): nothing can drop
DROPPING = 0.75
NEVER_DROPS = 2.0
# Strategy.recompute as a budget: the tiny Mixtral's embedding, head and loss keep 0.59x (dp2)
# to 0.71x (tp2) of its saved bytes whatever the blocks recompute, so 0.9 is a budget that
# can be met and still makes the blocks recompute part of what they would keep
BUDGET = 0.9


def sgd():
    return functools.partial(torch.optim.SGD, lr=0.1)


def reference(arch, strategy, optimizer, max_grad_norm=None, batch=8):
    """Eager single-device training of `arch` on the global batch as graphpar trains it
    (graphpar/tools/reference.py, gp.verify's: with param_dtype, a compute copy in it and fp32
    masters; clip_grad_norm_ before each step with max_grad_norm): (losses, state, logits,
    clip_grad_norm_'s total norms), each an Expected with how far param_dtype's rounding alone
    moved it (0 in fp32)."""
    (x, y), loss_fn, _ = ep_targets.task(arch, batch)
    model = ep_targets.build(arch)
    training = SingleDeviceReference(model, strategy, optimizer)
    losses, norms = [], []
    for _ in range(STEPS):
        losses.append(training.forward_backward((x,), y, loss_fn))
        if max_grad_norm is not None:
            norms.append(training.clip(max_grad_norm))
        training.step()
    # the flattened output: the model output's fields in order, those that are None left out
    # (mixtral_aux: aux_loss, logits, the router logits of each layer)
    logits = training.evaluate((x,))[1 if arch == "mixtral_aux" else 0]
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


def check_parity(results, ref, dp, ep, tp=1, max_grad_norm=None, param_dtype=None, zero=0, expert_tp=1, listed=False):
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
    experts = {key: tuple(e.value.shape) if listed else held_piece(key, e.value.shape, ep, expert_tp)
               for key, e in state.items() if ep_targets.expert_weight(key)}
    # each rank holds E/ep experts of every expert weight of its stages, with expert_tp 1/tp of
    # each (measured on its programs; at zero=3 with edp > 1 on what its expert buckets gather,
    # check_expert_split; `listed`: expert modules, whole, E/ep of them in each container,
    # which the caller checks); together the ranks hold every layer's
    held = [{**run["held"], **run["expert_split"]["shapes"]} for run in results]
    assert set().union(*held) == set(experts)
    for rank, run in enumerate(results):
        assert held[rank] and held[rank] == {key: experts[key] for key in held[rank]}
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
    if zero == 3:
        check_dense_split(results, dp)
        check_expert_split(results, dp * tp // (ep * expert_tp))


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


def check_dense_split(results, dp):
    """zero=3 with ep: no rank's program holds a dense weight whole; each holds its shard of
    every dense bucket (gathered around its use), 1/dp of the dense elements but the padding of
    each bucket to a multiple of dp (at most dp - 1 elements), while its experts stay whole
    (check_parity: E/ep of them on every rank)."""
    for run in results:
        split = run["dense_split"]
        assert split["whole"] == 0 and split["buckets"] > 0
        if split["dense"] is not None:   # (tp = pp = 1: the rank's dense weights are the model's)
            assert 0 <= dp * split["shard"] - split["dense"] <= split["buckets"] * (dp - 1)


def check_expert_split(results, edp):
    """zero=3 with ep: at edp > 1 no rank's program holds an expert weight; each holds its shard
    of every expert bucket (one per experts module, gathered around its call), 1/edp of its E/ep
    experts' elements but the padding of each bucket to a multiple of edp. At edp = 1 the
    experts stay whole in the rank's programs (nothing to shard them over) and no expert bucket
    is gathered."""
    for run in results:
        split = run["expert_split"]
        if edp == 1:
            assert split["buckets"] == 0 and split["whole"] > 0
            continue
        assert split["whole"] == 0 and split["buckets"] > 0 and split["gathered"] > 0
        # the E/ep experts' elements, from the shapes gathered (each checked against E/ep above)
        assert split["gathered"] == sum(math.prod(shape) for shape in split["shapes"].values())
        assert 0 <= edp * split["shard"] - split["gathered"] <= split["buckets"] * (edp - 1)


PARITY = [
    ("mixtral", dict(dp=2, ep=2), adamw), ("mixtral", dict(dp=2, ep=2), sgd), ("mixtral", dict(dp=4, ep=2), adamw),
    ("mixtral", dict(dp=4, ep=4), adamw), ("mixtral", dict(dp=2, pp=2, ep=2, microbatches=2), adamw),
    ("qwen2_moe", dict(dp=2, ep=2), adamw), ("olmoe", dict(dp=4, ep=4), sgd),
    # ep folds into dp x tp: over the tp ranks of each replica (ep2), over all four (ep4), and
    # ep2 x tp2 x pp2 (dp1: the ep group is the two tp ranks of each stage)
    ("mixtral", dict(dp=2, tp=2, ep=2), adamw), ("mixtral", dict(dp=2, tp=2, ep=4), sgd),
    ("mixtral", dict(tp=2, pp=2, ep=2, microbatches=2), adamw), ("mixtral", dict(tp=2, pp=2, ep=2, microbatches=2), sgd),
    # 8 processes: dp2 x tp2 x pp2 with ep2 (expert gradients summed over edp pairs across
    # replicas). One optimizer per mix where tp2 pp2 ep2 above has both: SGD, whose step is
    # proportional to the gradient, sees a wrongly scaled sum that AdamW's normalised step hides
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
    # zero=3: dense weights sharded over dp, gathered around their use; expert weights sharded
    # over edp, gathered around their experts call (dp4 ep2, dp2 tp2 ep2, dp4 pp2 ep2: edp 2);
    # at edp 1 (dp2 ep2, dp2 pp2 ep2) whole on the rank, their gradients and states as at zero=2
    ("mixtral", dict(dp=2, ep=2, zero=3), adamw), ("mixtral", dict(dp=4, ep=2, zero=3), adamw),
    ("mixtral", dict(dp=2, tp=2, ep=2, zero=3), adamw), ("mixtral", dict(dp=2, pp=2, ep=2, zero=3, microbatches=2), adamw),
    ("mixtral", dict(dp=4, pp=2, ep=2, zero=3, microbatches=2), adamw),
    ("mixtral", dict(dp=4, ep=2, zero=3, param_dtype=torch.bfloat16), adamw),
    ("mixtral", dict(dp=4, ep=2, zero=3), adamw, dict(max_grad_norm=CLIP)),   # dense rows over dp, experts' over edp
    # the router's load-balancing loss in the loss: its token fractions and router
    # probabilities summed over dp (passes/global_router_statistics.py), with and without ep
    ("mixtral_aux", dict(dp=2), adamw), ("mixtral_aux", dict(dp=4, ep=2), adamw),
    ("mixtral_aux", dict(dp=2, tp=2, ep=2), sgd),
    # the optimizer on the host: each rank's host holds the masters and states of its E/ep
    # experts (and of the dense weights); with ZeRO its 1/edp share of them
    ("mixtral", dict(dp=2, ep=2, offload_optimizer=True), adamw),
    ("mixtral", dict(dp=4, ep=2, offload_optimizer=True), adamw),
    ("mixtral", dict(dp=2, tp=2, ep=4, offload_optimizer=True), sgd),
    ("mixtral", dict(dp=4, ep=2, zero=1, offload_optimizer=True), adamw),
    ("mixtral", dict(dp=4, ep=2, zero=3, offload_optimizer=True), adamw),
    # and of its pieces of each expert with expert tensor parallelism (without ZeRO each master
    # the shape of the rank's piece; at zero=3 its 1/edp share of them)
    ("mixtral", dict(dp=2, tp=2, ep=2, expert_tp=2, offload_optimizer=True), adamw),
    ("mixtral", dict(dp=2, tp=2, expert_tp=2, zero=3, offload_optimizer=True), adamw),
    # expert tensor parallelism: each expert's matrices split over tp as well; ep=1 (every rank
    # all experts, half of each) and ep=2 (the ep group: the two dp ranks at one tp rank)
    # (SGD for dp2 tp2 below, with clipping)
    ("mixtral", dict(dp=2, tp=2, expert_tp=2), adamw), ("mixtral", dict(dp=2, tp=2, ep=2, expert_tp=2), sgd),
    # with pipeline stages: tp2 x pp2 (every rank all its stage's experts, half of each) and, on
    # 8 processes, ep2 x tp2 x pp2 x dp2
    ("mixtral", dict(tp=2, pp=2, expert_tp=2, microbatches=2), sgd),
    ("mixtral", dict(dp=2, tp=2, pp=2, ep=2, expert_tp=2, microbatches=2), adamw),
    # clipping counts each piece once (ep1: edp pairs across the replicas, first rank counts);
    # ZeRO shards each piece's state over its edp pair, with clipping over the shards
    ("mixtral", dict(dp=2, tp=2, expert_tp=2), sgd, dict(max_grad_norm=CLIP)),
    ("mixtral", dict(dp=2, tp=2, expert_tp=2, zero=1), adamw, dict(max_grad_norm=CLIP)),
    # zero=3 on the pieces: sharded over their edp pair and gathered around the call (dp2 tp2
    # at ep1; dp4 tp2 ep2 on 8 processes), whole at edp 1 (dp2 tp2 ep2)
    ("mixtral", dict(dp=2, tp=2, expert_tp=2, zero=3), adamw), ("mixtral", dict(dp=2, tp=2, ep=2, expert_tp=2, zero=3), adamw),
    ("mixtral", dict(dp=4, tp=2, ep=2, expert_tp=2, zero=3), adamw),
    # another architecture (Qwen2-MoE: its shared expert is a dense MLP, split by tp as such) and
    # bf16 compute weights (the tp sums of the pieces in bf16) on the fx-traced TinyMoE, with SGD:
    # each piece's partial output is rounded to bf16 before the sum, a rounding one device does
    # not make, and AdamW's normalised step turns it into a step of up to lr on a router element
    # whose gradient is near zero (one of 32 moved by 0.019 against 0.0115 allowed); SGD's step
    # is proportional to the gradient, so the comparison still sees any wrong piece or sum
    ("qwen2_moe", dict(dp=2, tp=2, ep=2, expert_tp=2), adamw),
    ("tiny_moe", dict(dp=2, tp=2, expert_tp=2, param_dtype=torch.bfloat16), sgd, dict(tp_replicate=["head"])),
    # activation recomputation: the experts calls stay out of the recomputed regions (their
    # all-to-alls run once each way), the rest of each block is replayed in backward; every
    # mode, with tp (the ep group across the tp ranks) and with pipeline stages
    ("mixtral", dict(dp=2, ep=2, recompute="full"), adamw), ("mixtral", dict(dp=2, ep=2, recompute="selective"), adamw),
    ("mixtral", dict(dp=2, ep=2, recompute=BUDGET), sgd), ("mixtral", dict(tp=2, ep=2, recompute="full"), sgd),
    ("mixtral", dict(dp=2, tp=2, ep=2, recompute=BUDGET), adamw),
    ("mixtral", dict(tp=2, pp=2, ep=2, microbatches=2, recompute="selective"), adamw),
    # sequence parallelism: the MoE block gathers its replica's tokens, each tp rank dispatches
    # its share of them (expert_tp: all of them) and takes its piece of the sequence back
    ("mixtral", dict(tp=2, ep=2, sequence_parallel=True), adamw),
    ("mixtral", dict(dp=2, tp=2, ep=2, sequence_parallel=True), sgd),
    ("mixtral", dict(dp=2, tp=2, ep=2, expert_tp=2, sequence_parallel=True), adamw),
    ("mixtral", dict(tp=2, ep=2, sequence_parallel=True, recompute="full"), adamw),
    ("mixtral", dict(tp=2, pp=2, ep=2, microbatches=2, sequence_parallel=True), sgd),
    # the embedding table on the host (offload_embedding): its rows gathered there, the experts
    # on the device as without it
    ("mixtral", dict(dp=2, ep=2, offload_embedding=True), adamw),
    ("mixtral", dict(dp=2, tp=2, ep=2, offload_embedding=True, recompute="full"), adamw)]
OFFLOADED = [i for i, (_, strategy, *_) in enumerate(PARITY) if strategy.get("offload_optimizer")]


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


@pytest.mark.parametrize("index", OFFLOADED, ids=lambda i: "-".join(f"{k}{n}" for k, n in PARITY[i][1].items()))
def test_the_host_of_each_rank_holds_its_experts_state_as_planned(launched, index):
    strategy = gp.Strategy(**PARITY[index][1])
    for rank, run in enumerate(launched(index)):
        host = run["host"]
        # masters, optimizer states, compute copies and the step's gradients on the host,
        # measured, equal the plan's host bytes for this rank
        assert host["held"] == host["planned"] > 0, rank
        assert host["moved"]["to_host"] > 0 and host["moved"]["to_device"] > 0
        if not strategy.zero:   # each expert master is the rank's E/ep experts, as its device weight
            assert host["expert_masters"] and host["expert_masters"] == run["held"], rank


RECOMPUTED = [i for i, (_, strategy, *_) in enumerate(PARITY) if strategy.get("recompute") is not None]


def _without_recompute(index):
    """The PARITY case trained as PARITY[index] but without recomputation, if there is one."""
    arch, strategy, optimizer, *_ = PARITY[index]
    base = {k: v for k, v in strategy.items() if k != "recompute"}
    return next((i for i, (a, s, o, *_) in enumerate(PARITY) if (a, s, o) == (arch, base, optimizer)), None)


@pytest.mark.parametrize("index", [i for i in RECOMPUTED if _without_recompute(i) is not None],
                         ids=lambda i: "-".join(f"{k}{n}" for k, n in PARITY[i][1].items()))
def test_recompute_with_ep_trains_bit_for_bit_as_without(launched, index):
    # the replay runs the same ops on the same inputs, and the experts calls run once: the
    # same losses, state and outputs as the same strategy without recomputation, exactly
    base = launched(_without_recompute(index))
    for rank, (run, expected) in enumerate(zip(launched(index), base, strict=True)):
        assert run["losses"] == expected["losses"], rank
        for key, value in expected["state"].items():
            torch.testing.assert_close(run["state"][key], value, atol=0, rtol=0, msg=f"rank {rank}: {key}")
        torch.testing.assert_close(run["logits"], expected["logits"], atol=0, rtol=0)


@pytest.mark.parametrize("index", [i for i, (_, s, *_) in enumerate(PARITY) if s.get("offload_embedding")],
                         ids=lambda i: "-".join(f"{k}{n}" for k, n in PARITY[i][1].items()))
def test_the_embedding_table_stays_on_the_host_with_ep(launched, index):
    for rank, run in enumerate(launched(index)):
        tables = run["tables"]
        assert tables["host"] and set(tables["host"].values()) == {"cpu"}, rank
        assert not tables["device"], rank


@pytest.mark.parametrize("degrees", [dict(dp=2, ep=2), dict(dp=2, tp=2, ep=2, expert_tp=2), dict(dp=4, ep=2, zero=3)],
                         # expert_tp: the tp sums of zero rows; zero=3: the starved experts still
                         # gathered over edp and their zero gradients reduce-scattered
                         ids=["dp2-ep2", "dp2-tp2-ep2-expert_tp2", "dp4-ep2-zero3"])
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
    check_parity(results, reference("starved_mixtral", strategy, adamw()), dp=strategy.dp, ep=strategy.ep,
                 tp=strategy.tp, zero=strategy.zero, expert_tp=strategy.expert_tp)
    assert [run["programs"] for run in results] == [1] * strategy.world_size


@pytest.mark.parametrize("degrees", [dict(dp=4, ep=2, zero=3), dict(dp=4, pp=2, ep=2, zero=3, microbatches=2)],
                         ids=["dp4-ep2-zero3", "dp4-pp2-ep2-zero3"])
def test_zero3_expert_shards_round_trip_through_a_saved_full_state_dict(degrees, tmp_path):
    # zero=3 at edp = 2: full_state_dict gathers each expert weight over edp then over ep;
    # load_full_state_dict writes each rank's 1/edp of its E/ep experts back into its shards
    strategy = gp.Strategy(**degrees)
    results = launch(ep_targets.round_trip_moe, world_size=strategy.world_size,
                     args=(degrees, 2, str(tmp_path / "state.pt")))
    for run in results:
        assert run["split"]["whole"] == 0 and run["split"]["buckets"] > 0   # the experts are sharded
        assert run["saved"].keys() == run["loaded"].keys()
        moved = [key for key in run["saved"] if not torch.equal(run["saved"][key], run["untrained"][key])]
        assert any(ep_targets.expert_weight(key) for key in moved)   # training moved expert weights
        for key, value in run["saved"].items():   # gathered back exactly as saved
            assert torch.equal(run["loaded"][key], value), key
        trained, loaded = run["logits"]
        assert torch.equal(trained, loaded)   # the same weights through the same program
        assert run["losses"][0] == run["losses"][1]


def test_zero3_expert_shards_serve_a_new_input_shape():
    # a new input shape traces the model again; at zero=3 (edp = 2) the new program gathers
    # the first program's expert shards (lower_to_rank's stand-ins for them are replaced by
    # the same buckets), so it computes with the trained weights
    degrees, cut = dict(dp=4, ep=2, zero=3), 4
    results = launch(ep_targets.reshaped_moe, world_size=4, args=(degrees, cut))
    (x, y), loss_fn, logits_of = ep_targets.task("mixtral")
    model = ep_targets.moe_model("mixtral")
    model.load_state_dict(results[0]["state"])
    rows = x.shape[0] // degrees["dp"]
    with torch.no_grad():
        logits = logits_of(model(x[:, :cut]))
        loss = loss_fn(model(x[:, :cut]), y[:, :cut]).item()
    for rank, run in enumerate(results):
        assert run["programs"] == 2   # the first shape's and the new one's (evaluation and training)
        # the same weights, the rows' sums ordered otherwise (LOSS_TOL's reasons, one forward)
        torch.testing.assert_close(run["logits"], logits[rank * rows:(rank + 1) * rows], atol=LOSS_TOL, rtol=0)
        assert run["loss"] == pytest.approx(loss, abs=LOSS_TOL)


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
PLANNED_WORLDS = {
    # mixtral_aux: the load-balancing loss's two per-expert means, their sums all-reduced over dp
    2: [("mixtral", dict(dp=2, ep=2)), ("mixtral", dict(dp=2, ep=2, expert_capacity_factor=DROPPING)),
        ("mixtral_aux", dict(dp=2, ep=2)),
        # zero=3: dense buckets gathered over dp in forward (and backward), expert buckets
        # reduce-scattered and gathered over edp (one rank here) as at zero=2
        ("mixtral", dict(dp=2, ep=2, zero=3)),
        # the list layout (a user's ModuleList, top-2 indices): its experts' rows the same way
        ("list_moe", dict(dp=2, ep=2)),
        # recomputation: the experts calls run once; a replay issues its region's forward tp
        # collectives again (reduce_from's all-reduce; with sequence parallelism its gathers
        # and reduce-scatters); sequence parallelism's gathers around the MoE block
        ("mixtral", dict(dp=2, ep=2, recompute="full")), ("mixtral", dict(tp=2, ep=2, recompute="selective")),
        ("mixtral", dict(tp=2, ep=2, sequence_parallel=True)),
        ("mixtral", dict(tp=2, ep=2, sequence_parallel=True, recompute="full"))],
    4: [("mixtral", strategy) for strategy in (
        dict(dp=4, ep=2), dict(dp=2, pp=2, ep=2, microbatches=2), dict(dp=2, tp=2, ep=4),
        dict(tp=2, pp=2, ep=2, microbatches=2),
        # ZeRO: expert buckets reduce-scattered and gathered over edp
        dict(dp=4, ep=2, zero=2), dict(dp=2, tp=2, ep=2, zero=1),
        # zero=3 at edp 2: expert buckets gathered over edp around their call, in forward and
        # backward, and reduce-scattered over it every microbatch; the all-to-alls in bf16 rows
        dict(dp=4, ep=2, zero=3), dict(dp=2, tp=2, ep=2, zero=3), dict(dp=4, ep=2, zero=3, param_dtype=torch.bfloat16),
        # a capacity: only the kept pairs are sent (per microbatch, per tp share)
        dict(dp=2, pp=2, ep=2, microbatches=2, expert_capacity_factor=DROPPING),
        dict(dp=2, tp=2, ep=4, expert_capacity_factor=DROPPING),
        # expert tensor parallelism: all-reduces over tp, no all-to-all at ep=1; ZeRO over edp
        # pairs at ep=1
        dict(dp=2, tp=2, expert_tp=2, zero=1), dict(dp=2, tp=2, expert_tp=2, zero=3), dict(dp=2, tp=2, ep=2, expert_tp=2),
        dict(tp=2, pp=2, expert_tp=2, microbatches=2),
        dict(dp=2, tp=2, ep=2, expert_tp=2, expert_capacity_factor=DROPPING),
        dict(dp=2, tp=2, ep=2, sequence_parallel=True), dict(tp=2, pp=2, ep=2, microbatches=2, recompute=BUDGET))]
    # the list layout at zero=3 over edp pairs: one bucket run per container, gathered around its call
    + [("list_moe", dict(dp=4, ep=2, zero=3))],
    # zero=3 at edp 2 with pipeline stages: each stage gathers its own layers' experts
    8: [("mixtral", dict(dp=4, pp=2, ep=2, zero=3, microbatches=2))]}


def _planned(report, rank):
    totals = {}
    for t in report.ranks[rank].collectives:
        entry = totals.setdefault(t.op, [0, 0])
        entry[0] += t.bytes
        entry[1] += t.count
    return totals


@pytest.mark.parametrize("world", sorted(PLANNED_WORLDS), ids=lambda w: f"world{w}")
def test_all_to_all_bytes_of_each_rank_equal_the_plan_for_its_routing(world):
    cases = [(arch, gp.Strategy(**degrees)) for arch, degrees in PLANNED_WORLDS[world]]
    measured = launch(ep_targets.measure_moe, world_size=world, args=([(arch, s.to_dict()) for arch, s in cases],))
    for i, (arch, strategy) in enumerate(cases):
        (x, y), loss_fn, _ = ep_targets.task(arch)
        routing = measured[0][i]["routing"]
        for run in measured:   # every rank's weights gave the same routing
            assert all(torch.equal(run[i]["routing"][path], index) for path, index in routing.items())
        local = x.shape[0] // strategy.dp
        report = gp.plan(ep_targets.build(arch), strategy, (x[:local],), loss_fn=loss_fn,
                         optimizer=adamw(), example_target=y[:local], routing=routing)
        sent = {sum(t.bytes for t in report.ranks[rank].collectives if t.op == "all_to_all") for rank in range(world)}
        # the routing is uneven: ranks receive different numbers of pairs (at ep=1 none is sent)
        assert len(sent) > 1 if strategy.ep > 1 else sent == {0}
        if strategy.expert_capacity_factor is not None:   # the step drops pairs: fewer bytes than dropless
            dropless = gp.plan(ep_targets.build(arch), replace(strategy, expert_capacity_factor=None),
                               (x[:local],), loss_fn=loss_fn, optimizer=adamw(),
                               example_target=y[:local], routing=routing)
            assert all(_planned(report, rank)["all_to_all"][0] < _planned(dropless, rank)["all_to_all"][0]
                       for rank in range(world))
        for rank in range(world):
            m, planned = measured[rank][i], report.ranks[rank]
            assert _planned(report, rank) == m["counts"], (strategy.to_dict(), rank)
            # what the rank holds: E/ep experts, and with ZeRO its shards of their optimizer state
            assert planned.param_bytes == m["param_bytes"], (strategy.to_dict(), rank)
            if arch in ep_targets.LISTED:
                # an expert module that got no token in the two steps has no gradient and no
                # optimizer state, as in eager (here one of rank 1's); the plan counts every expert's
                assert planned.grad_bytes >= m["grad_bytes"] and planned.optimizer_bytes >= m["optimizer_bytes"]
            else:
                assert (planned.grad_bytes, planned.optimizer_bytes) == (m["grad_bytes"], m["optimizer_bytes"]), \
                    (strategy.to_dict(), rank)


CAPPED = [dict(dp=2, ep=2), dict(dp=4, ep=4), dict(dp=4, ep=2), dict(dp=2, tp=2, ep=2),
          dict(dp=2, tp=2, ep=2, expert_tp=2),   # every tp rank dispatches the replica's kept pairs
          dict(dp=2, pp=2, ep=2, microbatches=2)]   # each microbatch of 16 tokens has its capacity


def capped_reference(factor, dp, microbatches=1, arch="mixtral"):
    """Eager single-device AdamW training of `arch` (Mixtral) whose experts drop past capacity
    per dp replica's microbatch of tokens (ep_targets.CappedExperts): (losses, state, logits,
    no norms), each an Expected with no rounding noise (fp32), and the pairs dropped per step
    per replica (over its microbatches)."""
    (x, y), loss_fn, logits_of = ep_targets.task(arch)
    model = ep_targets.capped(arch, factor, blocks=dp * microbatches)
    optimizer = adamw()(model.parameters())
    losses, dropped = [], []
    for _ in range(STEPS):
        optimizer.zero_grad()
        model.capped_dropped.clear()
        loss = loss_fn(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(Expected(loss.item(), 0.0))
        dropped.append([sum(sum(layer[d * microbatches:(d + 1) * microbatches]) for layer in model.capped_dropped)
                        for d in range(dp)])
    with torch.no_grad():
        logits = logits_of(model.eval()(x))
    state = {key: Expected(value, 0.0) for key, value in model.state_dict().items()}
    return (losses, state, Expected(logits, 0.0), []), dropped


def _capped_case(strategy, factor):
    return {**strategy, "expert_capacity_factor": factor}


@pytest.fixture(scope="module")
def capped_launches():
    cases = {i: _capped_case(strategy, DROPPING) for i, strategy in enumerate(CAPPED)}
    cases["never"] = _capped_case(CAPPED[0], NEVER_DROPS)
    return SharedLaunches({name: (gp.Strategy(**strategy).world_size, ep_targets.train_moe,
                                  ("mixtral", strategy, STEPS, adamw())) for name, strategy in cases.items()})


@pytest.mark.parametrize("index", range(len(CAPPED)),
                         ids=["-".join(f"{k}{n}" for k, n in strategy.items()) for strategy in CAPPED])
def test_capacity_drops_as_single_device_with_the_same_rule(capped_launches, index):
    strategy = gp.Strategy(**_capped_case(CAPPED[index], DROPPING))
    ref, dropped = capped_reference(DROPPING, strategy.dp, strategy.microbatches)
    results = capped_launches(index)
    check_parity(results, ref, strategy.dp, strategy.ep, strategy.tp, expert_tp=strategy.expert_tp)
    assert all(sum(step) > 0 for step in dropped), "every step drops pairs"
    # each rank counts the drops of its replica's tokens in its stages' layers (every tp rank
    # of a replica the same); over a replica's stages, as eager drops in its blocks of tokens
    for rank, run in enumerate(results):
        assert run["dropped"] == results[rank - rank % strategy.tp]["dropped"], rank
    for replica in range(strategy.dp):
        stages = [run["dropped"] for rank, run in enumerate(results)
                  if rank // strategy.tp % strategy.dp == replica and rank % strategy.tp == 0]
        assert [sum(counts) for counts in zip(*stages)] == [step[replica] for step in dropped], replica


def test_a_capacity_that_drops_nothing_is_dropless(capped_launches):
    strategy = gp.Strategy(**_capped_case(CAPPED[0], NEVER_DROPS))
    results = capped_launches("never")
    check_parity(results, reference("mixtral", strategy, adamw()), strategy.dp, strategy.ep)
    assert [run["dropped"] for run in results] == [[0] * STEPS] * strategy.world_size


# (strategy, recompute modes): each mode's bytes against the same strategy without recompute.
# Not with sequence parallelism: the planner's regions are not the compile's there, with or
# without ep (tests/multiprocess/runtime/test_recompute.py does not compare them either)
RECOMPUTE_PLANNED = [(dict(dp=2, ep=2), ("full", "selective", BUDGET)), (dict(tp=2, ep=2), ("full", BUDGET))]


def test_recompute_with_ep_keeps_what_the_plan_says():
    cases = [{**strategy, "recompute": mode} for strategy, modes in RECOMPUTE_PLANNED for mode in (None, *modes)]
    measured = launch(ep_targets.measure_recompute, world_size=2, args=(cases,))
    for rank, runs in enumerate(measured):
        by_case = {(tuple(sorted((k, v) for k, v in c.items() if k != "recompute")), c["recompute"]): run
                   for c, run in zip(cases, runs, strict=True)}
        for strategy, modes in RECOMPUTE_PLANNED:
            key = tuple(sorted(strategy.items()))
            base = by_case[key, None]
            for mode in modes:
                run, where = by_case[key, mode], (strategy, mode, rank)
                # what the experts calls save depends on the routing, which the plan does not
                # know (it counts one device's experts code), and no mode changes it: the
                # bytes recomputation spares, measured, are the plan's exactly
                assert base["peak"] - run["peak"] == base["planned"] - run["planned"] > 0, where
                # the compile and the plan outline the same regions, keep the same calls and
                # count the same bytes (the experts calls as keeping their routing weights)
                assert run["compiled"] == run["note"] is not None, where
