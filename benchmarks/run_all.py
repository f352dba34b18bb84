"""Run every benchmark, collect their markdown tables in one results.md, and plot the ratios.

    .venv/bin/python benchmarks/run_all.py [--quick] [--out DIR] [--only compile,dp,...]
    ./run bench [--quick] ...                      # the same

Each benchmark script runs as its own subprocess with the venv's python, from the repository
root, with a time limit (its whole process group is ended when it runs over). What a script
prints on stdout is its report: markdown with one or more tables. This script keeps that
text as it is, reads the numbers it needs out of the tables by column header (not by
position), and writes into --out (default benchmarks/results/, which git ignores):

    results.md           machine details (CPU, cores, load average at the start and the end,
                         Python, torch, date, commit), a summary, then every benchmark's
                         report and the command that reproduces it
    results.json         the numbers read from the tables
    *.png                graphpar / peer step-time ratios (one bar chart per comparison, with
                         the line at 1.0) and compile / planning time against depth
    logs/NAME.stdout.md, logs/NAME.stderr.log    each script's raw output

--quick passes each script the options it has for fewer rounds (bench_compile.py has none, so
it runs in full); a quick run takes about 7-10 minutes on 2 cores. Plots need matplotlib,
which is not a graphpar dependency: when it is missing, it is installed into .venv with the
venv's pip (quietly) the first time plots are made; if that fails, the plots are skipped and
results.md says so. Nothing is written into the repository outside git-ignored paths.
"""
from __future__ import annotations

import argparse
import datetime
import importlib
import importlib.util
import json
import os
import pathlib
import platform
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import _common
from _common import REPO

VENV = REPO / ".venv"
VENV_PYTHON = VENV / "bin" / "python"
DEFAULT_OUT = REPO / "benchmarks" / "results"


@dataclass
class Bench:
    key: str
    script: str
    title: str
    timeout: int                     # seconds, full run
    quick_timeout: int               # seconds, --quick
    quick_args: List[str]            # what --quick passes (the script's own options)
    kind: str                        # "layers": time vs depth; "ratio": graphpar / peer


BENCHES = [
    Bench("compile", "bench_compile.py", "Compile time vs depth", 900, 300, [], "layers"),
    Bench("planning", "bench_planning.py", "Planning time vs depth", 900, 300, ["--runs", "1"], "layers"),
    Bench("data_parallel", "bench_data_parallel.py", "Data parallelism: graphpar vs DDP", 1200, 300,
          ["--warmup", "2", "--steps", "12"], "ratio"),
    Bench("tensor_parallel", "bench_tensor_parallel.py",
          "Tensor parallelism: graphpar vs DTensor and hand-written Megatron", 1200, 300,
          ["--rounds", "6", "--steps", "2"], "ratio"),
    Bench("pipeline_parallel", "bench_pipeline_parallel.py",
          "Pipeline parallelism: graphpar vs torch.distributed.pipelining", 2400, 600, ["--quick"], "ratio"),
    Bench("host_optimizer", "bench_host_optimizer.py", "Host optimizer: graphpar's host step vs torch AdamW",
          900, 240, ["--params", "4000000", "--rounds", "6", "--steps", "3"], "ratio"),
    Bench("zero", "bench_zero.py", "ZeRO: graphpar vs ZeroRedundancyOptimizer and FSDP2", 900, 300,
          ["--quick"], "ratio"),
    Bench("recompute", "bench_recompute.py", "Activation recomputation: graphpar vs torch.utils.checkpoint", 1200,
          600, ["--quick"], "ratio"),
]
ALIASES = {"dp": "data_parallel", "tp": "tensor_parallel", "pp": "pipeline_parallel", "plan": "planning",
           "host": "host_optimizer"}


def log(message: str) -> None:
    print(f"run_all: {message}", file=sys.stderr, flush=True)


# ---- markdown tables -------------------------------------------------------------------------

