"""docs/errors.md, Pass pipeline (passes/manager.py, passes/context.py, graphpar/ir/):
every entry triggered here and its message checked for the value it names, the rule
and the fix (tests/errors/test_catalogue.py checks that the doc and the cases agree)."""
from __future__ import annotations

import torch
import torch.fx

import graphpar as gp
from graphpar.frontend.compile import lower_rank
from graphpar.ir import record, stamp, tensor_meta
from graphpar.passes.manager import make_pass, register_pass, unregister_pass
from graphpar.ir.validate import GraphValidationError
from tests.errors.catalogue import entry_test, expect, expect_untouched, registrar
from tests.errors.models import Gate, WithSize, identity_pass, lower, mlp, mse_pm, x4


CASES = {}
case = registrar(CASES)


def compile_with_pass(fn):
    return gp.compile(mlp(), gp.Strategy(passes=(make_pass(fn, name="under_test", after="trace"),)), (x4(),))


@case("E-pass-duplicate")
def _():
    expect(ValueError, lambda: register_pass(name="trace")(identity_pass), r"register_pass\(name='trace'\)",
           "already in the pipeline", "Fix:")


@case("E-pass-unregister")
def _():
    expect(ValueError, lambda: unregister_pass("no_such_pass"), r"unregister_pass\('no_such_pass'\)",
           "no registered user pass", "Fix:")


@case("E-pass-both-anchors")
def _():
    expect(ValueError, lambda: make_pass(identity_pass, name="p", after="trace", before="split_stages"),
           "pass 'p': give after= or before=, not both", "Fix: keep one anchor")


@case("E-pass-not-callable")
def _():
    expect(TypeError, lambda: make_pass(3, name="p"), r"a pass must be callable fn\(gm, ctx\) -> gm, got 3", "Fix:")


@case("E-pass-before-trace")
def _():
    strategy = gp.Strategy(passes=(make_pass(identity_pass, name="p", before="trace"),))
    expect(ValueError, lambda: gp.list_passes(strategy), "pass 'p' is anchored before='trace'", "Fix:.*after='trace'")


@case("E-pass-unknown-anchor")
def _():
    strategy = gp.Strategy(passes=(make_pass(identity_pass, name="p", after="trcae"),))
    expect(ValueError, lambda: gp.list_passes(strategy), "pass 'p' is anchored after='trcae', which is not in the "
           "pipeline", "Fix:")


@case("E-pass-requires")
def _():
    strategy = gp.Strategy(passes=(make_pass(identity_pass, name="p", after="trace", requires=("stage_plan",)),))
    expect(ValueError, lambda: gp.list_passes(strategy), r"pass 'p' requires ctx.results.stage_plan",
           "'partition_stages' produces", "Fix: anchor 'p' after='partition_stages'")


@case("E-pass-declares")
def _():
    expect(ValueError, lambda: make_pass(identity_pass, name="p", produces=("tp_plans",)),
           "pass 'p': produces names 'tp_plans', which is neither a result field", "Fix:.*'tp_plan'")


@case("E-pass-result-missing")
def _():
    expect(KeyError, lambda: mse_pm().compiled.extra(Gate), "no pass left a result of type Gate", "Fix:")


@case("E-pass-import")
def _():
    expect(ValueError, lambda: gp.compile(mlp(), gp.Strategy(passes=("tests.no_such_module:fn",)), (x4(),)),
           "entry 'tests.no_such_module:fn' could not be imported", "Fix:")


@case("E-pass-return-type")
def _():
    expect(TypeError, lambda: compile_with_pass(lambda gm, ctx: None), "pass 'under_test' returned NoneType",
           "Fix:")


def _first_op(gm):
    return next(n for n in gm.graph.nodes if n.op == "call_function")


def _use_before_definition(gm, ctx):
    last = [n for n in gm.graph.nodes if n.op == "call_function"][-1]
    with gm.graph.inserting_before(_first_op(gm)):
        node = gm.graph.call_function(torch.neg, (last,))
    node.meta["graphpar"] = record(last)
    return gm


