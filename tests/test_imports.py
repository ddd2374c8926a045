"""No module of moe_comm imports, directly or through others, a module that imports it back.

The graph is read from the source with ``ast``, without importing anything: every ``import`` and
``from ... import`` of a moe_comm module, those inside functions too (a lazy import closes a circle
just as well), except those under ``if TYPE_CHECKING:``, which never run. An edge goes to the module
named, not to its parent packages; ``from .b import c`` names the submodule ``b.c`` when there is one
(``b/c.py`` or ``b/c/__init__.py``), else the module ``b`` when ``b``'s code binds ``c``, else the
submodule ``b.c`` with no Python source. Modules with no Python source (``moe_comm._C``, the compiled
extension) and modules outside moe_comm are not in the graph.
"""
from __future__ import annotations

import ast
import textwrap
from pathlib import Path

from helpers.paths import ROOT

PACKAGE = ROOT / "moe_comm"


def module_files(package: Path) -> dict[str, Path]:
    """Dotted name -> source file of every module under the package directory ``package``."""
    found = {}
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _run_time_imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """The import statements of ``tree`` that can run: all but the bodies of ``if TYPE_CHECKING:``."""
    found: list[ast.Import | ast.ImportFrom] = []
    pending = [tree]
    while pending:
        node = pending.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        children = node.orelse if isinstance(node, ast.If) and _is_type_checking(node.test) else \
            list(ast.iter_child_nodes(node))
        pending.extend(children)
    return found


def _bound_names(tree: ast.Module) -> set[str] | None:
    """The names a module's code binds outside functions and classes; None when it may bind any name
    (``from x import *``, a module ``__getattr__``)."""
    names: set[str] = set()
    pending: list[ast.AST] = list(tree.body)
    while pending:
        node = pending.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            if node.name == "__getattr__":
                return None
            names.add(node.name)
        elif isinstance(node, ast.ImportFrom) and any(alias.name == "*" for alias in node.names):
            return None
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update(alias.asname or alias.name.split(".")[0] for alias in node.names)
        else:
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            pending.extend(ast.iter_child_nodes(node))
    return names


def imports_of(module: str, modules: dict[str, Path], trees: dict[str, ast.Module]) -> set[str]:
    """The modules of ``modules`` (parsed: ``trees``) that ``module`` imports (see the module docstring)."""
    package = module if modules[module].name == "__init__.py" else module.rpartition(".")[0]
    targets: set[str] = set()
    for node in _run_time_imports(trees[module]):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
            continue
        if node.level:
            parts = package.split(".")
            base = ".".join(parts[:len(parts) - node.level + 1] + ([node.module] if node.module else []))
        else:
            base = node.module or ""
        bound = _bound_names(trees[base]) if base in trees else set()
        for alias in node.names:
            submodule = f"{base}.{alias.name}"
            is_name = alias.name == "*" or (submodule not in modules and (bound is None or alias.name in bound))
            targets.add(base if is_name else submodule)
    return targets & modules.keys()


def import_graph(package: Path) -> dict[str, set[str]]:
    """Module -> the modules it imports, for every module under the package directory ``package``."""
    modules = module_files(package)
    trees = {module: ast.parse(path.read_text(), str(path)) for module, path in modules.items()}
    return {module: imports_of(module, modules, trees) for module in modules}


