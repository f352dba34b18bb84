"""Graph dumps: what a graph looks like after each pass, in forms people and tools can read.

With dumping on, the pipeline writes every pass's output for every rank under
``<dump_dir>/rank<R>/``, named ``<NN>_<pass>.<ext>`` so a directory listing reads in pass
order:

``.py``
    The graph as Python, in the style of Lightning Thunder traces: fx's own code for the
    graph, one statement per node, each with a trailing comment carrying the node's
    record::

        linear = torch.ops.aten.linear.default(x, fc_weight, fc_bias)  # f32[8, 64] R fc [trace]

    The comment reads: value (dtype and shape, a tuple for multi-valued nodes, ``-`` for
    non-tensors), sharding spec (``R``, ``S(dim)``, ``P(op)``), ``@host`` for host
    placement, ``update@host``/``update@device`` for where a parameter's update runs,
    pipeline stage, the update program's ``bucket N`` and phase (``launch``, ``step``,
    ``write``), module path, and in brackets the pass that last wrote the record. Inputs are
    bound in the signature, so their records are listed as comments at the top of the body.
    The file compiles (``python -m py_compile``) but is not meant to run: targets are printed
    as fx prints them, not imported.

``.json``
    ``{"rank", "pass", "index", "nodes": [...]}`` with one entry per node in graph order
    (see `render_node_table`), for scripts that diff passes or check a property.

``.dot`` / ``.svg``
    A Graphviz drawing: one box per node, data-flow edges, host nodes in light orange,
    parameters small and grey, Shard specs with a blue border and Partial ones with a red
    border, and one cluster per pipeline stage. The ``.svg`` is only produced when the
    ``dot`` executable is installed; a drawing that fails never fails the compile.
"""
from __future__ import annotations

import ast
import io
import json
import os
import pathlib
import re
import shutil
import subprocess
import tokenize
import warnings
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
import torch.fx
from torch.fx.node import _get_qualified_name, map_arg

from graphpar.ir import META_KEY, NodeRecord, TensorMeta, Value, describe_value

NO_RECORD = "(no record)"
DOT_TIMEOUT_S = 60
_MAX_ARG_REPR = 2000      # JSON keeps arguments nearly whole; only pathological constants get cut
_MAX_DOT_TARGET = 40      # dot labels stay small so ~1000-node graphs remain legible
_MAX_DOT_VALUE = 60
_MAX_DOT_NAME = 48

LEGEND = """\
# Each statement is one fx node; its trailing comment is the node's graphpar record:
#   <dtype>[shape] (a tuple for multi-valued nodes, '-' for non-tensors)
#   spec: R = replicated, S(d) = sharded along dim d, P(op) = partial, pending reduction,
#         Sq(d) = split along the sequence dim d (sequence parallelism)
#   @host = placed on the host (absent = device), update@host / update@device = where a
#   parameter's optimizer update runs, 'stage N' = pipeline stage, 'bucket N' and 'step' /
#   'write' = an update-program node's gradient bucket and phase, 'recomputed' / 'saved (ops)'
#   = in a recompute region's body (printed after the program), run again in backward or
#   kept from forward, then the module path and, in brackets, the pass that last wrote the record.
# Inputs are listed as comments at the top of the body. The file compiles but is not meant
# to run."""


# --------------------------------------------------------------------------------------- #
# Python


def render_python(gm: torch.fx.GraphModule) -> str:
    """The graph as compilable Python with one record comment per node."""
    src = gm.graph.python_code(root_module="self").src.strip("\n ") + "\n"
    nodes = list(gm.graph.nodes)
    try:
        annotated = _annotate(src, nodes)
        compile(annotated, "<graphpar dump>", "exec")
        return annotated
    except (SyntaxError, tokenize.TokenError):
        return _unannotated(src, nodes)


def _unannotated(src: str, nodes: Sequence[torch.fx.Node]) -> str:
    # The line-level annotation could not place its comments (or fx's code does not
    # parse, e.g. a call_method whose name is not an identifier). The records as a comment
    # block are less pleasant to read, but the dump stays valid Python either way.
    records = _records_block(nodes, "") + "\n"
    try:
        compile(src, "<graphpar dump>", "exec")
        return records + src
    except SyntaxError as exc:
        note = f"# fx's code for this graph does not parse ({exc.msg}); shown commented out:\n"
        return records + note + "".join("# " + line + "\n" for line in src.splitlines())


