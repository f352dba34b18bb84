"""Pipeline parallelism on gloo against single-device training from the same state_dict. Every
case of one world size runs in one launch (tests/targets/cases.py), `cases` below; a rank
failing mid-schedule is a launch of its own (it tests launch's failure)."""
import json
import re

import pytest
import torch

from graphpar.distributed.launch import LaunchError, launch
from tests import helpers
from tests.targets import pp_targets
from tests.targets.cases import SharedLaunches

STEPS = 3
# Microbatches sum the gradient in another order than the full batch, and stages only add
# p2p copies (exact): losses agree to float32 noise. Parameters: the AdamW
# noise bound explained in test_world_of_one.
FIRST_LOSS_TOL = 1e-5
LOSS_TOL = 1e-4
PARAM_TOL = 2e-4
OUT_TOL = 1e-4

SCHEDULES = [("gpipe", 1, (1, 4, 8)), ("1f1b", 1, (1, 4, 8))]


def _matrix(name, pp, interleaved_microbatches=(), **extra):
    """Every schedule x microbatch count for one model (interleaving needs m % pp == 0)."""
    configs = [dict(name=name, pp=pp, microbatches=m, schedule=s, virtual=v, **extra)
               for s, v, ms in SCHEDULES for m in ms]
    return configs + [dict(name=name, pp=pp, microbatches=m, schedule="interleaved-1f1b", virtual=2, **extra)
                      for m in interleaved_microbatches]


# pp=2: GPT, AlexNet and transformers GPT-2 (export) under all three schedules, m = 1, 4, 8
# the last ones: messages through shared memory (GRAPHPAR_PIPELINE_TRANSPORT=shm,
# runtime/pipeline/shm_transport.py; gloo for the others): every kind of schedule, and GPT-2's
# several tensors crossing a cut
PP2 = (_matrix("gpt", 2, (4, 8)) + _matrix("alexnet", 2, (4, 8)) + _matrix("hf_gpt2", 2, (4, 8))
       + [dict(name=name, pp=2, microbatches=m, schedule=schedule, virtual=v, transport="shm")
          for name, schedule, v, m in [("gpt", "gpipe", 1, 8), ("gpt", "1f1b", 1, 4), ("gpt", "interleaved-1f1b", 2, 8),
                                       ("gpt", "zbv", 2, 4), ("hf_gpt2", "1f1b", 1, 4)]])
# pp=4: the same with transformers LLaMA; interleaving 8 stages needs more layers than the
# 2-block transformers models have, so it runs on a 6-block GPT and AlexNet
PP4 = (_matrix("gpt", 4, (8,), layers=6) + _matrix("alexnet", 4, (8,)) + _matrix("hf_llama", 4))


WORLDS = {2: PP2, 4: PP4}
# dp2 x tp2 x pp2 with small buckets: several per stage, which start their all-reduce during the
# stage's last backward (except the ones holding a tied weight, which wait for the sum over
# stages), with and without example_target (compiled again at the first step: the same program)
EIGHT = {name: [dict(name=name, pp=2, tp=2, dp=2, microbatches=2, schedule="1f1b", steps=STEPS, bucket_bytes=4096,
                     with_target=with_target) for with_target in (True, False)] for name in ("gpt", "hf_llama")}


def cases(directory):
    """Every launched case of this module: {name: (world size, function, args)}."""
    return {
        **{("schedules", world, i): (world, pp_targets.train_pp, (), {**config, "steps": STEPS})
           for world, configs in WORLDS.items() for i, config in enumerate(configs)},
        "alexnet": (2, pp_targets.train_pp, (), dict(name="alexnet", pp=2, microbatches=2, schedule="1f1b", steps=1)),
        "uneven": (2, pp_targets.uneven_batch, ()),
        **{("eight", name, i): (8, pp_targets.train_pp, (), config)
           for name, configs in EIGHT.items() for i, config in enumerate(configs)},
        "profile": (2, pp_targets.profile_partition, (str(directory),)),
        "profile_cuts": (2, pp_targets.profile_partition_cuts, ()),
    }


@pytest.fixture(scope="module")
def launched(directory):
    return SharedLaunches(cases(directory))


def _reference(config):
    model, loss_fn = pp_targets.build(config["name"], 1, config.get("layers", 2))
    x, y = pp_targets.data(config["name"], 8)
    trained, losses = helpers.train_reference(model, [(x, y)], loss_fn, helpers.adamw(), STEPS)
    out = trained.eval()(x)
    return losses, trained.state_dict(), out.logits if hasattr(out, "logits") else out