@dataclass
class Table:
    header: List[str]
    rows: List[List[str]]

    def col(self, name: str, prefix: bool = False) -> Optional[int]:
        """Index of the column named `name` (exact, case and spacing ignored), else the first
        whose name starts with it when prefix is set."""
        want = _norm(name)
        for i, h in enumerate(self.header):
            if _norm(h) == want:
                return i
        if prefix:
            for i, h in enumerate(self.header):
                if _norm(h).startswith(want):
                    return i
        return None

    def cell(self, row: List[str], index: Optional[int]) -> str:
        return row[index] if index is not None and index < len(row) else ""


def _norm(text: str) -> str:
    return " ".join(text.replace("*", "").replace("`", "").lower().split())


def _cells(line: str) -> List[str]:
    line = line.strip()
    if line.startswith("|"):
        line = line[1:]
    if line.endswith("|"):
        line = line[:-1]
    return [c.strip() for c in line.split("|")]


def tables(text: str) -> List[Table]:
    """Every markdown table in text (outside code fences): a header row, a |---| row, rows."""
    found, block, fenced = [], [], False

    def close():
        if len(block) >= 2 and all(re.fullmatch(r":?-{1,}:?", c) for c in _cells(block[1])):
            found.append(Table(_cells(block[0]), [_cells(b) for b in block[2:]]))
        block.clear()

    for line in text.splitlines():
        if line.strip().startswith("```"):
            fenced = not fenced
            close()
            continue
        if not fenced and line.strip().startswith("|"):
            block.append(line)
        else:
            close()
    close()
    return found


