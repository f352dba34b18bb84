"""Tensor parallelism on gloo against single-device training from the same state_dict."""
import re

import pytest
import torch

import graphpar as gp
from graphpar.frontend.compile import lower_rank
from graphpar.ir import Shard, record
from graphpar.distributed.launch import launch
from graphpar.ir.layout import local_shard
from graphpar.passes.tp.rules import DivisibilityError, reshape_rule
from tests import helpers
from tests.targets import tp_targets

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
def test_tp_matches_single_device(name, tp):
    """Compiled with and without example_target (API.md: the same program either way)."""
    per_rank = launch(tp_targets.train_tp_with_and_without_target, world_size=tp, args=(name, STEPS))
    for results in zip(*per_rank):
        check_parity(results, _reference(name, tp), tp)
        assert any(r["shards"] for r in results)  # something really was sharded


@pytest.mark.parametrize("name", ["hf_falcon", "hf_falcon_old", "hf_gptj", "hf_bloom"])
def test_transformers_layouts_split_attention_and_mlp(name):
    """Layouts the solver once left whole: Falcon's one query_key_value traced as `x @ w.T`
    (rows per kv group [its q heads, k, v]; the old layout per head [q, k, v]), GPT-J's
    rotary (interleaved with stack) and BLOOM's attention over batch x heads merged in one
    dim, with the alibi bias each rank slices from the replicated one. Each rank holds half of every attention and MLP weight
    (Falcon: whole kv groups) and trains like one device (fused qkv + grouped kv heads is
    where DeepSpeed AutoTP went silently wrong)."""
    tp = 2
    results = launch(tp_targets.train_tp, world_size=tp, args=(name, STEPS))
    reference = _reference(name, tp)
    check_parity(results, reference, tp)
    full = reference[2]
    projections = [k for k in full if re.search(r"\.(self_attention|attn|mlp)\.\w+\.weight$", k)]
    assert len(projections) >= 4 * 2   # at least qkv, out, up, down in each of the 2 layers
    for r in results:
        for key in projections:
            assert r["grads"][key].numel() * tp == full[key].numel(), key


def test_collectives_per_block_and_parameter_bytes():
    tp, layers = 2, 2
    results = launch(tp_targets.train_tp, world_size=tp, args=("gpt", 1))
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


def _lower(model, tp, loss_fn=helpers.lm_loss, **kwargs):
    x, y = helpers.token_batch(batch=2, vocab=model_vocab(model))
    return lower_rank(model, gp.Strategy(tp=tp), (x,), rank=0, world_size=tp, loss_fn=loss_fn,
                      example_target=y, **kwargs)


def model_vocab(model):
    return model.wte.weight.shape[0] if hasattr(model, "wte") else 64


@pytest.mark.parametrize("overrides, message", [
    (dict(n_embd=48, n_head=6), r"tp=4 does not divide the number of heads \(a reshaped dim\)=6 at blocks.0.attn"),
    (dict(n_head=8, n_kv_head=2), r"tp=4 does not divide the number of heads \(a reshaped dim\)=2 at blocks.0.attn"),
    (dict(vocab_size=62), r"tp=4 does not divide out_features=62 at lm_head"),
])
def test_sizes_tp_does_not_divide_are_clear_errors(overrides, message):
    with pytest.raises(DivisibilityError, match=message) as err:
        _lower(helpers.tiny_gpt(**overrides), 4)
    assert "Fix: use a tp that divides" in str(err.value)


def test_kv_groups_tp_does_not_divide_is_a_clear_error():
    model = helpers.hf_model("falcon")   # 2 kv groups in the fused query_key_value
    with pytest.raises(DivisibilityError, match=r"tp=4 does not divide the number of heads \(a reshaped dim\)=2 "
                                                r"at transformer.h.0.self_attention"):
        _lower(model, 4, loss_fn=helpers.hf_causal_lm_loss)


# The linears tensor parallelism may leave whole: a masked-LM head's transform feeds a
# LayerNorm over the full hidden size (Megatron keeps it replicated too). Never an attention
# or MLP projection.
HEAD_TRANSFORMS = {"bert": ["cls.predictions.transform.dense"], "roberta": ["lm_head.dense"],
                   "electra": ["generator_predictions.dense"], "distilbert": ["vocab_transform"]}


def _linear_modules(model):
    return [path for path, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) or type(m).__name__ == "Conv1D"]   # Conv1D: GPT-2's


@pytest.mark.parametrize("arch", helpers.HF_ARCHITECTURES)
def test_replicated_linears_are_at_most_head_transforms(arch):
    model = helpers.hf_model(arch)
    result = _lower(model, 2, loss_fn=helpers.hf_causal_lm_loss, until="annotate_shards", snapshots=False)
    plan = result.ctx.results.tp_plan
    replicated = [module for module, _ in plan.replicated_linears]
    assert replicated == HEAD_TRANSFORMS.get(arch, []), plan.replicated_linears
    split = {record(n).module_path for n in result.gm.graph.nodes if plan.roles.get(n.name) in ("column", "row")}
    assert set(_linear_modules(model)) == split | set(replicated)   # every linear is listed one way or the other


