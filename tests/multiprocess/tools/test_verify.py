"""graphpar.verify: a correct program passes; injected bugs are caught and attributed. The
programs run in one launch (tests/targets/cases.py); verify's own processes are their own test."""
import pytest

import graphpar as gp
from tests import helpers
from tests.targets import verify_targets
from tests.targets.cases import SharedLaunches

BUGS = [
    ("wrong_reduce_op", "insert_collectives"),
    ("wrong_head_count", "rewrite_parallel_layers"),
    ("swapped_column_row", "annotate_shards"),
    ("dropped_gradient_sync", "gradient synchronisation"),
]


# None: fp32 training. bf16/fp16: verify's reference is mixed precision as graphpar trains it,
# and a value may differ by what that rounding does by itself (graphpar/tools/reference.py).
DTYPES = [None, "bf16", "fp16"]


# Per dtype, the bugs verify reports. In bf16/fp16 the two that break shapes fail compile
# itself (cast_params re-derives every value on fake tensors): an exception, not a report.
CASES = [(bug, blamed, dtype) for bug, blamed in BUGS for dtype in DTYPES
         if dtype is None or bug in ("wrong_reduce_op", "dropped_gradient_sync")]


# transformers models trace only with torch.export, whose float32 casts cast_params re-types from
# a trace in bf16 (passes/tracing/compute_dtype.py). With two microbatches and a loss computed in
# bf16 (hf_causal_lm_loss does not upcast) each microbatch's loss is rounded on its own, which
# verify's loss tolerance allows for (graphpar/tools/verify.py: _loss_rounding).
TRANSFORMERS = {"llama-tp2": ("llama", dict(tp=2)), "gpt2-pp2": ("gpt2", dict(pp=2)),
                "gpt2-pp2-mb2": ("gpt2", dict(pp=2, microbatches=2))}


@pytest.fixture(scope="module")
def launched():
    names = [("clean", dtype) for dtype in DTYPES] + [(bug, dtype) for bug, _, dtype in CASES]
    jobs = {(name, dtype): (2, getattr(verify_targets, name), (dtype,)) for name, dtype in names}
    jobs.update({name: (2, verify_targets.transformers_bf16, args) for name, args in TRANSFORMERS.items()})
    jobs.update({("localised", name): (2, verify_targets.transformers_localised, args)
                 for name, args in TRANSFORMERS.items()})
    return SharedLaunches(jobs)


@pytest.mark.parametrize("param_dtype", DTYPES)
def test_a_correct_program_passes(launched, param_dtype):
    reports = launched(("clean", param_dtype))
    for report in reports:
        assert report.passed, report.message
        assert "PASS" in report.message


@pytest.mark.parametrize("name", sorted(TRANSFORMERS))
def test_transformers_models_pass_in_bf16(launched, name):
    for report in launched(name):
        assert report.passed, report.message


@pytest.mark.parametrize("name", sorted(TRANSFORMERS))
def test_localisation_finds_no_culprit_in_a_correct_transformers_program(launched, name):
    """Every forward value of every stage agrees with the whole-model trace computing in bf16
    (its casts typed as the ranks' are; a later stage's inputs taken from that trace)."""
    assert launched(("localised", name)) == [None, None]


@pytest.mark.parametrize("bug, blamed, param_dtype", CASES)
def test_injected_bugs_are_attributed_to_their_pass(launched, bug, blamed, param_dtype):
    reports = launched((bug, param_dtype))
    for report in reports:
        assert not report.passed
        assert report.culprit is not None and report.culprit.pass_name.startswith(blamed), report.message
        assert "FAIL" in report.message and blamed in report.message


def test_verify_starts_its_own_processes():
    model = helpers.tiny_gpt()
    x, y = helpers.token_batch(batch=4)
    report = gp.verify(model, gp.Strategy(dp=2), example_inputs=(x,), target=y, loss_fn=helpers.lm_loss, steps=2)
    assert report.passed, report.message
