"""The plugin installs the scheduler clock (``ELASTICKV_SCHEDULER_CLOCK``) on native vLLM as on
an elastic engine, and on an elastic engine around elastickv's own scheduler hooks, so that
their cost is counted. Each case runs the plugin's entry point in a fresh process."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from elastickv.integrations.vllm.scheduler.scheduler_clock import SchedulerTimes, read_clock

CHECK = """
import json
from elastickv.integrations.vllm import plugin
plugin.register()
from vllm.v1.core.sched.scheduler import Scheduler
method = Scheduler.schedule
inner = getattr(method, "__wrapped__", None)
print(json.dumps({
    "clocked": bool(getattr(method, "__elastickv_scheduler_clock__", False)),
    "around_elastickv_hook": hasattr(inner, "__elastickv_original__"),
}))
"""


@pytest.mark.parametrize("elastic", [False, True])
def test_the_clock_wraps_the_scheduler_outside_elastickvs_hooks(
    tmp_path: Path, elastic: bool
) -> None:
    clock = tmp_path / "scheduler.clock"
    env = {k: v for k, v in os.environ.items() if not k.startswith("ELASTICKV")}
    env["ELASTICKV_SCHEDULER_CLOCK"] = str(clock)
    if elastic:
        env.update(ELASTICKV="1", ELASTICKV_LEDGER_DIR=str(tmp_path / "ledger"))
    done = subprocess.run(
        [sys.executable, "-c", CHECK], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen == {"clocked": True, "around_elastickv_hook": elastic}
    assert "set but ELASTICKV=1 is not" not in done.stderr  # not an ignored setting
    assert stat.S_IMODE(clock.stat().st_mode) == 0o600  # created at start-up, owner-only
    assert read_clock(clock) == SchedulerTimes()  # no scheduler ran: nothing counted


def test_a_path_that_is_not_a_clock_file_stops_the_start(tmp_path: Path) -> None:
    """A mistyped ``ELASTICKV_SCHEDULER_CLOCK`` naming another file fails the engine's start
    with what is wrong, and the file is left as it was."""
    notes = tmp_path / "notes.txt"
    notes.write_text("precious data, longer than thirty-two bytes")
    env = {k: v for k, v in os.environ.items() if not k.startswith("ELASTICKV")}
    env["ELASTICKV_SCHEDULER_CLOCK"] = str(notes)
    done = subprocess.run(
        [sys.executable, "-c", CHECK], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode != 0
    assert "ElasticKVStartupError" in done.stderr
    assert "is not a scheduler clock file" in done.stderr
    assert notes.read_text() == "precious data, longer than thirty-two bytes"
