"""The benchmark monitor counts each workload's own preemptions and queue time: vLLM's
counters are cumulative per engine process, so the first look is a baseline (a bug made the
idle workload report the correlated workload's preemptions and queue seconds again)."""

from __future__ import annotations

from elastickv.bench.monitor import Monitor


def scrape(preemptions: float, queue_s: float, waiting: float) -> str:
    labels = '{engine="0",model_name="m"}'
    return "\n".join(
        [
            "# HELP vllm:num_preemptions_total Cumulative number of preemption",
            f"vllm:num_preemptions_total{labels} {preemptions}",
            f"vllm:request_queue_time_seconds_sum{labels} {queue_s}",
            f"vllm:request_queue_time_seconds_count{labels} 99.0",
            f"vllm:num_requests_waiting{labels} {waiting}",
        ]
    )


def test_counters_count_from_the_baseline_and_new_engines_from_zero() -> None:
    monitor = Monitor("http://127.0.0.1:1", ["m"])
    monitor.absorb("m", 100, scrape(7, 142.0, 26), baseline=True)  # an earlier workload's
    assert monitor.preemptions["m"] == monitor.queue_s["m"] == monitor.max_waiting["m"] == 0
    monitor.absorb("m", 100, scrape(9, 143.5, 3))
    monitor.absorb("m", 100, scrape(9, 144.0, 0))
    assert (monitor.preemptions["m"], monitor.queue_s["m"], monitor.max_waiting["m"]) == (
        2,
        2.0,
        3,
    )
    monitor.absorb("m", 200, scrape(1, 0.5, 0))  # the engine restarted: a new process
    assert (monitor.preemptions["m"], monitor.queue_s["m"]) == (3, 2.5)
