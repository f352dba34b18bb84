"""Global gradient-norm clipping across ranks: every tp shard, pipeline stage, dp replica,
ZeRO shard and host master counted once, a tied weight once (the tolerances and the contrast
with unclipped training are the unit twin's, explained there). One launch per world size
trains every strategy of that size."""
import pytest

import graphpar as gp
from graphpar.distributed.launch import launch
from tests.targets import clip_targets as targets
from tests.unit.runtime.test_grad_clip import assert_matches_clipped_training

# world size -> strategies trained in its one launch
STRATEGIES = {
    4: [dict(tp=2, pp=2, microbatches=2),            # tp shards and tp-replicated weights; the tied
                                                     #   embedding on both stages, summed, counted once
        dict(dp=2, pp=2, microbatches=2, zero=3)],   # each dp rank's reduced shard rows; the tied
                                                     #   weight's rows summed over pp
    2: [dict(dp=2),                                  # the dp average, alike on both replicas
        dict(dp=2, offload_optimizer=True),          # host masters: the update program steps after the norm
        dict(dp=2, zero=2)],                         # reduce-scattered shards, the full gradients freed
}
CASES = [(size, index) for size, strategies in STRATEGIES.items() for index in range(len(strategies))]


@pytest.fixture(scope="module")
def launched():
    runs = {}

    def of(world_size):
        if world_size not in runs:
            strategies = [gp.Strategy(**s).to_dict() for s in STRATEGIES[world_size]]
            runs[world_size] = launch(targets.train_each, world_size=world_size, args=(strategies,))
        return runs[world_size]
    return of


@pytest.fixture(scope="module")
def reference():
    return targets.reference()


@pytest.mark.parametrize("world_size, index", CASES, ids=[str(STRATEGIES[w][i]) for w, i in CASES])
def test_clipped_training_matches_clip_grad_norm_on_one_device(launched, reference, world_size, index):
    norms, _, state = reference
    for rank in launched(world_size):
        assert_matches_clipped_training(rank[index], norms, state)
