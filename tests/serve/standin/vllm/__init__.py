"""A stand-in for vLLM in serve's own tests: only ``vllm.entrypoints.openai.api_server``."""
