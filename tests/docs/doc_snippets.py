"""The code blocks of README.md and docs/*.md, and how each kind is checked.

A ```python block runs after the python blocks above it in the same file (a page's examples
build on each other), in a fresh interpreter. An HTML comment on the line before a block
marks it: ``<!-- snippet: vllm -->`` (needs real vLLM: run by tests/vllm in the vLLM
environments) or ``<!-- snippet: skip, REASON -->`` (cannot run in a test, e.g. needs a GPU;
the reason is required). Shell blocks (```sh, ```bash, ```console) are not run: their
``elastickv`` command lines must parse, their ``make`` targets and ``benchmarks/`` scripts
must exist.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
SHELL_LANGUAGES = frozenset({"sh", "bash", "console"})
_FENCE = re.compile(r"^```(\S*)\s*$")
_MARKER = re.compile(r"^<!--\s*snippet:\s*(?P<kind>[a-z]+)\s*(?:,\s*(?P<reason>.*?))?\s*-->$")
_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
_OPERATORS = frozenset({"|", "||", "&&", ";", "&", "(", ")"})


@dataclass(frozen=True)
class Snippet:
    path: Path
    line: int  # 1-based line of the opening fence
    language: str
    text: str
    marker: str | None = None  # "vllm", "skip", or an unknown word (an error)
    reason: str = ""

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(REPO)}:{self.line}"


def snippets(path: Path) -> list[Snippet]:
    """Every fenced block of ``path``, with the marker comment on the line before it."""
    found: list[Snippet] = []
    lines = path.read_text().splitlines()
    index = 0
    while index < len(lines):
        fence = _FENCE.match(lines[index])
        if fence is None:
            index += 1
            continue
        end = next(i for i in range(index + 1, len(lines)) if lines[i].startswith("```"))
        before = lines[index - 1].strip() if index else ""
        marker = _MARKER.match(before)
        found.append(
            Snippet(
                path=path,
                line=index + 1,
                language=fence.group(1),
                text="\n".join(lines[index + 1 : end]) + "\n",
                marker=marker.group("kind") if marker else None,
                reason=(marker.group("reason") or "") if marker else "",
            )
        )
        index = end + 1
    return found


def all_snippets() -> list[Snippet]:
    return [snippet for path in DOCS for snippet in snippets(path)]


def python_snippets(marker: str | None) -> list[Snippet]:
    return [s for s in all_snippets() if s.language == "python" and s.marker == marker]


# Runs blocks in order in one namespace, each compiled under its markdown file and line, so a
# traceback points into the page.
_RUNNER = """
import json, sys
namespace = {"__name__": "__main__"}
for path, line, text in json.loads(sys.argv[1]):
    exec(compile("\\n" * line + text, path, "exec"), namespace)
"""


def run_python(snippet: Snippet, workdir: Path) -> subprocess.CompletedProcess[str]:
    """``snippet`` after the unmarked and same-marked python blocks above it in its file, in
    a fresh interpreter, in ``workdir``, with a ledger directory of its own."""
    blocks = [
        s
        for s in snippets(snippet.path)
        if s.language == "python" and s.line <= snippet.line and s.marker in (None, snippet.marker)
    ]
    payload = json.dumps([[str(s.path.relative_to(REPO)), s.line, s.text] for s in blocks])
    env = {
        **os.environ,
        "ELASTICKV_LEDGER_DIR": str(workdir / "ledgers"),
        "ELASTICKV_MODEL_CACHE": str(workdir / "models"),
    }
    env.pop("ELASTICKV_METRICS_PORT", None)
    return subprocess.run(
        [sys.executable, "-c", _RUNNER, payload],
        cwd=workdir,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def command_lines(snippet: Snippet) -> list[tuple[int, str]]:
    """(line, command) of a shell block: continuations joined; in a console block only the
    ``$ `` lines (the rest is output)."""
    commands: list[tuple[int, str]] = []
    pending: list[str] = []
    start = 0
    for offset, raw in enumerate(snippet.text.splitlines(), start=snippet.line + 1):
        line = raw
        if not pending:
            if snippet.language == "console":
                if not line.startswith("$ "):
                    continue
                line = line[2:]
            start = offset
        if line.rstrip().endswith("\\"):
            pending.append(line.rstrip()[:-1])
            continue
        commands.append((start, " ".join([*pending, line]).strip()))
        pending = []
    return [(n, c) for n, c in commands if c and not c.startswith("#")]


def simple_commands(command: str) -> list[list[str]]:
    """``command`` split at pipes and ``&&``/``;``, without leading ``VAR=value`` words."""
    lexer = shlex.shlex(command, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    lexer.commenters = "#"
    parts: list[list[str]] = [[]]
    for token in lexer:
        if token in _OPERATORS:
            parts.append([])
        elif parts[-1] or not _ASSIGNMENT.match(token):
            parts[-1].append(token)
    return [part for part in parts if part]


def make_targets(makefile: Path = REPO / "Makefile") -> set[str]:
    targets: set[str] = set()
    for line in makefile.read_text().splitlines():
        match = re.match(r"^([^\s:=#][^:=]*?)\s*:(?!=)", line)
        if match:
            targets.update(match.group(1).split())
    return targets
