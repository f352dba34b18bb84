"""The `graphpar` command line.

    graphpar demo   train the small GPT with graphpar and check it against eager PyTorch
    graphpar dump   compile a model and write the graph after every pass (.py/.json/.dot)
    graphpar plan   per-rank memory and communication plan (--auto: search the strategy)

Exit codes: 0 success; 1 a failed parity check or an error graphpar reported (printed as
one message, without a traceback); 2 bad usage.
"""
from __future__ import annotations

import argparse
import functools
import dataclasses
import importlib
import os
import pathlib
import sys
import time
from typing import Dict, List, Optional, Tuple

import torch

from graphpar.frontend.compile import lower_rank
from graphpar.passes.manager import list_passes
from graphpar.planner import auto
from graphpar.planner.calibrate import DEFAULT_OPTIMIZER, model_width
from graphpar.planner.measure import measure_steps
from graphpar.planner.plan import plan
from graphpar.strategy import SCHEDULES, ZERO_STAGES, Strategy
from graphpar.tools import demo
from graphpar.ir.printer import write_graph_dump
from graphpar.distributed.launch import LaunchError
from graphpar.models.gpt import lm_loss

# graphpar's own errors name the bad value and a fix; a traceback adds nothing for the user.
USER_ERRORS = (ValueError, TypeError, NotImplementedError, LaunchError)


# ---- argument types ----------------------------------------------------------------------
def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {text}")
    return value


def _add_model_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("model and data (the built-in GPT, byte-level vocab 256)")
    group.add_argument("--layers", type=_positive_int, default=2, help="transformer blocks (default 2)")
    group.add_argument("--n-embd", type=_positive_int, default=64,
                       help=f"width, a multiple of the {demo.N_HEAD} attention heads (default 64)")
    group.add_argument("--seq-len", type=_positive_int, default=64, help="tokens per sequence (default 64)")
    group.add_argument("--batch-size", type=_positive_int, default=8,
                       help="global batch: sequences per step over all DP ranks (default 8)")
    group.add_argument("--seed", type=int, default=0, help="seed for weights and data (default 0)")


def _add_strategy_flags(parser: argparse.ArgumentParser, degree_default: int = 1,
                        microbatches_default: int = 1, exact_only: bool = False) -> None:
    """`exact_only`: only fields that keep training equal to fp32 single-device training
    (the demo checks that; bf16 weights or row-wise embedding updates would not)."""
    group = parser.add_argument_group("strategy (dp * tp * pp processes)")
    for degree, meaning in (("dp", "data"), ("tp", "tensor"), ("pp", "pipeline")):
        group.add_argument(f"--{degree}", type=_positive_int, default=degree_default,
                           help=f"{meaning}-parallel degree (default {degree_default})")
    group.add_argument("--microbatches", type=_positive_int, default=microbatches_default,
                       help=f"pipeline microbatches per step (default {microbatches_default})")
    group.add_argument("--schedule", default="1f1b", choices=SCHEDULES,
                       help="pipeline schedule (default 1f1b)")
    group.add_argument("--virtual-stages", type=_positive_int, default=1,
                       help="model chunks per pipeline rank, for interleaved-1f1b (default 1)")
    group.add_argument("--sequence-parallel", action="store_true",
                       help="split activations between tp regions along the sequence (needs --tp > 1)")
    group.add_argument("--offload-optimizer", action="store_true",
                       help="optimizer step, fp32 master weights and states on the host")
    group.add_argument("--zero", type=int, choices=ZERO_STAGES, default=0,
                       help="ZeRO stage: 1 shards optimizer states over the dp ranks, 2 gradients too, "
                            "3 parameters too (default 0)")
    if not exact_only:
        group.add_argument("--param-dtype", choices=("bf16", "fp16"), default=None,
                           help="low-precision weights on the device, fp32 masters (default: fp32)")
        group.add_argument("--reduce-dtype", choices=("fp32", "bf16", "fp16"), default=None,
                           help="gradients' accumulation and dp reduction dtype: fp32 or the --param-dtype "
                                "(default: fp32)")
        group.add_argument("--offload-embedding", action="store_true",
                           help="untied embedding tables on the host, rows split over the dp ranks")


