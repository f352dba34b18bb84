"""One record per node, across the project: no module outside graphpar/ir reads or writes a
graphpar key of node.meta (a scan of graphpar/ and passes/), and the scan sees every form."""
import ast
import pathlib


ROOT = pathlib.Path(__file__).resolve().parents[3]
# node.meta keys torch.fx / torch.export own; graphpar may read them (and the front end
# gives nodes it creates a module stack, as torch does). Everything graphpar keeps on a node
# lives in its record.
TORCH_META_KEYS = {"val", "tensor_meta", "nn_module_stack", "stack_trace", "source_fn_stack", "example_value"}


def _scanned_files():
    files = [*(ROOT / "graphpar").rglob("*.py"), *(ROOT / "passes").rglob("*.py")]
    return [f for f in files if (ROOT / "graphpar" / "ir") not in f.parents]


def _is_meta(expr: ast.AST) -> bool:
    return isinstance(expr, ast.Attribute) and expr.attr == "meta"


def _meta_key_uses(tree: ast.AST):
    """(line, key) of every node.meta key named in the code: subscripts, get/pop/setdefault,
    `in` tests and update(key=...) / update({key: ...}). A key that is not a string
    literal is reported as None (graphpar code cannot hide a key behind a constant)."""
    for n in ast.walk(tree):
        if isinstance(n, ast.Subscript) and _is_meta(n.value):
            yield n.lineno, n.slice.value if isinstance(n.slice, ast.Constant) else None
        elif isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and _is_meta(n.func.value):
            if n.func.attr in ("get", "pop", "setdefault") and n.args:
                yield n.lineno, n.args[0].value if isinstance(n.args[0], ast.Constant) else None
            elif n.func.attr == "update":
                yield from ((n.lineno, k.arg) for k in n.keywords)
                for arg in n.args:  # copying another node's whole meta is fine; literal keys are not
                    if isinstance(arg, ast.Dict):
                        yield from ((n.lineno, k.value if isinstance(k, ast.Constant) else None) for k in arg.keys)
        elif isinstance(n, ast.Compare) and any(_is_meta(c) for c in n.comparators):
            yield n.lineno, n.left.value if isinstance(n.left, ast.Constant) else None


def test_no_graphpar_node_meta_outside_the_ir():
    offences = []
    for path in _scanned_files():
        tree = ast.parse(path.read_text(), str(path))
        where = path.relative_to(ROOT)
        offences += [f"{where}:{line}: node.meta[{key!r}]" for line, key in _meta_key_uses(tree)
                     if key not in TORCH_META_KEYS]
        offences += [f"{where}:{n.lineno}: META_KEY" for n in ast.walk(tree)
                     if isinstance(n, (ast.Name, ast.alias)) and "META_KEY" in (getattr(n, "id", None),
                                                                                getattr(n, "name", None))]
    assert not offences, ("graphpar annotations belong in the NodeRecord, written with graphpar.ir.stamp / "
                          "set_record / copy_record:\n" + "\n".join(offences))


def test_the_scan_sees_every_form_of_a_graphpar_meta_key():
    # the scan itself must catch what it forbids, or the test above could never fail
    code = ('node.meta["graphpar"] = r\nnode.meta.get("bucket")\n"phase" in node.meta\n'
            'node.meta.update(bucket=1)\nnode.meta.update({"phase": 2})\nnode.meta[KEY] = 1\n'
            'a.meta.update(b.meta)\nnode.meta["val"]\n')
    keys = [key for _, key in _meta_key_uses(ast.parse(code))]
    assert keys == ["graphpar", "bucket", "phase", "bucket", "phase", None, "val"]
