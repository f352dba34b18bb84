"""trace: the user's nn.Module (and loss) -> one GraphModule in graphpar IR.

    before: (no graph)            model, example inputs, loss_fn
    after:  input_0, target = placeholders; fc_weight = get_attr[fc.weight]; ...
            return (loss, *flat_outputs)

Runs the front end chosen by compile(tracer=...): symbolic_trace, falling back to
torch.export, then normalises both into the IR (passes/tracing). The traced program's
input/output structure is left in ctx.notes["program"] for the executor.
"""
from __future__ import annotations

from graphpar.passes.manager import builtin_pass
from graphpar.passes.tracing import trace_program


@builtin_pass("trace")
def trace(gm, ctx):
    program = trace_program(
        ctx.model, ctx.example_inputs, loss_fn=ctx.loss_fn, example_target=ctx.example_target,
        with_loss=ctx.with_loss, front_end=ctx.options.get("tracer", "auto"),
        leaf_modules=ctx.options.get("leaf_modules", ()))
    ctx.notes["program"] = program
    return program.gm
