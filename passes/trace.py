"""trace: the user's nn.Module (and loss) -> one GraphModule in graphpar IR.

    before: (no graph)            model, example inputs, loss_fn
    after:  input_0, target = placeholders; fc_weight = get_attr[fc.weight]; ...
            return (loss, *flat_outputs)

Runs the front end chosen by compile(tracer=...): symbolic_trace, falling back to
torch.export, then normalises both into the IR (passes/tracing). The traced program's
input/output structure is left in ctx.results.program for the executor.
"""
from __future__ import annotations

from graphpar.passes.tracing import trace_program


def trace(gm, ctx):
    program = trace_program(
        ctx.model, ctx.example_inputs, loss_fn=ctx.loss_fn, example_target=ctx.example_target,
        with_loss=ctx.with_loss, front_end=ctx.options.tracer,
        leaf_modules=ctx.options.leaf_modules, dense_experts=ctx.strategy.splits_experts)
    ctx.results.program = program
    return program.gm