def number(cell: str) -> Optional[float]:
    """The first number in a cell ('**0.981**' -> 0.981, '17.8%' -> 17.8); None for n/a."""
    m = re.search(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?", cell.replace(",", ""))
    return float(m.group()) if m else None


def numbers(cell: str) -> List[Optional[float]]:
    """'1.040 / 1.054 / 0.98' -> [1.04, 1.054, 0.98]."""
    return [number(part) for part in re.sub(r"(?i)n/a", "na", cell).split("/")]


def find_table(all_tables: List[Table], *columns: str, prefix: bool = False) -> Optional[Table]:
    for t in all_tables:
        if all(t.col(c, prefix) is not None for c in columns):
            return t
    return None


# ---- what each benchmark's tables say -----------------------------------------------------------
# Layer benchmarks: {"series": {label: [[layers, seconds], ...]}, "verdicts": [...]}
# Ratio benchmarks: {"groups": [[peer, [[metric, ratio], ...]], ...]}  (ratio = graphpar / peer)

def extract_compile(text: str) -> dict:
    t = find_table(tables(text), "front end", "layers", "median (s)")
    if t is None:
        raise ValueError("no table with the columns 'front end', 'layers', 'median (s)'")
    fe, layers, median = t.col("front end"), t.col("layers"), t.col("median (s)")
    series: Dict[str, List[List[float]]] = {}
    for row in t.rows:
        n, s = number(t.cell(row, layers)), number(t.cell(row, median))
        if n is not None and s is not None:
            series.setdefault(t.cell(row, fe) or "?", []).append([n, s])
    verdicts = [line.strip() for line in text.splitlines() if line.startswith("target ")]
    return {"series": series, "verdicts": verdicts, "ylabel": "compile time (s)"}


def extract_planning(text: str) -> dict:
    t = find_table(tables(text), "layers", "median (s)")
    if t is None:
        raise ValueError("no table with the columns 'layers', 'median (s)'")
    layers = t.col("layers")
    series: Dict[str, List[List[float]]] = {}
    for label, name in (("wall", "median (s)"), ("CPU", "CPU median (s)")):
        index = t.col(name)
        if index is None:
            continue
        for row in t.rows:
            n, s = number(t.cell(row, layers)), number(t.cell(row, index))
            if n is not None and s is not None:
                series.setdefault(label, []).append([n, s])
    verdicts = [f"{m.group(1)}: {m.group(2)}"
                for m in re.finditer(r"growth \(([^)]*)\): \*\*(\w+)\*\*", text)]
    return {"series": series, "verdicts": verdicts, "ylabel": "graphpar.plan time (s)"}


def extract_data_parallel(text: str) -> dict:
    all_tables = tables(text)
    t = find_table(all_tables, "variant", "per-round ratio to DDP", prefix=True)
    if t is None:
        raise ValueError("no table with the columns 'variant', 'per-round ratio to DDP...'")
    variant, ratio = t.col("variant"), t.col("per-round ratio to DDP", prefix=True)
    metrics = []
    for row in t.rows:
        name, value = t.cell(row, variant), number(t.cell(row, ratio))
        if name and name != "DDP" and value is not None:
            metrics.append([f"{name} / DDP", value])
    return {"groups": [["DDP", metrics]], "what": "step time (median of per-round ratios)",
            "xlabel": "variant"}


def extract_tensor_parallel(text: str) -> dict:
    """graphpar's row: 'ratio to X' (wall) in the first table, 'ratio to X (process CPU /
    thread CPU / fastest)' in the second, each cell 'a / b / c'."""
    groups: Dict[str, List[List[float]]] = {}
    for t in tables(text):
        variant = t.col("variant")
        row = next((r for r in t.rows if t.cell(r, variant) == "graphpar"), None)
        if variant is None or row is None:
            continue
        names = ["wall, median of rounds"]
        for i, h in enumerate(t.header):
            m = re.fullmatch(r"ratio to (.+?)(?: \((.+)\))?", h.strip())
            if not m:
                continue
            peer = m.group(1).strip()
            if peer == "DTensor + PMI":
                peer = "DTensor + PrepareModuleInput"
            if m.group(2) and m.group(2).strip() != "same":  # '(same)': the statistics named before
                names = [n.strip() for n in m.group(2).split("/")]
            values = numbers(t.cell(row, i))
            for name, value in zip(names, values):
                if value is not None:
                    groups.setdefault(peer, []).append([name, value])
    if not groups:
        raise ValueError("no table with a 'variant' column, a 'graphpar' row and 'ratio to ...' columns")
    return {"groups": [[peer, metrics] for peer, metrics in groups.items()], "what": "step time"}


def extract_pipeline_parallel(text: str) -> dict:
    t = find_table(tables(text), "schedule", "graphpar / torch")
    if t is None:
        raise ValueError("no table with the columns 'schedule', 'graphpar / torch'")
    schedule, ratio = t.col("schedule"), t.col("graphpar / torch")
    pp, peer = t.col("pp"), t.col("torch schedule")
    metrics = []
    for row in t.rows:
        # one row per graphpar schedule and torch schedule on its stages, per pipeline degree
        name = t.cell(row, schedule).replace("*", "").strip()
        if peer is not None:
            name = f"{name} / {t.cell(row, peer).replace('*', '').strip()}"
        if pp is not None:
            name = f"pp={t.cell(row, pp)} {name}"
        metrics.append([name, number(t.cell(row, ratio))])
    metrics = [[name, value] for name, value in metrics if value is not None]
    return {"groups": [["torch", metrics]], "what": "step time (median of per-round ratios)",
            "xlabel": "schedule (graphpar / torch.distributed.pipelining)"}


def extract_host_optimizer(text: str) -> dict:
    t = find_table(tables(text), "variant", "per-round ratio to fused AdamW", prefix=True)
    if t is None:
        raise ValueError("no table with the columns 'variant', 'per-round ratio to fused AdamW...'")
    variant, ratio = t.col("variant"), t.col("per-round ratio to fused AdamW", prefix=True)
    metrics = [[t.cell(row, variant), number(t.cell(row, ratio))] for row in t.rows]
    metrics = [[name, value] for name, value in metrics if value is not None and name.startswith("graphpar")]
    return {"groups": [["torch AdamW(fused=True)", metrics]], "what": "optimizer step time (median of per-round ratios)",
            "xlabel": "variant"}


def extract_comparisons(text: str) -> dict:
    """The 'comparison' table (bench_zero.py's, bench_recompute.py's): one group per peer, rows
    'variant / peer'; comparisons whose variant this build does not have (n/a) are left out."""
    t = find_table(tables(text), "comparison", "per-round ratio (median)")
    if t is None:
        raise ValueError("no table with the columns 'comparison', 'per-round ratio (median)'")
    comparison, ratio = t.col("comparison"), t.col("per-round ratio (median)")
    groups: Dict[str, List[List[float]]] = {}
    for row in t.rows:
        name, value = t.cell(row, comparison), number(t.cell(row, ratio))
        if value is not None and " / " in name:
            groups.setdefault(name.split(" / ", 1)[1], []).append([name, value])
    return {"groups": [[peer, metrics] for peer, metrics in groups.items()],
            "what": "step time (median of per-round ratios)", "xlabel": "comparison"}


EXTRACT = {"compile": extract_compile, "planning": extract_planning, "data_parallel": extract_data_parallel,
           "tensor_parallel": extract_tensor_parallel, "pipeline_parallel": extract_pipeline_parallel,
           "host_optimizer": extract_host_optimizer, "zero": extract_comparisons, "recompute": extract_comparisons}


def headline(bench: Bench, data: dict) -> str:
    if bench.kind == "layers":
        parts = []
        for label, points in data["series"].items():
            parts.append(f"{label}: " + ", ".join(f"{int(n)} layers {s:.2f} s" for n, s in points))
        return "; ".join(parts + data.get("verdicts", []))
    parts = []
    for peer, metrics in data["groups"]:
        if len(data["groups"]) > 1:
            metrics = metrics[:2]  # the summary line stays short; the section has them all
        for name, value in metrics:
            label = name if name.endswith(f" / {peer}") else f"graphpar / {peer} ({name})"
            parts.append(f"{label} **{value:.3f}**")
    return "; ".join(parts)


# ---- running one benchmark ---------------------------------------------------------------------

@dataclass
class Result:
    bench: Bench
    args: List[str]
    status: str = "not run"          # ok | failed (rc N) | timed out after N s | could not start
    seconds: float = 0.0
    stdout: str = ""
    stderr: str = ""
    data: Optional[dict] = None
    parse_error: str = ""
    plot: str = ""

    @property
    def command(self) -> str:
        return _common.command(self.bench.script, self.args, quote=True)


def _pump(stream, sink: List[str], echo: bool) -> None:
    for line in iter(stream.readline, ""):
        sink.append(line)
        if echo:
            sys.stderr.write(f"    {line}")
            sys.stderr.flush()
    stream.close()


def _end_group(proc: subprocess.Popen) -> None:
    """End the benchmark and everything it started (its own process group, by id)."""
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def run_bench(bench: Bench, args: List[str], python: str, timeout: float, logs: pathlib.Path,
              echo: bool) -> Result:
    result = Result(bench, args)
    log(f"{bench.key}: {result.command} (time limit {timeout:.0f} s)")
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    start = time.perf_counter()
    try:
        proc = subprocess.Popen([python, str(REPO / "benchmarks" / bench.script), *args], cwd=REPO, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                                text=True, start_new_session=True)
    except OSError as e:
        result.status = f"could not start ({e})"
        return result
    out: List[str] = []
    err: List[str] = []
    pumps = [threading.Thread(target=_pump, args=(proc.stdout, out, False), daemon=True),
             threading.Thread(target=_pump, args=(proc.stderr, err, echo), daemon=True)]
    for p in pumps:
        p.start()
    try:
        rc = proc.wait(timeout=timeout)
        result.status = "ok" if rc == 0 else f"failed (exit code {rc})"
    except subprocess.TimeoutExpired:
        _end_group(proc)
        result.status = f"timed out after {timeout:.0f} s"
    except KeyboardInterrupt:
        _end_group(proc)
        raise
    for p in pumps:
        p.join(timeout=10)
    result.seconds = time.perf_counter() - start
    result.stdout, result.stderr = "".join(out), "".join(err)
    (logs / f"{bench.key}.stdout.md").write_text(result.stdout)
    (logs / f"{bench.key}.stderr.log").write_text(result.stderr)
    if result.status == "ok":
        try:
            result.data = EXTRACT[bench.key](result.stdout)
        except Exception as e:  # a report whose format changed: keep the text, say what failed
            result.parse_error = f"{type(e).__name__}: {e}"
    log(f"{bench.key}: {result.status} in {result.seconds:.0f} s"
        + (f"; could not read its table: {result.parse_error}" if result.parse_error else ""))
    return result


# ---- plots -------------------------------------------------------------------------------------

def load_matplotlib(python: str):
    """matplotlib.pyplot, installed into the venv on first use; None (and why) if it cannot be."""
    if importlib.util.find_spec("matplotlib") is None:
        log("plots need matplotlib (not a graphpar dependency); installing it into .venv with its pip...")
        try:
            proc = subprocess.run([python, "-m", "pip", "install", "-q", "matplotlib"], capture_output=True,
                                  text=True, timeout=600, env=dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1"))
        except (OSError, subprocess.TimeoutExpired) as e:
            return None, f"installing matplotlib failed ({e})"
        if proc.returncode != 0:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
            return None, f"`pip install matplotlib` failed (exit code {proc.returncode}): " + " / ".join(tail)
        importlib.invalidate_caches()
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:
        return None, f"matplotlib could not be imported ({type(e).__name__}: {e})"
    return plt, ""


def plot_ratios(plt, path: pathlib.Path, title: str, data: dict) -> None:
    """Bars of graphpar / peer with a dashed line at 1.0 (parity). One peer: a bar per row of
    its table (variant, schedule). Several peers: a group per peer, a bar per statistic."""
    groups, what = data["groups"], data["what"]
    colours = plt.get_cmap("tab10").colors
    bars = []  # (x, value, colour, legend label or None)
    if len(groups) == 1:
        peer, metrics = groups[0]
        ticks = [name for name, _ in metrics]
        faster, slower = "tab:green", "tab:red"   # which side of parity, for a glance
        bars = [(i, v, faster if v <= 1 else slower, None) for i, (_, v) in enumerate(metrics)]
        xlabel = data.get("xlabel", "")
        width = 0.6
        ylabel = f"graphpar / {peer}"
    else:
        names: List[str] = []
        for _, metrics in groups:
            names += [n for n, _ in metrics if n not in names]
        width = 0.8 / len(names)
        palette = [colours[i] for i in (0, 1, 4, 5, 6, 7, 8, 9)]  # no green / red: those mean faster / slower
        seen = set()
        for g, (_, metrics) in enumerate(groups):
            for k, (name, v) in enumerate(metrics):
                label = None if name in seen else name
                seen.add(name)
                bars.append((g + (k - (len(metrics) - 1) / 2) * width, v, palette[names.index(name) % len(palette)], label))
        ticks = [f"graphpar /\n{peer}" for peer, _ in groups]
        xlabel, ylabel = "", "graphpar / peer"
    fig, ax = plt.subplots(figsize=(max(6.5, 1.5 + 0.8 * len(bars) + (2.5 if len(groups) > 1 else 0)), 4.8))
    for x, v, colour, label in bars:
        ax.bar(x, v, width * 0.9, color=colour, label=label)
        # on a white box, so that the parity line does not run through a value next to 1.0
        ax.annotate(f"{v:.3f}", (x, v), ha="center", va="bottom", fontsize=8 if len(bars) > 6 else 9,
                    xytext=(0, 3), textcoords="offset points",
                    bbox=dict(boxstyle="round,pad=0.15", fc="white", ec="none", alpha=0.85))
    top = max([1.0] + [v for _, v, _, _ in bars])
    ax.axhline(1.0, color="black", linewidth=1.2, linestyle="--", label="parity (1.0)")
    ax.set_xticks(range(len(ticks)))
    ax.set_xticklabels(ticks, fontsize=9)
    ax.set_xlim(-0.6, len(ticks) - 0.4)
    ax.set_ylim(0, top * 1.18)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(f"{ylabel}, {what}\n(below 1: graphpar faster)", fontsize=9)
    ax.set_title(title, fontsize=11)
    ax.grid(axis="y", alpha=0.3)
    if len(groups) > 1:
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), title="statistic", title_fontsize=8)
    else:
        ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_layers(plt, path: pathlib.Path, title: str, series, ylabel: str) -> None:
    """Time against depth, one line per series, each with a dashed 'proportional to depth from
    its smallest size' reference: a line above it at the largest size means superlinear."""
    colours = plt.get_cmap("tab10").colors
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    largest = 0.0
    for i, (label, points) in enumerate(series.items()):
        points = sorted(points)
        xs, ys = [p[0] for p in points], [p[1] for p in points]
        largest = max(largest, xs[-1])
        c = colours[i % 10]
        ax.plot(xs, ys, marker="o", color=c, label=label)
        # even series label above-left of their points, odd ones below-right: no overlaps
        # when two series land on the same value
        offset, align = ((-5, 6), "right") if i % 2 == 0 else ((5, -12), "left")
        for x, y in points:
            ax.annotate(f"{y:.2f}", (x, y), fontsize=8, xytext=offset, textcoords="offset points", color=c,
                        ha=align)
        ax.plot(xs, [ys[0] * x / xs[0] for x in xs], linestyle=":", color=c, alpha=0.8,
                label=f"{label}: proportional to depth")
    ax.set_xlabel("layers")
    ax.set_ylabel(ylabel)
    ax.set_title(title + "\ndotted: the smallest size's time scaled with depth (a line above it: superlinear)",
                 fontsize=10)
    ax.set_xlim(0, largest * 1.08)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def make_plots(results: List[Result], out: pathlib.Path, python: str) -> str:
    """Writes NAME.png per benchmark with numbers; returns '' or why there are no plots."""
    wanted = [r for r in results if r.data]
    if not wanted:
        return "no benchmark produced numbers to plot"
    plt, why = load_matplotlib(python)
    if plt is None:
        return why
    for r in wanted:
        path = out / f"{r.bench.key}.png"
        try:
            if r.bench.kind == "layers":
                plot_layers(plt, path, f"{r.bench.title} ({r.bench.script})", r.data["series"], r.data["ylabel"])
            else:
                plot_ratios(plt, path, f"{r.bench.title}\n({r.bench.script})", r.data)
            r.plot = path.name
        except Exception as e:
            log(f"plot for {r.bench.key} failed: {type(e).__name__}: {e}")
    return ""


