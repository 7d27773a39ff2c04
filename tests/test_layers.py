"""The floors of the house: ``volunteer_cli -> tui -> volunteer -> swarm``, never back up.

A static scan of every import statement (also the ones inside functions), so a lazy import that
runs only on one code path cannot hide an upward dependency."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# package -> the packages of this project it must never import
FORBIDDEN = {
    "swarm": ("volunteer", "tui", "volunteer_cli"),
    "volunteer": ("tui", "volunteer_cli"),
    "tui": ("volunteer_cli",),
}


def _imported_packages(path: Path) -> set[tuple[str, int]]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update((alias.name.split(".")[0], node.lineno) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add((node.module.split(".")[0], node.lineno))
    return found


def test_no_module_imports_a_floor_above_its_own():
    upward = []
    for package, forbidden in FORBIDDEN.items():
        files = sorted((ROOT / package).rglob("*.py"))
        assert files, f"no modules found under {package}/"
        for path in files:
            upward += [f"{path.relative_to(ROOT)}:{line} imports {name}"
                       for name, line in _imported_packages(path) if name in forbidden]
    assert upward == [], "imports that run back up a floor:\n" + "\n".join(sorted(upward))


def test_the_scan_sees_lazy_imports(tmp_path):
    module = tmp_path / "lazy.py"
    module.write_text("def f():\n    from tui.app import run_dashboard\n    import volunteer_cli.main\n")
    assert {name for name, _ in _imported_packages(module)} == {"tui", "volunteer_cli"}


PACKAGES = ("swarm", "volunteer", "volunteer_cli", "tui", "benchmarks")


def _module_graph() -> dict[str, set[str]]:
    """module -> the modules of this project it imports, lazily or not; imports under ``if TYPE_CHECKING:`` never run
    and are left out (a type-only reference is no circle)."""
    modules = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
            modules[name] = path

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and
                       "TYPE_CHECKING" in ast.unparse(node.test) for part in node.body for n in ast.walk(part)}
        deps = set()
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            if isinstance(node, ast.Import):
                deps.update(resolve(alias.name) for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                deps.update(resolve(f"{node.module}.{alias.name}") or resolve(node.module) for alias in node.names)
        # a package's __init__ and its own modules are one unit
        graph[name] = {d for d in deps if d and d != name and not d.startswith(name + ".")
                       and not name.startswith(d + ".")}
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on_stack, stack, out, counter = {}, {}, set(), [], [], [0]
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter[0]
                    counter[0] += 1
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
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


def test_no_import_circle():
    """issue 41, item 6: no two modules import each other, directly or around a loop, even lazily (driver <->
    driver_eval, run/data <-> run/tokens, benchmarks/pipeline <-> pipeline_configs and the stage RPC's client <->
    server were; a lazy import hid each one)."""
    graph = _module_graph()
    # the scan sees what it must: a lazy import inside a function, and not a type-only one
    assert "swarm.run.tokens" in graph["swarm.run.data"]
    assert "volunteer.node.core" not in graph["volunteer.node.governors"]
    assert _circles(graph) == []


def test_the_circle_scan_finds_a_lazy_loop():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _circles(graph) == [["a", "b", "c"]]


# swarm/pipeline by plane (issue 41, item 6): plane -> the planes (and the wiring modules above them) it must not import
PLANES = {
    "swarm.pipeline.transport": ("swarm.pipeline.stage", "swarm.pipeline.control", "swarm.pipeline.peer"),
    "swarm.pipeline.stage": ("swarm.pipeline.control", "swarm.pipeline.peer"),
    "swarm.pipeline.control": ("swarm.pipeline.peer",),
}


def test_the_pipeline_planes_import_only_downwards():
    """transport <- stage <- control <- peer (the wiring): a stage never depends on the driver, the transport on
    neither; lazy imports count (``_module_graph`` sees them)."""
    graph = _module_graph()
    assert any(name.startswith("swarm.pipeline.stage.") for name in graph), "the planes are not laid out"
    upward = sorted(f"{name} imports {dep}" for name, deps in graph.items() for plane, forbidden in PLANES.items()
                    if name.startswith(plane + ".") for dep in deps
                    if any(dep == f or dep.startswith(f + ".") or dep.startswith(f + "_") for f in forbidden))
    assert upward == [], "imports against the planes:\n" + "\n".join(upward)
