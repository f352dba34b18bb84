"""Tensor parallelism on gloo against single-device training from the same state_dict. Every
case of one world size runs in one launch (tests/targets/cases.py), `cases` below."""
import re

import pytest
import torch

from graphpar.ir import Shard
from graphpar.ir.layout import local_shard
from tests import helpers
from tests.targets import tp_targets
from tests.targets.cases import SharedLaunches
from tests.unit.passes.tp.test_tensor_parallel import _lower


STEPS = 3
# TP changes the order of float32 sums (row-parallel partial products, the parallel cross
# entropy's log-sum-exp over shards): losses and outputs agree to rounding noise (~1e-6).
# Gradients of one step: same. After 3 AdamW steps, entries whose gradient is only rounding
# noise move by up to lr * |g| / eps ~ 1e-5 per step (see test_world_of_one), a wrong
# gradient by O(lr) = 1e-2.
FIRST_LOSS_TOL = 1e-5
LOSS_TOL = 1e-4  # later steps: the loss of parameters that differ by the Adam noise above
GRAD_TOL = 1e-5
OUT_TOL = 1e-4
PARAM_TOL = 2e-4
MODELS = ["gpt", "gpt_fused_qkv", "gpt_gqa_swiglu", "hf_gpt2", "hf_llama", "hf_bert"]
LAYOUTS = ["hf_falcon", "hf_falcon_old", "hf_gptj", "hf_bloom"]
DP2_TP2 = ["gpt", "hf_llama"]


def cases():
    """Every launched case of this module: {name: (world size, function, args)}."""
    return {
        **{("tp", name, tp): (tp, tp_targets.train_tp_with_and_without_target, (name, STEPS))
           for tp in (2, 4) for name in MODELS},
        **{("layout", name): (2, tp_targets.train_tp, (name, STEPS)) for name in LAYOUTS + ["hf_falcon_mq"]},
        **{("dp2_tp2", name): (4, tp_targets.train_tp_with_and_without_target, (name, STEPS, 2)) for name in DP2_TP2},
        "cross_entropy": (2, tp_targets.cross_entropy_options, ()),
    }


@pytest.fixture(scope="module")
def launched():
    return SharedLaunches(cases())


def _reference(name, tp):
    return tp_targets.reference(name, tp, STEPS)


def check_parity(results, reference, tp, dp=1, norms=False):
    """Each rank against single-device training: losses, its gradients against its chunk of
    the full ones (dp: averaged), the state after STEPS steps, its dp slice of the outputs.
    `norms`: the model's norm-weight gradients are whole and equal on every tp rank."""
    losses, grads, state, out = reference
    norm_grads = {}
    for r in results:
        assert r["losses"][0] == pytest.approx(losses[0], abs=FIRST_LOSS_TOL)
        assert r["losses"] == pytest.approx(losses, abs=LOSS_TOL)
        for param, grad in r["grads"].items():  # each rank's gradient is its chunk of the full one
            spec = r["shards"].get(param)
            expected = local_shard(grads[param], spec, r["tp_rank"], tp) if spec else grads[param]
            torch.testing.assert_close(grad, expected, atol=GRAD_TOL, rtol=0, msg=param)
            if "ln" in param or "norm" in param:
                norm_grads.setdefault(param, []).append(grad)
        for key, value in state.items():
            torch.testing.assert_close(r["state"][key], value, atol=PARAM_TOL, rtol=0, msg=key)
        rows = out.shape[0] // dp   # pm(x) returns this dp rank's outputs
        torch.testing.assert_close(r["out"], out[r.get("dp_rank", 0) * rows:][:rows], atol=OUT_TOL, rtol=0)
    if norms:
        assert norm_grads, "the model has norm weights"
        for param, per_rank in norm_grads.items():   # whole and identical on every tp rank
            assert all(torch.equal(g, per_rank[0]) for g in per_rank), param


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("name", MODELS)
def test_tp_matches_single_device(launched, name, tp):
    """Compiled with and without example_target (API.md: the same program either way)."""
    per_rank = launched(("tp", name, tp))
    for results in zip(*per_rank):
        check_parity(results, _reference(name, tp), tp)
        assert any(r["shards"] for r in results)  # something really was sharded


@pytest.mark.parametrize("name", LAYOUTS)
def test_transformers_layouts_split_attention_and_mlp(launched, name):
    """Layouts the solver once left whole: Falcon's one query_key_value traced as `x @ w.T`
    (rows per kv group [its q heads, k, v]; the old layout per head [q, k, v]), GPT-J's
    rotary (interleaved with stack) and BLOOM's attention over batch x heads merged in one
    dim, with the alibi bias each rank slices from the replicated one. Each rank holds half of every attention and MLP weight
    (Falcon: whole kv groups) and trains like one device (fused qkv + grouped kv heads is
    where DeepSpeed AutoTP went silently wrong)."""
    tp = 2
    results = launched(("layout", name))
    reference = _reference(name, tp)
    check_parity(results, reference, tp)
    full = reference[2]
    projections = [k for k in full if re.search(r"\.(self_attention|attn|mlp)\.\w+\.weight$", k)]
    assert len(projections) >= 4 * 2   # at least qkv, out, up, down in each of the 2 layers
    for r in results:
        for key in projections:
            assert r["grads"][key].numel() * tp == full[key].numel(), key