def _check(config, result, reference):
    losses, state, out = reference
    where = f"{config} on stages {result['stages']}"
    assert result["losses"][0] == pytest.approx(losses[0], abs=FIRST_LOSS_TOL), where
    assert result["losses"] == pytest.approx(losses, abs=LOSS_TOL), where
    for key, value in state.items():
        torch.testing.assert_close(result["state"][key], value, atol=PARAM_TOL, rtol=0, msg=f"{key}: {where}")
    torch.testing.assert_close(result["out"], out, atol=OUT_TOL, rtol=0, msg=where)


def _check_in_flight(config, result):
    """1F1B bounds the activations a stage holds by the stages after it; GPipe holds all."""
    pp, m = config["pp"], config["microbatches"]
    for stage, peak in result["peaks"].items():
        if config["schedule"] == "gpipe":
            assert peak == m, (config, stage, peak)
        elif config["schedule"] == "1f1b":
            assert peak == min(pp - stage, m), (config, stage, peak)


@pytest.mark.parametrize("world", list(WORLDS), ids=["pp2", "pp4"])
def test_pipeline_schedules_match_single_device(launched, world):
    references = {}
    for i, config in enumerate(WORLDS[world]):
        key = (config["name"], config.get("layers", 2))
        if key not in references:
            references[key] = _reference(config)
        for result in launched(("schedules", world, i)):
            _check(config, result, references[key])
            _check_in_flight(config, result)
            assert result["transport"] == ("shared memory" if config.get("transport") == "shm" else "gloo"), config


def test_alexnet_parameters_partition_puts_the_last_two_linears_on_stage_1(launched):
    results = launched("alexnet")
    # DeepSpeed's partition_balanced on AlexNet's layers gives parts [0, 19, 22]: stage 1 is
    # fc7, its ReLU and fc8; the dropouts (p=0 here) vanish from the graph
    assert results[0]["units"][1] == ["classifier.4", "classifier.5", "classifier.6"]


def test_a_rank_failing_mid_schedule_fails_every_rank_quickly():
    with pytest.raises(LaunchError, match="rank 1 failed: RuntimeError: injected failure in stage 1"):
        launch(pp_targets.fail_mid_schedule, world_size=2, timeout=20)


def test_a_batch_that_does_not_split_into_microbatches_is_refused(launched):
    for error in launched.errors("uneven"):
        assert re.search(r"microbatches=4.*6", error), error


@pytest.mark.parametrize("name", list(EIGHT))
def test_dp2_x_tp2_x_pp2_on_8_processes(launched, name):
    results = [launched(("eight", name, i)) for i in range(len(EIGHT[name]))]
    model, loss_fn = pp_targets.build(name, 2)
    x, y = pp_targets.data(name, 8)
    trained, losses = helpers.train_reference(model, [(x, y)], loss_fn, helpers.adamw(), STEPS)
    for result in (result for case in results for result in case):
        assert result["losses"] == pytest.approx(losses, abs=LOSS_TOL)
        assert result["launched_in_backward"] > 0
        for key, value in trained.state_dict().items():
            torch.testing.assert_close(result["state"][key], value, atol=PARAM_TOL, rtol=0, msg=key)


def test_profile_partition_times_layers_and_dump_writes_the_timeline(launched, directory):
    tmp_path = directory
    results = launched("profile")
    losses, seconds, bounds = results[0]
    assert all(s > 0 for s in seconds[2:6])  # every block was timed
    assert len(bounds) == 2 and results[1][2] == bounds  # both ranks cut the same place
    model, loss_fn = pp_targets.build("gpt", layers=4)
    x, y = pp_targets.data("gpt", 8)
    _, expected = helpers.train_reference(model, [(x, y)], loss_fn, helpers.adamw(), 2)
    assert losses == pytest.approx(expected, abs=LOSS_TOL)
    for rank in (0, 1):
        trace = json.load(open(tmp_path / f"rank{rank}" / "timeline.json"))
        assert any(e.get("name", "").startswith("F0") for e in trace["traceEvents"])


def test_profile_partition_is_the_same_on_every_rank_and_reported(launched):
    """Each rank times the layers itself; the times are averaged over the world first, or ranks
    whose clocks disagree would cut the model in different places and run mismatched stages."""
    results = launched("profile_cuts")
    cuts = {tuple(c) for c, _ in results}
    assert len(cuts) == 1
    for compiled, report in results:
        assert f"partition by paths {compiled}" in report  # pm.report() plans the measured cuts
