"""The vLLM general plugin: vLLM's KV cache on elastickv storage.

Importing this package imports nothing from vLLM; :func:`plugin.register` (the
``vllm.general_plugins`` entry point) does, and only when ``ELASTICKV=1``.
"""
