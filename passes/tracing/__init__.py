"""Tracing front ends: nn.Module (+ loss) -> one GraphModule in graphpar IR (graphpar/ir/node_record.py).

    trace_program(model, example_inputs, ...) -> TracedProgram

"auto" tries torch.fx.symbolic_trace first (fast, keeps the user's Python structure) and
falls back to torch.export (non-strict) when it fails, as it does on transformers models.
Both graphs are then normalised the same way: mode-dependent ops canonicalised
(canonical.py), fake-tensor shapes propagated and a NodeRecord put on every node
(records.py).
"""
from __future__ import annotations

import contextlib
import linecache
import os
import traceback
from typing import Any, Callable, Iterable, Optional, Tuple

import torch
import torch.fx
import torch.nn as nn
from torch.fx.graph_module import _copy_attr

from graphpar.runtime import ops
from graphpar import ir as graphpar_ir
from graphpar.runtime.ops import training_flags
from graphpar.ir import TensorMeta, describe_value, fetch_attr, first_keys, record
from graphpar.passes.tracing.canonical import canonicalize_mode_ops
from graphpar.passes.tracing.expert_lists import dense_expert_lists
from graphpar.passes.tracing.export import trace_export
from graphpar.passes.tracing.loss_checks import LossError, check_count, check_loss_fn, loss_error
from graphpar.ir.compiled import TracedProgram
from graphpar.passes.tracing.program import (WithLoss, flatten_inputs, with_named_inputs)
from graphpar.passes.tracing.records import annotate_records, propagate_fake_values
from graphpar.passes.tracing.symbolic import trace_symbolic

