"""The planner's numbers against what real runs hold and send."""
import importlib

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

import graphpar as gp
from graphpar.runtime import ops
from graphpar.runtime.single_stage import loss_only
from graphpar.distributed.launch import launch
from tests import helpers, plan_targets, pp_targets

CASES = [("gpt", dict(tp=2, pp=2, microbatches=2)),          # tp + pp + tied weights
         ("hf_gpt2", dict(dp=2, pp=2, microbatches=4)),      # several tensors crossing a cut
         ("bn_cnn", dict(dp=2))]                             # SyncBatchNorm statistics


def _planned(report, rank):
    totals = {}
    for t in report.ranks[rank].collectives:
        op = {"all_reduce": "all_reduce", "send": "isend", "recv": "irecv"}[t.op]
        entry = totals.setdefault(op, [0, 0])
        entry[0] += t.bytes
        entry[1] += t.count
    return totals


@pytest.mark.parametrize("name, degrees", CASES, ids=[c[0] for c in CASES])
def test_bytes_and_transfers_are_exact(name, degrees):
    strategy = gp.Strategy(**degrees)
    model, loss_fn = pp_targets.build(name, strategy.tp)
    x, y = pp_targets.data(name, 8)
    local = 8 // strategy.dp
    report = gp.plan(model, strategy, (x[:local],), loss_fn=loss_fn, optimizer=helpers.adamw(),
                     example_target=y[:local], bucket_bytes=4096)
    measured = launch(plan_targets.measure, world_size=strategy.world_size, args=(name, strategy.to_dict()))
    for m in measured:
        planned = report.ranks[m["rank"]]
        assert (planned.param_bytes, planned.grad_bytes, planned.optimizer_bytes) == \
            (m["param_bytes"], m["grad_bytes"], m["optimizer_bytes"])
        # every all-reduce, send and receive of a training step, in bytes and calls
        assert _planned(report, m["rank"]) == m["counts"]


def _measured_saved_bytes(pm, x, y):
    """Bytes autograd really saves in one forward (unique storages, parameters excluded)."""
    gm = loss_only(pm.graph_modules[0])
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
    page = report.to_html(str(tmp_path / "plan.html"))
    assert "<pre>" in open(page).read()


def test_repeated_blocks_share_one_analysis(monkeypatch):
    """Planning a 6-block model through a 2-block surrogate gives exactly the full analysis."""
    plan_module = importlib.import_module("graphpar.planner.plan")  # graphpar.plan is the function
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
    assert middle.optimizer_bytes == 2 * middle.param_bytes  # AdamW: exp_avg and exp_avg_sq
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
