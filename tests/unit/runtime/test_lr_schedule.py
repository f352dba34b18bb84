"""LR schedules on pm.optimizer in one process (issue 17): fp32 masters (param_dtype, on the
device or on the host with the fused kernel) follow the schedule, and save_checkpoint /
load_checkpoint's lr_scheduler= refuses what cannot resume exactly, before anything changes.
Parity under dp, tp, pp and ZeRO and exact resume across layouts:
tests/multiprocess/runtime/test_lr_schedule.py."""
import warnings

import pytest
import torch

from graphpar.checkpoint.sharded import CheckpointError, load_full_checkpoint
from graphpar.runtime.placement.update import fused_adam_step
from tests.helpers import tiny_gpt
from tests.targets import lr_schedule_targets as targets
from tests.unit.checkpoint.test_checkpoint import assert_same
from tests.unit.runtime.placement.test_placement import OFFLOAD_TOL, _max_diff


@pytest.mark.parametrize("strategy", [{"param_dtype": "bf16"}, {"param_dtype": "bf16", "offload_optimizer": True}])
def test_fp32_masters_follow_the_schedule_on_one_rank(strategy):
    """One rank computes what the eager bf16 model computes; its masters take the scheduled
    step in the update program (several buckets, each stepping alone). The host's fused
    kernel stands in for optimizer.step(), and the scheduler sees it as the step (no warning
    that it was stepped first)."""
    pm, scheduler, x, y = targets.compile_scheduled(strategy, "adamw")
    if strategy.get("offload_optimizer"):
        assert all(bucket.kernel is fused_adam_step for bucket in pm._placed.buckets)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch's "lr_scheduler.step() before optimizer.step()" included
        losses, rates = targets.train(pm, scheduler, x, y, targets.STEPS)
    ref_losses, ref_rates, ref_state = targets.train_reference(tiny_gpt(), targets.OPTIMIZERS["adamw"](),
                                                               targets.STEPS, dtype=torch.bfloat16)
    assert rates == ref_rates
    assert losses == ref_losses
    # the fused/foreach rounding of one update per step (placement's OFFLOAD_TOL); a step at
    # another rate moves entries by O(lr) = 1e-2
    assert _max_diff(pm.full_state_dict(), ref_state) < OFFLOAD_TOL


def _scheduled(path=None):
    """A module one step into the schedule (saved to `path` with its scheduler, if given)."""
    pm, scheduler, x, y = targets.compile_scheduled({}, "adamw")
    targets.train(pm, scheduler, x, y, 1)
    if path is not None:
        pm.save_checkpoint(path, lr_scheduler=scheduler)
    return pm, scheduler, x, y


def _state(pm, scheduler):
    return {"model": pm.full_state_dict(), "groups": [dict(g, params=None) for g in pm.optimizer.param_groups],
            "scheduler": scheduler.state_dict()}


def test_a_scheduler_of_another_optimizer_is_refused(tmp_path):
    pm, scheduler, _, _ = _scheduled(tmp_path / "ck")
    other = torch.optim.lr_scheduler.LambdaLR(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0),
                                              targets.warmup_cosine)
    for call in (lambda: pm.save_checkpoint(tmp_path / "other", lr_scheduler=other),
                 lambda: pm.load_checkpoint(tmp_path / "ck", lr_scheduler=other)):
        with pytest.raises(CheckpointError, match=r"lr_scheduler=LambdaLR does not schedule pm.optimizer: it was "
                                                  r"built on another optimizer\. Fix: build the scheduler on the "
                                                  r"compiled module's optimizer, e\.g\. LambdaLR\(pm\.optimizer"):
            call()
    with pytest.raises(CheckpointError, match=r"lr_scheduler=dict has no state_dict\(\) and load_state_dict\(\)"):
        pm.save_checkpoint(tmp_path / "other", lr_scheduler=scheduler.state_dict())
    assert not (tmp_path / "other").exists()


def test_a_scheduler_the_checkpoint_cannot_resume_is_refused_before_anything_changes(tmp_path):
    pm, scheduler, x, y = _scheduled()
    pm.save_checkpoint(tmp_path / "unscheduled")
    assert load_full_checkpoint(tmp_path / "unscheduled").lr_scheduler is None
    _scheduled(tmp_path / "scheduled")
    targets.train(pm, scheduler, x, y, 1)  # the state moves on, so a load would change it
    before = _state(pm, scheduler)
    with pytest.raises(CheckpointError, match=r"holds no LR scheduler state \(it was saved without lr_scheduler=\)"):
        pm.load_checkpoint(tmp_path / "unscheduled", lr_scheduler=scheduler)
    assert_same(_state(pm, scheduler), before)
    step_lr = torch.optim.lr_scheduler.StepLR(pm.optimizer, step_size=2)
    before = _state(pm, step_lr)
    with pytest.raises(CheckpointError, match=r"holds the state of a torch\.optim\.lr_scheduler\.LambdaLR, and "
                                              r"lr_scheduler= is a torch\.optim\.lr_scheduler\.StepLR"):
        pm.load_checkpoint(tmp_path / "scheduled", lr_scheduler=step_lr)
    assert_same(_state(pm, step_lr), before)


def test_a_load_that_leaves_the_saved_schedule_behind_says_so(tmp_path):
    _, scheduler, _, _ = _scheduled(tmp_path / "ck")
    pm, _, _, _ = targets.compile_scheduled({}, "adamw")
    with pytest.warns(UserWarning, match=r"holds a torch\.optim\.lr_scheduler\.LambdaLR's state, which this load "
                                         r"does not restore: the optimizer goes on at the rate saved \(lr 0\.01\)"):
        pm.load_checkpoint(tmp_path / "ck")
    assert pm.optimizer.param_groups[0]["lr"] == scheduler.get_last_lr()[0]
    assert load_full_checkpoint(tmp_path / "ck").lr_scheduler == scheduler.state_dict()