# ---- machine and report ------------------------------------------------------------------------

def memory() -> str:
    try:
        with open("/proc/meminfo") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("MemTotal"))
        return f"{kib / 2**20:.1f} GiB"
    except (OSError, StopIteration, ValueError):
        return "unknown"


def venv_versions(python: str) -> Tuple[str, str]:
    try:
        out = subprocess.run([python, "-c", "import platform, torch; print(platform.python_version(), "
                              "torch.__version__)"], capture_output=True, text=True, timeout=120, cwd=REPO)
        py, torch_version = out.stdout.split()
        return py, torch_version
    except Exception:
        return platform.python_version(), "unknown (torch did not import)"


def git_commit() -> str:
    """Read-only: the commit and whether the working tree differs from it."""
    try:
        head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=30).stdout.strip()
        dirty = subprocess.run(["git", "--no-optional-locks", "-C", str(REPO), "status", "--porcelain",
                                "--untracked-files=no"], capture_output=True, text=True, timeout=60).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    if not head:
        return "unknown"
    return head + (" (with uncommitted changes)" if dirty else "")


def demote(text: str, top: int = 3) -> str:
    """A script's headings, shifted so that its top one is level `top` (### under this
    report's '## section'); the levels below keep their distance to it."""
    lines = text.splitlines()
    levels, fenced = [], False
    for line in lines:
        if line.strip().startswith("```"):
            fenced = not fenced
        m = None if fenced else re.match(r"(#{1,6}) ", line)
        levels.append(len(m.group(1)) if m else 0)
    present = [lv for lv in levels if lv]
    if not present:
        return text
    shift = top - min(present)
    return "\n".join("#" * min(6, lv + shift) + line[lv:] if lv else line for lv, line in zip(levels, lines))


