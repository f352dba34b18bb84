"""ZeRO-1 and ZeRO-2 with pipeline parallelism: each pipeline rank shards its own stages'
optimizer states (and gradients) over its dp group, under every schedule, with the GPT's
tied embedding and LM head on the first and last stage; against single-device training.
Every case of one world size runs in one launch (tests/targets/cases.py), `cases` below."""
import pytest
import torch

import graphpar as gp
from graphpar.checkpoint.sharded import load_full_checkpoint
from tests.helpers import lm_loss, tiny_gpt, token_batch, train_reference
from tests.multiprocess.planner.test_plan import _planned
from tests.multiprocess.runtime.test_zero import LOSS_TOL, PARAM_TOL, STATE_ELEMENTS, check_parity, reference
from tests.targets import pp_targets, plan_targets, zero_targets
from tests.targets.cases import SharedLaunches

# Tolerances are test_zero.py's, for the same reasons: a pipeline adds no rounding of its own
# (microbatch losses are means of equal microbatches, as at pp=1; a stage's gradients are
# the same sums), so the losses differ from single-device by float32 rounding (LOSS_TOL, 1e-5)
# and parameters by the AdamW noise bound of tests/helpers.adamw (PARAM_TOL, 1e-4).
STEPS = 3
# Per schedule, the runs that share one set of processes: (zero, optimizer, microbatches,
# global batch, other strategy fields). Microbatches 2 to 4 (3 on a batch of 12: 6 rows per
# dp rank), AdamW and SGD with momentum, zero=1 and zero=2 under each schedule, and fp32 master
# shards on the host (offload_optimizer) once.
RUNS = {
    "gpipe": [(1, "adamw", 2, 8, {}), (2, "sgd", 4, 8, {})],
    "1f1b": [(1, "sgd", 4, 8, {}), (2, "adamw", 3, 12, {}), (2, "adamw", 2, 8, {"offload_optimizer": True})],
    "interleaved-1f1b": [(1, "adamw", 4, 8, {"virtual_stages": 2}), (2, "sgd", 2, 8, {"virtual_stages": 2})],
}


def _peers(held, *fields):
    """The ranks' records grouped by the given mesh coordinates."""
    groups = {}
    for h in held:
        groups.setdefault(tuple(h[f] for f in fields), []).append(h)
    return groups


def check_shares(held, zero, optimizer_name, steps):
    """Each pipeline rank's parameters are split over its dp group, element by element, and
    its dp collectives go in one order on every dp peer, the buckets starting in backward."""
    for peers in _peers(held, "pp_rank", "tp_rank").values():
        assert sum(h["owned"] for h in peers) == peers[0]["elements"]
        # every rank of a dp group issues the same collectives in the same order on each of its
        # two dp process groups (gloo pairs them up)
        assert all(h["issued"] == peers[0]["issued"] for h in peers)
    for h in held:
        assert h["state_elements"] == STATE_ELEMENTS[optimizer_name] * h["owned"]
        assert h["grads"] == [zero == 1] * len(h["grads"])  # zero=2 frees them into the reduce buffer
        for op, names in h["issued"].items():
            assert sorted(names) == sorted(f"{op}_{k}" for k in range(h["buckets"]) for _ in range(steps))
        # a stage's buckets start during its last backward, except the one holding the tied
        # weight (wte on the first and last stage), which waits for the sum across pp ranks
        assert h["tied_buckets"] == 1
        assert h["launched_in_backward"] == (h["buckets"] - h["tied_buckets"]) * steps


def check_tied_copies(held):
    """Both pipeline ranks' copies of the tied weight took the same steps: the gradient was
    summed across them before either reduce-scatter read it, and the update is elementwise."""
    for peers in _peers(held, "dp_rank", "tp_rank").values():
        first = peers[0]["tied_copies"]
        assert first.keys() == {"wte.weight"}
        for h in peers[1:]:
            for name, value in first.items():
                torch.testing.assert_close(h["tied_copies"][name], value, atol=0, rtol=0, msg=name)


# zero=3 under each schedule: (schedule, microbatches, optimizer, other strategy fields)
ZERO3_RUNS = [("gpipe", 2, "adamw", {}), ("1f1b", 4, "sgd", {}),
              ("interleaved-1f1b", 4, "adamw", {"virtual_stages": 2}), ("1f1b", 2, "adamw", {"offload_optimizer": True})]
