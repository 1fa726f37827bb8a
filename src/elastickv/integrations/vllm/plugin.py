"""The ``vllm.general_plugins`` entry point. Inert unless ``ELASTICKV=1`` (or
``ELASTICKV_SCHEDULER_CLOCK``, which clocks a native engine's scheduler too).

vLLM loads general plugins in every process it starts; :func:`register` is idempotent and
either installs every hook the detected contract needs or raises — never half of them.
"""

from __future__ import annotations

import logging
import multiprocessing
import threading

from elastickv.geometry import Contract
from elastickv.integrations.vllm.config import (
    ENABLE_VAR,
    ElasticConfig,
    enabled,
    ignored_settings,
)
from elastickv.integrations.vllm.logs import join_vllm_log
from elastickv.integrations.vllm.scheduler import scheduler_clock
from elastickv.integrations.vllm.scheduler.store import PolicyFactory, default_policy

logger = logging.getLogger(__name__)
_install_lock = threading.Lock()


def register() -> None:
    """Entry point: validate settings and the vLLM contract, then install the hooks."""
    join_vllm_log()
    clock = scheduler_clock.clock_file_from_env()
    if not enabled():
        ignored = ignored_settings()
        # Once, from the process the user started (vLLM's engine and worker processes are
        # multiprocessing children and load the plugin again).
        if ignored and multiprocessing.parent_process() is None:
            logger.warning(
                "elastickv: %s set but %s=1 is not: vLLM runs without elastickv and these "
                "settings do nothing (set %s=1 to enable elastickv)",
                ", ".join(ignored),
                ENABLE_VAR,
                ENABLE_VAR,
            )
        if clock is not None:
            scheduler_clock.install(clock)
        return
    install(ElasticConfig.from_env())
    if clock is not None:
        scheduler_clock.install(clock)  # after the hooks, so that they are counted


def install(config: ElasticConfig, policy_factory: PolicyFactory = default_policy) -> Contract:
    """Install the hooks for the installed vLLM (idempotent); returns the contract used."""
    from elastickv.integrations.vllm import preflight
    from elastickv.integrations.vllm.contract import detect_contract, installed_version

    contract = detect_contract()
    with _install_lock:
        preflight.install(config.resolved_virtual_capacity())
        if contract is Contract.V032:
            from elastickv.integrations.vllm.engine import engine_core
            from elastickv.integrations.vllm.scheduler import scheduler_hooks
            from elastickv.integrations.vllm.transfer import kv_transfer
            from elastickv.integrations.vllm.worker import worker_v032

            worker_v032.install(config)
            engine_core.install(config, policy_factory)
            scheduler_hooks.install()
            # NIXL: refuse other layouts, hold unread blocks, the progress thread's wait.
            kv_transfer.install(config.kv_read_hold_s, config.nixl_progress_wait_ms)
        elif contract is Contract.V028:
            from elastickv.integrations.vllm.engine import engine_core
            from elastickv.integrations.vllm.scheduler import scheduler_v028
            from elastickv.integrations.vllm.worker import worker_v028

            worker_v028.install(config)
            engine_core.install(config, policy_factory)  # same EngineCore hook in 0.28
            scheduler_v028.install()
    logger.debug(
        "elastickv: hooks installed for vLLM %s (%s contract), page %d B, budget %s",
        installed_version(),
        contract.value,
        config.page_size,
        config.budget_text(),
    )
    return contract
