"""Imports flow one way: recipes -> meshes -> composer_replication. The core never imports Monarch."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import composer_replication

CORE = Path(composer_replication.__file__).resolve().parent


def _imported_modules(path: Path) -> set[str]:
    """Every module a file imports: ``import``/``from`` statements and ``importlib.import_module("...")`` /
    ``__import__("...")`` calls with a literal name (dynamic imports are imports too)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = node.func
            fname = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if fname in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                names.add(node.args[0].value)
    return names


def _string_literals(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    return [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)]


def test_core_sources_never_import_monarch_meshes_or_recipes():
    offenders = []
    for path in sorted(CORE.rglob("*.py")):
        for name in _imported_modules(path):
            root = name.split(".")[0]
            if root in {"monarch", "meshes", "recipes"}:
                offenders.append(f"{path.relative_to(CORE.parent)} imports {name}")
    assert not offenders, "\n".join(offenders)


def test_core_never_reads_files_of_the_outer_layers():
    """Bundled data is package data (``importlib.resources``): no path into ``recipes/`` or ``meshes/``."""
    offenders = []
    for path in sorted(CORE.rglob("*.py")):
        for text in _string_literals(path):
            if text in ("recipes", "meshes") or text.startswith(("recipes/", "meshes/")):
                offenders.append(f"{path.relative_to(CORE.parent)} names the path {text!r}")
    assert not offenders, "\n".join(offenders)


def test_teacher_replay_never_imports_replaysim():
    """replaysim builds on teacher_replay, never the other way round (the replay CLI is the one entry point
    that may normalize, and it is an entry point, not a library module)."""
    offenders = []
    for path in sorted((CORE / "teacher_replay").rglob("*.py")):
        if path.name == "__main__.py":
            continue
        offenders += [f"{path.name} imports {n}" for n in _imported_modules(path) if "replaysim" in n]
    assert not offenders, "\n".join(offenders)


def test_the_layering_check_sees_dynamic_imports(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text('import importlib\nimportlib.import_module("meshes.trainer")\n__import__("recipes")\n')
    assert {"meshes.trainer", "recipes"} <= _imported_modules(probe)


def test_importing_the_core_loads_no_monarch_module():
    code = (
        "import sys, composer_replication, composer_replication.loss, composer_replication.ingestion, "
        "composer_replication.teacher_replay, composer_replication.engine;"
        "bad=[m for m in sys.modules if m.split('.')[0] in ('monarch','meshes','recipes')];"
        "print(bad); sys.exit(1 if bad else 0)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_spec_reexports_resolve():
    import composer_replication as cr

    assert cr.__version__ == "0.1.0"
    assert isinstance(cr._DILOCO_AVAILABLE, bool)
    for name in cr.__all__:
        assert hasattr(cr, name), name
    assert (cr.make_diloco_outer_loop is None) == (not cr._DILOCO_AVAILABLE)
