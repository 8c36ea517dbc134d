"""No import circles between the files of ``trickles/``, and no file of it past 400 lines without saying why.

Every ``trickles/**/*.py`` is parsed with :mod:`ast` and each of its imports -- at the top of the file, inside a
function or under ``if TYPE_CHECKING:`` (an import moved out of the way still makes the circle, it only delays or
hides it) -- is resolved to the one file inside ``trickles/`` it names:

* ``import trickles.a.b`` and ``from .a import b``/``from trickles.a import b`` name ``a/b.py`` (or
  ``a/b/__init__.py``) when ``b`` is a submodule of the package ``a``, and ``a/__init__.py`` otherwise;
* ``from . import name`` names the submodule ``name`` if there is one, else the package's ``__init__.py``; so a
  package ``__init__.py`` that imports its own submodules has an edge to each of them.

The file-level graph's strongly connected components of more than one file, and files that import themselves, are
the circles; the test fails listing each with its files and the imports that close it.

A file over :data:`MAX_LINES` lines holds more than one idea unless its module docstring gives the reason, in a
line starting ``Long because`` (none does today).
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "trickles"
MAX_LINES = 400


def _modules(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` under ``root`` (``root`` itself is the top package)."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = [root.name, *path.relative_to(root).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _package_of(module: str, path: Path) -> str:
    """The package a relative import in ``module`` starts from: itself for an ``__init__.py``, else its parent."""
    return module if path.name == "__init__.py" else module.rpartition(".")[0]


def _imported(module: str, path: Path, modules: dict[str, Path]) -> list[tuple[str, int]]:
    """The modules of ``modules`` that ``module`` (the file ``path``) imports, each with the line of its import."""
    top = next(iter(modules)).split(".")[0]
    targets = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == top or alias.name.startswith(top + "."):
                    name = alias.name
                    while name not in modules and "." in name:  # `import trickles.a.f` where f is not a module
                        name = name.rpartition(".")[0]
                    targets.append((name, node.lineno))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = _package_of(module, path)
                for _ in range(node.level - 1):
                    base = base.rpartition(".")[0]
                base = ".".join(filter(None, [base, node.module]))
            else:
                base = node.module or ""
            if base != top and not base.startswith(top + "."):
                continue
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                targets.append((submodule if submodule in modules else base, node.lineno))
    unknown = [name for name, _ in targets if name not in modules]
    assert not unknown, f"{path}: imports of modules that do not exist: {unknown}"
    return targets


def _graph(modules: dict[str, Path]) -> dict[str, dict[str, int]]:
    """module -> {imported module: line of the first such import}."""
    graph: dict[str, dict[str, int]] = {}
    for module, path in modules.items():
        edges = graph.setdefault(module, {})
        for target, line in _imported(module, path, modules):
            edges.setdefault(target, line)
    return graph


def _components(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Tarjan's strongly connected components of ``graph`` (iterative, so deep chains need no recursion)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(graph[start]))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            for target in edges:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(graph[target])))
                    break
                if target in on_stack:
                    low[node] = min(low[node], index[target])
            else:
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


def cycles(root: Path = PACKAGE) -> list[str]:
    """One readable line block per import circle among the files under ``root``: its files and their imports."""
    modules = _modules(root)
    graph = _graph(modules)
    base = root.parent
    found = []
    for component in _components(graph):
        if len(component) == 1 and component[0] not in graph[component[0]]:
            continue
        members = set(component)
        lines = [f"circle of {len(component)} file(s):"]
        for module in component:
            for target, line in sorted(graph[module].items()):
                if target in members:
                    lines.append(f"  {modules[module].relative_to(base)}:{line} -> {modules[target].relative_to(base)}")
        found.append("\n".join(lines))
    return found


def test_resolution_covers_every_import_form(tmp_path):
    """The resolver sees relative, absolute, package and in-function imports (a tiny package with one of each)."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from . import a\nfrom .sub import thing\n")
    (pkg / "a.py").write_text("import pkg.sub.b\n")
    (pkg / "sub" / "__init__.py").write_text("thing = 1\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from ..a import name\n")
    (pkg / "c.py").write_text("from pkg.sub import b\nfrom pkg import sub\nfrom pkg.sub import thing\n")
    modules = _modules(pkg)
    graph = _graph(modules)
    assert set(graph["pkg"]) == {"pkg.a", "pkg.sub"}
    assert set(graph["pkg.a"]) == {"pkg.sub.b"}
    assert set(graph["pkg.sub.b"]) == {"pkg.a"}  # the import inside a function counts
    assert set(graph["pkg.c"]) == {"pkg.sub.b", "pkg.sub"}
    assert cycles(pkg) == ["circle of 2 file(s):\n  pkg/a.py:1 -> pkg/sub/b.py\n  pkg/sub/b.py:2 -> pkg/a.py"]


def test_no_import_circles_inside_trickles():
    found = cycles()
    assert not found, "import circles between files of trickles/ (break each at its cause):\n" + "\n".join(found)


def too_long(root: Path = PACKAGE, limit: int = MAX_LINES) -> list[str]:
    """``path: N lines`` for each file under ``root`` longer than ``limit`` whose docstring gives no reason."""
    found = []
    for path in sorted(root.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        doc = ast.get_docstring(ast.parse(text)) or ""
        n = text.count("\n")
        if n > limit and not any(line.startswith("Long because") for line in doc.splitlines()):
            found.append(f"{path.relative_to(root.parent)}: {n} lines")
    return found


def test_no_file_over_400_lines_without_a_reason(tmp_path):
    (tmp_path / "long.py").write_text('"""A module."""\n' + "x = 1\n" * 5)
    (tmp_path / "said.py").write_text('"""A module.\n\nLong because one table.\n"""\n' + "x = 1\n" * 5)
    assert too_long(tmp_path, limit=4) == [f"{tmp_path.name}/long.py: 6 lines"]
    found = too_long()
    assert not found, (
        "files of trickles/ past 400 lines (split them by idea, or say why in the docstring):\n" + "\n".join(found)
    )
