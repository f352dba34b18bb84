"""The schedules that split backward, zero-bubble (ZB-H1) and zbv, on gloo against eager
single-device training from the same state_dict: transformers GPT-2 (its LM head tied to the
token embedding) at pp=2 and pp=4 with 4 and 8 microbatches, and at dp2 x pp2; pm(x) after
training; and what ZB-H1 keeps in flight against 1F1B. Two launches, each running every case
of its world size (process start-up dominates these small runs)."""
import pytest
import torch

from graphpar.distributed.launch import launch
from tests import helpers
from tests.targets import pp_targets

STEPS = 3
# As in test_pipeline_parallel: microbatches and the weight gradients' own sums add float32
# rounding in another order (a tied weight's two uses are added before its .grad here, by
# autograd there); the parameters carry the AdamW noise bound explained in test_world_of_one.
LOSS_TOL = 1e-4
PARAM_TOL = 2e-4
OUT_TOL = 1e-4

SPLIT = [("zero-bubble", 1), ("zbv", 2)]
# pp=4: four blocks, so that zbv's eight stages each get a unit; ZB-H1 and its 1F1B baseline
# cut them uniformly (a block per stage), as the memory comparison below needs
PP2 = [dict(name="hf_gpt2", pp=2, microbatches=m, schedule=s, virtual=v) for s, v in SPLIT for m in (4, 8)]
PP4 = [dict(name="hf_gpt2", pp=4, microbatches=m, schedule=s, virtual=v, layers=4,
            partition="uniform" if s == "zero-bubble" else "parameters") for s, v in SPLIT for m in (4, 8)]
# dp2 x pp2, small buckets: several per stage, which start their all-reduce during the stage's
# last weight gradient (except the one holding the tied table, summed over stages first)
DP2_PP2 = [dict(name="hf_gpt2", pp=2, dp=2, microbatches=4, schedule=s, virtual=v, bucket_bytes=4096)
           for s, v in SPLIT]
# with the rest of graphpar, against 1F1B on the same strategy (below): tensor parallelism
# (the collectives are nodes of their own: only local matmuls are split) with selective
# recomputation (calls inside a region stay whole); and fp16 compute weights with fp32
# masters, loss scaling and ZeRO-1 (gradients reach the update program through the hooks), on
# our GPT, tied as well (transformers' exported graph asserts float32 embeddings)
COMPOSED = [dict(name="hf_gpt2", pp=2, tp=2, microbatches=2, schedule=s, virtual=v,
                 options=dict(recompute="selective")) for s, v in SPLIT + [("1f1b", 1)]]
COMPOSED += [dict(name="gpt", pp=2, dp=2, microbatches=2, schedule=s, virtual=v,
                  options=dict(param_dtype="fp16", zero=1)) for s, v in SPLIT + [("1f1b", 1)]]
# (losses and parameters, outputs): zbv sums the tied table's two gradients on rank 0 before its
# .grad, 1F1B over the pp group after, so they round differently: in float32 (1e-5 covers a
# few rounding steps of values below 1), and in fp16 gradients in the second group, which move
# the fp32 masters by up to 2e-4 in 3 AdamW steps (fp16 keeps 11 bits: half an ulp is 2.4e-4
# at 0.5); the fp16 weights cast from them then round to neighbouring fp16 values, and the
# fp16 logits (below 1) differ by up to two fp16 steps of 2^-10 each
COMPOSED_TOL = {None: (1e-5, 1e-5), "fp16": (5e-4, 2e-3)}
# the baselines ZB-H1's in-flight memory is compared with
BASELINES = [dict(name="hf_gpt2", pp=2, microbatches=8, schedule="1f1b"),
             dict(name="hf_gpt2", pp=4, microbatches=8, schedule="1f1b", layers=4, partition="uniform")]


def _run(world, configs):
    configs = [{**c, "steps": STEPS} for c in configs]
    return configs, launch(pp_targets.train_many, world_size=world, args=(configs,))


def _reference(layers):
    model, loss_fn = pp_targets.build("hf_gpt2", layers=layers)
    x, y = pp_targets.data("hf_gpt2", 8)
    trained, losses = helpers.train_reference(model, [(x, y)], loss_fn, helpers.adamw(), STEPS)
    return losses, trained.state_dict(), trained.eval()(x).logits


