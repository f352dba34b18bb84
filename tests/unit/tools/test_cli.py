"""The `graphpar` command line, run as a user runs it: in a separate process (the demo, which
starts 8 ranks: tests/multiprocess/tools/test_cli.py).

Plus the demo's parity check seen failing, in-process: a check that cannot fail proves nothing.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import subprocess
import sys

import torch

import graphpar
from graphpar.tools import demo
from tests.targets import plan_targets


TIMEOUT_S = 300  # generous for 2 busy cores; a hang fails instead of blocking the suite


def graphpar_cli(*args: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "graphpar.tools.cli", *args], capture_output=True,
                          text=True, timeout=TIMEOUT_S, cwd=cwd)


def test_help_lists_the_subcommands():
    result = graphpar_cli("--help")
    assert result.returncode == 0, result.stderr
    for command in ("demo", "plan", "dump"):
        assert command in result.stdout


def test_dump_gpt_writes_and_lists_files(tmp_path):
    out = tmp_path / "dumps"
    result = graphpar_cli("dump", "gpt", "--out", str(out), "--layers", "1")
    assert result.returncode == 0, result.stdout + result.stderr
    written = sorted(p for p in out.rglob("*") if p.is_file())
    assert written
    for path in written:
        assert str(path) in result.stdout


def test_dump_accepts_a_factory(tmp_path):
    (tmp_path / "my_models.py").write_text(
        "import torch\n"
        "def make():\n"
        "    model = torch.nn.Sequential(torch.nn.Linear(4, 3))\n"
        "    return model, (torch.randn(2, 4),), torch.nn.functional.mse_loss, torch.randn(2, 3)\n")
    result = graphpar_cli("dump", "my_models:make", "--out", "dumps", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert list((tmp_path / "dumps").rglob("*.py"))


def test_dump_reports_a_bad_spec_without_a_traceback(tmp_path):
    result = graphpar_cli("dump", "no_such_module:make", "--out", str(tmp_path))
    assert result.returncode == 1
    assert "could not be imported" in result.stderr
    assert "Traceback" not in result.stderr


def test_plan_prints_each_rank(tmp_path):
    out = tmp_path / "plan.json"
    result = graphpar_cli("plan", "--dp", "2", "--tp", "2", "--pp", "2", "--microbatches", "2",
                          "--json", str(out))
    assert result.returncode == 0, result.stderr
    assert "world 8, dp=2 tp=2 pp=2" in result.stdout and "bubble" in result.stdout
    report = json.loads(out.read_text())
    assert len(report["ranks"]) == 8 and report["ranks"][0]["param_bytes"] > 0


def test_plan_flags_for_placement_and_sequence_parallelism(tmp_path):
    out = tmp_path / "plan.json"
    base = graphpar_cli("plan", "--tp", "2", "--json", str(out))
    assert base.returncode == 0, base.stderr
    plain = json.loads(out.read_text())["ranks"][0]
    result = graphpar_cli("plan", "--tp", "2", "--sequence-parallel", "--offload-optimizer", "--param-dtype", "bf16",
                          "--backend", "nccl", "--json", str(out))
    assert result.returncode == 0, result.stderr
    placed = json.loads(out.read_text())
    rank = placed["ranks"][0]
    assert placed["strategy"]["sequence_parallel"] and placed["strategy"]["param_dtype"] == "bfloat16"
    assert rank["param_bytes"] * 2 == plain["param_bytes"] and rank["optimizer_bytes"] == 0
    assert rank["host_bytes"] > 0 and "to_host" in result.stdout and "reduce_scatter" in result.stdout
    # bf16 gradients instead of the default fp32 ones: 2 bytes per parameter instead of 4
    result = graphpar_cli("plan", "--tp", "2", "--param-dtype", "bf16", "--reduce-dtype", "bf16", "--json", str(out))
    assert result.returncode == 0, result.stderr
    bf16 = json.loads(out.read_text())
    assert bf16["strategy"]["reduce_dtype"] == "bfloat16" and bf16["ranks"][0]["grad_bytes"] * 2 == rank["grad_bytes"]

def test_plan_zero_flag(tmp_path):
    out = tmp_path / "plan.json"
    result = graphpar_cli("plan", "--dp", "2", "--zero", "2", "--backend", "nccl", "--json", str(out))
    assert result.returncode == 0, result.stderr
    report = json.loads(out.read_text())
    assert report["strategy"]["zero"] == 2 and report["ranks"][0]["grad_bytes"] == 0
    assert "reduce_scatter" in result.stdout and "zero=2 over dp=2" in result.stdout
    # gloo has no reduce-scatter of its own: the plan names the messages that run instead
    gloo = graphpar_cli("plan", "--dp", "2", "--zero", "2", "--backend", "gloo")
    assert gloo.returncode == 0, gloo.stderr
    assert "reduce_scatter" not in gloo.stdout and "a row to each other rank" in gloo.stdout


def test_parity_check_fails_when_graphpar_diverges(monkeypatch):
    """A compiled copy with a different learning rate stands in for a wrong gradient."""
    def compile_wrong_lr(model, config, example):
        x, y = example
        return graphpar.compile(model, config.strategy, example_inputs=(x,), example_target=y,
                                loss_fn=demo.lm_loss,
                                optimizer=functools.partial(torch.optim.AdamW, lr=2 * config.lr))

    monkeypatch.setattr(demo, "compile_model", compile_wrong_lr)
    config = dataclasses.replace(demo.DemoConfig(), check_steps=3)
    initial = demo.build_model(config).state_dict()
    parity = demo.check_parity(initial, demo.load_corpus(), config)
    assert not parity["passed"]
    assert parity["max_param_diff"] > parity["param_tolerance"]
    assert parity["max_loss_diff"] > parity["loss_tolerance"]


def test_plan_auto_with_a_budget_no_replica_meets_picks_zero_and_says_why():
    """`graphpar plan --auto --world-size 8 --memory-budget B` on a model only dp can split
    (tests/targets/plan_targets.one_layer), B between the least peak of a ZeRO plan and of a
    zero=0 plan."""
    _, budget, closest = plan_targets.zero_only_budget(8)
    result = graphpar_cli("plan", "--auto", "--world-size", "8", "--memory-budget", str(budget),
                          "tests.targets.plan_targets:one_layer")
    assert result.returncode == 0, result.stdout + result.stderr
    winner = next(line for line in result.stdout.splitlines() if line.startswith("winner: "))
    zero = int(winner.split(" zero=")[1].split()[0])
    assert winner.startswith("winner: dp=8 ") and zero > 0
    assert (f"zero={zero} because no zero=0 strategy meets the memory budget of {budget:,} bytes: the closest, "
            f"{closest.label()}, is over it by {int(closest.terms['peak_bytes']) - budget:,} bytes") in result.stdout
    assert "zero=0 with the same layout: peak" in result.stdout


def test_plan_auto_with_a_budget_no_plan_without_recomputation_meets_picks_recomputation_and_says_why():
    """`graphpar plan --auto --world-size 2 --memory-budget B` on the tiny GPT with 4 blocks
    (tests/targets/plan_targets.gpt_blocks), B below the least peak of any plan without
    recomputation and above that of a recompute plan."""
    _, budget, closest = plan_targets.recompute_only_budget(2)
    result = graphpar_cli("plan", "--auto", "--world-size", "2", "--memory-budget", str(budget),
                          "tests.targets.plan_targets:gpt_blocks")
    assert result.returncode == 0, result.stdout + result.stderr
    winner = next(line for line in result.stdout.splitlines() if line.startswith("winner: "))
    mode = winner.split(" recompute=")[1].split()[0]
    assert (f"recompute={mode} because no strategy without recomputation meets the memory budget of {budget:,} "
            f"bytes: the closest, {closest.label()}, is over it by "
            f"{int(closest.terms['peak_bytes']) - budget:,} bytes") in result.stdout
    assert "recompute=None with the same layout: peak" in result.stdout
    assert "| of which recompute |" in result.stdout   # the recompute share of compute, per strategy
