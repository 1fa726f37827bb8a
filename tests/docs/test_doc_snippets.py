"""Every snippet in README.md and docs/ works: python blocks run, shell blocks name commands
that exist (``elastickv`` command lines parse, ``make`` targets and ``benchmarks/`` scripts
exist), and the commands of the pages in ``RUN_PAGES`` run as written (those marked
``vllm`` in tests/vllm). Each case is named by its file and line. See doc_snippets.py for the
markers."""

from __future__ import annotations

import contextlib
import io
import re
import sys
from pathlib import Path

import pytest
from doc_snippets import (
    REPO,
    RUN_PAGES,
    SHELL_LANGUAGES,
    Snippet,
    all_snippets,
    command_lines,
    make_targets,
    page_commands,
    python_snippets,
    run_page,
    run_python,
    simple_commands,
    snippets,
)

from elastickv.cli.main import parse_args

SNIPPETS = all_snippets()
RUNNABLE = python_snippets(None)
SHELL = [s for s in SNIPPETS if s.language in SHELL_LANGUAGES]
MARKERS = ("vllm", "skip")


def unpublished(word: str) -> bool:
    return re.fullmatch(r"elastickv(\[[\w,]+\])?", word) is not None


def ids(snippets: list[Snippet]) -> list[str]:
    return [s.id for s in snippets]


def test_the_docs_have_snippets_of_every_kind() -> None:
    assert len(RUNNABLE) >= 4 and len(SHELL) >= 8
    assert {s.path.name for s in RUNNABLE} >= {"README.md", "control.md"}


def test_every_marker_is_known_and_every_skip_has_a_reason() -> None:
    marked = [s for s in SNIPPETS if s.marker is not None]
    unknown = [s.id for s in marked if s.marker not in MARKERS]
    assert not unknown, f"unknown snippet markers (use one of {MARKERS}): {unknown}"
    no_reason = [s.id for s in marked if s.marker == "skip" and not s.reason]
    assert not no_reason, f"<!-- snippet: skip, REASON --> needs a reason: {no_reason}"
    runnable = {"python", "sh", "bash"}
    assert all(s.language in runnable for s in marked), f"markers apply to {sorted(runnable)}"
    counts = {kind: sum(s.marker == kind for s in marked) for kind in MARKERS}
    print(f"doc snippets: {len(RUNNABLE)} run here, {counts['vllm']} in tests/vllm, "
          f"{counts['skip']} skipped")  # fmt: skip


@pytest.mark.parametrize("snippet", RUNNABLE, ids=ids(RUNNABLE))
def test_python_snippet_runs(snippet: Snippet, tmp_path: Path) -> None:
    result = run_python(snippet, tmp_path)
    assert result.returncode == 0, f"{snippet.id} failed:\n{result.stderr[-4000:]}"


@pytest.mark.parametrize("snippet", SHELL, ids=ids(SHELL))
def test_shell_snippet_names_what_exists(snippet: Snippet) -> None:
    targets = make_targets()
    problems: list[str] = []
    for line, command in command_lines(snippet):
        for words in simple_commands(command):
            where = f"{snippet.path.relative_to(REPO)}:{line}: {command}"
            program = Path(words[0]).name
            if program == "elastickv":
                problems += [f"{where}: {e}" for e in _parse_errors(words[1:])]
            elif program == "make":
                problems += [
                    f"{where}: no make target {t!r}" for t in words[1:] if t not in targets
                ]
            elif "pip" in (program, *words[1:3]) and "install" in words:
                # elastickv is not on PyPI: install it from a clone or a built wheel.
                problems += [f"{where}: {w} is not published" for w in words if unpublished(w)]
            scripts = [w for w in words if w.startswith("benchmarks/") and w.endswith(".py")]
            problems += [f"{where}: no {w}" for w in scripts if not (REPO / w).is_file()]
    assert not problems, "\n".join(problems)


def _parse_errors(argv: list[str]) -> list[str]:
    """What argparse says about ``elastickv ARGV`` (nothing when it parses)."""
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
            parse_args(argv)
    except SystemExit as exit_:
        if exit_.code not in (0, None):
            return [stderr.getvalue().strip().splitlines()[-1]]
    return []


@pytest.mark.parametrize(
    ("argv", "fine"),
    [
        (["list", "--json"], True),
        (["limit", "NAME", "2G", "--revision", "1"], True),
        (["limit", "NAME"], False),
        (["top", "--bogus"], False),
        (["nosuch"], False),
    ],
)
def test_the_checker_tells_good_command_lines_from_bad(argv: list[str], fine: bool) -> None:
    assert (_parse_errors(argv) == []) is fine


