"""Activation recomputation: a region of the forward run without keeping its intermediates.

passes/recompute.py replaces each chosen region of a program (a transformer block, say) by
one `RecomputeRegion` module that holds the region's nodes as a GraphModule of its own (the
`body`). In a training forward the region runs under `_Recompute`, an autograd Function:

    forward   runs the body, keeps its inputs and the outputs of the calls the plan chose to
              save (`saves`), and lets every other intermediate go
    backward  runs the body again on the kept inputs, with autograd recording, where each
              saved call returns its kept output instead of computing and each call whose
              values backward never reads returns zeros (`plan_calls`, from the first replay
              watched), then backpropagates the gradients of the region's outputs through
              that graph

A call is one op at torch's dispatcher (aten level) made while a node of the body runs; it
is named (node, op, n), the n-th call of that op by that node. What a call keeps is its
output tensors: a saved `addmm` is not run again, but its backward still gets the recomputed
input it needs. Only calls that make new tensors are saved: views and in-place ops always run
again (a view shares storage, an in-place op must act on the recomputed tensor). Random
draws are kept or drawn again region by region, never mixed (a draw skipped before one made
would shift the stream): the pass keeps them all when each only fills a tensor with random
numbers (`fills`: dropout's mask, a bernoulli_ into a fresh bool tensor, 1 byte an element),
so the replay copies the forward's numbers in and draws nothing; on CPU drawing a mask costs
more than the rest of a block's elementwise work. A region with a draw that computes as well
(a fused dropout) draws everything again from the restored streams.

Everything the backward replay depends on is restored from the forward: the dropout streams
(graphpar/runtime/rng.py) and torch's default generator are reset to their states at the
start of the region's forward, then put back (so masks are the forward's, and the draws of
later forwards are untouched), and the executor's run-time state (graphpar/runtime/ops.py:
training flags, the mesh, the streams) is the forward's. Collectives inside a region run
again in the replay (on the same tp group, in the same order on every rank of it): the
replay issues the region's forward collectives once more, and its backward the usual ones.

Saved-tensor hooks (graphpar/runtime/zero3.py's recipes, a user's measurement) see what
the region keeps: its inputs and the saved calls' outputs, packed with save_for_backward.
What the body saves inside the forward and inside the replay is transient and hidden from
them by an identity pair of hooks.

Without autograd recording (evaluation, pm(x)) or with no input needing a gradient the body
just runs.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import logging
import threading
import weakref
from collections import Counter
from dataclasses import dataclass
from typing import Any, Dict, FrozenSet, List, Optional, Sequence, Tuple

import torch
import torch.fx
import torch.nn as nn
import torch.utils._pytree as pytree
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

from graphpar.runtime import ops

Call = Tuple[str, str, int]   # (body node, op, n-th call of that op by that node)
_log = logging.getLogger("graphpar")


@dataclass(frozen=True)
class CallInfo:
    """One call of a region's forward, as `profiling` records it (on fake tensors)."""
    call: Call
    func: Any
    args: Tuple[Any, ...]
    kwargs: Dict[str, Any]
    out: Any
    overwritten: bool = False   # a later in-place op of the region writes the output: never kept
    saved: bool = False         # autograd saves its output (or a view of it) for backward


_PROFILE: Optional[Dict["RecomputeRegion", List[CallInfo]]] = None


@contextlib.contextmanager
def profiling():
    """Within the block, every region's forward records its calls (passes/recompute.py runs
    the program on fake tensors in it to cost what each region could save)."""
    global _PROFILE
    previous, _PROFILE = _PROFILE, {}
    try:
        yield _PROFILE
    finally:
        _PROFILE = previous


def writes_inputs(func) -> bool:
    """An in-place or out= op. torch.distributed's collectives (namespace c10d) write their
    tensors in place without saying so in their schemas."""
    schema = getattr(func, "_schema", None)
    return schema is not None and (schema.is_mutable or getattr(func, "namespace", "") == "c10d")


def _argument(func, args, kwargs, name: str):
    """The value of the call's argument `name` (its default when not given; None if it has none)."""
    for i, argument in enumerate(func._schema.arguments):
        if argument.name == name:
            if i < len(args):
                return args[i]
            return kwargs.get(name, argument.default_value if argument.has_default_value() else None)
    return None


