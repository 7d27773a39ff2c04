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
