"""vLLM 0.28–0.31's elastic block pool: the 0.32 one, adapted (the hooks are shared).

0.28's ``BlockPool`` / ``KVCacheCoordinator`` / ``KVCacheManager`` have the shape the hooks
rely on (``get_num_blocks_to_allocate`` then ``get_num_free_blocks`` inside
``allocate_slots``, ``get_new_blocks``, ``free_blocks``, ``touch``, ``evict_blocks``,
``reset_prefix_cache``), so ``scheduler_hooks`` applies unchanged. What 0.28 lacks: blocks
that belong to another pool (``KVCacheBlock.pool``; 0.28's block is a slotted dataclass
without it) and ``unpin_blocks`` with its reuse watchers. :class:`ElasticBlockPoolV028`
supplies an empty watcher table (so those paths are inert) and a ``free_blocks`` without the
pool check.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from elastickv.integrations.vllm.scheduler.block_pool import ElasticBlockPool


class ElasticBlockPoolV028(ElasticBlockPool):
    """:class:`ElasticBlockPool` on vLLM 0.28's ``BlockPool`` (single pool, no unpinning)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # 0.28 never unpins blocks: no block is ever watched, so every watcher path is inert.
        self._reuse_watchers: dict[int, Any] = {}

    def free_blocks(self, ordered_blocks: Iterable[Any]) -> None:
        blocks = list(ordered_blocks)
        super(ElasticBlockPool, self).free_blocks(blocks)  # vLLM's own bookkeeping
        self._released(blocks, check_pool=False)

    def unpin_blocks(self, blocks: Iterable[Any], on_reuse: Any) -> None:
        raise NotImplementedError("vLLM 0.28 has no unpin_blocks")


def install() -> None:
    """The scheduler hooks, with 0.28's pool class."""
    from elastickv.integrations.vllm.scheduler import scheduler_hooks

    scheduler_hooks.install(ElasticBlockPoolV028)