CHECKPOINT_STEPS, CHECKPOINT_BATCH = 2, 8
# the layouts a checkpoint saved at dp=2 x pp=2, zero=2 loads into, by world size; the second
# cuts the stages (so buckets and shards) otherwise
RESUME_LAYOUTS = {2: gp.Strategy(dp=2),
                  4: gp.Strategy(dp=2, pp=2, zero=1, microbatches=2, schedule="interleaved-1f1b", virtual_stages=2)}
# fp32 parameters stepped in place, and fp32 master shards on the host, which loading must refresh
LOADING = [gp.Strategy(dp=2, pp=2, zero=1, microbatches=2),
           gp.Strategy(dp=2, pp=2, zero=2, microbatches=2, offload_optimizer=True)]
LOADING_STEPS = 2
PLANNED = gp.Strategy(dp=2, pp=2, zero=1, microbatches=2)


def loaded_weights():
    """Weights unlike the compiled model's (which every rank builds with seed 0), the tied
    embedding and LM head moved together."""
    model = tiny_gpt()
    with torch.no_grad():
        g = torch.Generator().manual_seed(5)
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return model


def cases(directory):
    """Every launched case of this module: {name: (world size, function, args)}. The resumes
    load the checkpoint "save" writes: at world size 4 they come after it in the same launch, and
    the test asks for "save" before it asks for the world of 2's resume."""
    path = str(directory / "A")
    return {
        **{("schedule", schedule): (4, zero_targets.train_pipeline, ([
            (gp.Strategy(dp=2, pp=2, zero=zero, microbatches=m, schedule=schedule, **extra).to_dict(), STEPS,
             batch, optimizer_name) for zero, optimizer_name, m, batch, extra in runs],))
           for schedule, runs in RUNS.items()},
        "zero3": (4, zero_targets.train_pipeline, ([
            (gp.Strategy(dp=2, pp=2, zero=3, microbatches=m, schedule=schedule, **extra).to_dict(), STEPS, 8,
             optimizer_name) for schedule, m, optimizer_name, extra in ZERO3_RUNS],)),
        **{("eight", zero): (8, zero_targets.train_pipeline, ([
            (gp.Strategy(dp=2, tp=2, pp=2, zero=zero, microbatches=2).to_dict(), STEPS, 8, "adamw")],))
           for zero in (1, 3)},
        "save": (4, zero_targets.save_pipeline, (path, CHECKPOINT_STEPS, CHECKPOINT_BATCH)),
        **{("resume", size): (size, zero_targets.resume, (path, strategy.to_dict(), CHECKPOINT_BATCH))
           for size, strategy in RESUME_LAYOUTS.items()},
        "load_then_train": (4, zero_targets.load_then_train, (
            [(s.to_dict(), LOADING_STEPS, 8, "adamw") for s in LOADING], loaded_weights().state_dict())),
        "plan": (4, plan_targets.measure, ("gpt", PLANNED.to_dict())),
    }


@pytest.fixture(scope="module")
def launched(directory):
    return SharedLaunches(cases(directory))


@pytest.mark.parametrize("schedule", list(RUNS))
def test_zero_with_pipeline_matches_single_device(launched, schedule):
    per_rank = launched(("schedule", schedule))
    for i, (zero, optimizer_name, _, batch, _) in enumerate(RUNS[schedule]):
        results = [runs[i] for runs in per_rank]
        check_parity(results, optimizer_name, STEPS, batch, dp=2)
        held = [r[3] for r in results]
        check_shares(held, zero, optimizer_name, STEPS)
        check_tied_copies(held)


def check_zero3_shares(held, optimizer_name, steps):
    """zero=3: each pipeline rank holds only its shard of its stages' weights; its buckets start
    during the stage's last backward, but the tied weight's, which waits for the pp sum."""
    for peers in _peers(held, "pp_rank", "tp_rank").values():
        assert sum(h["owned"] for h in peers) == peers[0]["elements"]
    for h in held:
        assert h["held_parameter_elements"] == h["shard"]
        assert h["state_elements"] == STATE_ELEMENTS[optimizer_name] * h["owned"]
        assert h["tied_buckets"] == 1
        assert h["launched_in_backward"] == (h["buckets"] - h["tied_buckets"]) * steps


