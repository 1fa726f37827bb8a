"""See ``vllm.entrypoints.openai.api_server``."""
