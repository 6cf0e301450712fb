"""The package's imports, read statically: no cycles anywhere, and the low layers never import a
feature.

Every module under src/gptkiln is parsed with `ast`; every ``import`` counts, the ones inside
functions too (a lazy import is still a dependency, only a later one), except a module-level
``if TYPE_CHECKING:`` block, which never runs. Relative imports are resolved against the module's
package, and ``from gptkiln import x`` is an edge to the module ``gptkiln.x`` when there is one.
Importing ``a.b.c`` also runs ``a/b/__init__.py``, but that is not counted as an edge: a package
whose ``__init__`` re-exports its modules would otherwise be a cycle with each of them.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import gptkiln

PACKAGE = "gptkiln"
SOURCE = Path(gptkiln.__file__).parent

# The bottom of the house: what every command builds on. None of it may reach, through any chain
# of imports, what is above it: a feature (a command's own code) or the modules that write runs
# and other formats; they are what knows about the bottom, never the other way.
LOW = ("gptkiln.loading", "gptkiln.model", "gptkiln.positions", "gptkiln.config",
       "gptkiln.tokenizers", "gptkiln.quantize", "gptkiln.cpu", "gptkiln.gpu", "gptkiln.sampling",
       "gptkiln.logits_processors", "gptkiln.text_stream", "gptkiln.errors", "gptkiln.devices",
       "gptkiln.load_steps", "gptkiln.cache", "gptkiln.losses")  # fmt: skip
ABOVE = ("gptkiln.finetune", "gptkiln.serve", "gptkiln.cli", "gptkiln.api", "gptkiln.inspect",
         "gptkiln.chat", "gptkiln.train", "gptkiln.convert", "gptkiln.checkpoint",
         "gptkiln.run_guard", "gptkiln.info", "gptkiln.interop", "gptkiln.export")  # fmt: skip

Edge = tuple[str, int]  # (imported module, line of the import)


def package_modules(root: Path, package: str) -> dict[str, Path]:
    """Module name -> file, for every .py under ``root`` (``pkg/__init__.py`` is ``pkg``)."""
    modules = {}
    for path in sorted(root.rglob("*.py")):
        parts = [package, *path.relative_to(root).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _is_type_checking(node: ast.stmt) -> bool:
    if not isinstance(node, ast.If):
        return False
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def module_imports(name: str, path: Path, modules: dict[str, Path]) -> list[Edge]:
    """The package's modules that ``name`` imports anywhere in its file, with their lines."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    skipped = {id(n) for top in tree.body if _is_type_checking(top) for n in ast.walk(top)}
    # the package a relative import starts from: a package's own name, a module's parent
    here = name if path.name == "__init__.py" else name.rpartition(".")[0]
    edges = []
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = here.split(".")[: len(here.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            # `from pkg import sub` imports the module pkg.sub; `from mod import name`, mod
            targets = [
                f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names
            ]
        else:
            continue
        for target in targets:
            while target and target not in modules:  # `import a.b.c` of a name inside a.b.c
                target = target.rpartition(".")[0]
            if target and target != name:
                edges.append((target, node.lineno))
    return edges


def import_graph(root: Path, package: str) -> dict[str, dict[str, int]]:
    """Module -> {imported module: line of its first import}, for the package's own modules."""
    modules = package_modules(root, package)
    graph: dict[str, dict[str, int]] = {}
    for name, path in modules.items():
        graph[name] = {}
        for target, line in module_imports(name, path, modules):
            graph[name].setdefault(target, line)
    return graph


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """One cycle (``[a, b, ..., a]``) through each strongly connected set of modules (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            members = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                members.add(member)
                if member == node:
                    break
            if len(members) > 1:
                found.append(_cycle_through(min(members), members, graph))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def _cycle_through(start: str, members: set[str], graph: dict[str, dict[str, int]]) -> list[str]:
    """The shortest path start -> ... -> start inside ``members`` (breadth first)."""
    paths = {start: [start]}
    queue = [start]
    while queue:
        node = queue.pop(0)
        for nxt in sorted(graph[node]):
            if nxt == start:
                return [*paths[node], start]
            if nxt in members and nxt not in paths:
                paths[nxt] = [*paths[node], nxt]
                queue.append(nxt)
    raise AssertionError(f"no cycle through {start}")  # a strongly connected set has one


def describe(cycle: list[str], graph: dict[str, dict[str, int]], modules: dict[str, Path]) -> str:
    steps = [
        f"{a} ({modules[a].relative_to(SOURCE.parent)}:{graph[a][b]}) -> {b}"
        for a, b in zip(cycle, cycle[1:])
    ]
    return "\n    ".join(steps)


def reachable(graph: dict[str, dict[str, int]], start: str) -> dict[str, list[str]]:
    """Every module ``start`` imports, directly or through others, with one chain to it."""
    chains = {start: [start]}
    queue = [start]
    while queue:
        node = queue.pop(0)
        for nxt in sorted(graph[node]):
            if nxt not in chains:
                chains[nxt] = [*chains[node], nxt]
                queue.append(nxt)
    return chains


def _under(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def test_gptkiln_has_no_import_cycle():
    graph = import_graph(SOURCE, PACKAGE)
    modules = package_modules(SOURCE, PACKAGE)
    assert "gptkiln.loading" in graph and graph["gptkiln.loading"], "the walk found no imports"
    found = cycles(graph)
    assert not found, "import cycles:\n  " + "\n  ".join(describe(c, graph, modules) for c in found)


def test_low_layers_never_import_what_is_above_them():
    graph = import_graph(SOURCE, PACKAGE)
    low = [name for name in graph if _under(name, LOW)]
    assert "gptkiln.loading" in low and "gptkiln.model" in low
    wrong = [
        " -> ".join(chain)
        for name in low
        for reached, chain in reachable(graph, name).items()
        if _under(reached, ABOVE)
    ]
    assert not wrong, "a low layer imports what is above it:\n  " + "\n  ".join(wrong)


def test_sampling_and_the_model_import_nothing_of_the_cpu_backend():
    """Text generation is small pure functions and the model is plain: the CPU backend
    (`gptkiln.cpu`) is applied from outside, by whoever owns a decoding (api, serve, evaluate),
    never reached from them, not even lazily or through another module."""
    graph = import_graph(SOURCE, PACKAGE)
    assert "gptkiln.cpu.plan" in graph  # the backend is there, and is not what they import
    for plain in ("gptkiln.sampling", "gptkiln.model"):
        wrong = [
            " -> ".join(chain)
            for reached, chain in reachable(graph, plain).items()
            if _under(reached, ("gptkiln.cpu",))
        ]
        assert not wrong, f"{plain} reaches the CPU backend:\n  " + "\n  ".join(wrong)


# -- the walk itself, on packages made for it -----------------------------------------------------
def write_package(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / "pkg" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    return root / "pkg"


@pytest.mark.parametrize(
    "files",
    [
        # a lazy import inside a function, the way loading imported finetune.lora
        {"__init__.py": "", "low.py": "def f():\n    from pkg.high import g\n",
         "high.py": "from pkg.low import f\n"},
        # relative imports, from a module and from a package's __init__
        {"__init__.py": "", "a.py": "from . import b\n", "sub/__init__.py": "from ..a import x\n",
         "b.py": "from .sub import y\n"},
        # `from pkg import sub` is the module pkg.sub, not pkg
        {"__init__.py": "", "a.py": "from pkg import b\n", "b.py": "import pkg.a as a\n"},
        # `import pkg.sub.mod.name`, a function's TYPE_CHECKING import (it runs if the test is True)
        {"__init__.py": "", "sub/__init__.py": "", "sub/mod.py": "import pkg.c\n",
         "c.py": "def f():\n    if TYPE_CHECKING:\n        import pkg.sub.mod.name\n"},
    ],
)  # fmt: skip
def test_the_walk_finds_cycles(tmp_path, files):
    root = write_package(tmp_path, files)
    found = cycles(import_graph(root, "pkg"))
    assert len(found) == 1 and found[0][0] == found[0][-1] and len(found[0]) >= 3


def test_the_walk_passes_what_has_no_cycle(tmp_path):
    root = write_package(
        tmp_path,
        {
            "__init__.py": "from pkg.a import x\nfrom pkg.b import y\n",  # re-exports: no cycle
            "a.py": "import typing\nif typing.TYPE_CHECKING:\n    from pkg.b import y\n",
            "b.py": "import os\nfrom pkg.a import x\nfrom . import a\n",
        },
    )
    graph = import_graph(root, "pkg")
    assert graph == {"pkg": {"pkg.a": 1, "pkg.b": 2}, "pkg.a": {}, "pkg.b": {"pkg.a": 2}}
    assert cycles(graph) == []
    assert list(reachable(graph, "pkg")) == ["pkg", "pkg.a", "pkg.b"]
