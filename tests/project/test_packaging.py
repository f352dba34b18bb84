"""What `pip install .` gives a user: a wheel built from the checkout, installed without
editable mode into a fresh environment, must import and train.

./run installs graphpar in editable mode, whose finder maps the whole source tree: a
subpackage missing from the wheel (graphpar.runtime.placement once was) still imports there, so the
rest of the suite cannot notice. This module builds the wheel from a copy of the checkout,
checks it against the tree, and trains one step at world size 2 from a fresh environment.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
# Where each source directory lands in the installed package (setup.py's package_dir).
SOURCE_TO_PACKAGE = {"graphpar": "graphpar", "passes": "graphpar/passes"}
# Build outputs and environments: copying them would be slow, and a stale build/ leaks
# deleted modules into the wheel.
NOT_SOURCE = (".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache")

TRAIN_SCRIPT = '''
import functools
import json

import torch
import graphpar as gp
import graphpar.passes
from graphpar.models.gpt import GPT, GPTConfig, lm_loss

CONFIG = GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=16)
X = torch.randint(0, CONFIG.vocab_size, (4, CONFIG.block_size), generator=torch.Generator().manual_seed(0))
Y = torch.roll(X, -1, dims=1)


def model():
    torch.manual_seed(0)
    return GPT(CONFIG)


def train_one_step():
    rank = torch.distributed.get_rank()
    x, y = X.chunk(2)[rank], Y.chunk(2)[rank]   # this rank's DP-local half of the batch
    pm = gp.compile(model(), gp.Strategy(dp=2), example_inputs=(x,), example_target=y,
                    loss_fn=lm_loss, optimizer=functools.partial(torch.optim.SGD, lr=0.1))
    return {"loss": float(pm.train_step(x, target=y)),
            "graphpar": gp.__file__, "passes": graphpar.passes.__file__}


if __name__ == "__main__":
    print(json.dumps({"ranks": gp.launch(train_one_step, world_size=2),
                      "eager_loss": float(lm_loss(model()(X), Y))}))
'''


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    # A copy, because an in-tree build writes build/ and graphpar.egg-info into the checkout
    # while other tests run from it.
    source = tmp_path_factory.mktemp("source") / "graphpar"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(*NOT_SOURCE))
    out = tmp_path_factory.mktemp("wheel")
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--wheel-dir", str(out), str(source)])
    (built,) = out.glob("graphpar-*.whl")
    return built


@pytest.fixture(scope="module")
def fresh_env(wheel, tmp_path_factory) -> Path:
    """A new venv that already has torch, with the wheel installed (no editable mode)."""
    env = tmp_path_factory.mktemp("env")
    run([sys.executable, "-m", "venv", "--without-pip", str(env)])
    python = env / "bin" / "python"
    site = Path(run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"]).strip())
    # torch comes from this interpreter rather than a `pip install torch==2.13.0` into the new
    # venv: a venv with pip and that install took 100 s and 900 MB on a 2-core machine; this
    # fixture, the wheel's install included, takes about 3 s. A .pth line puts a directory of links to this interpreter's packages on
    # the new venv's path, after its own site-packages; graphpar itself (the editable
    # install's finder, .pth and metadata) is left out, so the only graphpar there is the
    # wheel's. --system-site-packages would not do: it exposes the base interpreter's
    # packages, not this venv's, where torch is.
    borrowed = env / "borrowed"
    borrowed.mkdir()
    torch_site = Path(torch.__file__).resolve().parents[1]
    for entry in torch_site.iterdir():
        if "graphpar" not in entry.name.lower():
            (borrowed / entry.name).symlink_to(entry)
    (site / "borrowed.pth").write_text(f"{borrowed}\n")
    # --no-index: the dependencies (torch, numpy, tqdm) must already be satisfied, and the
    # test must not reach for the network or install a second torch.
    run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-index", str(wheel)])
    return env


def run(command: list[str], cwd: Path | None = None) -> str:
    """Run outside the checkout's influence (no PYTHONPATH) and fail with its output."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{command} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def test_wheel_ships_every_module_assets_and_license(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = {f"{package}/{path.relative_to(ROOT / source).as_posix()}"
                for source, package in SOURCE_TO_PACKAGE.items()
                for path in (ROOT / source).rglob("*.py")}
    expected |= {f"graphpar/assets/{path.name}" for path in (ROOT / "graphpar" / "assets").glob("*.txt")}
    assert "graphpar/runtime/placement/__init__.py" in expected  # the subpackage that once went missing
    assert not expected - names, f"missing from the wheel (a directory without __init__.py?): {sorted(expected - names)}"
    dist_info = f"graphpar-{wheel.name.split('-')[1]}.dist-info"
    assert f"{dist_info}/licenses/LICENSE" in names
    # Nothing else at the top: passes/ must not install as a package of its own.
    assert {name.split("/")[0] for name in names} == {"graphpar", dist_info}


def test_installed_wheel_trains_one_step_at_world_size_2(fresh_env, tmp_path):
    # From an empty directory, so the checkout's graphpar/ cannot be imported by accident.
    (tmp_path / "train_one_step.py").write_text(TRAIN_SCRIPT)
    result = json.loads(run([str(fresh_env / "bin" / "python"), "train_one_step.py"], cwd=tmp_path))
    for rank in result["ranks"]:
        assert Path(rank["graphpar"]).is_relative_to(fresh_env), rank
        assert Path(rank["passes"]).is_relative_to(fresh_env), rank
        # train_step returns the mean loss over both ranks' halves, which is the eager loss
        # of the whole batch; float32 sums in a different order differ by a few ulps.
        assert rank["loss"] == pytest.approx(result["eager_loss"], rel=1e-5)


def test_installed_command_line_starts(fresh_env, tmp_path):
    assert "demo" in run([str(fresh_env / "bin" / "graphpar"), "--help"], cwd=tmp_path)
