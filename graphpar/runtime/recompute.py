"""Activation recomputation: a region of the forward run without keeping its intermediates.

passes/recompute.py replaces each chosen region of a program (a transformer block, say) by
one `RecomputeRegion` module that holds the region's nodes as a GraphModule of its own (the
`body`). In a training forward the region runs under `_Recompute`, an autograd Function:

    forward   runs the body, keeps its inputs and the outputs of the calls the plan chose to
              save (`saves`), and lets every other intermediate go
    backward  runs the body again on the kept inputs, with autograd recording, where each
              saved call returns its kept output instead of computing, then backpropagates
              the gradients of the region's outputs through that graph

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


@dataclass(frozen=True)
class CallInfo:
    """One call of a region's forward, as `profiling` records it (on fake tensors)."""
    call: Call
    func: Any
    args: Tuple[Any, ...]
    kwargs: Dict[str, Any]
    out: Any
    overwritten: bool = False   # a later in-place op of the region writes the output: never kept


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


class _Replay(_Calls):
    """Backward: each kept call returns its forward output (a fresh alias of it), a kept fill
    writes the forward's numbers into the tensor it is given; every other call runs."""

    def __init__(self, kept: Dict[Call, Any]):
        super().__init__()
        self.kept = kept

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = self.kept.get(self.name(func))
        if out is None:
            return func(*args, **(kwargs or {}))
        if writes_inputs(func):
            return args[0].copy_(out)
        return pytree.tree_map_only(torch.Tensor, lambda t: t.detach(), out)


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
        with torch.set_grad_enabled(keep is not None), _hidden():
            outputs = run_body(region.body, _rebuild(layout, _detached(tensors, wants)), keep)
        kept = keep.kept if keep is not None else {}
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
        replay = _Replay(kept) if kept else None
        with torch.enable_grad(), _hidden(), ops.restored(ctx.state), ctx.randomness.replayed():
            outputs = run_body(ctx.region.body, _rebuild(ctx.layout, inputs), replay)
            pairs = [(o, g) for o, g in zip(outputs, grads)
                     if isinstance(o, torch.Tensor) and o.requires_grad and g is not None]
            wanted = [t for t in inputs if t.requires_grad]
            found = torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs],
                                        allow_unused=True) if pairs and wanted else [None] * len(wanted)
        found = iter(found)
        return (None, None, *[next(found) if t.requires_grad else None for t in inputs])
