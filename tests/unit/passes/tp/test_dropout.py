"""Dropout RNG under tensor parallelism: per-rank streams in TP regions, shared ones outside
(the streams the lowering assigns; what they draw on two ranks:
tests/multiprocess/passes/tp/test_dropout.py)."""
import pytest
import torch

import graphpar as gp
from graphpar.runtime import ops
from graphpar.frontend.compile import lower_rank
from tests.targets import tp_targets


def _streams(masks):
    x = torch.randn(8, 16)
    result = lower_rank(tp_targets.DropoutMLP(), gp.Strategy(tp=2), (x,), rank=0, world_size=2,
                        loss_fn=torch.nn.functional.mse_loss, example_target=x, dropout_masks=masks)
    return {n.meta["graphpar"].module_path: n.args[2:] for n in result.gm.graph.nodes
            if n.target is ops.dropout}


def test_streams_follow_the_shard_spec():
    assert _streams("local") == {"inner": ("tp_local", None), "outer": ("global", None)}
    assert _streams("tp_invariant") == {"inner": ("global", 1), "outer": ("global", None)}
    with pytest.raises(ValueError, match="dropout_masks='mine'.*local"):
        _streams("mine")
