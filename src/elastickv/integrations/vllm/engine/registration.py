"""One engine's record in the host ledger: registration, live limits, metrics, unregistration.

The process that owns the scheduler-side block allocator (the engine core; in-process the
only process) registers the engine when its elastic store is created, and every page the
allocator commits is admitted from credit the engine holds in the ledger
(:class:`~elastickv.control.credit.CreditPolicy`). ``ELASTICKV_BUDGET``
becomes the instance limit; an operator changes it live with ``elastickv limit NAME SIZE``
and the scheduler applies it once per step (:meth:`EngineRegistration.sync_limit`). The
record goes away on a clean engine shutdown, at process exit, and — should the process die
— by the ledger's liveness sweep.

Default name: the last path component of the served model name (``--served-model-name``,
which defaults to ``--model``; a built-in tiny model's cache entry ``tiny-llama-<digest>`` is
``tiny-llama``) and ``:<port>`` under the OpenAI server (``tiny-llama:8000``), else that name
alone, with ``-2``, ``-3``, ... while a live instance holds it: the same name on every run,
one per running engine. ``ELASTICKV_INSTANCE`` overrides it.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import re
import sys
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from elastickv.control import DuplicateInstance, InstanceHandle, Ledger, LedgerError, open_ledger
from elastickv.control.credit import CreditPolicy
from elastickv.integrations.vllm.config import ElasticConfig
from elastickv.integrations.vllm.errors import ElasticKVStartupError

if TYPE_CHECKING:
    from elastickv.alloc import BlockAllocator
    from elastickv.control.metrics import InstanceMetrics, MetricsServer

logger = logging.getLogger(__name__)
DEFAULT_SERVER_PORT = 8000  # vLLM's OpenAI server default
_NAME_BYTES = 64
_lock = threading.Lock()
_hint: str | None = None  # the default name of the engine being built in this process
_live: list[EngineRegistration] = []  # registered and not yet closed, in this process


def _clean(text: str) -> str:
    return re.sub(r"[^\w.:@+\-]+", "_", text).strip("_") or "vllm"


def server_port(argv: Sequence[str]) -> int | None:
    """The ``--port`` of vLLM's OpenAI server command line in ``argv``; None if it is not one.

    The engine core inherits the API server's ``sys.argv`` (fork, or multiprocessing's spawn
    preparation), so this answers there too."""
    if not argv:
        return None
    prog = os.path.basename(argv[0])
    is_server = prog == "api_server.py" or (prog == "vllm" and argv[1:2] == ["serve"])
    if not is_server:
        return None
    args = list(argv[1:])
    for i, arg in enumerate(args):
        text = arg[len("--port=") :] if arg.startswith("--port=") else None
        if arg == "--port" and i + 1 < len(args):
            text = args[i + 1]
        if text is not None and text.isdigit():
            return int(text)
    return DEFAULT_SERVER_PORT


def default_name(vllm_config: Any, argv: Sequence[str] | None = None) -> str:
    """``<served model name>:<port>`` for the OpenAI server, else ``<served model name>``
    (registration appends ``-2``, ``-3``, ... while that name is taken)."""
    from elastickv.models import builtin_name_of

    model_config = getattr(vllm_config, "model_config", None)
    served = getattr(model_config, "served_model_name", None) or getattr(
        model_config, "model", None
    )
    if isinstance(served, list | tuple):
        served = served[0] if served else None
    path = str(served or "vllm")
    base = _clean(builtin_name_of(path) or os.path.basename(path.rstrip("/")))
    port = server_port(sys.argv if argv is None else argv)
    suffix = f":{port}" if port is not None else ""
    return base[: _NAME_BYTES - len(suffix) - len("-99")] + suffix


def describe_engine(vllm_config: Any) -> None:
    """Remember the default name of the engine whose store is about to be created here."""
    global _hint
    with _lock:
        _hint = default_name(vllm_config)


class EngineRegistration:
    """This process's engine in the ledger: the handle, its policy, optional metrics."""

    def __init__(self, config: ElasticConfig, name: str | None, device: str = "host") -> None:
        self.config = config
        self.ledger: Ledger = open_ledger(device, directory=config.ledger_dir)
        try:
            self.handle: InstanceHandle = self._register(name)
        except BaseException:
            self.ledger.close()
            raise
        self.policy = CreditPolicy(self.handle)
        self.allocator: BlockAllocator | None = None
        self.metrics: InstanceMetrics | None = None
        self.server: MetricsServer | None = None
        self._closed = False
        if config.metrics_port is not None:
            try:
                self._start_metrics(config.metrics_port)
            except BaseException:
                self.close()
                raise

    @property
    def name(self) -> str:
        return self.handle.name

    def _register(self, name: str | None) -> InstanceHandle:
        limit = self.config.budget_spec
        explicit = self.config.instance_name
        try:
            if explicit is not None:
                return self.ledger.register(explicit.strip(), limit=limit)
            base = name or default_name(None)
            for attempt in range(1, 100):
                candidate = base if attempt == 1 else f"{base}-{attempt}"
                with contextlib.suppress(DuplicateInstance):
                    return self.ledger.register(candidate, limit=limit)
            return self.ledger.register(None, limit=limit)
        except (LedgerError, ValueError) as exc:
            raise ElasticKVStartupError(
                f"cannot register this vLLM engine in the elastickv ledger "
                f"{self.ledger.path}: {exc}"
            ) from exc

    def _start_metrics(self, port: int) -> None:
        from elastickv.control.metrics import InstanceMetrics, start_metrics_server

        self.metrics = InstanceMetrics(self.handle)
        try:
            self.server = start_metrics_server(port, metrics=self.metrics)
        except OSError as exc:
            raise ElasticKVStartupError(
                f"ELASTICKV_METRICS_PORT={port}: cannot serve metrics on 127.0.0.1: {exc}"
            ) from exc
        logger.info("elastickv: metrics of %r at %s", self.name, self.server.url)

    def attach_allocator(
        self, allocator: BlockAllocator, cached_blocks: Callable[[], int] | None = None
    ) -> None:
        """The scheduler's allocator: closed (pages returned) before unregistering. Its
        floor goes into the record (no limit below it is accepted), its commits into the
        commit-latency metric; ``cached_blocks`` counts the prefix-cache blocks it keeps."""
        self.allocator = allocator
        self.handle.set_floor_bytes(allocator.floor_bytes())
        if self.metrics is not None:
            self.metrics.attach_allocator(allocator, cached_blocks=cached_blocks)
            allocator.commit_observer = self.metrics.observe_commit

    def over_limit_bytes(self) -> int:
        """How far the engine is over its live limit (0 when closed or within it)."""
        if self._closed or self.handle.closed:
            return 0
        return self.handle.over_limit_bytes()

    def close(self) -> None:
        """Return every page, unregister, stop metrics (idempotent; never raises)."""
        if self._closed:
            return
        self._closed = True
        for undo in (
            None if self.allocator is None else self.allocator.close,
            self.handle.close,
            None if self.server is None else self.server.stop,
            self.ledger.close,
        ):
            if undo is None:
                continue
            try:
                undo()
            except Exception:  # shutdown must go on; liveness reclaims what is left
                logger.exception("elastickv: error while unregistering %r", self.handle.name)
        with _lock:
            if self in _live:
                _live.remove(self)
        logger.info("elastickv: unregistered %r", self.handle.name)


def register_engine(config: ElasticConfig, device: str = "host") -> EngineRegistration:
    """Register the engine whose store is being created in this process in the ledger of
    ``device`` (see module doc)."""
    with _lock:
        hint = _hint
    registration = EngineRegistration(config, hint, device)
    with _lock:
        _live.append(registration)
    logger.debug(
        "elastickv: registered %r in %s (limit %s)",
        registration.name,
        registration.ledger.path,
        config.budget_text(),
    )
    return registration


def registration_of(policy: Any) -> EngineRegistration | None:
    """The registration whose policy ``policy`` is (None for a local policy)."""
    with _lock:
        return next((r for r in _live if r.policy is policy), None)


def close_all() -> None:
    """Unregister every engine of this process (at exit; a clean shutdown did it already)."""
    with _lock:
        live = list(_live)
    for registration in reversed(live):
        registration.close()


atexit.register(close_all)
