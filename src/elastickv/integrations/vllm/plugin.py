"""The ``vllm.general_plugins`` entry point. Inert unless ``ELASTICKV=1``.

vLLM loads general plugins in every process it starts; :func:`register` is idempotent and
either installs every hook the detected contract needs or raises — never half of them.
"""

from __future__ import annotations

import logging
import threading

from elastickv.geometry import Contract
from elastickv.integrations.vllm.config import ElasticConfig, enabled
from elastickv.integrations.vllm.store import PolicyFactory, default_policy

logger = logging.getLogger(__name__)
_install_lock = threading.Lock()


def register() -> None:
    """Entry point: validate settings and the vLLM contract, then install the hooks."""
    if not enabled():
        return
    install(ElasticConfig.from_env())


def install(config: ElasticConfig, policy_factory: PolicyFactory = default_policy) -> Contract:
    """Install the hooks for the installed vLLM (idempotent); returns the contract used."""
    from elastickv.integrations.vllm.contract import detect_contract, installed_version

    contract = detect_contract()
    with _install_lock:
        if contract is Contract.V032:
            from elastickv.integrations.vllm import engine_core, scheduler_v032, worker_v032

            worker_v032.install(config, policy_factory)
            engine_core.install(config, policy_factory)
            scheduler_v032.install()
        elif contract is Contract.V028:
            from elastickv.integrations.vllm import engine_core, scheduler_v028, worker_v028

            worker_v028.install(config, policy_factory)
            engine_core.install(config, policy_factory)  # same EngineCore hook in 0.28
            scheduler_v028.install()
    logger.info(
        "elastickv: vLLM %s, %s contract, page %d B, hot %d..%d pages, virtual %d B, budget %s",
        installed_version(),
        contract.value,
        config.page_size,
        config.hot_min_pages,
        config.hot_max_pages,
        config.resolved_virtual_capacity(),
        config.budget_bytes,
    )
    return contract
