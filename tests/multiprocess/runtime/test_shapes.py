"""Batches of varying shape across ranks (graphpar/runtime/shapes.py): sequence lengths 16 and
32 in turn at tp2 x pp2 (the pipeline's receive buffers follow the shape) train as
single-device training on the same batches, each shape traced once; at dp2 x pp2 with ZeRO-1
the dp replicas see batches of different sizes and lengths at one step, and a token-weighted
loss trains as single-device training with the token mean over all of them. The tolerances
are the unit twin's, explained there; one launch runs both."""
import re

import graphpar as gp
from graphpar.distributed.launch import launch
from tests.helpers import assert_trains_as
from tests.targets import shapes_targets as targets
from tests.unit.runtime.test_shapes import LOSS_RTOL, PARAM_ATOL, assert_matches_eager

LENGTHS = [(4, 16), (4, 32), (4, 16), (4, 32)]    # global batches of one dp replica
# per step, each dp replica's (batch size, sequence length); compile takes step 0's, alike
REPLICAS = [[(4, 16), (4, 16)], [(2, 32), (4, 16)], [(4, 16), (2, 32)], [(2, 32), (2, 32)]]


def test_alternating_lengths_at_tp2_pp2_and_replicas_of_other_shapes_at_dp2_pp2_match_eager():
    trained = (gp.Strategy(tp=2, pp=2, microbatches=2).to_dict(), LENGTHS, {"max_shapes": 2})
    replicas = (gp.Strategy(dp=2, pp=2, microbatches=2, zero=1).to_dict(), REPLICAS)
    results = launch(targets.train_cases, world_size=4, args=(trained, replicas))
    ref_losses, ref_state = targets.reference(LENGTHS)
    for run, _ in results:
        assert_matches_eager(run, ref_losses, ref_state)
        assert run["traced"] == [1, 2, 2, 2]  # a shape seen again is not traced again
        assert run["evaluated"] == 2          # pm(x) of the last batch runs its training program
        assert run["shapes"] == [{"inputs": [[2, 16]], "target": [[2, 16]]}, {"inputs": [[2, 32]], "target": [[2, 32]]}]
        # a third shape past max_shapes=2 is refused on every rank, before anything is traced
        assert re.search(r"train_step: a batch of a new shape \(microbatch inputs \[2, 8\], target \[2, 8\]\) needs "
                         r"a program of its own, but this ParallelModule already keeps max_shapes=2 program\(s\), one "
                         r"per microbatch shape seen: \(inputs \[2, 16\], target \[2, 16\]\); \(inputs \[2, 32\], "
                         r"target \[2, 32\]\)\. .*Fix: pad batches to a few fixed shapes", run["bound"]), run["bound"]
    ref_losses, ref_state = targets.reference_token_mean(REPLICAS)
    for rank, (_, run) in enumerate(results):
        assert_trains_as(run, ref_losses, ref_state, LOSS_RTOL, PARAM_ATOL)
        # mesh rank order: dp rank = rank // tp % dp = rank % 2 here; each replica compiles its second shape once
        assert run["traced"] == ([1, 2, 2, 2] if rank % 2 == 0 else [1, 1, 2, 2])