def _components(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of ``graph`` (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            nxt = next(edges, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                components.append(sorted(component))
    return components


def _cycle_through(start: str, graph: dict[str, set[str]], within: set[str]) -> list[str]:
    """A shortest import path ``start -> ... -> start`` inside ``within`` (one strongly connected component)."""
    previous: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for nxt in sorted(graph[node] & within):
                if nxt == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(previous[path[-1]])
                    return [start, *reversed(path[:-1]), start] if node != start else [start, start]
                if nxt not in previous:
                    previous[nxt] = node
                    following.append(nxt)
        frontier = following
    raise ValueError(f"_cycle_through: no cycle through {start} within {sorted(within)}")


def find_cycles(package: Path) -> list[list[str]]:
    """One import cycle (``[a, b, ..., a]``) per strongly connected component of more than one module
    or with a self-import, for the package directory ``package``."""
    graph = import_graph(package)
    return [_cycle_through(component[0], graph, set(component)) for component in _components(graph)
            if len(component) > 1 or component[0] in graph[component[0]]]


def _describe(cycles: list[list[str]]) -> str:
    return "\n".join(" -> ".join(cycle) for cycle in cycles)


def test_moe_comm_has_no_import_cycle():
    cycles = find_cycles(PACKAGE)
    assert not cycles, f"import cycles in moe_comm:\n{_describe(cycles)}"


def _write_package(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(textwrap.dedent(text))
    return root


def test_a_planted_cycle_through_a_lazy_import_is_named(tmp_path):
    package = _write_package(tmp_path / "pkg", {
        "__init__.py": "",
        "a.py": "from . import b\n\ng = 1\n",
        "b.py": "def f():\n    from .a import g\n    return g\n",
        "c.py": "import pkg.a\n",
    })
    assert _describe(find_cycles(package)) == "pkg.a -> pkg.b -> pkg.a"


def test_a_self_import_is_a_cycle(tmp_path):
    package = _write_package(tmp_path / "pkg", {"__init__.py": "", "a.py": "from pkg.a import x\nx = 1\n"})
    assert _describe(find_cycles(package)) == "pkg.a -> pkg.a"


def test_names_type_checking_imports_and_parent_packages_make_no_edge(tmp_path):
    package = _write_package(tmp_path / "pkg", {
        "__init__.py": "from .sub.impl import run\n",
        "sub/__init__.py": "",
        "sub/impl.py": """
            from typing import TYPE_CHECKING
            from ..names import helper   # a name of pkg.names, not a module
            if TYPE_CHECKING:
                from .. import user
            else:
                import os

            def run():
                pass
            """,
        "names.py": "def helper():\n    pass\n",
        "user.py": "import pkg.sub.impl\n",
    })
    graph = import_graph(package)
    assert graph["pkg"] == {"pkg.sub.impl"}
    assert graph["pkg.sub.impl"] == {"pkg.names"}
    assert graph["pkg.user"] == {"pkg.sub.impl"}
    assert find_cycles(package) == []


ROOT_PACKAGE = "__init__"
#: The package's floors, bottom to top (docs/layout.md): a module imports modules of its own package and
#: of packages on lower floors only, so nothing imports from a layer above it.
FLOORS = (
    ("core",),                            # leaf utilities: native modules, config, env, errors, checks
    ("ops", "transport"),                 # local compute; byte movers
    ("protocol", "accuracy", "launch"),   # what every backend agrees on; the accuracy standard; local worlds
    ("backends",),                        # portable, cuda, ascend, cambricon
    ("buffer",),                          # the DeepEP facade
    ("moe", "compat", "testing"),         # the EP-MoE layer; the deep_ep alias; contract helpers
    (ROOT_PACKAGE,),                      # moe_comm/__init__.py: the public names users import
    ("bench", "integrations"),            # benchmarks and engine plugins, written against the public names
)


def floor_of(module: str) -> tuple[int, str]:
    """(floor, package) of a module of moe_comm (``moe_comm`` itself: the public names' floor)."""
    parts = module.split(".")
    if len(parts) == 1:
        parts = [parts[0], ROOT_PACKAGE]
    for floor, packages in enumerate(FLOORS):
        if parts[1] in packages:
            return floor, parts[1]
    raise AssertionError(f"{module}: moe_comm.{parts[1]} is on no floor of FLOORS (test_imports.py, docs/layout.md)")


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """``a -> b`` for every import of a module ``b`` of another package on the same or a higher floor."""
    found = []
    for module, targets in sorted(graph.items()):
        floor, package = floor_of(module)
        for target in sorted(targets):
            target_floor, target_package = floor_of(target)
            if target_package != package and target_floor >= floor:
                found.append(f"{module} (floor {floor}) -> {target} (floor {target_floor})")
    return found


def test_nothing_imports_from_a_floor_above_it():
    found = upward_imports(import_graph(PACKAGE))
    assert not found, "imports that do not go down:\n" + "\n".join(found)


def test_a_planted_upward_import_is_named(tmp_path):
    package = _write_package(tmp_path / "moe_comm", {
        "__init__.py": "", "core/__init__.py": "", "buffer/__init__.py": "", "ops/__init__.py": "",
        "core/env.py": "def f():\n    from ..buffer import facade\n",
        "buffer/facade.py": "from ..core import env\n",
        "ops/a.py": "from ..transport import mover\n",
        "transport/__init__.py": "", "transport/mover.py": "",
    })
    assert upward_imports(import_graph(package)) == [
        "moe_comm.core.env (floor 0) -> moe_comm.buffer.facade (floor 4)",
        "moe_comm.ops.a (floor 1) -> moe_comm.transport.mover (floor 1)"]
