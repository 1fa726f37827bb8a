"""``elastickv serve`` put together: checks, router, engines, arbiter, idle policy, shutdown.

Order matters for "a clear error, nothing left running": everything that can be checked is
checked before the first process starts (configuration, the engine Python, model paths, the
ledger, the router's port — bound first), and any failure after that stops what did start.
A model added at run time (the models API) goes through the same checks before its engine
starts, and a start that fails leaves nothing of it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from elastickv.control import DEFAULT_UTILIZATION, Ledger, LedgerError, open_ledger
from elastickv.control.ledger import host_total_bytes
from elastickv.control.paths import HOST_DEVICE, ledger_directory, ledger_path
from elastickv.ports import free_port
from elastickv.serve.arbiter import Activity, MemoryArbiter, ModelView
from elastickv.serve.config import (
    MIN_KV_UNSET,
    ModelConfig,
    ServeConfig,
    ServeConfigError,
    check_model,
    default_min_kv,
    model_from_mapping,
)
from elastickv.serve.engine import EngineStartError, build_launch, log_path, session_processes
from elastickv.serve.leftovers import remove_stale_rpc_dirs
from elastickv.serve.metrics import ModelReading, ServeMetrics
from elastickv.serve.model import ModelHooks, ModelState, ServedModel
from elastickv.serve.pd import PDPair
from elastickv.serve.python_env import EnginePythonError, find_engine_python
from elastickv.serve.router import ModelsApi, ModelsApiError, Router, upstream_session
from elastickv.serve.state_file import remove_state, write_state
from elastickv.units import format_bytes

logger = logging.getLogger("elastickv.serve")
IDLE_CHECK_S = 0.5
# How often each engine's resident memory is read (a few system calls per engine process).
RESIDENT_CHECK_S = 2.0
# How often a wake from sleep is looked at, to time it (the engine clears its record's flag).
WAKE_POLL_S = 0.02


def _engines(count: int) -> str:
    return f"{count} engine" + ("" if count == 1 else "s")


class ServeError(RuntimeError):
    """``serve`` cannot start or keep going; the message says why (nothing is left running)."""


_ACTIVITY = {
    ModelState.IDLE: Activity.IDLE,
    ModelState.KV_RELEASED: Activity.RELEASED,
    ModelState.ASLEEP: Activity.RELEASED,
}


class ServeApp:
    """One ``elastickv serve`` process."""

    def __init__(self, config: ServeConfig, *, ledger_dir: str | None = None) -> None:
        self.config = config
        self.ledger_dir = ledger_dir or os.environ.get("ELASTICKV_LEDGER_DIR") or None
        # Engine logs: the configured folder, else a temporary one made at the first engine
        # start (a run refused before that leaves none) and removed at the end unless an
        # engine failed (see :meth:`shutdown`).
        self._log_dir: Path | None = Path(config.log_dir) if config.log_dir else None
        self.pythons: dict[str, str] = {}
        self.paths: dict[str, str] = {}
        self.models: dict[str, ServedModel] = {}
        self.ledger: Ledger | None = None
        self.arbiter: MemoryArbiter | None = None
        self.metrics = ServeMetrics(self._readings)
        self.url = f"http://{config.host}:{config.port}"
        self._runner: web.AppRunner | None = None
        self._router: Router | None = None
        self._models_lock = asyncio.Lock()  # one model added or removed at a time
        self._session: aiohttp.ClientSession | None = None
        self._tasks: list[asyncio.Task[Any]] = []
        self._wake_timers: set[asyncio.Task[None]] = set()
        self.resident: dict[str, int | None] = {}  # each engine's PSS, read every few seconds
        self._booted = False
        self._closing = False
        self._start_failed: str | None = None  # the model whose first start failed

    # -- before anything starts -----------------------------------------------------------------

    @property
    def log_dir(self) -> Path:
        if self._log_dir is None:
            self._log_dir = Path(tempfile.mkdtemp(prefix="elastickv-serve-"))
        return self._log_dir

    def check(self) -> None:
        """Everything that can fail before a process starts; raises ServeError."""
        self._find_pythons()
        for model in self.config.models:
            self.paths[model.name] = self._model_path(model)

    def _find_pythons(self) -> None:
        try:
            for model in self.config.models:
                self.pythons[model.name] = find_engine_python(model.python, self.config.python)
        except EnginePythonError as exc:
            raise ServeError(str(exc)) from None

    def preflight(self) -> list[str]:
        """``serve --check``: every check a start makes before its first process (the engine
        Python, the ledger's names and budget), creating nothing; raises ServeError with
        what a start would refuse, else returns what it found, one line each."""
        self._find_pythons()
        lines = [f"engine Python {p}" for p in dict.fromkeys(self.pythons.values())]
        path = ledger_path(HOST_DEVICE, self.ledger_dir or ledger_directory())
        if os.path.exists(path) and os.path.getsize(path) > 0:
            try:
                ledger = open_ledger("host", directory=self.ledger_dir, create=False)
            except (LedgerError, ValueError, OSError) as exc:
                raise ServeError(f"cannot open the host ledger: {exc}") from None
            with ledger:
                self._check_ledger(ledger)
                usage = ledger.device_usage()
            lines.append(
                f"host ledger {path}: {format_bytes(usage.available_bytes)} of "
                f"{format_bytes(usage.budget_bytes)} available"
            )
        else:
            budget = int(host_total_bytes() * DEFAULT_UTILIZATION)
            self._check_budget(
                budget,
                f"the {format_bytes(budget)} a new host ledger has ({DEFAULT_UTILIZATION:.0%} of "
                f"this machine's memory; {path})",
            )
            lines.append(f"host ledger {path}: not created yet, budget {format_bytes(budget)}")
        return lines

    def _model_path(self, model: ModelConfig) -> str:
        if not model.builtin:
            return str(Path(model.source).expanduser().resolve())
        try:
            from elastickv.models import ensure_tiny_model

            return str(ensure_tiny_model(model.source))
        except ImportError:  # this interpreter lacks the [models] extra: the engine's has it
            code = (
                "import sys; from elastickv.models import ensure_tiny_model; "
                "print(ensure_tiny_model(sys.argv[1]))"
            )
            proc = subprocess.run(
                [self.pythons[model.name], "-c", code, model.source],
                capture_output=True, text=True, timeout=300, check=False,
            )  # fmt: skip
            if proc.returncode != 0:
                raise ServeError(
                    f"cannot build the built-in model {model.source!r}: {proc.stderr[-2000:]}"
                ) from None
            return proc.stdout.strip().splitlines()[-1]

    def _open_ledger(self) -> Ledger:
        try:
            ledger = open_ledger("host", directory=self.ledger_dir)
        except (LedgerError, ValueError, OSError) as exc:
            raise ServeError(f"cannot open the host ledger: {exc}") from None
        try:
            self._check_ledger(ledger)
        except BaseException:
            ledger.close()
            raise
        return ledger

    def _check_ledger(self, ledger: Ledger) -> None:
        """No live instance holds a model's name, and the budget fits what is available."""
        taken = {i.name: i.pid for i in ledger.list_instances()}
        clash = [f"{n!r} (pid {taken[n]})" for n in self.config.names() if n in taken]
        if clash:
            raise ServeError(
                f"the ledger {ledger.path} already has live instances named "
                f"{', '.join(clash)}; stop them or serve under other names"
            )
        usage = ledger.device_usage()
        self._check_budget(
            usage.available_bytes,
            f"the host ledger has available ({format_bytes(usage.available_bytes)} of "
            f"{format_bytes(usage.budget_bytes)}; see `elastickv list`)",
        )

    def _check_budget(self, available: int, what: str) -> None:
        if self.config.budget <= available:
            return
        raise ServeError(
            f"[device] budget = {format_bytes(self.config.budget)} is more than {what}; "
            "lower the budget"
        )

    # -- running --------------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        """Serve until ``stop`` is set; every process started is stopped on the way out."""
        self.check()
        self.ledger = self._open_ledger()
        for path in remove_stale_rpc_dirs():
            logger.info("removed %s: IPC sockets of engines no process uses any more", path)
        try:
            self._session = upstream_session()
            self._build_models()
            await self._bind_router()
            self._tasks.append(asyncio.create_task(self._background()))
            for model in self.models.values():
                if not await self._boot(model, stop):
                    return
            self._booted = True  # idle clocks start now: no model sleeps while others boot
            for model in self.models.values():
                model.last_active = time.monotonic()
            logger.info(
                "serving %s at %s/v1 (KV budget %s)",
                ", ".join(self.config.served_names()) or "no models yet", self.url,
                format_bytes(self.config.budget),
            )  # fmt: skip
            if self.config.models_api:
                logger.info("models API at %s/admin/models", self.url)
            await stop.wait()
        finally:
            await self.shutdown()

    async def _boot(self, model: ServedModel, stop: asyncio.Event) -> bool:
        """Start one model's engine; False if ``stop`` came first (the start is cancelled,
        which stops the engine it began)."""
        boot = asyncio.create_task(model.boot())
        stopped = asyncio.create_task(stop.wait())
        await asyncio.wait({boot, stopped}, return_when=asyncio.FIRST_COMPLETED)
        stopped.cancel()
        if not boot.done():
            boot.cancel()
            with contextlib.suppress(asyncio.CancelledError, EngineStartError):
                await boot
            return False
        try:
            boot.result()
        except EngineStartError as exc:
            self._start_failed = model.name  # its log is kept: the error names it
            raise ServeError(f"cannot start model {model.name!r}: {exc}") from None
        return True

    def _hooks(self) -> ModelHooks:
        assert self._session is not None
        return ModelHooks(
            launch=self._launch,
            session=self._session,
            changed=self._changed,
            restore_kv=self._restore_kv,
            release_kv=self._release_kv,
            engine_ready=self._engine_ready,
            woke=lambda name, tier, s: self.metrics.wake.labels(name, tier).observe(s),
            request_sleep=self._request_sleep,
            sleep_answer=self._sleep_answer,
        )

    def _build_models(self) -> None:
        hooks = self._hooks()
        for m in self.config.models:
            self.models[m.name] = ServedModel(
                m, hooks, queue_limit=self.config.queue_limit,
                wake_timeout_s=self.config.wake_timeout_s,
            )  # fmt: skip
        assert self.ledger is not None
        views = self._views()
        self.arbiter = MemoryArbiter(
            self.ledger, self.config.budget, views, self._views, self.config.page_size
        )

    async def _bind_router(self) -> None:
        assert self._session is not None
        pairs = {
            name: PDPair(name, self.models[prefill.name], self.models[decode.name])
            for name, (prefill, decode) in self.config.pairs().items()
        }
        api = ModelsApi(self.add_model, self.remove_model) if self.config.models_api else None
        router = Router(
            self.models, self.metrics, self._session, self.describe, pairs,
            api_key=self.config.api_key, models_api=api,
        )  # fmt: skip
        self._router = router
        self._runner = web.AppRunner(router.app(), handler_cancellation=True, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.config.host, self.config.port)
        try:
            await site.start()
        except OSError as exc:
            raise ServeError(
                f"cannot listen on {self.config.host}:{self.config.port}: {exc.strerror or exc}; "
                "choose another port with --port or [router] port"
            ) from None
        if self.config.port == 0:  # an ephemeral port: report the real one
            server = site._server
            sockets = getattr(server, "sockets", None) or []
            if sockets:
                self.url = f"http://{self.config.host}:{sockets[0].getsockname()[1]}"
        logger.info("router listening at %s", self.url)

    def _launch(self, model: ModelConfig) -> Any:
        return build_launch(
            self.config, model, python=self.pythons[model.name],
            model_path=self.paths[model.name], port=free_port(), log_dir=self.log_dir,
        )  # fmt: skip

    async def _background(self) -> None:
        assert self.arbiter is not None
        arbiter = None if self.config.static else asyncio.create_task(self.arbiter.run())
        resident_read = 0.0
        try:
            while True:
                now = time.monotonic()
                idle_policy = arbiter is not None and self._booted
                for model in list(self.models.values()) if idle_policy else []:
                    await model.apply_idle_policy(now)
                if now - resident_read >= RESIDENT_CHECK_S:
                    resident_read = now
                    await self._read_resident()
                self._publish()  # the bytes and limits, which change without a state change
                await asyncio.sleep(IDLE_CHECK_S)
        finally:
            if arbiter is not None:
                arbiter.cancel()
            for timer in list(self._wake_timers):
                timer.cancel()

    async def _read_resident(self) -> None:
        engines = {name: m.engine for name, m in self.models.items()}
        readings = await asyncio.to_thread(
            lambda: {n: None if e is None else e.resident_bytes() for n, e in engines.items()}
        )
        self.resident = readings

    async def shutdown(self) -> None:
        """Stop the router, every engine (SIGTERM, then SIGKILL), the loops; idempotent. The
        last line it logs says how many engines stopped and whether anything was left."""
        self._closing = True  # no state file is written from here on
        for task in self._tasks:
            task.cancel()
        self._tasks.clear()
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await runner.cleanup()
        try:
            await asyncio.gather(*(m.stop(final=True) for m in self.models.values()))
        finally:
            self.kill()
            if self._session is not None:
                await self._session.close()
                self._session = None
            remove_state(self.ledger_dir)
            stopped = [(m.name, pid) for m in self.models.values() for pid in m.stopped_on_exit]
            left = self._left_behind(stopped)
            if self.ledger is not None:
                self.ledger.close()
                self.ledger = None
            if self.models or self.config.models_api:
                self._report_stopped(len(stopped), left)

    def _left_behind(self, engines: list[tuple[str, int]]) -> list[str]:
        """What the stopped engines left: processes of their sessions, ledger records."""
        left = [f"{name}: process {p.pid}" for name, pid in engines for p in session_processes(pid)]
        if self.ledger is not None and not self.config.static:
            with contextlib.suppress(LedgerError, OSError):
                names = set(self.config.names())
                left += [
                    f"{i.name}: ledger record (pid {i.pid})"
                    for i in self.ledger.list_instances()
                    if i.name in names
                ]
        return left

    def _report_stopped(self, engines: int, left: list[str]) -> None:
        failed = [f"{m.name} restarted" for m in self.models.values() if m.restarts]
        failed += [f"{m.name} failed" for m in self.models.values() if m.failures_in_row]
        if self._start_failed is not None:
            failed.append(f"{self._start_failed} failed to start")
        logs, where = self._log_dir, ""
        if logs is not None and self.config.log_dir is None:
            if failed or left:
                where = f"; engine logs kept in {logs} ({', '.join(failed) or 'see above'})"
            else:
                shutil.rmtree(logs, ignore_errors=True)  # temporary, and nothing went wrong
        elif logs is not None:
            where = f"; engine logs in {logs}"
        if left:
            logger.warning("stopped: %s; left behind: %s%s", _engines(engines), "; ".join(left),
                           where)  # fmt: skip
        else:
            logger.info("stopped: %s, nothing left%s", _engines(engines), where)

    def kill(self) -> None:
        for model in self.models.values():
            model.kill()

    # -- the models API -------------------------------------------------------------------------

    async def add_model(self, raw: object) -> dict[str, object]:
        """Add a model (a ``[[model]]`` table) and start its engine; its description once it
        is healthy. Raises ModelsApiError: 400 for a bad field, 409 for a name in use or a
        ``min_kv`` the budget cannot guarantee, 503 when the models' holdings leave no room
        for its ``min_kv`` within ``wake_timeout``, 502 when its engine fails to start (the
        error names its log)."""
        async with self._models_lock:
            model, config = self._admissible(raw)
            python, path = await self._locate(model, config)
            served = ServedModel(
                model, self._hooks(), queue_limit=config.queue_limit,
                wake_timeout_s=config.wake_timeout_s,
            )  # fmt: skip
            assert self.arbiter is not None
            self.config = config
            self.pythons[model.name], self.paths[model.name] = python, path
            self.models[model.name] = served
            self.arbiter.add(self._views()[-1], config.page_size)
            logger.info("%s: added (min_kv %s)", model.name, format_bytes(model.min_kv))
            try:
                await self._wait_for_room(model)
                await served.boot()
            except BaseException as exc:
                await self._forget(served)
                if isinstance(exc, EngineStartError):
                    self._start_failed = model.name  # its log is kept: the error names it
                    raise ModelsApiError(502, f"cannot start model {model.name!r}: {exc}") from None
                raise
            served.last_active = time.monotonic()
            assert self._router is not None
            self._router.add(served)
            self._publish()
            return next(m for m in self.describe()["models"] if m["name"] == model.name)

    def _admissible(self, raw: object) -> tuple[ModelConfig, ServeConfig]:
        """The model and the configuration with it, or ModelsApiError (nothing changed)."""
        config = self.config
        try:
            model = model_from_mapping(raw, where="the model")
            if model.min_kv == MIN_KV_UNSET:
                engines = len(config.models) + 1
                floor = default_min_kv(config.budget, engines, config.page_size)
                model = replace(model, min_kv=floor)
            check_model(model, page_size=config.page_size, static=config.static)
        except ServeConfigError as exc:
            raise ModelsApiError(400, str(exc)) from None
        if model.name in self.models or model.name in config.served_names():
            raise ModelsApiError(409, f"a model named {model.name!r} is served already")
        try:  # what is left to refuse is the budget: the models' min_kv together
            config = replace(config, models=(*config.models, model))
        except ServeConfigError as exc:
            raise ModelsApiError(409, str(exc)) from None
        return model, config

    async def _locate(self, model: ModelConfig, config: ServeConfig) -> tuple[str, str]:
        """The engine Python and the model's path (a built-in one is built), and no live
        ledger instance under its name; ModelsApiError otherwise."""
        try:
            python = find_engine_python(model.python, config.python)
        except EnginePythonError as exc:
            raise ModelsApiError(400, str(exc)) from None
        self.pythons[model.name] = python  # _model_path may need it to build a built-in model
        try:
            path = await asyncio.to_thread(self._model_path, model)
        except ServeError as exc:
            raise ModelsApiError(400, str(exc)) from None
        finally:
            del self.pythons[model.name]
        if self.ledger is not None and not config.static:
            live = {i.name: i.pid for i in self.ledger.list_instances()}
            if model.name in live:
                raise ModelsApiError(
                    409,
                    f"the ledger {self.ledger.path} already has a live instance named "
                    f"{model.name!r} (pid {live[model.name]}); stop it or use another name",
                )
        return python, path

    async def _wait_for_room(self, model: ModelConfig) -> None:
        """Until the models' holdings leave this model its ``min_kv`` (the arbiter cuts idle
        ones to theirs; busy ones drain as their requests end), at most ``wake_timeout``:
        its engine starts only then, so the budget holds whatever the engines do."""
        assert self.arbiter is not None
        if self.config.static:
            return
        deadline = time.monotonic() + self.config.wake_timeout_s
        while (short := -self.arbiter.room_left()) > 0:
            if time.monotonic() > deadline:
                raise ModelsApiError(
                    503,
                    f"no room for model {model.name!r}: the models hold "
                    f"{format_bytes(short)} more than the budget leaves for its min_kv after "
                    f"{self.config.wake_timeout_s:.0f} s; retry when they are idle",
                )
            self.arbiter.kick()
            await asyncio.sleep(0.1)

    async def remove_model(self, name: str, drain_s: float) -> dict[str, object]:
        """Stop a model's engine and forget it: new requests get 404 at once, those in flight
        get up to ``drain_s`` seconds to finish. ModelsApiError 404 for an unknown name."""
        async with self._models_lock:
            served = self.models.get(name)
            if served is None or served.config.group is not None:
                known = ", ".join(m for m in self.models if self.models[m].config.group is None)
                raise ModelsApiError(
                    404, f"no model named {name!r} is served here (served: {known or 'none'})"
                )
            assert self._router is not None
            self._router.remove(name)
            served.retire()
            deadline = time.monotonic() + drain_s
            while served.in_flight and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            left = served.in_flight
            pid = None if served.engine is None else served.engine.pid
            await self._forget(served)
            logger.info("%s: removed%s", name, f" ({left} requests cut short)" if left else "")
            return {"removed": name, "engine_pid": pid, "requests_cut_short": left}

    async def _forget(self, served: ServedModel) -> None:
        """Stop a model's engine (if any) and drop every trace of it."""
        await served.stop(final=True)
        name = served.name
        self.models.pop(name, None)
        if self._router is not None:
            self._router.remove(name)
        self.config = replace(
            self.config, models=tuple(m for m in self.config.models if m.name != name)
        )
        self.pythons.pop(name, None)
        self.paths.pop(name, None)
        if self.arbiter is not None:
            self.arbiter.remove(name)
        self._publish()

    # -- hooks the models call ------------------------------------------------------------------

    def _changed(self) -> None:
        # Published at once: `elastickv list` shows a state as soon as the log has said it.
        self._publish()
        if self.arbiter is not None:
            self.arbiter.kick()

    async def _restore_kv(self, name: str) -> None:
        model = self.models[name]
        assert self.arbiter is not None
        self.arbiter.set_limit(name, model.config.min_kv)

    async def _release_kv(self, name: str) -> None:
        model = self.models[name]
        assert self.arbiter is not None
        self.arbiter.set_limit(name, max(model.floor_bytes, 1))

    def _request_sleep(self, name: str, wanted: bool) -> None:
        """Ask ``name``'s engine to put its weights to sleep, or withdraw the request; a
        withdrawal from an engine that sleeps times its wake (the ``weights`` tier)."""
        assert self.ledger is not None
        was_asleep = self._sleep_answer(name) == "asleep"
        try:
            self.ledger.request_sleep(name, wanted)
        except LedgerError as exc:  # the engine is gone meanwhile: nothing to ask
            logger.warning("%s: cannot change its sleep request: %s", name, exc)
            return
        if not wanted and was_asleep:
            timer = asyncio.get_running_loop().create_task(self._time_wake(name))
            self._wake_timers.add(timer)
            timer.add_done_callback(self._wake_timers.discard)

    def _sleep_answer(self, name: str) -> str | None:
        """The engine's answer in its record, as the arbiter last read it."""
        info = None if self.arbiter is None else self.arbiter.records.get(name)
        if info is None:
            return None
        return "asleep" if info.asleep else "refused" if info.sleep_refused else None

    async def _time_wake(self, name: str) -> None:
        """Seconds until the engine's record says it is awake again (its weights reloaded)."""
        assert self.arbiter is not None
        began = time.monotonic()
        while time.monotonic() - began < self.config.wake_timeout_s:
            try:
                info = self.arbiter.writer.records().get(name)
            except LedgerError:
                return
            if info is None:  # the engine is gone (stopped, crashed): no wake to time
                return
            if not info.asleep:
                self.metrics.wake.labels(name, "weights").observe(time.monotonic() - began)
                return
            await asyncio.sleep(WAKE_POLL_S)

    async def _engine_ready(self, name: str) -> None:
        """Right after the engine's first health: what it holds now is its floor."""
        if self.config.static:
            return
        assert self.arbiter is not None
        self.models[name].floor_bytes = self.arbiter.committed_of(name) or 0

    def _views(self) -> list[ModelView]:
        views = []
        for m in self.config.models:
            served = self.models.get(m.name)
            state = served.state if served is not None else ModelState.STOPPED
            active = served is not None and (served.in_flight > 0 or served.waiting > 0)
            activity = Activity.ACTIVE if active else _ACTIVITY.get(state, Activity.DOWN)
            if state in (ModelState.STARTING, ModelState.STOPPED, ModelState.FAILED):
                activity = Activity.DOWN
            views.append(
                ModelView(
                    m.name, m.min_kv, self.config.cap_of(m), m.priority, activity,
                    served.floor_bytes if served is not None else 0,
                )
            )  # fmt: skip
        return views

    # -- what operators see ---------------------------------------------------------------------

    def describe(self) -> dict[str, Any]:
        records = self.arbiter.records if self.arbiter is not None else {}
        models = []
        for m in self.models.values():
            info = records.get(m.name)
            used, limit = self._bytes_of(m, info)
            models.append(
                {
                    "name": m.name,
                    "served_name": m.config.served_name,
                    "role": m.config.role,
                    "state": m.state.value,
                    "source": m.config.source,
                    "engine_pid": None if m.engine is None else m.engine.pid,
                    "port": None if m.engine is None else m.engine.launch.port,
                    "in_flight": m.in_flight,
                    "waiting": m.waiting,
                    "min_kv": m.config.min_kv,
                    "cap": self.config.cap_of(m.config),
                    "priority": m.config.priority,
                    "pinned": m.config.pinned,
                    "restarts": m.restarts,
                    "resident_bytes": self.resident.get(m.name),
                    "sleep_after_s": m.config.sleep_after_s,
                    "sleep_refused": m.sleep_refused,
                    "committed_bytes": used,
                    "limit_bytes": limit,
                    "log": None if self._log_dir is None else str(log_path(self._log_dir, m.name)),
                }
            )
        return {
            "url": self.url,
            "mode": self.config.mode,
            "budget_bytes": self.config.budget,
            "models": models,
        }

    def _bytes_of(self, model: ServedModel, info: Any) -> tuple[int | None, int | None]:
        """(held, limit) bytes: the ledger's record; in static mode the fixed share while the
        engine runs (native vLLM keeps its whole KV cache)."""
        if self.config.static:
            share = self.config.cap_of(model.config)
            return (share, share) if model.engine is not None else (None, None)
        if info is None:
            return None, None
        return info.used_bytes, info.limit_desired

    def _publish(self) -> None:
        if self._closing:
            return
        with contextlib.suppress(OSError):
            write_state(self.describe(), self.ledger_dir)

    def _readings(self) -> tuple[int, Sequence[ModelReading]]:
        arbiter = self.arbiter
        records = arbiter.records if arbiter is not None else {}
        readings = []
        for m in self.models.values():
            info = records.get(m.name)
            used, limit = self._bytes_of(m, info)
            readings.append(
                ModelReading(
                    name=m.name,
                    state=m.state.value,
                    in_flight=m.in_flight,
                    waiting=m.waiting,
                    committed_bytes=used or 0,
                    limit_bytes=limit,
                    refusals=0 if info is None else info.refusals,
                    restarts=m.restarts,
                    limit_raises=0 if arbiter is None else arbiter.raises[m.name],
                    limit_cuts=0 if arbiter is None else arbiter.cuts[m.name],
                    resident_bytes=self.resident.get(m.name),
                )
            )
        return self.config.budget, readings
