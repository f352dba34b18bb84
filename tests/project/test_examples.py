"""Every script in examples/ runs with --small and passes its own checks (exit code 0).

Each example compares itself with single-device training or asserts what it demonstrates,
and exits non-zero on a mismatch; these tests only run them, the way a user would, from
the repository root. The multi-process ones start their own ranks (graphpar.launch or
torchrun), so each runs in a new session that is killed as a whole on timeout.
"""
from __future__ import annotations

import os
import pathlib
import shutil
import signal
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"
TIMEOUT_S = 120

PYTHON_EXAMPLES = [
    "gpt_from_scratch.py",
    "transformers_model.py",
    "alexnet_pipeline.py",
    "syncbn_data_parallel.py",
    "custom_pass.py",
    "plan_before_running.py",
    "host_placement.py",
]


def _run(command, env=None):
    environment = {**os.environ, "GRAPHPAR_TIMEOUT_S": "60", **(env or {})}
    proc = subprocess.Popen(command, cwd=REPO, env=environment, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)   # the example and every rank it started
        output, _ = proc.communicate()
        pytest.fail(f"{' '.join(map(str, command))} did not finish in {TIMEOUT_S} s:\n{output[-4000:]}")
    assert proc.returncode == 0, (f"{' '.join(map(str, command))} exited with {proc.returncode}:\n"
                                  f"{output[-4000:]}")
    return output


@pytest.mark.parametrize("script", PYTHON_EXAMPLES)
def test_example_passes_with_small(script):
    if script == "transformers_model.py":
        pytest.importorskip("transformers", reason="transformers is in the test extra")
    output = _run([sys.executable, str(EXAMPLES / script), "--small"])
    assert "PASS" in output


def _torchrun():
    beside_python = pathlib.Path(sys.executable).with_name("torchrun")
    if beside_python.exists():
        return str(beside_python)
    return shutil.which("torchrun")


def test_torchrun_two_nodes_script():
    torchrun = _torchrun()
    if torchrun is None:
        pytest.skip("torchrun is not installed (it comes with torch): cannot start the two-node run")
    for tool in ("bash", "setsid"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} is not available; examples/torchrun_two_nodes.sh needs it")
    output = _run(["bash", str(EXAMPLES / "torchrun_two_nodes.sh"), "--small"],
                  env={"TORCHRUN": torchrun, "TIMEOUT": str(TIMEOUT_S - 20)})
    assert output.count("-> PASS") == 2, output[-4000:]   # both ranks checked themselves
    assert "both nodes finished: PASS" in output


def test_every_example_is_tested():
    scripts = {p.name for p in EXAMPLES.glob("*.py")}
    assert scripts == set(PYTHON_EXAMPLES) | {"torchrun_two_nodes.py"}
