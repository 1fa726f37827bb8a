"""Shared sizes for the ledger tests (a uniquely named module: test folders have no
``__init__.py``, so ``conftest`` is not importable by name without ambiguity)."""

from __future__ import annotations

MiB = 1 << 20
BUDGET = 64 * MiB