def _annotate(src: str, nodes: Sequence[torch.fx.Node]) -> str:
    lines = src.split("\n")
    fn = next(s for s in ast.parse(src).body if isinstance(s, ast.FunctionDef))
    statements = _strip_deletions(lines, fn.body, {n.name for n in nodes})
    comment_line = _commentable_lines(src)
    by_name = {n.name: n for n in nodes}
    comments: Dict[int, List[torch.fx.Node]] = {}
    for stmt in statements:
        for name in _assigned_names(stmt):
            node = by_name.pop(name, None)
            if node is not None:
                comments.setdefault(_comment_lineno(stmt, comment_line), []).append(node)
    for lineno, line_nodes in comments.items():
        lines[lineno - 1] += "  # " + _line_comment(line_nodes)
    # Whatever has no statement of its own (inputs bound in the signature) is listed
    # at the top of the body, in graph order.
    unbound = [n for n in nodes if n.name in by_name and n.op != "output"]
    first = fn.body[0].lineno - 1
    indent = re.match(r"\s*", lines[first]).group(0)
    lines[first:first] = [_records_block(unbound, indent)] if unbound else []
    return "\n".join(lines)


def _strip_deletions(lines: List[str], body: Sequence[ast.stmt], names: set) -> List[ast.stmt]:
    """Drop fx's ``;  a = b = None`` suffixes: they free memory when run, but are noise to read.

    Returns the statements that remain, so nodes named in a deletion are not taken for
    being assigned there.
    """
    kept: List[ast.stmt] = []
    prev = None
    for stmt in body:
        if prev is not None and _is_deletion(stmt, prev, names):
            row = stmt.lineno - 1
            # ast columns are UTF-8 byte offsets; string constants may be non-ASCII.
            raw = lines[row].encode("utf-8")
            lines[row] = (raw[:prev.end_col_offset] + raw[stmt.end_col_offset:]).decode("utf-8")
            continue    # the statement before it still ends at prev's end column
        kept.append(stmt)
        prev = stmt
    return kept


def _is_deletion(stmt: ast.stmt, prev: ast.stmt, names: set) -> bool:
    return (isinstance(stmt, ast.Assign)
            and stmt.lineno == prev.end_lineno == stmt.end_lineno
            and isinstance(stmt.value, ast.Constant) and stmt.value.value is None
            and all(isinstance(t, ast.Name) and t.id in names for t in stmt.targets))


def _assigned_names(stmt: ast.stmt) -> List[str]:
    # Augmented assignments are left out: fx emits in-place ops as ``a += b;  iadd = a``,
    # where the node is ``iadd`` and ``a`` is its input.
    if isinstance(stmt, ast.Assign):
        targets = stmt.targets
    elif isinstance(stmt, ast.AnnAssign):
        targets = [stmt.target]
    else:
        return []
    names = []
    for target in targets:
        elts = target.elts if isinstance(target, (ast.Tuple, ast.List)) else [target]
        names.extend(e.id for e in elts if isinstance(e, ast.Name))
    return names


def _commentable_lines(src: str) -> set:
    """Line numbers whose end is outside any string or continuation, so a comment fits there."""
    ends = set()
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type in (tokenize.NEWLINE, tokenize.NL, tokenize.COMMENT):
            ends.add(tok.start[0])
    return ends


def _comment_lineno(stmt: ast.stmt, commentable: set) -> int:
    # The first line reads best (the comment sits next to the name); a multi-line
    # statement whose first line cannot take a comment gets it on its last line.
    return stmt.lineno if stmt.lineno in commentable else stmt.end_lineno


def _line_comment(nodes: Sequence[torch.fx.Node]) -> str:
    if len(nodes) == 1:
        return _node_comment(nodes[0])
    return "; ".join(f"{n.name}: {_node_comment(n)}" for n in nodes)


def _records_block(nodes: Iterable[torch.fx.Node], indent: str) -> str:
    return "\n".join(f"{indent}# {n.name}: {_node_comment(n)}" for n in nodes if n.op != "output")


