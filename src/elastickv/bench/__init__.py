"""Load for ``elastickv serve``: seeded multi-model workloads, a streaming client that
measures what users feel (TTFT, TPOT, end-to-end), summaries and plots. Used by
``benchmarks/bench_serve.py`` (static split vs elastic) and by ``elastickv demo``."""