def report(results: List[Result], machine: dict, quick: bool, plots_note: str, invocation: str) -> str:
    lines = ["# graphpar benchmarks", "",
             f"{'Quick run' if quick else 'Full run'} of every benchmark, {machine['date']}. "
             f"Reproduce all: `{invocation}` (or `./run bench{' --quick' if quick else ''}`); each "
             "benchmark's own command is under its section. Ratios are graphpar / peer: below 1, graphpar "
             "is faster.", "",
             "## Machine", "",
             f"- CPU: {machine['cpu']}, {machine['cores']} cores usable of {machine['cpus']}, memory {machine['memory']}",
             f"- load average (1/5/15 min): {machine['load_start']} at the start, {machine['load_end']} at the end "
             f"(above {machine['cores']}, other work shared the cores and wall times are noisy)",
             f"- Python {machine['python']}, torch {machine['torch']}, {machine['os']}",
             f"- graphpar commit {machine['commit']}",
             f"- date: {machine['date']} (total {machine['total_s']:.0f} s)", ""]
    if quick:
        lines += ["Quick mode: fewer rounds where a script has options for it "
                  "(" + "; ".join(f"{r.bench.script} `{' '.join(r.bench.quick_args)}`" if r.bench.quick_args
                                  else f"{r.bench.script} has none, runs in full" for r in results)
                  + "), so ratios are noisier than in a full run.", ""]
    lines += ["## Summary", "", "| benchmark | status | time (s) | headline | plot |", "|---|---|---:|---|---|"]
    for r in results:
        head = headline(r.bench, r.data) if r.data else (r.parse_error and f"table not read: {r.parse_error}") or ""
        plot = f"[{r.plot}]({r.plot})" if r.plot else ""
        lines.append(f"| {r.bench.script} | {r.status} | {r.seconds:.0f} | {head.replace('|', '/')} | {plot} |")
    lines.append("")
    if plots_note:
        lines += [f"Plots skipped: {plots_note}", ""]
    for r in results:
        lines += [f"## {r.bench.title} (`{r.bench.script}`)", "",
                  f"Command (from the repository root): `{r.command}`", "",
                  f"Status: {r.status}, {r.seconds:.0f} s." + (f" Plot: [{r.plot}]({r.plot})" if r.plot else ""), ""]
        if r.stdout.strip():
            lines += [demote(r.stdout.strip()), ""]
        if r.status != "ok":
            tail = "\n".join(r.stderr.strip().splitlines()[-30:])
            lines += ["Last lines of its stderr (all of it in logs/):", "", "```", tail or "(empty)", "```", ""]
    return "\n".join(lines).rstrip() + "\n"


