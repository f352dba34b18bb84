"""graphpar.compile: trace, transform and lower a model for this rank.

Called on every rank. If torch.distributed is initialised, the world is its default group
and the mesh's groups are built from it; otherwise the world is this one process.
"""
from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any, Callable, Iterable, Optional, Tuple

import torch
import torch.nn as nn
import torch.utils._pytree as pytree

from graphpar.distributed import groups as distributed
from graphpar.frontend.arguments import (check_bucket_bytes, check_device, check_max_grad_norm, check_max_shapes,
                                         check_no_backward_hooks, module_names_and_options)
from graphpar.ir.compiled import DEFAULT_MAX_SHAPES, CompileCall, CompiledRank, CompileOptions, PreviousCompile
from graphpar.ir.printer import check_dump_dir, write_graph_dump
from graphpar.runtime.single_stage import batch_size, first_microbatch
from graphpar.runtime.grad_sync import DEFAULT_BUCKET_BYTES
from graphpar.distributed.mesh import build_mesh
from graphpar.runtime.zero import check_zero_optimizer
from graphpar.runtime.module import ParallelModule
from graphpar.passes.host_tables import host_embedding_paths
from graphpar.passes.tracing.expert_lists import expert_list_paths
from graphpar.passes.context import PassContext, PassResults
from graphpar.passes.manager import PipelineResult, run_pipeline
from graphpar.runtime.optimizer import check_optimizer_factory
from graphpar.strategy import Strategy
from graphpar.runtime.target import check_target

DUMP_ENV = "GRAPHPAR_DUMP"


def _check_model(model) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"graphpar.compile(model=...) needs a torch.nn.Module, got {type(model).__name__}.")


def _check_example_inputs(example_inputs) -> Tuple[Any, ...]:
    if isinstance(example_inputs, torch.Tensor):
        raise TypeError("example_inputs must be a tuple of the model's positional inputs, got a bare "
                        "tensor. Fix: example_inputs=(x,).")
    if not isinstance(example_inputs, (tuple, list)) or not example_inputs:
        raise TypeError(f"example_inputs must be a non-empty tuple of the model's positional inputs, got "
                        f"{type(example_inputs).__name__}. Fix: example_inputs=(x,).")
    return tuple(example_inputs)


def _check_same_on_every_rank(strategy: Strategy, flat_inputs) -> None:
    """Ranks that disagree on the strategy or the batch shapes would pair up mismatched
    collectives and hang or mix data; compare them once, here, and say which rank differs."""
    if distributed.world_size() == 1:
        return
    mine = (repr(strategy.to_dict() if not strategy.passes else (strategy.dp, strategy.tp, strategy.pp,
                                                                   strategy.microbatches)),
            [tuple(t.shape) if isinstance(t, torch.Tensor) else repr(t) for t in flat_inputs])
    everyone = [None] * distributed.world_size()
    torch.distributed.all_gather_object(everyone, mine)
    for rank, theirs in enumerate(everyone):
        if theirs != everyone[0]:
            what = "strategy" if theirs[0] != everyone[0][0] else "example input shapes"
            raise ValueError(
                f"rank {rank} called graphpar.compile with a different {what} than rank 0 "
                f"({theirs[0] if what == 'strategy' else theirs[1]} vs "
                f"{everyone[0][0] if what == 'strategy' else everyone[0][1]}). Fix: every rank must pass "
                f"the same Strategy and DP-local batches of the same shape.")


def _check_options(model, optimizer, dump_dir, dump_source, options: CompileOptions) -> CompileOptions:
    """compile's keyword options checked before anything is built; returns them with the
    module names checked."""
    check_optimizer_factory(optimizer)
    check_no_backward_hooks(model)
    check_device(options.device)
    check_dump_dir(dump_dir, dump_source)
    check_bucket_bytes(options.bucket_bytes)
    options = dataclasses.replace(options, max_grad_norm=check_max_grad_norm(options.max_grad_norm))
    check_max_shapes(options.max_shapes)
    return _with_module_names(model, options)


