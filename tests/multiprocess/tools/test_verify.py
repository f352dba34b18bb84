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


@pytest.fixture(scope="module")
def launched():
    return SharedLaunches({name: (2, getattr(verify_targets, name), ()) for name in ["clean"] + [b for b, _ in BUGS]})


def test_a_correct_program_passes(launched):
    reports = launched("clean")
    for report in reports:
        assert report.passed, report.message
        assert "PASS" in report.message


@pytest.mark.parametrize("bug, blamed", BUGS)
def test_injected_bugs_are_attributed_to_their_pass(launched, bug, blamed):
    reports = launched(bug)
    for report in reports:
        assert not report.passed
        assert report.culprit is not None and report.culprit.pass_name.startswith(blamed), report.message
        assert "FAIL" in report.message and blamed in report.message


def test_verify_starts_its_own_processes():
    model = helpers.tiny_gpt()
    x, y = helpers.token_batch(batch=4)
    report = gp.verify(model, gp.Strategy(dp=2), example_inputs=(x,), target=y, loss_fn=helpers.lm_loss, steps=2)
    assert report.passed, report.message
