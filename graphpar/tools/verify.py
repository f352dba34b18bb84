"""graphpar.verify: prove the parallel program equals the single-device one, or say where not.

    report = graphpar.verify(model, strategy, example_inputs=(x,), target=y, loss_fn=..., steps=2)
    report.passed, report.message

Every rank trains the compiled program and, beside it, the single-device reference built
from the same state_dict, and compares losses, outputs, its gradients against the matching
chunk of the full gradients, and the parameters after `steps` optimizer steps.

On a mismatch it localises the first wrong value. Node names survive every pass, so the
rank's final graph and the traced whole-model graph share them. Both run on the same first
microbatch (evaluation mode: no dropout); each value of the rank is turned back into the
full value by its record's spec (Shard: all-gather over tp; Partial: all-reduce), and nodes
are compared in graph order. The first node that differs while its inputs agree is the
culprit: the pass that last wrote its record (set_by), or, when one of its parameters holds
the wrong piece of the full tensor, the pass that placed the parameters.
"""
from __future__ import annotations

import copy
import functools
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.fx
import torch.utils._pytree as pytree

from graphpar.distributed.launch import launch
from graphpar.frontend.compile import compile as compile_model
from graphpar.ir import Partial, Shard, record
from graphpar.ir.layout import full_from_shards, local_shard
from graphpar.passes.context import PassContext
from graphpar.passes.tracing.compute_dtype import adopt_compute_dtypes
from graphpar.runtime import ops
from graphpar.runtime.single_stage import first_microbatch
from graphpar.runtime.zero import owned_ranges
from graphpar.strategy import Strategy
from graphpar.tools.reference import SingleDeviceReference, cast_inputs

# Parallel sums change float32 rounding: values agree to ~1e-6 relative; a real bug is
# off by O(1) relative. These defaults sit between, and are arguments.
DEFAULT_ATOL = 1e-4
DEFAULT_RTOL = 1e-3
# With param_dtype, a value may also differ by this many times what rounding to param_dtype
# alone does to the reference (its distance from the same training in fp32). A correct run's
# own rounding moves it about as far again (measured: at most 1.9 times it, tiny
# GPT, AdamW, dp2/tp2/pp2 in bf16 and fp16); a wrong shard or a missing reduction moves it
# by the value itself.
NOISE_FACTOR = 4.0
# Locating the first wrong node with param_dtype: each node's value may differ by this many
# units of param_dtype's precision at its largest entry (a wrong shard or reduction is off
# by the value itself).
LOCALISE_ULPS = 8


@dataclass
class Culprit:
    node: str
    pass_name: str
    module_path: str
    max_error: float
    detail: str = ""

    def describe(self) -> str:
        where = f" in {self.module_path}" if self.module_path else ""
        return (f"first wrong value: node {self.node!r}{where}, written by pass {self.pass_name!r} "
                f"(max abs error {self.max_error:.3g}){'; ' + self.detail if self.detail else ''}")


@dataclass
class VerifyReport:
    passed: bool
    losses: List[float]
    reference_losses: List[float]
    max_output_error: float
    max_grad_error: float
    max_param_error: float
    culprit: Optional[Culprit] = None
    problems: List[str] = field(default_factory=list)
    # with max_grad_norm: pm.last_grad_norm and clip_grad_norm_'s total norm, per step
    grad_norms: List[float] = field(default_factory=list)
    reference_grad_norms: List[float] = field(default_factory=list)

    @property
    def message(self) -> str:
        if self.passed:
            return (f"graphpar.verify: PASS: losses {self.losses} match the single-device run; max errors: "
                    f"outputs {self.max_output_error:.2g}, gradients {self.max_grad_error:.2g}, "
                    f"parameters {self.max_param_error:.2g}")
        lines = ["graphpar.verify: FAIL"] + [f"  {p}" for p in self.problems]
        if self.culprit is not None:
            lines.append(f"  {self.culprit.describe()}")
        return "\n".join(lines)


