"""The pass pipeline: an ordered, editable list of graph passes.

A pass is a plain function ``fn(gm, ctx) -> gm`` (torch.fx style). The built-in passes live
in graphpar.passes, one per file; users add their own with `register_pass` (for every
compile in the process) or `Strategy(passes=...)` (for one compile). Between passes the
validator (graphpar/ir/validate.py) checks the graph and graphpar's invariants, and names the
pass that broke them; with dumping on, every pass's output is written for every rank.

`run_pipeline` is a pure function of (model, strategy, rank, world size): it needs no
process group, so `graphpar dump` and the planner can run it for any rank of any world.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.fx
import torch.utils._pytree as pytree

PassFn = Callable[[Optional[torch.fx.GraphModule], "PassContext"], torch.fx.GraphModule]


@dataclass(frozen=True)
class Pass:
    name: str
    fn: PassFn
    after: Optional[str] = None
    before: Optional[str] = None


@dataclass
class PassContext:
    """What a pass may read: the strategy, this rank's mesh coordinates and the inputs.

    `notes` is where passes leave results for later passes (tag, then apply): for example
    the traced program's input/output structure under "program".
    """
    model: torch.nn.Module
    strategy: Any                      # graphpar.Strategy
    mesh: Any                          # graphpar.distributed.mesh.Mesh for this rank
    example_inputs: Tuple[Any, ...]    # one microbatch of this rank's inputs
    example_target: Any = None
    loss_fn: Optional[Callable] = None
    with_loss: bool = True
    options: Dict[str, Any] = field(default_factory=dict)   # compile options (tracer, leaves, device)
    notes: Dict[str, Any] = field(default_factory=dict)

    def graph_inputs(self) -> List[Any]:
        """The traced graph's placeholder values: the flat example inputs, then the target
        when the loss is traced with a loss_fn."""
        flat = list(pytree.tree_flatten(self.example_inputs)[0])
        if self.with_loss and self.loss_fn is not None and self.example_target is not None:
            flat.append(self.example_target)
        return flat

    @property
    def rank(self) -> int:
        return self.mesh.rank

    @property
    def world_size(self) -> int:
        return self.mesh.world_size


_BUILTIN: List[Pass] = []
LAST = "split_stages"  # unanchored user passes run just before it
_REGISTERED: List[Pass] = []


def builtin_pass(name: str):
    """Decorator for graphpar's own passes; their order is the order of registration."""
    def decorate(fn: PassFn) -> PassFn:
        _BUILTIN.append(Pass(name, fn))
        return fn
    return decorate


def register_pass(name: Optional[str] = None, *, after: Optional[str] = None,
                  before: Optional[str] = None):
    """Add a user pass to every later compile; returns the function unchanged.

        @graphpar.register_pass(name="count_linears", after="trace")
        def count_linears(gm, ctx): ...
    """
    def decorate(fn: PassFn) -> PassFn:
        new = make_pass(fn, name=name, after=after, before=before)
        existing = [p.name for p in _ordered(_builtin_passes(), _REGISTERED)]
        if new.name in existing:
            raise ValueError(f"register_pass(name={new.name!r}): a pass with that name is already in "
                             f"the pipeline {existing}. Fix: choose another name, or "
                             f"graphpar.unregister_pass({new.name!r}) first.")
        _ordered(_builtin_passes(), _REGISTERED + [new])  # fails early on an unknown anchor
        _REGISTERED.append(new)
        return fn
    return decorate


def unregister_pass(name: str) -> None:
    names = [p.name for p in _REGISTERED]
    if name not in names:
        raise ValueError(f"unregister_pass({name!r}): no registered user pass by that name; "
                         f"registered: {names}. Fix: unregister one of those names (built-in passes "
                         f"cannot be removed).")
    del _REGISTERED[names.index(name)]


def make_pass(fn, *, name: Optional[str] = None, after: Optional[str] = None,
              before: Optional[str] = None) -> Pass:
    if after is not None and before is not None:
        raise ValueError(f"pass {name or getattr(fn, '__name__', fn)!r}: give after= or before=, "
                         f"not both (after={after!r}, before={before!r}). Fix: keep one anchor.")
    if not callable(fn):
        raise TypeError(f"a pass must be callable fn(gm, ctx) -> gm, got {fn!r}. Fix: pass the function "
                        f"itself (or its 'package.module:function' path in Strategy.passes).")
    return Pass(name or fn.__name__, fn, after, before)


def list_passes(strategy=None) -> List[str]:
    """Ordered names of the pass pipeline: built-ins, registered passes, and the strategy's."""
    return [p.name for p in pipeline_for(strategy)]


def pipeline_for(strategy=None) -> List[Pass]:
    extra = [resolve_pass(p) for p in (strategy.passes if strategy is not None else ())]
    return _ordered(_builtin_passes(), _REGISTERED + extra)