def draws(func, args=(), kwargs=None) -> bool:
    """A call that draws random numbers: an op torch tags as seeded, unless its dropout_p is 0
    (attention without dropout carries the tag but draws nothing)."""
    if torch.Tag.nondeterministic_seeded not in getattr(func, "tags", ()):
        return False
    return _argument(func, args, kwargs or {}, "dropout_p") not in (0, 0.0)


def fills(func, args) -> bool:
    """A draw that reads no tensor's values: an in-place fill of its first argument (dropout's
    mask, bernoulli_) or a factory (torch.rand). The forward may keep what it drew and the replay
    copy it in instead of drawing."""
    schema = func._schema
    first = schema.arguments[0].alias_info if schema.arguments else None
    fills_first = (first is not None and first.is_write and len(schema.returns) == 1
                   and schema.returns[0].alias_info is not None)
    return fills_first or not tensors_in(args)


def keep(func, args, kwargs, out):
    """What the forward keeps of a saved call's outputs: a detached alias; for a draw, a copy of
    the numbers (a later in-place op may write the tensor it filled: attention's dropout divides
    its mask in place), a bernoulli draw's 0s and 1s as bool (1 byte an element)."""
    if not draws(func, args, kwargs):
        return pytree.tree_map_only(torch.Tensor, lambda t: t.detach(), out)
    dtype = torch.bool if _bernoulli(func) else None
    return pytree.tree_map_only(torch.Tensor, lambda t: t.detach().to(dtype or t.dtype, copy=True), out)


def kept_bytes(func, args, kwargs, out) -> int:
    """The bytes `keep` holds for the call (a view's storage counted whole, as autograd's is)."""
    if not draws(func, args, kwargs):
        return sum(t.untyped_storage().nbytes() for t in tensors_in(out))
    size = 1 if _bernoulli(func) else None
    return sum(t.numel() * (size or t.element_size()) for t in tensors_in(out))


def _bernoulli(func) -> bool:
    return func.overloadpacket.__name__.startswith("bernoulli")


def savable(func, args=(), kwargs=None) -> bool:
    """A call whose outputs may be kept instead of run again: it makes new tensors (no view,
    no in-place or out= write, no collective) and draws no random numbers; or it is a draw
    that `fills` (the pass keeps a region's draws all or none)."""
    schema = getattr(func, "_schema", None)
    if schema is None:
        return False
    if draws(func, args, kwargs):
        return fills(func, args)
    if writes_inputs(func):
        return False
    return not any(r.alias_info is not None for r in schema.returns)


def _detach(t):
    return t.detach()


def _identity(t):
    return t


def _hidden():
    """Saved-tensor hooks hiding the body's own saves from the caller's hooks (a region's
    transient graph is not what it keeps). They keep a detached alias: a tensor kept as is by
    the node that made it (layer norm's statistics, attention's output) would hold that node
    through its grad_fn, a cycle through C++ that the forward's graph, never backpropagated,
    would leak every step."""
    return torch.autograd.graph.saved_tensors_hooks(_detach, _identity)


class _Calls(TorchDispatchMode):
    """Names every call made while the body runs (`_tracked`'s calls say which node runs)."""

    def __init__(self):
        super().__init__()
        self.counts: Counter = Counter()

    @property
    def node(self) -> str:
        return getattr(_node, "name", "")

    def name(self, func) -> Call:
        key = (self.node, _op_name(func))
        n = self.counts[key]
        self.counts[key] += 1
        return (*key, n)


@functools.lru_cache(maxsize=None)
def _op_name(func) -> str:
    return str(func)


