"""Calibration: what the cost model of graphpar/planner/auto.py needs, measured on this machine.

    calibration = graphpar.auto.calibrate(world_size=2)          # cached; under a minute
    result = graphpar.auto.search(model, 2, (x,), ..., calibration=calibration)

`calibrate` launches `world_size` processes (graphpar.launch, gloo by default: the backend
the runs it predicts use) and times, in every rank at once, so that ranks sharing cores
are measured sharing them (each figure the least of its loops, or their median where the
ranks outnumber the cores: _typical), every training step with the optimizer the search
will be given (AdamW unless told):

- matmul throughput: (rows x width) @ (width x 4 width / tp), rows from 16 to 4096, for
  every tp dividing the world (the MLP's first matmul, the model's largest);
- speedup: how much faster the model's eager forward and backward (without a model, that
  matmul at 256 rows) runs when only n ranks compute and the others wait, for every n
  dividing the world, against all of them computing (on shared cores a rank alone in a
  pipeline's bubble computes faster than ranks computing together; the median of loops of
  at least SPEEDUP_SECONDS, never below the share of the cores they get: monotone_speedup);
- each collective (all-reduce, all-gather, reduce-scatter, all-to-all) over groups of
  every size g > 1 dividing the world: latency (a 4-element call) and bandwidth (the
  bytes a rank sends of a 1 MiB buffer with the ring algorithms, auto.sent_bytes's share);
- busy latency: the time a small all-reduce adds between matmuls, over groups of every
  size g > 1 (tp's all-reduces run between the ops' computations: a rank waits for peers
  that are still computing, or descheduled on shared cores, which a tight loop of ready
  ranks does not show);
- point-to-point: latency and bandwidth of a send and its receive between rank pairs;
- overlap: the share of an asynchronous all-reduce that hides behind matmuls run meanwhile
  (1: fully hidden, 0: they take as long as run one after the other);
- memory bandwidth: the optimizer's step over 1M parameters, as bytes it streams (weights
  and states read and written, gradients read) per second: the optimizer step's speed on
  the device and, on a CPU, the host's;
- the executors' overhead: training steps of a GPT too small to compute anything (width 8)
  with graphpar.compile: at pp = world 1F1B with 1, 4 and 8 microbatches and interleaved
  1F1B with 8, a least-squares fit of a unit's cost per microbatch and a stage call's
  (forward and backward), less what their messages add (the time model simulates those);
  at dp = world with 1, 3 and 5 blocks, a line whose slope, less the unit's per-microbatch
  cost, is a unit's cost per step (its optimizer step and gradients) and whose intercept
  is the step's own and a microbatch's (overheads_from);
- ZeRO's own work per unit: training steps of that GPT at the model's width (5 blocks) at
  each ZeRO stage against zero=0, less what the time model already counts for the
  difference (the collectives of each, from their bytes and the links above), over its units.
- with a model: its training steps as graphpar runs them (graphpar.compile at dp = world,
  the rank's batch of 1, 2 and 4 sequences: the microbatch sizes the candidates use, and the
  4 again in microbatches of one): the least-squares slope of step time against tokens gives
  its throughput, what a microbatch more takes beyond what the time model counts its
  overhead per microbatch, and what the one-microbatch steps take beyond that its work per
  step (model_terms, planned in the launching process).

The result is cached as JSON under $GRAPHPAR_CACHE (default ~/.cache/graphpar), one file
per key: hostname, CPU model, usable cores, torch version, backend, world size and width;
a machine or torch version that changes gets a new key, so its old file is not read.
"""
from __future__ import annotations

import copy
import functools
import hashlib
import json
import math
import os
import pathlib
import pickle
import platform
import socket
import statistics
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from graphpar.distributed.launch import launch
from graphpar.frontend.compile import compile as compile_model
from graphpar.models.gpt import GPT, GPTConfig, lm_loss
from graphpar.planner.calibration import SENT_SHARE, Calibration, Link, speed_in
from graphpar.planner.plan import report_from, unit_analysis
from graphpar.planner.time_model import forward_backward, message_seconds, step_seconds
from graphpar.runtime.pipeline.schedules import build_schedule
from graphpar.runtime.pipeline.simulate import simulate
from graphpar.strategy import Strategy

