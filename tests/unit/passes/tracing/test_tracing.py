"""Both tracing front ends produce graphpar IR: records with shapes, dtypes and module paths."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import graphpar as gp
from graphpar.runtime import ops
from graphpar.ir import TensorMeta, record
from graphpar.passes.tracing import TraceError, trace_program
from tests.helpers import (hf_bert, hf_causal_lm_loss, hf_gpt2, hf_llama, lm_loss, tiny_gpt,
                           token_batch)


def _assert_ir(gm):
    for node in gm.graph.nodes:
        if node.op == "output":
            continue
        assert node.op != "placeholder" or node.name.startswith(("input_", "target"))
        rec = record(node)
        if node.op == "placeholder" or (node.op == "get_attr" and "." in str(node.target)):
            assert isinstance(rec.value, TensorMeta), node  # inputs, parameters and buffers
    linears = [n for n in gm.graph.nodes if n.op == "call_function" and "linear" in str(n.target)]
    return linears


def test_handwritten_gpt_traces_with_symbolic_trace():
    model = tiny_gpt()
    x, y = token_batch(batch=2)
    program = trace_program(model, (x,), loss_fn=lm_loss, example_target=y)
    assert program.front_end == "fx"
    assert program.has_loss
    gm = program.gm
    linears = _assert_ir(gm)
    # q, k, v, proj, fc, proj per block, plus the LM head: all lowered from nn.Linear
    assert len(linears) == 2 * 6 + 1
    q = next(n for n in linears if record(n).module_path == "blocks.0.attn.q")
    assert record(q).value == TensorMeta((2, 16, 32), torch.float32, requires_grad=True)
    assert record(q).module_type == "Linear"
    assert not any(n.op == "call_module" for n in gm.graph.nodes)
    attrs = {n.target for n in gm.graph.nodes if n.op == "get_attr"}
    assert "blocks.1.mlp.fc.weight" in attrs
    loss = next(iter(n for n in gm.graph.nodes if n.op == "output")).args[0][0]
    assert record(loss).value == TensorMeta((), torch.float32, requires_grad=True)


@pytest.mark.parametrize("build, module_type", [(hf_gpt2, "Conv1D"), (hf_llama, "Linear")])
def test_transformers_models_fall_back_to_export(build, module_type):
    model = build()
    x, y = token_batch(batch=2)
    # Any error will do (which one depends on the transformers version): that it fails at all
    # is the reason the export front end exists.
    with pytest.raises(Exception):  # noqa: B017
        torch.fx.symbolic_trace(model)
    program = trace_program(model, (x,), loss_fn=hf_causal_lm_loss, example_target=y)
    assert program.front_end == "export"
    _assert_ir(program.gm)
    types = {record(n).module_type for n in program.gm.graph.nodes if n.op == "call_function"}
    assert module_type in types
    # the output keeps the transformers output structure for pm(x)
    assert "logits" in str(program.out_spec)


def test_bert_traces_with_export():
    model = hf_bert()
    x, _ = token_batch(batch=2)
    program = trace_program(model, (x,), with_loss=False)
    assert program.front_end == "export" and not program.has_loss
    values = [record(n).value for n in program.gm.graph.nodes if n.op == "call_function"]
    assert TensorMeta((2, 16, 64), torch.float32, True) in values  # MLM logits


def test_forcing_a_front_end():
    model = tiny_gpt()
    x, y = token_batch(batch=2)
    assert trace_program(model, (x,), loss_fn=lm_loss, example_target=y, front_end="export").front_end == "export"
    with pytest.raises(TraceError, match="fx"):
        trace_program(hf_gpt2(), (x,), loss_fn=hf_causal_lm_loss, example_target=y, front_end="fx")
    with pytest.raises(ValueError, match="tracer='jit'.*auto"):
        trace_program(model, (x,), front_end="jit")


class _DataDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.odd = _Branchy()

    def forward(self, x):
        return self.odd(self.fc(x))


class _Branchy(nn.Module):
    def forward(self, x):
        if x.sum() > 0:  # control flow on a tensor value: symbolic_trace cannot follow it
            return x * 2
        return x


def test_leaf_modules_keep_a_module_opaque():
    model = _DataDependent()
    x = torch.randn(3, 4)
    program = trace_program(model, (x,), front_end="fx", leaf_modules=["odd"], with_loss=False)
    calls = [n for n in program.gm.graph.nodes if n.op == "call_module"]
    assert [n.target for n in calls] == ["odd"]
    assert record(calls[0]).value == TensorMeta((3, 4), torch.float32, True)
    with pytest.raises(TraceError, match="leaf"):
        trace_program(model, (x,), front_end="fx", with_loss=False)


@pytest.mark.parametrize("front_end", ["fx", "export"])
def test_mode_dependent_ops_are_canonical_and_tracing_leaves_buffers_alone(front_end):
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Dropout(0.5),
                          nn.Flatten(), nn.Linear(4 * 6 * 6, 5))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x, y = torch.randn(2, 3, 8, 8), torch.randint(0, 5, (2,))
    program = trace_program(model, (x,), loss_fn=F.cross_entropy, example_target=y, front_end=front_end)
    targets = [n.target for n in program.gm.graph.nodes if n.op == "call_function"]
    assert ops.dropout in targets and ops.batch_norm in targets and ops.count_batch in targets
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), f"tracing changed {key}"


def test_meta_device_model_traces_without_memory():
    with torch.device("meta"):
        model = tiny_gpt(n_embd=1024, n_layer=4, vocab_size=50000)
    x, y = token_batch(batch=2)
    program = trace_program(model, (x,), loss_fn=lm_loss, example_target=y)
    head = next(n for n in program.gm.graph.nodes if record(n).module_path == "lm_head" and n.op == "call_function")
    assert record(head).value.shape == (2, 16, 50000)


@pytest.mark.parametrize("front_end", ["fx", "export"])
def test_evaluation_needs_no_target_when_the_loss_broadcasts(front_end):
    """export spells F.mse_loss as broadcast_tensors([output, target]) then the loss, and
    returned the model's output through the broadcast, so pm(x) asked for the target."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    x, y = torch.randn(4, 4), torch.randn(4, 2)
    pm = gp.compile(model, gp.Strategy(), (x,), loss_fn=F.mse_loss, example_target=y, tracer=front_end)
    assert pm.front_end == front_end
    with torch.no_grad():
        torch.testing.assert_close(pm(x), model(x), rtol=0, atol=0)  # the same ops on the same weights
    assert pm.train_step(x, target=y) == F.mse_loss(model(x), y).item()
