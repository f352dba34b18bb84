"""The pass pipeline: an ordered, editable list of graph passes.

A pass is a plain function ``fn(gm, ctx) -> gm`` (torch.fx style) in a `Pass` that declares
what it requires and produces (passes/context.py). The built-in passes live in
graphpar.passes, one per file, listed in order by `builtin.default_passes`; users add their
own with `register_pass` (for every compile in the process) or `Strategy(passes=...)` (for
one compile). Before anything runs, every pass's requirements must be produced by an
earlier pass. Between passes the validator (graphpar/ir/validate.py) checks the graph and
graphpar's invariants, and names the pass that broke them; with dumping on, every pass's
output is written for every rank. At the end the results are frozen into the rank's
hand-off, a `graphpar.ir.compiled.CompiledRank`.

`run_pipeline` is a pure function of (model, strategy, rank, world size): it needs no
process group, so `graphpar dump` and the planner can run it for any rank of any world.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch
import torch.fx
from torch.fx._lazy_graph_module import _LazyGraphModule

from graphpar.ir.compiled import CompiledRank
from graphpar.ir.printer import write_graph_dump
from graphpar.ir.validate import validate, validate_update_program
from graphpar.passes.builtin import LAST, default_passes
from graphpar.passes.context import RECORD_PREFIX, Pass, PassContext, PassFn, hand_off

__all__ = ["Pass", "PassContext", "PipelineResult", "UserPassError", "list_passes", "register_pass",
           "run_pipeline", "unregister_pass"]

_REGISTERED: List[Pass] = []


def register_pass(name: Optional[str] = None, *, after: Optional[str] = None,
                  before: Optional[str] = None, requires: Sequence[str] = (), produces: Sequence[str] = ()):
    """Add a user pass to every later compile; returns the function unchanged.

        @graphpar.register_pass(name="count_linears", after="trace")
        def count_linears(gm, ctx): ...
    """
    def decorate(fn: PassFn) -> PassFn:
        new = make_pass(fn, name=name, after=after, before=before, requires=requires, produces=produces)
        existing = [p.name for p in _ordered(default_passes(), _REGISTERED)]
        if new.name in existing:
            raise ValueError(f"register_pass(name={new.name!r}): a pass with that name is already in "
                             f"the pipeline {existing}. Fix: choose another name, or "
                             f"graphpar.unregister_pass({new.name!r}) first.")
        # fails early on an unknown anchor or a requirement produced too late
        check_requirements(_ordered(default_passes(), _REGISTERED + [new]))
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
              before: Optional[str] = None, requires: Sequence[str] = (), produces: Sequence[str] = ()) -> Pass:
    if after is not None and before is not None:
        raise ValueError(f"pass {name or getattr(fn, '__name__', fn)!r}: give after= or before=, "
                         f"not both (after={after!r}, before={before!r}). Fix: keep one anchor.")
    if not callable(fn):
        raise TypeError(f"a pass must be callable fn(gm, ctx) -> gm, got {fn!r}. Fix: pass the function "
                        f"itself (or its 'package.module:function' path in Strategy.passes).")
    return Pass(name or fn.__name__, fn, after, before, tuple(requires), tuple(produces))


def list_passes(strategy=None) -> List[str]:
    """Ordered names of the pass pipeline: built-ins, registered passes, and the strategy's."""
    return [p.name for p in pipeline_for(strategy)]


def pipeline_for(strategy=None) -> List[Pass]:
    """The passes a compile under `strategy` runs, in order, their requirements checked."""
    extra = [resolve_pass(p) for p in (strategy.passes if strategy is not None else ())]
    return check_requirements(_ordered(default_passes(strategy), _REGISTERED + extra))


def check_requirements(passes: List[Pass]) -> List[Pass]:
    """Every name a pass requires must be produced by an earlier pass; returns `passes`."""
    produced = set()
    for index, p in enumerate(passes):
        for name in p.requires:
            if name not in produced:
                raise ValueError(_requirement_error(p, name, passes[index + 1:]))
        produced.update(p.produces)
    return passes


