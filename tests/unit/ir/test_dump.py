"""Tests for graphpar.ir.printer: the .py/.json/.dot/.svg graph dumps written after every pass."""

import json
import os
import re
import shutil
import stat

import pytest
import torch
import torch.fx
import torch.nn as nn
import torch.nn.functional as F
from torch.fx.passes.shape_prop import ShapeProp

from graphpar.ir.printer import (NO_RECORD, render_dot, render_node_table, render_python,
                           write_graph_dump)
from graphpar.ir import (PHASE_STEP, PHASE_WRITE, NodeRecord, Partial, Replicate, Shard, TensorMeta, record,
                         set_record, stamp)

N_OUTPUTS = 24      # enough for fx to print a return tuple well past any line-length limit


class Tiny(nn.Module):
    """Linear written functionally so the parameters appear as get_attr nodes."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 32)

    def forward(self, x):
        h = F.relu(F.linear(x, self.fc.weight, self.fc.bias))
        return (h.sum(),) + tuple(h[:, i] * 2.0 for i in range(N_OUTPUTS))


def _spec_for(node: torch.fx.Node):
    if node.name == "linear":
        return Shard(1)
    if node.name == "sum_1":
        return Partial("sum")
    return Replicate()


def _traced(with_records=True) -> torch.fx.GraphModule:
    gm = torch.fx.symbolic_trace(Tiny())
    ShapeProp(gm).propagate(torch.randn(8, 16))
    if not with_records:
        return gm
    nodes = list(gm.graph.nodes)
    half = len(nodes) // 2
    for i, node in enumerate(nodes):
        if node.op == "output":
            continue
        meta = node.meta["tensor_meta"]
        set_record(node, NodeRecord(
            value=TensorMeta(tuple(meta.shape), meta.dtype, meta.requires_grad),
            module_path="fc" if node.op == "get_attr" or node.name == "linear" else "",
            module_type="Linear" if node.name == "linear" else "",
            spec=_spec_for(node),
            placement="host" if node.name == "relu" else "device",
            stage=0 if i < half else 1,
            set_by="annotate_shards" if node.name == "linear" else "trace",
        ))
    return gm


def _line_of(src: str, name: str) -> str:
    matches = [line for line in src.splitlines() if re.match(rf"\s*{name}\s*[:=]", line)]
    assert len(matches) == 1, f"{name}: {matches}"
    return matches[0]


# --------------------------------------------------------------------------------------- #
# Python


def test_python_dump_compiles_and_annotates_every_node():
    gm = _traced()
    src = render_python(gm)
    compile(src, "dump.py", "exec")
    for node in gm.graph.nodes:
        if node.op == "output":
            continue
        expected = "# " + record(node).describe()
        if node.op == "placeholder":
            assert f"# {node.name}: {record(node).describe()}" in src
        else:
            assert _line_of(src, node.name).endswith(expected), node.name


def test_python_dump_line_format():
    src = render_python(_traced())
    line = _line_of(src, "linear").strip()
    assert re.fullmatch(r"linear = torch\._C\._nn\.linear\(x, fc_weight, fc_bias\)  "
                        r"# f32\[8, 32\] S\(1\) stage \d fc \[annotate_shards\]", line), line
    assert "@host" in _line_of(src, "relu")
    assert "P(sum)" in _line_of(src, "sum_1")


def test_python_dump_strips_deletions_but_keeps_code():
    src = render_python(_traced())
    assert "= None" not in src
    # The long output tuple survives whole.
    ret = [line for line in src.splitlines() if line.strip().startswith("return")]
    assert len(ret) == 1 and ret[0].count("mul") == N_OUTPUTS


def test_python_dump_without_records():
    gm = _traced(with_records=False)
    src = render_python(gm)
    compile(src, "dump.py", "exec")
    assert _line_of(src, "relu").endswith("# " + NO_RECORD)
    assert f"# x: {NO_RECORD}" in src


def test_python_dump_partial_records():
    gm = _traced()
    relu = next(n for n in gm.graph.nodes if n.name == "relu")
    del relu.meta["graphpar"]
    src = render_python(gm)
    assert _line_of(src, "relu").endswith("# " + NO_RECORD)
    assert _line_of(src, "linear").endswith("[annotate_shards]")


class _MultiLineCodeGen(torch.fx.graph.CodeGen):
    """Emits a multi-line return and splits the linear call over lines, as custom
    codegens (pytree, expanded defs) may."""

    def __init__(self):
        super().__init__()
        self._body_transformer = self._split_linear

    @staticmethod
    def _split_linear(body):
        return [part.replace(", ", ",\n        ") if part.startswith("linear =") else part
                for part in body]

    def generate_output(self, output_args, *, descs=None, repr_fn=None):
        return self._format_multiline_container(output_args, None, "return ", repr_fn=repr_fn)


def test_python_dump_multiline_statements():
    gm = _traced()
    gm.graph.set_codegen(_MultiLineCodeGen())
    raw = gm.graph.python_code(root_module="self").src
    assert "linear = torch._C._nn.linear(x,\n" in raw and "return (\n" in raw
    src = render_python(gm)
    compile(src, "dump.py", "exec")
    first = _line_of(src, "linear")
    assert first.rstrip().endswith("# " + record(_node(gm, "linear")).describe())
    assert "mul_3 = getitem_3 * 2.0  # " in src


def test_python_dump_inplace_ops():
    # fx prints in-place ops as "a += b;  iadd = a": the record belongs to iadd, not a.
    import operator
    graph = torch.fx.Graph()
    a, b = graph.placeholder("a"), graph.placeholder("b")
    iadd = graph.call_function(operator.iadd, (a, b))
    graph.output(iadd)
    meta = TensorMeta((4,), torch.float32)
    for node, by in ((a, "trace"), (b, "trace"), (iadd, "fuse")):
        set_record(node, NodeRecord(meta, set_by=by))
    src = render_python(torch.fx.GraphModule({}, graph))
    compile(src, "dump.py", "exec")
    assert "# a: f32[4] [trace]" in src
    assert re.search(r"a \+= b;\s+iadd = a  # f32\[4\] \[fuse\]", src), src


def test_python_dump_unparseable_target_still_compiles():
    gm = _traced()
    relu = _node(gm, "relu")
    with gm.graph.inserting_after(relu):
        odd = gm.graph.call_method('we"ird\\name', (relu,))
    set_record(odd, record(relu))
    src = render_python(gm)
    compile(src, "dump.py", "exec")
    assert "# relu: " in src


def _node(gm, name):
    return next(n for n in gm.graph.nodes if n.name == name)


# --------------------------------------------------------------------------------------- #
# JSON


def test_node_table_fields():
    gm = _traced()
    table = json.loads(json.dumps(render_node_table(gm)))
    nodes = list(gm.graph.nodes)
    assert [row["name"] for row in table] == [n.name for n in nodes]
    rows = {row["name"]: row for row in table}
    linear = rows["linear"]
    assert linear["op"] == "call_function"
    assert linear["target"] == "torch._C._nn.linear"
    assert linear["args"] == ["x", "fc_weight", "fc_bias"]
    assert linear["users"] == ["relu"]
    assert linear["value"] == "f32[8, 32]"
    assert linear["shape"] == [8, 32] and linear["dtype"] == "float32"
    assert linear["spec"] == "S(1)" and linear["set_by"] == "annotate_shards"
    assert linear["module_path"] == "fc" and linear["module_type"] == "Linear"
    assert linear["record"] == record(_node(gm, "linear")).describe()
    assert rows["relu"]["placement"] == "host"
    assert {row["stage"] for row in table if row["op"] != "output"} == {0, 1}
    assert rows["getitem"]["args"][1] == "(slice(None, None, None), 0)"
    assert rows["output"]["value"] is None and rows["output"]["op"] == "output"


def test_update_fields_in_the_python_and_json_dumps():
    gm = _traced()
    stamp(_node(gm, "fc_weight"), "place_on_host", update_placement="host")
    stamp(_node(gm, "relu"), "build_update", bucket=3, phase=PHASE_STEP)
    stamp(_node(gm, "sum_1"), "lower_placement", phase=PHASE_WRITE)
    src = render_python(gm)
    assert _line_of(src, "fc_weight").endswith("# f32[32, 16] R update@host stage 0 fc [place_on_host]")
    assert _line_of(src, "relu").endswith("# f32[8, 32] R @host stage 0 bucket 3 step [build_update]")
    assert _line_of(src, "sum_1").endswith("# f32[] P(sum) stage 0 write [lower_placement]")
    rows = {row["name"]: row for row in json.loads(json.dumps(render_node_table(gm)))}
    assert (rows["fc_weight"]["update_placement"], rows["fc_weight"]["bucket"], rows["fc_weight"]["phase"]) == (
        "host", None, None)
    assert (rows["relu"]["update_placement"], rows["relu"]["bucket"], rows["relu"]["phase"]) == (None, 3, "step")
    assert (rows["sum_1"]["bucket"], rows["sum_1"]["phase"]) == (None, "write")
    assert rows["output"]["update_placement"] is rows["output"]["bucket"] is rows["output"]["phase"] is None


def test_node_table_tuple_and_missing_values():
    gm = _traced()
    x = _node(gm, "x")
    set_record(x, record(x).replace("split", value=(TensorMeta((2, 3), torch.bfloat16), None)))
    rows = {row["name"]: row for row in render_node_table(gm)}
    assert rows["x"]["shape"] == [[2, 3], None]
    assert rows["x"]["dtype"] == ["bfloat16", None]
    assert rows["x"]["value"] == "(bf16[2, 3], -)"
    json.dumps(rows)


# --------------------------------------------------------------------------------------- #
# Graphviz


def _dot_syntax_ok(src: str) -> None:
    """A small structural check of dot syntax, for machines without Graphviz."""
    strings = re.compile(r'"(?:[^"\\]|\\.)*"')
    bare = strings.sub('""', src)
    assert '"' not in bare.replace('""', ""), "unbalanced quote"
    depth = 0
    for ch in bare:
        depth += {"{": 1, "}": -1}.get(ch, 0)
        assert depth >= 0
    assert depth == 0, "unbalanced braces"
    assert "\n" not in "".join(strings.findall(src)), "raw newline inside a string"


def _decl(src: str, name: str) -> str:
    return next(line for line in src.splitlines() if line.strip().startswith(f'"{name}" ['))


def test_dot_contains_nodes_edges_and_stage_clusters():
    gm = _traced()
    src = render_dot(gm, "rank 0, after pass 03 annotate_shards")
    _dot_syntax_ok(src)
    assert src.startswith('digraph "rank 0, after pass 03 annotate_shards')
    for node in gm.graph.nodes:
        assert f'"{node.name}" [' in src
    assert '"x" -> "linear";' in src and '"relu" -> "sum_1";' in src
    assert "subgraph cluster_stage_0 {" in src and "subgraph cluster_stage_1 {" in src
    assert "#ffd8a8" in _decl(src, "relu")      # host placement is light orange
    assert "fontsize=8" in _decl(src, "fc_weight")
    assert "S(1)" in src and "P(sum)" in src


def test_dot_without_stages_has_no_clusters():
    src = render_dot(_traced(with_records=False), "t")
    _dot_syntax_ok(src)
    assert "cluster" not in src and NO_RECORD in src


def test_dot_escapes_weird_targets_and_truncates():
    gm = _traced()
    relu = _node(gm, "relu")

    def weird(t):
        return t

    weird.__name__ = weird.__qualname__ = 'we"ird\\{op}|<x>' + "_long" * 30
    with gm.graph.inserting_after(relu):
        odd = gm.graph.call_function(weird, (relu,))
    set_record(odd, record(relu))
    src = render_dot(gm, 'title with "quotes" and \\ {braces}')
    _dot_syntax_ok(src)
    decl = _decl(src, odd.name)
    assert '\\"ird\\\\{op}' in decl
    label = decl.split("label=", 1)[1]
    assert "_long" * 12 not in label and "..." in label
    assert '"title with \\"quotes\\" and \\\\ {braces}' in src


@pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz `dot` is not installed")
def test_dot_accepted_by_graphviz():
    import subprocess
    gm = _traced()
    result = subprocess.run(["dot", "-Tsvg"], input=render_dot(gm, 'q"uote\\').encode(),
                            capture_output=True, timeout=60)
    assert result.returncode == 0, result.stderr


# --------------------------------------------------------------------------------------- #
# Files


def test_write_graph_dump_files(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))    # no Graphviz, whatever is installed
    gm = _traced()
    paths = write_graph_dump(tmp_path / "dumps", 1, 3, "annotate shards/v2", gm)
    folder = tmp_path / "dumps" / "rank1"
    assert [p.name for p in paths] == [
        "03_annotate_shards_v2.py", "03_annotate_shards_v2.json", "03_annotate_shards_v2.dot"]
    assert all(p.parent == folder and p.is_file() for p in paths)

    py = paths[0].read_text()
    assert py.startswith("# graphpar dump: rank 1, after pass 03 annotate shards/v2\n")
    compile(py, str(paths[0]), "exec")
    assert "S(d) = sharded along dim d" in py

    doc = json.loads(paths[1].read_text())
    assert (doc["rank"], doc["pass"], doc["index"]) == (1, "annotate shards/v2", 3)
    assert len(doc["nodes"]) == len(gm.graph.nodes)

    _dot_syntax_ok(paths[2].read_text())
    assert not folder.joinpath("03_annotate_shards_v2.svg").exists()


def test_write_graph_dump_svg_when_dot_available(tmp_path):
    if shutil.which("dot") is None:
        pytest.skip("Graphviz `dot` is not installed; the .svg is only written with it")
    paths = write_graph_dump(tmp_path, 0, 0, "trace", _traced())
    svg = tmp_path / "rank0" / "00_trace.svg"
    assert svg in paths and "<svg" in svg.read_text()


def _fake_dot(tmp_path, script: str):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    dot = bin_dir / "dot"
    dot.write_text("#!/bin/sh\n" + script)
    dot.chmod(dot.stat().st_mode | stat.S_IXUSR)
    return bin_dir


@pytest.mark.skipif(os.name != "posix", reason="fake `dot` is a shell script")
def test_write_graph_dump_svg_from_dot_on_path(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(_fake_dot(tmp_path, "cat >/dev/null; echo '<svg></svg>'\n")))
    paths = write_graph_dump(tmp_path / "d", 2, 7, "split_stages", _traced())
    svg = tmp_path / "d" / "rank2" / "07_split_stages.svg"
    assert paths[-1] == svg and svg.read_text().strip() == "<svg></svg>"


@pytest.mark.skipif(os.name != "posix", reason="fake `dot` is a shell script")
def test_failing_dot_warns_and_keeps_other_files(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(_fake_dot(tmp_path, "echo 'syntax error' >&2; exit 3\n")))
    with pytest.warns(UserWarning, match="syntax error"):
        paths = write_graph_dump(tmp_path / "d", 0, 1, "trace", _traced())
    assert [p.suffix for p in paths] == [".py", ".json", ".dot"]
    assert not (tmp_path / "d" / "rank0" / "01_trace.svg").exists()
