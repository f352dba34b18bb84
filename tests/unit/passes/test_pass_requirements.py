"""What passes declare (requires / produces), checked before anything runs; the built-in
pass list; and the frozen per-rank hand-off the runtime receives."""
import dataclasses

import pytest
import torch

import graphpar as gp
from graphpar.ir.compiled import CompiledRank
from graphpar.passes.builtin import default_passes
from graphpar.passes.manager import check_requirements
from tests.helpers import lm_loss, tiny_gpt, token_batch


def _reads_stage_plan(gm, ctx):
    return gm


@dataclasses.dataclass(frozen=True)
class Found:
    count: int


def _puts_found(gm, ctx):
    ctx.results.put(Found(len(gm.graph.nodes)))
    return gm


def _gets_found(gm, ctx):
    assert ctx.results.get(Found).count > 0
    return gm


def test_default_passes_are_the_pipeline_and_satisfy_their_own_requirements():
    passes = default_passes(gp.Strategy())
    assert [p.name for p in passes] == gp.list_passes(gp.Strategy())
    assert check_requirements(passes) == passes
    assert dict((p.name, p.produces) for p in passes)["partition_stages"] == ("stage_plan", "record.stage")


def test_a_user_pass_needing_a_result_produced_later_is_refused_naming_both():
    early = gp.Pass("count_stages", _reads_stage_plan, after="trace", requires=("stage_plan",))
    with pytest.raises(ValueError, match=r"pass 'count_stages' requires ctx.results.stage_plan \('stage_plan'\), "
                                         r"which 'partition_stages' produces, but 'partition_stages' runs after "
                                         r"'count_stages'.*Fix: anchor 'count_stages' after='partition_stages'"):
        gp.list_passes(gp.Strategy(passes=(early,)))
    late = dataclasses.replace(early, after="partition_stages")
    assert gp.list_passes(gp.Strategy(passes=(late,)))[8:10] == ["partition_stages", "count_stages"]


def test_register_pass_refuses_a_requirement_produced_later_and_registers_nothing():
    before = gp.list_passes()
    with pytest.raises(ValueError, match=r"'early_stages' requires the record field 'stage' \('record.stage'\), "
                                         r"which 'partition_stages' produces"):
        gp.register_pass(name="early_stages", after="trace", requires=("record.stage",))(_reads_stage_plan)
    assert gp.list_passes() == before


def test_a_requirement_nothing_produces_and_an_unknown_name_are_refused():
    reader = gp.Pass("reader", _gets_found, after="trace", requires=(Found,))
    with pytest.raises(ValueError, match=r"'reader' requires a Found result .*which no pass before it produces, "
                                         r"and none after"):
        gp.list_passes(gp.Strategy(passes=(reader,)))
    with pytest.raises(ValueError, match=r"requires names 'stage_plans', which is neither a result field.*"
                                         r"'stage_plan'"):
        gp.Pass("typo", _reads_stage_plan, requires=("stage_plans",))
    with pytest.raises(TypeError, match=r"requires='program' is a string.*Fix: requires=\('program',\)"):
        gp.Pass("bare", _reads_stage_plan, requires="program")


def test_a_user_result_put_by_one_pass_is_read_by_a_later_one_and_reaches_the_hand_off():
    writer = gp.Pass("writer", _puts_found, after="trace", produces=(Found,))
    reader = gp.Pass("reader", _gets_found, after="writer", requires=(Found,))
    x, y = token_batch(batch=2)
    pm = gp.compile(tiny_gpt(), gp.Strategy(passes=(writer, reader)), example_inputs=(x,), example_target=y,
                    loss_fn=lm_loss)
    assert pm.compiled.extra(Found).count > 10
    with pytest.raises(KeyError, match=r"no pass left a result of type Compiled"):
        pm.compiled.extra(CompiledRank)


def test_the_hand_off_is_frozen():
    x, y = token_batch(batch=2)
    pm = gp.compile(tiny_gpt(), gp.Strategy(), example_inputs=(x,), example_target=y, loss_fn=lm_loss)
    compiled = pm.compiled
    assert isinstance(compiled, CompiledRank) and compiled.program.has_loss and not compiled.stages
    with pytest.raises(dataclasses.FrozenInstanceError):
        compiled.update = torch.nn.Module()
    with pytest.raises(TypeError):
        compiled.param_shards["wte.weight"] = None
    with pytest.raises(dataclasses.FrozenInstanceError):
        compiled.program.has_loss = False
    assert isinstance(compiled.input_names, tuple)