def _check_parity(config, result, reference, rank):
    losses, state, out = reference
    where = f"{config} on stages {result['stages']}"
    dp = config.get("dp", 1)
    out = out.chunk(dp)[rank % dp]   # pm(x) on a dp rank's rows (rank = pp_rank * dp + dp_rank at tp=1)
    assert result["losses"] == pytest.approx(losses, abs=LOSS_TOL), where
    for key, value in state.items():
        torch.testing.assert_close(result["state"][key], value, atol=PARAM_TOL, rtol=0, msg=f"{key}: {where}")
    torch.testing.assert_close(result["out"], out, atol=OUT_TOL, rtol=0, msg=where)


def _check_all(configs, results):
    references = {}
    for i, config in enumerate(configs):
        layers = config.get("layers", 2)
        if layers not in references:
            references[layers] = _reference(layers)
        for rank, rank_results in enumerate(results):
            _check_parity(config, rank_results[i], references[layers], rank)


def _check_composed(configs, results):
    """Each group of three: zero-bubble and zbv train as 1F1B on the same strategy does."""
    for group in range(0, len(configs), 3):
        tol, out_tol = COMPOSED_TOL[configs[group]["options"].get("param_dtype")]
        for rank_results in results:
            plain = rank_results[group + 2]
            for config, split in zip(configs[group:group + 2], rank_results[group:group + 2]):
                assert split["losses"] == pytest.approx(plain["losses"], abs=tol), config
                for key, value in plain["state"].items():
                    torch.testing.assert_close(split["state"][key], value, atol=tol, rtol=0, msg=f"{key}: {config}")
                torch.testing.assert_close(split["out"], plain["out"], atol=out_tol, rtol=0, msg=str(config))


def _in_flight(configs, results, schedule, pp):
    """Per pp rank: (microbatches held at once per stage, most bytes held between instructions)."""
    i = next(i for i, c in enumerate(configs) if c["schedule"] == schedule and c["pp"] == pp and c.get("dp", 1) == 1
             and c["microbatches"] == 8)
    return [(rank_results[i]["peaks"], rank_results[i]["in_flight"]) for rank_results in results]


def _check_zb_h1_keeps_1f1b_in_flight(configs, results, pp):
    """ZB-H1 holds 1F1B's microbatches in flight on every stage (forward done, input gradient
    not); rank r also keeps r pending weight gradients' inputs and output gradients, so rank r
    holds more than under 1F1B but, with stages alike, no more than rank 0, whose count is 1F1B's
    largest: the pipeline's peak is 1F1B's (the paper's claim). Measured with saved-tensor hooks."""
    zero, plain = _in_flight(configs, results, "zero-bubble", pp), _in_flight(configs, results, "1f1b", pp)
    assert [peaks for peaks, _ in zero] == [peaks for peaks, _ in plain] == [{r: pp - r} for r in range(pp)]
    assert max(held for _, held in zero) <= max(held for _, held in plain), (zero, plain)
    assert zero[0][1] == plain[0][1]   # rank 0 runs each weight gradient right after its backward


def test_split_schedules_at_pp2_match_single_device():
    configs, results = _run(2, PP2 + BASELINES[:1])
    _check_all(configs, results)
    _check_zb_h1_keeps_1f1b_in_flight(configs, results, 2)
    zbv = results[0][PP2.index(next(c for c in PP2 if c["schedule"] == "zbv"))]
    assert zbv["stages"] == [0, 3]   # rank 0: the embedding and the tied LM head, in a V


def test_split_schedules_at_pp4_and_dp2_x_pp2_match_single_device():
    configs, results = _run(4, PP4 + BASELINES[1:] + DP2_PP2 + COMPOSED)
    _check_all(configs[:-len(COMPOSED)], results)
    _check_composed(configs[-len(COMPOSED):], [r[-len(COMPOSED):] for r in results])
    _check_zb_h1_keeps_1f1b_in_flight(configs, results, 4)
    for i, config in enumerate(configs[:-len(COMPOSED)]):
        if config.get("dp", 1) == 2:
            assert all(rank_results[i]["launched_in_backward"] > 0 for rank_results in results), config