def _shared_config(args: argparse.Namespace, strategy: Optional[Strategy] = None):
    """The model, data and strategy flags that demo and dump have in common (`strategy`
    replaces the strategy flags)."""
    if strategy is None:
        # each strategy flag is named after its Strategy field (--virtual-stages: virtual_stages)
        strategy = Strategy(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Strategy)
                               if hasattr(args, f.name)})
    return demo.DemoConfig(batch_size=args.batch_size, seq_len=args.seq_len, layers=args.layers,
                           n_embd=args.n_embd, strategy=strategy)


def _check_shapes(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Errors argparse can report before any process starts or any model is built."""
    heads = demo.N_HEAD
    if args.n_embd % heads:
        parser.error(f"--n-embd {args.n_embd} must be a multiple of the {heads} attention heads; try "
                     f"--n-embd {args.n_embd + heads - args.n_embd % heads}")
    if args.batch_size % args.dp:
        parser.error(f"--batch-size {args.batch_size} must split evenly over --dp {args.dp} ranks; try "
                     f"--batch-size {args.batch_size + args.dp - args.batch_size % args.dp}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="graphpar", description="Compiled graph partitioning for PyTorch training.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    demo = commands.add_parser(
        "demo", help="train a small GPT with graphpar and check it against single-device training",
        description="Train the small GPT on a bundled public-domain text, then check graphpar "
                    "against eager single-device PyTorch. Exit code 0 on PASS, 1 on FAIL.")
    demo.add_argument("--steps", type=_positive_int, default=200, help="training steps (default 200)")
    demo.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (default 1e-3)")
    demo.add_argument("--check-steps", type=_non_negative_int, default=5,
                      help="steps of the parity check; 0 skips it (default 5)")
    demo.add_argument("--out", default="./graphpar_demo_out",
                      help="output folder for dumps/ and summary.json (default ./graphpar_demo_out)")
    _add_model_flags(demo)
    _add_strategy_flags(demo, degree_default=2, microbatches_default=2, exact_only=True)  # dp2 x tp2 x pp2
    demo.set_defaults(run=cmd_demo)

    dump = commands.add_parser(
        "dump", help="compile a model and write the graph after every pass",
        description="Compile MODEL_SPEC and write, per pass and per rank, the graph as Python, "
                    "JSON and a Graphviz drawing.")
    dump.add_argument("model", metavar="MODEL_SPEC",
                      help="'gpt' (the built-in GPT; see the model flags) or 'module.path:factory', "
                           "a callable returning (model, example_inputs, loss_fn, example_target)")
    dump.add_argument("--out", required=True, help="folder to write the dumps to")
    dump.add_argument("--tracer", default="auto", choices=("auto", "fx", "export"),
                      help="front end: symbolic_trace, falling back to torch.export (default auto)")
    _add_model_flags(dump)
    _add_strategy_flags(dump)
    dump.set_defaults(run=cmd_dump)

    plan = commands.add_parser(
        "plan", help="per-rank memory and communication plan, before anything runs",
        description="Compile MODEL_SPEC for tp rank 0 of each pipeline stage (no processes, no "
                    "process group) and report per-rank parameter, gradient, optimizer and "
                    "activation bytes, every transfer per step and the pipeline bubble.")
    plan.add_argument("model", metavar="MODEL_SPEC", nargs="?", default="gpt",
                      help="'gpt' (default; the built-in GPT, see the model flags) or "
                           "'module.path:factory' returning (model, example_inputs, loss_fn, example_target)")
    plan.add_argument("--optimizer", default="adamw", choices=("adamw", "sgd", "none"),
                      help="optimizer whose states are counted (default adamw)")
    plan.add_argument("--auto", action="store_true",
                      help="search dp x tp x pp, microbatches, schedule, optimizer placement, ZeRO stage "
                           "and (with --memory-budget) activation recomputation for --world-size and rank "
                           "them by the cost model (graphpar/planner/auto.py); the strategy flags are ignored")
    plan.add_argument("--world-size", type=_positive_int, default=8, help="world size for --auto (default 8)")
    plan.add_argument("--calibrate", action="store_true",
                      help="with --auto: cost the candidates with the calibrated time model, measuring this "
                           "machine first (under a minute on 2 cores at world 2 or 4, world-size processes on "
                           "gloo; cached per machine and torch version: graphpar.auto.calibrate)")
    plan.add_argument("--measure", type=_non_negative_int, nargs="?", const=5, default=0, metavar="N",
                      help="with --auto: also run the N best-ranked candidates (default 5) for 2 warm-up and 5 "
                           "timed steps each and print the median step time beside the prediction")
    plan.add_argument("--memory-budget", type=float, default=None, metavar="BYTES",
                      help="per-rank memory budget for --auto, in bytes; recomputation is searched only "
                           "with one (without a budget it only costs time)")
    plan.add_argument("--backend", choices=("gloo", "nccl"), default=None,
                      help="the torch.distributed backend to plan the collectives for (default: nccl where "
                           "CUDA is available, gloo elsewhere, as graphpar.launch picks); gloo has no "
                           "reduce-scatter of its own: ZeRO sends its rows point to point there, and "
                           "sequence parallelism all-reduces (docs/zero.md)")
    plan.add_argument("--json", metavar="PATH", help="also write the plan as JSON")
    plan.add_argument("--html", metavar="PATH", help="also write the plan as an HTML page")
    _add_model_flags(plan)
    _add_strategy_flags(plan)
    plan.set_defaults(run=cmd_plan)
    return parser


# ---- demo --------------------------------------------------------------------------------
def cmd_demo(args: argparse.Namespace) -> int:
    config = dataclasses.replace(_shared_config(args), steps=args.steps, lr=args.lr,
                                 check_steps=args.check_steps, out=args.out)
    return demo.run(config)


# ---- dump --------------------------------------------------------------------------------
def _gpt_example(config):
    x, y = next(demo.batches(demo.load_corpus(), config))
    local = config.batch_size // config.strategy.dp
    return demo.build_model(config), (x[:local],), lm_loss, y[:local]


def _factory_example(spec: str):
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ValueError(f"MODEL_SPEC {spec!r} is neither 'gpt' nor 'module.path:factory'. "
                         f"Fix: e.g. graphpar dump mypkg.models:make_model --out dumps")
    # Like `python -m`: a factory in a file next to where the user stands must be importable.
    sys.path.insert(0, os.getcwd())
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"MODEL_SPEC {spec!r} could not be imported ({exc}). Fix: name a "
                         f"module-level callable, 'package.module:function'.") from exc
    example = factory()
    if not isinstance(example, tuple) or len(example) != 4:
        raise ValueError(f"{spec}() must return (model, example_inputs, loss_fn, example_target), "
                         f"got {type(example).__name__}. Fix: return a 4-tuple; loss_fn and "
                         f"example_target may be None.")
    return example


def dump_rank(spec: str, config, out: str, tracer: str, rank: int = 0) -> Tuple[str, float]:
    """Run the passes for one rank of the strategy's world and write its dumps. No process
    or process group is needed (graphpar.lower_rank): any rank of any world can be dumped."""
    model, example_inputs, loss_fn, example_target = (
        _gpt_example(config) if spec == "gpt" else _factory_example(spec))
    start = time.perf_counter()
    result = lower_rank(model, config.strategy, example_inputs, rank=rank,
                        world_size=config.world_size, loss_fn=loss_fn,
                        example_target=example_target, tracer=tracer, dump=out)
    compile_s = time.perf_counter() - start
    index = len(result.snapshots)
    for stage, program in result.compiled.stages.items():
        write_graph_dump(out, rank, index, f"stage{stage}", program.gm)
    return result.compiled.program.front_end, compile_s


def _files(directory: pathlib.Path) -> Dict[pathlib.Path, Tuple[int, int]]:
    if not directory.is_dir():
        return {}
    return {p: (p.stat().st_mtime_ns, p.stat().st_size) for p in directory.rglob("*") if p.is_file()}


def cmd_dump(args: argparse.Namespace) -> int:
    config = _shared_config(args)
    out = pathlib.Path(args.out)
    before = _files(out)
    timings = [dump_rank(args.model, config, str(out), args.tracer, rank) for rank in range(config.world_size)]
    front_end, compile_s = timings[0][0], sum(t for _, t in timings)
    written = sorted(p for p, stat in _files(out).items() if before.get(p) != stat)
    print(f"compiled in {compile_s:.2f} s ({front_end} front end); passes: "
          f"{', '.join(list_passes(config.strategy))}")
    print(f"wrote {len(written)} files under {out.resolve()}:")
    for path in written:
        print(f"  {path}")
    return 0


# ---- plan --------------------------------------------------------------------------------
OPTIMIZERS = {"adamw": functools.partial(torch.optim.AdamW, lr=1e-3),
              "sgd": functools.partial(torch.optim.SGD, lr=1e-3, momentum=0.9), "none": None}


def cmd_auto(args: argparse.Namespace) -> int:
    config = _shared_config(args, Strategy(seed=args.seed))   # the search chooses the rest
    model, example_inputs, loss_fn, example_target = (
        _gpt_example(config) if args.model == "gpt" else _factory_example(args.model))
    calibration = None
    if args.calibrate:
        calibration = auto.calibrate(args.world_size, width=model_width(model), model=model,
                                     example_inputs=example_inputs, loss_fn=loss_fn, example_target=example_target,
                                     optimizer=OPTIMIZERS[args.optimizer] or DEFAULT_OPTIMIZER)
        print(calibration.to_text() + "\n")
    result = auto.search(model, args.world_size, example_inputs, loss_fn=loss_fn,
                         optimizer=OPTIMIZERS[args.optimizer], example_target=example_target,
                         memory_budget=int(args.memory_budget) if args.memory_budget else None,
                         calibration=calibration)
    if args.measure:
        best = sorted((c for c in result.candidates if not c.reason), key=lambda c: c.cost)[:args.measure]
        times = measure_steps(model, [c.strategy for c in best], example_inputs, loss_fn, OPTIMIZERS[args.optimizer],
                              example_target)
        for candidate, seconds in zip(best, times):
            candidate.measured = seconds
    print(result.to_text())
    return 0 if result.best is not None else 1


def cmd_plan(args: argparse.Namespace) -> int:
    if args.auto:
        return cmd_auto(args)
    config = _shared_config(args)
    model, example_inputs, loss_fn, example_target = (
        _gpt_example(config) if args.model == "gpt" else _factory_example(args.model))
    report = plan(model, config.strategy, example_inputs=example_inputs, loss_fn=loss_fn,
                  optimizer=OPTIMIZERS[args.optimizer], example_target=example_target, backend=args.backend)
    print(report.to_text())
    if args.json:
        pathlib.Path(args.json).write_text(report.to_json() + "\n")
    if args.html:
        report.to_html(args.html)
    return 0


# ---- entry point -------------------------------------------------------------------------
def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command in ("demo", "dump", "plan"):
        _check_shapes(parser, args)
    try:
        return args.run(args)
    except USER_ERRORS as exc:
        print(f"graphpar {args.command}: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    # Run the importable copy: functions handed to graphpar.launch must pickle by their
    # module name (graphpar.tools.cli.dump_rank), which the ranks can import; __main__'s
    # copies would not.
    from graphpar.tools.cli import main as _main
    sys.exit(_main())
