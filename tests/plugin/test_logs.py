"""elastickv's records reach vLLM's log handlers (the real vLLM log is checked in the
server tests); the refusal log is rate-limited."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

from elastickv.integrations.vllm import logs
from elastickv.integrations.vllm.engine.startup import RefusalLog


class Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def vllm_handler() -> Iterator[Collect]:
    vllm_logger, ours = logging.getLogger("vllm"), logging.getLogger(logs.ROOT)
    saved = (list(vllm_logger.handlers), list(ours.handlers), ours.level, ours.propagate)
    handler = Collect()
    handler.setLevel(logging.INFO)
    vllm_logger.handlers[:] = [handler]
    ours.handlers[:] = []
    ours.setLevel(logging.NOTSET)
    try:
        yield handler
    finally:
        vllm_logger.handlers[:] = saved[0]
        ours.handlers[:] = saved[1]
        ours.setLevel(saved[2])
        ours.propagate = saved[3]


def test_elastickv_records_go_to_vllms_handlers(vllm_handler: Collect) -> None:
    logging.getLogger("vllm").setLevel(logging.INFO)
    assert logs.join_vllm_log() and logs.join_vllm_log()  # idempotent
    assert len(logging.getLogger(logs.ROOT).handlers) == 1
    logging.getLogger("elastickv.integrations.vllm.engine.startup").info("on")
    logging.getLogger("elastickv.x").debug("too detailed")
    assert [r.getMessage() for r in vllm_handler.records] == ["on"]


def test_without_vllm_logging_nothing_changes(vllm_handler: Collect) -> None:
    logging.getLogger("vllm").handlers[:] = []
    assert not logs.join_vllm_log()
    assert logging.getLogger(logs.ROOT).handlers == []


def test_refusals_are_logged_first_then_once_per_interval(
    vllm_handler: Collect, monkeypatch: pytest.MonkeyPatch
) -> None:
    logging.getLogger("vllm").setLevel(logging.INFO)
    logs.join_vllm_log()
    now = [100.0]
    monkeypatch.setattr("elastickv.integrations.vllm.engine.startup.time.monotonic", lambda: now[0])
    refusals = RefusalLog("tiny:8000", interval_s=10.0)
    for _ in range(5):
        refusals.refused(3, lambda: 2 << 20)
    now[0] += 10.0
    refusals.refused(1, lambda: 2 << 20)
    lines = [r.getMessage() for r in vllm_handler.records]
    assert len(lines) == 2 and refusals.count == 6
    assert (
        "'tiny:8000' is at its memory limit (2.0 MiB committed): 1 allocation refused" in lines[0]
    )
    assert "5 allocations refused (last: 1 blocks)" in lines[1]  # 4 held back + this one
