"""LR schedules on pm.optimizer (issue 17): a warmup + cosine LambdaLR stepped after every
train_step gives single-device training's trajectory in every mode that steps an optimizer
(the plain step, the host masters' fused kernel, ZeRO's shard optimizer, host tables' row-wise
optimizers, pipeline ranks' own optimizers), and a run saved mid-schedule with
save_checkpoint(lr_scheduler=) and resumed into a new compile continues it: bit for bit in the
same layout, within the resharding tolerance in another (docs/checkpoint.md). Every case of
one world size runs in one launch (tests/targets/cases.py), `cases` below."""
import pytest
import torch

import graphpar as gp
from graphpar.checkpoint.sharded import load_full_checkpoint
from tests.helpers import lm_loss, tiny_gpt, token_batch
from tests.targets import lr_schedule_targets as targets
from tests.targets.cases import SharedLaunches

# Against single-device training, as the data-parallel and ZeRO parity tests: the loss is the
# global batch's sums in another order (dp halves, tp partial sums, pp microbatches), float32
# rounding noise (1e-5); parameters get the AdamW noise bound of tests/helpers.adamw, ~1e-5
# per step at full rate, under 1e-4 over the 6 steps (the schedule only lowers the rate).
LOSS_TOL = 1e-5
PARAM_TOL = 1e-4
# Host tables with SGD (no momentum, no decay): the row-wise update is the dense one, the
# split table only regroups the same sums (tests/multiprocess/runtime/placement's EMB_TOL).
EMB_TOL = 1e-6
TOLERANCE = {"adamw": PARAM_TOL, "sgd": EMB_TOL}


def _max_diff(a, b):
    return max((a[k].float() - b[k].float()).abs().max().item() for k in b)


def test_the_schedule_moves_the_trajectory_far_beyond_the_tolerances():
    """A run that ignored the scheduler (a per-bucket copy of the rate, a table's own
    optimizer) could not pass the parity tests below: without the schedule the single-device
    state ends more than 100 tolerances away."""
    for name in ("adamw", "sgd"):
        model = targets.model_for({"offload_embedding": name == "sgd"})
        optimizer = targets.OPTIMIZERS[name]()
        _, _, scheduled = targets.train_reference(model, optimizer, targets.STEPS)
        _, rates, constant = targets.train_reference(model, optimizer, targets.STEPS, schedule=False)
        assert _max_diff(constant, scheduled) > 100 * TOLERANCE[name], name
        assert len(set(rates)) == 1


SCHEDULED = [
    ([({"dp": 2}, "adamw"),
      ({"dp": 2, "offload_optimizer": True}, "adamw"),  # host masters, torch's fused kernel per bucket
      ({"dp": 2, "zero": 1}, "adamw"),                  # the shard optimizer, stepped per bucket
      ({"dp": 2, "zero": 2, "offload_optimizer": True}, "adamw"),  # host master shards
      ({"dp": 2, "zero": 3}, "adamw"),
      ({"dp": 2, "offload_embedding": True}, "sgd")],   # host tables' row-wise optimizers follow pm.optimizer
     2),
    ([({"tp": 2, "pp": 2, "microbatches": 2}, "adamw")], 4),  # each pipeline rank schedules its own optimizer
]
STOP_AT = 3  # of targets.STEPS: saved just past the warmup, resumed into the cosine
ZERO1, PLAIN = {"dp": 2, "zero": 1}, {"dp": 2}
OFFLOAD = {"dp": 2, "offload_optimizer": True}
PIPELINE = {"tp": 2, "pp": 2, "microbatches": 2}
# saved in the first layout, resumed in each of the second (tests/targets/lr_schedule_targets.resume_scenarios)
RESUMES = {2: [(ZERO1, [ZERO1, PLAIN]), (OFFLOAD, [OFFLOAD])], 4: [(PIPELINE, [PIPELINE, {"dp": 2, "tp": 2}])]}


def cases(directory):
    """Every launched case of this module, {name: (world size, function, args)}: one launch
    per world size (tests/targets/cases.py); each resume writes under its own folder."""
    folders = {world: directory / f"world{world}" for world in RESUMES}
    for folder in folders.values():
        folder.mkdir(exist_ok=True)
    return {
        **{("scheduled", world): (world, targets.scheduled_runs, (configs,)) for configs, world in SCHEDULED},
        **{("resume", world): (world, targets.resume_scenarios, (str(folders[world]), scenarios, STOP_AT))
           for world, scenarios in RESUMES.items()},
    }


@pytest.fixture(scope="module")
def launched(directory):
    return SharedLaunches(cases(directory))