def test_command_lines_are_split_like_a_shell() -> None:
    block = Snippet(
        path=REPO / "README.md",
        line=1,
        language="console",
        text="$ A=1 elastickv list | grep x && make demo  # note\noutput\n$ elastickv top \\\n"
        "   --once\n",
    )
    assert command_lines(block) == [
        (2, "A=1 elastickv list | grep x && make demo  # note"),
        (4, "elastickv top     --once"),
    ]
    assert unpublished("elastickv[cuda]") and not unpublished("./elastickv")
    assert simple_commands(command_lines(block)[0][1]) == [
        ["elastickv", "list"], ["grep", "x"], ["make", "demo"],
    ]  # fmt: skip
    assert {"demo", "test", "venv", "vllm-venvs", "clean"} <= make_targets()


def test_every_shell_block_of_the_run_pages_runs_somewhere_or_says_why_not() -> None:
    for page in RUN_PAGES:
        for snippet in snippets(page):
            if snippet.language in SHELL_LANGUAGES:
                # console blocks mix commands with their output: not runnable as written.
                assert snippet.language != "console", f"{snippet.id}: use ```sh"
                assert snippet.marker in (None, "vllm", "skip"), snippet.id
    assert page_commands(REPO / "docs" / "serve.md", None)
    assert page_commands(REPO / "docs" / "vllm.md", "vllm")


@pytest.mark.vllm
def test_serve_page_commands_run_as_written(tmp_path: Path) -> None:
    """docs/serve.md's commands, in order: ``elastickv serve`` with the built-in models on
    real vLLM (the project's vLLM environment), requests with curl, ``elastickv list``; then
    Ctrl-C, after which serve's log ends with every engine stopped and nothing left."""
    session = run_page(REPO / "docs" / "serve.md", None, tmp_path, Path(sys.executable).parent)
    (serve,) = [job for job in session.ended if job.kind == "serve"]
    serve_log = serve.text().strip()
    assert serve_log.splitlines()[-1].endswith("stopped: 2 engines, nothing left"), serve_log
    for model in ("tiny-llama", "tiny-llama-bf16"):
        assert f"{model}: starting -> idle" in serve_log
    for model in ("tiny-llama", "tiny-llama-bf16"):  # the curl completion, the curl chat
        assert re.search(rf"{model}: (idle|kv-released) -> serving", serve_log), serve_log
    answers = "".join(session.log).replace(" ", "")
    assert '"object":"text_completion"' in answers, answers[-3000:]
    assert '"object":"chat.completion"' in answers, answers[-3000:]


def test_serve_page_configurations_are_accepted(tmp_path: Path) -> None:
    """Every TOML example of docs/serve.md is a configuration serve accepts (with a built-in
    model, no interpreter and a key file of this test's in place of the paths this machine
    does not have)."""
    import tomllib

    from elastickv.serve.config import config_from_mapping

    key_file = tmp_path / "api-key"
    key_file.write_text("k" * 32)
    examples = [s for s in snippets(REPO / "docs" / "serve.md") if s.language == "toml"]
    assert len(examples) >= 2
    for example in examples:
        data = tomllib.loads(example.text)
        data.pop("python", None)
        if "api_key_file" in data.get("router", {}):
            data["router"]["api_key_file"] = str(key_file)
        data.setdefault("device", {"budget": "8G"})
        for model in data["model"]:
            model["model"] = "tiny-llama"
        config_from_mapping(data, source=example.id)


def test_cluster_page_configurations_are_accepted(tmp_path: Path) -> None:
    """Every TOML example of docs/cluster.md is a configuration ``elastickv cluster`` accepts
    (with a key file of this test's in place of the page's path)."""
    import tomllib

    from elastickv.cluster.config import cluster_config_from_mapping

    key_file = tmp_path / "api-key"
    key_file.write_text("k" * 32)
    examples = [s for s in snippets(REPO / "docs" / "cluster.md") if s.language == "toml"]
    assert examples
    for example in examples:
        data = tomllib.loads(example.text)
        if "api_key_file" in data.get("ingress", {}):
            data["ingress"]["api_key_file"] = str(key_file)
        config = cluster_config_from_mapping(data, source=example.id)
        assert config.models and config.pools