def _builtin_passes() -> List[Pass]:
    import graphpar.passes.builtin as builtin  # registers the built-ins on first use
    position = {module.__name__: i for i, module in enumerate(builtin.ORDER)}
    return sorted(_BUILTIN, key=lambda p: position[p.fn.__module__])


def _ordered(base: List[Pass], extra: Sequence[Pass]) -> List[Pass]:
    """Insert each extra pass at its anchor. Passes with no anchor go after every transforming
    pass but before split_stages, in the order given: they see this rank's whole lowered
    graph (at pp > 1 split_stages turns it into stage programs a later pass would not reach)."""
    order = list(base)
    for p in extra:
        names = [q.name for q in order]
        anchor = p.after or p.before
        if anchor is None:
            order.insert(names.index(LAST) if LAST in names else len(order), p)
            continue
        if p.before == names[0]:
            raise ValueError(f"pass {p.name!r} is anchored before={anchor!r}, but {anchor!r} builds the "
                             f"graph and must come first. Fix: use after={anchor!r}.")
        if anchor not in names:
            raise ValueError(
                f"pass {p.name!r} is anchored {'after' if p.after else 'before'}={anchor!r}, which is "
                f"not in the pipeline {names}. Fix: anchor it to one of those names.")
        index = names.index(anchor) + (1 if p.after else 0)
        if p.after:  # after the anchor and after passes already placed after it, in order
            while index < len(order) and order[index] in extra and order[index].after == anchor:
                index += 1
        order.insert(index, p)
    return order


def resolve_pass(spec) -> Pass:
    """A Strategy.passes entry: a callable, a Pass, "module:function", or its dict form."""
    if isinstance(spec, Pass):
        return spec
    if isinstance(spec, dict):
        return make_pass(_import(spec["target"]), name=spec.get("name"),
                         after=spec.get("after"), before=spec.get("before"))
    if isinstance(spec, str):
        return make_pass(_import(spec))
    if hasattr(spec, "name") and hasattr(spec, "fn"):
        return make_pass(spec.fn, name=spec.name, after=getattr(spec, "after", None),
                         before=getattr(spec, "before", None))
    return make_pass(spec)


def _import(path: str):
    module_name, _, attr = path.partition(":")
    try:
        obj = importlib.import_module(module_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"Strategy.passes entry {path!r} could not be imported ({exc}). Fix: use "
                         f"'package.module:function' naming a module-level function.") from exc
    return obj


@dataclass
class PipelineResult:
    gm: torch.fx.GraphModule
    ctx: PassContext
    snapshots: List[Tuple[str, torch.fx.Graph]]     # (pass name, graph after it) for dumps


def run_pipeline(ctx: PassContext, dump_dir: Optional[str] = None, until: Optional[str] = None,
                 snapshots: bool = True) -> PipelineResult:
    """Run the passes in order, validating after each; `until` stops after the named pass
    (the planner analyses the tagged whole-model graph before it is lowered and split)."""
    from graphpar.ir.validate import validate, validate_update_program
    gm = None
    taken = []
    passes = pipeline_for(ctx.strategy)
    names = [p.name for p in passes]
    if until is not None and until not in names:
        raise ValueError(f"run_pipeline(until={until!r}): no such pass in {names}.")
    for index, p in enumerate(passes):
        gm = _apply(p, gm, ctx)
        validate(gm, p.name)
        if ctx.notes.get("update") is not None:  # build_update's program: validated like the graph
            validate_update_program(ctx.notes["update"], p.name)
        if snapshots:
            taken.append((p.name, _snapshot(gm)))
        if dump_dir:
            from graphpar.ir.printer import write_graph_dump
            write_graph_dump(dump_dir, ctx.rank, index, p.name, gm)
        if p.name == until:
            break
    return PipelineResult(gm, ctx, taken)


class UserPassError(RuntimeError):
    """A user pass raised; the original error is its __cause__."""


def _apply(p: Pass, gm, ctx: PassContext) -> torch.fx.GraphModule:
    try:
        result = p.fn(gm, ctx)
    except Exception as exc:
        if p in _BUILTIN:  # graphpar's own errors already name their cause and fix
            raise
        raise UserPassError(
            f"user pass {p.name!r} ({getattr(p.fn, '__module__', '?')}.{getattr(p.fn, '__qualname__', p.fn)}) "
            f"raised {type(exc).__name__}: {exc}. graphpar stopped before building the program; the model is "
            f"unchanged. Fix: correct the pass (its traceback is chained below), or leave it out of "
            f"Strategy.passes / graphpar.unregister_pass({p.name!r}).") from exc
    if not isinstance(result, torch.fx.GraphModule):
        raise TypeError(f"pass {p.name!r} returned {type(result).__name__}, not a torch.fx.GraphModule. "
                        f"Fix: return the GraphModule (after gm.recompile() if you edited the graph).")
    result.recompile()
    return result


def _snapshot(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of the graph (sharing parameters) that later passes cannot change."""
    graph = torch.fx.Graph()
    output = graph.graph_copy(gm.graph, {})
    graph.output(output)
    return torch.fx.GraphModule(gm, graph)
