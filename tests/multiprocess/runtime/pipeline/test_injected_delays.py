"""The executor keeps the simulated timing: with fixed per-op costs (each forward, input
gradient and weight gradient sleeps one unit, large against the model's own compute and the
executor's python and send/receive overhead), the measured bubble of every schedule is within
10% (relative) of the bubble graphpar.runtime.pipeline.simulate gives the same costs."""
import statistics

import pytest

from graphpar.distributed.launch import launch
from graphpar.runtime.pipeline.schedules import build_schedule
from graphpar.runtime.pipeline.simulate import result_from, simulate
from tests.targets import pp_targets

# measured bubbles against simulated ones within 10%: alone on the machine (./run tests runs it after the rest)
pytestmark = pytest.mark.serial

# 2 microbatches: simulated bubbles of 14-33% (zero-bubble and zbv 1 and 2 units idle per rank
# in 7 and 14), so that 10% of one is 5-15 ms per rank. The ranks hand over about a dozen
# messages on the critical path, each a gloo round trip and the wake-up of a blocked thread:
# 0.1 ms on an idle machine, about 1 ms when other processes keep both cores busy. At 4
# microbatches zbv's bubble is 1 unit in 25 per rank and its 10% would have to cover twice
# as many hand-overs: a test of the machine's load, not of the executor (measured there at
# a load average of 6-8: 4.7-5.2% against 4.0%).
PP, MICROBATCHES = 2, 2
SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2), ("zero-bubble", 1), ("zbv", 2)]
# 50 ms: the model's forward or backward with the executor's python around it takes 0.3-1 ms,
# so the sleeps set the timing
UNIT_S = 0.05
STEPS = 4   # timed steps per schedule; their median bubble is compared (one slow step on a busy machine is not)
RELATIVE = 0.10   # the acceptance line of issue #18


def test_measured_bubbles_follow_the_simulated_ones_under_fixed_per_op_costs():
    configs = [dict(pp=PP, microbatches=MICROBATCHES, schedule=s, virtual=v) for s, v in SCHEDULES]
    per_rank = launch(pp_targets.injected_delays, world_size=PP, args=(configs, UNIT_S, STEPS))
    for i, config in enumerate(configs):
        schedule = build_schedule(config["schedule"], PP, MICROBATCHES, config["virtual"])
        simulated = simulate(schedule, PP, forward_cost=1, backward_cost=2, weight_cost=1).bubble_fraction
        measured = statistics.median(result_from([rank[i][step] for rank in per_rank]).bubble_fraction
                                     for step in range(STEPS))
        assert measured == pytest.approx(simulated, rel=RELATIVE), (config, measured, simulated)