class _Keep(_Calls):
    """Forward: runs every call, keeping the outputs of the saved ones. With a `log` (profiling)
    every call is recorded, marked `overwritten` when a later in-place op writes its output."""

    def __init__(self, saves: FrozenSet[Call], log: Optional[List[CallInfo]] = None, masks: bool = False):
        super().__init__()
        self.saves = saves
        self.masks = masks  # the region keeps its draws: every one, or the replay's would shift
        self.log = log
        self.kept: Dict[Call, Any] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        call = self.name(func)
        if self.masks and call not in self.saves and draws(func, args, kwargs or {}):
            raise RuntimeError(
                f"graphpar recompute: the region keeps its random draws, but {call} draws and was not seen "
                f"when the region was planned, so the backward's replay would draw it out of order (wrong "
                f"gradients). Fix: report this model; Strategy(recompute=None) trains it meanwhile.")
        if writes_inputs(func):
            self._forget_written(_written(func, args, kwargs or {}))
        if self.log is not None:
            self.log.append(CallInfo(call, func, tuple(args), dict(kwargs or {}), out))
        if call in self.saves and savable(func, args, kwargs or {}):
            self.kept[call] = keep(func, args, kwargs or {}, out)
        return out

    def _forget_written(self, written) -> None:
        """A kept output that a later in-place op overwrites (reduce_from all-reduces a row-parallel
        matmul's output in place) no longer holds the value the call returned: that call runs
        again in the replay instead (and a profile says it cannot be saved)."""
        for call in [c for c, out in self.kept.items() if _storages(out) & written]:
            del self.kept[call]
        if self.log is not None:
            self.log[:] = [dataclasses.replace(i, overwritten=True) if _storages(i.out) & written else i
                           for i in self.log]


def _storages(value) -> set:
    return {StorageWeakRef(t.untyped_storage()) for t in tensors_in(value)}


def _written(func, args, kwargs) -> set:
    """The storages an in-place op writes."""
    values = list(args) + [kwargs.get(a.name) for a in func._schema.arguments[len(args):]]
    unannotated = not func._schema.is_mutable  # a collective: every tensor it is given
    return {StorageWeakRef(t.untyped_storage())
            for argument, value in zip(func._schema.arguments, values)
            if unannotated or (argument.alias_info is not None and argument.alias_info.is_write)
            for t in tensors_in(value)}


def tensors_in(value) -> List[torch.Tensor]:
    """The tensors of a call's output or argument (a tensor, a list of them, a tuple...)."""
    return [t for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor)]


# ---- the calls the replay may skip -------------------------------------------------------------
#
# Backward needs of the replay only what autograd saves and what the calls computing it
# read. A call whose outputs nothing of that reads (in a pre-LN block, the MLP's output
# projection, its dropout and the residual add: only the region's output, whose value backward
# never reads) need not compute: it returns zeros of its outputs' sizes, strides and dtypes,
# and autograd, which sits above the dispatch mode, records it with the real inputs it saves.

FREE, WRITE, COMPUTE, ALWAYS = "free", "write", "compute", "always"


@dataclass(frozen=True)
class Step:
    """One call of a replay, as `plan_calls` sees it: the storages it reads and the storages it
    makes (fresh outputs) or writes, and how it runs:

        FREE     reads no value: a view (its output shares its input's storage), a kept call,
                 a call reading metadata (`prim.device`)
        WRITE    an in-place write or a collective: always runs (a collective is issued on every
                 rank of its group), reading real values only when what it writes is needed
        COMPUTE  makes fresh tensors: skipped when none of them is needed
        ALWAYS   always runs on real values: a random draw (it keeps its stream's position and
                 may check its arguments), a call returning no tensor or a size that depends on
                 the values (`.item()`, `nonzero`: the program may branch on them), a call whose
                 outputs are not fresh storages of their own
    """
    kind: str
    reads: FrozenSet[Any]
    makes: FrozenSet[Any]


def step(func, args, kwargs, out, kept: bool = False) -> Step:
    reads = frozenset(_storages((args, kwargs)))
    if writes_inputs(func) or getattr(func, "namespace", "") in _COLLECTIVES:
        return Step(FREE if kept else WRITE, reads, frozenset(_written(func, args, kwargs) | _storages(out)))
    makes = frozenset(_storages(out))
    if kept or (makes and makes <= reads) or _metadata(func):
        return Step(FREE, frozenset(), makes)
    if draws(func, args, kwargs) or not _fresh(func, out, reads):
        return Step(ALWAYS, reads, makes)
    return Step(COMPUTE, reads, makes)


_COLLECTIVES = ("c10d", "_c10d_functional")
# calls that read a tensor's metadata, not its values (fake tensors make them)
_METADATA = frozenset({"sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "is_contiguous",
                       "is_strides_like_format", "is_non_overlapping_and_dense"})


