"""The one error type the plugin raises at start-up, so users see why elastickv refused."""

from __future__ import annotations


class ElasticKVStartupError(RuntimeError):
    """elastickv cannot serve this vLLM engine as configured; vLLM must not start natively."""
