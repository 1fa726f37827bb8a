"""``elastickv list``, ``limit`` and ``doctor`` end to end, through the real console script,
against live instances registered by this process and by child processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from elastickv.cli.vllm_report import vllm_contract
from elastickv.control import (
    ENV_DIR,
    RESET_COMMAND,
    InstanceClosed,
    Ledger,
    ledger_path,
    open_ledger,
)

SCRIPT = Path(sys.executable).with_name("elastickv")
MiB = 1 << 20
BUDGET = 64 * MiB

# A live instance in another process: registers, commits some bytes, waits to be killed.
CHILD = """
import sys, time
from elastickv.control import open_ledger
with open_ledger(directory=sys.argv[1]) as ledger, ledger.register(sys.argv[2]) as handle:
    assert handle.try_admit(int(sys.argv[3]))
    print("ready", flush=True)
    time.sleep(600)
"""


@pytest.fixture
def ledger_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The console script inherits this environment, so it reads the test's ledger."""
    directory = tmp_path / "ledgers"
    monkeypatch.setenv(ENV_DIR, str(directory))
    return directory


@pytest.fixture
def ledger(ledger_dir: Path) -> Iterator[Ledger]:
    with open_ledger(total_bytes=BUDGET, utilization=1.0) as opened:
        yield opened


@pytest.fixture
def child(ledger: Ledger, ledger_dir: Path) -> Iterator[subprocess.Popen[str]]:
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(ledger_dir), "child-a", str(4 * MiB)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "ready"
    yield proc
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=30)
    proc.stdout.close()


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(SCRIPT), *args], capture_output=True, text=True, timeout=120, check=False
    )


def cli_json(*args: str, code: int = 0) -> dict[str, Any]:
    result = cli(*args, "--json")
    assert result.returncode == code, result.stderr
    payload: dict[str, Any] = json.loads(result.stdout)
    return payload


def assert_user_error(result: subprocess.CompletedProcess[str], *fragments: str) -> None:
    """A clean refusal: non-zero exit, one line on stderr, no traceback."""
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("elastickv: error: "), result.stderr
    for fragment in fragments:
        assert fragment in lines[0]


