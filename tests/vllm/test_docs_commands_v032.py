"""docs/vllm.md's commands marked ``<!-- snippet: vllm -->`` run as written in this vLLM
environment (its ``python`` and ``elastickv`` first on ``PATH``): an elastic OpenAI server of
the built-in ``tiny-llama``, then ``elastickv list``, ``top`` and ``limit`` against it under its
default name; then Ctrl-C, after which no ledger record is left."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

REPO = Path(__file__).resolve().parents[2]


def _load_doc_snippets() -> ModuleType:
    """tests/docs/doc_snippets.py (test folders are not packages)."""
    path = REPO / "tests" / "docs" / "doc_snippets.py"
    spec = importlib.util.spec_from_file_location("doc_snippets", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while defining
    spec.loader.exec_module(module)
    return module


doc_snippets = _load_doc_snippets()


def test_vllm_page_commands_run_as_written(tmp_path: Path) -> None:
    page = REPO / "docs" / "vllm.md"
    session: Any = doc_snippets.run_page(page, "vllm", tmp_path, Path(sys.executable).parent)
    (server,) = [job for job in session.ended if job.kind == "vllm"]
    port = server.port
    log = "\n".join(session.log)
    # The engine's default name is the one the page's `elastickv limit` used, on its port.
    assert f"tiny-llama:{port}: limit 512M -> revision 2" in log, log[-4000:]
    assert "Downcasting" not in server.text()  # float32, as the page says
