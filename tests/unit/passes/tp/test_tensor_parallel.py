"""Tensor parallelism in one process: sizes tp does not divide are clear errors, which linears
stay replicated, strict mode, the reshape rule. Parity on gloo:
tests/multiprocess/passes/tp/test_tensor_parallel.py."""

import pytest
import torch

import graphpar as gp
from graphpar.frontend.compile import lower_rank
from graphpar.ir import Shard, record
from graphpar.ir.layout import local_shard
from graphpar.passes.tp.rules import DivisibilityError, reshape_rule
from tests import helpers


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
