"""vLLM 0.28: the plugin does not implement the 0.28 contract yet, so an engine with
``ELASTICKV=1`` must refuse to start, naming the version and what is supported — never run
natively behind the user's back. (Replace with the real tests once 0.28 is supported.)"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from elastickv.integrations.vllm.contract import detect_contract, installed_version
from elastickv.integrations.vllm.errors import ElasticKVStartupError


def test_detect_contract_refuses_0_28() -> None:
    with pytest.raises(ElasticKVStartupError, match=r"does not support vLLM 0\.28.*0\.32\.x"):
        detect_contract()
    assert installed_version().startswith("0.28.")


def test_plugin_loading_fails_with_elastickv(cache_root: Path) -> None:
    code = "from vllm.plugins import load_general_plugins\nload_general_plugins()\n"
    env = dict(os.environ, ELASTICKV="1", VLLM_CACHE_ROOT=str(cache_root))
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode != 0
    assert "does not support vLLM 0.28" in proc.stderr


def test_plugin_inert_without_elastickv(cache_root: Path) -> None:
    code = "from vllm.plugins import load_general_plugins\nload_general_plugins()\n"
    env = {k: v for k, v in os.environ.items() if not k.startswith("ELASTICKV")}
    env["VLLM_CACHE_ROOT"] = str(cache_root)
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
