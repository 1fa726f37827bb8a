"""Let NIXL's progress thread wait for events instead of spinning (vLLM 0.32, P/D).

NIXL's UCX backend runs a progress thread in every process that holds an agent (each vLLM
worker of a P/D engine). The thread sleeps in ``poll()`` on UCX's event descriptor, with a
timeout as a fallback for a wake-up UCX misses. NIXL's Python wrapper, through which vLLM
creates its agents, sets that timeout to 0, so the thread never sleeps: an idle P/D engine
keeps one core busy per worker (measured on a CPU host: 0.99 of a core per worker, with no
request in flight). On a host shared by several engines, that is CPU an idle
engine never gives back.

``ELASTICKV_NIXL_PROGRESS_WAIT_MS=N`` creates this process's NIXL agents with an ``N`` ms
timeout instead (NIXL's own ``pthrDelay`` setting, which its C++ and Rust interfaces expose
and its Python wrapper does not). Transfers still wake the thread through the event
descriptor; only a missed wake-up waits up to ``N`` ms. 0 keeps NIXL's spin. Unset, the wait
is 5 ms on vLLM's CPU backend, where the spinning thread takes the core the engine computes
on (a P/D pair on two cores: 374 output tokens/s spinning, 642 waiting), and 0 elsewhere:
on a GPU host with cores to spare, busy polling is what NIXL's users expect.
"""

from __future__ import annotations

import importlib
import logging
import sys
from typing import Any

logger = logging.getLogger(__name__)

NIXL_UTILS_MODULE = "vllm.distributed.nixl_utils"
MAX_WAIT_MS = 1000  # beyond a second, a missed wake-up stalls a transfer visibly
CPU_DEFAULT_WAIT_MS = 5


class _BindingsWithWait:
    """NIXL's bindings module as its Python wrapper sees it, with agents created with a
    progress-thread timeout of ``wait_ms``; every other name is the module's own."""

    def __init__(self, bindings: Any, wait_ms: int) -> None:
        self.bindings = bindings
        self.wait_ms = wait_ms

    def nixlAgent(self, name: str, config: Any) -> Any:
        config.pthrDelay = self.wait_ms * 1000  # in µs; NIXL polls in whole ms
        return self.bindings.nixlAgent(name, config)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.bindings, name)


def default_wait_ms() -> int:
    """The wait when none is set: ``CPU_DEFAULT_WAIT_MS`` on vLLM's CPU backend, else 0.
    Call it once vLLM has chosen its platform (a connector is being created)."""
    try:
        platforms = importlib.import_module("vllm.platforms")
    except ImportError:
        return 0
    return CPU_DEFAULT_WAIT_MS if platforms.current_platform.is_cpu() else 0


def apply_when_loaded(wait_ms: int | None) -> bool:
    """Give the NIXL agents of this process a progress wait of ``wait_ms`` (None:
    :func:`default_wait_ms`) from the moment vLLM loads NIXL, or now if it has; whether vLLM's
    NIXL loader was found. Nothing of NIXL is imported here: an engine without a NIXL
    connector never loads it."""
    try:
        utils = importlib.import_module(NIXL_UTILS_MODULE)
    except ImportError:
        return False

    def apply() -> None:
        install(default_wait_ms() if wait_ms is None else wait_ms)

    if "NixlWrapper" in vars(utils):  # vLLM has loaded NIXL already
        apply()
        return True
    load = getattr(utils, "_load_nixl_attr", None)
    if load is None:
        return False
    load = getattr(load, "__elastickv_original__", load)

    def load_nixl_attr(name: str) -> Any:
        value = load(name)
        if name == "NixlWrapper" and value is not None:
            apply()
        return value

    setattr(load_nixl_attr, "__elastickv_original__", load)  # noqa: B010
    setattr(utils, "_load_nixl_attr", load_nixl_attr)  # noqa: B010
    return True


def install(wait_ms: int) -> bool:
    """Create this process's later NIXL agents with a ``wait_ms`` progress timeout
    (idempotent; 0 restores NIXL's own); whether NIXL was found."""
    if not 0 <= wait_ms <= MAX_WAIT_MS:
        raise ValueError(f"NIXL progress wait of {wait_ms} ms: use 0 to {MAX_WAIT_MS}")
    try:
        # vLLM's own loader: it sets UCX's environment before NIXL is first imported.
        agent_class = getattr(importlib.import_module(NIXL_UTILS_MODULE), "NixlWrapper", None)
    except ImportError:
        return False
    if agent_class is None:  # vLLM found no NIXL
        return False
    api = sys.modules[agent_class.__module__]
    bindings = getattr(api, "nixlBind")  # noqa: B009 (an untyped module's name)
    if isinstance(bindings, _BindingsWithWait):
        bindings.wait_ms = wait_ms
    elif wait_ms:
        setattr(api, "nixlBind", _BindingsWithWait(bindings, wait_ms))  # noqa: B010
        logger.info(
            "elastickv: NIXL's progress thread waits for events, at most %d ms, instead of "
            "spinning (ELASTICKV_NIXL_PROGRESS_WAIT_MS; 0 keeps NIXL's spin)",
            wait_ms,
        )
    return True


def installed_wait_ms() -> int:
    """The timeout this process's NIXL agents get: 0 when NIXL's own (or NIXL not loaded)."""
    utils = sys.modules.get(NIXL_UTILS_MODULE)
    agent_class = vars(utils).get("NixlWrapper") if utils is not None else None  # no load
    api = sys.modules.get(getattr(agent_class, "__module__", ""))
    bindings = getattr(api, "nixlBind", None)
    return bindings.wait_ms if isinstance(bindings, _BindingsWithWait) else 0
