"""Real NIXL, created as vLLM 0.32 creates it: with a progress wait (the default on vLLM's CPU
backend, or ``ELASTICKV_NIXL_PROGRESS_WAIT_MS``) the progress thread of an idle agent sleeps;
with 0 (NIXL's own) it spins on a core.

Each agent lives in a child process of its own: an agent's thread runs until the process
ends, so two in one process would add up.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from elastickv.integrations.vllm.transfer import nixl_progress

IDLE_S = 2.0
CHILD = f"""
import json, sys, time
import psutil
from elastickv.integrations.vllm.transfer import nixl_progress
for wait in sys.argv[1].split(","):  # as the plugin sets it up: before vLLM loads NIXL
    assert nixl_progress.apply_when_loaded(None if wait == "default" else int(wait))
assert "nixl" not in sys.modules  # nothing of NIXL imported until vLLM loads it
from vllm.distributed.nixl_utils import NixlWrapper, nixl_agent_config
# As vLLM's NIXL worker creates its agent (UCX, 4 threads, telemetry).
agent = NixlWrapper("probe", nixl_agent_config(num_threads=4, capture_telemetry=True))
time.sleep(0.5)
process = psutil.Process()
before = sum(process.cpu_times()[:2])
time.sleep({IDLE_S})
cpu_s = sum(process.cpu_times()[:2]) - before
print(json.dumps({{"cpu_s": cpu_s, "wait_ms": nixl_progress.installed_wait_ms()}}))
"""


def idle_agent(waits: str) -> dict[str, float]:
    """CPU seconds an idle agent's process uses over ``IDLE_S``, after ``apply_when_loaded``
    of each of ``waits`` in turn."""
    done = subprocess.run(
        [sys.executable, "-c", CHILD, waits], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return out


def test_an_idle_agent_sleeps_with_a_wait_and_spins_without() -> None:
    waiting = idle_agent("default")  # this is vLLM's CPU backend: 5 ms
    spinning = idle_agent("default,0")  # the last setting wins: 0, NIXL's own spin
    assert (waiting["wait_ms"], spinning["wait_ms"]) == (nixl_progress.CPU_DEFAULT_WAIT_MS, 0)
    print(
        f"\nidle NIXL agent over {IDLE_S} s: {waiting['cpu_s']:.2f} s of CPU waiting, "
        f"{spinning['cpu_s']:.2f} s spinning"
    )
    # Spinning takes a core (about IDLE_S of CPU on an idle host); waiting, a few wake-ups.
    assert spinning["cpu_s"] > 4 * waiting["cpu_s"], (waiting, spinning)
    assert waiting["cpu_s"] < IDLE_S / 4, waiting


@pytest.mark.parametrize("wait_ms", [-1, nixl_progress.MAX_WAIT_MS + 1])
def test_a_wait_out_of_range_is_refused(wait_ms: int) -> None:
    with pytest.raises(ValueError, match="use 0 to 1000"):
        nixl_progress.install(wait_ms)
