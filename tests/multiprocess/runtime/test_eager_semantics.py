"""graphpar behaves as eager PyTorch does (issue #14), on two ranks: parameters that get no
gradient are not stepped under dp, host placement, pp and tp."""
import pytest

from graphpar.distributed.launch import launch
from tests.targets import eager_targets
from tests.unit.runtime.test_eager_semantics import _check_partly_used


@pytest.mark.parametrize("strategy", [{"dp": 2}, {"dp": 2, "offload_optimizer": True}, {"pp": 2}, {"tp": 2},
                                      {"dp": 2, "zero": 2}, {"dp": 2, "zero": 3}])
def test_parameters_without_gradient_are_not_stepped_on_two_ranks(strategy):
    for losses, state in launch(eager_targets.train_partly_used, world_size=2, args=(strategy, 3)):
        _check_partly_used(state, losses)