def _close(a: torch.Tensor, b: torch.Tensor, atol: float, rtol: float, noise: float = 0.0) -> Tuple[bool, float]:
    """Whether a matches b to atol + rtol |b|, plus NOISE_FACTOR times `noise`: how far rounding
    to param_dtype alone moved b (see graphpar/tools/reference.py)."""
    if a.shape != b.shape:
        return False, float("inf")
    atol = atol + NOISE_FACTOR * noise
    error = (a.double() - b.double()).abs()
    return bool((error <= atol + rtol * b.double().abs()).all()), float(error.max()) if error.numel() else 0.0


# ---- node-level localisation ---------------------------------------------------------------
class _Recorder(torch.fx.Interpreter):
    def __init__(self, gm):
        super().__init__(gm)
        self.values: Dict[str, Any] = {}
        self.failed: Optional[Tuple[str, str]] = None

    def run_node(self, n):
        try:
            result = super().run_node(n)
        except Exception as exc:  # noqa: BLE001 - a node that cannot run is itself the culprit
            self.failed = (n.name, f"{type(exc).__name__}: {str(exc).splitlines()[0]}")
            raise
        if isinstance(result, torch.Tensor):
            self.values[n.name] = result.detach()
        return result


def _run_recording(gm, inputs) -> _Recorder:
    recorder = _Recorder(gm)
    try:
        with torch.no_grad():
            recorder.run(*inputs)
    except Exception:  # noqa: BLE001 - recorded in recorder.failed
        pass
    return recorder


def _full_value(local: torch.Tensor, spec, mesh) -> torch.Tensor:
    """The whole-model value from this rank's piece (collective over tp)."""
    if mesh.tp == 1 or spec is None or not isinstance(spec, (Shard, Partial)):
        return local
    group = mesh.group("tp")
    if isinstance(spec, Partial):
        total = local.clone()
        dist.all_reduce(total, group=group)
        return total
    parts = [torch.empty_like(local) for _ in range(mesh.tp)]
    dist.all_gather(parts, local.contiguous(), group=group)
    return full_from_shards(parts, spec)


def localise(pm, reference_gm, inputs, atol: float, rtol: float) -> Optional[Culprit]:
    """The first node of this rank's programs whose value differs from the reference."""
    mesh = pm.mesh
    expected = _run_recording(reference_gm, inputs)
    if expected.failed:  # values it never reached would be skipped: a localisation that checks nothing
        raise RuntimeError(f"graphpar.verify: the single-device trace it localises against fails at node "
                           f"{expected.failed[0]!r} ({expected.failed[1]})")
    culprit = None
    for gm in pm.graph_modules:
        stage_inputs = _stage_inputs(gm, inputs, expected.values)
        actual = _run_recording(gm, stage_inputs)
        culprit = culprit or _first_difference(gm, actual, expected.values, mesh, atol, rtol, pm)
    return _agree_on_culprit(culprit, mesh)


def _stage_inputs(gm, inputs, reference_values) -> List[Any]:
    """A stage's placeholders: the user's batch, or values received from earlier stages
    (taken from the reference run, so each stage is checked on its own)."""
    batch = {f"input_{i}": v for i, v in enumerate(inputs)}
    batch["target"] = inputs[-1]
    values = []
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            values.append(batch.get(node.name, reference_values.get(node.name)))
    return values


def _first_difference(gm, actual, expected, mesh, atol, rtol, pm) -> Optional[Culprit]:
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if actual.failed and actual.failed[0] == node.name:
            return _failure_culprit(node, actual.failed[1], pm, atol, rtol)
        if node.name not in actual.values or node.name not in expected:
            continue
        rec = record(node)
        full = _full_value(actual.values[node.name], rec.spec, mesh)
        reference = expected[node.name]
        same, error = _close(full, reference, atol + _rounding(reference, pm._compiled.strategy.param_dtype), rtol)
        if same:
            continue
        inserted = _inserted_input(node, expected)
        if inserted is not None:  # a node a pass added (a collective): not in the reference
            return Culprit(inserted.name, record(inserted).set_by, record(inserted).module_path, error,
                           f"it feeds {node.name}, the first value that differs")
        misplaced = _misplaced_parameter(node, pm, atol, rtol)
        if misplaced is not None:
            return Culprit(misplaced.name, record(misplaced).set_by, record(misplaced).module_path, error,
                           f"parameter {misplaced.target} holds the wrong piece of the full tensor "
                           f"(read by {node.name})")
        return Culprit(node.name, rec.set_by, rec.module_path, error)
    return None


