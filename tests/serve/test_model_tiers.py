"""One model's idle tiers in order, on serve's clock (``apply_idle_policy(now)``), with hooks
that record what serve would do to the engine and the ledger (the whole path, with real
processes and a real ledger, is in test_serve_run.py and, with real vLLM, in
tests/integration_vllm/test_vllm_plugin_v032_serve.py)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from elastickv.serve.config import ModelConfig
from elastickv.serve.engine import EngineLaunch
from elastickv.serve.model import SLEEP_ANSWER_S, ModelHooks, ModelState, ServedModel


class Engine:
    """What the hooks reach: the engine's answer to a sleep request, and the calls made."""

    def __init__(self) -> None:
        self.answer: str | None = None
        self.calls: list[tuple[str, Any]] = []

    def hooks(self) -> ModelHooks:
        async def restore(name: str) -> None:
            self.calls.append(("restore_kv", name))

        async def release(name: str) -> None:
            self.calls.append(("release_kv", name))

        async def ready(name: str) -> None:
            return None

        return ModelHooks(
            launch=lambda m: EngineLaunch(m.name, (), {}, 0, Path("/dev/null")),
            session=None,  # type: ignore[arg-type]
            changed=lambda: None,
            restore_kv=restore,
            release_kv=release,
            engine_ready=ready,
            woke=lambda name, tier, seconds: self.calls.append(("woke", tier)),
            request_sleep=lambda name, wanted: self.calls.append(("sleep", wanted)),
            sleep_answer=lambda name: self.answer,
        )


def model(engine: Engine, **fields: Any) -> ServedModel:
    config = ModelConfig(
        name="m", source="tiny-llama", release_after_s=30, stop_after_s=600, **fields
    )
    served = ServedModel(config, engine.hooks(), queue_limit=4, wake_timeout_s=1)
    served.state = ModelState.IDLE
    served.last_active = 0.0
    return served


def test_released_then_asleep_once_the_engine_answers_then_stopped() -> None:
    async def main() -> None:
        engine = Engine()
        m = model(engine)
        await m.apply_idle_policy(29.0)
        assert m.current() is ModelState.IDLE and engine.calls == []
        await m.apply_idle_policy(31.0)
        assert m.current() is ModelState.KV_RELEASED and engine.calls == [("release_kv", "m")]
        await m.apply_idle_policy(121.0)  # sleep_after: 2 min by default
        assert engine.calls[-1] == ("sleep", True) and m.current() is ModelState.KV_RELEASED
        await m.apply_idle_policy(122.0)  # no answer yet: it waits
        assert m.current() is ModelState.KV_RELEASED and len(engine.calls) == 2
        engine.answer = "asleep"
        await m.apply_idle_policy(123.0)
        assert m.current() is ModelState.ASLEEP and len(engine.calls) == 2
        await m.apply_idle_policy(600.0)
        assert m.current() is ModelState.STOPPED

    asyncio.run(main())


def test_a_request_to_a_sleeping_model_withdraws_the_sleep_and_is_admitted_at_once() -> None:
    async def main() -> None:
        engine = Engine()
        m = model(engine)
        await m.apply_idle_policy(121.0)  # idle straight to sleep: its KV released first
        assert engine.calls == [("release_kv", "m"), ("sleep", True)]
        engine.answer = "asleep"
        await m.apply_idle_policy(122.0)
        assert m.current() is ModelState.ASLEEP
        async with m.serving() as waited:
            assert m.current() is ModelState.SERVING and m.waiting == 0 and waited < 1
        assert engine.calls[2:] == [("sleep", False), ("restore_kv", "m"), ("woke", "kv")]
        assert m.current() is ModelState.IDLE and m.sleep_asked_at is None

    asyncio.run(main())


def test_a_request_while_the_answer_is_pending_withdraws_it() -> None:
    async def main() -> None:
        engine = Engine()
        m = model(engine)
        await m.apply_idle_policy(121.0)
        async with m.serving():
            pass
        assert engine.calls[2] == ("sleep", False) and m.sleep_asked_at is None
        engine.answer = "asleep"  # too late: the request was withdrawn, nothing reads it
        await m.apply_idle_policy(m.last_active + 1)
        assert m.current() is ModelState.IDLE

    asyncio.run(main())


def test_an_engine_that_refuses_or_never_answers_stays_released_and_is_not_asked_again() -> None:
    async def main() -> None:
        for answer, why in (("refused", "cannot release"), (None, "did not answer within")):
            engine = Engine()
            m = model(engine)
            engine.answer = answer
            await m.apply_idle_policy(121.0)
            await m.apply_idle_policy(121.0 + (1 if answer else SLEEP_ANSWER_S))
            assert m.current() is ModelState.KV_RELEASED
            assert m.sleep_refused is not None and why in m.sleep_refused
            assert engine.calls[-1] == ("sleep", False)  # withdrawn
            calls = len(engine.calls)
            await m.apply_idle_policy(300.0)
            assert len(engine.calls) == calls and m.current() is ModelState.KV_RELEASED

    asyncio.run(main())


def test_sleep_after_never_goes_from_released_to_stopped() -> None:
    async def main() -> None:
        engine = Engine()
        m = model(engine, sleep_after_s=None)
        await m.apply_idle_policy(31.0)
        await m.apply_idle_policy(300.0)
        assert m.current() is ModelState.KV_RELEASED and ("sleep", True) not in engine.calls
        await m.apply_idle_policy(600.0)
        assert m.current() is ModelState.STOPPED

    asyncio.run(main())


def test_an_engine_woken_behind_serves_back_stays_asleep_for_serve() -> None:
    """A step that reached the engine another way wakes it for that step; the request still
    stands, so it sleeps again by itself: serve neither gives up nor asks anew."""

    async def main() -> None:
        engine = Engine()
        m = model(engine)
        engine.answer = "asleep"
        await m.apply_idle_policy(121.0)
        await m.apply_idle_policy(122.0)
        assert m.current() is ModelState.ASLEEP
        engine.answer = None
        await m.apply_idle_policy(122.0 + 2 * SLEEP_ANSWER_S)
        assert m.current() is ModelState.ASLEEP and m.sleep_refused is None
        assert engine.calls.count(("sleep", True)) == 1 and ("sleep", False) not in engine.calls

    asyncio.run(main())
