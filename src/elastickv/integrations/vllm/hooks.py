"""Small helpers to wrap a vLLM method once, recognisably, so re-registration is a no-op."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

_MARK = "__elastickv_original__"


def wrap_method(
    owner: type, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]
) -> None:
    """Replace ``owner.name`` by ``make(original)`` unless it was already wrapped by us."""
    original = owner.__dict__.get(name)
    if original is None:
        original = getattr(owner, name)
    if getattr(original, _MARK, None) is not None:
        return
    wrapper = functools.wraps(original)(make(original))
    setattr(wrapper, _MARK, original)
    setattr(owner, name, wrapper)
