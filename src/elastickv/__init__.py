"""elastickv: an elastic, virtual-memory-backed KV cache for LLM serving."""

__version__ = "0.1.0"