def _with_module_names(model, options: CompileOptions) -> CompileOptions:
    return dataclasses.replace(options, **module_names_and_options(model, options.leaf_modules, options.tp_replicate))


def _default_device(model: nn.Module) -> torch.device:
    devices = {t.device for t in model.state_dict().values()} - {torch.device("meta")}
    return devices.pop() if len(devices) == 1 else torch.device("cpu")


def _context(model, strategy: Strategy, mesh, example_inputs, loss_fn, example_target,
             options: CompileOptions) -> PassContext:
    """The pass context of one rank: the first microbatch of the example batch, the options."""
    flat, spec = pytree.tree_flatten(example_inputs)
    batch = batch_size(flat, "example_inputs")
    strategy.check_batch(batch)
    check_target(example_target, batch, "example_target")
    micro_inputs = pytree.tree_unflatten([first_microbatch(v, strategy.microbatches) for v in flat], spec)
    # a host table is looked up whole on each rank (its rows split over dp, not tp); split
    # experts of the list layout run whole on the rows each tp rank dispatches (the experts call
    # replaces their traced linears, which tensor parallelism must not cut)
    replicate = tuple(options.tp_replicate) + tuple(host_embedding_paths(model, strategy.offload_embedding)) + \
        tuple(expert_list_paths(model) if strategy.splits_experts else ())
    device = torch.device(options.device) if options.device is not None else _default_device(model)
    return PassContext(
        model=model, strategy=strategy, mesh=mesh, example_inputs=tuple(micro_inputs),
        options=dataclasses.replace(options, device=device, tp_replicate=replicate),
        example_target=first_microbatch(example_target, strategy.microbatches), loss_fn=loss_fn,
        with_loss=loss_fn is None or example_target is not None)


def _compile_again(ctx: PassContext, dump_dir: Optional[str], micro_inputs: Tuple[Any, ...], micro_target,
                   previous: PreviousCompile) -> CompiledRank:
    """The compile ParallelModule asks for when it needs another program: the model with its
    loss (the first train_step when compile had no example_target), or for a microbatch of
    another shape (graphpar/runtime/shapes.py), sharing the previous state. Without a target
    (pm(x) of a new shape) a loss_fn's loss is left out. A new shape's dumps go to a
    directory of their own inside the dump directory, named by its shapes."""
    again = dataclasses.replace(ctx, example_inputs=micro_inputs, example_target=micro_target,
                                with_loss=ctx.loss_fn is None or micro_target is not None, previous=previous,
                                results=PassResults())
    return run_pipeline(again, _shape_dump_dir(dump_dir, ctx.example_inputs, micro_inputs)).compiled


def _shape_dump_dir(dump_dir: Optional[str], compiled_inputs, micro_inputs) -> Optional[str]:
    shapes = [tuple(t.shape) for t in pytree.tree_flatten(micro_inputs)[0] if isinstance(t, torch.Tensor)]
    if dump_dir is None or shapes == [tuple(t.shape) for t in pytree.tree_flatten(compiled_inputs)[0]
                                      if isinstance(t, torch.Tensor)]:
        return dump_dir
    return os.path.join(dump_dir, "shape_" + "_".join("x".join(map(str, shape)) for shape in shapes))


