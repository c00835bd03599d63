"""Every code snippet of README.md and docs/*.md runs (the rules: doc_snippets.py and
docs/testing.md). One test per block, named FILE:LINE, so a broken example names itself.

python blocks run in a fresh interpreter with `path` bound to a tiny random-weight checkpoint;
bash blocks run their fleetllm commands as `python -m fleetllm.cli ...` (and curl as it is).
Blocks marked `server` talk to one `fleetllm serve` of the demo model on 127.0.0.1, started
for the module when the first of them runs; `server embed` blocks to another, of the demo model
as an embedding model; `server lora` blocks to one with LoRA adapters.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from doc_snippets import (
    _FENCE,
    _MARKER,
    DOC_FILES,
    REPO,
    SERVER_ADDRESSES,
    Block,
    all_blocks,
    anchors,
    fleetllm_args,
    shell_commands,
    with_server,
)
from serving_helpers import CHAT_TEMPLATE, KV, server_env, serving

BLOCKS = all_blocks()
TIMEOUT = 240  # one snippet; the first Ray start on a busy 2-core machine is the slowest
MAX_SKIPS = 5  # skips are for what cannot run in a test at all; keep them rare


@pytest.fixture(scope="module")
def model(tiny_models) -> Path:
    return tiny_models["llama_gqa"]  # GQA, 2 layers: TP=2 and PP=2 both fit


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The server the `server` blocks talk to: the demo model, under the names the examples
    use, with a small chat template (the demo model's tokenizer has none)."""
    from fleetllm.entrypoints.openai.local_server import LocalServer

    template = tmp_path_factory.mktemp("docs-server") / "chat.jinja"
    template.write_text(CHAT_TEMPLATE)
    srv = LocalServer(["--served-model-name", "demo", "smol", "--chat-template", str(template),
                       "--kv-cache-memory", str(KV), "--enable-auto-tool-choice",
                       "--tool-call-parser", "hermes"], env=server_env())
    with serving(srv):
        yield srv


@pytest.fixture(scope="module")
def embed_server():
    """The server the `server embed` blocks talk to: the demo model as an embedding model,
    served as `e5`."""
    from fleetllm.entrypoints.openai.local_server import LocalServer

    srv = LocalServer(["--task", "embed", "--served-model-name", "e5", "--kv-cache-memory",
                       str(KV)], env=server_env())
    with serving(srv):
        yield srv


@pytest.fixture(scope="module")
def lora_server(tmp_path_factory):
    """The server the `server lora` blocks talk to: the demo model as `smol` with two random
    adapters, `sql` and `chat`, and runtime loading on."""
    from fleetllm.benchmarks.lora import make_adapters
    from fleetllm.entrypoints.openai.local_server import LocalServer

    root = tmp_path_factory.mktemp("docs-lora")
    (root / "chat.jinja").write_text(CHAT_TEMPLATE)
    sql, chat = make_adapters(REPO / "fleetllm" / "demo_model", root, 2, rank=8)
    srv = LocalServer(["--served-model-name", "smol", "--chat-template", str(root / "chat.jinja"),
                       "--kv-cache-memory", str(KV), "--enable-lora", "--max-loras", "2",
                       "--lora-modules", f"sql={sql}", f"chat={chat}",
                       "--allow-runtime-lora-updating"], env=server_env())
    with serving(srv):
        yield srv


def _run(cmd: list[str], cwd: Path, what: str) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=cwd, env=server_env(), capture_output=True, text=True,
                          timeout=TIMEOUT, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, (f"{what} exited {proc.returncode}\n--- stdout\n"
                                  f"{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-5000:]}")
    return proc


def run_python(block: Block, code: str, model: Path, cwd: Path) -> None:
    # A file named after the block, so that a traceback points at the doc (its line + 1).
    script = cwd / (re.sub(r"\W", "_", block.id) + ".py")
    script.write_text(f"path = {str(model)!r}  # bound by tests/project/test_docs.py\n{code}")
    _run([sys.executable, str(script)], cwd, block.id)


def run_bash(block: Block, code: str, model: Path, cwd: Path) -> None:
    extra = shlex.split(block.directives.get("args", "").replace("{model}", str(model)))
    commands = shell_commands(code)
    assert commands, f"{block.id}: no command in a bash block"
    for argv in commands:
        args = fleetllm_args(argv)
        if args is not None:
            _run([sys.executable, "-m", "fleetllm.cli", *args, *extra], cwd, shlex.join(argv))
        elif argv[0] == "curl":
            if shutil.which("curl") is None:
                pytest.skip("curl is not installed")
            # --fail-with-body: an HTTP error fails the command (curl -s alone exits 0).
            out = _run([*argv, "--fail-with-body"], cwd, shlex.join(argv)).stdout
            assert out.strip(), f"{shlex.join(argv)} printed nothing"
        else:
            pytest.fail(f"{block.id}: `{shlex.join(argv)}` is neither a fleetllm command nor "
                        "curl: make it one, or mark the block (docs/testing.md)")


