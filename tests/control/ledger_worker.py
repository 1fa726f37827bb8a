"""A real elastic instance for the multi-process ledger tests: a host-backend range, a
``BlockAllocator`` admitted through the ledger, and a random allocate/free workload.

    python ledger_worker.py stress DIR NAME MIN_OPS SEED
    python ledger_worker.py credit DIR NAME MIN_OPS SEED
    python ledger_worker.py hold DIR NAME BYTES

Prints one JSON line ``{"ready": ..., "fd": <memfd>}`` once registered. stress and credit then
wait for a line on stdin (``go``: all workers start contending together), run until a second
line (``stop``: the test saw what it waits for) and at least MIN_OPS operations, and print one
JSON summary. Exits non-zero if the kernel ever held more than the ledger admitted.

``credit`` runs an engine's protocol: credit taken per step for a random demand, blocks
placed within it over page grants, and the page operations applied by a follower to a real
range (the worker's), so the kernel's footprint is the granted pages.
"""

from __future__ import annotations

import json
import random
import sys
import threading
import time

from elastickv.alloc import BlockAllocator
from elastickv.control import LedgerPolicy, open_ledger
from elastickv.control.credit import CreditPolicy
from elastickv.geometry import KVCacheGeometry
from elastickv.vmm import HostBackend
from elastickv.vmm.grants import GrantFollower, PageGrants

PAGE = 64 * 1024
# 16 KiB per block over 2 layers: 8 blocks share a 64 KiB page in each layer; 8 MiB in all.
GEOMETRY = KVCacheGeometry(
    num_layers=2, num_blocks=512, num_kv_heads=2, block_size=16, head_size=64
)


def say(**fields: object) -> None:
    print(json.dumps(fields), flush=True)


class Until:
    """Reads ``go`` (blocking), then ``stop`` in a thread: :meth:`running` until ``stop`` came
    and at least ``min_ops`` operations were counted."""

    def __init__(self, min_ops: int) -> None:
        self.min_ops = min_ops
        self.ops = 0
        self._stop = threading.Event()

    def go(self) -> Until:
        sys.stdin.readline()  # start together, once every worker holds its null block
        threading.Thread(target=self._wait_for_stop, daemon=True).start()
        return self

    def _wait_for_stop(self) -> None:
        sys.stdin.readline()  # "stop", or the end of input: either way no more waiting
        self._stop.set()

    def running(self) -> bool:
        if self._stop.is_set() and self.ops >= self.min_ops:
            return False
        self.ops += 1
        return True


def stress(directory: str, name: str, min_ops: int, seed: int) -> int:
    rng = random.Random(seed)
    with (
        open_ledger(directory=directory) as ledger,
        ledger.register(name) as handle,
        HostBackend(page_size=PAGE).reserve(GEOMETRY.backing_bytes) as vrange,
        BlockAllocator(GEOMETRY, vrange, LedgerPolicy(handle)) as alloc,
    ):
        say(ready=name, fd=vrange.pool.fd)
        until = Until(min_ops).go()
        held: list[list[int]] = []
        refusals = 0
        max_footprint = 0
        while until.running():
            if held and rng.random() < 0.45:
                alloc.free(held.pop(rng.randrange(len(held))))
            else:
                blocks = alloc.allocate(rng.randint(1, 24))
                if blocks is None:
                    refusals += 1
                    if held and rng.random() < 0.5:
                        alloc.free(held.pop(rng.randrange(len(held))))
                else:
                    held.append(blocks)
            footprint = vrange.footprint_bytes()
            max_footprint = max(max_footprint, footprint)
            if footprint > handle.committed_bytes:
                say(error=f"kernel holds {footprint} > admitted {handle.committed_bytes}")
                return 3
        stats = alloc.stats()
        for blocks in held:
            alloc.free(blocks)
        say(
            done=name,
            ops=until.ops,
            refusals=refusals,
            allocator_refusals=stats.refusals,
            max_footprint=max_footprint,
        )
    return 0


def credit(directory: str, name: str, min_ops: int, seed: int) -> int:
    rng = random.Random(seed)
    grants = PageGrants(GEOMETRY.backing_bytes, PAGE)
    with (
        open_ledger(directory=directory) as ledger,
        ledger.register(name) as handle,
        HostBackend(page_size=PAGE).reserve(GEOMETRY.backing_bytes) as vrange,
    ):
        policy = CreditPolicy(handle)
        alloc = BlockAllocator(GEOMETRY, grants, policy)
        follower = GrantFollower(vrange)
        follower.apply(grants.drain())
        say(ready=name, fd=vrange.pool.fd)
        until = Until(min_ops).go()
        held: list[list[int]] = []
        refusals = 0
        max_footprint = 0
        while until.running():
            # One scheduler step: credit for the demand, blocks within it, frees.
            policy.settle(rng.randint(0, 24) * PAGE)
            for _ in range(rng.randint(1, 4)):
                want = rng.randint(1, 24)
                if want > alloc.blocks_within(policy.available_bytes()):
                    refusals += 1
                    continue
                blocks = alloc.allocate(want)
                if blocks is None:
                    say(error=f"{want} blocks within the counted room were refused")
                    return 4
                held.append(blocks)
            while held and rng.random() < 0.5:
                alloc.free(held.pop(rng.randrange(len(held))))
            follower.apply(grants.drain())
            footprint = vrange.footprint_bytes()
            max_footprint = max(max_footprint, footprint)
            if footprint != grants.granted_pages() * PAGE or footprint > policy.admitted_bytes:
                say(error=f"kernel holds {footprint}, granted {grants.granted_pages() * PAGE}")
                return 3
        for blocks in held:
            alloc.free(blocks)
        alloc.close()
        follower.apply(grants.drain())
        say(done=name, ops=until.ops, refusals=refusals, max_footprint=max_footprint)
    return 0


def hold(directory: str, name: str, nbytes: int) -> int:
    """Commit about ``nbytes`` through the ledger, report it, then wait to be killed."""
    with (
        open_ledger(directory=directory) as ledger,
        ledger.register(name) as handle,
        HostBackend(page_size=PAGE).reserve(GEOMETRY.backing_bytes) as vrange,
        BlockAllocator(GEOMETRY, vrange, LedgerPolicy(handle)) as alloc,
    ):
        while handle.committed_bytes < nbytes and alloc.allocate(8) is not None:
            pass
        say(ready=name, fd=vrange.pool.fd, committed=handle.committed_bytes)
        time.sleep(600)
    return 0


def main(argv: list[str]) -> int:
    mode, directory, name = argv[:3]
    if mode == "stress":
        return stress(directory, name, int(argv[3]), int(argv[4]))
    if mode == "credit":
        return credit(directory, name, int(argv[3]), int(argv[4]))
    if mode == "hold":
        return hold(directory, name, int(argv[3]))
    raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