def by_name(payload: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {instance["name"]: instance for instance in payload["instances"]}


# -- list -------------------------------------------------------------------------------------


def test_list_without_a_ledger_says_so(ledger_dir: Path) -> None:
    payload = cli_json("list")
    assert payload == {
        "schema": 1,
        "ledger": str(ledger_dir / "host.ledger"),
        "exists": False,
    }
    human = cli("list")
    assert human.returncode == 0 and "no elastic instance has registered" in human.stdout
    assert not (ledger_dir / "host.ledger").exists()  # reading never creates a ledger


def test_a_gpu_the_driver_cannot_name_is_a_clear_error(ledger_dir: Path) -> None:
    """``--device cuda:N`` asks the driver for the GPU's UUID; without that GPU (or with a
    malformed number) the command says so and how to name the ledger instead."""
    for device, message in (
        ("cuda:999", "give its key cuda-<GPU UUID> instead"),
        ("cuda:x", "a GPU is cuda:N, N a device number"),
    ):
        done = cli("list", "--device", device)
        assert done.returncode == 2 and message in done.stderr, done.stderr
        assert "Traceback" not in done.stderr


def test_list_json_reports_every_field(ledger: Ledger, child: subprocess.Popen[str]) -> None:
    with ledger.register("llama-a", limit="8M") as a, ledger.register("qwen-b") as b:
        assert a.try_admit(3 * MiB) and a.set_reserved_bytes(1 * MiB)
        assert b.try_admit(5 * MiB)
        payload = cli_json("list")
        assert payload["schema"] == 1 and payload["exists"] is True
        assert payload["ledger"] == ledger.path
        device = payload["device"]
        assert device == {
            "device": "host",
            "path": ledger.path,
            "total_bytes": BUDGET,
            "utilization": 1.0,
            "headroom_bytes": 0,
            "budget_bytes": BUDGET,
            "committed_bytes": 12 * MiB,
            "reserved_bytes": 1 * MiB,
            "used_bytes": 13 * MiB,
            "available_bytes": BUDGET - 13 * MiB,
            "instances": 3,
            "capacity": device["capacity"],
            "generation": device["generation"],
            "reclaimed": 0,
        }
        instances = by_name(payload)
        assert set(instances) == {"llama-a", "qwen-b", "child-a"}
        llama = instances["llama-a"]
        assert llama == {
            "name": "llama-a",
            "pid": os.getpid(),
            "alive": True,
            "slot": llama["slot"],
            "limit_desired": 8 * MiB,
            "limit_effective": 8 * MiB,
            "limit_revision": 1,
            "committed_bytes": 3 * MiB,
            "reserved_bytes": 1 * MiB,
            "used_bytes": 4 * MiB,
            "peak_bytes": 4 * MiB,
            "over_limit_bytes": 0,
            "draining": False,
            "admissions": 1,
            "refusals": 0,
            "releases": 0,
            "registered_at": llama["registered_at"],
            "floor_bytes": 0,
            "sleep_wanted": False,
            "asleep": False,
            "sleep_refused": False,
        }
        assert abs(llama["registered_at"] - time.time()) < 120
        assert instances["qwen-b"]["limit_desired"] is None
        assert instances["qwen-b"]["limit_effective"] == BUDGET
        assert instances["child-a"]["pid"] == child.pid
        assert instances["child-a"]["committed_bytes"] == 4 * MiB

        human = cli("list")
        assert human.returncode == 0, human.stderr
        for text in ("llama-a", "qwen-b", "child-a", "8.0 MiB", "budget 64.0 MiB"):
            assert text in human.stdout


def test_a_killed_instance_disappears_from_list(
    ledger: Ledger, child: subprocess.Popen[str]
) -> None:
    assert "child-a" in by_name(cli_json("list"))
    child.send_signal(signal.SIGKILL)
    child.wait(timeout=30)
    payload = cli_json("list")
    assert by_name(payload) == {}
    assert payload["device"]["used_bytes"] == 0
    assert payload["device"]["reclaimed"] == 1


# -- limit ------------------------------------------------------------------------------------


def test_limit_prints_the_new_revision_and_shrink_restore_shows(ledger: Ledger) -> None:
    with ledger.register("llama-a") as handle:
        assert handle.try_admit(6 * MiB)
        shrink = cli("limit", "llama-a", "4M")
        assert shrink.returncode == 0, shrink.stderr
        assert "revision 2" in shrink.stdout and "draining 2.0 MiB" in shrink.stdout
        info = by_name(cli_json("list"))["llama-a"]
        assert info["limit_desired"] == 4 * MiB and info["limit_effective"] == 6 * MiB
        assert info["draining"] is True and info["limit_revision"] == 2
        assert not handle.try_admit(1 * MiB)  # the shrink stops growth at once

        payload = cli_json("limit", "llama-a", "50%", "--revision", "2")
        assert payload["revision"] == 3
        assert payload["instance"]["limit_desired"] == BUDGET // 2
        assert payload["instance"]["draining"] is False
        assert handle.try_admit(1 * MiB)  # restoring re-enables growth

        for text, expected in (("512K", 512 * 1024), ("2GiB", 2 << 30), ("none", None)):
            payload = cli_json("limit", "llama-a", text)
            assert payload["instance"]["limit_desired"] == expected
        assert payload["revision"] == 6
        assert payload["instance"]["limit_effective"] == BUDGET


def test_limit_with_a_stale_revision_is_refused(ledger: Ledger) -> None:
    with ledger.register("llama-a") as handle:
        assert cli("limit", "llama-a", "8M").returncode == 0  # revision 2
        result = cli("limit", "llama-a", "16M", "--revision", "1")
        assert_user_error(result, "revision 2, not 1", "re-read it (`elastickv list`")
        assert handle.info().limit_desired == 8 * MiB


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (("llama-a", "12X"), "invalid limit '12X'"),
        (("llama-a", "150%"), "between 0% and 100%"),
        (("--", "llama-a", "-5M"), "invalid limit '-5M': a limit cannot be negative"),
        (("llama-a", "-1G"), "invalid limit '-1G': a limit cannot be negative; use a size (512M"),
        (("llama-a", "-30%"), "a limit cannot be negative"),
        (("llama-a", "-.5G", "--json"), "a limit cannot be negative"),
        (("llama-a", "1.5"), "invalid limit '1.5'"),
        (("nobody", "2G"), "no live instance named 'nobody'"),
        (("nobody", "2G"), "`elastickv list` (in Python: list_instances()) shows the"),
        (("llama-a", "2G", "--device", "bad key!"), "invalid device key"),
    ],
)
def test_limit_bad_input_is_one_clear_line(
    ledger: Ledger, args: tuple[str, ...], fragment: str
) -> None:
    with ledger.register("llama-a") as handle:
        assert_user_error(cli("limit", *args), fragment)
        assert handle.info().limit_revision == 1


def test_limit_without_a_ledger(ledger_dir: Path) -> None:
    assert_user_error(cli("limit", "llama-a", "2G"), "no elastic instance has registered")


# -- doctor -----------------------------------------------------------------------------------


