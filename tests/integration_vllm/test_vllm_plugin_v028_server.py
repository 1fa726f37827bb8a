"""elastickv under vLLM 0.28's OpenAI server (``ELASTICKV=1`` is the only difference): health,
repeated functional prompts and 16 concurrent greedy completions identical to a native server,
the engine in `elastickv list` while it runs, SIGTERM leaves no process and no ledger record.

The tests are shared with the other vLLM series (:mod:`server_tests`); the servers run once
per session (``conftest.servers``) and also feed the validation table.
"""

from __future__ import annotations

from server_tests import (
    test_server_completions_identical_to_native,
    test_server_footprint_returns_after_load,
    test_server_health_and_elastic_pool,
    test_server_log_says_elastickv_is_on,
    test_server_metrics_count_commits_and_split_blocks,
    test_server_registers_in_ledger_by_model_and_port,
    test_server_sigterm_leaves_no_process,
)

__all__ = [
    "test_server_completions_identical_to_native",
    "test_server_footprint_returns_after_load",
    "test_server_health_and_elastic_pool",
    "test_server_log_says_elastickv_is_on",
    "test_server_metrics_count_commits_and_split_blocks",
    "test_server_registers_in_ledger_by_model_and_port",
    "test_server_sigterm_leaves_no_process",
]
