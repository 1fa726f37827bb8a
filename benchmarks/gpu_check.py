"""The GPU check: elastickv's device-memory path on one real GPU, in one command.

    make gpu-check                              # or: python benchmarks/gpu_check.py
    python benchmarks/gpu_check.py --json out.json

It needs only this repository, PyTorch with CUDA and cuda-bindings (no vLLM), and takes well
under five minutes on one GPU. It prints one table and writes one JSON file (``--json PATH``,
default ``gpu-check.json`` in the current directory); the exit status is 0 when every row
passed, 1 otherwise. Without a usable GPU it prints exactly one ``SKIP`` line naming what it
needs, writes the JSON with ``"status": "skip"`` and exits 0: it never passes by pretending.

Rows (docs/cuda.md, "The GPU check", says what each one proves):

* ``probes``: the eight 600-block VMM probes on the CUDA backend;
* ``store/<layout>``: an elastic KV cache (``ElasticKVCache`` over ``CudaBackend``) in a
  FlashAttention-like (NHD), a FlashInfer-like (HND) and an MLA layout: blocks written by
  torch through the geometry's views read back bit-exact, never-written blocks read 0;
* ``attention/<layout>``: causal attention (torch SDPA) over K/V gathered from elastic paged
  blocks by a block table equals attention over the dense copy exactly (fp32), and a
  block-by-block attention straight off the paged views agrees within 1e-5;
* ``commit-release``: the backend's commit and release per 2 MiB page against the raw driver
  calls measured in the same run, as ratios, and the raw calls against kvcached's A100 numbers;
* ``ledger``: two processes on one GPU ledger (keyed by the GPU's UUID) under one budget: the
  committed bytes, sampled throughout, never exceed it;
* ``uncommitted-read`` / ``uncommitted-write`` (real CUDA kernels only): a torch kernel reading
  an uncommitted page sees zeros and does not fault; a kernel writing one is reported (a fault,
  in a child process, where the zero page is read-only; ``check_zero_page`` otherwise).

Everything above the "real CUDA kernels" section also runs without a GPU against the fake
driver of tests/cuda_fake (tensors are host tensors there), so ``make test`` exercises it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

# Run from a checkout with nothing installed (the GPU machine has only PyTorch and
# cuda-bindings): this repository's own sources come first.
SRC = Path(__file__).resolve().parents[1] / "src"
if (SRC / "elastickv").is_dir() and str(SRC) not in sys.path:
    sys.path.insert(0, str(SRC))

# Without PyTorch there is nothing to check: main() turns that into the SKIP line.
TORCH_MISSING: ImportError | None = None
try:
    import torch

    from elastickv.alloc import BlockAllocator
    from elastickv.cache import ElasticKVCache
    from elastickv.control import cuda_device_key, open_ledger
    from elastickv.control.policy import LedgerPolicy
    from elastickv.geometry import AttentionKind, KVCacheGeometry, KVLayout, split_kv
    from elastickv.vmm.cuda import CudaBackend, Uncommitted
    from elastickv.vmm.cuda_driver import CudaDriver
except ImportError as exc:
    if exc.name != "torch":
        raise
    TORCH_MISSING = exc

MiB = 1 << 20
PAGE = 2 * MiB
DEFAULT_JSON = "gpu-check.json"
SCHEMA = 1
# kvcached's per-page driver costs on an A100 (µs), for comparison with the raw calls measured.
A100_ANCHOR_US = {"create": 193.0, "map": 1.45, "set_access": 36.0, "unmap": 25.6}
ATTENTION_TOLERANCE = 1e-5  # fp32, block-by-block online softmax against SDPA on dense K/V

Number = float | int | str | bool | None


@dataclass(frozen=True)
class Check:
    """One row: what was checked, whether it held, a line for people, numbers for machines."""

    name: str
    ok: bool
    detail: str
    numbers: Mapping[str, Number] = field(default_factory=dict)


@dataclass(frozen=True)
class Target:
    """Where the checks run: ``device`` is where torch sees the backend's memory (``cuda:0`` on
    a GPU, the host against the fake driver); ``ledger_dir`` is a private ledger directory, so a
    real deployment's ledger on this GPU is never touched."""

    device: torch.device
    ledger_dir: Path

    @property
    def on_gpu(self) -> bool:
        return self.device.type == "cuda"

    def sync(self) -> None:
        """Wait for queued kernels (nothing to wait for on the host)."""
        if self.on_gpu:
            torch.cuda.synchronize(self.device)


def guarded(name: str, check: Callable[[], Check]) -> Check:
    """Run one check; any exception is a FAIL row naming it, never a traceback."""
    try:
        return check()
    except Exception as exc:
        return Check(name, False, f"{type(exc).__name__}: {exc}")


# -- what the check needs -------------------------------------------------------------------