_VALUE_SHAPED = (torch.Tag.dynamic_output_shape, torch.Tag.data_dependent_output)


def _metadata(func) -> bool:
    return getattr(func, "namespace", "") == "prim" or func.overloadpacket.__name__ in _METADATA


def _fresh(func, out, reads) -> bool:
    """Outputs that are tensors (or None), each on a storage of its own that it fills from its
    start, sizes that do not depend on values: zeros can stand for them."""
    if any(tag in _VALUE_SHAPED for tag in getattr(func, "tags", ())):
        return False
    leaves = [t for t in pytree.tree_leaves(out) if t is not None]
    if not leaves or not all(isinstance(t, torch.Tensor) for t in leaves):
        return False
    storages = [StorageWeakRef(t.untyped_storage()) for t in leaves]
    return (len(set(storages)) == len(storages) and not set(storages) & reads
            and all(t.storage_offset() == 0 and t.untyped_storage().nbytes() == _span(t) for t in leaves))


def _span(t: torch.Tensor) -> int:
    """The bytes a tensor of t's size and strides spans from its start."""
    if t.numel() == 0:
        return 0
    return (1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))) * t.element_size()


SKIP, RUN, BLIND = "skip", "run", "blind"


def plan_calls(steps: Sequence[Step], packed) -> List[str]:
    """How each call of a replay runs: SKIP (it need not compute), RUN (on real values) or BLIND
    (it runs, but what it reads need not be real). Walking back from the storages autograd saves
    (`packed`), a storage is needed if a call that runs and whose result is needed reads it (an
    ALWAYS call's reads are needed whatever it makes). The region's outputs are not needed by
    themselves: backward reads their autograd history, not their values."""
    needed, runs = set(packed), [BLIND] * len(steps)
    for i in reversed(range(len(steps))):
        s = steps[i]
        wanted = not s.makes.isdisjoint(needed)
        if s.kind == COMPUTE and not wanted:
            runs[i] = SKIP
        elif s.kind == ALWAYS or (wanted and s.kind != FREE):
            runs[i] = RUN
            needed |= s.reads
    return runs


def skipped_calls(infos: Sequence[CallInfo], kept: FrozenSet[Call]) -> FrozenSet[Call]:
    """The calls of a profiled region (`profiling`) its replay skips when it keeps `kept`."""
    steps = [step(i.func, i.args, i.kwargs, i.out, i.call in kept) for i in infos]
    packed = set().union(*[_storages(i.out) for i in infos if i.saved])
    return frozenset(i.call for i, run in zip(infos, plan_calls(steps, packed)) if run == SKIP)


class _Replay(_Calls):
    """Backward: each kept call returns its forward output (a fresh alias of it), a kept fill
    writes the forward's numbers into the tensor it is given; every other call runs. `watching`:
    it also notes each call as a `Step`, for the `_Plan` of the replays after it."""

    def __init__(self, kept: Dict[Call, Any], watching: bool = False):
        super().__init__()
        self.kept = kept
        self.watching = watching
        self.funcs: List[Any] = []
        self.steps: List[Step] = []
        self.layouts: List[Any] = []       # of each call's output, for zeros standing for it
        # every output's storage, alive until the plan is made: one freed and made again would
        # look like the same storage. Not the tensors: a second reference to the tensor a
        # factory returns makes torch add a detach call, which the replays after would not make
        self.storages: List[Any] = []
        self.names: Dict[int, Call] = {}   # position -> the kept call returned there
        self.packed: set = set()           # the storages autograd saves (`_noting`)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = self.name(func)
        kept = self.kept.get(name)
        out = func(*args, **(kwargs or {})) if kept is None else _kept_output(func, args, kept)
        if self.watching:
            if kept is not None:
                self.names[len(self.steps)] = name
            self.funcs.append(func)
            self.steps.append(step(func, args, kwargs or {}, out, kept is not None))
            self.layouts.append(_layout(out) if self.steps[-1].kind == COMPUTE else None)
            self.storages += [t.untyped_storage() for t in tensors_in(out)]
        return out

    def plan(self) -> "_Plan":
        runs = plan_calls(self.steps, self.packed)
        return _Plan(tuple(self.funcs), {i: self.layouts[i] for i, r in enumerate(runs) if r == SKIP},
                     dict(self.names), frozenset(i for i, r in enumerate(runs) if r == BLIND))


