"""A replica's device: the ``elastickv serve`` it runs (real, with no model) starts, answers,
leaves no file behind once it runs, and stops. (The cluster itself, on Ray Serve, is in
tests/integration_vllm/test_vllm_plugin_v032_cluster.py.)"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import aiohttp
import pytest

from elastickv.cluster.config import PoolConfig
from elastickv.cluster.device import DeviceServe
from elastickv.control import ENV_DIR
from elastickv.serve.auth import ApiKey

KEY = ApiKey("the test", "device-" + "k" * 25)


async def ready_and_healthy(device: DeviceServe) -> dict[str, object]:
    async with aiohttp.ClientSession() as session:
        await device.wait_ready(session)
        return await device.health(session)


def test_the_configuration_is_gone_once_serve_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """serve reads its configuration at start-up; the replica removes it then, not only in
    ``stop``, which never runs when Ray kills the replica's process (a removed node left a
    directory in /tmp behind for every replica it held)."""
    monkeypatch.setenv(ENV_DIR, str(tmp_path / "ledgers"))
    pool = PoolConfig(name="hosts", replicas=1, budget=8 << 20, python=sys.executable)
    device = DeviceServe.start(pool, KEY)
    try:
        assert (device.workdir / "serve.toml").is_file()
        health = asyncio.run(ready_and_healthy(device))
        assert health, health
        assert not device.workdir.exists()
        assert device.exited is None  # serve runs on without it
    finally:
        device.stop()
    assert device.exited is not None
