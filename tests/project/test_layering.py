"""The import structure of graphpar/ and passes/ (installed as graphpar.passes).

Every module is parsed with ast, its imports read (at module level and inside functions,
so a function-local import cannot hide an edge) and resolved to the modules of the
package. The floors, from the top (docs/architecture.md, "Import floors"):

    graphpar (the API in graphpar/__init__.py)
    tools -> planner -> frontend -> passes -> runtime -> ir / distributed / strategy /
    checkpoint / errors / models

A module may import its own floor and the floors below it. Checked: no import cycle, no
import going up the floors, no ``from x import _private`` across modules, and no package
whose own names shadow one of its submodules.
"""
from __future__ import annotations

import ast
import pathlib
from dataclasses import dataclass
from typing import Dict, List, Optional, Set, Tuple

ROOT = pathlib.Path(__file__).resolve().parents[2]
SOURCES = (("graphpar", ROOT / "graphpar"), ("graphpar.passes", ROOT / "passes"))

# top floor first; each entry lists the packages (and their submodules) on that floor
FLOORS: Tuple[Tuple[str, Tuple[str, ...]], ...] = (
    ("tools", ("graphpar.tools",)),
    ("planner", ("graphpar.planner",)),
    ("frontend", ("graphpar.frontend",)),
    ("passes", ("graphpar.passes",)),
    ("runtime", ("graphpar.runtime",)),
    ("base", ("graphpar.ir", "graphpar.distributed", "graphpar.strategy", "graphpar.checkpoint",
              "graphpar.errors", "graphpar.models")),
)
API = "graphpar"   # the package itself: the public API, above every floor


@dataclass(frozen=True)
class Module:
    name: str
    path: pathlib.Path
    is_package: bool


@dataclass(frozen=True)
class Edge:
    source: str
    target: str
    names: Tuple[str, ...]   # the names a `from` import takes (empty for `import x`)
    line: int
    local: bool              # inside a function

    def __str__(self) -> str:
        where = f"{_relative(MODULES[self.source].path)}:{self.line}"
        taken = f" ({', '.join(self.names)})" if self.names else ""
        return f"{self.source} -> {self.target}{taken} at {where}{' (function-local)' if self.local else ''}"


def _relative(path: pathlib.Path) -> str:
    return str(path.relative_to(ROOT))