def parse_fleetllm(args: list[str]) -> None:
    """What `fleetllm ARGS` would do up to running: its parser takes every flag and value."""
    from fleetllm.benchmarks import serve as bench_serve
    from fleetllm.cli import build_parser

    def parse(parser, argv: list[str], known_only: bool = False):
        try:
            return parser.parse_known_args(argv) if known_only else (parser.parse_args(argv),)
        except SystemExit as e:  # argparse reports on stderr and exits 2; --help/--version 0
            if e.code:
                pytest.fail(f"fleetllm {shlex.join(args)}: the parser refused it")
            return None

    if args[:2] == ["bench", "serve"]:  # its own flags, then the server's (see its main())
        parsed = parse(bench_serve.build_parser(), args[2:], known_only=True)
        if parsed is not None:
            own, rest = parsed
            if own.base_url is not None:
                assert not rest, f"bench serve --base-url does not take {rest}"
            else:
                parse(build_parser(), ["serve", *rest])
        return
    parse(build_parser(), args)


@pytest.mark.parametrize("block", BLOCKS, ids=[b.id for b in BLOCKS])
def test_snippet(block: Block, request, tmp_path):
    assert not block.marker_error, f"{block.id}: {block.marker_error}"
    assert block.kind is not None, (
        f"{block.id}: a ```{block.lang or '(no language)'} block: label it python, bash, or "
        "text (not run)")
    if "skip" in block.directives:
        pytest.skip(f"{block.id}: {block.directives['skip'][1:-1]}")
    if block.kind == "text":
        return
    if "parse" in block.directives:
        assert block.kind == "bash", f"{block.id}: `parse` is for bash blocks"
        for argv in shell_commands(block.code):
            args = fleetllm_args(argv)
            assert args is not None, f"{block.id}: `{shlex.join(argv)}` is not a fleetllm command"
            parse_fleetllm(args)
        return
    code = block.code
    if "server" in block.directives:
        assert any(a in code for a in SERVER_ADDRESSES), \
            f"{block.id}: marked `server` but names no {SERVER_ADDRESSES[1:]}"
        which = block.directives["server"]
        fixtures = {"": "server", "embed": "embed_server", "lora": "lora_server"}
        assert which in fixtures, f"{block.id}: `server {which}`: only `server embed` or " \
            "`server lora`"
        fixture = fixtures[which]
        code = with_server(code, request.getfixturevalue(fixture).url)
    model = request.getfixturevalue("model")
    if block.kind == "python":
        run_python(block, code, model, tmp_path)
    else:
        run_bash(block, code, model, tmp_path)


def test_the_docs_have_snippets_and_skips_stay_rare():
    files = {b.file for b in BLOCKS}
    assert "README.md" in files and len(files) >= 6, files
    kinds = {b.kind for b in BLOCKS}
    assert {"python", "bash"} <= kinds
    skips = [b.id for b in BLOCKS if "skip" in b.directives]
    assert len(skips) <= MAX_SKIPS, f"{len(skips)} skipped snippets: {skips}"


def test_every_marker_sits_right_before_a_block():
    """A `<!-- test: ... -->` line governs the block that opens on the next line; anywhere else
    it governs nothing, and the block it was meant for runs in full (a marker written after a
    benchmark once let a minutes-long run into the suite)."""
    for path in DOC_FILES:
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            if _MARKER.match(line):
                nxt = lines[i + 1] if i + 1 < len(lines) else ""
                assert _FENCE.match(nxt), (f"{path.relative_to(REPO)}:{i + 1}: a test marker "
                                           "must sit on the line right before a code block")


def test_readme_links_resolve():
    """README.md is not part of the mkdocs site (whose build checks the docs' links): its
    relative links and their anchors are checked here."""
    text = (REPO / "README.md").read_text()
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    assert links
    for link in links:
        if re.match(r"[a-z]+://", link):
            continue
        target, _, anchor = link.partition("#")
        path = REPO / target
        assert path.exists(), f"README.md links to {target}, which does not exist"
        if anchor:
            assert anchor in anchors(path), f"README.md: {target} has no heading #{anchor}"


def test_every_doc_page_is_in_the_site():
    nav = (REPO / "mkdocs.yml").read_text()
    for path in DOC_FILES[1:]:
        assert re.search(rf":\s*{re.escape(path.name)}\s*$", nav, re.M), \
            f"docs/{path.name} is not in mkdocs.yml's nav"


def test_the_test_paths_the_repository_names_exist():
    """A test file or folder named in the docs, the Makefile, pyproject.toml, tools/, .ci/ or a
    test (`tests/engine/test_engine.py`, `tests/kernels`) exists: the tests moved into folders
    once, and a stale path in prose is easy to miss. (fleetllm/ and csrc/ comments are not
    read: their owners keep them.)"""
    files = [REPO / "README.md", REPO / "Makefile", REPO / "pyproject.toml", *DOC_FILES[1:],
             *(REPO / "tools").iterdir(), *(REPO / ".ci").iterdir(),
             *(REPO / "tests").rglob("*.py"), *(REPO / "tests" / "csrc").iterdir()]
    missing = []
    for path in files:
        if path.is_file():
            text = path.read_text(errors="replace")
            missing += [f"{path.relative_to(REPO)}: {name}"
                        for name in set(re.findall(r"\btests/[\w/]*\w(?:\.\w+)?", text))
                        if not (REPO / name).exists()]
    assert not missing, missing
