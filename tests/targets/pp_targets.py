"""Per-rank functions for the pipeline-parallel tests (run under graphpar.launch)."""
import os
import time

import torch
import torch.distributed as dist

import graphpar as gp
from graphpar.runtime.pipeline.shm_transport import TRANSPORT_ENV
from tests import helpers
from tests.targets import tp_targets


def train_pp(name, steps, pp, tp=1, dp=1, microbatches=4, schedule="1f1b", virtual=1, batch=8,
             partition="parameters", layers=2, bucket_bytes=25 * 2**20, with_target=True, options=None,
             transport=None):
    """`with_target=False` compiles without example_target (traced again at the first step);
    `options`: more Strategy fields; `transport`: GRAPHPAR_PIPELINE_TRANSPORT for this run only.
    The last step is measured: "in_flight" is the most bytes this rank kept for backward from
    one instruction of its schedule to the next (_in_flight_bytes); "transport" is what carried
    the pipeline's messages ("shared memory" or "gloo")."""
    if transport is None:
        return _train_pp(name, steps, pp, tp, dp, microbatches, schedule, virtual, batch, partition, layers,
                         bucket_bytes, with_target, options)
    earlier = os.environ.get(TRANSPORT_ENV)
    os.environ[TRANSPORT_ENV] = transport
    try:
        return _train_pp(name, steps, pp, tp, dp, microbatches, schedule, virtual, batch, partition, layers,
                         bucket_bytes, with_target, options)
    finally:   # the launch's next cases run in this process
        if earlier is None:
            del os.environ[TRANSPORT_ENV]
        else:
            os.environ[TRANSPORT_ENV] = earlier


