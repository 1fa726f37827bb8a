"""A replica's device: the ``elastickv serve`` it runs as a child process, and the calls the
replica makes to it.

Each replica runs the same ``elastickv serve`` a user runs on one host, with its models API
on, on loopback, behind an API key (the cluster's, or one of its own when the cluster has
none). It is started in a session of its own and sets a parent-death signal on itself: if
the replica's process dies (its node removed, the actor killed), serve gets SIGTERM and stops
its engines, and each engine follows serve the same way; nothing outlives the replica.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import aiohttp

from elastickv.cluster.config import PoolConfig
from elastickv.ports import free_port
from elastickv.serve.auth import ENV_API_KEY, ApiKey
from elastickv.serve.engine import stop_session

START_TIMEOUT_S = 180.0  # serve itself, without engines: Python and its imports
STOP_TIMEOUT_S = 90.0  # serve stops its engines (20 s each at most, in parallel)


class DeviceError(RuntimeError):
    """serve refused a model, or is gone; ``status`` is the HTTP status to answer with."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def serve_toml(pool: PoolConfig, port: int) -> str:
    """The device's serve configuration: loopback, the models API, the pool's device."""
    lines = []
    if pool.python is not None:
        lines.append(f"python = {json.dumps(pool.python)}")
    if pool.log_dir is not None:
        lines.append(f"log_dir = {json.dumps(pool.log_dir)}")
    lines += [
        "[router]",
        'host = "127.0.0.1"',
        f"port = {port}",
        "models_api = true",
        f"queue_limit = {pool.queue_limit}",
        f"wake_timeout = {pool.wake_timeout_s!r}",
        "[device]",
        f"budget = {pool.budget}",
        f"page_size = {pool.page_size}",
        f"hot_max_pages = {pool.hot_max_pages}",
    ]
    return "\n".join(lines) + "\n"


class DeviceServe:
    """The replica's ``elastickv serve``: started, called, stopped."""

    def __init__(self, proc: subprocess.Popen[bytes], port: int, key: ApiKey, workdir: Path):
        self.proc = proc
        self.port = port
        self.key = key
        self.workdir = workdir
        self.url = f"http://127.0.0.1:{port}"

    @classmethod
    def start(cls, pool: PoolConfig, key: ApiKey) -> DeviceServe:
        """Start serve (its log goes where the replica's does: Ray's worker log)."""
        workdir = Path(tempfile.mkdtemp(prefix="elastickv-replica-"))  # 0700
        try:
            port = free_port()
            config = workdir / "serve.toml"
            config.write_text(serve_toml(pool, port))
            env = {k: v for k, v in os.environ.items() if k != ENV_API_KEY}
            env[ENV_API_KEY] = key.secret  # the environment, never the command line
            argv = [sys.executable, "-m", "elastickv.cli.main", "serve", "--config", str(config)]
            argv += ["--port", str(port), "--exit-with-parent", str(os.getpid())]
            proc = subprocess.Popen(
                argv, env=env, stdin=subprocess.DEVNULL, start_new_session=True
            )  # no preexec_fn: serve sets its own parent-death signal (--exit-with-parent)
        except BaseException:
            shutil.rmtree(workdir, ignore_errors=True)
            raise
        return cls(proc, port, key, workdir)

    @property
    def exited(self) -> int | None:
        """serve's exit status, or None while it runs."""
        return self.proc.poll()

    async def wait_ready(self, session: aiohttp.ClientSession) -> None:
        """Until serve answers ``/health``; RuntimeError if it exits or does not answer.
        Either way its configuration file is removed then: serve read it at start-up, and
        :meth:`stop` never runs when the replica's process is killed (its node removed)."""
        try:
            await self._until_healthy(session)
        finally:
            shutil.rmtree(self.workdir, ignore_errors=True)

    async def _until_healthy(self, session: aiohttp.ClientSession) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.exited is not None:
                raise RuntimeError(
                    f"this replica's elastickv serve exited during start-up (status "
                    f"{self.exited}); its log is in the replica's log above"
                )
            with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError, OSError):
                async with session.get(
                    self.url + "/health", headers=self.key.header(),
                    timeout=aiohttp.ClientTimeout(total=5),
                ) as answer:  # fmt: skip
                    if answer.status == 200:
                        return
            await asyncio.sleep(0.25)
        raise RuntimeError(f"this replica's elastickv serve did not answer in {START_TIMEOUT_S} s")

    async def health(self, session: aiohttp.ClientSession) -> dict[str, Any]:
        async with session.get(
            self.url + "/health", headers=self.key.header(), timeout=aiohttp.ClientTimeout(10)
        ) as answer:
            document: dict[str, Any] = await answer.json()
            return document

    async def add_model(self, session: aiohttp.ClientSession, table: Mapping[str, Any]) -> None:
        """Register a model and start its engine (returns once it is healthy); a model serve
        has already (an unload that did not reach it) counts as added."""
        async with session.post(
            self.url + "/admin/models", json=dict(table), headers=self.key.header()
        ) as answer:
            if answer.status == 200:
                return
            error = _message(await answer.read())
        if answer.status == 409 and str(table.get("name")) in await self._served(session):
            return
        raise DeviceError(answer.status, error)

    async def _served(self, session: aiohttp.ClientSession) -> set[str]:
        async with session.get(self.url + "/v1/models", headers=self.key.header()) as answer:
            return {m["id"] for m in (await answer.json()).get("data", [])}

    def remove_model(self, name: str, drain_s: float) -> None:
        """Stop a model's engine and unregister it (blocking: Ray Serve runs a model's
        unloading in a thread). Nothing to do once serve is gone."""
        if self.exited is not None:
            return
        url = f"{self.url}/admin/models/{urllib.parse.quote(name, safe='')}?drain={drain_s:g}"
        request = urllib.request.Request(url, method="DELETE", headers=self.key.header())
        try:
            with urllib.request.urlopen(request, timeout=drain_s + STOP_TIMEOUT_S):
                pass
        except urllib.error.HTTPError as exc:
            if exc.code != 404:  # 404: not there (any more)
                raise DeviceError(exc.code, _message(exc.read())) from None

    def stop(self) -> None:
        """SIGTERM serve (it stops its engines), SIGKILL if it does not end in time."""
        try:
            stop_session(self.proc, timeout=STOP_TIMEOUT_S)
        finally:
            shutil.rmtree(self.workdir, ignore_errors=True)


def _message(body: bytes) -> str:
    """The message of an OpenAI-format error (the body itself if it is not one)."""
    try:
        return str(json.loads(body)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return body.decode(errors="replace")[:500]