def _node_comment(node: torch.fx.Node) -> str:
    rec = _record_or_none(node)
    # A record's text comes from user module paths and pass names; keep it on one line.
    return rec.describe().replace("\n", " ") if rec is not None else NO_RECORD


def _record_or_none(node: torch.fx.Node) -> Optional[NodeRecord]:
    rec = node.meta.get(META_KEY)
    return rec if isinstance(rec, NodeRecord) else None


# --------------------------------------------------------------------------------------- #
# JSON


def render_node_table(gm: torch.fx.GraphModule) -> List[Dict[str, Any]]:
    """One JSON-able dict per node, in graph order.

    ``shape`` and ``dtype`` mirror the value: a list of ints and a dtype name for a tensor,
    a list of those for a tuple value, null for non-tensors.
    """
    return [_node_row(node) for node in gm.graph.nodes]


def _node_row(node: torch.fx.Node) -> Dict[str, Any]:
    row = {
        "name": node.name,
        "op": node.op,
        "target": _target_str(node.target),
        "args": [_arg_repr(a) for a in node.args],
        "kwargs": {k: _arg_repr(v) for k, v in node.kwargs.items()},
        "users": [u.name for u in node.users],
    }
    row.update(_record_fields(_record_or_none(node)))
    return row


def _record_fields(rec: Optional[NodeRecord]) -> Dict[str, Any]:
    if rec is None:
        return dict(record=None, value=None, shape=None, dtype=None, spec=None,
                    placement=None, update_placement=None, stage=None, bucket=None, phase=None,
                    module_path=None, module_type=None, set_by=None)
    return dict(
        record=rec.describe(),
        value=describe_value(rec.value),
        shape=_value_shape(rec.value),
        dtype=_value_dtype(rec.value),
        spec=rec.spec.describe() if rec.spec is not None else None,
        placement=rec.placement,
        update_placement=rec.update_placement,
        stage=rec.stage,
        bucket=rec.bucket,
        phase=rec.phase,
        module_path=rec.module_path,
        module_type=rec.module_type,
        set_by=rec.set_by,
    )


def _value_shape(value: Value):
    if isinstance(value, TensorMeta):
        return list(value.shape)
    if isinstance(value, tuple):
        return [_value_shape(v) for v in value]
    return None


def _value_dtype(value: Value):
    if isinstance(value, TensorMeta):
        return str(value.dtype).replace("torch.", "")
    if isinstance(value, tuple):
        return [_value_dtype(v) for v in value]
    return None


class _NodeRef:
    """Stands in for a node inside an argument so its repr is just the node's name."""

    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return self.name


def _arg_repr(arg: Any) -> str:
    text = repr(map_arg(arg, lambda n: _NodeRef(n.name)))
    return text if len(text) <= _MAX_ARG_REPR else text[:_MAX_ARG_REPR] + "..."


def _target_str(target: Any) -> str:
    if isinstance(target, str):
        return target
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return str(target)      # "aten.linear.default"
    try:
        # fx's own naming knows the aliases ("torch.relu", not the C class it lives on).
        name = _get_qualified_name(target)
    except Exception:   # noqa: BLE001 - any odd callable still gets a name below
        return getattr(target, "__name__", None) or repr(target)
    return "operator." + name[len("_operator."):] if name.startswith("_operator.") else name


# --------------------------------------------------------------------------------------- #
# Graphviz

_HOST_FILL = "#ffd8a8"       # light orange
_DEVICE_FILL = "#ffffff"
_PARAM_FILL = "#eeeeee"
_SPEC_BORDER = {"S": "#1c7ed6", "P": "#e03131"}

_DOT_LEGEND = ("orange = host, grey = parameter/buffer, "
               "blue border = Shard, red border = Partial")


def render_dot(gm: torch.fx.GraphModule, title: str) -> str:
    """Graphviz source: one box per node, data-flow edges, a cluster per pipeline stage."""
    nodes = list(gm.graph.nodes)
    out = [
        f"digraph {_dot_str(title)} {{",
        f"  graph [label={_dot_str(title + chr(10) + _DOT_LEGEND)}, labelloc=t, "
        f"rankdir=TB, fontname=\"Helvetica\"];",
        "  node [shape=box, style=\"rounded,filled\", fontname=\"Courier\", fontsize=10];",
        "  edge [arrowsize=0.6, color=\"#868e96\"];",
    ]
    for stage, members in _by_stage(nodes):
        out.extend(_dot_stage(stage, members))
    out.extend(_dot_edges(nodes))
    out.append("}")
    return "\n".join(out) + "\n"


