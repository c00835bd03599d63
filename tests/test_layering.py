"""Layering: workers do not know the executors that drive them (an executor imports the
worker, never the other way round), so a worker can run under any executor."""

from __future__ import annotations

import ast
from pathlib import Path

import fleetllm

PACKAGE = Path(fleetllm.__file__).resolve().parent


def imported_modules(path: Path) -> set[str]:
    """Absolute names of the modules a file imports (relative imports resolved)."""
    package = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts[:-1])
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            names |= {base} | {f"{base}.{a.name}" for a in node.names}
    return names


def test_workers_do_not_import_executors():
    files = sorted((PACKAGE / "worker").glob("**/*.py"))
    assert files
    for path in files:
        bad = {m for m in imported_modules(path)
               if m == "fleetllm.executor" or m.startswith("fleetllm.executor.")}
        assert not bad, f"{path.name} imports {sorted(bad)}"
