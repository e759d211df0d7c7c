"""The shape of the code base (issue 20): no import circle inside `megatron_po/`, no oversized module.

Import graph: every module under `megatron_po/` is parsed with `ast` (nothing is imported) and every
`import` / `from ... import` statement in it adds an edge, absolute or relative, at module level or
inside a function or method alike. Function-level imports COUNT: deferring an import into a function
hides a circle from Python's import machinery but not from the reader (the module still needs the other
one, which needs it back), and a circle that exists only at call time still ties the two modules
together; issue 20's own example, config.py -> models/te_transformer.py -> models/te_layout.py ->
config.py, closes through a function-level import. Imports under `if TYPE_CHECKING:` would count too
(there are none). An edge goes to the most specific module the statement names: `from a.b import c`
is an edge to `a.b.c` when that is a module, else to `a.b` (the package's `__init__.py`); the parent
packages Python initialises on the way are not edges (else every submodule of a package whose
`__init__.py` re-exports its submodules, like optim/ and tensor_parallel/, would sit in a circle).
Only edges between modules of `megatron_po/` are kept.

Size: no `.py` file under `megatron_po/`, `bench/` or `tools/` over MAX_LINES lines.
"""

from __future__ import annotations

import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = "megatron_po"
MAX_LINES = 800
SIZE_CHECKED = ("megatron_po", "bench", "tools")


def module_files(package_dir: str, package: str) -> dict[str, str]:
    """{dotted module name: file path} of every .py file under `package_dir` (a package `__init__.py`
    is the package's own name)."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(package_dir):
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
        rel = os.path.relpath(dirpath, package_dir)
        parts = [package] + ([] if rel == "." else rel.split(os.sep))
        for name in sorted(filenames):
            if name.endswith(".py"):
                mod = parts if name == "__init__.py" else parts + [name[:-3]]
                out[".".join(mod)] = os.path.join(dirpath, name)
    return out


def imported_modules(tree: ast.AST, module: str, is_package: bool, known: set[str]) -> set[str]:
    """The modules in `known` that `tree` (the source of `module`) imports, anywhere in it."""
    out = set()

    def add(name: str) -> None:  # the most specific known module `name` or a parent of it names
        parts = name.split(".")
        for i in range(len(parts), 0, -1):
            if ".".join(parts[:i]) in known:
                out.add(".".join(parts[:i]))
                return

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from the package of `module`, `level` - 1 packages up
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[:len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            for alias in node.names:
                add(f"{target}.{alias.name}")  # a submodule, or a name defined in `target`
    out.discard(module)
    return out


def import_graph(package_dir: str = os.path.join(ROOT, PACKAGE), package: str = PACKAGE) -> dict[str, set[str]]:
    files = module_files(package_dir, package)
    graph = {}
    for mod, path in files.items():
        with open(path) as f:
            tree = ast.parse(f.read(), filename=path)
        graph[mod] = imported_modules(tree, mod, path.endswith("__init__.py"), set(files))
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle ([a, b, ..., a]) through each knot of the graph (`knots`), in a stable order."""
    return [_cycle_in(graph, knot) for knot in knots(graph)]


def knots(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components that hold a cycle (every member reaches every other: breaking
    the one printed cycle may leave another), ordered by their smallest name. Tarjan's algorithm,
    iterative (no recursion limit)."""
    index, low, on_stack, stack, components = {}, {}, set(), [], []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1 or node in graph.get(node, ()):
                    components.append(component)
    return sorted(components, key=min)


def _cycle_in(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    """A shortest cycle through the smallest-named member of a strongly connected component (BFS)."""
    first = min(component)
    parent, frontier = {first: None}, [first]
    while frontier:
        following = []
        for node in frontier:
            for child in sorted(graph.get(node, ())):
                if child == first:  # closed: walk back
                    path = [node]
                    while parent[path[-1]] is not None:
                        path.append(parent[path[-1]])
                    return path[::-1] + [first]
                if child in component and child not in parent:
                    parent[child] = node
                    following.append(child)
        frontier = following
    raise AssertionError(f"no cycle through {first} in its component")  # not a component, then


def oversized_files(dirs=SIZE_CHECKED, max_lines: int = MAX_LINES) -> list[tuple[str, int]]:
    out = []
    for top in dirs:
        for dirpath, dirnames, filenames in os.walk(os.path.join(ROOT, top)):
            dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
            for name in sorted(filenames):
                if name.endswith(".py"):
                    path = os.path.join(dirpath, name)
                    with open(path, encoding="utf-8") as f:
                        n = sum(1 for _ in f)
                    if n > max_lines:
                        out.append((os.path.relpath(path, ROOT), n))
    return out


# --------------------------------------------------------------------------------------------------
# The cycle finder and the graph builder on small inputs (so the real checks can fail)
# --------------------------------------------------------------------------------------------------


def test_find_cycles_on_small_graphs():
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []
    assert find_cycles({"a": {"b", "c"}, "b": {"d"}, "c": {"d"}, "d": set()}) == []  # a diamond is no circle
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert find_cycles({"x": {"x"}}) == [["x", "x"]]
    # two separate circles, one of them with a shortcut: the shortest cycle of each is reported
    graph = {"a": {"b"}, "b": {"a"}, "p": {"q"}, "q": {"r", "p"}, "r": {"p"}, "z": {"p"}}
    assert find_cycles(graph) == [["a", "b", "a"], ["p", "q", "p"]]
    assert knots(graph) == [{"a", "b"}, {"p", "q", "r"}]
    # deep chains do not hit the recursion limit
    chain = {str(i): {str(i + 1)} for i in range(5000)}
    assert find_cycles(chain) == []
    chain["5000"] = {"0"}
    assert len(find_cycles(chain)[0]) == 5002


def test_import_graph_sees_relative_and_function_level_imports(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from .leaf import value\n")
    (pkg / "sub" / "leaf.py").write_text("value = 1\n\ndef later():\n    from pkg.top import helper\n")
    (pkg / "top.py").write_text("import os\nfrom . import sub\nfrom .sub.leaf import value\n\n"
                                "def helper():\n    return value\n")
    (pkg / "other.py").write_text("from pkg.sub import value\nimport pkg.top as t\n")
    graph = import_graph(str(pkg), "pkg")
    assert graph == {"pkg": set(), "pkg.sub": {"pkg.sub.leaf"}, "pkg.sub.leaf": {"pkg.top"},
                     "pkg.top": {"pkg.sub", "pkg.sub.leaf"}, "pkg.other": {"pkg.sub", "pkg.top"}}
    assert find_cycles(graph) == [["pkg.sub", "pkg.sub.leaf", "pkg.top", "pkg.sub"]]


# --------------------------------------------------------------------------------------------------
# The checks
# --------------------------------------------------------------------------------------------------


def test_no_import_circle_in_megatron_po():
    graph = import_graph()
    assert "megatron_po.training" in graph and "megatron_po.config" in graph["megatron_po.training"]
    found = [(_cycle_in(graph, knot), knot) for knot in knots(graph)]
    assert not found, "import circles in megatron_po/ (function-level imports count):\n" + "\n".join(
        "  " + " -> ".join(cycle) + (f"  (knot of {len(knot)}: {', '.join(sorted(knot))})" if len(knot) > 2 else "")
        for cycle, knot in found)


@pytest.mark.parametrize("top", SIZE_CHECKED)
def test_no_module_over_max_lines(top):
    assert os.path.isdir(os.path.join(ROOT, top))
    offenders = oversized_files((top,))
    assert not offenders, f"modules over {MAX_LINES} lines:\n" + "\n".join(f"  {p}: {n}" for p, n in offenders)
