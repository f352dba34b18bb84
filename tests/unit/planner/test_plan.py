"""The planner's numbers against what the lowering holds, in one process (the comparison with
instrumented real runs: tests/multiprocess/planner/test_plan.py)."""
import cProfile
import functools
import gc
import html
import importlib
import pstats
import xml.etree.ElementTree as ET

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

import graphpar as gp
from graphpar.runtime import ops
from graphpar.frontend.compile import lower_rank
from graphpar.runtime.single_stage import loss_only
from tests import helpers
from tests.targets import pp_targets


def _measured_saved_bytes(pm, x, y):
    """Bytes autograd really saves in one forward (unique storages, parameters excluded)."""
    gm = loss_only(pm.graph_modules[0], 1)   # a mean loss: one loss output
    params = {StorageWeakRef(p.untyped_storage()) for p in gm.parameters()}
    saved = {}

    def pack(t):
        ref = StorageWeakRef(t.untyped_storage())
        if ref not in params:
            saved[ref] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), ops.mode(training=True):
        gm(x, y)[0].backward()
    return sum(saved.values())


@pytest.mark.parametrize("name", ["gpt", "bn_cnn", "hf_llama"])
def test_activation_estimate_within_10_percent_of_measured(name):
    model, loss_fn = pp_targets.build(name)
    x, y = pp_targets.data(name, 8)
    pm = gp.compile(model, gp.Strategy(), example_inputs=(x,), example_target=y, loss_fn=loss_fn)
    report = pm.report()
    measured = _measured_saved_bytes(pm, x, y)
    # measured: saved_tensors_hooks on a real forward of the compiled program
    assert report.ranks[0].activation_peak_bytes == pytest.approx(measured, rel=0.10)


def _megatron_sharded(name: str) -> bool:
    """What Megatron shards in this GPT: the vocabulary, every linear weight, column biases."""
    if name == "wte.weight" or name.endswith(".weight") and (".attn." in name or ".mlp." in name):
        return True
    return name.endswith(("q.bias", "k.bias", "v.bias", "fc.bias"))


def test_sharded_weights_take_one_tp_th():
    model, loss_fn = pp_targets.build("gpt")
    x, y = pp_targets.data("gpt", 8)
    report = gp.plan(model, gp.Strategy(tp=4), (x,), loss_fn=loss_fn, example_target=y)
    params = dict(model.named_parameters())
    sharded = sum(p.numel() * 4 for n, p in params.items() if _megatron_sharded(n))
    replicated = sum(p.numel() * 4 for n, p in params.items() if not _megatron_sharded(n))
    assert report.ranks[0].param_bytes == sharded // 4 + replicated
    assert report.ranks[0].optimizer_bytes == 0  # no optimizer given: no states


def test_report_formats(tmp_path):
    model, loss_fn = pp_targets.build("gpt")
    x, y = pp_targets.data("gpt", 8)
    report = gp.plan(model, gp.Strategy(dp=2, pp=2, microbatches=4), (x[:4],), loss_fn=loss_fn,
                     example_target=y[:4], optimizer=helpers.adamw())
    assert report.bubble_fraction == pytest.approx(1 / 5)  # (p-1)/(m+p-1) for 1F1B
    assert '"world_size": 4' in report.to_json()
    assert "| rank |" in report.to_text()
    page = open(report.to_html(str(tmp_path / "plan.html"))).read()
    svg = ET.fromstring(page[page.index("<svg"):page.index("</svg>") + len("</svg>")])
    bars = [r for r in svg.iter("{http://www.w3.org/2000/svg}rect") if not r.get("class").startswith("legend")]
    roles = report.distinct_ranks()
    assert [r.pp_rank for r in roles] == [0, 1]  # dp ranks share a plan: one bar per pp rank
    for role, y in zip(roles, sorted({float(b.get("y")) for b in bars})):
        widths = {b.get("class"): float(b.get("width")) for b in bars if float(b.get("y")) == y}
        # segment widths are written with 2 decimals, on bars of 1000 px
        assert widths["params"] / widths["optimizer"] == pytest.approx(role.param_bytes / role.optimizer_bytes,
                                                                       rel=1e-3)
        assert f"<td class=n>{role.total_bytes / 2**20:.2f}</td>" in page
    for transfer in report.ranks[0].collectives:
        assert f"<td>{html.escape(transfer.what)}</td>" in page