def test_zero3_with_pipeline_matches_single_device_under_every_schedule(launched):
    per_rank = launched("zero3")
    for i, (_, _, optimizer_name, _) in enumerate(ZERO3_RUNS):
        results = [runs[i] for runs in per_rank]
        check_parity(results, optimizer_name, STEPS, 8, dp=2)
        held = [r[3] for r in results]
        check_zero3_shares(held, optimizer_name, STEPS)
        check_tied_copies(held)


@pytest.mark.parametrize("zero", [1, 3])
def test_zero_with_tensor_and_pipeline_parallelism_on_eight_processes_matches_single_device(launched, zero):
    [results] = zip(*launched(("eight", zero)))
    check_parity(results, "adamw", STEPS, 8, dp=2)
    held = [r[3] for r in results]
    if zero == 3:
        check_zero3_shares(held, "adamw", STEPS)
    else:
        check_shares(held, zero, "adamw", STEPS)
    check_tied_copies(held)
    assert len(_peers(held, "pp_rank", "tp_rank")) == 4  # four dp groups, each sharding its own stage's shards


def test_checkpoint_saved_with_zero_and_pipeline_loads_under_other_layouts(launched, directory):
    steps, batch, path = CHECKPOINT_STEPS, CHECKPOINT_BATCH, str(directory / "A")
    saved = launched("save")
    model, ref_losses, opt = reference("adamw", steps, batch)
    # the checkpoint holds the whole model and the whole optimizer state (gathered from the
    # four ranks' shards): the single-device run's
    checkpoint = load_full_checkpoint(path)
    for key, value in model.state_dict().items():
        torch.testing.assert_close(checkpoint.model[key], value, atol=PARAM_TOL, rtol=0, msg=key)
    for name, p in model.named_parameters():
        for entry in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(checkpoint.optimizer[name][entry], opt.state[p][entry], atol=PARAM_TOL, rtol=0,
                                       msg=f"{name} {entry}")
        assert float(checkpoint.optimizer[name]["step"]) == steps
    dp_only = launched(("resume", 2))
    alone = zero_targets.resume(path, gp.Strategy().to_dict(), batch)  # one process, no process group
    # and back into ZeRO with a pipeline whose stages (so buckets and shards) are cut otherwise
    other_cut = launched(("resume", 4))
    for losses, straight, after in saved:
        assert losses == pytest.approx(ref_losses, abs=LOSS_TOL)
        for loaded, loss, stepped in [*dp_only, alone, *other_cut]:
            for key, value in checkpoint.model.items():
                assert torch.equal(loaded[key], value), key  # loaded as saved, bit for bit
            # the same state going in: the next step agrees with the run that saved it
            assert loss == pytest.approx(straight, abs=LOSS_TOL)
            for key, value in after.items():
                torch.testing.assert_close(stepped[key], value, atol=PARAM_TOL, rtol=0, msg=key)


def test_load_full_state_dict_with_zero_and_pipeline_trains_from_the_loaded_weights(launched):
    model = loaded_weights()
    state, steps, batch = model.state_dict(), LOADING_STEPS, 8
    x, y = token_batch(batch=batch)
    trained, ref_losses = train_reference(model, [(x, y)], lm_loss, zero_targets.optimizer("adamw"), steps)
    for runs in launched("load_then_train"):
        for loaded, losses, after in runs:
            for key, value in state.items():
                assert torch.equal(loaded[key], value), key
            assert losses == pytest.approx(ref_losses, abs=LOSS_TOL)
            for key, value in trained.state_dict().items():
                torch.testing.assert_close(after[key], value, atol=PARAM_TOL, rtol=0, msg=key)


def test_plan_bytes_at_dp_2_pp_2_zero_1_equal_what_each_rank_holds(launched):
    strategy = PLANNED
    model, loss_fn = pp_targets.build("gpt", 1)
    x, y = pp_targets.data("gpt", 8)
    report = gp.plan(model, strategy, (x[:4],), loss_fn=loss_fn, optimizer=zero_targets.optimizer("adamw"),
                     example_target=y[:4], bucket_bytes=4096)
    assert [note.split(": zero=1 over dp=2")[0] for note in report.notes] == ["pp rank 0", "pp rank 1"]
    for measured in launched("plan"):
        planned = report.ranks[measured["rank"]]
        assert (planned.param_bytes, planned.grad_bytes, planned.optimizer_bytes) == \
            (measured["param_bytes"], measured["grad_bytes"], measured["optimizer_bytes"])
        # every reduce-scatter, all-gather, tied-weight all-reduce, send and receive of a step
        assert _planned(report, measured["rank"]) == measured["counts"]
