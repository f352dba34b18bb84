"""The pass pipeline: ordering, user passes, the validator between passes, dumps."""
import ast
import json
import os

import pytest
import torch

import graphpar as gp
from graphpar.passes.manager import make_pass
from graphpar.ir.validate import GraphValidationError
from tests.targets import user_passes
from tests.helpers import adamw, lm_loss, tiny_gpt, token_batch


def _compile(strategy=None, **kwargs):
    x, y = token_batch(batch=2)
    return gp.compile(tiny_gpt(), strategy or gp.Strategy(), example_inputs=(x,), example_target=y,
                      loss_fn=lm_loss, optimizer=adamw(), **kwargs), x


def test_builtin_order():
    names = gp.list_passes()
    assert names[0] == "trace" and names[-5:] == ["cast_params", "recompute", "shard_parameters", "split_backward",
                                                  "split_stages"]
    assert names.index("place_on_host") < names.index("lower_to_rank") < names.index("lower_placement")


def test_registered_pass_runs_after_trace_and_changes_the_output():
    baseline, x = _compile()
    expected = baseline(x)
    gp.register_pass(name="double_logits", after="trace")(user_passes.double_logits)
    try:
        assert gp.list_passes()[:2] == ["trace", "double_logits"]
        pm, _ = _compile()
        torch.testing.assert_close(pm(x), 2 * expected)
        dumped = [name for name, _ in pm.compiled.snapshots]
        assert dumped[1] == "double_logits"
    finally:
        gp.unregister_pass("double_logits")
    assert "double_logits" not in gp.list_passes()


def test_strategy_passes_apply_to_one_compile_only():
    user_passes.SEEN.clear()
    strategy = gp.Strategy(passes=("tests.targets.user_passes:record_graph",))
    # unanchored: before the lowering for the pipeline
    assert gp.list_passes(strategy)[-3:] == ["record_graph", "split_backward", "split_stages"]
    _compile(strategy)
    assert len(user_passes.SEEN) == 1 and user_passes.SEEN[0] > 10
    _compile()
    assert len(user_passes.SEEN) == 1
    anchored = gp.Strategy(passes=(gp.Pass("record_graph", user_passes.record_graph, after="trace"),))
    assert gp.list_passes(anchored)[1] == "record_graph"


def test_validator_names_the_pass_that_drops_records():
    strategy = gp.Strategy(passes=(make_pass(user_passes.drop_records, name="buggy", after="trace"),))
    with pytest.raises(GraphValidationError, match=r"after pass 'buggy': node 'neg'.*no graphpar record"):
        _compile(strategy)


def test_pass_pipeline_errors():
    with pytest.raises(ValueError, match="anchored after='nope'.*trace"):
        gp.list_passes(gp.Strategy(passes=(gp.Pass("p", user_passes.record_graph, after="nope"),)))
    with pytest.raises(ValueError, match="must come first"):
        gp.list_passes(gp.Strategy(passes=(gp.Pass("p", user_passes.record_graph, before="trace"),)))
    with pytest.raises(ValueError, match="already in the pipeline"):
        gp.register_pass(name="trace")(user_passes.record_graph)

    def returns_none(gm, ctx):
        return None
    with pytest.raises(TypeError, match="'returns_none' returned NoneType"):
        _compile(gp.Strategy(passes=(returns_none,)))


def _check_dump_dir(directory, passes):
    rank_dir = os.path.join(directory, "rank0")
    files = sorted(os.listdir(rank_dir))
    for index, name in enumerate(passes):
        stem = f"{index:02d}_{name}"
        source = open(os.path.join(rank_dir, stem + ".py")).read()
        ast.parse(source)
        compile(source, stem, "exec")
        table = json.load(open(os.path.join(rank_dir, stem + ".json")))
        assert table["pass"] == name and table["nodes"]
        assert os.path.exists(os.path.join(rank_dir, stem + ".dot"))
    return files


def test_pm_dump_writes_every_pass(tmp_path):
    pm, _ = _compile()
    pm.dump(str(tmp_path))
    _check_dump_dir(str(tmp_path), gp.list_passes())
    source = open(tmp_path / "rank0" / "00_trace.py").read()
    assert "blocks.0.attn.q" in source and "f32[2, 16, 32]" in source


def test_dump_env_var(tmp_path, monkeypatch):
    monkeypatch.setenv("GRAPHPAR_DUMP", str(tmp_path))
    _compile()
    _check_dump_dir(str(tmp_path), gp.list_passes())