def missing_requirement() -> str | None:
    """What this machine lacks for the check, or None when PyTorch sees a CUDA GPU and
    cuda-bindings is importable."""
    if TORCH_MISSING is not None:
        return "needs PyTorch with CUDA (torch is not installed)"
    if not torch.cuda.is_available():
        built = torch.version.cuda
        why = "no CUDA device is visible" if built else "this PyTorch is built without CUDA"
        return f"needs PyTorch with CUDA and a visible GPU ({why}; torch {torch.__version__})"
    try:
        import cuda.bindings  # noqa: F401
    except ImportError:
        return "needs cuda-bindings (pip install 'cuda-bindings>=12.8')"
    return None


def describe_device() -> dict[str, Number]:
    """The GPU, driver and library versions, for the JSON."""
    from cuda.bindings import __version__ as bindings

    info: dict[str, Number] = {
        "torch": torch.__version__,
        "cuda_bindings": str(bindings),
        "python": platform.python_version(),
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(
            name=props.name, total_bytes=int(props.total_memory), torch_cuda=torch.version.cuda
        )
    driver = CudaDriver(0)
    try:
        info["uuid"] = driver.uuid()
    finally:
        driver.close()
    return info


# -- layouts --------------------------------------------------------------------------------


@dataclass(frozen=True)
class LayoutCase:
    """A KV-cache layout as one attention backend family lays it out."""

    name: str
    geometry: KVCacheGeometry


def layout_cases() -> tuple[LayoutCase, ...]:
    """FlashAttention-like (NHD: LBNHC), FlashInfer-like (HND: LBHNC), MLA (one latent row).

    Sizes keep several pages per layer with blocks straddling page boundaries (MLA's 18 KiB
    blocks do not divide 2 MiB)."""

    def packed(layout: str) -> KVCacheGeometry:
        return KVCacheGeometry(
            num_layers=2,
            num_blocks=257,
            num_kv_heads=4,
            block_size=16,
            head_size=64,
            dtype="float32",
            layout=layout,
        )

    return (
        LayoutCase("flash-attn NHD", packed("NHD")),
        LayoutCase("flashinfer HND", packed("HND")),
        LayoutCase(
            "mla",
            KVCacheGeometry(
                num_layers=2,
                num_blocks=257,
                num_kv_heads=1,
                block_size=16,
                head_size=576,
                dtype="bfloat16",
                kind="mla",
            ),
        ),
    )


@contextmanager
def elastic_cache(target: Target, geometry: KVCacheGeometry, name: str) -> Iterator[ElasticKVCache]:
    """An elastic KV cache over the CUDA backend, registered in a private ledger of this GPU."""
    backend = CudaBackend()
    driver = backend.driver
    assert isinstance(driver, CudaDriver)
    key = cuda_device_key(driver.uuid())
    total = backend.mem_get_info()[1]
    ledger = open_ledger(
        key,
        total_bytes=total,
        utilization=1.0,
        headroom_bytes=0,
        directory=str(target.ledger_dir / "store"),
    )
    try:
        with ElasticKVCache(geometry, backend=backend, ledger=ledger, name=name) as cache:
            yield cache
    finally:
        ledger.close()


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-exact equality (NaN payloads and signed zeros included)."""
    return a.shape == b.shape and bool(
        torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
    )


def is_zero(t: torch.Tensor) -> bool:
    return not bool(t.contiguous().view(torch.uint8).any())


def random_like(
    shape: Sequence[int], dtype: torch.dtype, device: torch.device, seed: int
) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(tuple(shape), generator=generator, dtype=torch.float32).to(dtype).to(device)


# -- checks that run wherever the driver runs (a GPU, or the fake driver in make test) --------


def check_probes() -> Check:
    """The eight 600-block probes of elastickv.probes.vmm_probe on the CUDA backend."""
    from elastickv.probes.vmm_probe import CASES, run_case

    backend = CudaBackend()
    results = [run_case(backend, case) for case in CASES]
    failed = [r for r in results if not r.ok]
    detail = f"{len(results) - len(failed)}/{len(results)} cases pass"
    if failed:
        detail += f"; {failed[0].case}: {failed[0].error}"
    return Check(
        "probes",
        not failed,
        detail,
        {"cases": len(results), "failed": len(failed), "seconds": sum(r.seconds for r in results)},
    )


def check_store(target: Target, case: LayoutCase) -> Check:
    """Blocks written through the geometry's views (K and V separately for packed layouts) read
    back bit-exact in every layer; blocks never written read 0, whether allocated (fresh pages
    are zeroed) or not (those on uncommitted pages read the zero page); pages released and
    committed again (their handles reused) read 0 again."""
    geometry = case.geometry
    name = f"store/{case.name}"
    with elastic_cache(target, geometry, f"gpu-check-store-{case.name.split()[0]}") as cache:
        written = cache.allocate(geometry.num_blocks * 2 // 5)
        untouched = cache.allocate(8)
        if written is None or untouched is None:
            return Check(name, False, "the cache refused the blocks")
        index = torch.tensor(written, device=target.device)
        sources: list[tuple[torch.Tensor, torch.Tensor]] = []
        for layer, view in enumerate(cache.views):
            mla = geometry.kind is AttentionKind.MLA
            parts = [view] if mla else list(split_kv(geometry, view))
            for side, part in enumerate(parts):
                data = random_like(part[index].shape, part.dtype, target.device, 97 * layer + side)
                part[index] = data
                sources.append((part, data))
        target.sync()
        exact = all(same_bits(part[index], data) for part, data in sources)
        every = set(range(1, geometry.num_blocks))  # block 0 is the engine's null block
        never = sorted(every - set(written))
        zeros = all(
            is_zero(view[torch.tensor(never, device=target.device)]) for view in cache.views
        )
        committed = cache.range.committed_pages()
        on_zero_page = [
            b for b in never if not set(geometry.block_pages(b, cache.range.page_size)) & committed
        ]
        peak_pages = len(committed)
        cache.free(written + untouched)
        cache.allocator.trim(0)
        kept = cache.range.committed_pages()  # the null block's page(s)
        again = cache.allocate(geometry.num_blocks - 1) or []  # every block: every page
        fresh = [b for b in again if not set(geometry.block_pages(b, cache.range.page_size)) & kept]
        fresh_index = torch.tensor(fresh, device=target.device)
        recommitted = bool(fresh) and all(is_zero(view[fresh_index]) for view in cache.views)
        target.sync()
    ok = exact and zeros and recommitted and bool(on_zero_page)
    detail = (
        f"{len(written)} blocks x {geometry.num_layers} layers read back "
        f"{'bit-exact' if exact else 'WRONG'}; {len(never)} never-written blocks "
        f"({len(on_zero_page)} on uncommitted pages) {'read 0' if zeros else 'NOT 0'}; "
        f"{len(fresh)} blocks on pages released and committed again "
        f"{'read 0' if recommitted else 'NOT 0'}"
    )
    return Check(
        name,
        ok,
        detail,
        {
            "layout": KVLayout.parse(geometry.layout).name,
            "kind": AttentionKind.parse(geometry.kind).value,
            "blocks_written": len(written),
            "blocks_never_written": len(never),
            "blocks_on_uncommitted_pages": len(on_zero_page),
            "peak_committed_pages": peak_pages,
            "bit_exact": exact,
            "never_written_zero": zeros,
            "recommitted_zero": recommitted,
            "blocks_recommitted": len(fresh),
        },
    )


def paged_attention_blockwise(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, table: list[int], length: int, scale: float
) -> torch.Tensor:
    """Causal attention reading K/V page by page straight off the paged views (online softmax
    over blocks): ``q`` is ``(Hq, T, D)``, ``k``/``v`` are the views ``(B, N, Hkv, D)``."""
    heads, tokens, _ = q.shape
    block = k.shape[1]
    group = heads // k.shape[2]
    positions = torch.arange(tokens, device=q.device)
    best = torch.full((heads, tokens, 1), -math.inf, device=q.device, dtype=q.dtype)
    total = torch.zeros((heads, tokens, 1), device=q.device, dtype=q.dtype)
    out = torch.zeros_like(q)
    for number, block_id in enumerate(table):
        first = number * block
        count = min(block, length - first)
        kb = k[block_id, :count].permute(1, 0, 2).repeat_interleave(group, dim=0)  # (Hq, n, D)
        vb = v[block_id, :count].permute(1, 0, 2).repeat_interleave(group, dim=0)
        scores = (q @ kb.transpose(1, 2)) * scale  # (Hq, T, n)
        keys = first + torch.arange(count, device=q.device)
        scores = scores.masked_fill(keys[None, None, :] > positions[None, :, None], -math.inf)
        new_best = torch.maximum(best, scores.amax(dim=-1, keepdim=True))
        factor = torch.exp(best - new_best)
        weights = torch.exp(scores - new_best)
        total = total * factor + weights.sum(dim=-1, keepdim=True)
        out = out * factor + weights @ vb
        best = new_best
    return out / total


def causal_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """torch's SDPA, causal, ``q`` ``(Hq, T, D)`` over ``k``/``v`` ``(T, Hkv, D)`` (GQA by
    repeating KV heads)."""
    group = q.shape[0] // k.shape[1]
    kh = k.permute(1, 0, 2).repeat_interleave(group, dim=0)
    vh = v.permute(1, 0, 2).repeat_interleave(group, dim=0)
    return torch.nn.functional.scaled_dot_product_attention(
        q[None], kh[None], vh[None], is_causal=True, scale=scale
    )[0]


def check_attention(target: Target, case: LayoutCase) -> Check:
    """Attention over elastic paged blocks equals attention over the dense K/V: exactly when K/V
    are gathered by block table (the same inputs, the same SDPA), within ``ATTENTION_TOLERANCE``
    when computed block by block off the paged views (fp32)."""
    geometry = case.geometry
    query_heads = 2 * geometry.num_kv_heads
    lengths = (37, 80, 5, 129)
    scale = geometry.head_size**-0.5
    exact = True
    worst = 0.0
    with elastic_cache(target, geometry, f"gpu-check-attn-{case.name.split()[0]}") as cache:
        k_view, v_view = split_kv(geometry, cache.views[geometry.num_layers - 1])
        for number, length in enumerate(lengths):
            blocks = cache.allocate(-(-length // geometry.block_size))
            if blocks is None:
                return Check(f"attention/{case.name}", False, "the cache refused the blocks")
            table = blocks[::-1]  # a block table out of allocation order
            slots = torch.arange(length, device=target.device)
            block_index = torch.tensor(table, device=target.device)[slots // geometry.block_size]
            slot_index = slots % geometry.block_size
            shape = (length, geometry.num_kv_heads, geometry.head_size)
            dense_k = random_like(shape, k_view.dtype, target.device, 11 * number + 1)
            dense_v = random_like(shape, v_view.dtype, target.device, 11 * number + 2)
            q = random_like(
                (query_heads, length, geometry.head_size),
                k_view.dtype,
                target.device,
                11 * number + 3,
            )
            k_view[block_index, slot_index] = dense_k
            v_view[block_index, slot_index] = dense_v

            reference = causal_sdpa(q, dense_k, dense_v, scale)
            paged_k, paged_v = k_view[block_index, slot_index], v_view[block_index, slot_index]
            gathered = causal_sdpa(q, paged_k, paged_v, scale)
            blockwise = paged_attention_blockwise(q, k_view, v_view, table, length, scale)
            target.sync()
            exact = exact and same_bits(gathered, reference)
            worst = max(worst, float((blockwise - reference).abs().max()))
    ok = exact and worst <= ATTENTION_TOLERANCE
    detail = (
        f"{len(lengths)} sequences ({', '.join(map(str, lengths))} tokens), "
        f"{query_heads} query / {geometry.num_kv_heads} KV heads: gathered "
        f"{'== dense (exact)' if exact else '!= dense'}, block by block max |err| {worst:.2e} "
        f"(tolerance {ATTENTION_TOLERANCE:.0e})"
    )
    return Check(
        f"attention/{case.name}",
        ok,
        detail,
        {
            "gathered_exact": exact,
            "blockwise_max_abs_error": worst,
            "tolerance": ATTENTION_TOLERANCE,
        },
    )


def _median_us(samples: list[float]) -> float:
    return statistics.median(samples) * 1e6


def _timed(call: Callable[[], object]) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def measure_raw_driver(pages: int) -> dict[str, float]:
    """Median µs per 2 MiB page of each raw driver call the backend makes, on a reservation of
    its own, through the same thin wrapper the backend calls (so a ratio is the backend's own
    work)."""
    driver = CudaDriver(0)
    samples: dict[str, list[float]] = {
        k: [] for k in ("create", "map", "set_access", "zero", "unmap", "release")
    }
    try:
        with driver.current():
            base = driver.address_reserve(pages * PAGE, PAGE)
            handles: list[int] = []
            try:
                for _ in range(pages):
                    start = time.perf_counter()
                    handles.append(driver.create(PAGE))
                    samples["create"].append(time.perf_counter() - start)
                for page, handle in enumerate(handles):
                    at = base + page * PAGE
                    samples["map"].append(_timed(partial(driver.map, at, PAGE, handle)))
                    samples["set_access"].append(_timed(partial(driver.set_access, at, PAGE)))
                    samples["zero"].append(_timed(partial(driver.zero, at, PAGE, None)))
                driver.synchronize(None)
                for page in range(pages):
                    at = base + page * PAGE
                    samples["unmap"].append(_timed(partial(driver.unmap, at, PAGE)))
                for handle in handles:
                    samples["release"].append(_timed(partial(driver.release, handle)))
            finally:
                driver.address_free(base, pages * PAGE)
    finally:
        driver.close()
    return {name: _median_us(values) for name, values in samples.items()}


def measure_backend(mode: Uncommitted, pages: int) -> dict[str, float]:
    """Median µs per page of the backend: single-page commits and releases (handles pooled, as
    in serving), a whole-range commit and release, and the reserve and close of the range."""
    backend = CudaBackend(uncommitted=mode, handle_pool_size=pages)
    start = time.perf_counter()
    vrange = backend.reserve(pages * PAGE)
    reserve = time.perf_counter() - start
    try:
        vrange.fill_pool(pages)
        commit = [_timed(partial(vrange.commit, [page])) for page in range(pages)]
        release = [_timed(partial(vrange.release, [page])) for page in range(pages)]
        commit_run = _timed(partial(vrange.commit, range(pages))) / pages
        release_run = _timed(partial(vrange.release, range(pages))) / pages
        if vrange.footprint_bytes() != 0:
            raise RuntimeError(f"{vrange.footprint_bytes()} bytes still mapped after the releases")
    finally:
        close = _timed(vrange.close)
    return {
        "commit": _median_us(commit),
        "release": _median_us(release),
        "commit_run": commit_run * 1e6,
        "release_run": release_run * 1e6,
        "reserve_per_page": reserve / pages * 1e6,
        "close_per_page": close / pages * 1e6,
    }


def check_commit_release(pages: int = 64) -> Check:
    """Per 2 MiB page: the backend's commit (a pooled handle mapped, access, zeroed; in zero
    mode also the zero page's unmap and a wait for queued work) against the raw map +
    set-access + memset, its release against the raw unmap; the raw calls against kvcached's A100
    anchors. A measurement: it fails only if a number cannot be measured."""
    raw = measure_raw_driver(pages)
    modes = {mode: measure_backend(mode, pages) for mode in ("zero", "fault")}
    raw_commit = raw["map"] + raw["set_access"] + raw["zero"]
    numbers: dict[str, Number] = {f"raw_{k}_us": round(v, 3) for k, v in raw.items()}
    for mode, values in modes.items():
        numbers.update({f"{mode}_{k}_us": round(v, 3) for k, v in values.items()})
        numbers[f"{mode}_commit_ratio"] = round(values["commit"] / raw_commit, 3)
        numbers[f"{mode}_release_ratio"] = round(values["release"] / raw["unmap"], 3)
    for call, anchor in A100_ANCHOR_US.items():
        numbers[f"raw_{call}_vs_a100"] = round(raw[call] / anchor, 3)
    finite = all(
        isinstance(v, int | float) and math.isfinite(v) and v > 0
        for k, v in numbers.items()
        if k.endswith(("_us", "ratio", "a100"))
    )
    zero = modes["zero"]
    detail = (
        f"commit {zero['commit']:.1f} µs/page = {numbers['zero_commit_ratio']}x raw "
        f"map+access+memset ({raw_commit:.1f} µs), release {zero['release']:.1f} µs = "
        f"{numbers['zero_release_ratio']}x raw unmap; fault mode "
        f"{numbers['fault_commit_ratio']}x / {numbers['fault_release_ratio']}x; raw vs A100: "
        f"create {numbers['raw_create_vs_a100']}x, map {numbers['raw_map_vs_a100']}x, "
        f"set_access {numbers['raw_set_access_vs_a100']}x, "
        f"unmap {numbers['raw_unmap_vs_a100']}x; zero page at reserve "
        f"{zero['reserve_per_page']:.1f} µs/page"
    )
    return Check("commit-release", finite, detail, numbers)


# -- two processes, one ledger ----------------------------------------------------------------


def ledger_geometry(blocks: int) -> KVCacheGeometry:
    """One 2 MiB block per page (16 tokens x 32768 fp16 values a row), so pages = blocks."""
    return KVCacheGeometry(
        num_layers=1,
        num_blocks=blocks,
        num_kv_heads=1,
        block_size=16,
        head_size=32768,
        dtype="float16",
    )


LEDGER_BUDGET_PAGES = 24
LEDGER_WANT_PAGES = 16


def ledger_worker(config: Mapping[str, Any]) -> int:
    """A process with an elastic allocator admitted through the shared ledger. Commands come
    on stdin, one JSON answer per command on stdout: ``grab N`` takes blocks until it holds N
    pages or the ledger refuses; ``churn S`` allocates and frees at random for S seconds;
    ``quit`` frees everything and closes."""
    geometry = ledger_geometry(config["blocks"])
    ledger = open_ledger(config["key"], directory=config["directory"], create=False)
    handle = ledger.register(config["name"])
    backend = CudaBackend()
    vrange = backend.reserve(geometry.backing_bytes)
    alloc = BlockAllocator(geometry, vrange, LedgerPolicy(handle), max_hot_pages=0)
    held: list[int] = []
    refusals = 0
    peak = 0
    rng = random.Random(config["seed"])

    def answer(**values: Any) -> None:
        print(json.dumps(values), flush=True)

    try:
        while line := sys.stdin.readline():
            command, *args = line.split()
            if command == "grab":
                while vrange.num_committed < int(args[0]):
                    got = alloc.allocate(1)
                    if got is None:
                        refusals += 1
                        break
                    held.extend(got)
                peak = max(peak, vrange.footprint_bytes())
                answer(pages=vrange.num_committed, refusals=refusals)
            elif command == "churn":
                deadline = time.monotonic() + float(args[0])
                allocations = 0
                while time.monotonic() < deadline:
                    if held and rng.random() < 0.5:
                        rng.shuffle(held)
                        count = rng.randint(1, len(held))
                        alloc.free(held[:count])
                        del held[:count]
                    else:
                        got = alloc.allocate(rng.randint(1, 6))
                        if got is None:
                            refusals += 1
                        else:
                            held.extend(got)
                            allocations += 1
                    peak = max(peak, vrange.footprint_bytes())
                answer(pages=vrange.num_committed, refusals=refusals, allocations=allocations)
            elif command == "quit":
                break
        alloc.free(held)
        alloc.close()  # the null block's page goes too
        answer(pages=vrange.num_committed, refusals=refusals, peak_bytes=peak)
    finally:
        alloc.close()
        vrange.close()
        handle.close()
        ledger.close()
    return 0


class Worker:
    """A ledger worker process driven line by line."""

    def __init__(self, config: Mapping[str, Any]) -> None:
        self.process = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--ledger-worker", json.dumps(config)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def send(self, command: str) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(command + "\n")
        self.process.stdin.flush()

    def receive(self) -> dict[str, Any]:
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if not line:
            self.process.wait(timeout=60)
            assert self.process.stderr is not None
            said = self.process.stderr.read()[-2000:]
            raise RuntimeError(f"ledger worker exited ({self.process.returncode}): {said}")
        answer: dict[str, Any] = json.loads(line)
        return answer

    def ask(self, command: str) -> dict[str, Any]:
        self.send(command)
        return self.receive()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(timeout=60)


def check_ledger(target: Target, churn_seconds: float = 3.0) -> Check:
    """Two processes share one budget in this GPU's ledger (its key from the GPU's UUID). The
    first takes 16 pages, so the second gets only what is left (refused beyond it, by
    construction); then both allocate and free at random while this process samples the
    ledger: the committed bytes never exceed the budget, and all return to 0."""
    driver = CudaDriver(0)
    try:
        key = cuda_device_key(driver.uuid())
    finally:
        driver.close()
    directory = target.ledger_dir / "shared"
    budget = LEDGER_BUDGET_PAGES * PAGE
    ledger = open_ledger(
        key, total_bytes=budget, utilization=1.0, headroom_bytes=0, directory=str(directory)
    )
    workers: list[Worker] = []
    try:
        for number in range(2):
            workers.append(
                Worker(
                    {
                        "key": key,
                        "directory": str(directory),
                        "name": f"gpu-check-{number}",
                        "blocks": LEDGER_WANT_PAGES * 2,
                        "seed": number,
                    }
                )
            )
        first = workers[0].ask(f"grab {LEDGER_WANT_PAGES}")
        second = workers[1].ask(f"grab {LEDGER_WANT_PAGES}")
        for worker in workers:
            worker.send(f"churn {churn_seconds}")
        peak = samples = 0
        deadline = time.monotonic() + churn_seconds
        while time.monotonic() < deadline:
            peak = max(peak, ledger.device_usage().used_bytes)
            samples += 1
            time.sleep(0.0005)
        churned = [worker.receive() for worker in workers]
        final = [worker.ask("quit") for worker in workers]
        for worker in workers:
            worker.process.wait(timeout=60)
        after = ledger.device_usage().used_bytes
    finally:
        for worker in workers:
            worker.stop()
        ledger.close()
    contended = (
        first["pages"] == LEDGER_WANT_PAGES
        and second["pages"] < LEDGER_WANT_PAGES
        and second["refusals"] > 0
    )
    within = peak <= budget and all(f["peak_bytes"] <= budget for f in final)
    returned = after == 0 and all(f["pages"] == 0 for f in final)
    ok = contended and within and returned and all(w.process.returncode == 0 for w in workers)
    detail = (
        f"budget {LEDGER_BUDGET_PAGES} pages on {key[:17]}...: first took {first['pages']}, second "
        f"{second['pages']} ({second['refusals']} refusal(s)); churn {churn_seconds:g} s "
        f"({sum(c['allocations'] for c in churned)} allocations): sampled peak "
        f"{peak // PAGE} pages over {samples} samples, {after // PAGE} left after"
    )
    return Check(
        "ledger",
        ok,
        detail,
        {
            "device_key": key,
            "budget_bytes": budget,
            "peak_committed_bytes": peak,
            "samples": samples,
            "first_pages": first["pages"],
            "second_pages": second["pages"],
            "refusals": sum(c["refusals"] for c in churned),
            "committed_after_bytes": after,
        },
    )


# -- real CUDA kernels only ------------------------------------------------------------------


def check_uncommitted_read(target: Target) -> Check:
    """A torch kernel reads 14 uncommitted pages of a default (zero mode) range: all zeros, no
    fault, and the committed page beside them keeps its data."""
    backend = CudaBackend()
    with backend.reserve(8 * PAGE) as vrange:
        vrange.commit([0])
        tensor = vrange.as_tensor()
        tensor[:PAGE].fill_(7)
        uncommitted_sum = int(tensor[PAGE:].sum(dtype=torch.int64))
        uncommitted_max = int(tensor[PAGE:].max())
        committed_ok = bool((tensor[:PAGE] == 7).all())
        torch.cuda.synchronize(target.device)
        written = vrange.check_zero_page()
        read_only = vrange.zero_page_read_only
        refusal = vrange.zero_page_refusal
        del tensor
    ok = uncommitted_sum == 0 and uncommitted_max == 0 and committed_ok and not written
    access = "read-only" if read_only else f"read-write (driver refused read-only: {refusal})"
    detail = (
        f"7 uncommitted pages read {'0' if uncommitted_max == 0 else 'NON-ZERO'} with no fault; "
        f"committed page {'intact' if committed_ok else 'WRONG'}; zero page {access}"
    )
    return Check(
        "uncommitted-read",
        ok,
        detail,
        {"zero_page_read_only": read_only, "refusal": refusal, "sum": uncommitted_sum},
    )


def check_worker_protocol(target: Target) -> Check:
    """The vLLM plugin's worker storage on this GPU, as an engine drives it: a scheduler's
    grants (allocator over page grants) mapped by the worker before each step, a torch kernel
    writing and reading the granted blocks, a release held by a CUDA event until the step
    queued before it is done, and the warm-up's own pages released at the first planned step.
    Needs real kernels: the fence is a CUDA event on the compute stream."""
    from elastickv.alloc import BlockAllocator, Unlimited
    from elastickv.geometry import build_layer_views
    from elastickv.integrations.vllm.config import ElasticConfig
    from elastickv.integrations.vllm.worker.worker_kv import WorkerKV
    from elastickv.vmm.grants import PageGrants

    geometry = layout_cases()[0].geometry
    config = ElasticConfig(page_size=PAGE)
    kv = WorkerKV.create(config, geometry, geometry.backing_bytes, target.device)
    grants = PageGrants(
        -(-geometry.backing_bytes // PAGE) * PAGE, PAGE, held=geometry.block_pages(0, PAGE)
    )
    allocator = BlockAllocator(geometry, grants, Unlimited(), max_hot_pages=0)
    try:
        kv.map_unplanned(range(1, 9))  # what Model Runner V2's warm-up writes
        warm = len(kv.unplanned)
        views = build_layer_views(geometry, kv.backing().view(torch.uint8))
        blocks = allocator.allocate(geometry.num_blocks // 2)
        assert blocks is not None
        started = time.perf_counter()
        kv.apply(grants.drain())  # the first planned step: maps its grants, warm-up pages go
        map_s = time.perf_counter() - started
        mapped = kv.vmm_range.committed_pages() == allocator.committed_pages()
        for view in views:
            view[blocks].fill_(3)  # the step writes its blocks...
        total = sum(int(view[blocks].sum(dtype=torch.int64)) for view in views)
        expected = sum(3 * view[blocks].numel() for view in views)
        del views  # no tensor reads the pages once they go back
        kv.follower.step_queued()  # ...and is queued when the next batch arrives
        allocator.free(blocks)
        kv.apply(grants.drain())
        held = len(kv.follower.held_pages)
        target.sync()
        kv.apply(None)
        released = kv.vmm_range.committed_pages() == kv.null_pages and not kv.follower.held_pages
    finally:
        allocator.close()
        kv.vmm_range.close()
    ok = mapped and released and total == expected and warm > 0
    detail = (
        f"{'granted pages mapped' if mapped else 'MAPPING DIFFERS'} in {map_s * 1e3:.2f} ms; "
        f"{held} released page(s) held while the step ran, "
        f"{'then released' if released else 'NOT RELEASED'}; warm-up's {warm} page(s) returned"
    )
    return Check(
        "worker-protocol",
        ok,
        detail,
        {"map_ms": round(map_s * 1e3, 3), "held_pages": held, "warm_pages": warm},
    )


def write_probe() -> int:
    """Child process: a torch kernel writes to an uncommitted page, after a read of it and a
    write to a committed page went through (so a fault is the stray write's). Prints one JSON
    line: the fault it got, or what ``check_zero_page`` found when the zero page is read-write."""
    backend = CudaBackend()
    vrange = backend.reserve(4 * PAGE)
    vrange.commit([0])
    tensor = vrange.as_tensor()
    read_only = vrange.zero_page_read_only
    tensor[:PAGE].fill_(5)
    before = int(tensor[2 * PAGE : 3 * PAGE].max())
    torch.cuda.synchronize()
    try:
        tensor[2 * PAGE + 123] = 1
        torch.cuda.synchronize()
    except RuntimeError as exc:
        fault = str(exc).strip().splitlines()[0]
        print(json.dumps({"read_only": read_only, "read": before, "fault": fault}), flush=True)
        os._exit(0)  # the context is lost: nothing can be cleaned up, the process must go
    found = vrange.check_zero_page()
    print(
        json.dumps({"read_only": read_only, "read": before, "fault": None, "detected": found}),
        flush=True,
    )
    del tensor
    vrange.close()
    return 0


def check_uncommitted_write() -> Check:
    """A stray write to an uncommitted page is reported, never shared silently: with a read-only
    zero page the kernel faults (in a child process, whose context it poisons); with a
    read-write one ``check_zero_page`` finds it."""
    done = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "--write-probe"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if not lines:
        return Check(
            "uncommitted-write",
            False,
            f"the probe process said nothing (exit {done.returncode}): {done.stderr[-500:]}",
        )
    result = json.loads(lines[-1])
    if result["read_only"]:
        ok = result["fault"] is not None and result["read"] == 0
        detail = f"read-only zero page: the write faulted ({result['fault']})"
    else:
        ok = result["fault"] is None and bool(result["detected"])
        found = "found by check_zero_page" if ok else "NOT reported"
        detail = f"read-write zero page: the write was {found}"
    return Check("uncommitted-write", ok, detail, result)


# -- the run ---------------------------------------------------------------------------------


def run_checks(target: Target, *, kernels: bool, churn_seconds: float = 3.0) -> list[Check]:
    """Every check, each guarded so one failure is one FAIL row. ``kernels``: also the checks
    that need real CUDA kernels (a GPU)."""
    checks = [guarded("probes", check_probes)]
    cases = layout_cases()
    checks += [guarded(f"store/{c.name}", partial(check_store, target, c)) for c in cases]
    checks += [
        guarded(f"attention/{c.name}", partial(check_attention, target, c)) for c in cases[:2]
    ]
    checks.append(guarded("commit-release", check_commit_release))
    checks.append(guarded("ledger", partial(check_ledger, target, churn_seconds)))
    if kernels:
        checks.append(guarded("uncommitted-read", partial(check_uncommitted_read, target)))
        checks.append(guarded("worker-protocol", partial(check_worker_protocol, target)))
        checks.append(guarded("uncommitted-write", check_uncommitted_write))
    return checks


def print_table(checks: Sequence[Check], title: str, caption: str) -> None:
    """One table (rich when installed, plain columns otherwise)."""
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        width = max(len(c.name) for c in checks)
        print(title)
        for c in checks:
            print(f"{c.name:<{width}}  {'PASS' if c.ok else 'FAIL'}  {c.detail}")
        print(caption)
        return
    table = Table(title=title, caption=caption)
    table.add_column("check", no_wrap=True)
    table.add_column("result", no_wrap=True)
    table.add_column("detail", overflow="fold")
    for c in checks:
        table.add_row(c.name, "[green]PASS[/]" if c.ok else "[red]FAIL[/]", c.detail)
    Console().print(table)


def write_json(path: Path, payload: Mapping[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, default=str) + "\n")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument(
        "--json",
        type=Path,
        default=Path(DEFAULT_JSON),
        metavar="PATH",
        help=f"where to write the results (default: ./{DEFAULT_JSON})",
    )
    parser.add_argument("--ledger-worker", metavar="CONFIG", help=argparse.SUPPRESS)
    parser.add_argument("--write-probe", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.ledger_worker:
        return ledger_worker(json.loads(args.ledger_worker))
    if args.write_probe:
        return write_probe()
    missing = missing_requirement()
    if missing is not None:
        print(f"SKIP gpu-check: {missing}")
        write_json(args.json, {"schema": SCHEMA, "status": "skip", "reason": missing, "checks": []})
        return 0
    start = time.perf_counter()
    try:
        device = describe_device()
    except Exception as exc:
        device = {"error": f"{type(exc).__name__}: {exc}"}
    with tempfile.TemporaryDirectory(prefix="elastickv-gpu-check-") as directory:
        checks = run_checks(Target(torch.device("cuda", 0), Path(directory)), kernels=True)
    seconds = time.perf_counter() - start
    ok = all(c.ok for c in checks)
    print_table(
        checks,
        f"elastickv GPU check: {device.get('name', 'cuda:0')} ({seconds:.0f} s)",
        f"{'PASS' if ok else 'FAIL'}: {sum(c.ok for c in checks)}/{len(checks)} checks; "
        f"results in {args.json}",
    )
    write_json(
        args.json,
        {
            "schema": SCHEMA,
            "status": "pass" if ok else "fail",
            "seconds": round(seconds, 1),
            "device": device,
            "checks": [asdict(c) for c in checks],
        },
    )
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
