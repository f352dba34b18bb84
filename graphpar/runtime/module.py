"""ParallelModule: what graphpar.compile returns on each rank.

It holds this rank's compiled program (one GraphModule per local stage), the executor that
runs it, and the optimizer over this rank's parameters. Parameters are this rank's own
tensors, named by the original model's state_dict keys; the user's model is never changed.
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import os
import threading
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch
import torch.fx
import torch.utils._pytree as pytree

from graphpar.distributed import groups as distributed
from graphpar.runtime import experts as expert_runtime, ops
from graphpar.distributed.groups import check_shapes
from graphpar.runtime.single_stage import SingleStageExecutor, batch_size, first_microbatch, unflatten_output
from graphpar.ir import canonical_keys
from graphpar.ir.compiled import CompileCall, CompiledRank, PreviousCompile, replica_axis
from graphpar.ir.printer import check_dump_dir, write_graph_dump
from graphpar.runtime.grad_divisor import GradientDivisor
from graphpar.runtime.grad_norm import NormShare
from graphpar.runtime.grad_sync import GradientSync
from graphpar.runtime.optimizer import make_optimizer
from graphpar.runtime.pipeline.rank_trace import write_rank_trace
from graphpar.runtime.pipeline.setup import pipeline_executor
from graphpar.runtime.placement.precision import LossScaler
from graphpar.runtime.placement.runner import UpdateRunner
from graphpar.runtime.placement.state import PlacedState
from graphpar.runtime.rng import make_streams
from graphpar.runtime.shapes import (ProgramCache, ShapeKey, Specialisation, batch_shapes, cannot_compile,
                                     check_dtypes, check_replica_shapes, check_same_layout, shape_key)
from graphpar.runtime.target import check_target
from graphpar.runtime.zero import zero_active
from graphpar.ir.layout import full_from_shards, full_shape, local_shard

# Step numbers are compared modulo this (see _global_mean): their squares summed over any
# world up to 23,000 ranks stay below 2**53, exact in float64.
_STEP_MODULUS = 4096


class StepMismatchError(RuntimeError):
    """Ranks ran different train steps into the same collectives: some rank carried on
    after a train_step failed on it (or skipped one)."""


# (one microbatch of the inputs, of the target or None, the state to share) -> a new program
Retrace = Callable[[Tuple[Any, ...], Any, PreviousCompile], CompiledRank]


class ParallelModule:
    """Runs one rank's CompiledRank, the compiler's only hand-off (graphpar/ir/compiled.py).

    `call` is what compile was called with (for report()); `retrace(inputs, target, previous)`
    compiles the model again (the frontend's, given by compile): with its loss, for the first
    train_step of a compile that had no example_target, and for each batch of a new shape
    (graphpar/runtime/shapes.py)."""

    # pm.report() is the planner's plan of this module. The planner runs the compiler, which
    # sits above the runtime, so the runtime does not import it: graphpar/__init__.py, the
    # public API that sees every floor, plugs graphpar.planner.plan.plan in here.
    planner: Optional[Callable[..., Any]] = None

    def __init__(self, compiled: CompiledRank, optimizer_factory, dump_dir, call: CompileCall, retrace: Retrace):
        self._compiled = compiled
        self._call = call
        self._retrace = retrace
        self._optimizer_factory = optimizer_factory
        self._dump_dir = dump_dir
        model = compiled.model
        self._state_keys = list(model.state_dict(keep_vars=True).keys())
        self._full_shapes = {k: tuple(t.shape) for k, t in model.state_dict(keep_vars=True).items()}
        self._dtypes = {k: t.dtype for k, t in model.state_dict(keep_vars=True).items()}
        self._canonical = canonical_keys(model)
        self._untraced: Dict[str, torch.Tensor] = {}
        # each module's training flag as compile found it; train_step follows them (train/eval)
        self._modes = ops.training_flags(model)
        self._steps = 0  # train_step calls begun on this rank, compared across ranks each step
        self._running = threading.Lock()  # held by the train_step or evaluation under way
        self.loss_scaler: Optional[LossScaler] = None  # fp16 only (graphpar.runtime.placement.precision)
        self._last_grad_norm: Optional[float] = None
        self._last_dropped_pairs: Optional[int] = None
        self._sync = None  # the gradient sync and update runner every program's executor shares
        self._tied: Optional[list] = None  # pp > 1: tied-weight groups, made once (new_group is collective)
        self._install(compiled)
        params = list(self.parameters())
        # built before any collective, so a factory that fails its checks fails on every rank alike;
        # with master weights the optimizer steps them (in the update program), not `params`;
        # a pipeline stage may hold no parameters at all (only pooling, activations): no optimizer
        masters = self._placed.build_optimizer(optimizer_factory)
        self.optimizer: Optional[torch.optim.Optimizer] = masters if self._placed.steps_in_program else (
            make_optimizer(optimizer_factory, params) if optimizer_factory is not None and params else None)
        self._placed.tables_follow(self.optimizer)
        self._broadcast_from_first_replica()
        self._untraced = self._untraced_state(model)

    # ---- compiled program -------------------------------------------------------------
    def _install(self, compiled: CompiledRank) -> None:
        """`compiled` as the only program, with the state every program shares built around it:
        at compile, and when the lazy loss trace replaces compile's programs (the loss decides
        the gradient divisor, and whether update steps may start during backward)."""
        self._compiled = compiled
        # until weights are loaded: a program traced again (with its loss) reuses the uninitialised
        # tensors, which its own trace does not flag
        self._uninitialized = getattr(self, "_uninitialized", False) or compiled.uninitialized
        if self._sync is not None:
            self._sync.remove()
        self._placed = PlacedState(compiled, compiled.strategy.offload_optimizer)
        if getattr(self, "_rng", None) is None:
            self._rng = make_streams(compiled.strategy.seed, compiled.mesh, compiled.options.device)
        self._divisor = GradientDivisor(compiled.mesh, compiled.strategy.microbatches, compiled.program.loss_count,
                                        distributed.DEFAULT_TIMEOUT_S, compiled.options.max_grad_norm)
        self._norm_share = self._share_of_norm(compiled)
        self._sync = self._gradient_sync(compiled.graph_modules)
        self._loss_traced = compiled.program.has_loss
        self._programs = ProgramCache(compiled.options.max_shapes)
        self._use(self._keep(compiled))

    def _keep(self, compiled: CompiledRank) -> Specialisation:
        """Keep `compiled` as the program of its shape, run by an executor of its own over the
        shared state."""
        key = shape_key(pytree.tree_flatten(compiled.example_inputs)[0],
                        compiled.example_target if compiled.loss_fn is not None else None, 1)
        if not compiled.stages:
            executor = SingleStageExecutor(compiled.gm, compiled.program, compiled.strategy, compiled.mesh,
                                           self._divisor, self._sync, self._rng)
        else:
            executor = pipeline_executor(compiled, self._sync, self._rng, self._divisor, self._tied)
            self._tied = executor.tied
        self._programs.add(key, Specialisation(compiled, executor))
        return self._programs.get(key)

    def _use(self, program: Specialisation) -> None:
        """Make `program` the current one: train_step's (pm.compiled, graph_modules, dump and
        timeline show it)."""
        self._compiled, self._program, self._executor = program.compiled, program.compiled.program, program.executor

    @property
    def compiled(self) -> CompiledRank:
        """This rank's hand-off from the compiler (frozen): programs, plans, layouts."""
        return self._compiled

    def _gradient_sync(self, gms):
        """What runs after backward: dp gradient averaging, and the update program if any
        (which then starts each bucket's step as soon as its average is ready)."""
        mesh, program = self._compiled.mesh, self._placed.program
        sync = None
        if mesh.dp > 1 and not zero_active(self._compiled.strategy, mesh.dp):  # ZeRO reduces in the update program
            ready = self._ready_order(gms)
            experts = [p for name, p in ready if replica_axis(name, self._compiled.expert_shards) == "edp"]
            sync = GradientSync([p for _, p in ready], mesh.group("dp"), mesh.dp,
                                distributed.DEFAULT_TIMEOUT_S, self._compiled.options.bucket_bytes,
                                buckets=program.buckets if program is not None and program.buckets else None,
                                experts=experts, expert_group=mesh.group("edp"))
        if program is None:
            return sync
        if self._compiled.strategy.param_dtype == torch.float16 and self.loss_scaler is None:
            self.loss_scaler = LossScaler()
        return UpdateRunner(program, self._divisor, sync, distributed.DEFAULT_TIMEOUT_S, self.loss_scaler,
                            self._norm_share)

    def _share_of_norm(self, compiled: CompiledRank) -> NormShare:
        """What this rank counts of the global gradient norm: whole gradients are every
        parameter's but ZeRO's (whose reduced shards the update runner counts)."""
        sharded = {name for step in self._placed.shard_steps for name in step.names}
        whole = {name: p for gm in compiled.graph_modules for name, p in gm.named_parameters() if name not in sharded}
        return NormShare(compiled.mesh, compiled.param_shards, compiled.param_stages, whole, compiled.expert_shards)

    def _ready_order(self, gms) -> List[Tuple[str, torch.nn.Parameter]]:
        """This rank's parameters, named, in the reverse of the model's order (module
        registration, which follows the forward pass in practice): backward finishes gradients
        about in this order, so buckets fill while backward runs. The planner buckets the same way."""
        local = {name: p for gm in gms for name, p in gm.named_parameters()}
        order = [k for k in reversed(self._state_keys) if k in local]
        return [(k, local[k]) for k in dict.fromkeys(order)]

    def _broadcast_from_first_replica(self) -> None:
        """Every dp replica starts from the first replica's weights, whatever seed built them."""
        mesh = self._compiled.mesh
        if mesh.dp == 1:
            return
        self._check_shapes_agree("compile (the broadcast of the first dp replica's weights)")
        with torch.no_grad():
            for name, tensor in self._state().items():
                # an ep rank's experts are its own: they come from the first rank holding the same ones
                axis = replica_axis(name, self._compiled.expert_shards)
                torch.distributed.broadcast(tensor, src=mesh.ranks_along(axis)[0], group=mesh.group(axis))
            self._placed.broadcast_masters()

    # ---- one program per input shape (graphpar/runtime/shapes.py) -------------------------
    def _training_program(self, flat, target) -> Specialisation:
        """The program of this batch's shape, with its loss: compiled now if there is none."""
        m = self.strategy.microbatches
        key = shape_key(flat, target if self._compiled.loss_fn is not None else None, m)
        if self._programs.get(key) is None:
            self._compile_for(key, flat, target if key.target is not None else None, m, "train_step")
        return self._programs.get(key)

    def _evaluation_program(self, flat) -> Specialisation:
        """A program that evaluates the batch in whole microbatches, or one compiled now for
        it (a batch train_step could take is split as train_step splits it; another, whole)."""
        batch = batch_size(flat, "pm(x)")
        self._check_dtypes(flat, None)
        program = self._programs.for_evaluation(flat, batch)
        if program is None:
            chunks = self.strategy.microbatches if batch % self.strategy.microbatches == 0 else 1
            key = shape_key(flat, None, chunks)
            self._compile_for(key, flat, None, chunks, "pm(x)")
            program = self._programs.get(key)
        return program

    def _compile_for(self, key: ShapeKey, flat, target, chunks: int, call: str) -> None:
        """Compile the model again for the microbatch shapes of `key`, sharing this module's
        state, and keep the program (with its loss when `target` is given)."""
        self._programs.check_room(key, call)
        micro_inputs = pytree.tree_unflatten([first_microbatch(v, chunks) for v in flat], self._program.in_spec)
        previous = PreviousCompile(parameters=self._model_state(), update=self._placed.program,
                                   host_tables=self._compiled.host_tables, stage_plan=self._compiled.stage_plan)
        try:
            compiled = self._retrace(tuple(micro_inputs), first_microbatch(target, chunks), previous)
        except Exception as error:
            if self._programs.has_inputs(key):  # the loss traced at a known shape: the trace's own errors
                raise
            raise cannot_compile(call, key, self._programs.keys(), error) from error
        check_same_layout(self._compiled, compiled, *self._layout_cause(key, compiled, call))
        if compiled.program.has_loss and not self._loss_traced:
            self._install(compiled)
        else:
            self._keep(compiled)

    def _layout_cause(self, key: ShapeKey, compiled: CompiledRank, call: str) -> Tuple[str, str]:
        """(how the program came to be compiled again, the fix) for a parameter laid out otherwise."""
        if compiled.program.has_loss and not self._loss_traced:
            return ("train_step: compile had no example_target, so it traced the model without its loss; traced "
                    "with the loss", "pass example_target=<one batch of targets> to graphpar.compile, so the "
                    "program is traced with its loss from the start.")
        if self._loss_traced and not compiled.program.has_loss:
            return (f"{call}: compiled for a new shape (microbatch {key.describe()}) without the loss, as pm(x) has "
                    f"no target, while train_step's programs have it; traced without the loss",
                    "evaluate batches of a shape train_step has compiled (pad them to it), so that pm(x) runs a "
                    "program traced with the loss.")
        return (f"{call}: compiled for a new shape (microbatch {key.describe()})",
                "pass batches of a shape already compiled (pad them to it), or compile with an example of this "
                "shape.")

    def _check_dtypes(self, flat, target) -> None:
        examples = pytree.tree_flatten(self._call.example_inputs)[0]
        names = [f"input {i}" for i in range(len(flat))]
        if target is not None:
            flat, examples, names = [*flat, target], [*examples, self._programs.example_target()], [*names, "target"]
        check_dtypes(flat, examples, names)

    @property
    def graph_modules(self) -> List[torch.fx.GraphModule]:
        return self._compiled.graph_modules

    @property
    def mesh(self):
        return self._compiled.mesh

    @property
    def strategy(self):
        return self._compiled.strategy

    @property
    def front_end(self) -> str:
        return self._program.front_end

    # ---- running ----------------------------------------------------------------------
    def train(self, mode: bool = True) -> "ParallelModule":
        """Set every module's training flag, as nn.Module.train does. train_step follows the
        flags (recorded from the model at compile): dropout and batch norm of a module in eval
        mode behave as eager's do. pm(x) always evaluates."""
        self._modes = dict.fromkeys(self._modes, bool(mode))
        return self

    def eval(self) -> "ParallelModule":
        return self.train(False)

    @contextlib.contextmanager
    def _exclusive(self, call: str):
        """One train step or evaluation at a time: a second thread's call would interleave
        its gradients, optimizer step and collectives with the first one's. Refused, not
        queued, so the misuse is seen."""
        if not self._running.acquire(blocking=False):
            raise RuntimeError(
                f"{call} was called on thread {threading.current_thread().name!r} while {self._running_call} "
                f"is running on thread {self._running_thread!r}: a ParallelModule runs one train_step or "
                f"pm(x) at a time. Fix: call it from one thread, or serialise the calls with a lock of your own.")
        self._running_call, self._running_thread = call, threading.current_thread().name
        try:
            yield
        finally:
            self._running.release()

    def train_step(self, *inputs, target=None) -> float:
        with self._exclusive("train_step"):
            self._steps += 1  # counted before any check, so a rank that failed a step is seen ahead
            return self._train_step(inputs, target)

    def _train_step(self, inputs, target) -> float:
        self._check_call(inputs, target)
        flat = self._training_batch(inputs, target)
        check_replica_shapes("train_step", batch_shapes(flat, target), self.mesh)
        self._use(self._training_program(flat, target))
        self._check_has_weights("train_step")
        if not self._program.has_loss:
            raise ValueError("train_step needs a loss: the model returned no scalar loss and compile had "
                             "no loss_fn. Fix: graphpar.compile(..., loss_fn=callable(output, target)).")
        for p in self.parameters():
            p.grad = None
        if self.loss_scaler is not None:
            self._executor.loss_scale = self.loss_scaler.scale
        self._divisor.begin_step()
        experts = self._capped_experts()
        for module in experts:
            module.dropped_pairs = 0
        with ops.module_modes(self._modes):
            loss = self._executor.train_step(flat, target if self._compiled.loss_fn is not None else None)
        self._last_dropped_pairs = sum(module.dropped_pairs for module in experts) if experts else None
        if not self._placed.steps_in_program:  # else the update program divided and stepped
            if self._divisor.clipping and self._placed.program is None:  # else the update runner clipped
                self._divisor.clip(self._norm_share.of_whole())
            self._divide_gradients(self._divisor.value())
            if self.optimizer is not None:
                self.optimizer.step()
        self._last_grad_norm = self._divisor.grad_norm
        return self._global_mean(loss)

    @property
    def last_grad_norm(self) -> Optional[float]:
        """The global gradient norm of the last train_step, before clipping, the same on every
        rank (graphpar/runtime/grad_norm.py); inf for a step the fp16 loss scaler skipped. None
        before the first step, and without compile(max_grad_norm=...), which is what pays for
        it: one all-reduce per step, and update steps that wait for the end of backward."""
        return self._last_grad_norm

    @property
    def last_dropped_pairs(self) -> Optional[int]:
        """The (token, expert) pairs of this rank's tokens (with tp > 1: its replica's) that the
        last train_step dropped past Strategy.expert_capacity_factor's capacity, over every
        experts layer and microbatch of its stages (graphpar/runtime/experts.py). None without
        a capacity factor (dropless) and before the first step."""
        return self._last_dropped_pairs

    def _capped_experts(self) -> List[expert_runtime.ExpertParallel]:
        """This rank's experts modules that drop pairs past a capacity."""
        return [m for gm in self.graph_modules for m in gm.modules()
                if isinstance(m, expert_runtime.ExpertParallel) and m.capacity_factor is not None]

    def _divide_gradients(self, divisor: float) -> None:
        """The post-backward divisor (graphpar/runtime/grad_divisor.py) in place, before the step."""
        grads = list({id(p): p.grad for p in self.parameters() if p.grad is not None}.values())
        if divisor != 1.0 and grads:
            torch._foreach_div_(grads, divisor)

    def _check_call(self, inputs, target) -> None:
        """Mistakes in how train_step is called, refused before anything is traced or run."""
        if not torch.is_grad_enabled():
            raise RuntimeError("train_step was called with gradients disabled (inside torch.no_grad() or "
                               "torch.inference_mode()), so it could compute no gradients. Fix: call train_step "
                               "outside that block; evaluate with pm(x), which needs no gradients.")
        expected = self._program.in_spec.num_children
        if target is None and self._compiled.loss_fn is not None and len(inputs) == expected + 1:
            raise ValueError(f"train_step got {len(inputs)} positional arguments, but the model takes {expected}; "
                             f"the last looks like the target, which is keyword-only. Fix: "
                             f"pm.train_step({', '.join(['x'] * expected)}, target=y).")
        if target is not None:
            check_target(target, batch_size(pytree.tree_flatten(tuple(inputs))[0], "train_step"), "target")

    def _training_batch(self, inputs, target) -> List[Any]:
        """The flat inputs, checked: a target where the loss needs one, the compiled structure,
        a batch the microbatches divide and the compiled dtypes (any sizes: a batch of a new
        shape gets a program of its own)."""
        if self._compiled.loss_fn is not None and target is None:
            if not self._loss_traced:
                raise ValueError("train_step(x) needs target=... because compile was given a loss_fn.")
            raise ValueError("train_step(x) needs target=...: the model was compiled with a loss_fn, which "
                             "takes (output, target). Fix: pm.train_step(x, target=y).")
        flat, spec = pytree.tree_flatten(tuple(inputs))
        if spec != self._program.in_spec:
            raise ValueError(f"train_step inputs have structure {spec}, but the model was compiled with "
                             f"{self._program.in_spec}. Fix: pass inputs shaped like example_inputs.")
        self.strategy.check_batch(batch_size(flat, "train_step"))
        self._check_dtypes(flat, target if self._compiled.loss_fn is not None else None)
        return flat

    def _global_mean(self, loss: torch.Tensor) -> float:
        """The step's mean loss (over the dp replicas and microbatches, or the global token mean
        of a (loss_sum, count) loss) from each replica's loss total and, in the same all-reduce
        over the world, a check that every rank is at the same step. A replica's loss is counted
        once: by its first tp rank, on the stage that computed it (the other stages hold zero)."""
        mesh = self._compiled.mesh
        if mesh.world_size == 1:
            return self._divisor.mean_loss(float(loss))
        step = float(self._steps % _STEP_MODULUS)
        sums = torch.tensor([float(loss) if mesh.tp_rank == 0 else 0.0, step, step * step], dtype=torch.float64)
        work = torch.distributed.all_reduce(sums, async_op=True)
        work.wait(datetime.timedelta(seconds=distributed.DEFAULT_TIMEOUT_S))
        loss_sum, step_sum, square_sum = sums.tolist()
        # n * sum(s^2) == sum(s)^2 exactly when all n step numbers are equal (Cauchy-Schwarz)
        if mesh.world_size * square_sum != step_sum * step_sum:
            self._raise_step_mismatch()
        return self._divisor.mean_loss(loss_sum)

    def _raise_step_mismatch(self) -> None:
        """Every rank sees the same sums, so every rank gathers the step numbers and raises."""
        steps = torch.zeros(self.mesh.world_size, dtype=torch.int64)
        parts = list(steps.chunk(self.mesh.world_size))
        work = torch.distributed.all_gather(parts, torch.tensor([self._steps]), async_op=True)
        work.wait(datetime.timedelta(seconds=distributed.DEFAULT_TIMEOUT_S))
        by_step: Dict[int, List[int]] = {}
        for rank, step in enumerate(steps.tolist()):
            by_step.setdefault(step, []).append(rank)
        where = "; ".join(f"rank(s) {ranks} at train_step {step}" for step, ranks in sorted(by_step.items()))
        raise StepMismatchError(
            f"ranks are out of step: {where} (counted since compile). Their collectives paired up "
            f"across different steps, so this step mixed batches of different steps. A rank that caught "
            f"an exception from train_step (or skipped a call) and carried on causes this. Fix: when "
            f"train_step raises on a rank, stop every rank (let the exception propagate), or restart all "
            f"ranks from a checkpoint.")

    def __call__(self, *inputs):
        with self._exclusive("pm(x)"):
            self._check_has_weights("pm(x)")
            flat, _ = pytree.tree_flatten(tuple(inputs))
            check_replica_shapes("pm(x)", batch_shapes(flat, None), self.mesh)
            program = self._evaluation_program(flat)
            return unflatten_output(program.executor.forward(flat), program.compiled.program.out_spec)

    def timeline(self):
        """What each local stage executed in the last step: (instruction, start s, end s)."""
        return list(getattr(self._executor, "timeline", []))

    def _check_has_weights(self, use: str) -> None:
        """Refuse ``use`` of a model compiled on the meta device before weights are loaded:
        its tensors are uninitialised memory."""
        if self._uninitialized:
            raise RuntimeError(f"the model was compiled on the meta device and has no weights yet, so {use} "
                               f"would read uninitialised memory. Fix: pm.load_full_state_dict(state_dict) or "
                               f"pm.load_checkpoint(path) first.")

    # ---- parameters and state ---------------------------------------------------------
    def named_parameters(self) -> Iterator[Tuple[str, torch.nn.Parameter]]:
        """This rank's parameters in the original model's order (a GraphModule holds them in
        the order the graph first reads them). A weight read by two local stages is listed once."""
        order = {key: i for i, key in enumerate(self._state_keys)}
        local = dict(item for gm in self.graph_modules for item in gm.named_parameters())
        local.update(self._placed.named_pieces())  # zero=3: the pieces of its shards the optimizer steps
        yield from sorted(local.items(), key=lambda item: order.get(item[0], len(order)))

    def parameters(self) -> Iterator[torch.nn.Parameter]:
        for _, p in self.named_parameters():
            yield p

    def _state(self) -> Dict[str, torch.Tensor]:
        state = {}
        for gm in self.graph_modules:
            state.update(gm.state_dict(keep_vars=True))
        return state

    def _model_state(self) -> Dict[str, torch.Tensor]:
        """This rank's tensors of the model's own state, which every program shares; a
        program's constants are its own (a trace bakes them for its shapes, e.g. a count of
        the target's elements)."""
        names = set(self._canonical.values())
        return {name: t for name, t in self._state().items() if name in names}

    def _weights(self) -> Dict[str, torch.Tensor]:
        """This rank's state with each parameter's truth: its fp32 master where it has one."""
        return {**self._state(), **self._placed.masters()}

    def _untraced_state(self, model: torch.nn.Module) -> Dict[str, torch.Tensor]:
        """State the graph never reads (unused parameters, buffers): kept as is."""
        local = {**self._state(), **dict.fromkeys(self._placed.unsharded_names())}
        return {key: t.detach().clone() for key, t in model.state_dict().items()
                if self._canonical[key] not in local and self._owner(self._canonical[key]) is None
                and self._canonical[key] not in self._compiled.expert_owners
                and self._canonical[key] not in self._placed.tables}

    def _shards(self) -> Dict[str, object]:
        return self._compiled.param_shards

    def _check_shapes_agree(self, what: str) -> None:
        """Before graphpar exchanges this module's tensors between ranks (dp broadcasts, tp
        gathers, broadcasts from a stage's rank, checkpoint pieces): every rank's tensors
        must make the model's full shapes, the same on every rank (one small collective over
        the world, so that every rank raises together instead of failing inside gloo)."""
        expected = {self._canonical[key]: shape for key, shape in self._full_shapes.items()}
        held = {name: self._full_shape(name, t) for name, t in self._weights().items() if name in expected}
        world = torch.distributed.group.WORLD if distributed.world_size() > 1 else None
        check_shapes(what, held, expected, world)

    def _full_shape(self, name: str, local: torch.Tensor) -> Tuple[int, ...]:
        """The full shape this rank's piece of `name` is a piece of (tp shard, or ep experts and
        with expert_tp their tp pieces; an expert module's weight is whole)."""
        if name in self._compiled.expert_owners:
            return tuple(local.shape)
        if name in self._compiled.expert_shards:
            return expert_runtime.tp_whole_shape(name, (self._compiled.expert_shards[name], *local.shape[1:]), self.mesh.etp)
        return full_shape(local.shape, self._shards().get(name), self.mesh.tp)

    def _full_experts(self, name: str, local: torch.Tensor) -> torch.Tensor:
        if self.mesh.etp > 1:
            parts = [torch.empty_like(local) for _ in range(self.mesh.etp)]
            torch.distributed.all_gather(parts, local.contiguous(), group=self.mesh.group("tp"))
            local = expert_runtime.tp_whole(name, parts)
        if self.mesh.ep == 1:
            return local
        parts = [torch.empty_like(local) for _ in range(self.mesh.ep)]
        torch.distributed.all_gather(parts, local.contiguous(), group=self.mesh.group("ep"))
        return torch.cat(parts)

    def _full_tensor(self, name: str, local: torch.Tensor) -> torch.Tensor:
        """Gather a tp-sharded tensor from the ranks of this rank's tp group (an expert weight:
        with expert_tp its pieces from the tp group, then the experts from the ep group; an expert
        module's weight is whole on its ep rank)."""
        if name in self._compiled.expert_owners:
            return local.detach().to("cpu", copy=True)
        if name in self._compiled.expert_shards:
            return self._full_experts(name, local.detach()).cpu()
        spec = self._shards().get(name)
        if spec is None:
            return local.detach().to("cpu", copy=True)
        group = self.mesh.group("tp")
        parts = [torch.empty_like(local) for _ in range(self.mesh.tp)]
        torch.distributed.all_gather(parts, local.detach().contiguous(), group=group)
        return full_from_shards(parts, spec).cpu()

    def _owner(self, name: str) -> Optional[int]:
        """The pp rank holding a parameter or buffer (the first stage reading it); None
        without pipeline parallelism."""
        readers = self._compiled.param_stages
        if name not in readers:
            return self._placed.table_owner(name) if self.mesh.pp > 1 else None
        return self.strategy.stage_rank(readers[name][0])

    def _from_owner(self, name: str, tensor: Optional[torch.Tensor], key: str) -> torch.Tensor:
        owner = self._owner(name)
        if owner is None:
            return tensor
        if tensor is None:
            tensor = torch.empty(self._full_shapes[key], dtype=self._dtypes[key])
        source = self.mesh.rank_at(self.mesh.dp_rank, owner, self.mesh.tp_rank)
        torch.distributed.broadcast(tensor, src=source, group=self.mesh.group("pp"))
        return tensor

    def _from_expert_owner(self, name: str, tensor: Optional[torch.Tensor], key: str) -> torch.Tensor:
        """An expert module's weight (list layout), from the ep rank holding it to its ep group
        (the ranks of its layer's stage; _from_owner then sends it to the other stages)."""
        if tensor is None:
            tensor = torch.empty(self._full_shapes[key], dtype=self._dtypes[key])
        source = self.mesh.ranks_along("ep")[self._compiled.expert_owners[name]]
        torch.distributed.broadcast(tensor, src=source, group=self.mesh.group("ep"))
        return tensor

    def full_state_dict(self) -> Dict[str, torch.Tensor]:
        """The original model's state dict, full size, on every rank (collective over tp and
        pp: each tensor is gathered from its tp shards, then sent from its stage's rank)."""
        self._check_has_weights("full_state_dict()")
        self._check_shapes_agree("full_state_dict")
        local = self._weights()
        full, done = {}, {}
        for key in self._state_keys:
            canonical = self._canonical[key]
            if canonical in done:
                full[key] = done[canonical]
            elif canonical in self._placed.tables:
                mine = self._placed.full_table(canonical) if canonical in self._placed.owned_tables() else None
                full[key] = done[canonical] = self._from_owner(canonical, mine, key)
            elif canonical in self._compiled.expert_owners:
                mine = self._full_tensor(canonical, local[canonical]) if canonical in local else None
                if self._owner(canonical) in (None, self.mesh.pp_rank):   # its layer's stage is this rank's
                    mine = self._from_expert_owner(canonical, mine, key)
                full[key] = done[canonical] = self._from_owner(canonical, mine, key)
            elif canonical in local or self._owner(canonical) is not None:
                mine = self._full_tensor(canonical, local[canonical]) if canonical in local else None
                full[key] = done[canonical] = self._from_owner(canonical, mine, key)
            else:
                full[key] = self._untraced[key].detach().to("cpu", copy=True)
        return full

    def load_full_state_dict(self, state_dict: Dict[str, torch.Tensor]) -> None:
        """Shard a full state dict onto the ranks; every key and shape is checked before any
        tensor is written, so a refused state dict leaves the module as it was."""
        _check_keys(set(state_dict), self._state_keys)
        _check_loaded_shapes(state_dict, self._full_shapes)
        local = self._weights()
        with torch.no_grad():
            for key in self._state_keys:
                value = state_dict[key]
                target = local.get(self._canonical[key])
                if self._canonical[key] in self._placed.tables:
                    self._placed.load_table(self._canonical[key], value)
                    continue
                if target is None:
                    if self._canonical[key] in self._compiled.expert_owners:   # another ep rank's expert
                        continue
                    if self._owner(self._canonical[key]) is None:  # not on another stage either
                        self._untraced[key] = value.detach().clone()
                    continue
                spec = self._shards().get(self._canonical[key])
                # (an expert module's weight, list layout, is whole on the rank holding it)
                if self._canonical[key] in self._compiled.expert_shards and \
                        self._canonical[key] not in self._compiled.expert_owners:
                    value = value.chunk(self.mesh.ep)[self.mesh.ep_rank]
                    if self.mesh.etp > 1:
                        value = expert_runtime.tp_piece(self._canonical[key], value, self.mesh.tp_rank, self.mesh.etp)
                elif spec is not None:
                    value = local_shard(value, spec, self.mesh.tp_rank, self.mesh.tp)
                target.copy_(value)
            if self._placed.has_masters:
                self._placed.refresh_device_copies()
        self._uninitialized = False

    # ---- inspection -------------------------------------------------------------------
    def report(self, *inputs, target=None):
        """The planner's per-rank memory and communication plan of this compiled module, for
        compile's example batch or for `inputs` (and `target`: a batch of another shape),
        listing the microbatch shapes this rank has programs for (`shapes`)."""
        call = self._call
        example_inputs, example_target = (inputs, target) if inputs else (call.example_inputs, call.example_target)
        report = type(self).planner(call.model, self._planned_strategy(), example_inputs, loss_fn=call.loss_fn,
                                    optimizer=call.optimizer, world_size=self.mesh.world_size,
                                    example_target=example_target, **call.options.as_kwargs())
        report.shapes = [key.as_dict() for key in self._programs.keys()]
        return report

    def _planned_strategy(self):
        """The strategy as compiled: a measured partition ("profile") becomes the cuts it chose,
        since the planner runs nothing and cannot measure."""
        stage_plan = self._compiled.stage_plan
        if self.strategy.partition != "profile" or stage_plan is None:
            return self.strategy
        return dataclasses.replace(self.strategy, partition=stage_plan.cuts())

    def dump(self, directory: str) -> str:
        check_dump_dir(directory, "directory")
        for index, (name, gm) in enumerate(self._compiled.snapshots):
            write_graph_dump(directory, self.mesh.rank, index, name, gm)
        index = len(self._compiled.snapshots)
        for stage, program in self._compiled.stages.items():
            write_graph_dump(directory, self.mesh.rank, index, f"stage{stage}", program.gm)
        if self._placed.program is not None:
            write_graph_dump(directory, self.mesh.rank, index + 1, "update", self._placed.program)
        if self.timeline():  # this rank's last pipeline step: merge ranks' files in Perfetto
            write_rank_trace(self.timeline(), os.path.join(directory, f"rank{self.mesh.rank}"),
                             self.mesh.pp_rank)
        return os.path.abspath(directory)

    # ---- checkpoints (graphpar/checkpoint/sharded.py, docs/checkpoint.md) ----------------------
    # imported on first use: torch.distributed.checkpoint adds ~1.5 s to `import graphpar`
    def save_checkpoint(self, path: str, extra: Optional[dict] = None, data=None, lr_scheduler=None) -> str:
        """Save model, optimizer, RNG streams, data position, ``lr_scheduler``'s state (one
        built on pm.optimizer) and ``extra`` to ``path`` atomically; collective (every rank,
        same path). Loads under any strategy."""
        from graphpar.checkpoint.sharded import save_checkpoint
        return save_checkpoint(self, path, extra=extra, data=data, lr_scheduler=lr_scheduler)

    def load_checkpoint(self, path: str, data=None, lr_scheduler=None) -> dict:
        """Load a checkpoint saved under any strategy, and ``lr_scheduler``'s position;
        collective. Returns its ``extra``."""
        from graphpar.checkpoint.sharded import load_checkpoint
        return load_checkpoint(self, path, data=data, lr_scheduler=lr_scheduler)


def _check_keys(given: set, expected: List[str]) -> None:
    missing = [k for k in expected if k not in given]
    unexpected = sorted(given - set(expected))
    if missing or unexpected:
        raise ValueError(
            f"load_full_state_dict: the state dict does not match the compiled model "
            f"(missing {len(missing)} keys{': ' + ', '.join(missing[:5]) if missing else ''}; "
            f"unexpected {len(unexpected)}{': ' + ', '.join(unexpected[:5]) if unexpected else ''}). "
            f"Fix: load a state dict saved from this model (model.state_dict() or pm.full_state_dict()).")


def _check_loaded_shapes(state_dict: Dict[str, torch.Tensor], full_shapes: Dict[str, Tuple[int, ...]]) -> None:
    for key, expected in full_shapes.items():
        if tuple(state_dict[key].shape) != expected:
            raise ValueError(f"load_full_state_dict: {key!r} has shape {list(state_dict[key].shape)}, the model "
                             f"expects {list(expected)}. Fix: load a checkpoint of this model.")