def _kept_output(func, args, kept):
    """What a kept call returns in a replay: a fill writes the forward's numbers into the tensor
    it is given; any other call returns a fresh alias of its forward output."""
    if writes_inputs(func):
        return args[0].copy_(kept)
    return pytree.tree_map_only(torch.Tensor, lambda t: t.detach(), kept)


def _layout(out):
    """What zeros standing for a call's output need: its tree, and each tensor's size, strides,
    dtype and device."""
    leaves, spec = pytree.tree_flatten(out)
    return spec, tuple(None if t is None else (t.shape, t.stride(), t.dtype, t.device) for t in leaves)


def _zeros(spec, leaves):
    # zeros, not uninitialised memory: garbage may hold denormals or NaNs that would slow the
    # elementwise calls a skipped value still flows through (views, blind in-place writes)
    return pytree.tree_unflatten([None if m is None else torch.empty_strided(m[0], m[1], dtype=m[2], device=m[3]).zero_()
                                  for m in leaves], spec)


@dataclass(frozen=True)
class _Plan:
    """A region's replay as watched once (for one signature of its inputs): the op of each call,
    in order, which calls it skips (with their outputs' layouts), which return a kept output, and
    which may read values a skipped call did not make (`BLIND`)."""
    funcs: Tuple[Any, ...]
    zeros: Dict[int, Any]
    kept: Dict[int, Call]
    blind: FrozenSet[int]


class _Diverged(Exception):
    """A replay that is not the one its plan watched: it runs again, computing everything."""


class _Skipping(TorchDispatchMode):
    """Backward, by a `_Plan`: a skipped call returns zeros, a kept call its forward output, every
    other call runs. It checks as it goes that the replay is the one watched: the same op at each
    position, no call that needs real values reading one a skipped call stood in for, autograd
    saving none of them (`_checked`); else `_Diverged`."""

    def __init__(self, plan: _Plan, kept: Dict[Call, Any]):
        super().__init__()
        self.plan, self.kept, self.position = plan, kept, 0
        self.unreal: set = set()   # storages of skipped calls' zeros and of what blind calls made of them
        # the zeros' storages, alive for the replay: one freed and made again must not look
        # unreal (the storages, not the tensors: see _Replay.storages)
        self.zeros: List[Any] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        i, plan, kwargs = self.position, self.plan, kwargs or {}
        self.position += 1
        if i >= len(plan.funcs) or plan.funcs[i] is not func:
            raise _Diverged(f"call {i}: {func}")
        if i in plan.zeros:
            out = _zeros(*plan.zeros[i])
            self.zeros += [t.untyped_storage() for t in tensors_in(out)]
            self.unreal |= _storages(out)
            return out
        unreal = bool(self.unreal) and not _storages((args, kwargs)).isdisjoint(self.unreal)
        if unreal and i not in plan.blind:
            raise _Diverged(f"call {i}: {func} reads a value the replay did not compute")
        name = plan.kept.get(i)
        out = func(*args, **kwargs) if name is None else _kept_output(func, args, self.kept[name])
        if unreal:
            self.unreal |= _storages(out) | (_written(func, args, kwargs) if writes_inputs(func) else set())
        return out

    def finish(self) -> None:
        if self.position != len(self.plan.funcs):
            raise _Diverged(f"{self.position} calls, the plan has {len(self.plan.funcs)}")


def _noting(packed: set):
    """Saved-tensor hooks noting the storages autograd saves (hidden from the caller's hooks, as
    `_hidden`'s): what a profiled forward or a watched replay needs for backward."""
    def pack(t):
        packed.add(StorageWeakRef(t.untyped_storage()))
        return t.detach()
    return torch.autograd.graph.saved_tensors_hooks(pack, _identity)


def _checked(replay: _Skipping):
    """Saved-tensor hooks refusing a value a skipped call stood in for: backward would read it."""
    def pack(t):
        if replay.unreal and StorageWeakRef(t.untyped_storage()) in replay.unreal:
            raise _Diverged("autograd saves a value the replay did not compute")
        return t.detach()
    return torch.autograd.graph.saved_tensors_hooks(pack, _identity)