# ---- command line ------------------------------------------------------------------------------

def output_dir(text: str) -> pathlib.Path:
    path = pathlib.Path(text).expanduser().resolve()
    if _common.in_repo(path):
        # inside the repository only where git ignores it, so that results never get committed
        try:
            ignored = subprocess.run(["git", "-C", str(REPO), "check-ignore", "-q", str(path / "results.md")],
                                     capture_output=True, timeout=30).returncode == 0
        except (OSError, subprocess.TimeoutExpired):
            ignored = path == DEFAULT_OUT or DEFAULT_OUT in path.parents
        if not ignored:
            raise argparse.ArgumentTypeError(
                f"{text}: inside the repository but not ignored by git; results are machine-specific and "
                f"stay out of it: use {DEFAULT_OUT.relative_to(REPO)}/ (ignored) or a path outside {REPO}")
    return path


def select(text: str) -> List[Bench]:
    by_key = {b.key: b for b in BENCHES}
    chosen = []
    for name in (n.strip() for n in text.split(",") if n.strip()):
        key = ALIASES.get(name, name.removesuffix(".py").removeprefix("bench_"))
        if key not in by_key:
            raise argparse.ArgumentTypeError(
                f"unknown benchmark {name!r}; choose from {', '.join(by_key)} (or {', '.join(ALIASES)})")
        if by_key[key] not in chosen:
            chosen.append(by_key[key])
    return chosen


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="fewer rounds where a script has options for it (about 7-10 minutes in all)")
    parser.add_argument("--out", type=output_dir, default=DEFAULT_OUT,
                        help=f"output folder (default {DEFAULT_OUT.relative_to(REPO)}/, ignored by git)")
    parser.add_argument("--only", type=select, default=list(BENCHES), metavar="NAMES",
                        help="comma-separated subset: " + ", ".join(b.key for b in BENCHES)
                        + " (or " + ", ".join(ALIASES) + ")")
    parser.add_argument("--timeout", type=float, default=None,
                        help="time limit per benchmark in seconds (default: each benchmark's own, "
                             + ", ".join(f"{b.key} {b.timeout}/{b.quick_timeout}" for b in BENCHES)
                             + " full/quick)")
    parser.add_argument("--no-plots", action="store_true", help="write results.md only")
    parser.add_argument("--quiet", action="store_true", help="do not echo the benchmarks' progress (stderr)")
    return parser.parse_args(argv)