def _by_stage(nodes: Sequence[torch.fx.Node]) -> List[Tuple[Optional[int], List[torch.fx.Node]]]:
    groups: Dict[Optional[int], List[torch.fx.Node]] = {}
    for node in nodes:
        rec = _record_or_none(node)
        groups.setdefault(rec.stage if rec is not None else None, []).append(node)
    # Unstaged nodes first (top level), then stages in order.
    return sorted(groups.items(), key=lambda kv: (kv[0] is not None, kv[0] or 0))


def _dot_stage(stage: Optional[int], members: Sequence[torch.fx.Node]) -> List[str]:
    decls = [_dot_node(n) for n in members]
    if stage is None:
        return ["  " + d for d in decls]
    label = _dot_str(f"stage {stage}")
    return ([f"  subgraph cluster_stage_{int(stage)} {{",
             f"    label={label}; style=\"rounded,dashed\"; color=\"#495057\";"]
            + ["    " + d for d in decls] + ["  }"])


def _dot_node(node: torch.fx.Node) -> str:
    rec = _record_or_none(node)
    attrs = {"label": _dot_label(_label_lines(node, rec))}
    attrs.update(_dot_style(node, rec))
    body = ", ".join(f"{k}={v}" for k, v in attrs.items())
    return f"{_dot_str(node.name)} [{body}];"


def _label_lines(node: torch.fx.Node, rec: Optional[NodeRecord]) -> List[str]:
    lines = [_short(node.name, _MAX_DOT_NAME)]
    if node.op != "get_attr":     # a parameter's name already says what it is
        lines.append(_short(_op_summary(node), _MAX_DOT_TARGET))
    if node.op == "output":
        return lines
    if rec is None:
        return lines + [NO_RECORD]
    value = describe_value(rec.value)
    if rec.spec is not None:
        value += " " + rec.spec.describe()
    return lines + [_short(value, _MAX_DOT_VALUE)]


def _op_summary(node: torch.fx.Node) -> str:
    target = _target_str(node.target)
    if node.op == "call_function":
        return target.removesuffix(".default")
    if node.op == "call_method":
        return "." + target
    if node.op == "call_module":
        return "module " + target
    return {"placeholder": "input", "output": "output"}.get(node.op, node.op)


def _dot_style(node: torch.fx.Node, rec: Optional[NodeRecord]) -> Dict[str, str]:
    host = rec is not None and rec.placement == "host"
    style: Dict[str, str] = {}
    if node.op == "get_attr":
        style.update(fontsize="8", fontcolor="\"#495057\"", height="0.2", margin="\"0.05,0.02\"")
        style["fillcolor"] = _dot_str(_HOST_FILL if host else _PARAM_FILL)
    else:
        style["fillcolor"] = _dot_str(_HOST_FILL if host else _DEVICE_FILL)
    if node.op in ("placeholder", "output"):
        style["shape"] = "ellipse"
    border = _SPEC_BORDER.get(rec.spec.describe()[:1]) if rec is not None and rec.spec else None
    if border:
        style.update(color=_dot_str(border), penwidth="2")
    return style


def _dot_edges(nodes: Sequence[torch.fx.Node]) -> List[str]:
    return [f"  {_dot_str(src.name)} -> {_dot_str(node.name)};"
            for node in nodes for src in node.all_input_nodes]


def _dot_label(lines: Sequence[str]) -> str:
    # Lines are joined with dot's own "\n" escape after each one is escaped, so a
    # backslash from a target can never combine with a separator.
    return '"' + "\\n".join(_dot_escape(line) for line in lines) + '"'


def _dot_str(text: str) -> str:
    return '"' + "\\n".join(_dot_escape(line) for line in str(text).split("\n")) + '"'


