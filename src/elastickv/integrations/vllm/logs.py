"""elastickv's log lines in vLLM's log: same stream, same format, same level.

vLLM configures only its own ``vllm`` logger, so the ``elastickv`` logger's records were
dropped (below WARNING) and a user could not see that elastickv was on. We forward them to
whatever handlers the ``vllm`` logger has at the time of each record (vLLM may reconfigure
logging after the plugin loaded).
"""

from __future__ import annotations

import logging

ROOT = "elastickv"


class ForwardToVllm(logging.Handler):
    """Hands each record to the ``vllm`` logger's current handlers."""

    def emit(self, record: logging.LogRecord) -> None:
        for handler in logging.getLogger("vllm").handlers:
            if record.levelno >= handler.level:
                handler.handle(record)


def join_vllm_log() -> bool:
    """Route the ``elastickv`` logger into vLLM's log (idempotent). False, and nothing
    changed, when vLLM's logging is off (``VLLM_CONFIGURE_LOGGING=0``): the application's
    own logging configuration then decides, as for any library."""
    ours = logging.getLogger(ROOT)
    if any(isinstance(h, ForwardToVllm) for h in ours.handlers):
        return True
    vllm_logger = logging.getLogger("vllm")
    if not vllm_logger.handlers:
        return False
    ours.addHandler(ForwardToVllm())
    ours.propagate = False
    if ours.level == logging.NOTSET:
        ours.setLevel(vllm_logger.getEffectiveLevel())
    return True