def test_collectives_per_block_and_parameter_bytes(launched):
    tp, layers = 2, 2
    # the tp=2 GPT's parity run, compiled with example_target: what its program holds does not
    # depend on how many steps it then takes
    results = [with_target for with_target, _ in launched(("tp", "gpt", tp))]
    for r in results:
        # per block: one forward all-reduce after attention, one after the MLP (reduce_from),
        # and their backward conjugates at the block inputs (copy_to); plus the vocab-parallel
        # embedding's all-reduce, the LM head's copy_to and the parallel cross entropy.
        assert r["counts"] == {"reduce_from": 2 * layers + 1, "copy_to": 2 * layers + 1,
                               "vocab_parallel_embedding": 1, "parallel_cross_entropy": 1,
                               "gather_from": 1}  # logits for pm(x); not in the training program
    model, _ = tp_targets.build("gpt")
    sharded = sum(t.numel() for n, t in model.state_dict().items() if n in results[0]["shards"])
    replicated = sum(p.numel() for n, p in model.named_parameters() if n not in results[0]["shards"])
    assert results[0]["param_bytes"] == 4 * (sharded // tp + replicated)


def test_multi_query_falcon_splits_its_q_heads_and_keeps_the_kv_head_whole(launched):
    """Falcon-7B's layout: one k/v head, shared by every q head, fused with the q heads in
    query_key_value. Megatron's layout for tp > kv heads: each rank holds half of the q rows
    and the whole k/v rows (S(0|32,R8,R8)), dense is row-parallel; nothing is left whole,
    and training matches one device (the k/v rows' gradient summed over tp, whole on every rank)."""
    tp = 2
    model, loss_fn = tp_targets.build("hf_falcon_mq", tp)
    plan = _lower(model, tp, loss_fn=loss_fn, until="annotate_shards", snapshots=False).ctx.results.tp_plan
    assert plan.replicated_linears == [] and plan.fallbacks == []
    results = launched(("layout", "hf_falcon_mq"))
    reference = _reference("hf_falcon_mq", tp)
    check_parity(results, reference, tp)
    qkv, dense = "transformer.h.0.self_attention.query_key_value.weight", "transformer.h.0.self_attention.dense.weight"
    q_rows, head = 32, 8   # 4 q heads of 8, one k and one v head
    for r in results:
        assert r["shards"][qkv] == Shard(0, (q_rows, head, head), whole=(1, 2))
        assert r["grads"][qkv].shape == (q_rows // tp + 2 * head, 32)
        assert r["grads"][dense].numel() * tp == reference[2][dense].numel()
        assert "transformer.h.0.mlp.dense_h_to_4h.weight" in r["shards"]
    torch.testing.assert_close(results[0]["grads"][qkv][q_rows // tp:], results[1]["grads"][qkv][q_rows // tp:],
                               atol=0, rtol=0)   # the k/v rows: one all-reduced gradient on every rank


@pytest.mark.parametrize("name", DP2_TP2)
def test_dp2_x_tp2_matches_single_device(launched, name):
    per_rank = launched(("dp2_tp2", name))
    losses, _, state, _ = _reference(name, 2)
    for r in (r for both in per_rank for r in both):
        assert r["losses"] == pytest.approx(losses, abs=LOSS_TOL)
        for key, value in state.items():
            torch.testing.assert_close(r["state"][key], value, atol=PARAM_TOL, rtol=0, msg=key)


def test_parallel_cross_entropy_ignore_index_and_label_smoothing(launched):
    results = launched("cross_entropy")
    model = helpers.tiny_gpt()
    x, y = helpers.token_batch(batch=4)
    y = y.clone()
    y[:, :5] = -100
    loss = tp_targets.smoothed_loss(model(x), y)
    loss.backward()
    for value, grads, shards, tp_rank, roles in results:
        assert "parallel_cross_entropy" in roles  # the logits were never gathered for the loss
        assert value == pytest.approx(loss.item(), abs=FIRST_LOSS_TOL)
        for name, p in model.named_parameters():
            expected = local_shard(p.grad, shards[name], tp_rank, 2) if name in shards else p.grad
            torch.testing.assert_close(grads[name], expected, atol=GRAD_TOL, rtol=0, msg=name)
