"""What the benchmark scripts share: the machine a run was made on and its load, the command
that reproduces it, where --out may write, the statistics of their tables, and the GPT and
batch the distributed benchmarks train.

The scripts run as `python benchmarks/NAME.py`, which puts benchmarks/ first on sys.path, so
they `import _common`; the processes graphpar.launch spawns inherit that path, so functions
the scripts hand to it may use this module too. Importing it does not import torch:
run_all.py uses it and may run with a python without torch; the functions that need torch
or graphpar import them when called.
"""
from __future__ import annotations

import argparse
import os
import pathlib
import platform
import shlex
import statistics
import sys
from typing import Iterable, List, Optional, Sequence

REPO = pathlib.Path(__file__).resolve().parent.parent
PYTHON = ".venv/bin/python"   # as the commands in the reports spell it: from the repository root


# ---- the machine -------------------------------------------------------------------------------

def cpu_model(unknown: Optional[str] = None) -> str:
    """The CPU's model name (/proc/cpuinfo); where there is none, platform.processor(), or
    `unknown` (default platform.machine()) when that is empty too."""
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or (platform.machine() if unknown is None else unknown)


def usable_cores() -> int:
    """The cores this process may run on (its affinity), which can be fewer than the machine's."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def load_average() -> str:
    """'1.23/4.56/7.89' (1, 5 and 15 minutes), 'n/a' where the OS has none. Other work on the
    machine shows up as noise in the timings; above the core count, it shared the cores."""
    return "/".join(f"{x:.2f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "n/a"


def machine() -> str:
    """One line for a single-process benchmark: CPU, cores, the 1-minute load average at the
    time of the call, Python, torch, OS."""
    import torch

    # The load average tells a reader whether other work shared the cores during the run.
    load = ", load average %.1f" % os.getloadavg()[0] if hasattr(os, "getloadavg") else ""
    return (f"{cpu_model()}, {usable_cores()} usable of {os.cpu_count()} cores{load}; Python "
            f"{platform.python_version()}, torch {torch.__version__}, {platform.system()}")


def distributed_machine(ranks: str, cpu_count: bool = False) -> str:
    """One line for a gloo benchmark: CPU, cores (with os.cpu_count() when asked), OS, Python,
    torch, then `ranks` (how the ranks use the cores, e.g. '1 thread per rank')."""
    import torch

    count = f"os.cpu_count() {os.cpu_count()}, " if cpu_count else ""
    return (f"{cpu_model('unknown CPU')}, {count}{usable_cores()} cores available; "
            f"{platform.system()} {platform.release()}; Python {platform.python_version()}, "
            f"torch {torch.__version__}, gloo, {ranks}")


# ---- reproducing a run -------------------------------------------------------------------------

def command(script: str, args: Optional[Sequence[str]] = None, quote: bool = False) -> str:
    """The command, from the repository root, that runs benchmarks/`script` with `args`
    (default: this process's own arguments); `quote` quotes them for a shell."""
    words = [PYTHON, f"benchmarks/{script}", *(sys.argv[1:] if args is None else args)]
    return shlex.join(words) if quote else " ".join(words)


def reproduce_lines(ranks: str, load_before: str, load_after: str, script: str,
                    cpu_count: bool = False) -> List[str]:
    """The closing lines of a distributed benchmark's report: the machine, the load average
    before and after the run, and the command that reproduces it."""
    return [f"Machine: {distributed_machine(ranks, cpu_count)}; load average (1/5/15 min) "
            f"{load_before} before, {load_after} after",
            "",
            f"Reproduce: `{command(script)}`"]


def launch(fn, world_size: int, args: tuple):
    """graphpar.launch(fn, world_size, args), with the load average just before and just
    after: (results by rank, load before, load after)."""
    import graphpar

    before = load_average()
    results = graphpar.launch(fn, world_size=world_size, args=args)
    return results, before, load_average()


# ---- --out: results stay out of the repository ----------------------------------------------

def in_repo(path: pathlib.Path) -> bool:
    """Whether the resolved `path` is the repository or lies inside it."""
    return path == REPO or REPO in path.parents


def add_out_option(parser: argparse.ArgumentParser, example: str) -> None:
    """--out FILE: also write the report there; a path inside the repository is refused
    (results are machine-specific), `example` is the path the refusal suggests."""
    def output_path(text: str) -> pathlib.Path:
        path = pathlib.Path(text).resolve()
        if in_repo(path):
            raise SystemExit(f"--out {text}: results are machine-specific and stay out of the repository; "
                             f"give a path outside {REPO}, e.g. {example}")
        return path

    parser.add_argument("--out", type=output_path, help="also write the table here (outside the repository)")


def emit(table: str, out: Optional[pathlib.Path]) -> None:
    """Print the report; with --out, write it there too and say so."""
    print(table)
    if out:
        out.write_text(table + "\n")
        print(f"\nwritten to {out}")


# ---- statistics --------------------------------------------------------------------------------

def iqr(values: Sequence[float]) -> float:
    """Interquartile range (0 for fewer than two values)."""
    if len(values) < 2:
        return 0.0
    q = statistics.quantiles(values, n=4)
    return q[2] - q[0]


def slowest_rank(per_rank: Iterable[Sequence[float]]) -> List[float]:
    """Step by step, the slowest rank's time: every step starts after a barrier, so that is
    the time the step took. `per_rank`: each rank's list of times, in the same order."""
    return [max(values) for values in zip(*per_rank)]


def median_ratio(times: Sequence[float], reference: Sequence[float]) -> float:
    """Median of the paired ratios times[i] / reference[i]: the two of a pair ran in the same
    round and shared whatever else the machine was doing then, which pairing cancels."""
    return statistics.median(t / r for t, r in zip(times, reference))


# ---- the model the distributed benchmarks train --------------------------------------------

def add_model_options(parser: argparse.ArgumentParser, *, layers: int, embd: int, heads: int, vocab: int,
                      seq: int, batch: int, batch_help: Optional[str] = None) -> None:
    """--layers --embd --heads --vocab --seq --batch: the GPT's size and the batch."""
    for name, default in (("layers", layers), ("embd", embd), ("heads", heads), ("vocab", vocab), ("seq", seq)):
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--batch", type=int, default=batch, help=batch_help)


def gpt(args: argparse.Namespace, **config):
    """graphpar.models.gpt's GPT of the size add_model_options asked for, with seed 0: the
    same initial weights in every process that builds it. `config`: further GPTConfig fields."""
    import torch
    from graphpar.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=args.vocab, block_size=args.seq, n_layer=args.layers,
                         n_head=args.heads, n_embd=args.embd, **config))


def token_batch(args: argparse.Namespace, seed: int):
    """(inputs, targets) of args.batch random sequences of args.seq tokens, the targets the
    inputs shifted by one; the same for the same seed."""
    import torch

    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def eager_train_step(model, optimizer, x, y, group, world: int) -> float:
    """One step of a torch-wrapped model (DDP, FSDP2, ZeroRedundancyOptimizer's) with the
    GPT's loss, returning the global mean loss over `group`: graphpar's train_step does that
    all-reduce too, so the peers do the same work."""
    import torch.distributed as dist
    from graphpar.models.gpt import lm_loss

    optimizer.zero_grad(set_to_none=True)
    loss = lm_loss(model(x), y)
    loss.backward()
    optimizer.step()
    loss = loss.detach().clone()
    dist.all_reduce(loss, group=group)
    return float(loss) / world
