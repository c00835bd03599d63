"""Layering, read from the source (the AST of every fleetllm module), not from what a test
happens to import:

- workers do not know the executors that drive them (an executor imports the worker, never the
  other way round), so a worker can run under any executor;
- the package has no import circle: the graph of module imports, top-level and function-level
  ones both, is acyclic but for the few lazy edges listed in ALLOWED_LAZY, each with its reason;
- fleetllm.cli is the console-script entry point on top of everything: no fleetllm module
  imports it (the flags it shares live in fleetllm.engine.arg_utils);
- fleetllm.config is at the bottom: it and its parts (config_*.py) import nothing of fleetllm
  but errors, utils and envs, so every layer can read the configuration.
"""

from __future__ import annotations

import ast
from pathlib import Path

import fleetllm

PACKAGE = Path(fleetllm.__file__).resolve().parent


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.glob("**/*.py"))
           if "demo_model" not in p.parts}

# Lazy (function-level) imports that close a circle, allowed because the circle never runs at
# import time and breaking it would cost more than it buys. Keep this list short: every entry
# must still exist, lazily only (test_allowed_lazy_edges_are_current).
ALLOWED_LAZY = {
    # Executor.get_class resolves "uni" | "mp" | "ray" to the backend class, as vLLM v1's
    # Executor.get_class does; the backends subclass Executor, so they import abstract.py at
    # the top and the base can only name them when called (ray must stay optional too).
    ("fleetllm.executor.abstract", "fleetllm.executor.uniproc"),
    ("fleetllm.executor.abstract", "fleetllm.executor.multiproc"),
    ("fleetllm.executor.abstract", "fleetllm.executor.ray_executor"),
}


def _target(name: str) -> str | None:
    """The fleetllm module an imported dotted name lives in (None: outside the package)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imported_names(node: ast.Import | ast.ImportFrom, module: str, is_package: bool
                    ) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    base = node.module or ""
    if node.level:  # relative: resolved against this module's package
        package = module if is_package else module.rpartition(".")[0]
        if node.level > 1:
            package = package.rsplit(".", node.level - 1)[0]
        base = f"{package}.{base}" if base else package
    # `from pkg import name`: the submodule pkg.name if there is one, else pkg's attribute.
    return [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]


def import_edges(module: str) -> dict[str, bool]:
    """{imported fleetllm module: True if only imported inside functions (lazily)}."""
    path = MODULES[module]
    is_package = path.name == "__init__.py"
    edges: dict[str, bool] = {}

    def visit(node: ast.AST, lazy: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import | ast.ImportFrom):
                for name in _imported_names(child, module, is_package):
                    target = _target(name)
                    if target and target != module:
                        edges[target] = edges.get(target, True) and lazy
            visit(child, lazy or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef
                                            | ast.Lambda))

    tree = ast.parse(path.read_text(), str(path))
    visit(tree, False)
    if module == "fleetllm":  # the package's lazy exports go through importlib: edges too
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign) and any(
                    isinstance(t, ast.Name) and t.id == "_EXPORTS" for t in node.targets):
                for value in node.value.values:
                    edges.setdefault(_target(value.value), True)
    return edges


GRAPH = {m: import_edges(m) for m in MODULES}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle as a path (first == last), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def dfs(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := dfs(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := dfs(node)):
            return found
    return None


def test_the_graph_sees_top_level_and_function_level_imports():
    # Known edges of each kind, so that a broken parser cannot pass the checks below vacuously.
    assert GRAPH["fleetllm.cli"]["fleetllm.engine.arg_utils"] is False
    assert GRAPH["fleetllm.cli"]["fleetllm.benchmarks.throughput"] is True
    assert GRAPH["fleetllm.benchmarks.throughput"]["fleetllm.engine.arg_utils"] is False
    assert GRAPH["fleetllm.executor.abstract"]["fleetllm.executor.health"] is False
    assert GRAPH["fleetllm"]["fleetllm.entrypoints.llm"] is True
    assert sum(map(len, GRAPH.values())) > 200


def test_top_level_imports_have_no_circle():
    top = {m: {t for t, lazy in edges.items() if not lazy} for m, edges in GRAPH.items()}
    cycle = find_cycle(top)
    assert cycle is None, "import circle at import time: " + " -> ".join(cycle or [])


def test_no_import_circle_but_the_allowed_lazy_edges():
    graph = {m: {t for t in edges if (m, t) not in ALLOWED_LAZY} for m, edges in GRAPH.items()}
    cycle = find_cycle(graph)
    assert cycle is None, ("import circle (function-level imports included): "
                           + " -> ".join(cycle or []))


def test_allowed_lazy_edges_are_current():
    for source, target in sorted(ALLOWED_LAZY):
        assert GRAPH[source].get(target) is True, (
            f"{source} -> {target} is no longer a lazy-only import: update ALLOWED_LAZY")


def test_no_module_imports_the_cli():
    importers = sorted(m for m, edges in GRAPH.items() if "fleetllm.cli" in edges)
    assert importers == [], f"{importers} import fleetllm.cli: use fleetllm.engine.arg_utils"


def test_workers_do_not_import_executors():
    workers = [m for m in MODULES if m.startswith("fleetllm.worker.")]
    assert workers
    for module in workers:
        bad = {t for t in GRAPH[module]
               if t == "fleetllm.executor" or t.startswith("fleetllm.executor.")}
        assert not bad, f"{module} imports {sorted(bad)}"


CONFIG_LAYER = {"fleetllm.errors", "fleetllm.utils", "fleetllm.envs"} | {
    m for m in MODULES if m == "fleetllm.config" or m.startswith("fleetllm.config_")}


def test_config_imports_nothing_above_it():
    """Everything importing fleetllm.config runs (parent packages included, lazy imports too)
    stays within the configuration and the errors/utils/envs it builds on."""
    assert {"fleetllm.config_lora", "fleetllm.config_pooler",
            "fleetllm.config_speculative"} <= CONFIG_LAYER
    seen, todo = set(), ["fleetllm.config"]
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        parents = [module.rsplit(".", i)[0] for i in range(1, module.count("."))]
        todo += [*GRAPH[module], *(p for p in parents if p in MODULES)]
    assert seen <= CONFIG_LAYER, f"fleetllm.config reaches {sorted(seen - CONFIG_LAYER)}"
