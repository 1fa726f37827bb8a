"""``elastickv serve``: several models on one device behind one OpenAI endpoint, sharing the
device's KV memory by demand.

Layers, each in its own module: :mod:`.config` (what to serve, validated once),
:mod:`.engine` (one vLLM OpenAI server process), :mod:`.leftovers` (what an engine leaves
when it ends: its IPC sockets and shared memory), :mod:`.model` (a model's life: start, serve,
release, stop, wake, restart), :mod:`.arbiter` (the shared budget, through ledger limits),
:mod:`.router` (the HTTP endpoint), :mod:`.metrics`, :mod:`.state_file` (what ``elastickv
list`` / ``top`` show) and :mod:`.app`, which wires them together.
"""

from elastickv.serve.config import (
    ModelConfig,
    ServeConfig,
    ServeConfigError,
    builtin_config,
    config_from_flags,
    load_config,
)

__all__ = [
    "ModelConfig",
    "ServeConfig",
    "ServeConfigError",
    "builtin_config",
    "config_from_flags",
    "load_config",
]