def lower_rank(model: nn.Module, strategy, example_inputs, *, rank: int, world_size: int,
               loss_fn: Optional[Callable] = None, example_target: Any = None,
               dump: Optional[str] = None, until: Optional[str] = None, snapshots: bool = True,
               **options) -> PipelineResult:
    """Run the pass pipeline for any rank of any world, with no process group: what
    `graphpar dump` and the planner use. Returns the rank's graph and pass snapshots;
    `until` stops after the named pass. `options` are compile's keyword options."""
    _check_model(model)
    strategy = Strategy.coerce(strategy)
    example_inputs = _check_example_inputs(example_inputs)
    check_dump_dir(dump, "dump")
    checked = _with_module_names(model, CompileOptions(**{"device": None, "bucket_bytes": DEFAULT_BUCKET_BYTES,
                                                          **options}))
    checked = dataclasses.replace(checked, max_grad_norm=check_max_grad_norm(checked.max_grad_norm))
    mesh = build_mesh(strategy, rank, world_size, with_groups=False)
    ctx = _context(model, strategy, mesh, example_inputs, loss_fn, example_target, checked)
    result = run_pipeline(ctx, dump, until=until, snapshots=snapshots)
    program = result.ctx.results.update
    if dump and program is not None:  # the rank's update program, after the passes' graphs
        write_graph_dump(dump, rank, len(result.snapshots), "update", program)
    return result


def compile(model: nn.Module, strategy, example_inputs, loss_fn: Optional[Callable] = None,
            optimizer: Optional[Callable] = None, *, example_target: Any = None,
            tracer: str = "auto", leaf_modules: Iterable = (), device=None,
            dump: Optional[str] = None, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
            tp_replicate: Iterable[str] = (), dropout_masks: str = "local",
            max_grad_norm: Optional[float] = None, max_shapes: int = DEFAULT_MAX_SHAPES) -> ParallelModule:
    """Compile `model` for this rank. See docs/strategy.md; the keyword-only options are:

    example_target  one batch of targets for loss_fn; without it the loss is traced at the
                    first train_step (the program is compiled again then)
    tracer          "auto" (symbolic_trace, else torch.export), "fx" or "export"
    leaf_modules    module paths or classes the tracer keeps opaque
    device          where this rank's parameters live (default: the model's device, or cpu)
    dump            directory for per-pass dumps (default: $GRAPHPAR_DUMP)
    bucket_bytes    size of the data-parallel gradient all-reduce buckets (default 25 MiB)
    tp_replicate    module paths tensor parallelism must leave whole (replicated)
    dropout_masks   "local" (Megatron: per-tp-rank streams inside TP regions) or
                    "tp_invariant" (the same masks, and losses, at any tp degree)
    max_grad_norm   clip the global gradient norm (every shard, every axis) to this before
                    each optimizer step, as torch.nn.utils.clip_grad_norm_ (pm.last_grad_norm:
                    the norm before clipping); None: no clipping
    max_shapes      how many input shapes get a program of their own (default 8): a batch
                    of a new shape is compiled on first sight, past the bound refused
    """
    _check_model(model)
    strategy = Strategy.coerce(strategy)
    example_inputs = _check_example_inputs(example_inputs)
    dump_dir = dump or os.environ.get(DUMP_ENV) or None
    options = _check_options(model, optimizer, dump_dir, "dump" if dump else DUMP_ENV, CompileOptions(
        device=device, bucket_bytes=bucket_bytes, tracer=tracer, leaf_modules=leaf_modules,
        tp_replicate=tp_replicate, dropout_masks=dropout_masks, max_grad_norm=max_grad_norm,
        max_shapes=max_shapes))
    check_zero_optimizer(optimizer, strategy)
    mesh = build_mesh(strategy, distributed.rank(), distributed.world_size(),
                      with_groups=torch.distributed.is_available() and torch.distributed.is_initialized())
    flat, _ = pytree.tree_flatten(example_inputs)
    _check_same_on_every_rank(strategy, flat + [example_target])
    ctx = _context(model, strategy, mesh, example_inputs, loss_fn, example_target, options)
    call = CompileCall(model, strategy, example_inputs, example_target, loss_fn, optimizer, options)
    return ParallelModule(run_pipeline(ctx, dump_dir).compiled, optimizer, dump_dir, call,
                          retrace=functools.partial(_compile_again, ctx, dump_dir))