def _requirement_error(p: Pass, name, later: Sequence[Pass]) -> str:
    what = _describe_result(name)
    producers = [q.name for q in later if name in q.produces]
    if producers:
        return (f"pass {p.name!r} requires {what}, which {producers[0]!r} produces, but {producers[0]!r} runs after "
                f"{p.name!r} (the passes after {p.name!r}: {[q.name for q in later]}). Fix: anchor {p.name!r} "
                f"after={producers[0]!r} (or later).")
    return (f"pass {p.name!r} requires {what}, which no pass before it produces, and none after. Fix: add a pass "
            f"that produces it before {p.name!r}, or take it out of {p.name!r}'s requires.")


def _describe_result(name) -> str:
    if isinstance(name, type):
        return f"a {name.__name__} result (ctx.results.get({name.__name__}))"
    if name.startswith(RECORD_PREFIX):
        return f"the record field {name[len(RECORD_PREFIX):]!r} ({name!r})"
    return f"ctx.results.{name} ({name!r})"


def _ordered(base: List[Pass], extra: Sequence[Pass]) -> List[Pass]:
    """Insert each extra pass at its anchor. Passes with no anchor go after every transforming
    pass but before split_backward and split_stages, in the order given: they see this rank's
    whole lowered graph with its own ops (split_backward points linear layers at runtime
    functions under zero-bubble schedules; at pp > 1 split_stages turns the graph into stage
    programs a later pass would not reach)."""
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
                         before=getattr(spec, "before", None), requires=getattr(spec, "requires", ()),
                         produces=getattr(spec, "produces", ()))
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
    snapshots: List[Tuple[str, torch.fx.GraphModule]]   # (pass name, graph after it) for dumps
    compiled: Optional[CompiledRank]                    # the hand-off; None when stopped early (until=)


def run_pipeline(ctx: PassContext, dump_dir: Optional[str] = None, until: Optional[str] = None,
                 snapshots: bool = True) -> PipelineResult:
    """Run the passes in order, validating after each; `until` stops after the named pass
    (the planner analyses the tagged whole-model graph before it is lowered and split)."""
    gm = None
    taken = []
    passes = pipeline_for(ctx.strategy)
    builtins = default_passes(ctx.strategy)
    names = [p.name for p in passes]
    if until is not None and until not in names:
        raise ValueError(f"run_pipeline(until={until!r}): no such pass in {names}.")
    for index, p in enumerate(passes):
        gm = _apply(p, gm, ctx, builtin=p in builtins)
        validate(gm, p.name)
        if ctx.results.update is not None:  # build_update's program: validated like the graph
            validate_update_program(ctx.results.update, p.name)
        if snapshots:
            taken.append((p.name, _snapshot(gm)))
        if dump_dir:
            write_graph_dump(dump_dir, ctx.rank, index, p.name, gm)
        if p.name == until:
            break
    finished = until is None or until == names[-1]
    return PipelineResult(gm, ctx, taken, hand_off(ctx, gm, taken) if finished else None)


class UserPassError(RuntimeError):
    """A user pass raised; the original error is its __cause__."""


def _apply(p: Pass, gm, ctx: PassContext, builtin: bool) -> torch.fx.GraphModule:
    try:
        result = p.fn(gm, ctx)
    except Exception as exc:
        if builtin:  # graphpar's own errors already name their cause and fix
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
    """A copy of the graph (sharing parameters) that later passes cannot change. Its Python
    code is generated when first read or run (a dump, gp.verify), not here: most snapshots are
    never read, and generating each pass's code took about a tenth of a compile."""
    graph = torch.fx.Graph()
    output = graph.graph_copy(gm.graph, {})
    graph.output(output)
    return _LazyGraphModule(gm, graph)