def test_doctor_json_describes_the_machine(ledger: Ledger) -> None:
    with ledger.register("llama-a") as handle:
        assert handle.try_admit(2 * MiB)
        report = cli_json("doctor")
    assert report["schema"] == 1
    assert set(report) == {
        "schema",
        "elastickv",
        "python",
        "platform",
        "default_page_size",
        "strict_default",
        "backends",
        "ledger",
        "vllm",
    }
    host = report["backends"]["host"]
    assert host["available"] is True and host["granularity"] == os.sysconf("SC_PAGE_SIZE")
    assert host["strict"] is True and report["strict_default"] is True
    assert report["default_page_size"] == 2 * MiB
    cuda = report["backends"]["cuda"]
    assert set(cuda) >= {"bindings_installed", "available", "granularity", "error"}
    assert cuda["available"] or cuda["error"]
    assert report["ledger"] == {
        "device": "host",
        "directory": str(Path(ledger.path).parent),
        "directory_from_env": True,
        "path": ledger.path,
        "exists": True,
        "healthy": True,
        "error": None,
        "recovery": None,
        "usage": report["ledger"]["usage"],
    }
    assert report["ledger"]["usage"]["instances"] == 1
    assert report["ledger"]["usage"]["committed_bytes"] == 2 * MiB
    vllm = report["vllm"]
    assert set(vllm) >= {"installed", "distribution", "version", "contract", "python", "hint"}
    if vllm["installed"]:
        assert vllm["contract"] == vllm_contract(vllm["version"])


def test_doctor_before_any_instance(ledger_dir: Path) -> None:
    report = cli_json("doctor")
    assert report["ledger"]["exists"] is False and report["ledger"]["healthy"] is True
    human = cli("doctor")
    assert human.returncode == 0, human.stderr
    for text in ("backends", "host", "cuda", "ledger", "not created yet", "vllm"):
        assert text in human.stdout


def test_a_damaged_ledger_is_reported_and_reset(ledger_dir: Path) -> None:
    with open_ledger(total_bytes=BUDGET):
        pass
    path = ledger_path("host", str(ledger_dir))
    with open(path, "r+b") as damaged:
        damaged.write(b"not a ledger at all")

    report = cli_json("doctor", code=1)
    assert report["ledger"]["healthy"] is False
    assert "bad magic" in report["ledger"]["error"]
    assert report["ledger"]["recovery"] == RESET_COMMAND
    human = cli("doctor")
    assert human.returncode == 1 and RESET_COMMAND in human.stdout
    assert_user_error(cli("list"), "bad magic", RESET_COMMAND)

    fixed = cli_json("doctor", "--reset-ledger")
    assert fixed["reset"] == {"path": path, "done": True, "dropped_instances": []}
    assert fixed["ledger"]["healthy"] is True
    assert cli_json("list") == {"schema": 1, "ledger": path, "exists": False}
    with open_ledger(total_bytes=BUDGET) as ledger, ledger.register("after-reset"):
        assert "after-reset" in by_name(cli_json("list"))


def test_a_ledger_open_to_others_is_unhealthy_without_a_reset_hint(ledger: Ledger) -> None:
    os.chmod(ledger.path, 0o644)
    report = cli_json("doctor", code=1)
    assert report["ledger"]["healthy"] is False
    assert "chmod 600" in report["ledger"]["error"]
    assert report["ledger"]["recovery"] is None
    assert_user_error(cli("list"), "accessible to other users")


def test_reset_refuses_live_instances_unless_forced(ledger: Ledger) -> None:
    handle = ledger.register("llama-a")
    assert handle.try_admit(1 * MiB)
    assert_user_error(cli("doctor", "--reset-ledger"), "llama-a", "--force")
    assert handle.info().committed_bytes == 1 * MiB
    forced = cli_json("doctor", "--reset-ledger", "--force")
    assert forced["reset"]["dropped_instances"] == ["llama-a"]
    assert forced["ledger"]["usage"]["instances"] == 0
    with pytest.raises(InstanceClosed):
        handle.info()


def test_bad_device_is_one_clear_line(ledger_dir: Path) -> None:
    assert_user_error(cli("list", "--device", "../etc"), "invalid device key")
    assert_user_error(cli("doctor", "--device", ""), "invalid device key")


@pytest.mark.parametrize(
    ("version", "contract"),
    [
        ("0.28.0", "0.28"),
        ("0.29.1", "0.28"),
        ("0.31.2+cpu", "0.28"),
        ("0.32.0", "0.32"),
        ("0.32.1.dev3+g1234", "0.32"),
        ("0.27.9", "unsupported"),
        ("0.33.0", "unsupported"),
        ("1.32.0", "unsupported"),
        ("garbage", "unsupported"),
    ],
)
def test_vllm_contract_by_version(version: str, contract: str) -> None:
    assert vllm_contract(version) == contract