@pytest.mark.parametrize("configs, world", SCHEDULED)
def test_schedule_gives_the_single_device_trajectory(launched, configs, world):
    results = launched(("scheduled", world))
    for index, (strategy, name) in enumerate(configs):
        ref_losses, ref_rates, ref_state = targets.train_reference(targets.model_for(strategy),
                                                                   targets.OPTIMIZERS[name](), targets.STEPS)
        for rank, runs in enumerate(results):
            losses, rates, state = runs[index]
            assert rates == ref_rates, (strategy, rank)  # the same rate arithmetic, exactly
            assert losses == pytest.approx(ref_losses, abs=LOSS_TOL), (strategy, rank)
            assert _max_diff(state, ref_state) < TOLERANCE[name], (strategy, rank)


def check_resumed(results, scenarios):
    """Each rank's runs of targets.resume_scenarios against single-device training and the
    uninterrupted run: bit for bit where the layout is the saving one, within the resharding
    tolerance elsewhere; the control (loaded without the scheduler) warned and left the run."""
    ref_losses, ref_rates, _ = targets.train_reference(tiny_gpt(), targets.OPTIMIZERS["adamw"](), targets.STEPS)
    for rank, (runs, disagreeing) in enumerate(results):
        # a save given the scheduler on some ranks only is refused on every rank
        assert disagreeing.startswith("save_checkpoint: lr_scheduler= was given on rank(s) [0] and not on "
                                      "rank(s) [1"), disagreeing
        for (first, seconds), (full, resumed, control, caught, saved) in zip(scenarios, runs):
            full_losses, full_rates, full_state = full
            assert full_rates == ref_rates and full_losses == pytest.approx(ref_losses, abs=LOSS_TOL)
            for second, (losses, rates, state, loaded) in zip(seconds, resumed):
                where = (first, second, rank)
                assert loaded == saved, where  # the scheduler's position and base rates
                assert rates == full_rates[STOP_AT:], where
                if second == first:  # the same float operations as the uninterrupted run
                    assert losses == full_losses[STOP_AT:], where
                    assert all(torch.equal(state[k], v) for k, v in full_state.items()), where
                else:
                    assert losses == pytest.approx(full_losses[STOP_AT:], abs=LOSS_TOL), where
                    assert _max_diff(state, full_state) < PARAM_TOL, where
            control_losses, control_rates, control_state = control
            assert len(caught) == 1 and "lr_scheduler=scheduler" in caught[0], caught
            assert control_rates[0] == full_rates[STOP_AT] and control_rates[1:] != full_rates[STOP_AT + 1:]
            assert _max_diff(control_state, full_state) > 10 * PARAM_TOL


def test_a_run_saved_mid_schedule_resumes_it_exactly(launched, directory):
    """Saved at dp2 zero=1; resumed at dp2 zero=1 (bit for bit), at dp2 zero=0 and in one
    process, graphpar's and plain torch's (the resharding tolerance); host masters resumed
    bit for bit."""
    tmp_path, scenarios = directory / "world2", RESUMES[2]
    results = launched(("resume", 2))
    check_resumed(results, scenarios)

    # one process, graphpar: compile, a new scheduler, load, the remaining steps
    full_losses, full_rates, full_state = results[0][0][0][0]
    x, y = token_batch(batch=targets.GLOBAL_BATCH)
    pm = gp.compile(tiny_gpt(), gp.Strategy(), example_inputs=(x,), example_target=y, loss_fn=lm_loss,
                    optimizer=targets.OPTIMIZERS["adamw"]())
    scheduler = torch.optim.lr_scheduler.LambdaLR(pm.optimizer, targets.warmup_cosine)
    pm.load_checkpoint(tmp_path / "0" / "ck", lr_scheduler=scheduler)
    losses, rates = targets.train(pm, scheduler, x, y, targets.STEPS - STOP_AT)
    assert rates == full_rates[STOP_AT:]
    assert losses == pytest.approx(full_losses[STOP_AT:], abs=LOSS_TOL)
    assert _max_diff(pm.full_state_dict(), full_state) < PARAM_TOL

    # one process, plain torch: load_full_checkpoint gives torch's own state dicts
    ck = load_full_checkpoint(tmp_path / "0" / "ck")
    model = tiny_gpt()
    model.load_state_dict(ck.model)
    opt = targets.OPTIMIZERS["adamw"]()(model.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, targets.warmup_cosine)
    opt.load_state_dict(ck.optimizer_state_dict(model))
    scheduler.load_state_dict(ck.lr_scheduler)
    eager = []
    for _ in range(targets.STEPS - STOP_AT):
        opt.zero_grad()
        loss = lm_loss(model(x), y)
        loss.backward()
        opt.step()
        scheduler.step()
        eager.append(loss.item())
    assert eager == pytest.approx(full_losses[STOP_AT:], abs=LOSS_TOL)
    assert _max_diff(model.state_dict(), full_state) < PARAM_TOL


def test_pipeline_ranks_resume_their_schedules(launched):
    """tp2 x pp2: every rank schedules its own optimizer and the save keeps rank 0's; each
    rank resumes it, in the same layout (bit for bit) and at dp2 x tp2."""
    check_resumed(launched(("resume", 4)), RESUMES[4])