def _failure_culprit(node, error: str, pm, atol, rtol) -> Culprit:
    """A node that cannot run: a parameter holding the wrong piece, else the pass that chose
    the split of a sharded parameter it reads (the split fixes the local shapes), else the
    pass that last wrote the node."""
    detail = f"{node.name} fails to run: {error}"
    misplaced = _misplaced_parameter(node, pm, atol, rtol)
    if misplaced is not None:
        return Culprit(misplaced.name, record(misplaced).set_by, record(misplaced).module_path, float("inf"), detail)
    for source in node.all_input_nodes:
        rec = record(source)
        if source.op == "get_attr" and isinstance(rec.spec, Shard) and rec.spec_by:
            return Culprit(source.name, rec.spec_by, rec.module_path, float("inf"),
                           f"{detail}; {source.target} is split as {rec.spec.describe()}")
    return Culprit(node.name, record(node).set_by, record(node).module_path, float("inf"), detail)


def _rounding(value: torch.Tensor, param_dtype) -> float:
    """With param_dtype, what other sum orders may change in a node's value: LOCALISE_ULPS of
    param_dtype's precision at the value's largest entry (0.0 in fp32, where atol covers it)."""
    if param_dtype is None or not value.is_floating_point() or value.numel() == 0:
        return 0.0
    return LOCALISE_ULPS * torch.finfo(param_dtype).eps * float(value.abs().max())


def _inserted_input(node, expected) -> Optional[torch.fx.Node]:
    """The nearest input that a pass inserted (it has no counterpart in the traced graph)."""
    frontier = list(node.all_input_nodes)
    while frontier:
        source = frontier.pop(0)
        if source.op in ("get_attr", "placeholder") or source.name in expected:
            continue
        return source
    return None


def _misplaced_parameter(node, pm, atol, rtol) -> Optional[torch.fx.Node]:
    full_state = pm._reference_state
    for source in node.all_input_nodes:
        if source.op != "get_attr" or str(source.target) not in full_state:
            continue
        spec = pm._shards().get(str(source.target))
        full = full_state[str(source.target)]
        expected = local_shard(full, spec, pm.mesh.tp_rank, pm.mesh.tp) if spec is not None else full
        local = dict(pm._state())[str(source.target)]
        if not _close(local.detach().cpu(), expected.to(local.dtype), atol, rtol)[0]:  # param_dtype: cast as compile casts
            return source
    return None