def _dot_escape(text: str) -> str:
    # Inside a quoted dot string only '"' is special to the parser, but labels then
    # interpret backslash escapes (\n, \l, \N, ...), so a literal backslash must be doubled.
    # Braces, '|' and '<>' are only special in record shapes, which are never used here.
    text = text.replace("\r", " ").replace("\n", " ")
    return text.replace("\\", "\\\\").replace('"', '\\"')


def _short(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit - 3] + "..."


# --------------------------------------------------------------------------------------- #
# Files


def write_graph_dump(directory, rank: int, index: int, pass_name: str,
                     gm: torch.fx.GraphModule) -> List[pathlib.Path]:
    """Write the graph after pass ``index`` (``pass_name``) for ``rank``; return the paths."""
    folder = pathlib.Path(directory) / f"rank{int(rank)}"
    folder.mkdir(parents=True, exist_ok=True)
    stem = folder / f"{int(index):02d}_{_safe_name(pass_name)}"
    title = f"rank {rank}, after pass {int(index):02d} {pass_name}"
    dot_src = render_dot(gm, title)
    written = [
        _write(stem.with_suffix(".py"), _python_file(gm, title)),
        _write(stem.with_suffix(".json"), _json_file(gm, rank, index, pass_name)),
        _write(stem.with_suffix(".dot"), dot_src),
    ]
    svg = _render_svg(dot_src, stem.with_suffix(".svg"))
    return written + ([svg] if svg is not None else [])


def _safe_name(pass_name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", str(pass_name)).strip("._") or "pass"


def _python_file(gm: torch.fx.GraphModule, title: str) -> str:
    header = "# graphpar dump: " + title.replace("\n", " ")
    return f"{header}\n{LEGEND}\n\n{render_python(gm)}\n" + "".join(_bodies(gm))


def _bodies(gm: torch.fx.GraphModule) -> List[str]:
    """The graphs of the modules the program calls that hold one as `body` (a recompute
    region), each as a function named after the call's target, after the program."""
    out = []
    for node in gm.graph.nodes:
        if node.op != "call_module":
            continue
        body = getattr(gm.get_submodule(str(node.target)), "body", None)
        if isinstance(body, torch.fx.GraphModule):
            code = render_python(body).replace("def forward(", f"def {_safe_name(str(node.target))}(", 1)
            out.append(f"\n# ---- {node.target}: {gm.get_submodule(str(node.target)).extra_repr()}\n{code}\n")
    return out


def _json_file(gm: torch.fx.GraphModule, rank: int, index: int, pass_name: str) -> str:
    doc = {"rank": rank, "pass": pass_name, "index": index, "nodes": render_node_table(gm)}
    return json.dumps(doc, indent=1) + "\n"


def _write(path: pathlib.Path, text: str) -> pathlib.Path:
    path.write_text(text, encoding="utf-8")
    return path


def _render_svg(dot_src: str, path: pathlib.Path) -> Optional[pathlib.Path]:
    """Draw with Graphviz if it is installed; a missing or failing ``dot`` only warns."""
    dot = shutil.which("dot")
    if dot is None:
        return None
    try:
        result = subprocess.run([dot, "-Tsvg"], input=dot_src.encode("utf-8"),
                                capture_output=True, timeout=DOT_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        warnings.warn(f"graphpar dump: could not draw {path.name} with {dot}: {exc}; "
                      f"the .dot file is still there.", stacklevel=3)
        return None
    if result.returncode != 0 or not result.stdout:
        err = result.stderr.decode("utf-8", "replace").strip()[-500:]
        warnings.warn(f"graphpar dump: `dot -Tsvg` failed for {path.name} (exit "
                      f"{result.returncode}): {err}; the .dot file is still there.", stacklevel=3)
        return None
    path.write_bytes(result.stdout)
    return path


def check_dump_dir(path: Optional[str], option: str) -> None:
    """A dump goes into a directory (one folder per rank, one file per pass): refuse a
    path that is, or lies under, an existing file before any pass has run."""
    if not path:
        return
    probe = os.path.abspath(path)
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        raise ValueError(f"{option}={path!r} is not a directory: {probe!r} is a file, and a dump writes one "
                         f"folder per rank and a file per pass under a directory. Fix: give a directory path "
                         f"(created if missing), e.g. {option}={os.path.splitext(path)[0] + '_dump'!r}.")
