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
import time
from pathlib import Path
from typing import Any

import pytest
from pd_harness import (
    BLOCK,
    BUDGET,
    ENGINE,
    LEASE_S,
    MAX_TOKENS,
    decode_step,
    engine_env,
    exchange,
    parallel,
    post,
    prefill_step,
    prompts,
    scramble_pool,
    token_ids,
)
from plugin_harness import ledger_list, openai_server, terminate

from elastickv.ports import free_port

MISMATCH = "block size: this engine 64, remote engine 32"
HELD = "is running out before its decoder read the blocks"
RECOMPUTED = "computing its prompt here instead of reading stale blocks"


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
