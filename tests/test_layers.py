"""The stage folders of ``src/bistat`` import only downward.

The order, lowest first (a folder may import itself and any folder before it, never one after):

    core -> model -> store -> engines -> declare -> run -> analysis -> explain -> report -> cli

``bistat`` itself (``__init__``: the version) may be imported from anywhere. Every import counts,
those made only for type annotations (under ``if TYPE_CHECKING:``) too, and those inside
functions.

The graph is derived from the source with :mod:`ast` (nothing is imported), so the same check runs
from a shell: ``python tests/test_layers.py [SRC]`` prints the folder order, the module graph's size
(modules, import arrows, floors: the longest chain of imports, each loop counted as one module; and
its loops) and every import that climbs. ``SRC`` (default: this checkout's ``src``) may be another
checkout's ``src`` folder, e.g. an older commit's (``git worktree add``) to compare with.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
LAYERS = ("core", "model", "store", "engines", "declare", "run", "analysis", "explain", "report",
          "cli")


def _imports(tree: ast.AST):
    """Every ``bistat.*`` name imported anywhere in ``tree``, with its line."""
    stack = [tree]
    while stack:
        node = stack.pop()
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ImportFrom) and child.level == 0 and child.module:
                if child.module == "bistat":
                    for alias in child.names:
                        yield f"bistat.{alias.name}", child.lineno
                elif child.module.startswith("bistat."):
                    for alias in child.names:   # a submodule, where the name is one
                        yield f"{child.module}.{alias.name}", child.lineno
            elif isinstance(child, ast.Import):
                for alias in child.names:
                    if alias.name.startswith("bistat."):
                        yield alias.name, child.lineno
            stack.append(child)


def _strongly_connected(graph: dict[str, set[str]]) -> list[set[str]]:
    """Tarjan's strongly connected components of ``graph`` (iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
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
                components.append(component)
    return components


def structure(src: Path = SRC) -> dict[str, object]:
    """Modules, import arrows between them, floors (the longest import chain, a loop counted as
    one module) and the loops (modules that import each other), of ``src/bistat``."""
    graph = {m: {i for i, _ in imports} for m, imports in module_graph(src).items()}
    graph = {m: {i for i in deps if i in graph and i != m} for m, deps in graph.items()}
    components = _strongly_connected(graph)
    where = {m: n for n, c in enumerate(components) for m in c}
    floor: dict[int, int] = {}
    for n, component in enumerate(components):   # Tarjan yields a component after those it imports
        below = [floor[where[d]] for m in component for d in graph[m] if where[d] != n]
        floor[n] = 1 + max(below, default=0)
    return {"modules": len(graph), "arrows": sum(len(d) for d in graph.values()),
            "floors": max(floor.values(), default=0),
            "loops": sorted(sorted(c) for c in components if len(c) > 1)}


def _layer(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in LAYERS else None


def module_graph(src: Path = SRC) -> dict[str, list[tuple[str, int]]]:
    """``bistat.x.y`` -> the ``bistat`` modules it imports (with line numbers)."""
    paths = {".".join(p.relative_to(src).with_suffix("").parts).removesuffix(".__init__"): p
             for p in sorted((src / "bistat").rglob("*.py"))}

    extensions = {".".join(c.relative_to(src).with_suffix("").parts)
                  for c in (src / "bistat").rglob("*.c")}

    def target(name: str) -> str:   # ``from pkg import name``: the module pkg.name, else pkg
        known = name in paths or name in extensions
        return name if known or "." not in name else name.rpartition(".")[0]

    graph = {module: sorted({(target(name), line) for name, line in
                             _imports(ast.parse(path.read_text(encoding="utf-8")))})
             for module, path in paths.items()}
    for c_source in (src / "bistat").rglob("*.c"):   # a compiled extension imports nothing here
        graph[".".join(c_source.relative_to(src).with_suffix("").parts)] = []
    return graph


def climbs() -> list[str]:
    """Every import from a folder to a folder above it, as ``module:line -> imported``."""
    found = []
    for module, imports in module_graph().items():
        mine = _layer(module)
        for imported, line in imports:
            theirs = _layer(imported)
            if mine and theirs and LAYERS.index(theirs) > LAYERS.index(mine):
                found.append(f"{module}:{line} ({mine}) -> {imported} ({theirs})")
    return found


def test_every_module_lives_in_a_stage_folder():
    """Outside the folders: the package, ``python -m bistat`` and the deprecated aliases of
    bistat 0.1's module paths (``bistat.core.deprecated.MOVED``), each importing only that."""
    from bistat.core.deprecated import MOVED

    graph = module_graph()
    loose = [m for m in graph
             if _layer(m) is None and m not in ("bistat", "bistat.__main__") and m not in MOVED]
    assert loose == []
    aliases = sorted(m for m in graph if _layer(m) is None and m in MOVED)
    assert aliases == sorted(m for m in MOVED if m not in ("bistat.analysis", "bistat.report"))
    assert {m: [i for i, _ in graph[m]] for m in aliases} == {
        m: ["bistat.core.deprecated"] for m in aliases}


def test_imports_only_run_downward():
    assert climbs() == []


def test_the_check_sees_every_import():
    # the walker itself: an import in a function body counts, and one under TYPE_CHECKING
    tree = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                     "    from bistat.cli import x\n"
                     "def f():\n    from bistat.report.finding import y\n")
    assert sorted(_imports(tree)) == [("bistat.cli.x", 3), ("bistat.report.finding.y", 5)]


def test_structure_counts_floors_and_loops():
    shape = structure()
    assert shape["loops"] == []
    # the folders, plus the chains inside a folder: cli/ (a command, its shared options, gating),
    # declare/ (the design report's parts) and core/ (design -> design_coverage -> design_rho ->
    # serial -> rule)
    assert shape["floors"] <= len(LAYERS) + 4


def test_the_architecture_doc_gives_the_measured_structure():
    # docs/ARCHITECTURE.md's figures are generated from structure() and climbs() by cog
    import subprocess

    root = SRC.parent
    result = subprocess.run([sys.executable, "-m", "cogapp", "--check", "docs/ARCHITECTURE.md"],
                            cwd=root, capture_output=True, text=True)
    assert result.returncode == 0, (
        "docs/ARCHITECTURE.md's module-graph figures differ from the measured ones; run "
        "`cog -r docs/ARCHITECTURE.md`\n" + result.stdout + result.stderr)


if __name__ == "__main__":
    src = Path(sys.argv[1]).resolve() if len(sys.argv) > 1 else SRC
    print(" -> ".join(LAYERS))
    shape = structure(src)
    print(f"{shape['modules']} modules, {shape['arrows']} import arrows, {shape['floors']} floors, "
          f"{len(shape['loops'])} loop(s)")
    for loop in shape["loops"]:
        print("  loop: " + ", ".join(loop))
    if src != SRC:
        sys.exit(0)
    problems = climbs()
    print("\n".join(problems) or "no import climbs")
    sys.exit(1 if problems else 0)
