"""``forward_positionally``: a hook with the hooked method's own parameters hands every
argument, however it was passed, to the hook in the method's order, with its defaults."""

from __future__ import annotations

import inspect
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from elastickv.integrations.vllm.hooks import forward_positionally

NAMES = ["request_id", "num_tokens", "blocks", "total", "cap", "prefill_end"]


@st.composite
def calls(draw: st.DrawFn) -> tuple[Any, list[Any], dict[str, Any]]:
    """A method of 1-6 parameters (a suffix of them with defaults) and a valid call of it:
    some leading arguments positional, some of the rest by keyword, the others defaulted."""
    count = draw(st.integers(1, len(NAMES)))
    names = NAMES[:count]
    first_default = draw(st.integers(0, count))
    defaults = {n: object() for n in names[first_default:]}
    params = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)] + [
        inspect.Parameter(
            n,
            inspect.Parameter.POSITIONAL_OR_KEYWORD,
            default=defaults.get(n, inspect.Parameter.empty),
        )
        for n in names
    ]

    def method(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("not called by the forwarder itself")

    method.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    method.__name__ = "method"
    positional = draw(st.integers(0, count))
    values = {n: object() for n in names}
    args = [values[n] for n in names[:positional]]
    kwargs = {n: values[n] for n in names[positional:] if n not in defaults or draw(st.booleans())}
    return method, args, kwargs


@given(calls())
def test_the_hook_gets_every_argument_in_order(call: tuple[Any, list[Any], dict[str, Any]]) -> None:
    method, args, kwargs = call
    seen: list[tuple[Any, tuple[Any, ...]]] = []

    def hook(self: Any, got: tuple[Any, ...]) -> str:
        seen.append((self, got))
        return "done"

    forwarder = forward_positionally(method, hook)
    assert forwarder is not None
    owner = object()
    assert forwarder(owner, *args, **kwargs) == "done"
    bound = inspect.signature(method).bind(owner, *args, **kwargs)
    bound.apply_defaults()
    assert seen == [(owner, tuple(bound.arguments.values())[1:])]
    assert inspect.signature(forwarder) == inspect.signature(method)


def test_methods_it_cannot_mirror_get_none() -> None:
    def star(self: Any, *args: Any) -> None: ...

    def keyword_only(self: Any, *, request: Any) -> None: ...

    def clashing(self: Any, impl: Any) -> None: ...

    for method in (star, keyword_only, clashing):
        assert forward_positionally(method, lambda self, args: None) is None


def test_a_wrong_call_fails_like_the_method() -> None:
    def method(self: Any, request: Any, num: int = 0) -> None: ...

    forwarder = forward_positionally(method, lambda self, args: args)
    assert forwarder is not None
    with pytest.raises(TypeError, match="request"):
        forwarder(object())
    with pytest.raises(TypeError, match="unexpected keyword argument 'other'"):
        forwarder(object(), 1, other=2)