def _agree_on_culprit(culprit: Optional[Culprit], mesh) -> Optional[Culprit]:
    """Every rank reports the culprit earliest in the model (stages run different graphs)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return culprit
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, culprit)
    found = [c for c in everyone if c is not None]
    return found[0] if found else None


# ---- the whole check ------------------------------------------------------------------------
def verify_rank(model, strategy, example_inputs, target, loss_fn, optimizer, steps, atol, rtol,
                options, batches=None, lr_scheduler=None) -> VerifyReport:
    """The check on this rank (called on every rank inside a process group)."""
    strategy = Strategy.coerce(strategy)
    optimizer = optimizer or functools.partial(torch.optim.SGD, lr=1e-2)
    initial = copy.deepcopy(model.state_dict())
    dp_rank, dp = _dp_coordinates(strategy)
    local_inputs, local_target = _dp_slice(example_inputs, dp_rank, dp), _dp_slice((target,), dp_rank, dp)[0]
    pm = compile_model(copy.deepcopy(model), strategy, example_inputs=local_inputs, example_target=local_target,
                       loss_fn=loss_fn, optimizer=optimizer, **options)
    pm._reference_state = initial
    reference = SingleDeviceReference(model, strategy, optimizer)
    schedulers = []
    if lr_scheduler is not None:
        reference.schedule(lr_scheduler)
        schedulers = [lr_scheduler(pm.optimizer)] if pm.optimizer is not None else []  # a stage without parameters has none
    problems: List[str] = []
    losses, ref_losses, grad_error, grads_compared = [], [], 0.0, False
    max_grad_norm = options.get("max_grad_norm")
    norms, ref_norms, skips = [], [], []
    output_error = param_error = float("inf")
    batches = _checked_batches(batches) if batches else [(tuple(example_inputs), target)]
    try:
        for step in range(steps):
            inputs, y = batches[step % len(batches)]  # global batches; shapes may vary (a program each)
            loss_scale = pm.loss_scaler.scale if pm.loss_scaler is not None else 1.0  # this step's (fp16)
            ref_losses.append(reference.forward_backward(inputs, y, loss_fn, loss_scale))
            if max_grad_norm is not None:
                ref_norms.append(reference.clip(max_grad_norm))
            step_optimizer, pm.optimizer = pm.optimizer, None
            skipped_before = _skipped(pm)
            losses.append(pm.train_step(*_dp_slice(inputs, dp_rank, dp), target=_dp_slice((y,), dp_rank, dp)[0]))
            skip = _skipped(pm) > skipped_before
            skips.append(skip)
            if max_grad_norm is not None:
                norms.append(pm.last_grad_norm)
            if not (grads_compared or skip):  # the first step taken: its gradients are finite
                grad_error = _grad_error(pm, reference.grads(), loss_scale, atol, rtol, problems)
                grads_compared = True
            pm.optimizer = step_optimizer
            if pm.optimizer is not None:  # None on a pipeline rank holding no parameters
                pm.optimizer.step()
            for scheduler in schedulers:
                scheduler.step()
            reference.step(skip)
        loss_rtol = rtol + _loss_rounding(strategy.param_dtype)
        for step, (a, b) in enumerate(zip(losses, ref_losses)):
            if not _close(torch.tensor(a), torch.tensor(b.value), atol, loss_rtol, b.noise)[0]:
                problems.append(f"step {step}: loss {a:.6g}, single-device {b.value:.6g}")
        for step, (a, b) in enumerate(zip(norms, ref_norms)):
            if skips[step]:  # inf: the overflow the step was skipped for
                continue
            if not _close(torch.tensor(a), torch.tensor(b.value), atol, rtol, b.noise)[0]:
                problems.append(f"step {step}: global gradient norm {a:.6g}, single-device {b.value:.6g}")
        param_error = _param_error(pm, reference, atol, rtol, problems)
        output_error = _output_error(pm, reference, local_inputs, dp_rank, dp, example_inputs, atol, rtol, problems)
    except Exception as exc:  # noqa: BLE001 - a program that cannot run is a mismatch to localise
        problems.append(f"the parallel program fails: {type(exc).__name__}: {str(exc).splitlines()[0]}")
    problems = _union(problems)
    culprit = None
    if problems:
        culprit = _localise_from_start(pm, model, initial, strategy, local_inputs, local_target, loss_fn,
                                       atol, rtol, options)
        if culprit is None:  # every forward value agrees: what differs happens after backward
            culprit = Culprit("(gradients)", "gradient synchronisation (graphpar.runtime.grad_sync, tied weights)", "",
                              grad_error, "forward values agree everywhere; gradients differ")
    return VerifyReport(not problems, losses, [e.value for e in ref_losses], output_error, grad_error, param_error,
                        culprit, problems, norms, [e.value for e in ref_norms])


def _loss_rounding(param_dtype) -> float:
    """How far apart rounding alone may put a correct run's loss and the reference's, relative,
    when the loss is computed in param_dtype (a loss_fn that does not upcast): each is rounded
    to it, half an ulp each, the run's per microbatch and dp rank before they are averaged in
    float32, the reference's once on the whole batch. 0.0 in fp32."""
    return torch.finfo(param_dtype).eps if param_dtype is not None else 0.0


