"""ZeRO's flat shard layout (graphpar/runtime/zero.py) and the optimizers it refuses, in one
process; the multi-process parity and split checks are tests/multiprocess/runtime/test_zero.py."""
import functools

import pytest
import torch

import graphpar as gp
from graphpar.runtime.zero import ShardLayout
from tests.helpers import lm_loss, tiny_gpt, token_batch


def test_shard_layout_pads_to_a_multiple_of_dp():
    layouts = [ShardLayout((3, 4, 3), 4, r) for r in range(4)]   # 10 elements over 4 ranks: shards of 3
    assert [(lay.shard, lay.padding) for lay in layouts] == [(3, 2)] * 4
    assert [[(p.index, p.start, p.stop, p.offset) for p in lay.pieces()] for lay in layouts] == [
        [(0, 0, 3, 0)], [(1, 0, 3, 0)], [(1, 3, 4, 0), (2, 0, 2, 1)], [(2, 2, 3, 0)]]
    assert [lay.owned() for lay in layouts] == [3, 3, 3, 1]


@pytest.mark.parametrize("factory, name", [
    (lambda params: torch.optim.SparseAdam(params), "SparseAdam"),
    (lambda params: torch.optim.Muon(params), "Muon"),
    (functools.partial(torch.optim.Adafactor, lr=1e-2), "Adafactor"),
    (lambda params: type("MyAdam", (torch.optim.Adam,), {})(params), "MyAdam"),
])
def test_optimizers_that_are_not_elementwise_are_refused(factory, name):
    x, y = token_batch(batch=4)
    with pytest.raises(ValueError, match=rf"Strategy.zero=1 with optimizer \S*{name} is refused: .*elementwise.*"
                                         r"SGD, Adam, AdamW.*Fix: use one of those optimizers, or zero=0"):
        gp.compile(tiny_gpt(), gp.Strategy(zero=1), example_inputs=(x,), example_target=y, loss_fn=lm_loss,
                   optimizer=factory)
