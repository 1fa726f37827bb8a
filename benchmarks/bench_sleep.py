"""Sleep and wake of a running CPU engine's weights: memory released, time to wake, outputs
after waking.

One vLLM 0.32 engine (``LLM``, float32, greedy, elastickv on) on ``llama-100m`` (99 M random
parameters, 376 MiB, built locally on first use). After the reference outputs, ``--cycles``
times: the worker RPC ``elastickv_sleep_weights`` (parameters emptied, packed linear layers
dropped, heap trimmed), the engine's memory (PSS of its process tree) measured, then
``elastickv_wake_weights`` (reload from the checkpoint and repack, split), the first token of a
new request timed, and every prompt's greedy output compared with the reference. A last cycle
sends a request to the sleeping engine without waking it: the step wakes it first, and the
request is answered.

``--native`` first runs the same prompts on a native engine (no elastickv) in a child process
and checks the reference against it. ``--gpu [--level 1|2]``: on a host with an NVIDIA GPU
and vLLM's CUDA build, the engine runs there with ``--enable-sleep-mode`` and the RPCs drive
vLLM's own sleep at that level; the memory measured is the GPU's (used bytes, from CUDA), and
the fall must be at least 90 % of the weights. ``--mp``: the engine in vLLM's multiprocess
mode (the RPCs then cross processes); default in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``).
``--compile``: vLLM's torch.compile instead of eager mode.

    .venvs/vllm-0.32/bin/python benchmarks/bench_sleep.py [--cycles 3] [--native] [--mp]
        [--compile] [--gpu [--level 1|2]] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

PROMPTS = [
    "The quick brown fox",
    "Memory is reserved up front, but pages are only mapped",
    "你好，世界！",
    "12 + 7 = 19, 3 * 4 =",
]
MAX_TOKENS = 24


def tree_pss() -> int:
    """PSS of this process and its descendants (the engine core and workers in --mp)."""
    import psutil

    me = psutil.Process()
    total = 0
    for proc in [me, *me.children(recursive=True)]:
        try:
            total += proc.memory_full_info().pss
        except psutil.Error:
            continue
    return total


def gpu_used() -> int:
    """Bytes in use on the GPU (all processes: the engine's weights among them)."""
    import torch

    free, total = torch.cuda.mem_get_info()
    return int(total - free)


def start_engine(model: str, compile_model: bool = False, gpu: bool = False) -> Any:
    from vllm import LLM

    return LLM(
        model=model,
        dtype="float32",
        enforce_eager=not compile_model,
        max_model_len=256,
        kv_cache_memory_bytes=32 << 20,
        seed=0,
        **({"enable_sleep_mode": True} if gpu else {}),
    )


def generate(llm: Any, prompts: list[str], max_tokens: int) -> list[list[int]]:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]