FRONT_ENDS = ("auto", "fx", "export")
_TORCH_DIR = os.path.dirname(torch.__file__)
# frames of torch and of graphpar itself (the package, and passes/, which is installed as
# graphpar.passes but sits beside it in a source checkout) are never the user's model code
_LIBRARY_DIRS = (_TORCH_DIR, os.path.dirname(os.path.dirname(os.path.abspath(graphpar_ir.__file__))),
                 os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class TraceError(RuntimeError):
    pass


@contextlib.contextmanager
def _training_mode(model: nn.Module):
    """Trace in training mode, then give every module back its own flag (model.train(False)
    would also reset a BatchNorm the user froze with bn.eval())."""
    flags = training_flags(model)
    model.train()
    try:
        yield
    finally:
        for path, m in model.named_modules(remove_duplicate=False):
            m.training = flags[path]


def _normalise(gm: torch.fx.GraphModule, flat_example) -> torch.fx.GraphModule:
    canonicalize_mode_ops(gm)
    gm.graph.eliminate_dead_code(is_impure_node=ops.is_impure)
    gm.recompile()
    propagate_fake_values(gm, flat_example)
    annotate_records(gm)
    ops.bind_module_modes(gm, lambda node: record(node).module_path)
    return gm


def on_meta(model: nn.Module) -> bool:
    tensors = list(model.parameters()) + list(model.buffers())
    return bool(tensors) and all(t.is_meta for t in tensors)


def _canonical_attributes(gm: torch.fx.GraphModule, model: nn.Module) -> None:
    """Name every parameter and buffer by the first state_dict key of its tensor: a tied
    weight (embedding and LM head) is one value under one name, whichever alias the front
    end used (symbolic_trace keeps both module paths, export picks one)."""
    first = first_keys(model)
    for node in gm.graph.nodes:
        if node.op != "get_attr":
            continue
        name = first.get(id(fetch_attr(gm, str(node.target))))
        if name is not None and name != node.target:
            _copy_attr(model, gm, name)
            node.target = name


def _run_front_end(name: str, wrapper: WithLoss, flat_example, leaf_modules) -> torch.fx.GraphModule:
    if name == "fx":
        gm = trace_symbolic(wrapper, leaf_modules)
    else:
        gm = trace_export(wrapper, flat_example)
    _canonical_attributes(gm, wrapper.model)
    return _normalise(gm, flat_example)


def trace_program(model: nn.Module, example_inputs: Tuple[Any, ...], *,
                  loss_fn: Optional[Callable] = None, example_target: Any = None,
                  with_loss: bool = True, front_end: str = "auto",
                  leaf_modules: Iterable = (), dense_experts: bool = False) -> TracedProgram:
    if front_end not in FRONT_ENDS:
        raise ValueError(f"tracer={front_end!r} is not a front end: it must be one of {FRONT_ENDS}. "
                         f"Fix: use tracer='auto' to try symbolic_trace, then torch.export.")
    check_loss_fn(loss_fn)
    flat, in_spec = flatten_inputs(example_inputs)
    with_target = with_loss and loss_fn is not None
    if with_target:
        flat = flat + [example_target]
    if on_meta(model):  # shapes only: inputs must live where the parameters do
        flat = [t.to("meta") if isinstance(t, torch.Tensor) else t for t in flat]
    wrapper = with_named_inputs(WithLoss(model, loss_fn, in_spec, with_loss, with_target))
    order = ("fx", "export") if front_end == "auto" else (front_end,)
    failures = []
    # dense_experts: the experts are split, so expert containers trace as their dense function
    # (passes/tracing/expert_lists.py), a region expert_parallel replaces
    with _training_mode(model), dense_expert_lists(model, dense_experts):
        for name in order:
            try:
                gm = _run_front_end(name, wrapper, flat, tuple(leaf_modules))
            except LossError:
                raise
            except Exception as exc:  # noqa: BLE001 - each front end's failure is reported
                failures.append((name, exc, traceback.format_exc()))
                continue
            out_spec, loss_outputs = wrapper.take_captured()
            loss_outputs = check_loss(gm, loss_outputs, loss_fn)
            return TracedProgram(gm=gm, front_end=name, in_spec=in_spec, out_spec=out_spec,
                                 num_inputs=in_spec.num_leaves, has_loss=loss_outputs > 0,
                                 loss_count=loss_outputs == 2)
    if with_target:
        output = _output_without_loss(model, example_inputs, front_end, leaf_modules)
        if output is not None:
            raise loss_error(loss_fn, output, example_target, failures)
    raise _trace_error(model, failures)


def _output_without_loss(model: nn.Module, example_inputs, front_end: str, leaf_modules) -> Optional[str]:
    """The model's output described, if the model traces without the loss; else None."""
    try:
        gm = trace_program(model, example_inputs, with_loss=False, front_end=front_end,
                           leaf_modules=leaf_modules).gm
    except TraceError:
        return None
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    values = [describe_value(record(v).value) for v in output.args[0] if isinstance(v, torch.fx.Node)]
    return values[0] if len(values) == 1 else "(" + ", ".join(values) + ")"


def check_loss(gm: torch.fx.GraphModule, loss_outputs: int, loss_fn: Optional[Callable]) -> int:
    """The loss (or the loss sum of a (loss_sum, count) pair) must be a floating scalar, and the
    count a scalar number of tokens. A model output merely guessed to be the loss
    (loss_fn=None) that is not one is dropped from the outputs instead. Returns how many
    leading outputs are the loss."""
    if not loss_outputs:
        return 0
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    loss = output.args[0][0]
    value = record(loss).value if isinstance(loss, torch.fx.Node) else None
    if isinstance(value, TensorMeta) and value.shape == () and value.dtype.is_floating_point:
        if loss_outputs == 2:
            check_count(output.args[0][1], loss_fn)
        return loss_outputs
    if loss_outputs == 2:
        raise LossError(f"loss_fn returned (loss_sum, count) whose loss_sum is {describe_value(value)}; it must be "
                        f"a floating scalar (the sum over the batch). Fix: reduce it, e.g. with .sum() or "
                        f"reduction='sum'.")
    if loss_fn is not None:
        raise ValueError(f"loss_fn must return a floating scalar (the mean over the batch), but it "
                         f"returned {describe_value(value)}. Fix: reduce it, e.g. with .mean().")
    output.args = (tuple(output.args[0][1:]),)
    gm.recompile()
    return 0


def _failure_site(model: nn.Module, exc: BaseException) -> Optional[Tuple[str, str]]:
    """Where in the user's model a front end failed: the innermost traceback frame whose
    `self` is a module of `model`, as (module path, "Class.method file:line: code")."""
    paths = {id(m): path for path, m in model.named_modules()}
    site = None
    tb = exc.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        owner = tb.tb_frame.f_locals.get(code.co_varnames[0]) if code.co_argcount else None
        if id(owner) in paths and not code.co_filename.startswith(_LIBRARY_DIRS):
            line = linecache.getline(code.co_filename, tb.tb_lineno).strip()
            site = (paths[id(owner)], f"{type(owner).__name__}.{code.co_name} "
                                      f"{code.co_filename}:{tb.tb_lineno}: {line}")
        tb = tb.tb_next
    return site


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"


def _trace_fix(tried, leaf: Optional[str]) -> str:
    keep = (f"keep module {leaf!r} opaque to symbolic_trace with graphpar.compile(..., leaf_modules=[{leaf!r}])"
            if leaf else "move the failing code into a submodule and list it in graphpar.compile(..., "
                         "leaf_modules=['path.to.module'])")
    if "export" not in tried:
        return f"Fix: use tracer='export' (or 'auto', which falls back to it), or {keep}."
    return (f"Fix: {keep} (symbolic_trace only, so with tracer='fx' or 'auto'); Python control flow on "
            f"tensor values fails under both front ends unless it sits inside such a leaf module "
            f"(or is rewritten with torch.where).")


def _trace_error(model: nn.Module, failures) -> TraceError:
    lines = [f"could not trace {type(model).__name__} with any front end:"]
    leaf = None
    for name, exc, _ in failures:
        lines.append(f"  {name}: {_first_line(exc)}")
        site = _failure_site(model, exc)
        if site is not None:
            lines.append(f"      in module {site[0] or '<root>'!r} at {site[1]}")
            leaf = leaf or site[0] or None
    lines.append(_trace_fix([name for name, _, _ in failures], leaf))
    error = TraceError("\n".join(lines))
    error.__cause__ = failures[-1][1]
    return error
