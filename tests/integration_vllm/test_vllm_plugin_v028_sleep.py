"""Sleep and wake of a running elastic engine's weights, real vLLM 0.28; the tests are
shared with the other vLLM series (:mod:`sleep_tests`)."""

from __future__ import annotations

from sleep_tests import (
    sleep_run,
    test_a_request_to_a_sleeping_engine_wakes_it_and_is_answered,
    test_outputs_after_every_wake_equal_the_reference,
    test_release_and_restore_keep_the_parameter_objects,
    test_sleep_releases_the_weights_memory,
    test_wake_reports_reload_and_restore,
)

__all__ = [
    "sleep_run",
    "test_a_request_to_a_sleeping_engine_wakes_it_and_is_answered",
    "test_outputs_after_every_wake_equal_the_reference",
    "test_release_and_restore_keep_the_parameter_objects",
    "test_sleep_releases_the_weights_memory",
    "test_wake_reports_reload_and_restore",
]
