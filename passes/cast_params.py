"""cast_params: low-precision compute weights for Strategy.param_dtype (bf16 or fp16).

The device copies of this rank's floating parameters and buffers become param_dtype (in
place: the same Parameter objects, so the update program's references stay valid; the
fp32 masters were taken by build_update before this), and floating inputs are cast on the
way in, so the whole program computes in param_dtype, as `model.to(param_dtype)` would.
The trained parameters' gradients accumulate in Strategy.gradient_dtype (fp32 unless
reduce_dtype says param_dtype): autograd casts each microbatch's gradient to it as it adds
it into p.grad (Tensor.grad_dtype), Megatron's fp32 main_grad without a second buffer, so
the dp reduction, the loss scaler's overflow check and the master step read fp32 sums:

    before: linear = linear(input_0, fc_weight, fc_bias)          # f32
    after:  input_0_cast = to(input_0, torch.bfloat16)
            linear = linear(input_0_cast, fc_weight, fc_bias)     # bf16

Every node's value metadata is then recomputed on fake tensors, so the pipeline's receive
buffers and the planner see the new dtypes.
"""
from __future__ import annotations

import torch
import torch.fx

from graphpar.runtime import ops
from graphpar.ir import has_record, record, set_record, value_from_example
from graphpar.passes.tracing.compute_dtype import adopt_compute_dtypes
from graphpar.passes.tracing.records import propagate_fake_values

PASS = "cast_params"


def _cast_state(gm: torch.fx.GraphModule, dtype: torch.dtype) -> None:
    with torch.no_grad():
        for tensor in [*gm.parameters(), *gm.buffers()]:
            if tensor.is_floating_point() and tensor.dtype != dtype:
                tensor.data = tensor.data.to(dtype)


def _cast_inputs(gm: torch.fx.GraphModule, dtype: torch.dtype) -> None:
    for node in [n for n in gm.graph.nodes if n.op == "placeholder"]:
        value = record(node).value
        if node.name == "target" or not (hasattr(value, "dtype") and value.dtype.is_floating_point):
            continue
        with gm.graph.inserting_after(node):
            cast = gm.graph.create_node("call_method", "to", (node, dtype), name=f"{node.name}_cast")
        # The callback runs inside this call, while `cast` is still this iteration's node.
        node.replace_all_uses_with(cast, delete_user_cb=lambda user: user is not cast)  # noqa: B023
        users = [record(u).stage for u in cast.users if has_record(u)]
        stages = [s for s in users if s is not None]
        set_record(cast, record(node).replace(PASS, stage=min(stages) if stages else None))


def grad_dtype_supported() -> bool:
    """Whether this torch lets a parameter's gradient have another dtype (recent releases)."""
    return hasattr(torch.Tensor, "grad_dtype")


def _check_grad_dtype(strategy) -> None:
    """Refused before anything is cast: gradients of another dtype than their parameter."""
    if strategy.gradient_dtype == strategy.param_dtype or grad_dtype_supported():
        return
    raise ValueError(
        f"Strategy(param_dtype={strategy.param_dtype}, reduce_dtype={strategy.reduce_dtype}) accumulates and "
        f"reduces the {strategy.param_dtype} weights' gradients in {strategy.gradient_dtype}, which needs autograd "
        f"to keep a gradient in another dtype than its parameter (Tensor.grad_dtype), which this torch "
        f"({torch.__version__}) lacks. Fix: upgrade torch to a release with Tensor.grad_dtype, or Strategy(reduce_dtype={strategy.param_dtype}) to "
        f"accumulate and reduce in the compute dtype.")


def _adopt_traced_casts(gm: torch.fx.GraphModule, ctx) -> None:
    """torch.export fixed the model's computed casts to float32: they take their dtypes from a
    trace in param_dtype (passes/tracing/compute_dtype.py), or the graph is refused before
    anything is cast."""
    strategy = ctx.strategy
    node = adopt_compute_dtypes(gm, ctx, strategy.param_dtype)
    if node is None:
        return
    where = (node.meta.get("stack_trace") or "").strip().splitlines()
    source = f" (from: {where[-1].strip()})" if where else ""
    raise ValueError(
        f"Strategy(param_dtype={strategy.param_dtype}) cannot compute this model in {strategy.param_dtype}: "
        f"torch.export traced it in float32 and fixed the dtypes of its casts (e.g. `x.to(input_dtype)` in a "
        f"norm), and the trace in {strategy.param_dtype} that says what they mean does not match the program at "
        f"node {node.name}{source}. Fix: "
        f"train without param_dtype, or cast the model yourself (model.to({strategy.param_dtype})) and compile "
        f"it without param_dtype (no fp32 master weights then).")


def _accumulate_grads_in(gm: torch.fx.GraphModule, dtype: torch.dtype) -> None:
    for p in gm.parameters():
        if p.requires_grad and p.dtype != dtype:
            p.grad_dtype = dtype


def _retype(gm: torch.fx.GraphModule, ctx) -> None:
    with ops.simulation(ctx.mesh), ops.mode(training=True):
        propagate_fake_values(gm, ctx.graph_inputs())
    for node in gm.graph.nodes:
        if node.op != "output" and "val" in node.meta:
            value = value_from_example(node.meta["val"])
            old = record(node).value
            if hasattr(old, "requires_grad") and hasattr(value, "requires_grad"):
                value = type(value)(value.shape, value.dtype, old.requires_grad)
            if value != old:  # only what the cast changed is re-recorded; the node keeps its author
                # (gp.verify blames the pass that last wrote a wrong node; the dtype is bookkeeping)
                set_record(node, record(node).replace(record(node).set_by, value=value))


def cast_params(gm: torch.fx.GraphModule, ctx) -> torch.fx.GraphModule:
    dtype = ctx.strategy.param_dtype
    if dtype is None or dtype == torch.float32:
        return gm
    _check_grad_dtype(ctx.strategy)
    _adopt_traced_casts(gm, ctx)
    _cast_state(gm, dtype)
    _accumulate_grads_in(gm, ctx.strategy.gradient_dtype)
    _cast_inputs(gm, dtype)
    gm.recompile()
    _retype(gm, ctx)
    return gm
