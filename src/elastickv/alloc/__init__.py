"""Elastic block allocation: blocks inside pages, pages committed on demand under a policy."""

from elastickv.alloc.allocator import (
    NULL_BLOCK,
    AllocatorStats,
    BlockAllocator,
    null_floor_bytes,
)
from elastickv.alloc.pagemap import PageMap
from elastickv.alloc.policy import CapacityPolicy, FixedBudget, Unlimited

__all__ = [
    "NULL_BLOCK",
    "AllocatorStats",
    "BlockAllocator",
    "CapacityPolicy",
    "FixedBudget",
    "PageMap",
    "Unlimited",
    "null_floor_bytes",
]
