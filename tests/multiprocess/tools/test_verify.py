"""graphpar.verify: a correct program passes; injected bugs are caught and attributed."""
import pytest

import graphpar as gp
from graphpar.distributed.launch import launch
from tests import helpers
from tests.targets import verify_targets


def test_a_correct_program_passes():
    reports = launch(verify_targets.clean, world_size=2)
    for report in reports:
        assert report.passed, report.message
        assert "PASS" in report.message


@pytest.mark.parametrize("bug, blamed", [
    ("wrong_reduce_op", "insert_collectives"),
    ("wrong_head_count", "rewrite_parallel_layers"),
    ("swapped_column_row", "annotate_shards"),
    ("dropped_gradient_sync", "gradient synchronisation"),
])
def test_injected_bugs_are_attributed_to_their_pass(bug, blamed):
    reports = launch(getattr(verify_targets, bug), world_size=2)
    for report in reports:
        assert not report.passed
        assert report.culprit is not None and report.culprit.pass_name.startswith(blamed), report.message
        assert "FAIL" in report.message and blamed in report.message


def test_verify_starts_its_own_processes():
    model = helpers.tiny_gpt()
    x, y = helpers.token_batch(batch=4)
    report = gp.verify(model, gp.Strategy(dp=2), example_inputs=(x,), target=y, loss_fn=helpers.lm_loss, steps=2)
    assert report.passed, report.message
