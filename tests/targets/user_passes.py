"""Module-level passes for tests: Strategy(passes=...) entries must be importable by path."""
import torch

import graphpar.ir as ir

SEEN = []


def double_logits(gm, ctx):
    """Multiply the model's first output by 2: a visible change in pm(x)."""
    output = next(n for n in gm.graph.nodes if n.op == "output")
    values = list(output.args[0])
    index = 1 if ctx.results.program.has_loss else 0
    with gm.graph.inserting_before(output):
        doubled = gm.graph.call_function(torch.mul, (values[index], 2.0))
    ir.copy_record(values[index], doubled, "double_logits")
    values[index] = doubled
    output.args = (tuple(values),)
    return gm


def drop_records(gm, ctx):
    """A buggy pass: adds a node without a graphpar record."""
    output = next(n for n in gm.graph.nodes if n.op == "output")
    values = list(output.args[0])
    with gm.graph.inserting_before(output):
        values[-1] = gm.graph.call_function(torch.neg, (values[-1],))
    output.args = (tuple(values),)
    return gm


def record_graph(gm, ctx):
    SEEN.append(sum(1 for n in gm.graph.nodes if n.op == "call_function"))
    return gm
