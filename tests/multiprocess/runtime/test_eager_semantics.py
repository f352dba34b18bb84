"""graphpar behaves as eager PyTorch does (issue #14), on two ranks: parameters that get no
gradient are not stepped under dp, host placement, pp and tp. Every strategy runs in one
launch (tests/targets/cases.py)."""
import pytest

from tests.targets import eager_targets
from tests.targets.cases import SharedLaunches
from tests.unit.runtime.test_eager_semantics import _check_partly_used

STRATEGIES = [{"dp": 2}, {"dp": 2, "offload_optimizer": True}, {"pp": 2}, {"tp": 2},
              {"dp": 2, "zero": 2}, {"dp": 2, "zero": 3}]


@pytest.fixture(scope="module")
def launched():
    return SharedLaunches({i: (2, eager_targets.train_partly_used, (strategy, 3)) for i, strategy in enumerate(STRATEGIES)})


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_parameters_without_gradient_are_not_stepped_on_two_ranks(launched, strategy):
    for losses, state in launched(STRATEGIES.index(strategy)):
        _check_partly_used(state, losses)