# the optimizer every timed step uses where calibrate is given none: the commonest in training
# (its step is part of every step the calibration times, and costs more per tensor than SGD's)
DEFAULT_OPTIMIZER = functools.partial(torch.optim.AdamW, lr=1e-3)
FORMAT = 11                       # the file layout and how it was timed; a new one ignores older files
MATMUL_ROWS = (16, 64, 256, 1024, 4096)
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
SMALL, LARGE = 4, 1 << 18         # elements of the latency and the bandwidth measurements (1 MiB)
# loops timed of a training step (the model's, the tiny GPTs', the speedup's; _interleaved):
# these multiply every prediction: more chances of a quiet moment
STEP_REPEATS = 9
# the tiny GPTs the overheads are fitted from: blocks at dp = world (unit and step), microbatches
# at pp = world (microbatch), blocks at each ZeRO stage (ZeRO's work), up to this width
OVERHEAD_BLOCKS, OVERHEAD_MICROBATCHES, ZERO_BLOCKS, ZERO_MAX_WIDTH = (1, 3, 5), (1, 4, 8), 5, 512
# the tiny GPT's interleaved 1F1B step (pp = world): its microbatches and virtual stages; it runs
# each microbatch through twice the stage calls of 1F1B over the same units, which separates a
# stage call's own overhead from its units'
INTERLEAVED_MICROBATCHES, INTERLEAVED_VIRTUAL = 8, 2
# the tiny GPTs' width for the executor's overheads: next to nothing to compute
TINY_WIDTH = 8
# the pipeline overheads' fits: each takes out what the messages add at the last one's costs
# (1F1B's are the same at any costs, interleaved's change with them), until the costs move less
# than MESSAGE_SETTLED seconds (each fit cuts the change about 4 times) or MESSAGE_FITS fits
MESSAGE_FITS, MESSAGE_SETTLED = 50, 1e-12
# the rank's batches (sequences) the model's steps are timed at: three points of the line, the
# microbatch sizes the candidates of benchmarks/bench_auto.py use
MODEL_BATCHES = (1, 2, 4)
# the least a loop of the speedup's lasts: several of the ranks' time slices, so that ranks
# computing at once share the cores for most of it
SPEEDUP_SECONDS = 0.1
# a loop sized from a shorter one's time per call: this much longer than that says is enough (a
# call slower than the last loop's by this much still makes it), at most this many times as long
# (the timer's resolution can make a very short loop look free)
LOOP_MARGIN, LOOP_GROWTH = 1.2, 256


# ---- the cache ---------------------------------------------------------------------------

def machine_key(world_size: int, backend: str, width: int, model: str = "",
                optimizer: str = "") -> Dict[str, Any]:
    """`model`: the fingerprint of the model timed (model_fingerprint), empty without one;
    `optimizer`: the optimizer's name and arguments (optimizer_name)."""
    return {"format": FORMAT, "hostname": socket.gethostname(), "cpu": _cpu_model(), "cores": _cores(),
            "torch": torch.__version__, "backend": backend, "world_size": world_size, "width": width,
            "model": model, "optimizer": optimizer}


def optimizer_name(optimizer: Callable) -> str:
    """The optimizer's class and arguments (a functools.partial's keywords), without addresses."""
    if isinstance(optimizer, functools.partial):
        return f"{optimizer_name(optimizer.func)}({optimizer.args!r}, {sorted(optimizer.keywords.items())!r})"
    return f"{getattr(optimizer, '__module__', '')}.{getattr(optimizer, '__qualname__', type(optimizer).__name__)}"


def model_width(model: torch.nn.Module) -> int:
    """The model's hidden size, for the matmuls timed: the commonest in_features of its
    linear layers (64 where it has none)."""
    widths = [m.in_features for m in model.modules() if isinstance(m, torch.nn.Linear)]
    return statistics.mode(widths) if widths else 64


def model_fingerprint(model: torch.nn.Module, example_inputs) -> str:
    """The model's class, parameter shapes and the batch's shapes: what its timing depends on."""
    shapes = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    inputs = [tuple(t.shape) for t in example_inputs if isinstance(t, torch.Tensor)]
    return hashlib.sha256(repr((type(model).__name__, shapes, inputs)).encode()).hexdigest()[:16]


def cache_path(key: Dict[str, Any]) -> pathlib.Path:
    root = pathlib.Path(os.environ.get("GRAPHPAR_CACHE", pathlib.Path.home() / ".cache" / "graphpar"))
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return root / f"calibration-{digest}.json"


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def calibrate(world_size: int = 2, backend: str = "gloo", width: int = 128, model: Optional[torch.nn.Module] = None,
              example_inputs=(), loss_fn: Optional[Callable] = None, example_target: Any = None,
              refresh: bool = False, optimizer: Callable = DEFAULT_OPTIMIZER) -> Calibration:
    """The calibration of this machine for `world_size` ranks on `backend`, from the cache
    unless `refresh` or the machine, torch version, backend, world size, width or model changed.
    `width`: the model's hidden size (the matmuls are timed at it). `model` (optional, with
    the global batch `example_inputs`, `loss_fn` and `example_target`): its own forward and
    backward are timed too, in every rank at once, at batches of 1 sequence up to the
    batch: the slope of time against tokens gives model_flops, which the cost model then
    uses for compute in place of the matmuls' throughput, model_overhead, what a microbatch
    more of it takes beyond the other terms, and its work once per step (model_terms). `optimizer`: the one the search is given
    (params -> torch.optim.Optimizer, picklable: a class or a functools.partial; AdamW with
    lr=1e-3 unless told): every step timed steps it, as the candidates' steps will."""
    for name, value in (("world_size", world_size), ("width", width)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"calibrate: {name}={value!r} must be a positive integer; e.g. {name}=2")
    _check_picklable(optimizer)
    key = machine_key(world_size, backend, width, model_fingerprint(model, example_inputs) if model else "",
                      optimizer_name(optimizer))
    path = cache_path(key)
    if path.exists() and not refresh:
        cached = Calibration.from_json(path.read_text())
        if cached.key == key:
            return cached
    start = time.perf_counter()
    timed_model = (model, tuple(example_inputs), loss_fn, example_target) if model is not None else None
    per_rank = launch(_measure, world_size, args=(width, timed_model, optimizer), backend=backend)
    calibration = _combine(key, width, per_rank, time.perf_counter() - start, optimizer)
    if model is not None:
        model_terms(calibration, timed_model, _slowest_steps(per_rank), world_size, backend, optimizer)
        calibration.seconds = time.perf_counter() - start
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(calibration.to_json())
    return calibration


