"""Activation recomputation (Strategy.recompute) across processes: with tensor parallelism
(and sequence parallelism), pipeline parallelism under GPipe, 1F1B and the interleaved schedule, ZeRO-3,
bf16 compute weights, the optimizer and the embedding on the host, on the built-in GPT and `transformers`
LLaMA with dropout 0.1. Every mode must train exactly as the same strategy without
recomputation: the replay runs the same ops on the same inputs with the same dropout masks,
and re-issues the same collectives, so losses, each rank's gradients and parameters agree
bit for bit. And each rank keeps what the plan says it keeps."""
import pytest
import torch

from graphpar.distributed.launch import launch
from tests.targets import recompute_targets

ALL = (None, "full", "selective", 0.5)
FEW = (None, "full", 0.5)
# (model, strategy, modes, compare saved bytes with the plan)
CASES = [
    ("gpt", {"tp": 2}, ALL, True),
    ("hf_llama", {"tp": 2}, FEW, True),
    ("gpt", {"tp": 2, "sequence_parallel": True}, FEW, False),
    ("gpt", {"pp": 2, "microbatches": 2, "schedule": "gpipe"}, FEW, True),
    ("gpt", {"pp": 2, "microbatches": 2, "schedule": "1f1b"}, ALL, True),
    ("hf_llama", {"pp": 2, "microbatches": 2, "schedule": "1f1b"}, FEW, True),
    ("gpt", {"pp": 2, "microbatches": 2, "schedule": "interleaved-1f1b", "virtual_stages": 2}, ALL, True),
    ("hf_llama", {"pp": 2, "microbatches": 2, "schedule": "interleaved-1f1b", "virtual_stages": 2}, FEW, False),
    ("gpt", {"dp": 2, "zero": 3}, ALL, True),
    ("gpt", {"dp": 2, "zero": 1, "param_dtype": "bfloat16"}, FEW, False),
    ("gpt", {"dp": 2, "offload_optimizer": True}, FEW, False),
    ("gpt", {"dp": 2, "offload_embedding": True}, FEW, False),
]
# The plan's activation figure is autograd's saved bytes on fake tensors of the same program,
# times the microbatches a stage holds at once; measured bytes differ only where the plan
# counts a microbatch's saves at their total while a schedule frees some before the last
# forward of the step (the 1F1B warm-up), which stays well inside the 10% the issue allows.
PLAN_TOL = 0.10


@pytest.fixture(scope="module")
def results():
    return launch(recompute_targets.train_modes, world_size=2, args=(CASES,))


def _exact(a, b, what):
    torch.testing.assert_close(a, b, atol=0, rtol=0, msg=what)


@pytest.mark.parametrize("case", range(len(CASES)), ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_every_mode_trains_as_without_recompute(results, case):
    name, strategy, modes, _ = CASES[case]
    for rank, runs in enumerate(results):
        base = runs[case][None]
        for mode in modes[1:]:
            got = runs[case][mode]
            where = f"{name} {strategy} recompute={mode!r} rank {rank}"
            assert got["losses"] == base["losses"], where
            assert got["grads"].keys() == base["grads"].keys()
            for n in base["grads"]:
                _exact(got["grads"][n], base["grads"][n], f"{where}: gradient of {n}")
            for n in base["params"]:
                _exact(got["params"][n], base["params"][n], f"{where}: {n} after {recompute_targets.STEPS} steps")


@pytest.mark.parametrize("case", range(len(CASES)), ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_each_rank_keeps_less_and_what_the_plan_says(results, case):
    name, strategy, modes, measured = CASES[case]
    for rank, runs in enumerate(results):
        peaks = {mode: runs[case][mode]["peak"] for mode in modes}
        assert peaks["full"] < peaks[None] / 2, (name, strategy, rank, peaks)
        assert peaks[0.5] <= 0.5 * peaks[None] * (1 + PLAN_TOL), (name, strategy, rank, peaks)
        if not measured:
            continue
        for mode in modes:
            planned = runs[case][mode]["planned"]
            assert abs(peaks[mode] - planned) <= PLAN_TOL * planned, (name, strategy, rank, mode, peaks[mode], planned)
        assert any("recompute=0.5" in note for note in runs[case][0.5]["notes"])
