"""The eight VMM probes: real memory, real vLLM-format views, real capacity pressure.

Per-layer and cross-layer storage x NHD and HND x kernel-block ratio 1 and 2 (vLLM 0.28's
contract, so cross-layer storage can split kernel blocks). Each case maps 600 blocks that
straddle and share physical pages, writes distinct K/V values for three layers through the
views the geometry core builds, checks them, frees the blocks and checks the pages left,
forces a capacity rejection with a real foreign allocation under the same budget, frees it,
and checks all 600 blocks can be allocated and used again.

    python -m elastickv.probes.vmm_probe --backend host [--json]
    python -m elastickv.probes.vmm_probe --backend cuda
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass, field

import torch

from elastickv.alloc import BlockAllocator, FixedBudget
from elastickv.geometry import (
    KVCacheGeometry,
    KVLayout,
    build_layer_views,
    split_kv,
    vllm028_layout,
)
from elastickv.vmm import BackendUnavailable, VirtualRange, VmmBackend, VmmError

BLOCKS = 600
LAYERS = 3
SLACK_PAGES = 4


class ProbeFailure(Exception):
    """A check of the probe did not hold."""


@dataclass(frozen=True)
class ProbeCase:
    storage: str  # "per-layer" or "cross-layer"
    kv_layout: str  # "NHD" or "HND"
    ratio: int  # logical / kernel block size

    @property
    def name(self) -> str:
        return f"{self.storage}/{self.kv_layout}/r{self.ratio}"

    def geometry(self) -> KVCacheGeometry:
        """3 KV heads x 64 x fp32, 16 tokens: 24 KiB per (layer, block), so blocks straddle
        every power-of-two page size and several share each page."""
        return KVCacheGeometry(
            num_layers=LAYERS,
            num_blocks=BLOCKS + 1,  # block 0 is the null block
            num_kv_heads=3,
            block_size=16,
            kernel_block_size=16 // self.ratio,
            head_size=64,
            dtype="float32",
            layout=vllm028_layout(self.kv_layout, self.storage == "cross-layer"),
            contract="0.28",
        )


CASES = tuple(
    ProbeCase(storage, kv, ratio)
    for storage in ("per-layer", "cross-layer")
    for kv in ("NHD", "HND")
    for ratio in (1, 2)
)


@dataclass
class ProbeResult:
    case: str
    layout: str
    backend: str
    ok: bool = False
    page_size: int = 0
    pages_touched: int = 0
    straddling_blocks: int = 0
    peak_footprint: int = 0
    footprint_after_free: int = 0
    foreign_pages: int = 0
    rejected_under_pressure: bool = False
    reallocated: bool = False
    seconds: float = 0.0
    error: str | None = None
    checks: list[str] = field(default_factory=list)


def _check(condition: bool, what: str, result: ProbeResult) -> None:
    if not condition:
        raise ProbeFailure(what)
    result.checks.append(what)


def _expected(geometry: KVCacheGeometry, layer: int, side: int) -> torch.Tensor:
    """One distinct value per (layer, kernel block, side), exact in fp32."""
    kernel_blocks = torch.arange(geometry.num_kernel_blocks, dtype=torch.float32)
    return (layer * geometry.num_kernel_blocks + kernel_blocks) * 2 + side + 1


def _write_and_check(
    geometry: KVCacheGeometry, vrange: VirtualRange, blocks: list[int], result: ProbeResult
) -> None:
    committed = vrange.committed_pages()
    pages = {
        p for b in blocks for p in geometry.block_pages(b, vrange.page_size)
    }  # checked before any access: strict mode would fault on an uncommitted page
    _check(pages <= committed, "every page under the blocks is committed", result)
    backing = vrange.as_tensor()
    views = build_layer_views(geometry, backing)
    ratio = geometry.kernel_ratio
    logical = torch.tensor(blocks, dtype=torch.long)
    kernel = (logical[:, None] * ratio + torch.arange(ratio)).reshape(-1).to(backing.device)
    for layer in range(LAYERS):
        for side, tensor in enumerate(split_kv(geometry, views[layer])):
            values = _expected(geometry, layer, side).to(backing.device)[kernel]
            tensor[kernel] = values.view(-1, 1, 1, 1).expand(-1, *tensor.shape[1:])
    for layer in range(LAYERS):
        for side, tensor in enumerate(split_kv(geometry, views[layer])):
            values = _expected(geometry, layer, side).to(backing.device)[kernel]
            got = tensor[kernel]
            want = values.view(-1, 1, 1, 1).expand_as(got)
            _check(
                bool(torch.equal(got, want)),
                f"layer {layer} {'KV'[side]} values read back",
                result,
            )


def _wait_for(tensor: torch.Tensor) -> None:
    """Let queued kernels on ``tensor`` finish (CUDA launches are asynchronous)."""
    if tensor.is_cuda:
        torch.cuda.synchronize(tensor.device)


def run_case(backend: VmmBackend, case: ProbeCase) -> ProbeResult:
    """One probe case; any failure, a fault while closing included, becomes a FAIL result."""
    geometry = case.geometry()
    layout = KVLayout.parse(geometry.layout).name
    result = ProbeResult(case=case.name, layout=layout, backend=backend.name)
    start = time.perf_counter()
    result.page_size = backend.page_size
    try:
        vrange = backend.reserve(geometry.backing_bytes)
    except Exception as exc:
        result.error = f"reserving the range: {type(exc).__name__}: {exc}"
        result.seconds = round(time.perf_counter() - start, 3)
        return result
    try:
        _run_checks(backend, geometry, vrange, result)
        result.ok = True
    except Exception as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    try:
        vrange.close()
    except Exception as exc:
        closing = f"closing the range: {type(exc).__name__}: {exc}"
        result.error = closing if result.error is None else f"{result.error}; {closing}"
        result.ok = False
    result.seconds = round(time.perf_counter() - start, 3)
    return result


def _run_checks(
    backend: VmmBackend, geometry: KVCacheGeometry, vrange: VirtualRange, result: ProbeResult
) -> None:
    page = backend.page_size
    every = range(geometry.num_blocks)
    touched = {p for b in every for p in geometry.block_pages(b, page)}
    result.pages_touched = len(touched)
    result.straddling_blocks = sum(
        1 for b in every for s, e in geometry.block_byte_ranges(b) if s // page != (e - 1) // page
    )
    policy = FixedBudget((len(touched) + SLACK_PAGES) * page)
    alloc = BlockAllocator(geometry, vrange, policy, min_hot_pages=0, max_hot_pages=0)
    try:
        null_bytes = len(alloc.null_block_pages()) * page
        blocks = alloc.allocate(BLOCKS)
        _check(blocks is not None and len(blocks) == BLOCKS, "600 blocks allocated", result)
        assert blocks is not None
        _check(
            vrange.footprint_bytes() == len(alloc.committed_pages()) * page,
            "footprint equals committed pages",
            result,
        )
        result.peak_footprint = vrange.footprint_bytes()
        _write_and_check(geometry, vrange, blocks, result)
        alloc.free(blocks)
        result.footprint_after_free = vrange.footprint_bytes()
        _check(
            result.footprint_after_free == null_bytes,
            "pages released after free (only the null block's remain)",
            result,
        )
        foreign_pages = policy.available_bytes() // page - (len(touched) - null_bytes // page)
        foreign_pages += 1
        result.foreign_pages = foreign_pages
        _check(policy.try_admit(foreign_pages * page), "foreign allocation admitted", result)
        foreign = backend.reserve(foreign_pages * page)
        try:
            foreign.commit(range(foreign_pages))
            filled = foreign.as_tensor().fill_(0x5A)
            _wait_for(filled)  # the fill must finish before the close unmaps its pages
            del filled
            _check(
                foreign.footprint_bytes() == foreign_pages * page,
                "foreign allocation is real memory",
                result,
            )
            _check(not alloc.can_allocate(BLOCKS), "capacity query sees the pressure", result)
            refused = alloc.allocate(BLOCKS)
            result.rejected_under_pressure = refused is None
            _check(refused is None, "600 blocks rejected under pressure", result)
            _check(vrange.footprint_bytes() == null_bytes, "rejection left no trace", result)
        finally:
            foreign.close()
            policy.release(foreign_pages * page)
        _check(alloc.can_allocate(BLOCKS), "capacity is back after the foreign free", result)
        again = alloc.allocate(BLOCKS)
        result.reallocated = again is not None
        _check(again is not None, "600 blocks allocated again", result)
        assert again is not None
        _write_and_check(geometry, vrange, again, result)
        alloc.free(again)
        _check(vrange.footprint_bytes() == null_bytes, "released again", result)
    finally:
        alloc.close()
    _check(policy.admitted_bytes == 0, "budget fully returned", result)


def make_backend(name: str, page_size: int | None) -> VmmBackend:
    """The host backend, or the CUDA backend (imported only when asked for)."""
    from elastickv.vmm import DEFAULT_PAGE_SIZE

    size = DEFAULT_PAGE_SIZE if page_size is None else page_size
    if name == "host":
        from elastickv.vmm import HostBackend

        return HostBackend(page_size=size)
    if name == "cuda":
        try:
            from elastickv.vmm.cuda import CudaBackend
        except ImportError as exc:
            raise BackendUnavailable(
                f"the CUDA backend is not available here ({exc}); install elastickv[cuda] "
                "on a machine with an NVIDIA driver"
            ) from exc
        return CudaBackend(page_size=size)
    raise BackendUnavailable(f"unknown backend {name!r}; use host or cuda")


def _print_table(results: list[ProbeResult]) -> None:
    from rich.table import Table

    from elastickv.cli.tables import output_console, print_table

    table = Table(title=f"VMM probes ({results[0].backend if results else '?'} backend)")
    for column in (
        "case",
        "layout",
        "pages",
        "straddling",
        "peak MiB",
        "after free MiB",
        "foreign pages",
        "rejected",
        "reallocated",
        "s",
        "result",
    ):
        table.add_column(column)
    mib = 1 << 20
    for r in results:
        table.add_row(
            r.case,
            r.layout,
            str(r.pages_touched),
            str(r.straddling_blocks),
            f"{r.peak_footprint / mib:.1f}",
            f"{r.footprint_after_free / mib:.1f}",
            str(r.foreign_pages),
            "yes" if r.rejected_under_pressure else "no",
            "yes" if r.reallocated else "no",
            f"{r.seconds:.2f}",
            "[green]PASS[/]" if r.ok else f"[red]FAIL[/] {r.error}",
        )
    print_table(output_console(), table)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--backend", choices=("host", "cuda"), default="host")
    parser.add_argument("--page-size", type=int, default=None, help="bytes (backend default)")
    parser.add_argument("--json", action="store_true", help="one JSON line per case")
    args = parser.parse_args(argv)
    try:
        backend = make_backend(args.backend, args.page_size)
    except (VmmError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    results = [run_case(backend, case) for case in CASES]
    if args.json:
        for r in results:
            print(json.dumps({k: v for k, v in asdict(r).items() if k != "checks"}))
    else:
        _print_table(results)
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