def _check_picklable(optimizer: Callable) -> None:
    """The ranks get the optimizer pickled: say so before launching them."""
    try:
        pickle.dumps(optimizer)
    except (pickle.PicklingError, AttributeError, TypeError) as exc:
        raise ValueError(f"calibrate: optimizer={optimizer!r} cannot be pickled for the ranks ({exc}); pass a class "
                         f"or a functools.partial, e.g. functools.partial(torch.optim.AdamW, lr=1e-3)") from None


def _combine(key: Dict[str, Any], width: int, per_rank: List[Dict[str, Any]], seconds: float,
             optimizer: Callable) -> Calibration:
    """One calibration from every rank's measurements: rank 0's for what all ranks time
    together (they wait for each other), the slowest rank's throughput."""
    first = per_rank[0]
    matmul = {tp: [(rows, min(r["matmul"][tp][i][1] for r in per_rank)) for i, (rows, _) in enumerate(table)]
              for tp, table in first["matmul"].items()}
    calibration = Calibration(key=key, width=width, matmul=matmul, collectives=first["collectives"], p2p=first["p2p"],
                              overlap=first["overlap"], memory_bandwidth=min(r["memory_bandwidth"] for r in per_rank),
                              unit_overhead=first["unit_overhead"], microbatch_overhead=first["microbatch_overhead"],
                              unit_step_overhead=first["unit_step_overhead"],
                              step_overhead=first["step_overhead"], speedup=first["speedup"],
                              busy_latency=first["busy_latency"], seconds=seconds)
    calibration.zero_overhead = zero_overhead(calibration, first["zero_steps"], key["world_size"], width,
                                              key["backend"], optimizer)
    return calibration


def _slowest_steps(per_rank: List[Dict[str, Any]]) -> Dict[str, List[Tuple[int, float]]]:
    """(tokens, seconds) of the model's steps at each batch timed, per strategy timed ("dp",
    "tp"), the slowest rank's."""
    return {kind: [(tokens, max(r["model_steps"][kind][i][1] for r in per_rank)) for i, (tokens, _) in enumerate(rows)]
            for kind, rows in per_rank[0]["model_steps"].items()}


def model_terms(calibration: Calibration, timed_model, steps: Dict[str, List[Tuple[int, float]]], world: int,
                backend: str, optimizer: Callable) -> None:
    """Sets calibration.model_flops, model_overhead and the model's share of step_overhead
    from the model's steps (steps["dp"]: (tokens, seconds) at dp = world with `optimizer`,
    one microbatch, every rank at once; steps["microbatches"]: the largest batch again, one
    sequence per microbatch), the model planned here, then the busy latency from its tp step
    (steps["tp"], tp_latency). model_flops, 6 flops per parameter element the plan gives a
    rank per token over the least-squares slope of step time against tokens (the time model's
    compute then grows with tokens as the steps did); model_overhead, what each microbatch
    more took beyond what the time model gives for it (the same tokens in more microbatches:
    the model's own work per microbatch that the tiny GPTs do not show, their ops computing
    nothing), never below 0; then what the one-microbatch steps take beyond the time model,
    their mean, is the model's work once per step, added to step_overhead (never below 0).
    Format 5 put all of that intercept per microbatch: a noisy slope moved it by 2-10 ms, and
    pipelines of 8 microbatches paid it 8 times."""
    tokens, seconds = [t for t, _ in steps["dp"]], [s for _, s in steps["dp"]]
    report = _model_report(timed_model, Strategy(dp=world), world, backend, optimizer)
    slope = statistics.linear_regression(tokens, seconds).slope if len(tokens) > 1 else 0.0
    if slope <= 0:   # noise flattened the line: the largest batch's time per token, an upper bound
        slope = seconds[-1] / tokens[-1]
    calibration.model_flops = 6 * report.ranks[0].param_bytes / 4 / slope
    calibration.model_overhead = 0.0
    if steps.get("microbatches"):
        (tokens_m, seconds_m), = steps["microbatches"]
        m = _model_batches(timed_model[1])[-1]
        split = _model_report(timed_model, _microbatch_step(world, m), world, backend, optimizer)
        modeled_more = step_seconds(split, tokens_m, calibration) - step_seconds(report, tokens_m, calibration)
        calibration.model_overhead = max(0.0, (seconds_m - seconds[-1] - modeled_more) / (m - 1))
    modeled = [step_seconds(report, t, calibration) for t in tokens]
    calibration.step_overhead += max(0.0, statistics.fmean(s - m for s, m in zip(seconds, modeled)))
    if steps.get("tp"):
        (tokens, seconds), = steps["tp"]
        tp_report = _model_report(timed_model, _tp_step(world), world, backend, optimizer)
        calibration.busy_latency = tp_latency(calibration, tp_report,
                                              tokens, seconds)


