"""The code blocks of README.md and docs/*.md, and how each kind is checked.

A ```python block runs after the python blocks above it in the same file (a page's examples
build on each other), in a fresh interpreter. An HTML comment on the line before a block
marks it: ``<!-- snippet: vllm -->`` (needs real vLLM: run by tests/vllm in the vLLM
environments) or ``<!-- snippet: skip, REASON -->`` (cannot run in a test, e.g. needs a GPU;
the reason is required). In every shell block (```sh, ```bash, ```console) the ``elastickv``
command lines must parse, the ``make`` targets and ``benchmarks/`` scripts must exist.

The shell blocks of the pages in ``RUN_PAGES`` also run, command by command, in order, as a
user types them (:class:`ShellSession`): a server (``elastickv serve``, vLLM's OpenAI server,
``elastickv top``) runs in the background until the page ends, then gets Ctrl-C.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from elastickv.ports import free_port

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
SHELL_LANGUAGES = frozenset({"sh", "bash", "console"})
# Pages whose shell blocks are run, not only checked.
RUN_PAGES = (REPO / "docs" / "serve.md", REPO / "docs" / "vllm.md")
# The ports the pages name (serve's and vLLM's defaults): a session moves each to a free one.
DOC_PORTS = (8080, 8000)
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


# -- running shell blocks ---------------------------------------------------------------------


def page_commands(path: Path, marker: str | None) -> list[tuple[str, str]]:
    """(``file:line``, command) of ``path``'s ```sh / ```bash blocks marked ``marker``, in
    page order; ``make`` lines left out (the suite runs inside what they build: their
    targets are checked to exist)."""
    found = []
    for snippet in snippets(path):
        if snippet.language not in ("sh", "bash") or snippet.marker != marker:
            continue
        for line, command in command_lines(snippet):
            words = simple_commands(command)
            if words and Path(words[0][0]).name == "make":
                continue
            found.append((f"{path.relative_to(REPO)}:{line}", command))
    return found


_COMMENT = re.compile(r"\s+#[^'\"]*$")


@dataclass
class Background:
    """A long-running command of a page (a server, ``top``), with its output file."""

    where: str
    command: str
    kind: str  # "serve", "vllm" or "top"
    proc: subprocess.Popen[bytes]
    output: Path
    port: int | None

    def text(self) -> str:
        return self.output.read_text(errors="replace")

    def errors(self) -> str:
        """Its error lines (vLLM's root cause is far above the end), then its last lines."""
        lines = self.text().splitlines()
        found = [line for line in lines if re.search(r"Error\b|error:", line)]
        return "\n".join([*found[-20:], "...", *lines[-20:]])


@dataclass
class ShellSession:
    """Runs a page's commands as a user would, one shell command at a time in the
    repository's root, with a ledger directory and a temporary directory of its own, and
    ``bin`` (the environment's scripts: ``python``, ``elastickv``) first on ``PATH``. The
    documented ports move to free ones (a server command that names none gets ``--port``).
    A server runs in the background (``start_new_session``) until :meth:`close`, which
    sends it Ctrl-C and checks that it ended well and left no ledger record."""

    workdir: Path
    bin: Path
    timeout: float = 600.0
    ports: dict[int, int] = field(default_factory=dict)
    background: list[Background] = field(default_factory=list)
    ended: list[Background] = field(default_factory=list)  # stopped by close()
    log: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        # Below the ephemeral range: a server binds its port tens of seconds after the pick,
        # and an ephemeral one may be taken meanwhile by any connection on the host.
        self.ports = {port: free_port() for port in DOC_PORTS}
        self.temp = Path(tempfile.mkdtemp(prefix="ekv-doc-"))  # short: socket paths in it
        self.env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("ELASTICKV")},
            "PATH": f"{self.bin}{os.pathsep}{os.environ.get('PATH', '')}",
            "ELASTICKV_LEDGER_DIR": str(self.workdir / "ledger"),
            "TMPDIR": str(self.temp),
            "HF_HUB_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            "PYTHONUNBUFFERED": "1",
        }

    def rewrite(self, command: str) -> str:
        """``command`` on this session's ports."""
        for documented, port in self.ports.items():
            command = re.sub(rf"\b{documented}\b", str(port), command)
        server = self._server_port(command)
        if server is not None and not re.search(r"--port\b", command):
            body = _COMMENT.sub("", command)
            command = f"{body} --port {server}"
        return command

    @staticmethod
    def _kind(command: str) -> str | None:
        """``serve``, ``vllm`` (its OpenAI server) or ``top``: what runs until stopped."""
        words = [w for part in simple_commands(command) for w in part]
        elastickv = bool(words) and Path(words[0]).name == "elastickv"
        if elastickv and "serve" in words and "--check" not in words:
            return "serve"
        if elastickv and "top" in words and "--once" not in words:
            return "top"
        return "vllm" if "vllm.entrypoints.openai.api_server" in words else None

    def _server_port(self, command: str) -> int | None:
        """The port a server started by ``command`` listens on when it names none."""
        kind = self._kind(command)
        if kind == "serve" and "--config" not in command:
            return self.ports[8080]
        return self.ports[8000] if kind == "vllm" else None

    def _long_running(self, command: str) -> bool:
        return self._kind(command) is not None

    def run(self, where: str, command: str) -> None:
        """Run one documented command (AssertionError with its output if it fails)."""
        command = self.rewrite(command)
        self.log.append(f"$ {command}")
        if self._long_running(command):
            self._start(where, command)
            return
        result = subprocess.run(
            ["bash", "-c", command], cwd=REPO, env=self.env, capture_output=True, text=True,
            timeout=self.timeout, check=False,
        )  # fmt: skip
        self.log.append(result.stdout + result.stderr)
        assert result.returncode == 0, (
            f"{where}: `{command}` exited with {result.returncode}:\n{result.stdout[-3000:]}"
            f"\n{result.stderr[-3000:]}"
        )

    def _start(self, where: str, command: str) -> None:
        output = self.workdir / f"background-{len(self.background)}.log"
        with output.open("wb") as sink:
            proc = subprocess.Popen(
                ["bash", "-c", command], cwd=REPO, env=self.env, stdout=sink,
                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
            )  # fmt: skip
        match = re.search(r"--port[ =](\d+)", command)
        kind = self._kind(command) or ""
        port = int(match.group(1)) if match and kind != "top" else None
        job = Background(where, command, kind, proc, output, port)
        self.background.append(job)
        deadline = time.monotonic() + self.timeout
        while not self._ready(job):
            assert proc.poll() is None, f"{where}: `{command}` exited:\n{job.errors()}"
            assert time.monotonic() < deadline, f"{where}: `{command}` never became ready"
            time.sleep(0.5)

    @staticmethod
    def _ready(job: Background) -> bool:
        if job.port is None:  # top: its first frame
            return job.output.stat().st_size > 0
        url = f"http://127.0.0.1:{job.port}/health"
        with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=5) as answer:
            return bool(answer.status == 200)
        return False

    def close(self) -> list[str]:
        """Ctrl-C to every background command, last started first; the problems found:
        one that did not exit with 0, ledger records left."""
        problems = []
        for job in reversed(self.background):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(job.proc.pid, signal.SIGINT)
            try:
                code = job.proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                os.killpg(job.proc.pid, signal.SIGKILL)
                code = job.proc.wait()
            # Its other processes (a vLLM engine core) may still be exiting, holding their
            # ledger record until they are gone: the records are read once none is left.
            running = _session_left(job.proc.pid)
            self.log.append(f"[{job.where}] {job.command}\n{job.text()}")
            self.ended.append(job)
            if code != 0:
                problems.append(f"{job.where}: `{job.command}` ended with {code} after Ctrl-C")
            if running:
                problems.append(f"{job.where}: `{job.command}` left processes running: {running}")
        self.background.clear()
        listing = subprocess.run(
            [str(self.bin / "elastickv"), "list", "--json"], env=self.env, capture_output=True,
            text=True, timeout=120, check=False,
        )  # fmt: skip
        left = json.loads(listing.stdout).get("instances", []) if listing.returncode == 0 else []
        problems += [f"ledger record left: {i['name']} (pid {i['pid']})" for i in left]
        shutil.rmtree(self.temp, ignore_errors=True)
        return problems


# Only against a hang: how long a stopped command's other processes may take to exit.
SESSION_END_S = 120.0


def _session_left(sid: int) -> list[int]:
    """The processes of session ``sid`` still running once they had ``SESSION_END_S`` to
    exit (none, normally: they end within seconds of the command itself)."""
    from elastickv.serve.engine import session_processes

    deadline = time.monotonic() + SESSION_END_S
    while (left := [p.pid for p in session_processes(sid)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def run_page(path: Path, marker: str | None, workdir: Path, bin_dir: Path) -> ShellSession:
    """Run ``path``'s ``marker`` shell blocks in one session; fails with the first command
    that fails, or with what the servers left when stopped."""
    session = ShellSession(workdir, bin_dir)
    try:
        for where, command in page_commands(path, marker):
            session.run(where, command)
    finally:
        problems = session.close()
    assert not problems, "\n".join(problems) + "\n" + "\n".join(session.log)[-6000:]
    return session
