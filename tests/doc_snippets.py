"""The fenced code blocks of README.md and docs/*.md, and how each is to be tested.

The rules (docs/testing.md says them for writers): python and bash blocks run; text blocks are
diagrams or output; any other language, or none, is an error. An HTML comment on the line right
before a block, `<!-- test: DIRECTIVE[; DIRECTIVE ...] -->`, changes how it runs:
  args ARGS      append ARGS to every fleetllm command ({model}: the tiny test checkpoint)
  server         talk to the module's server: its address replaces 127.0.0.1:8000 / localhost:8000
  server embed   the same with a server of the demo model as an embedding model (`e5`)
  server lora    the same with a server of the demo model (`smol`) with LoRA adapters `sql` and
                 `chat` and --allow-runtime-lora-updating
  parse          check fleetllm commands with fleetllm's own parser instead of running them
  skip (REASON)  do not run it; the reason is mandatory and is printed with the skip
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DOC_FILES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]

LANGUAGES = {"python": "python", "py": "python", "bash": "bash", "sh": "bash", "shell": "bash",
             "text": "text"}
DIRECTIVES = {"args", "server", "parse", "skip"}
# The address a server example is written with, and what the test puts in its place.
SERVER_ADDRESSES = ("http://127.0.0.1:8000", "127.0.0.1:8000", "localhost:8000")
FLEETLLM = ("fleetllm", ".venv/bin/fleetllm")

_FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([\w+-]*)\s*$")
_MARKER = re.compile(r"^\s*<!--\s*test:\s*(.*?)\s*-->\s*$")


@dataclass(frozen=True)
class Block:
    file: str  # relative to the repository
    line: int  # of the opening fence, 1-based
    lang: str  # as written after the fence ("" if none)
    code: str
    directives: dict[str, str] = field(default_factory=dict, compare=False, hash=False)
    marker_error: str = ""

    @property
    def id(self) -> str:
        return f"{self.file}:{self.line}"

    @property
    def kind(self) -> str | None:
        """python, bash or text; None for a language the tests do not know."""
        return LANGUAGES.get(self.lang)


def parse_marker(text: str) -> tuple[dict[str, str], str]:
    """The directives of a marker's text, and an error message ("" when it is valid)."""
    directives: dict[str, str] = {}
    # `skip (REASON)` comes last and takes the rest, so that a reason may hold any text.
    if m := re.search(r"(?:^|;)\s*skip\b(.*)$", text):
        text, directives["skip"] = text[:m.start()], m.group(1).strip()
    for part in filter(None, (p.strip() for p in text.split(";"))):
        name, _, value = part.partition(" ")
        if name not in DIRECTIVES:
            return directives, f"unknown directive {name!r} (known: {sorted(DIRECTIVES)})"
        directives[name] = value.strip()
    skip = directives.get("skip")
    if skip is not None and not re.fullmatch(r"\(.+\)", skip):
        return directives, "`skip` needs its reason in parentheses: skip (why it cannot run)"
    if "parse" in directives and "args" in directives:
        return directives, "`parse` does not run the commands: `args` would change nothing"
    return directives, ""


def read_blocks(path: Path) -> list[Block]:
    lines = path.read_text().splitlines()
    blocks = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, lang = m.groups()
        end = i + 1
        while end < len(lines) and lines[end].strip() != fence[0] * len(fence):
            end += 1
        code = "\n".join(line[len(indent):] if line.startswith(indent) else line
                         for line in lines[i + 1:end])
        directives, error = {}, ""
        if i > 0 and (marker := _MARKER.match(lines[i - 1])):
            directives, error = parse_marker(marker.group(1))
        blocks.append(Block(str(path.relative_to(REPO)), i + 1, lang, code + "\n", directives,
                            error))
        i = end + 1
    return blocks


def all_blocks() -> list[Block]:
    return [b for path in DOC_FILES for b in read_blocks(path)]


def shell_commands(code: str) -> list[list[str]]:
    """The commands of a bash block, one argv each: continuation lines joined, comments and
    blank lines dropped."""
    joined = re.sub(r"\\\n", " ", code)
    return [argv for line in joined.splitlines() if (argv := shlex.split(line, comments=True))]


def fleetllm_args(argv: list[str]) -> list[str] | None:
    """The arguments of a fleetllm command (None if it is not one). `unshare -n sh -c '... &&
    fleetllm ...'` counts: the suite already runs in such a namespace (see the Makefile)."""
    if argv and argv[0] in FLEETLLM:
        return argv[1:]
    if argv[:4] == ["unshare", "-n", "sh", "-c"] and len(argv) == 5:
        for part in argv[4].split("&&"):
            if (inner := fleetllm_args(shlex.split(part))) is not None:
                return inner
    return None


def with_server(code: str, url: str) -> str:
    """The block with the test server's address (http://127.0.0.1:PORT) in place of the one it
    was written with."""
    host_port = url.removeprefix("http://")
    return (code.replace(SERVER_ADDRESSES[0], url).replace(SERVER_ADDRESSES[1], host_port)
            .replace(SERVER_ADDRESSES[2], host_port))


def slugify(heading: str) -> str:
    """A heading's anchor as mkdocs (Python-Markdown's toc) makes it, for the README's links."""
    text = re.sub(r"[`*]", "", heading).strip().lower()
    text = re.sub(r"[^\w\s-]", "", text)
    return re.sub(r"[-\s]+", "-", text).strip("-")


def anchors(path: Path) -> set[str]:
    headings, fenced = [], False
    for line in path.read_text().splitlines():
        if _FENCE.match(line):
            fenced = not fenced
        elif not fenced and (m := re.match(r"#{1,6}\s+(.*)", line)):
            headings.append(m.group(1))
    return {slugify(h) for h in headings}