def tp_latency(calibration: Calibration, report, tokens: int, seconds: float) -> Dict[int, float]:
    """The busy latency of every group size from the model's tp step (`report`, `seconds`):
    what it took beyond what the time model gives for it, over its tp calls, added to each
    group's. A tp all-reduce of the model waits for peers whose ops, dispatch and gloo's own
    threads share the cores, which the calibration's matmul and 4-element all-reduce do not
    show, or takes less than the tight loop of every rank at once gives; the step's own group
    (tp = 2) then gets what it took (Calibration.busy_link takes it as an all-reduce's latency
    under the loop's too), every other group the larger of its busy latency and its loop's
    plus the same (not timed in a step of the model, the loop still bounds it: the GPT's tp =
    4 at world 4 came out 41-46% under without). Never below 0."""
    calls = sum(t.count for t in report.ranks[0].collectives if t.axis == "tp")
    extra = (seconds - step_seconds(report, tokens, calibration)) / calls
    timed = report.strategy["tp"]

    def base(g: int) -> float:
        busy = calibration.busy_link("all_reduce", g).alpha
        return busy if g == timed else max(busy, calibration.link("all_reduce", g).alpha)

    return {g: max(0.0, base(g) + extra) for g in calibration.busy_latency or calibration.collectives["all_reduce"]}


def _model_report(timed_model, strategy: Strategy, world: int, backend: str, optimizer: Callable):
    """The plan of the model's calibration step at `strategy` (the rank's largest batch timed)."""
    model, inputs, loss_fn, target = timed_model
    rows = _model_batches(inputs)[-1]
    analysis = unit_analysis(model, strategy, _first_rows(inputs, rows), loss_fn, _first_rows(target, rows), world, {})
    return report_from(analysis, model, strategy, world, optimizer, {}, backend=backend)


def zero_overhead(calibration: Calibration, zero_steps: Dict[int, float], world: int, width: int,
                  backend: str, optimizer: Callable) -> Dict[int, float]:
    """ZeRO's own work per unit per step, at each stage: what a step of the tiny GPT at
    `width` took more than at zero=0 (`zero_steps`), less what the time model already counts
    for that difference (its collectives from their bytes, the sharded optimizer step), over
    the GPT's units. Planned here, in the launching process, with the calibration's links."""
    if not zero_steps:
        return {}
    model, x = _tiny_gpt(ZERO_BLOCKS, _zero_width(width))
    analysis = unit_analysis(model, Strategy(dp=world), (x,), lm_loss, x, world, {})

    def modeled(zero: int) -> float:
        report = report_from(analysis, model, Strategy(dp=world, zero=zero), world, optimizer, {}, backend=backend)
        return step_seconds(report, x.numel(), calibration)

    plain = modeled(0)
    return {z: max(0.0, (extra - (modeled(z) - plain)) / _tiny_gpt_units(ZERO_BLOCKS)) for z, extra in zero_steps.items()}


# ---- the measurements, run in every rank ---------------------------------------------------
def _timed(fn: Callable[[], Any], min_seconds: float = 0.02, repeats: int = 5) -> float:
    """The least over `repeats` of fn's mean time in a loop of at least `min_seconds`, all
    ranks starting each loop together (fn itself may be a collective); their median where
    the ranks outnumber the cores (_typical)."""
    calls, first = _loop_size(fn, min_seconds)
    return _typical([first] + [_loop(fn, calls) for _ in range(repeats - 1)])


def _typical(times: List[float]) -> float:
    """The least of loop times, or their median where the ranks outnumber the cores. The
    least: other processes on the machine only ever add time, and a calibration taken while
    they ran must not carry their load into every later prediction. The median where ranks
    share cores: their least is a loop that ran while the others happened not to (4 ranks on
    2 cores: the speed with one rank computing against all four, 1.0-1.3x from the least of
    short loops, about 2 from their median)."""
    return statistics.median(times) if dist.get_world_size() > _cores() else min(times)


def _interleaved(fns: Dict[Any, Callable[[], Any]], min_seconds: float = 0.02,
                 pick: Optional[Callable[[List[float]], float]] = None) -> Dict[Any, float]:
    """`pick` (_typical, as _timed, unless told) of STEP_REPEATS loops of each fn, the fns
    taking turns loop by loop: the figure is their difference or ratio, and a load that
    comes and goes then falls on all of them alike instead of on whichever was timed while
    it lasted."""
    sizes = {key: _loop_size(fn, min_seconds) for key, fn in fns.items()}
    found = {key: [first] for key, (_, first) in sizes.items()}
    for _ in range(STEP_REPEATS - 1):
        for key, fn in fns.items():
            found[key].append(_loop(fn, sizes[key][0]))
    return {key: (pick or _typical)(times) for key, times in found.items()}


def _loop_size(fn: Callable[[], Any], min_seconds: float) -> Tuple[int, float]:
    """fn run once, then in loops of 1 call and then of as many as the last loop's time per
    call says `min_seconds` takes (LOOP_MARGIN more, at most LOOP_GROWTH times the last),
    until one takes `min_seconds` on the slowest rank (every rank the same loop count): that
    count, and the loop's seconds per call. Growing 4 times a loop overshot by up to 4 times:
    the calibration's loops took about twice as long as asked."""
    fn()
    calls = 1
    while True:
        took = torch.tensor([_loop(fn, calls) * calls])
        dist.all_reduce(took, op=dist.ReduceOp.MAX)
        if took.item() >= min_seconds:
            return calls, took.item() / calls
        wanted = math.ceil(calls * LOOP_MARGIN * min_seconds / max(took.item(), 1e-9))
        calls = min(max(wanted, calls + 1), calls * LOOP_GROWTH)