def _train_pp(name, steps, pp, tp, dp, microbatches, schedule, virtual, batch, partition, layers, bucket_bytes,
              with_target, options):
    model, loss_fn = build(name, tp, layers)
    x, y = data(name, batch)
    strategy = gp.Strategy(dp=dp, tp=tp, pp=pp, microbatches=microbatches, schedule=schedule,
                           virtual_stages=virtual, partition=partition, **(options or {}))
    local = batch // dp
    rank_dp = (dist.get_rank() // tp) % dp
    xs, ys = x[rank_dp * local:(rank_dp + 1) * local], y[rank_dp * local:(rank_dp + 1) * local]
    pm = gp.compile(model, strategy, example_inputs=(xs,), example_target=ys if with_target else None,
                    loss_fn=loss_fn, optimizer=helpers.adamw(), bucket_bytes=bucket_bytes)
    losses = [pm.train_step(xs, target=ys) for _ in range(steps - 1)]
    in_flight = _in_flight_bytes(pm, lambda: losses.append(pm.train_step(xs, target=ys)))
    sync = pm._executor.grad_sync
    out = pm(xs)
    out = out.logits if hasattr(out, "logits") else out
    return {"losses": losses, "state": helpers.loadable_state(pm, model), "out": out,
            "peaks": dict(getattr(pm._executor, "peak_in_flight", {})), "in_flight": in_flight,
            "launched_in_backward": sync.launched_in_backward if sync is not None else 0,
            "stages": sorted(pm.compiled.stages),
            "transport": "shared memory" if pm._executor._shm is not None else "gloo",
            "units": [[u.path for u in pm.compiled.stage_plan.units[b:e]]
                      for b, e in _ranges(pm.compiled.stage_plan)]}


def _in_flight_bytes(pm, step):
    """The most bytes the rank held for backward between two instructions of its schedule,
    while step() runs: what it keeps in flight from one to the next, the activations autograd
    saved and (split schedules) the output gradients pending weight gradients keep, counted
    through saved-tensor hooks (helpers.SavedBytes), parameters not. Within one instruction a
    backward holds its output gradients too, under every schedule; only a split schedule
    keeps them past it, and that is what is counted."""
    saved, run, most = helpers.SavedBytes(helpers.held_parameters(pm)), pm._executor._run, [0]

    def sampled(instr, *args):
        result = run(instr, *args)
        most[0] = max(most[0], saved.held())
        return result
    pm._executor._run = sampled
    try:
        with saved.counting():
            step()
    finally:
        del pm._executor._run   # the class's method again
    return most[0]


def _ranges(plan):
    bounds = plan.bounds + [len(plan.units)]
    return list(zip(bounds[:-1], bounds[1:]))


def build(name, tp=1, layers=2):
    if name == "bn_cnn":
        from tests.targets import dp_targets
        return dp_targets.bn_cnn(), torch.nn.functional.cross_entropy
    if name == "alexnet":
        return helpers.alexnet(), torch.nn.functional.cross_entropy
    if name == "gpt" and layers != 2:
        return helpers.tiny_gpt(n_layer=layers), helpers.lm_loss
    if name == "hf_gpt2" and layers != 2:
        return helpers.hf_gpt2(n_layer=layers), helpers.hf_causal_lm_loss
    return tp_targets.build(name, tp)


def data(name, batch):
    if name == "bn_cnn":
        from tests.targets import dp_targets
        return dp_targets.bn_batch(batch)
    if name == "alexnet":
        g = torch.Generator().manual_seed(2)
        return torch.randn(batch, 3, 63, 63, generator=g), torch.randint(0, 10, (batch,), generator=g)
    return helpers.token_batch(batch=batch)


def train_many(configs):
    """Several pipeline runs in one set of processes (process start-up dominates small runs)."""
    results = []
    for config in configs:
        results.append(train_pp(**config))
    return results


def fail_mid_schedule():
    model, loss_fn = build("gpt")
    x, y = data("gpt", 8)
    pm = gp.compile(model, gp.Strategy(pp=2, microbatches=4), example_inputs=(x,), example_target=y,
                    loss_fn=loss_fn)
    run = pm._executor._run

    def failing(instr, *args):
        if pm.mesh.pp_rank == 1 and instr.op == "forward" and instr.mb == 2:
            raise RuntimeError("injected failure in stage 1 forward, microbatch 2")
        return run(instr, *args)
    pm._executor._run = failing
    pm.train_step(x, target=y)


def uneven_batch():
    model, loss_fn = build("gpt")
    x, y = data("gpt", 8)
    pm = gp.compile(model, gp.Strategy(pp=2, microbatches=4), example_inputs=(x,), example_target=y,
                    loss_fn=loss_fn)
    pm.train_step(x[:6], target=y[:6])


def profile_partition(directory):
    """The "profile" policy times each layer on the example batch; dump writes the timeline."""
    model, loss_fn = build("gpt", layers=4)
    x, y = data("gpt", 8)
    pm = gp.compile(model, gp.Strategy(pp=2, microbatches=2, partition="profile"), example_inputs=(x,),
                    example_target=y, loss_fn=loss_fn, optimizer=helpers.adamw())
    losses = [pm.train_step(x, target=y) for _ in range(2)]
    pm.dump(directory)
    plan = pm.compiled.stage_plan
    return losses, [u.seconds for u in plan.units], plan.bounds


def profile_partition_cuts():
    """partition='profile': the cuts this rank compiled, and the ones its report plans."""
    from tests.helpers import adamw, lm_loss, tiny_gpt, token_batch
    x, y = token_batch(batch=8)
    pm = gp.compile(tiny_gpt(n_layer=4), gp.Strategy(pp=2, microbatches=2, partition="profile"), example_inputs=(x,),
                    example_target=y, loss_fn=lm_loss, optimizer=adamw())
    plan = pm.compiled.stage_plan
    return [plan.units[b].path for b in plan.bounds[1:]], pm.report().partition


def injected_delays(configs, unit_s, steps):
    """Each config's pipeline step with every compute instruction made to take fixed time: it
    sleeps `unit_s` per forward, input gradient and weight gradient (a whole backward, where
    the schedule does not split it, sleeps both), on a model so small that its own compute
    is a few percent of that. Returns, per config, this rank's timeline (pm.timeline()) of
    each of `steps` steps after one warm-up, every step started after a barrier."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(4)])
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    timelines = []
    for config in configs:
        strategy = gp.Strategy(pp=config["pp"], microbatches=config["microbatches"], schedule=config["schedule"],
                               virtual_stages=config["virtual"], partition="uniform")
        pm = gp.compile(model, strategy, example_inputs=(x,), example_target=y,
                        loss_fn=torch.nn.functional.mse_loss, optimizer=helpers.adamw())
        units = {"forward": 1, "backward": 1 if strategy.schedule in ("zero-bubble", "zbv") else 2,
                 "backward_weight": 1}
        run = pm._executor._run

        def delayed(instr, *args, run=run, units=units):
            time.sleep(units[instr.op] * unit_s)
            return run(instr, *args)
        pm._executor._run = delayed
        runs = []
        for step in range(steps + 1):
            dist.barrier()
            pm.train_step(x, target=y)
            if step:
                runs.append([(start, end, str(instr)) for start, end, instr in pm.timeline()])
        timelines.append(runs)
    return timelines