def _skipped(pm) -> int:
    """Steps the fp16 loss scaler skipped so far (0 without one)."""
    return pm.loss_scaler.skipped if pm.loss_scaler is not None else 0


def _checked_batches(batches) -> List[Tuple[Tuple[Any, ...], Any]]:
    """verify(batches=...): (inputs, target) pairs, inputs a tuple as example_inputs is."""
    for i, (inputs, _) in enumerate(batches):
        if not isinstance(inputs, (tuple, list)):
            raise TypeError(f"graphpar.verify(batches=...): batches[{i}] holds inputs of type {type(inputs).__name__}, "
                            f"but each batch is an (inputs, target) pair whose inputs are a tuple of the model's "
                            f"positional inputs, like example_inputs. Fix: batches=[((x,), y), ...].")
    return [(tuple(inputs), y) for inputs, y in batches]


def _dp_coordinates(strategy) -> Tuple[int, int]:
    rank = dist.get_rank() if dist.is_initialized() else 0
    return (rank // strategy.tp) % strategy.dp, strategy.dp


def _dp_slice(values, dp_rank: int, dp: int):
    def piece(v):
        if isinstance(v, torch.Tensor) and v.dim() > 0:
            n = v.shape[0] // dp
            return v[dp_rank * n:(dp_rank + 1) * n]
        return v
    return tuple(piece(v) for v in values)


def _grad_error(pm, full_grads, loss_scale, atol, rtol, problems) -> float:
    worst = 0.0
    # ZeRO: p.grad is the dp average only on this rank's own pieces (zero=1), or None (zero=2)
    owned = owned_ranges(pm._placed.shard_steps) if pm._placed.shard_steps else None
    # where the update program steps, p.grad keeps the dp average and the step divides its own
    # copy by the post-backward divisor (graphpar/runtime/grad_divisor.py: a token count)
    left = pm._divisor.value() if pm._placed.steps_in_program else 1.0
    for name, grad in pm.named_parameters():
        if grad.grad is None or name not in full_grads:
            continue
        spec = pm._shards().get(name)
        expected, noise = full_grads[name].value, full_grads[name].noise
        expected = local_shard(expected, spec, pm.mesh.tp_rank, pm.mesh.tp) if spec is not None else expected
        actual = grad.grad.float() / left / loss_scale  # fp16: p.grad holds the scaled gradient
        if owned is not None:
            ranges = owned.get(name, [])
            actual, expected = _elements(actual, ranges), _elements(expected, ranges)
        same, error = _close(actual, expected, atol, rtol, noise)
        worst = max(worst, error)
        if not same:
            problems.append(f"gradient of {name} on rank {pm.mesh.rank} differs (max abs error {error:.3g})")
    return worst


def _elements(t: torch.Tensor, ranges) -> torch.Tensor:
    """The flat ranges of t, in order (empty without any)."""
    return torch.cat([t.reshape(-1)[a:b] for a, b in ranges]) if ranges else t.new_empty(0)


def _param_error(pm, reference, atol, rtol, problems) -> float:
    full = pm.full_state_dict()
    worst = 0.0
    for key, expected in reference.state_dict().items():
        same, error = _close(full[key], expected.value, atol, rtol, expected.noise)
        worst = max(worst, error)
        if not same:
            problems.append(f"parameter {key} after the optimizer steps differs (max abs error {error:.3g})")
    return worst


def _output_error(pm, reference, local_inputs, dp_rank, dp, example_inputs, atol, rtol, problems) -> float:
    ours = pytree.tree_flatten(pm(*local_inputs))[0]
    theirs = reference.evaluate(example_inputs)
    worst = 0.0
    for a, b in zip(ours, theirs):
        if isinstance(a, torch.Tensor):
            same, error = _close(a, _dp_slice((b.value,), dp_rank, dp)[0], atol, rtol, b.noise)
            worst = max(worst, error)
            if not same:
                problems.append(f"model output differs (max abs error {error:.3g})")
    return worst


def _union(problems: List[str]) -> List[str]:
    """Problems seen by any rank, so every rank returns the same verdict."""
    if not (dist.is_available() and dist.is_initialized()):
        return problems
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, problems)
    return [p for ranks in everyone for p in ranks if p is not None][:20]