def test_multi_query_falcon_splits_its_q_heads_and_keeps_the_kv_head_whole():
    """Falcon-7B's layout: one k/v head, shared by every q head, fused with the q heads in
    query_key_value. Megatron's layout for tp > kv heads: each rank holds half of the q rows
    and the whole k/v rows (S(0|32,R8,R8)), dense is row-parallel; nothing is left whole,
    and training matches one device (the k/v rows' gradient summed over tp, whole on every rank)."""
    tp = 2
    model, loss_fn = tp_targets.build("hf_falcon_mq", tp)
    plan = _lower(model, tp, loss_fn=loss_fn, until="annotate_shards", snapshots=False).ctx.results.tp_plan
    assert plan.replicated_linears == [] and plan.fallbacks == []
    results = launch(tp_targets.train_tp, world_size=tp, args=("hf_falcon_mq", STEPS))
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


class _MLP(torch.nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.up = torch.nn.Linear(8, hidden)
        self.down = torch.nn.Linear(hidden, 8)

    def forward(self, x):
        return self.down(torch.nn.functional.gelu(self.up(x)))


def test_hidden_size_tp_does_not_divide_is_a_clear_error():
    x = torch.randn(4, 8)
    with pytest.raises(DivisibilityError, match=r"tp=4 does not divide in_features=30 at down \(linear_1\).*one of \[1, 2, 3, 5, 6, 10, 15, 30\]"):
        lower_rank(_MLP(30), gp.Strategy(tp=4), (x,), rank=0, world_size=4,
                   loss_fn=torch.nn.functional.mse_loss, example_target=torch.randn(4, 8))
    result = lower_rank(_MLP(32), gp.Strategy(tp=4), (x,), rank=0, world_size=4,
                        loss_fn=torch.nn.functional.mse_loss, example_target=torch.randn(4, 8))
    assert result.ctx.results.tp_plan.roles == {"linear": "column", "linear_1": "row"}


class _CumsumMLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(8, 16)
        self.down = torch.nn.Linear(16, 8)

    def forward(self, x):
        return self.down(torch.cumsum(self.up(x), dim=-1))


def test_strict_mode_refuses_an_op_without_a_rule():
    x = torch.randn(4, 8)
    loss = torch.nn.functional.mse_loss
    result = lower_rank(_CumsumMLP(), gp.Strategy(tp=2), (x,), rank=0, world_size=2, loss_fn=loss,
                        example_target=torch.randn(4, 8))
    plan = result.ctx.results.tp_plan
    assert [module for _, module, _ in plan.fallbacks] == ["up", "down"]  # reported, replicated
    with pytest.raises(ValueError, match=r"(?s)strict=True, tp=2.*up \(linear\): no sharding rule for cumsum at <top> \(cumsum\)"):
        lower_rank(_CumsumMLP(), gp.Strategy(tp=2, strict=True), (x,), rank=0, world_size=2,
                   loss_fn=loss, example_target=torch.randn(4, 8))


def test_plan_reports_the_replicated_linears():
    report = gp.plan(_CumsumMLP(), gp.Strategy(tp=2), example_inputs=(torch.randn(4, 8),),
                     loss_fn=torch.nn.functional.mse_loss, world_size=2)
    # down's region (column parallel, gathered at the output) needs no rule for cumsum
    assert report.replicated_linears == [("up", "no sharding rule for cumsum at <top> (cumsum)")]
    assert "linears left whole (replicated): up" in report.to_text()


@pytest.mark.parametrize("name", ["gpt", "hf_llama"])
def test_dp2_x_tp2_matches_single_device(name):
    per_rank = launch(tp_targets.train_tp_with_and_without_target, world_size=4, args=(name, STEPS, 2))
    losses, _, state, _ = _reference(name, 2)
    for r in (r for both in per_rank for r in both):
        assert r["losses"] == pytest.approx(losses, abs=LOSS_TOL)
        for key, value in state.items():
            torch.testing.assert_close(r["state"][key], value, atol=PARAM_TOL, rtol=0, msg=key)


def test_parallel_cross_entropy_ignore_index_and_label_smoothing():
    results = launch(tp_targets.cross_entropy_options, world_size=2)
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


@pytest.mark.parametrize("in_shape, spec, out_shape", [
    ((2, 4, 16, 8), Shard(1), (8, 16, 8)),                  # BLOOM: [b, h] heads merged into b*h
    ((8, 16, 16), Shard(0, (4, 4)), (2, 4, 16, 16)),         # and split back
    ((2, 16, 96), Shard(2), (2, 16, 4, 3, 8)),               # per-head fused [h, 3, d]
    ((96, 2), Shard(0, (32, 32, 32)), (12, 8, 2)),           # fused q|k|v blocks into heads
    ((3, 4, 6), Shard(1), (72,)),                            # heads between two merged dims
])
def test_reshape_keeps_each_ranks_elements(in_shape, spec, out_shape):
    """The rule's output spec names, on every rank, the same elements as its input spec:
    rank r's shard of the reshaped tensor is its shard of the input, reshaped locally."""
    tp = 2
    full = torch.arange(torch.Size(in_shape).numel()).reshape(in_shape)
    out_spec = reshape_rule(None, spec, in_shape, out_shape, tp)
    local_out = list(out_shape)
    local_out[out_spec.dim] //= tp
    for rank in range(tp):
        expected = local_shard(full, spec, rank, tp).reshape(local_out)
        assert torch.equal(local_shard(full.reshape(out_shape), out_spec, rank, tp), expected), (rank, out_spec)