# region -> {signature of its inputs: the plan of its replays, None when it skips nothing}
_PLANS: "weakref.WeakKeyDictionary[RecomputeRegion, Dict[Any, Optional[_Plan]]]" = weakref.WeakKeyDictionary()
# region -> how many of its plans' replays diverged, by signature: a plan diverging twice is given up
_DIVERGED: "weakref.WeakKeyDictionary[RecomputeRegion, Counter]" = weakref.WeakKeyDictionary()


_node = threading.local()   # .name: the body node running now on this thread (see `_tracked`)


def _at_node(name: str) -> None:
    _node.name = name


def _tracked(body: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """The body with a call telling the dispatch mode which node runs next before each node
    (generated code: an fx.Interpreter costs more than the ops of a small block), built once
    per body and sharing its parameters."""
    tracked = _TRACKED.get(body)
    if tracked is None:
        graph = copy.deepcopy(body.graph)
        for node in list(graph.nodes):
            if node.op not in ("placeholder", "output", "get_attr"):
                with graph.inserting_before(node):
                    graph.call_function(_at_node, (node.name,))
        tracked = _TRACKED[body] = torch.fx.GraphModule(body, graph, class_name="TrackedBody")
    return tracked


_TRACKED: "weakref.WeakKeyDictionary[torch.fx.GraphModule, torch.fx.GraphModule]" = weakref.WeakKeyDictionary()


def run_body(body: torch.fx.GraphModule, args: Sequence[Any], calls: Optional[_Calls] = None):
    if calls is None:
        return body(*args)
    with calls:
        return _tracked(body)(*args)


# ---- what the replay must see as the forward saw it --------------------------------------------

class _Randomness:
    """The generators a region may draw from, and their states at the start of its forward."""

    def __init__(self, devices: Sequence[torch.device]):
        streams = ops.current_streams() or {}
        self.generators: List[torch.Generator] = list(streams.values()) + [torch.default_generator]
        self.cuda = sorted({d.index or 0 for d in devices if d.type == "cuda"})
        self.states = [g.get_state() for g in self.generators]
        self.cuda_states = [torch.cuda.get_rng_state(i) for i in self.cuda]

    @contextlib.contextmanager
    def replayed(self):
        """The generators as at the forward's start inside the block; afterwards, as they were."""
        now = [g.get_state() for g in self.generators]
        cuda_now = [torch.cuda.get_rng_state(i) for i in self.cuda]
        self._set(self.states, self.cuda_states)
        try:
            yield
        finally:
            self._set(now, cuda_now)

    def _set(self, states, cuda_states) -> None:
        for g, state in zip(self.generators, states):
            g.set_state(state)
        for i, state in zip(self.cuda, cuda_states):
            torch.cuda.set_rng_state(state, i)


# ---- the region ------------------------------------------------------------------------------

class RecomputeRegion(nn.Module):
    """One recomputed region: `body` (its nodes, a GraphModule taking the region's inputs and
    returning its outputs as a tuple) and the calls whose outputs the forward keeps."""

    def __init__(self, body: torch.fx.GraphModule, saves: FrozenSet[Call] = frozenset(), unit: str = ""):
        super().__init__()
        self.body = body
        self.saves = frozenset(saves)
        self.unit = unit
        self.masks = False   # passes/recompute.py: `saves` holds every random draw of the region

    def extra_repr(self) -> str:
        return f"unit={self.unit!r}, saved calls={len(self.saves)}"

    def forward(self, *args):
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        if not torch.is_grad_enabled() or not any(t.requires_grad for t in tensors):
            return self.body(*args)
        slots = [isinstance(a, torch.Tensor) for a in args]
        constants = [None if is_tensor else a for a, is_tensor in zip(args, slots)]
        return _Recompute.apply(self, (slots, constants), *tensors)


def _rebuild(layout, tensors: Sequence[torch.Tensor]) -> List[Any]:
    slots, constants = layout
    it = iter(tensors)
    return [next(it) if is_tensor else c for is_tensor, c in zip(slots, constants)]


def _detached(tensors: Sequence[torch.Tensor], grads: Sequence[bool]) -> List[torch.Tensor]:
    return [t.detach().requires_grad_(g) for t, g in zip(tensors, grads)]


class _Recompute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, region: RecomputeRegion, layout, *tensors):
        wants = [t.requires_grad for t in tensors]
        ctx.region, ctx.layout, ctx.wants = region, layout, wants
        ctx.randomness = _Randomness([t.device for t in tensors])
        ctx.state = ops.snapshot()
        log = _PROFILE.setdefault(region, []) if _PROFILE is not None else None
        keep = _Keep(region.saves, log, region.masks) if region.saves or log is not None else None
        # calls are matched to the replay's by name: record autograd as the replay does, so that
        # torch's composite ops decompose alike (matmul folds differently when grads are wanted);
        # with nothing to keep, nothing is matched and no graph is built
        packed: set = set()
        with torch.set_grad_enabled(keep is not None), _noting(packed) if log is not None else _hidden():
            outputs = run_body(region.body, _rebuild(layout, _detached(tensors, wants)), keep)
        if log is not None:
            log[:] = [dataclasses.replace(i, saved=True) if _storages(i.out) & packed else i for i in log]
        kept = keep.kept if keep is not None else {}
        ctx.signature = (tuple((t.shape, t.stride(), t.dtype, t.device, w) for t, w in zip(tensors, wants)),
                         repr(layout[1]), tuple(kept))
        ctx.calls = list(kept)
        ctx.specs = [pytree.tree_flatten(kept[c])[1] for c in ctx.calls]
        flat_kept = [t for c in ctx.calls for t in pytree.tree_leaves(kept[c])]
        ctx.save_for_backward(*tensors, *flat_kept)
        ctx.num_inputs = len(tensors)
        outputs = tuple(o.detach() if isinstance(o, torch.Tensor) else o for o in outputs)
        ctx.mark_non_differentiable(*[o for o in outputs if isinstance(o, torch.Tensor)
                                      and not (o.is_floating_point() or o.is_complex())])
        return outputs

    @staticmethod
    def backward(ctx, *grads):
        saved = ctx.saved_tensors
        inputs = _detached(saved[:ctx.num_inputs], ctx.wants)
        kept, leaves = {}, iter(saved[ctx.num_inputs:])
        for call, spec in zip(ctx.calls, ctx.specs):
            kept[call] = pytree.tree_unflatten([next(leaves) for _ in range(spec.num_leaves)], spec)
        plans = _PLANS.setdefault(ctx.region, {})
        plan = plans.get(ctx.signature)
        if plan is not None:
            try:
                return _backward(ctx, inputs, grads, _Skipping(plan, kept))
            except _Diverged as error:  # computing everything, watched again once; then always
                _log.debug("graphpar recompute: the replay of %s is not the one planned (%s)", ctx.region.unit, error)
                diverged = _DIVERGED.setdefault(ctx.region, Counter())
                diverged[ctx.signature] += 1
                del plans[ctx.signature]
                if diverged[ctx.signature] > 1:
                    plans[ctx.signature] = None
        watching = ctx.signature not in plans
        replay = _Replay(kept, watching) if kept or watching else None
        found = _backward(ctx, inputs, grads, replay)
        if watching:
            plan = replay.plan()
            # a plan skipping nothing would only slow the replays after this one
            plans[ctx.signature] = plan if plan.zeros else None
        return found


def _backward(ctx, inputs, grads, replay):
    """The region's replay under `replay` (a dispatch mode, or None), then the gradients of its
    inputs from those of its outputs."""
    hooks = (_noting(replay.packed) if isinstance(replay, _Replay) and replay.watching
             else _checked(replay) if isinstance(replay, _Skipping) else _hidden())
    with torch.enable_grad(), hooks, ops.restored(ctx.state), ctx.randomness.replayed():
        outputs = run_body(ctx.region.body, _rebuild(ctx.layout, inputs), replay)
        if isinstance(replay, _Skipping):
            replay.finish()
        pairs = [(o, g) for o, g in zip(outputs, grads)
                 if isinstance(o, torch.Tensor) and o.requires_grad and g is not None]
        wanted = [t for t in inputs if t.requires_grad]
        found = torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs],
                                    allow_unused=True) if pairs and wanted else [None] * len(wanted)
    found = iter(found)
    return (None, None, *[next(found) if t.requires_grad else None for t in inputs])
