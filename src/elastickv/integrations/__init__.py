"""Integrations of the elastic KV cache into serving engines (each imported only when used)."""