def _modules() -> Dict[str, Module]:
    found = {}
    for package, directory in SOURCES:
        for path in sorted(directory.rglob("*.py")):
            parts = list(path.relative_to(directory).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            name = ".".join([package] + (parts[:-1] if is_package else parts))
            found[name] = Module(name, path, is_package)
    return found


MODULES = _modules()


def _absolute(module: Module, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.name.split(".") if module.is_package else module.name.split(".")[:-1]
    base = base[:len(base) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def _inside_functions(tree: ast.AST) -> Set[int]:
    nested = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            nested.update(id(inner) for inner in ast.walk(node) if inner is not node)
    return nested


def _edges_of(module: Module) -> List[Edge]:
    tree = ast.parse(module.path.read_text(), str(module.path))
    local = _inside_functions(tree)
    edges = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == API or alias.name.startswith(API + "."):
                    edges.append(Edge(module.name, alias.name, (), node.lineno, id(node) in local))
        elif isinstance(node, ast.ImportFrom):
            target = _absolute(module, node)
            if target != API and not target.startswith(API + "."):
                continue
            by_target: Dict[str, List[str]] = {}
            for alias in node.names:
                submodule = f"{target}.{alias.name}"   # `from package import module`
                by_target.setdefault(submodule if submodule in MODULES else target, []).append(alias.name)
            for resolved, names in by_target.items():
                taken = () if resolved != target else tuple(names)
                edges.append(Edge(module.name, resolved, taken, node.lineno, id(node) in local))
    return [e for e in edges if e.target != module.name]


EDGES = [edge for module in MODULES.values() for edge in _edges_of(module)]


def floor_of(name: str) -> Optional[int]:
    """0 for the top floor (tools) ... len(FLOORS) - 1 for the base; -1 for the API."""
    if name == API:
        return -1
    for index, (_, packages) in enumerate(FLOORS):
        if any(name == p or name.startswith(p + ".") for p in packages):
            return index
    return None


def _cycle_through(start: str, graph: Dict[str, List[Edge]], members: Set[str]) -> List[Edge]:
    """One cycle from `start` back to it inside a strongly connected set (breadth first: the shortest)."""
    paths = {start: []}
    queue = [start]
    while queue:
        current = queue.pop(0)
        for edge in graph.get(current, ()):
            if edge.target == start:
                return paths[current] + [edge]
            if edge.target in members and edge.target not in paths:
                paths[edge.target] = paths[current] + [edge]
                queue.append(edge.target)
    return []


def _strongly_connected(graph: Dict[str, List[Edge]]) -> List[Set[str]]:
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    found: List[Set[str]] = []

    def visit(v: str) -> None:   # Tarjan's algorithm; the graph has ~100 modules, recursion is fine
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for edge in graph.get(v, ()):
            w = edge.target
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(component)

    for name in sorted(MODULES):
        if name not in index:
            visit(name)
    return found


def _report(problems: List[str], what: str) -> str:
    return f"{len(problems)} {what}:\n  " + "\n  ".join(problems)


def test_every_module_has_a_floor():
    homeless = sorted(name for name in MODULES if floor_of(name) is None)
    assert not homeless, f"modules on no floor (add their package to FLOORS and docs/architecture.md): {homeless}"


def test_no_import_cycles():
    graph: Dict[str, List[Edge]] = {}
    for edge in EDGES:
        if edge.target in MODULES:
            graph.setdefault(edge.source, []).append(edge)
    cycles = []
    for component in _strongly_connected(graph):
        cycle = _cycle_through(min(component), graph, component)
        cycles.append(f"{len(component)} modules in a circle ({', '.join(sorted(component))}); one cycle:\n    "
                      + "\n    ".join(str(edge) for edge in cycle))
    assert not cycles, _report(cycles, "import circles")


def test_no_import_goes_up_the_floors():
    upward = [f"{edge}: floor {FLOORS[floor_of(edge.source)][0]} imports floor "
              f"{'the API' if floor_of(edge.target) == -1 else FLOORS[floor_of(edge.target)][0]}"
              for edge in EDGES
              if floor_of(edge.source) is not None and floor_of(edge.target) is not None
              and floor_of(edge.target) < floor_of(edge.source)]
    assert not upward, _report(upward, "imports up the floors")


def test_no_private_names_across_modules():
    private = [str(edge) for edge in EDGES
               if any(n.startswith("_") and not n.startswith("__") for n in edge.names)]
    assert not private, _report(private, "imports of another module's private names")


def _shadowing(package: Module, source: str, children: Set[str]) -> List[Tuple[str, int]]:
    """(name, line) of each name `source`, a package's __init__.py, binds that is also one of its `children`."""
    found = []
    for node in ast.parse(source).body:
        bound = []
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound = [node.name]
        elif isinstance(node, ast.Assign):
            bound = [t.id for t in node.targets if isinstance(t, ast.Name)]
        elif isinstance(node, ast.ImportFrom):
            target = _absolute(package, node)
            # `from package import submodule` binds the submodule itself: no shadow
            bound = [a.asname or a.name for a in node.names if f"{target}.{a.name}" not in MODULES]
        found += [(name, node.lineno) for name in bound if name in children]
    return found


def test_no_package_name_shadows_its_submodule():
    """`package.x` must mean one thing: a name bound in package/__init__.py that is also a
    submodule would be replaced by the submodule (or replace it) depending on import order."""
    shadowed = []
    for module in MODULES.values():
        if module.is_package:
            prefix = module.name + "."
            children = {n[len(prefix):] for n in MODULES if n.startswith(prefix) and "." not in n[len(prefix):]}
            shadowed += [f"{module.name}.{name} ({_relative(module.path)}:{line})"
                         for name, line in _shadowing(module, module.path.read_text(), children)]
    assert not shadowed, _report(shadowed, "package names that shadow a submodule")


def test_the_checks_see_what_they_check():
    """The walk finds the packages, local imports and private imports it is meant to see."""
    assert {"graphpar.frontend.compile", "graphpar.passes.manager", "graphpar.passes.tp.solver",
            "graphpar.runtime.pipeline.schedules", "graphpar"} <= set(MODULES)
    assert any(edge.local for edge in EDGES)
    source = Module("graphpar.passes.tp.example", ROOT / "passes" / "tp" / "example.py", False)
    tree = ast.parse("from ..rules import _hidden, shape\nfrom . import solver\n")
    resolved = [(_absolute(source, node), [a.name for a in node.names]) for node in tree.body]
    assert resolved == [("graphpar.passes.rules", ["_hidden", "shape"]), ("graphpar.passes.tp", ["solver"])]
    assert floor_of("graphpar.tools.cli") == 0 and floor_of("graphpar.strategy") == len(FLOORS) - 1
    package = MODULES["graphpar.ir"]
    assert _shadowing(package, "from graphpar.ir.node_record import record\ndef printer(): pass\n",
                      {"printer", "node_record"}) == [("printer", 2)]
