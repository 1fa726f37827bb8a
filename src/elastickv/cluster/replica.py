"""A device replica: one Ray Serve replica per device, running that device's ``elastickv
serve`` (its arbiter, tiers, ledger) and answering the ingress's calls for the models it holds.

Ray Serve's model multiplexing decides what the replica holds: the first request for a model
loads it (the model is registered in the replica's serve through its models API, which starts
its engine and answers once it is healthy); when the replica already holds ``max_models``,
the least recently used one is dropped first (serve stops its engine and forgets it). serve's
own tiers still apply to what it holds: an idle model releases its KV, then stops, and wakes
on its next request.

A call carries the client's ``Authorization`` header; with a cluster key the replica answers
401 to any caller that does not send it, the ingress's checks notwithstanding.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

import aiohttp
import ray
from ray import serve

from elastickv.cluster.config import ClusterModel, KeySource, PoolConfig
from elastickv.cluster.device import DeviceError, DeviceServe
from elastickv.cluster.metrics import ReplicaMetrics
from elastickv.serve.auth import ApiKey
from elastickv.serve.router import upstream_session

logger = logging.getLogger("ray.serve")
REPORT_INTERVAL_S = 2.0  # the gauges' refresh from the replica's serve
DRAIN_S = 30.0  # how long a dropped model's requests in flight may still take
_HOP_HEADERS = frozenset(
    {"content-length", "transfer-encoding", "connection", "keep-alive", "content-encoding"}
)


def error_body(status: int, message: str, kind: str) -> bytes:
    """An error in OpenAI's format."""
    return json.dumps(
        {"error": {"message": message, "type": kind, "param": None, "code": status}}
    ).encode()


class LoadedModel:
    """What Ray Serve's multiplexing keeps for a model the replica holds; dropping it (Ray
    Serve calls ``__del__`` in a thread) stops the model's engine in the replica's serve."""

    def __init__(self, name: str, unload: Callable[[str], None]) -> None:
        self.name = name
        self._unload = unload
        self._done = False

    def __del__(self) -> None:
        if self._done:
            return
        self._done = True
        with contextlib.suppress(Exception):  # also reached by garbage collection at exit
            self._unload(self.name)


class DeviceReplica:
    """The Ray Serve deployment class of a pool (see the module doc)."""

    async def __init__(  # type: ignore[misc]  # Ray Serve awaits an async constructor
        self, pool: PoolConfig, models: Mapping[str, ClusterModel], key: KeySource
    ) -> None:
        self.pool = pool
        self.models = dict(models)
        self.key = key.load(os.environ)  # the cluster's key, read on this node
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.node_id = ray.get_runtime_context().get_node_id()
        self.metrics = ReplicaMetrics()
        self.session = upstream_session()
        own = ApiKey.generated("this replica's own key")
        self.device = DeviceServe.start(pool, self.key or own)
        self._closing = False
        try:
            await self.device.wait_ready(self.session)
        except BaseException:
            self.device.stop()
            raise

        async def load(model_id: str) -> LoadedModel:
            return await self._load_model(model_id)

        self._load = serve.multiplexed(max_num_models_per_replica=pool.max_models)(load)
        self._report = asyncio.get_running_loop().create_task(self._report_loop())
        logger.info(
            "elastickv replica %s on node %s: serve at %s (pool %s, up to %d models)",
            self.replica_id, self.node_id, self.device.url, pool.name, pool.max_models,
        )  # fmt: skip

    # -- loading and dropping models ----------------------------------------------------------

    async def _load_model(self, name: str) -> LoadedModel:
        model = self.models.get(name)
        if model is None:
            raise DeviceError(404, f"model {name!r} is not one of pool {self.pool.name!r}'s")
        began = time.monotonic()
        await self.device.add_model(self.session, model.table)
        self.metrics.loads.inc(tags={"model": name})
        self.metrics.load_seconds.observe(time.monotonic() - began, tags={"model": name})
        return LoadedModel(name, self._unload_model)

    def _unload_model(self, name: str) -> None:
        """In a thread: stop the model's engine in serve (nothing once the replica stops:
        serve stops every engine then)."""
        if self._closing:
            return
        self.device.remove_model(name, DRAIN_S)
        self.metrics.unloads.inc(tags={"model": name})

    # -- requests -----------------------------------------------------------------------------

    def _head(self, status: int, headers: list[tuple[str, str]] | None = None) -> dict[str, Any]:
        return {
            "status": status,
            "headers": headers or [("Content-Type", "application/json")],
            "replica": self.replica_id,
            "node": self.node_id,
        }

    async def forward(
        self, path: str, body: bytes, authorization: str | None
    ) -> AsyncIterator[Any]:
        """One OpenAI request for the multiplexed model: first a head (status, headers, this
        replica and node), then the answer's bytes as they come."""
        if self.key is not None and not self.key.matches(authorization):
            yield self._head(401)
            yield error_body(401, "missing or wrong API key", "invalid_request_error")
            return
        name = serve.get_multiplexed_model_id()
        if not name:  # a direct caller that named no model
            yield self._head(400)
            yield error_body(
                400, "no model: call with multiplexed_model_id", "invalid_request_error"
            )
            return
        began = time.monotonic()
        status = 502
        try:
            try:
                await self._load(name)
            except DeviceError as exc:
                status = exc.status
                yield self._head(status)
                yield error_body(
                    status, f"cannot load model {name!r}: {exc.message}", "load_failed"
                )
                return
            async for item in self._relay(path, body, name, began):
                if isinstance(item, dict):
                    status = item["status"]
                yield item
        finally:
            self.metrics.request(name, status)
            self.metrics.e2e.observe(time.monotonic() - began, tags={"model": name})

    async def _relay(self, path: str, body: bytes, name: str, began: float) -> AsyncIterator[Any]:
        headers = {**self.device.key.header(), "Content-Type": "application/json"}
        sent_head = False
        try:
            async with self.session.post(self.device.url + path, data=body, headers=headers) as up:
                passed = [(k, v) for k, v in up.headers.items() if k.lower() not in _HOP_HEADERS]
                yield self._head(up.status, passed)
                sent_head = True
                first = True
                async for chunk in up.content.iter_any():
                    if first:
                        self.metrics.ttft.observe(time.monotonic() - began, tags={"model": name})
                        first = False
                    yield chunk
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as exc:
            message = f"this replica's serve closed the connection ({exc.__class__.__name__})"
            if not sent_head:
                yield self._head(502)
                yield error_body(502, message, "replica_failed")
            else:
                event = {"error": {"message": message, "type": "replica_failed", "code": 502}}
                yield f"data: {json.dumps(event)}\n\n".encode()

    # -- what Ray Serve calls -----------------------------------------------------------------

    def check_health(self) -> None:
        """Ray Serve replaces a replica whose serve is gone."""
        code = self.device.exited
        if code is not None:
            raise RuntimeError(f"this replica's elastickv serve exited (status {code})")

    async def _report_loop(self) -> None:
        catalogue = list(self.models)
        while not self._closing:
            with contextlib.suppress(
                aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError
            ):
                self.metrics.observe(await self.device.health(self.session), catalogue)
            await asyncio.sleep(REPORT_INTERVAL_S)

    def __del__(self) -> None:
        """Ray Serve stopping the replica: serve stops every engine, then itself."""
        self._closing = True
        device = getattr(self, "device", None)
        if device is not None:
            device.stop()
