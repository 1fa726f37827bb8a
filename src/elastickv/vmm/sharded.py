"""One page index committed on every rank at once: the KV pool of a tensor-parallel engine.

Under tensor parallelism each worker rank holds the same blocks of its own shard of the KV
heads, so all ranks share one geometry and block ``b`` lives at the same offsets in every
rank's pool. The scheduler hands out one block id for all ranks; :class:`ShardedRange`
lets one allocator commit and release a page index in every rank's range as one
transaction (all ranks or none), and charges its policy for all of them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from elastickv.vmm.base import VirtualRange
from elastickv.vmm.errors import VmmError

if TYPE_CHECKING:
    import torch


class ShardedRange(VirtualRange):
    """``shards[r]`` is rank ``r``'s range; page ``i`` here is page ``i`` on every rank.

    ``commit`` is all-or-nothing across ranks: a rank that fails rolls back the ranks done
    before it, so no page is ever committed on some ranks only. ``release`` tries every
    rank; if one fails, the page stays committed here (a retry releases the rest).
    """

    backend_name = "sharded"

    def __init__(self, shards: Sequence[VirtualRange]) -> None:
        if not shards:
            raise ValueError("a sharded range needs at least one rank's range")
        first = shards[0]
        for rank, shard in enumerate(shards):
            if (shard.page_size, shard.num_pages) != (first.page_size, first.num_pages):
                raise ValueError(
                    f"rank {rank}'s range has {shard.num_pages} pages of {shard.page_size} B "
                    f"but rank 0's has {first.num_pages} of {first.page_size} B; every rank "
                    "of one engine must hold the same KV pool"
                )
        super().__init__(
            base_address=first.base_address,
            size_bytes=first.num_pages * first.page_size,
            page_size=first.page_size,
            strict=all(shard.strict for shard in shards),
        )
        self._shards = tuple(shards)

    @property
    def shards(self) -> tuple[VirtualRange, ...]:
        return self._shards

    @property
    def bytes_per_page(self) -> int:
        return self.page_size * len(self._shards)

    def footprint_bytes(self) -> int:
        """The sum of every rank's footprint, as each rank's kernel or driver reports it."""
        return sum(shard.footprint_bytes() for shard in self._shards)

    def as_tensor(self) -> torch.Tensor:
        raise VmmError("a sharded range has one tensor per rank; use shards[rank].as_tensor()")

    def _commit_run(self, first: int, count: int) -> None:
        pages = range(first, first + count)
        done: list[VirtualRange] = []
        try:
            for shard in self._shards:
                shard.commit(pages)
                done.append(shard)
        except BaseException as exc:
            for shard in reversed(done):
                try:
                    shard.release(pages)
                except VmmError as undo:
                    exc.add_note(f"rollback of pages {first}..{first + count - 1}: {undo}")
            raise

    def _release_run(self, first: int, count: int) -> None:
        pages = range(first, first + count)
        failure: VmmError | None = None
        for shard in self._shards:
            try:
                shard.release(pages)
            except VmmError as exc:
                failure = failure or exc
        if failure is not None:
            raise failure

    def _teardown(self) -> None:
        failure: VmmError | None = None
        for shard in self._shards:
            try:
                shard.close()
            except VmmError as exc:
                failure = failure or exc
        if failure is not None:
            raise failure
