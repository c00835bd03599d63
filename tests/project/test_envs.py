"""fleetllm/envs.py lists every environment variable the package and its kernels read, Python
reads each through envs.get (with the parsing each reader had before), and docs/envs.md's table
is the registry's."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from fleetllm import envs

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "fleetllm"
NAME = re.compile(r"^FLEETLLM_[A-Z0-9_]+$")


def _modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if p != PACKAGE / "envs.py")


def _is_environ(node: ast.AST) -> bool:
    """os.environ or a bare environ."""
    return (isinstance(node, ast.Attribute) and node.attr == "environ") or \
        (isinstance(node, ast.Name) and node.id == "environ")


def _envs_get_names(tree: ast.AST) -> list[str]:
    return [node.args[0].value for node in ast.walk(tree)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr == "get" and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "envs" and node.args
            and isinstance(node.args[0], ast.Constant)]


def _python_reads() -> dict[str, list[str]]:
    """Each name passed to envs.get in the package -> the modules that read it."""
    reads: dict[str, list[str]] = {}
    for path in _modules():
        for name in _envs_get_names(ast.parse(path.read_text())):
            reads.setdefault(name, []).append(str(path.relative_to(REPO)))
    return reads


def _cpp_reads() -> set[str]:
    names = set()
    for path in sorted((REPO / "csrc").iterdir()):
        text = path.read_text()
        literal = re.findall(r'getenv\("(\w+)"\)', text)
        # A name passed through a variable would escape the check: every getenv names its own.
        assert len(literal) == text.count("getenv("), f"{path.name}: getenv of a variable"
        names.update(literal)
    return names


def test_every_environment_variable_is_read_through_envs():
    """No module but envs.py reads a FLEETLLM_ variable from the environment: every full
    FLEETLLM_ name in the package's code is envs.get's argument, and no environ/getenv access
    outside envs.py names one (directly or through a variable holding it)."""
    bad = []
    for path in _modules():
        tree = ast.parse(path.read_text())
        via_envs = {id(node.args[0]) for node in ast.walk(tree)
                    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "get" and isinstance(node.func.value, ast.Name)
                    and node.func.value.id == "envs" and node.args}
        where = path.relative_to(REPO)
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                    and NAME.match(node.value) and id(node) not in via_envs:
                bad.append(f"{where}:{node.lineno}: {node.value!r} not read by envs.get")
            # os.environ.get(...), os.environ[...], os.getenv(...), ... in os.environ
            key = None
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and (
                    (_is_environ(node.func.value) and node.func.attr in ("get", "pop"))
                    or node.func.attr == "getenv") and node.args:
                key = node.args[0]
            elif isinstance(node, ast.Subscript) and _is_environ(node.value):
                key = node.slice
            elif isinstance(node, ast.Compare) and any(_is_environ(c) for c in node.comparators):
                key = node.left
            if key is not None and isinstance(key, ast.Constant) \
                    and str(key.value).startswith("FLEETLLM_"):
                bad.append(f"{where}:{node.lineno}: reads {key.value} from os.environ")
    assert not bad, "\n".join(bad)


def test_every_variable_read_is_listed_and_every_listed_one_is_read():
    python, cpp = _python_reads(), _cpp_reads()
    for name, where in python.items():
        assert envs.spec(name).read_by == "Python", (name, where)
    for name in cpp:
        assert name.startswith("FLEETLLM_") and envs.spec(name).read_by == "C++", name
    listed = {v.name for v in envs.VARIABLES}
    assert listed == set(python) | cpp, "listed in envs.py but read nowhere: " \
        f"{sorted(listed - set(python) - cpp)}"
    assert len(listed) == len(envs.VARIABLES)  # no name twice
    for v in envs.VARIABLES:
        assert v.doc and v.type and v.default and "|" not in v.doc + v.default, v.name
        assert (v.parse is None) == (v.read_by == "C++"), v.name


def test_fleetllm_macros_in_csrc_are_not_variables():
    """FLEETLLM_ROW_OPS, FLEETLLM_AMX, ... are C macros: only getenv'd names count."""
    assert "FLEETLLM_AMX" not in _cpp_reads()
    assert {"FLEETLLM_CPU_AMX", "FLEETLLM_SPIN_US", "FLEETLLM_KERNEL_THREADS"} <= _cpp_reads()