def in_venv() -> bool:
    return pathlib.Path(sys.prefix).resolve() == VENV.resolve()


def main(argv=None) -> int:
    if argv is None and VENV_PYTHON.exists() and not in_venv():
        # the benchmarks run with the venv's python, and the plots import the matplotlib that
        # gets installed into the venv: run this script there too
        os.execv(str(VENV_PYTHON), [str(VENV_PYTHON), str(pathlib.Path(__file__).resolve()), *sys.argv[1:]])
    args = parse_args(argv)
    python = str(VENV_PYTHON) if VENV_PYTHON.exists() else sys.executable
    if python == sys.executable and not VENV_PYTHON.exists():
        log(f"no {VENV_PYTHON}; running the benchmarks with {sys.executable}")
    out: pathlib.Path = args.out
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    for bench in BENCHES:  # last run's plots must not pass for this run's
        (out / f"{bench.key}.png").unlink(missing_ok=True)
    py_version, torch_version = venv_versions(python)
    machine = {"cpu": _common.cpu_model(), "cores": _common.usable_cores(), "cpus": os.cpu_count(),
               "memory": memory(), "python": py_version, "torch": torch_version,
               "os": f"{platform.system()} {platform.release()}",
               "commit": git_commit(), "load_start": _common.load_average(),
               "date": datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")}
    invocation = _common.command("run_all.py", argv, quote=True)
    log(f"{len(args.only)} benchmark(s){' (quick)' if args.quick else ''}, results into {out}; "
        f"load average {machine['load_start']}")
    start = time.perf_counter()
    results = []
    for bench in args.only:
        timeout = args.timeout or (bench.quick_timeout if args.quick else bench.timeout)
        results.append(run_bench(bench, bench.quick_args if args.quick else [], python, timeout, logs,
                                 echo=not args.quiet))
    machine["load_end"] = _common.load_average()
    machine["total_s"] = time.perf_counter() - start
    plots_note = "--no-plots given" if args.no_plots else make_plots(results, out, python)
    if plots_note and not args.no_plots:
        log(f"plots skipped: {plots_note}")
    (out / "results.md").write_text(report(results, machine, args.quick, plots_note, invocation))
    (out / "results.json").write_text(json.dumps(
        {"machine": machine, "quick": args.quick,
         "benchmarks": [{"name": r.bench.key, "script": r.bench.script, "command": r.command, "status": r.status,
                         "seconds": round(r.seconds, 1), "numbers": r.data, "parse_error": r.parse_error or None,
                         "plot": r.plot or None} for r in results]}, indent=2) + "\n")
    log(f"wrote {out / 'results.md'}" + (f" and {sum(1 for r in results if r.plot)} plot(s)" if not plots_note else ""))
    failed = [r.bench.key for r in results if r.status != "ok" or r.parse_error]
    if failed:
        log(f"not all went well: {', '.join(failed)} (see results.md and {logs})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
