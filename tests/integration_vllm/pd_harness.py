"""Helpers for the P/D tests (real vLLM 0.32, NIXL over UCX loopback): the engines'
connector configuration, prompts of several blocks, the two-step exchange, and overwriting a
pool's committed pages."""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy
import psutil
from plugin_harness import ELASTIC, PAGE, Server, pool_fds

from elastickv.serve.pd import prefill_request

MAX_TOKENS = 16
BLOCK = 32
# vLLM's prefiller frees the blocks it keeps for a decoder when their lease runs out; a short
# one, so that the late-decoder step outlives it. elastickv holds unread blocks HOLD_S more.
LEASE_S = 4
HOLD_S = 60
KV_TRANSFER = json.dumps(
    {
        "kv_connector": "NixlConnector",
        "kv_role": "kv_both",
        "kv_buffer_device": "cpu",
        "kv_connector_extra_config": {"kv_lease_duration": LEASE_S},
    }
)
ENGINE: dict[str, str | None] = {
    "dtype": "float32",
    "kv-transfer-config": KV_TRANSFER,
    "gpu-memory-utilization": "0.2",
}
# Each engine's own limit, 32 pages (1 MiB): the 16 concurrent reference prompts take 1.2 MiB
# unlimited. The prefiller must hold every prompt it has prefilled until the decoder reads it:
# in the scrambling step, 4 prompts held at once (8 do not fit: their prefills wait for pages
# only the decoder's reads would free).
BUDGET = 32 * PAGE


def prompts(n: int, salt: str) -> list[str]:
    """``n`` distinct prompts of three to four blocks (70 to 120 tokens)."""
    words = ["alpha", "beta", "gamma", "delta", "sky", "river", "stone", "light", "seven"]
    return [
        f"{salt} {i}: " + " ".join(words[(i * 5 + k * 7) % 9] for k in range(20 + 2 * i))
        for i in range(n)
    ]


def post(server: Server, body: dict[str, Any]) -> dict[str, Any]:
    """A greedy completion; the response, or ``{"status": code, "error": body}``."""
    body = {"model": server.model, "temperature": 0, "ignore_eos": True, **body}
    body["return_token_ids"] = True
    request = urllib.request.Request(
        server.url("/v1/completions"),
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=180) as response:
            out: dict[str, Any] = json.loads(response.read())
            return out
    except urllib.error.HTTPError as exc:
        return {"status": exc.code, "error": exc.read().decode(errors="replace")}


def token_ids(response: dict[str, Any]) -> list[int] | None:
    if "choices" not in response:
        return None
    ids: list[int] = response["choices"][0]["token_ids"]
    return ids


def prefill_step(prefill: Server, prompt: str) -> dict[str, Any]:
    return post(prefill, prefill_request({"prompt": prompt}))


def decode_step(decode: Server, prompt: str, prefilled: dict[str, Any]) -> dict[str, Any]:
    params = prefilled.get("kv_transfer_params")
    assert params, f"the prefill response carries no kv_transfer_params: {prefilled}"
    return post(decode, {"prompt": prompt, "max_tokens": MAX_TOKENS, "kv_transfer_params": params})


def exchange(prefill: Server, decode: Server, prompt: str) -> tuple[dict[str, Any], ...]:
    prefilled = prefill_step(prefill, prompt)
    return prefilled, decode_step(decode, prompt, prefilled)


def parallel(fn: Any, *iterables: list[Any]) -> list[Any]:
    with ThreadPoolExecutor(len(iterables[0])) as pool:
        return list(pool.map(fn, *iterables))


def scramble_pool(server: Server) -> int:
    """:func:`scramble_pool_of` the server's processes (its worker holds the pool)."""
    return scramble_pool_of(list(server.descendants))


def scramble_pool_of(pids: list[int]) -> int:
    """Overwrite every page committed in the KV pool that ``pids`` hold with random float32
    values (through ``/proc/<pid>/fd``; ``SEEK_DATA`` finds them, no page is added); bytes
    written.

    Finite values, not random bytes: random bytes hold NaN and infinity patterns, and the
    committed pages include the null block and the unwritten tail of partial blocks, which
    attention reads and masks (a NaN times a zero weight stays NaN). Every later prompt that
    touched them then decoded token 0 sixteen times: a poisoned engine, not a transfer."""
    holders = pool_fds(pids)  # the worker's pool (the scheduler holds none)
    paths = [path for held in holders.values() for path in held]
    assert len({os.stat(path).st_ino for path in paths}) == 1, holders  # one pool (TP 1)
    noise = numpy.random.default_rng(0)
    written = 0
    fd = os.open(paths[0], os.O_RDWR)
    try:
        size = os.fstat(fd).st_size
        offset = 0
        while offset < size:
            try:
                start = os.lseek(fd, offset, os.SEEK_DATA)
            except OSError:  # ENXIO: no data after offset
                break
            end = os.lseek(fd, start, os.SEEK_HOLE)
            for chunk in range(start, end, 1 << 20):
                length = min(1 << 20, end - chunk)
                written += os.pwrite(fd, noise.standard_normal(length // 4, "f4").tobytes(), chunk)
            offset = end
    finally:
        os.close(fd)
    return written


def engine_env(side_port: int, core: int) -> dict[str, str]:
    return {
        **ELASTIC,
        "ELASTICKV_BUDGET": str(BUDGET),
        "ELASTICKV_KV_READ_HOLD": str(HOLD_S),
        "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side_port),
        "VLLM_CPU_OMP_THREADS_BIND": str(core),
    }


def vllm_busy_loop_s() -> float:
    """How long vLLM's message-queue readers (a TP engine's workers, its engine core) keep
    polling after their last read before they sleep on a socket: ``busy_loop_s`` of vLLM's
    ``SpinCondition``, read from the installed vLLM."""
    import inspect

    from vllm.distributed.device_communicators.shm_broadcast import SpinCondition

    return float(inspect.signature(SpinCondition).parameters["busy_loop_s"].default)


# After vLLM's busy loop: the readers' last reads came before the last response did, so
# they have all gone to sleep by then; the margin covers reading the clocks.
SETTLE_MARGIN_S = 2.0


def idle_cpu_s(servers: list[Server], seconds: float = 2.0) -> float:
    """CPU seconds the servers' processes use over ``seconds`` with no request in flight,
    from vLLM's busy loop after the last one (its readers keep polling their message queue
    that long after their last read, by design; see :func:`vllm_busy_loop_s`)."""
    settle_s = vllm_busy_loop_s() + SETTLE_MARGIN_S

    def used() -> float:
        total = 0.0
        for server in servers:
            for pid in [server.proc.pid, *server.descendants]:
                try:
                    times = psutil.Process(pid).cpu_times()
                except psutil.Error:
                    continue
                total += times.user + times.system
        return total

    time.sleep(settle_s)
    for server in servers:
        server.snapshot_descendants()
    before = used()
    time.sleep(seconds)
    return used() - before
