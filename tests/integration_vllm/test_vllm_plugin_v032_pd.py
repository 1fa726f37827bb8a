"""Prefill/decode disaggregation on elastic storage, real vLLM 0.32 and real NIXL (UCX over
loopback): a prefill and a decode OpenAI server, both ``ELASTICKV=1``, vLLM's
``NixlConnector`` moving the prompt's blocks from one pool to the other.

One run of each server for the whole module (``pd`` below), the two engines on the machine's
two cores (``VLLM_CPU_OMP_THREADS_BIND=0`` / ``=1``), each with its own NIXL side channel:

1. the prompts on the prefill server alone (the reference: one elastic engine);
2. the two-step exchange for the same prompts: the prefill request
   (``do_remote_decode``, ``max_tokens=1``) and its ``kv_transfer_params`` with the decode
   request (one thread per prompt, as a router does); both engines in the ledger while
   serving, each within its own ``ELASTICKV_BUDGET``, which the reference run exceeds;
3. a late decoder: 4 prompts prefilled, then the decode requests held back past the
   prefiller's (4 s) lease while other prompts run on the prefiller; elastickv holds the
   unread blocks (``ELASTICKV_KV_READ_HOLD``) and the decoder reads the right KV;
4. for 4 other prompts, with every page the prefiller has committed overwritten with random
   values between the two steps (the decode output must change: the KV really crossed);
5. a decode request whose ``elastickv_read_by`` is past (set so by the test) and whose
   prefill blocks were overwritten: the decoder computes the prompt itself (right tokens);
6. a decode server with ``--block-size 64`` against the prefiller's 32: refused at the NIXL
   handshake, with both values in the error; never tokens.

Float32, as in the TP tests: greedy ids that do not depend on the batch's composition.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy
import pytest
from plugin_harness import (
    ELASTIC,
    PAGE,
    Server,
    free_port,
    ledger_list,
    openai_server,
    pool_fds,
    terminate,
)

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
MISMATCH = "block size: this engine 64, remote engine 32"
HELD = "ran out before its decoder read the blocks"
RECOMPUTED = "computing its prompt here instead of reading stale blocks"


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
    """Overwrite every page the server's worker has committed in its pool with random float32
    values (through ``/proc/<pid>/fd``; ``SEEK_DATA`` finds them, no page is added); bytes
    written.

    Finite values, not random bytes: random bytes hold NaN and infinity patterns, and the
    committed pages include the null block and the unwritten tail of partial blocks, which
    attention reads and masks (a NaN times a zero weight stays NaN). Every later prompt that
    touched them then decoded token 0 sixteen times: a poisoned engine, not a transfer."""
    holders = pool_fds(list(server.descendants))  # the worker's pool, and the scheduler's fds
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


@pytest.fixture(scope="module")
def pd(cache_root: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from elastickv.models import ensure_tiny_model

    model = str(ensure_tiny_model("tiny-llama"))
    logs = tmp_path_factory.mktemp("pd-logs")
    ledger_dir = cache_root / "ledger"
    same = prompts(8, "Request")
    other = prompts(4, "Query")
    late = prompts(4, "Late")
    stale = prompts(2, "Stale")
    result: dict[str, Any] = {"prompts": same}
    started = time.monotonic()
    with contextlib.ExitStack() as stack:
        prefill = stack.enter_context(
            openai_server(
                cache_root, model, engine_env(free_port(), 0), logs / "prefill.log", ENGINE
            )
        )
        with openai_server(
            cache_root, model, engine_env(free_port(), 1), logs / "decode.log", ENGINE
        ) as decode:
            result["startup_s"] = round(time.monotonic() - started, 1)
            result["reference"] = parallel(
                lambda p: post(prefill, {"prompt": p, "max_tokens": MAX_TOKENS}),
                same + other + late + stale,
            )
            # As a router does it: each prompt's decode request follows its own prefill.
            exchanged = parallel(lambda p: exchange(prefill, decode, p), same)
            result["prefilled"] = [pair[0] for pair in exchanged]
            result["decoded"] = [pair[1] for pair in exchanged]
            result["ledger"] = ledger_list(ledger_dir)["instances"]
            result["ports"] = {"prefill": prefill.port, "decode": decode.port}
            # A late decoder: its requests come after the prefiller's lease ran out, while
            # other prompts need the prefiller's pages (which freed blocks would give them).
            prefilled = parallel(lambda p: prefill_step(prefill, p), late)
            result["late_prefilled"] = prefilled
            time.sleep(LEASE_S + 2)
            parallel(lambda p: post(prefill, {"prompt": p, "max_tokens": 4}), same)
            result["late_gap_s"] = round(time.monotonic() - started, 1)
            result["late"] = parallel(lambda p, r: decode_step(decode, p, r), late, prefilled)
            prefilled = parallel(lambda p: prefill_step(prefill, p), other)
            result["scrambled_bytes"] = scramble_pool(prefill)
            result["scrambled"] = parallel(lambda p, r: decode_step(decode, p, r), other, prefilled)
            # Past the read-by time (the prefiller's blocks overwritten as well): the decoder
            # must not read them.
            prefilled = parallel(lambda p: prefill_step(prefill, p), stale)
            for response in prefilled:
                response["kv_transfer_params"]["elastickv_read_by"] = time.time() - 1.0
            result["stale_prefilled"] = prefilled
            scramble_pool(prefill)
            result["stale"] = parallel(lambda p, r: decode_step(decode, p, r), stale, prefilled)
            result["ledger_end"] = ledger_list(ledger_dir)["instances"]
            result["decode_stop"] = terminate(decode)
        result["pair_s"] = round(time.monotonic() - started, 1)
        mismatched: dict[str, str | None] = {**ENGINE, "block-size": "64"}
        log64 = logs / "decode64.log"
        with openai_server(cache_root, model, engine_env(free_port(), 1), log64, mismatched) as d64:
            prefilled = parallel(lambda p: prefill_step(prefill, p), same[:2])
            result["mismatch"] = parallel(lambda p, r: decode_step(d64, p, r), same[:2], prefilled)
            result["mismatch_health"] = d64.get_status("/health")
            result["mismatch_plain"] = post(d64, {"prompt": same[0], "max_tokens": MAX_TOKENS})
            result["decode64_stop"] = terminate(d64)
        result["prefill_stop"] = terminate(prefill)
    result["wall_s"] = round(time.monotonic() - started, 1)
    result["ledger_after"] = ledger_list(ledger_dir)["instances"]
    result["logs"] = {p.stem: p.read_text(errors="replace") for p in logs.iterdir()}
    print(
        f"\nP/D: start-up {result['startup_s']} s, pair {result['pair_s']} s, "
        f"all {result['wall_s']} s; ledger (name, peak, refusals): "
        f"{[(i['name'], i['peak_bytes'], i['refusals']) for i in result['ledger_end']]}"
    )
    return result


def test_pd_output_equals_one_engine(pd: dict[str, Any]) -> None:
    reference = [token_ids(r) for r in pd["reference"][:8]]
    assert all(ids is not None and len(ids) == MAX_TOKENS for ids in reference), pd["reference"]
    for prefilled in pd["prefilled"]:
        assert prefilled["kv_transfer_params"]["remote_block_ids"], prefilled
        # A prompt of at least three blocks: the transfer moves several whole blocks.
        assert prefilled["usage"]["prompt_tokens"] > 2 * BLOCK, prefilled["usage"]
    decoded = [token_ids(r) for r in pd["decoded"]]
    assert decoded == reference, pd["decoded"]
    assert "NIXL is available" in pd["logs"]["decode"]


def test_scrambled_prefill_blocks_change_decode_output(pd: dict[str, Any]) -> None:
    assert pd["scrambled_bytes"] > 0
    reference = [token_ids(r) for r in pd["reference"][8:12]]
    scrambled = [token_ids(r) for r in pd["scrambled"]]
    assert all(ids is not None and len(ids) == MAX_TOKENS for ids in scrambled), pd["scrambled"]
    changed = sum(a != b for a, b in zip(scrambled, reference, strict=True))
    assert changed == len(reference), (scrambled, reference)


def remote_ids(prefilled: list[dict[str, Any]]) -> list[str]:
    return [r["kv_transfer_params"]["remote_request_id"] for r in prefilled]


def test_a_late_decoder_reads_blocks_held_past_the_lease(pd: dict[str, Any]) -> None:
    reference = [token_ids(r) for r in pd["reference"][12:16]]
    assert [token_ids(r) for r in pd["late"]] == reference, pd["late"]
    held = [line for line in pd["logs"]["prefill"].splitlines() if HELD in line]
    for remote in remote_ids(pd["late_prefilled"]):
        # vLLM's lease ran out, elastickv held the blocks, and the decoder read them.
        assert any(remote in line for line in held), (remote, held)
        assert not any(
            remote in line and RECOMPUTED in line for line in pd["logs"]["decode"].splitlines()
        )


def test_a_decoder_past_the_read_by_time_computes_the_prompt(pd: dict[str, Any]) -> None:
    reference = [token_ids(r) for r in pd["reference"][16:]]
    # The prefiller's blocks were overwritten: a read would change these (as in the
    # scrambling step); the decoder computed the prompts itself.
    assert [token_ids(r) for r in pd["stale"]] == reference, pd["stale"]
    recomputed = [line for line in pd["logs"]["decode"].splitlines() if RECOMPUTED in line]
    for remote in remote_ids(pd["stale_prefilled"]):
        assert any(remote in line for line in recomputed), (remote, recomputed)


def test_both_engines_in_the_ledger_and_nothing_left(pd: dict[str, Any]) -> None:
    names = sorted(i["name"] for i in pd["ledger"])
    assert len(names) == 2, pd["ledger"]
    for side in ("prefill", "decode"):
        assert any(str(pd["ports"][side]) in name for name in names), (side, names)
    assert all(i["alive"] and i["committed_bytes"] > 0 for i in pd["ledger"]), pd["ledger"]
    # Within each engine's budget all along (the peak is the instance's highest use).
    assert len(pd["ledger_end"]) == 2
    assert all(i["peak_bytes"] <= BUDGET for i in pd["ledger_end"]), pd["ledger_end"]
    for stop in ("decode_stop", "decode64_stop", "prefill_stop"):
        assert pd[stop]["left"] == {}, (stop, pd[stop])
    assert pd["ledger_after"] == [], pd["ledger_after"]


def test_mismatched_block_size_is_refused(pd: dict[str, Any]) -> None:
    for response in pd["mismatch"]:
        assert token_ids(response) is None, f"tokens from mismatched block sizes: {response}"
        assert response["status"] == 500, response  # vLLM fails the request
    log = pd["logs"]["decode64"]
    assert MISMATCH in log, log[-4000:]
    assert "same --block-size" in log
    # The refused engine still serves requests that need no transfer.
    assert pd["mismatch_health"] == 200
    assert len(token_ids(pd["mismatch_plain"]) or []) == MAX_TOKENS, pd["mismatch_plain"]