def _loop(fn: Callable[[], Any], calls: int) -> float:
    """Seconds per call of `calls` calls of fn, all ranks starting together."""
    dist.barrier()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def _divisors(n: int) -> List[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _measure(width: int, timed_model, optimizer: Callable) -> Dict[str, Any]:
    world = dist.get_world_size()
    groups = _groups(world)
    p2p, speedup = _p2p(), _speedup(world, width, timed_model)
    return {"matmul": _matmuls(world, width), "speedup": speedup, "collectives": _collectives(groups),
            "busy_latency": _busy_latency(groups, width), "p2p": p2p, "overlap": _overlap(width),
            "memory_bandwidth": _memory_bandwidth(optimizer),
            "model_steps": _model_steps(*timed_model, optimizer) if timed_model else {},
            **_overheads(world, width, optimizer, p2p.time(_tiny_message_bytes()), speedup)}


def _model_steps(model, inputs, loss_fn, target, optimizer: Callable) -> Dict[str, List[Tuple[int, float]]]:
    """(tokens, seconds) of training steps of the model as graphpar runs it (its exported
    graph, graphpar.compile with `optimizer`, every rank at once), not the eager module: the two
    differ per call (masks and tables an eager forward builds). "dp": at dp = world, the
    rank's batch of each of MODEL_BATCHES sequences that the global batch holds (one compile;
    each batch size gets a program of its own, a trace each); "microbatches": the largest of
    those batches in microbatches of one sequence (_microbatch_step), where it has more than
    one; "tp": at _tp_step, the largest batch, where the world is even and the model splits
    over tp = 2. All taking turns (_interleaved)."""
    world, sizes = dist.get_world_size(), _model_batches(inputs)
    dp = _compiled(model, Strategy(dp=world), inputs, loss_fn, target, sizes[0], optimizer)
    steps, tokens = {}, {}
    for b in sizes:
        x, y = _first_rows(inputs, b), _first_rows(target, b)
        tokens[("dp", b)] = sum(t.numel() for t in x if isinstance(t, torch.Tensor))
        steps[("dp", b)] = lambda x=x, y=y: dp.train_step(*x, target=y)
    if sizes[-1] > 1:
        split = _compiled(model, _microbatch_step(world, sizes[-1]), inputs, loss_fn, target, sizes[-1], optimizer)
        x_split, y_split = _first_rows(inputs, sizes[-1]), _first_rows(target, sizes[-1])
        tokens[("microbatches", sizes[-1])] = tokens[("dp", sizes[-1])]
        steps[("microbatches", sizes[-1])] = lambda: split.train_step(*x_split, target=y_split)
    if world % 2 == 0:
        try:
            tp = _compiled(model, _tp_step(world), inputs, loss_fn, target, sizes[-1], optimizer)
        except (ValueError, NotImplementedError):   # the model does not split over tp = 2
            tp = None
        if tp is not None:
            x, y = _first_rows(inputs, sizes[-1]), _first_rows(target, sizes[-1])
            tokens[("tp", sizes[-1])] = tokens[("dp", sizes[-1])]
            steps[("tp", sizes[-1])] = lambda: tp.train_step(*x, target=y)
    found: Dict[str, List[Tuple[int, float]]] = {}
    # the median, not the least: these steps set the level of every prediction, which is
    # compared with the median of measured steps (graphpar.planner.measure); the least ran
    # 8-24% under it on a quiet machine (a step's own scheduling and allocator noise)
    for (kind, b), seconds in _interleaved(steps, pick=statistics.median).items():
        found.setdefault(kind, []).append((tokens[(kind, b)], seconds))
    return found


def _microbatch_step(world: int, sequences: int) -> Strategy:
    """The strategy the model's microbatch step is timed at: dp = world, the rank's batch of
    `sequences` one per microbatch."""
    return Strategy(dp=world, microbatches=sequences)


def _tp_step(world: int) -> Strategy:
    """The strategy the model's tp step is timed at: tp = 2, dp the rest of the world."""
    return Strategy(dp=world // 2, tp=2)


def _compiled(model, strategy: Strategy, inputs, loss_fn, target, rows: int, optimizer: Callable):
    return compile_model(copy.deepcopy(model), strategy, example_inputs=_first_rows(inputs, rows), loss_fn=loss_fn,
                         optimizer=optimizer, example_target=_first_rows(target, rows))


def _model_batches(inputs) -> List[int]:
    """The rank's batches the model's steps are timed at: MODEL_BATCHES up to the global batch."""
    batch = inputs[0].shape[0]
    return [b for b in MODEL_BATCHES if b <= batch] or [batch]


def _first_rows(value, rows: int):
    """The first `rows` rows of a tensor, or of each tensor of a tuple (anything else as is)."""
    if isinstance(value, tuple):
        return tuple(_first_rows(v, rows) for v in value)
    return value[:rows] if isinstance(value, torch.Tensor) and value.dim() > 0 else value


def _speedup(world: int, width: int, timed_model) -> Dict[int, float]:
    """Rank 0's speed with n ranks computing at once (the others waiting in a barrier, as a
    rank in a pipeline's bubble waits in a receive) against all of them, for each n dividing
    the world: of the model's eager forward and backward on 4 sequences where there is a
    model (its mix of matmuls and memory-bound ops shares cores as the graph's does), else of
    a matmul of 256 rows."""
    work = _eager_step(*timed_model, rows=4) if timed_model else _matmul(256, width)
    rank = dist.get_rank()
    # the median of loops of SPEEDUP_SECONDS, not the least of short ones: a short loop of
    # every rank at once can fall in a moment when the others are still leaving the barrier,
    # and its least then times them as if alone (4 ranks on 2 cores: 1.0-1.3x where the
    # median of longer loops gives about 2, as pipeline steps at pp = 4 show)
    seconds = _interleaved({n: lambda n=n: work() if rank < n else None for n in _divisors(world)},
                           min_seconds=SPEEDUP_SECONDS, pick=statistics.median)
    return monotone_speedup({n: seconds[world] / t for n, t in seconds.items()}, world, _cores())


def monotone_speedup(measured: Dict[int, float], world: int, cores: int) -> Dict[int, float]:
    """The measured speedups made what they can physically be: fewer ranks computing never
    slows one down, so each count's is at least any larger count's (noise on shared cores can
    time the alone loop in a busy moment and the together one in a quiet one), and at least
    its share of the cores against the world's (core_share: n ranks computing on `cores`
    cores get min(1, cores / n) of a core each, all `world` of them cores / world; 4 ranks on
    2 cores: at least 2x alone, where one calibration in seven timed 1.8x)."""
    found, floor, together = {}, 1.0, core_share(world, cores)
    for n in sorted(measured, reverse=True):
        floor = max(floor, measured[n], core_share(n, cores) / together)
        found[n] = floor
    return found


def core_share(ranks: int, cores: int) -> float:
    """The share of a core each of `ranks` ranks computing at once gets on `cores` cores."""
    return min(1.0, cores / ranks)


def _eager_step(model, inputs, loss_fn, target, rows: int) -> Callable[[], None]:
    x, y = _first_rows(inputs, rows), _first_rows(target, rows)

    def step():
        out = model(*x)
        (loss_fn(out, y) if loss_fn is not None else out).backward()
    return step


def _matmul(rows: int, width: int) -> Callable[[], torch.Tensor]:
    a, b = torch.randn(rows, width), torch.randn(width, 4 * width)
    return lambda: a @ b


def _matmuls(world: int, width: int) -> Dict[int, List[Tuple[int, float]]]:
    found = {}
    for tp in _divisors(world):
        out = max(1, 4 * width // tp)
        rows_table = []
        for rows in MATMUL_ROWS:
            a, b = torch.randn(rows, width), torch.randn(width, out)
            rows_table.append((rows, 2 * rows * width * out / _timed(lambda a=a, b=b: a @ b)))
        found[tp] = rows_table
    return found


def _groups(world: int) -> Dict[int, Any]:
    """This rank's group of every size g > 1 dividing the world (consecutive ranks; every
    rank creates every group, as new_group requires)."""
    mine = {}
    for g in _divisors(world)[1:]:
        for first in range(0, world, g):
            group = dist.new_group(list(range(first, first + g)))
            if first <= dist.get_rank() < first + g:
                mine[g] = group
    return mine


def _collective(op: str, elements: int, group, g: int) -> Optional[Callable[[], Any]]:
    buffer = torch.randn(elements)
    if op == "all_reduce":
        return lambda: dist.all_reduce(buffer, group=group)
    if op == "all_gather":
        shard, full = torch.randn(max(1, elements // g)), torch.empty(max(1, elements // g) * g)
        return lambda: dist.all_gather_single(full, shard, group=group)
    if op == "reduce_scatter":
        shard = torch.empty(max(1, elements // g))
        full = torch.randn(shard.numel() * g)
        return lambda: dist.reduce_scatter_single(shard, full, group=group)
    out = torch.empty(max(g, elements // g * g))
    source = torch.randn(out.numel())
    return lambda: dist.all_to_all_single(out, source, group=group)


def _collectives(groups: Dict[int, Any]) -> Dict[str, Dict[int, Link]]:
    found: Dict[str, Dict[int, Link]] = {}
    for op in COLLECTIVES:
        for g, group in groups.items():
            try:
                small, large = (_timed(_collective(op, n, group, g)) for n in (SMALL, LARGE))
            except (RuntimeError, ValueError):   # an op the backend lacks (gloo: reduce-scatter)
                continue
            found.setdefault(op, {})[g] = _link(small, large, 4 * (LARGE - SMALL) * SENT_SHARE[op](g))
    return found


def _busy_latency(groups: Dict[int, Any], width: int) -> Dict[int, float]:
    """What a 4-element all-reduce adds to a matmul (256 rows, as a tp layer's) run before
    it, every rank at once, over groups of each size: the latency of a collective whose
    ranks arrive from computing."""
    matmul, small = _matmul(256, width), torch.randn(SMALL)
    compute = _timed(matmul)
    found = {}
    for g, group in groups.items():
        def both(group=group):
            matmul()
            dist.all_reduce(small, group=group)
        found[g] = max(0.0, _timed(both) - compute)
    return found


def _p2p() -> Link:
    """A message one way: half a round trip between rank pairs (0, 1), (2, 3), ..."""
    rank, world = dist.get_rank(), dist.get_world_size()
    peer = rank ^ 1
    if world == 1 or peer >= world:
        peer = None

    def ping(buffer):
        if peer is None:
            return
        if rank % 2 == 0:
            dist.send(buffer, peer)
            dist.recv(buffer, peer)
        else:
            dist.recv(buffer, peer)
            dist.send(buffer, peer)

    small, large = torch.zeros(SMALL), torch.zeros(LARGE)
    t_small, t_large = _timed(lambda: ping(small)) / 2, _timed(lambda: ping(large)) / 2
    return _link(t_small, t_large, 4 * (LARGE - SMALL))


def _link(small: float, large: float, sent: float) -> Link:
    """Latency: the small call's time; bandwidth: the bytes the large call sends more over the
    time it takes more. Where noise leaves that difference under half the large call's time
    (an unbounded bandwidth, or a negative one), half the large call's time is taken: the
    bandwidth is then no more than twice what the large call alone shows."""
    return Link(alpha=small, beta=sent / max(large - small, large / 2))


def _overlap(width: int) -> float:
    """How much of an asynchronous all-reduce hides behind matmuls run meanwhile."""
    buffer = torch.randn(LARGE)
    a, b = torch.randn(256, width), torch.randn(width, 4 * width)

    def compute():
        for _ in range(8):
            a @ b

    def both():
        work = dist.all_reduce(buffer, async_op=True)
        compute()
        work.wait()

    t_comm, t_compute, t_both = _timed(lambda: dist.all_reduce(buffer)), _timed(compute), _timed(both)
    hidden = t_comm + t_compute - t_both
    return min(1.0, max(0.0, hidden / min(t_comm, t_compute)))


def _memory_bandwidth(optimizer: Callable) -> float:
    """Bytes per second the optimizer's step streams over 1M parameters in 4 tensors: the
    gradient read, the weight and each state read and written (the time model's 3 x
    parameter bytes + 2 x state bytes)."""
    params = [torch.nn.Parameter(torch.randn(1 << 18)) for _ in range(4)]
    for p in params:
        p.grad = torch.randn_like(p)
    stepper = optimizer(params)
    stepper.step()
    states = sum(t.numel() * t.element_size() for state in stepper.state.values() for t in state.values()
                 if isinstance(t, torch.Tensor) and t.dim() > 0)
    return (3 * sum(p.numel() * p.element_size() for p in params) + 2 * states) / _timed(stepper.step)


def _tiny_gpt(layers: int, width: int) -> Tuple[GPT, torch.Tensor]:
    """A GPT with next to nothing to compute (4 tokens, 8 sequences per dp rank, one head)
    and a dp rank's batch for it."""
    torch.manual_seed(0)
    seq = 4
    model = GPT(GPTConfig(vocab_size=16, block_size=seq, n_layer=layers, n_head=1, n_embd=width))
    return model, torch.randint(0, 16, (8, seq))


def _tiny_gpt_units(blocks: int) -> int:
    """The tiny GPT's pipeline units: wte, wpe, each block, ln_f, lm_head."""
    return blocks + 4


def _tiny_step(strategy: Strategy, layers: int, optimizer: Callable, width: int = TINY_WIDTH) -> Callable[[], Any]:
    """A graphpar training step of the tiny GPT, compiled, to time."""
    model, x = _tiny_gpt(layers, width)
    pm = compile_model(model, strategy, example_inputs=(x,), loss_fn=lm_loss, optimizer=optimizer, example_target=x)
    return lambda: pm.train_step(x, target=x)


def _zero_width(width: int) -> int:
    """The width ZeRO's work is timed at: the model's, up to ZERO_MAX_WIDTH (5 blocks of a
    wider GPT would hold more than a calibration should allocate)."""
    return min(width, ZERO_MAX_WIDTH)


def _tiny_message_bytes() -> int:
    """The bytes of one of the tiny GPT's pipeline messages: its activations, float32."""
    _, x = _tiny_gpt(1, TINY_WIDTH)
    return x.numel() * TINY_WIDTH * 4


def _overheads(world: int, width: int, optimizer: Callable, message: float,
               speedup: Dict[int, float]) -> Dict[str, Any]:
    """The tiny GPTs' steps, compiled first and then timed taking turns (_interleaved: the
    fits are differences between them), fitted to the overheads (`message`: the seconds of
    one of their pipeline messages, `speedup` the speeds measured, overheads_from's)."""
    dp = Strategy(dp=world)
    steps = {("dp", blocks): _tiny_step(dp, blocks, optimizer) for blocks in OVERHEAD_BLOCKS}
    if world > 1:
        # ZeRO's extra time per step at the model's width, against zero=0 (zero_overhead()
        # takes out what the time model counts of it)
        steps.update({("zero", z): _tiny_step(Strategy(dp=world, zero=z), ZERO_BLOCKS, optimizer, _zero_width(width))
                      for z in (0, 1, 2, 3)})
        steps.update({("pp", m): _tiny_step(Strategy(pp=world, microbatches=m, schedule="1f1b"), world, optimizer)
                      for m in OVERHEAD_MICROBATCHES})
        interleaved = Strategy(pp=world, microbatches=INTERLEAVED_MICROBATCHES, schedule="interleaved-1f1b",
                               virtual_stages=INTERLEAVED_VIRTUAL)
        steps[("interleaved", INTERLEAVED_MICROBATCHES)] = _tiny_step(interleaved, _interleaved_blocks(world), optimizer)
    return overheads_from(world, _interleaved(steps, min_seconds=0.05), message, speedup)


def _tiny_pipelines(world: int) -> List[Tuple[Tuple[str, int], List, int, float]]:
    """(key of its seconds, schedule, turns, units per stage) of each tiny pipeline step timed."""
    found = [(("pp", m), build_schedule("1f1b", world, m, 1), m + world - 1, _tiny_gpt_units(world) / world)
             for m in OVERHEAD_MICROBATCHES]
    m, v = INTERLEAVED_MICROBATCHES, INTERLEAVED_VIRTUAL
    found.append((("interleaved", m), build_schedule("interleaved-1f1b", world, m, v), m * v + world - 1,
                  _tiny_gpt_units(_interleaved_blocks(world)) / (world * v)))
    return found


def _pipeline_fit(world: int, seconds: Dict[Tuple[str, int], float], message: float,
                  speedup: Dict[int, float]) -> Tuple[float, float]:
    """(unit, call): the least-squares fit of (a constant, unit, call) through the tiny
    pipeline steps' seconds less what their messages add at the last fit's costs."""
    steps = _tiny_pipelines(world)
    rows = torch.tensor([[1.0, turns * stage_units, turns] for _, _, turns, stage_units in steps], dtype=torch.float64)
    fitted = (0.0, 0.0)
    for _ in range(MESSAGE_FITS):
        times = [[seconds[key] - _message_seconds(schedule, world, stage_units * fitted[0] + fitted[1], message,
                                                  speedup)]
                 for key, schedule, _, stage_units in steps]
        _, per_unit, per_call = torch.linalg.lstsq(rows, torch.tensor(times, dtype=torch.float64)).solution.flatten().tolist()
        settled = max(abs(per_unit - fitted[0]), abs(per_call - fitted[1])) < MESSAGE_SETTLED
        fitted = (per_unit, per_call)
        if settled:
            break
    return fitted


def _message_seconds(schedule: List, world: int, call: float, message: float, speedup: Dict[int, float]) -> float:
    """What messages of `message` seconds as calibrated add to a pipeline step whose stage
    calls cost `call` (split between forward and backward as the time model splits the
    executor's overheads), each at the speed of the ranks busy while it is in flight, as the
    time model takes them (time_model.message_seconds)."""
    forward, backward = forward_backward(call)
    first = simulate(schedule, world, forward, backward, p2p_cost=message)
    at_speed = message_seconds(message, first, 1, lambda ranks: speed_in(speedup, ranks))
    sent, free = (simulate(schedule, world, forward, backward, p2p_cost=cost).makespan for cost in (at_speed, 0.0))
    return sent - free


def _interleaved_blocks(world: int) -> int:
    """The tiny GPT's blocks for interleaved 1F1B at pp = world: a unit for each of its
    pp x virtual stages at least."""
    return max(world, INTERLEAVED_VIRTUAL * world - _tiny_gpt_units(0))


def overheads_from(world: int, seconds: Dict[Tuple[str, int], float], message: float = 0.0,
                   speedup: Optional[Dict[int, float]] = None) -> Dict[str, Any]:
    """The overheads from the tiny steps' seconds: ("dp", blocks) at dp = world, ("zero", z)
    at each ZeRO stage, ("pp", microbatches) at pp = world 1F1B, ("interleaved",
    microbatches) at pp = world interleaved 1F1B.

    A pipeline step of balanced stages takes `turns` stage calls one after the other
    (1F1B: m + pp - 1; interleaved: m v + pp - 1), each its stage's units times the unit's
    overhead per microbatch plus the call's own (microbatch_overhead): a least-squares fit
    of (a constant, unit, microbatch) through the four pipeline steps, each less what its
    messages add (`message` seconds each as calibrated, at the speed of the ranks busy while
    it is in flight in `speedup`, simulated at the fitted costs, refitted until they settle:
    _pipeline_fit; the time model simulates every message itself, and a fit that kept them
    counted each twice; about 0.6 of a message per 1F1B turn). The dp line's slope
    (one microbatch) is then a unit's per-microbatch overhead plus its per-step one
    (unit_step_overhead: its parameters' optimizer step and gradient handling, which the
    pipeline's microbatches do not repeat); its intercept the step's own plus a microbatch's."""
    units = [_tiny_gpt_units(blocks) for blocks in OVERHEAD_BLOCKS]
    line = statistics.linear_regression(units, [seconds[("dp", blocks)] for blocks in OVERHEAD_BLOCKS])
    zero = {z: seconds[("zero", z)] - seconds[("zero", 0)] for z in (1, 2, 3)} if world > 1 else {}
    unit, microbatch = max(0.0, line.slope), 0.0
    if world > 1:
        per_unit, per_call = _pipeline_fit(world, seconds, message, speedup or {})
        # noise can tip either below 0: a cost that is not there
        unit, microbatch = min(unit, max(0.0, per_unit)), max(0.0, per_call)
    return {"unit_overhead": unit, "microbatch_overhead": microbatch,
            "unit_step_overhead": max(0.0, line.slope - unit),
            "step_overhead": max(0.0, line.intercept - microbatch), "zero_steps": zero}