def test_repeated_blocks_share_one_analysis(monkeypatch):
    """Planning a 6-block model through a 2-block surrogate gives exactly the full analysis."""
    plan_module = importlib.import_module("graphpar.planner.plan")
    model = helpers.tiny_gpt(n_layer=6)
    x, y = helpers.token_batch(batch=8)
    args = dict(loss_fn=helpers.lm_loss, optimizer=helpers.adamw(), example_target=y[:4], bucket_bytes=4096)
    strategy = gp.Strategy(dp=2, tp=2, pp=2, microbatches=2)
    assert plan_module.repeated_blocks(model)[0] == "blocks"
    shared = gp.plan(model, strategy, (x[:4],), **args)
    monkeypatch.setattr(plan_module, "repeated_blocks", lambda m: None)
    full = gp.plan(model, strategy, (x[:4],), **args)
    assert shared.ranks == full.ranks
    assert shared.partition == full.partition


@pytest.mark.parametrize("degrees", [dict(dp=2, tp=2, pp=2), dict(dp=3, pp=2)], ids=["2x2x2", "3x1x2"])
def test_every_rank_has_its_coordinates_and_the_parameters_its_own_lowering_holds(degrees):
    strategy = gp.Strategy(microbatches=2, **degrees)
    model, loss_fn = pp_targets.build("gpt")
    x, y = pp_targets.data("gpt", 4)
    report = gp.plan(model, strategy, (x,), loss_fn=loss_fn, example_target=y)
    dp, tp = strategy.dp, strategy.tp
    assert len(report.ranks) == strategy.world_size
    for rank, entry in enumerate(report.ranks):
        # Megatron's order written out: tp varies fastest, then dp, then pp
        assert (entry.rank, entry.tp_rank, entry.dp_rank, entry.pp_rank) == \
            (rank, rank % tp, rank // tp % dp, rank // (tp * dp))
        assert entry.stages == [entry.pp_rank]
        lowered = lower_rank(model, strategy, (x,), rank=rank, world_size=strategy.world_size, loss_fn=loss_fn,
                             example_target=y)
        assert entry.param_bytes == sum(p.numel() * p.element_size() for p in lowered.gm.parameters())


def _python_calls(fn) -> int:
    """Python function calls fn() makes: work counted, which unlike time on a shared
    machine is the same on every run. The garbage collector is held off while counting: in a
    long pytest process it otherwise runs finalizers of other tests' objects in the middle,
    and their calls land in the count."""
    gc.collect()
    gc.disable()
    try:
        profile = cProfile.Profile()
        profile.runcall(fn)
    finally:
        gc.enable()
    return pstats.Stats(profile).total_calls


def test_ranks_of_one_role_are_planned_once_and_work_per_rank_does_not_grow_with_the_world(monkeypatch):
    plan_module = importlib.import_module("graphpar.planner.plan")
    model, loss_fn = pp_targets.build("gpt")
    x, y = pp_targets.data("gpt", 4)
    strategy = lambda dp: gp.Strategy(dp=dp, tp=2, pp=2, microbatches=2)  # noqa: E731
    analysis = plan_module.unit_analysis(model, strategy(1), (x,), loss_fn, y, 4, {})
    roles = []
    role_plan = plan_module._rank_plan
    monkeypatch.setattr(plan_module, "_rank_plan", lambda *args: roles.append(args[3]) or role_plan(*args))

    def calls_per_added_rank(dp):  # from a world of 4 * dp ranks to one of 8 * dp
        worlds = [plan_module.report_from(analysis, model, strategy(d), 4 * d, None, {}) for d in (dp, 2 * dp)]
        assert [len(report.ranks) for report in worlds] == [4 * dp, 8 * dp]
        calls = [_python_calls(functools.partial(plan_module.report_from, analysis, model, strategy(d), 4 * d, None, {}))
                 for d in (dp, 2 * dp)]
        return (calls[1] - calls[0]) / (4 * dp)

    small, large = calls_per_added_rank(64), calls_per_added_rank(1024)
    # Each rank costs the same few calls (its coordinates, its entry) in any world, so the
    # counts are equal; listing each rank's groups (dp + tp + pp ranks) made 15x more here.
    # 1% of slack: a stray call or two from the interpreter (a cache refill) is not growth,
    # and the regression this guards against is a 15x jump.
    assert large <= small * 1.01, (small, large)
    assert set(roles) == {0, 1} and len(roles) == 2 * 8  # once per pipeline rank in each of the 8 plans


def _llama_on_meta(layers):
    transformers = pytest.importorskip("transformers", reason="transformers is in the test extra")
    config = transformers.LlamaConfig(num_hidden_layers=layers, hidden_size=8192, intermediate_size=28672,
                                      num_attention_heads=64, num_key_value_heads=8, vocab_size=32000,
                                      max_position_embeddings=4096, use_cache=False)
    with torch.device("meta"):
        return transformers.LlamaForCausalLM(config)


def test_a_70b_llama_on_1024_ranks_plans_on_meta():
    """Timed in benchmarks/bench_planning.py (under 30 s here); this checks the numbers."""
    model = _llama_on_meta(80)
    x = torch.zeros(16, 4096, dtype=torch.long)  # a DP-local batch: 16 microbatches of 1
    report = gp.plan(model, gp.Strategy(dp=8, tp=8, pp=16, microbatches=16), (x,),
                     loss_fn=helpers.hf_causal_lm_loss, example_target=x, optimizer=helpers.adamw(),
                     world_size=1024)
    assert len(report.ranks) == 1024
    total = sum(p.numel() for p in model.parameters())   # ~69e9
    middle = report.ranks[8 * 64]                        # pp rank 8: only decoder layers
    weights = list(model.model.layers[0].parameters())
    # fp32; linear weights split over tp=8, the two RMSNorm weights replicated
    layer_bytes = sum(p.numel() * 4 // 8 if p.dim() == 2 else p.numel() * 4 for p in weights)
    layers = middle.param_bytes // layer_bytes
    assert 4 <= layers <= 6 and middle.param_bytes == layers * layer_bytes
    # AdamW: exp_avg and exp_avg_sq, and a 4-byte step per tensor (9 per decoder layer)
    assert middle.optimizer_bytes == 2 * middle.param_bytes + 4 * len(weights) * layers
    assert sum(r.param_bytes for r in report.ranks if r.dp_rank == 0) * 1 == pytest.approx(total * 4, rel=0.01)


def test_planning_leaves_the_model_untouched_while_it_runs(monkeypatch):
    """The repeated-block surrogate is a copy: during the analysis the user's model still has
    every block (another thread may be training it)."""
    plan_module = importlib.import_module("graphpar.planner.plan")
    model = helpers.tiny_gpt(n_layer=6)
    seen = []
    lower_rank = plan_module.lower_rank

    def watching(traced, *args, **kwargs):
        seen.append((len(model.blocks), len(traced.blocks)))
        return lower_rank(traced, *args, **kwargs)
    monkeypatch.setattr(plan_module, "lower_rank", watching)
    x, y = helpers.token_batch(batch=8)
    gp.plan(model, gp.Strategy(), example_inputs=(x,), example_target=y, loss_fn=helpers.lm_loss)
    assert seen == [(6, 2)]