@case("E-graph-lint")
def _():
    expect(GraphValidationError, lambda: compile_with_pass(_use_before_definition),
           "after pass 'under_test': the graph fails torch.fx lint: Argument 'linear_1' of Node 'neg' was used before "
           "it has been defined", "Fix:")


def _untupled_output(gm, ctx):
    output = next(n for n in gm.graph.nodes if n.op == "output")
    output.args = (output.args[0][0],)
    return gm


@case("E-graph-output")
def _():
    expect(GraphValidationError, lambda: compile_with_pass(_untupled_output),
           "after pass 'under_test': the graph must end in one output returning a flat tuple", "Fix:")


def _no_record(gm, ctx):
    first = _first_op(gm)
    with gm.graph.inserting_after(first):
        gm.graph.call_function(torch.neg, (first,))
    return gm


@case("E-graph-no-record")
def _():
    expect(GraphValidationError, lambda: compile_with_pass(_no_record),
           r"after pass 'under_test': node 'neg' \(call_function neg\) has no graphpar record", "Fix:.*copy_record")


def _bad_stage(gm, ctx):
    first = _first_op(gm)
    first.meta["graphpar"] = record(first).replace("under_test", stage=-1)
    return gm


@case("E-graph-record-field")
def _():
    expect(GraphValidationError, lambda: compile_with_pass(_bad_stage), "has stage -1", "Fix:")


def _update_placement_on_an_op(gm, ctx):
    stamp(_first_op(gm), "under_test", update_placement="host")
    return gm


@case("E-graph-update-field")
def _():
    expect(GraphValidationError, lambda: compile_with_pass(_update_placement_on_an_op),
           r"after pass 'under_test': node .*has update_placement 'host' but is not the get_attr of a trainable "
           r"parameter", "Fix:")


def _step_without_bucket(gm, ctx):
    stamp(next(iter(ctx.results.update.graph.nodes)), "under_test", bucket=None)
    return gm


@case("E-graph-update-program")
def _():
    strategy = gp.Strategy(offload_optimizer=True,
                           passes=(make_pass(_step_without_bucket, name="under_test", after="build_update"),))
    expect(GraphValidationError, lambda: lower_rank(mlp(), strategy, (x4(),), rank=0, world_size=1),
           r"after pass 'under_test': node 'grads_0' \(call_module grads_0\) is a step with no bucket", "Fix:")


def _missing_attr(gm, ctx):
    first = _first_op(gm)
    with gm.graph.inserting_before(first):
        node = gm.graph.create_node("get_attr", "no_such_weight")
    node.meta["graphpar"] = record(first)
    return gm


@case("E-graph-missing-attr")
def _():
    expect(GraphValidationError, lambda: compile_with_pass(_missing_attr), "the graph fails torch.fx lint: "
           "Node no_such_weight target no_such_weight references nonexistent attribute", "Fix:.*get_attr target")


@case("E-ir-no-record")
def _():
    graph = torch.fx.Graph()
    node = graph.placeholder("x")
    expect(KeyError, lambda: record(node), "node 'x' \\(placeholder x\\) has no graphpar record", "Fix:.*copy_record")


@case("E-ir-not-tensor")
def _():
    gm = lower(WithSize(), gp.Strategy(), 1, tracer="fx").gm
    size = next(n for n in gm.graph.nodes if n.op in ("call_method", "call_function") and "size" in str(n.target))
    expect(TypeError, lambda: tensor_meta(size), f"node '{size.name}' is not a single tensor value: a non-tensor value such as an int",
           r"Fix: read record\(node\)\.value")


def raising_pass(gm, ctx):
    raise KeyError("no such node")


@case("E-pass-raised")
def _():
    from graphpar.passes.manager import UserPassError
    message = expect_untouched(UserPassError, lambda m: gp.compile(m, gp.Strategy(passes=(raising_pass,)), (x4(),)),
                               r"user pass 'raising_pass' \(tests\.errors\.test_pass_pipeline_errors\.raising_pass\) raised "
                               r"KeyError: 'no such node'", r"Fix: correct the pass.*unregister_pass\('raising_pass'\)")
    assert "leaf_modules" not in message


test_entry = entry_test(CASES)