def native_outputs(model: str) -> list[list[int]]:
    """The prompts' greedy outputs from a native engine, in a child process."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ELASTICKV")}
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    code = (
        "import json, sys; sys.path.insert(0, sys.argv[2]); import bench_sleep as b\n"
        "llm = b.start_engine(sys.argv[1])\n"
        "print('IDS ' + json.dumps(b.generate(llm, b.PROMPTS, b.MAX_TOKENS)), flush=True)\n"
        "import os; os._exit(0)\n"
    )
    here = os.path.dirname(os.path.abspath(__file__))
    proc = subprocess.run(
        [sys.executable, "-c", code, model, here],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    for line in proc.stdout.splitlines():
        if line.startswith("IDS "):
            ids: list[list[int]] = json.loads(line[4:])
            return ids
    raise RuntimeError(f"the native engine failed:\n{proc.stderr[-3000:]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cycles", type=int, default=3)
    parser.add_argument("--native", action="store_true", help="check against a native engine")
    parser.add_argument("--mp", action="store_true", help="vLLM's multiprocess mode")
    parser.add_argument("--compile", action="store_true", help="torch.compile (not eager)")
    parser.add_argument(
        "--gpu", action="store_true", help="on an NVIDIA GPU, through vLLM's sleep mode"
    )
    parser.add_argument("--level", type=int, choices=(1, 2), default=1, help="with --gpu")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.gpu:
        import torch

        if not torch.cuda.is_available():
            parser.error("--gpu needs an NVIDIA GPU and vLLM's CUDA build; none is visible here")
    elif args.level != 1:
        parser.error("--level applies to --gpu (on the CPU the weights are always reloaded)")

    from elastickv.models import LLAMA_100M, ensure_tiny_model

    model = str(ensure_tiny_model(LLAMA_100M))
    weights = LLAMA_100M.num_parameters * 4
    native = native_outputs(model) if args.native else None

    os.environ.update(
        ELASTICKV="1",
        VLLM_ENABLE_V1_MULTIPROCESSING="1" if args.mp else "0",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
    )
    # The engine registers in a ledger of its own, never the user's; removed at the end.
    ledger = None
    if "ELASTICKV_LEDGER_DIR" not in os.environ:
        ledger = tempfile.mkdtemp(prefix="bench-sleep-ledger-")
        os.environ["ELASTICKV_LEDGER_DIR"] = ledger
    from elastickv.integrations.vllm.worker.weights_sleep import SLEEP_METHOD, WAKE_METHOD

    llm = start_engine(model, args.compile, args.gpu)
    reference = generate(llm, PROMPTS, MAX_TOKENS)
    memory = gpu_used if args.gpu else tree_pss
    awake = memory()
    result: dict[str, Any] = {
        "model": LLAMA_100M.name,
        "weights_bytes": weights,
        "mode": "multiprocess" if args.mp else "in-process",
        "compiled": args.compile,
        "device": f"gpu, vLLM sleep level {args.level}" if args.gpu else "cpu",
        "native_equal": None if native is None else native == reference,
        "pss_awake": awake,
        "cycles": [],
    }
    for cycle in range(args.cycles + 1):
        asleep_request = cycle == args.cycles  # the last: a request reaches a sleeping engine
        before = memory()
        slept = llm.collective_rpc(SLEEP_METHOD, kwargs={"level": args.level})
        asleep = memory()
        # On the CPU the worker's own PSS, its heap trimmed before and after, anonymous part
        # (where the weights live; other processes do not move it); on a GPU the device's.
        worker_fall = (
            (before - asleep) if args.gpu else slept[0]["pss_anon_before"] - slept[0]["pss_anon"]
        )
        start = time.perf_counter()
        woke = None if asleep_request else llm.collective_rpc(WAKE_METHOD)
        woken_at = time.perf_counter()
        first = generate(llm, PROMPTS[:1], 1)
        first_at = time.perf_counter()
        outputs = generate(llm, PROMPTS, MAX_TOKENS)
        entry = {
            "request_while_asleep": asleep_request,
            "released_bytes": slept[0]["released_bytes"],
            "packed_layers": slept[0].get("packed_layers"),
            "sleep_s": round(slept[0]["sleep_s"], 3),
            # PSS of the engine's processes on the CPU; the GPU's used bytes with --gpu.
            "pss_before": before,
            "pss_asleep": asleep,
            "pss_fall": before - asleep,
            "worker_pss_fall": worker_fall,
            "pss_fall_of_weights": round(worker_fall / weights, 3),
            "wake_s": round(woken_at - start, 3),
            "reload_s": None if woke is None else round(woke[0]["reload_s"], 3),
            "restore_s": None if woke is None else round(woke[0].get("restore_s", 0.0), 3),
            # The worker's CPU time for the wake: what it costs on a machine others load.
            "wake_cpu_s": None if woke is None else round(woke[0].get("cpu_s", 0.0), 3),
            "first_token_s": round(first_at - woken_at, 3),
            "wake_and_first_token_s": round(first_at - start, 3),
            "first_token_equal": first[0] == reference[0][:1],
            "outputs_equal": outputs == reference,
            "pss_awake_again": memory(),
        }
        result["cycles"].append(entry)
        if not args.json:
            print(json.dumps(entry), flush=True)
    result["ok"] = all(
        c["outputs_equal"] and c["first_token_equal"] and c["pss_fall_of_weights"] >= 0.9
        for c in result["cycles"]
    ) and result["native_equal"] in (None, True)
    print(json.dumps(result, indent=None if not args.json else 2), flush=True)
    llm.llm_engine.engine_core.shutdown()
    if ledger is not None:
        shutil.rmtree(ledger, ignore_errors=True)
    sys.exit(0 if result["ok"] else 1)


if __name__ == "__main__":
    main()
