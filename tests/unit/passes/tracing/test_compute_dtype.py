"""param_dtype on models only torch.export traces: the casts export fixed to float32 take
their dtypes from a trace in the compute dtype (passes/tracing/compute_dtype.py), so the
program computes as model.to(param_dtype) does, bit for bit on one process."""
import copy

import pytest
import torch

import graphpar as gp
from graphpar.passes.tracing.compute_dtype import float_checks
from tests import helpers
from tests.targets.ep_targets import moe_model

BUILDERS = {"llama": helpers.hf_llama, "gpt2": helpers.hf_gpt2, "mixtral": lambda: moe_model("mixtral")}


@pytest.mark.parametrize("arch", sorted(BUILDERS))
def test_program_computes_as_the_model_cast_to_bf16(arch):
    model = BUILDERS[arch]()
    x, y = helpers.token_batch(batch=4)
    pm = gp.compile(copy.deepcopy(model), gp.Strategy(param_dtype="bf16"), example_inputs=(x,),
                    loss_fn=helpers.hf_causal_lm_loss, example_target=y)
    eager = helpers.low_precision_copy(model, torch.bfloat16)
    # LLaMA's RMSNorm upcasts to float32 and casts back to its input's dtype, and its residual
    # adds the uncast input; GPT-2 casts its position embeddings to the device: with the
    # float32 trace's casts the logits differ by a bf16 step (0.002), so equality is the test.
    # Mixtral's grouped experts branch on the device (a float copy of the expert ids for histc
    # on CPU, an int one elsewhere): the trace in bf16 must take the CPU branch the program took
    assert torch.equal(pm(x).logits, eager(x).logits)
    assert not any(float_checks(gm) for gm in pm.graph_modules), "export's float32 checks were dropped"