@pytest.mark.parametrize("name,raw,want", [
    # the parsing each reader had before envs.py
    ("FLEETLLM_CPU_KERNELS", None, "1"), ("FLEETLLM_CPU_KERNELS", "require", "require"),
    ("FLEETLLM_CPU_ISA", None, ""), ("FLEETLLM_CPU_ISA", " AVX2 ", "avx2"),
    ("FLEETLLM_LINEAR", None, "auto"), ("FLEETLLM_LINEAR", "dense", "dense"),
    ("FLEETLLM_GEMV_MAX_BYTES", None, None), ("FLEETLLM_GEMV_MAX_BYTES", "0", 0),
    ("FLEETLLM_GEMV_MAX_BYTES", "1.5e9", 1_500_000_000),
    ("FLEETLLM_BATCH_INVARIANT", None, False), ("FLEETLLM_BATCH_INVARIANT", " True", True),
    ("FLEETLLM_BATCH_INVARIANT", "1", True), ("FLEETLLM_BATCH_INVARIANT", "yes", False),
    ("FLEETLLM_HUGE_PAGES", None, True), ("FLEETLLM_HUGE_PAGES", "0", False),
    ("FLEETLLM_HUGE_PAGES", "", True),
    ("FLEETLLM_LORA_ONE_THREAD", None, True), ("FLEETLLM_LORA_ONE_THREAD", "0", False),
    ("FLEETLLM_CUDA_DECODE", None, "auto"), ("FLEETLLM_CUDA_DECODE", "VarLen", "varlen"),
    ("FLEETLLM_NUM_THREADS", None, None), ("FLEETLLM_NUM_THREADS", "", None),
    ("FLEETLLM_NUM_THREADS", "3", 3), ("OMP_NUM_THREADS", "", None),
    ("FLEETLLM_MALLOC_TUNING", None, True), ("FLEETLLM_MALLOC_TUNING", "0", False),
    ("FLEETLLM_KERNEL_WERROR", None, False), ("FLEETLLM_KERNEL_WERROR", "", False),
    ("FLEETLLM_KERNEL_WERROR", "1", True), ("FLEETLLM_KERNEL_SANITIZE", "yes", True),
    ("CXX", None, "c++"), ("CXX", "clang++", "clang++"), ("TORCH_EXTENSIONS_DIR", "", None),
    ("FLEETLLM_API_KEY", None, None), ("FLEETLLM_API_KEY", "k", "k"),
    ("RAY_ADDRESS", "", None), ("FLEETLLM_VLLM_PYTHON", "/x/python", "/x/python"),
    ("FLEETLLM_KEEP_SERVER_LOGS", None, False), ("FLEETLLM_KEEP_SERVER_LOGS", "", True),
    ("FLEETLLM_SPIN_US", "50", "50"),  # C++'s: the raw string
])
def test_values_are_parsed_at_call_time(monkeypatch, name, raw, want):
    if raw is None:
        monkeypatch.delenv(name, raising=False)
    else:
        monkeypatch.setenv(name, raw)
    assert envs.get(name) == want


def test_a_bad_value_or_an_unlisted_name_raises(monkeypatch):
    monkeypatch.setenv("FLEETLLM_NUM_THREADS", "many")
    with pytest.raises(ValueError):
        envs.get("FLEETLLM_NUM_THREADS")
    with pytest.raises(KeyError, match="not listed"):
        envs.get("FLEETLLM_NOT_A_KNOB")


def test_the_docs_table_is_the_registry():
    page = (REPO / "docs" / "envs.md").read_text()
    assert page == envs.with_table(page), \
        "docs/envs.md is stale: run .venv/bin/python -m fleetllm.envs --write docs/envs.md"
    for v in envs.VARIABLES:
        assert f"| `{v.name}` |" in page


def test_every_variable_the_docs_name_exists():
    """A FLEETLLM_ name in the docs or README is listed in envs.py, or is one the test suite
    reads (docs/testing.md's knobs)."""
    test_names = set()
    for path in (REPO / "tests").rglob("*.py"):
        if path.name == "test_envs.py":
            continue
        test_names.update(re.findall(r"\bFLEETLLM_[A-Z0-9_]+", path.read_text()))
    listed = {v.name for v in envs.VARIABLES}
    unknown = []
    for path in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        for name in set(re.findall(r"\bFLEETLLM_[A-Z0-9_]+", path.read_text())):
            if name not in listed and name not in test_names:
                unknown.append(f"{path.name}: {name}")
    assert not unknown, unknown
