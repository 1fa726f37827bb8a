"""The worker's side: the KV tensors on the worker's own elastic range, the geometry read from
vLLM's config for each contract, and the page operations applied before each step."""