def _localise_from_start(pm_trained, model, initial, strategy, inputs, target, loss_fn, atol, rtol, options):
    """Compile again from the initial weights and compare value by value."""
    fresh = copy.deepcopy(model)
    fresh.load_state_dict(initial)
    pm = compile_model(fresh, strategy, example_inputs=inputs, example_target=target, loss_fn=loss_fn, **options)
    pm._reference_state = initial
    flat = list(pytree.tree_flatten(inputs)[0]) + ([target] if loss_fn is not None else [])
    micro = [first_microbatch(v, strategy.microbatches) for v in flat]
    if strategy.param_dtype is not None:
        micro = cast_inputs(micro, strategy.param_dtype)
    with ops.mode(training=False), ops.running_on(pm.mesh):
        return localise(pm, _reference_trace(pm.compiled), micro, atol, rtol)


def _reference_trace(compiled) -> torch.fx.GraphModule:
    """The traced whole-model graph, computing as the ranks do: with param_dtype in it, its
    casts given the dtypes cast_params gives the ranks' (torch.export fixed them, and checks
    of them, at float32 in the trace: passes/tracing/compute_dtype.py)."""
    trace_gm = compiled.snapshots[0][1]
    dtype = compiled.strategy.param_dtype
    if dtype is None:
        return trace_gm
    trace_gm = copy.deepcopy(trace_gm)
    ctx = PassContext(model=compiled.model, strategy=compiled.strategy, mesh=compiled.mesh,
                      example_inputs=compiled.example_inputs, options=compiled.options,
                      example_target=compiled.example_target, loss_fn=compiled.loss_fn)
    adopt_compute_dtypes(trace_gm, ctx, dtype)  # it matched when the ranks' program compiled
    return trace_gm.to(dtype)


def _verify_entry(model, strategy, example_inputs, target, loss_fn, optimizer, steps, atol, rtol, options, batches,
                  lr_scheduler):
    return verify_rank(model, strategy, example_inputs, target, loss_fn, optimizer, steps, atol, rtol, options, batches,
                       lr_scheduler)


def verify(model: torch.nn.Module, strategy, example_inputs, target=None, loss_fn: Optional[Callable] = None,
           optimizer: Optional[Callable] = None, steps: int = 2, atol: float = DEFAULT_ATOL,
           rtol: float = DEFAULT_RTOL, batches=None, lr_scheduler: Optional[Callable] = None,
           **options) -> VerifyReport:
    """Run the parallel program and the single-device reference and compare them.

    example_inputs and target are the GLOBAL batch; each dp rank takes its slice. `batches`:
    a list of (inputs, target) global batches the steps take in turn, of any shapes (each
    new one gets a program of its own); default: example_inputs and target every step.
    `lr_scheduler`: a factory, optimizer -> scheduler (functools.partial(LambdaLR,
    lr_lambda=f)), built on pm.optimizer and on the reference's optimizer and stepped after
    every step, as a training loop steps it.
    Inside a process group of the strategy's world size this runs on every rank; otherwise
    it starts the processes itself (graphpar.launch) and returns rank 0's report.
    """
    strategy = Strategy.coerce(strategy)
    args = (model, strategy, tuple(example_inputs), target, loss_fn, optimizer, steps, atol, rtol, options, batches,
            lr_scheduler)
    if dist.is_available() and dist.is_initialized():
        return verify_rank(*args)
    if strategy.world_size == 1:
        return verify_rank(*args)
    return launch(_verify_entry, strategy.world_size, args=args)[0]
