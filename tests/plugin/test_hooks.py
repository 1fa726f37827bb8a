"""``compile_hook``: a hook compiled with the hooked method's own parameters hands every
argument, however it was passed, to the method in its order, with its defaults, and reads the
parameters it names; a method it cannot mirror, or whose parameters clash with the hook's
names, gets None (the generic wrapper then does)."""

from __future__ import annotations

import inspect
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elastickv.integrations.vllm.hooks import compile_hook

NAMES = ["request_id", "num_tokens", "blocks", "total", "cap", "prefill_end"]
# Calls the method and records what it got and what the hook read by name.
RECORDING_HOOK = """
def {name}({signature}):
    result = original({arguments})
    seen.append((self, result))
    return "done"
"""


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


# No deadline: a loaded machine may stall an example past hypothesis's 200 ms.
@settings(deadline=None)
@given(calls())
def test_the_method_gets_every_argument_in_order(
    call: tuple[Any, list[Any], dict[str, Any]],
) -> None:
    method, args, kwargs = call
    seen: list[tuple[Any, tuple[Any, ...]]] = []

    def original(self: Any, *got: Any) -> tuple[Any, ...]:
        return got

    original.__signature__ = inspect.signature(method)  # type: ignore[attr-defined]
    original.__name__ = method.__name__
    hook = compile_hook(original, RECORDING_HOOK, {"seen": seen}, uses=("self",))
    assert hook is not None
    owner = object()
    assert hook(owner, *args, **kwargs) == "done"
    bound = inspect.signature(method).bind(owner, *args, **kwargs)
    bound.apply_defaults()
    assert seen == [(owner, tuple(bound.arguments.values())[1:])]
    assert inspect.signature(hook) == inspect.signature(method)


def test_the_hook_reads_the_parameters_it_uses() -> None:
    def method(self: Any, request: Any, num: int = 3) -> int:
        return num * 2

    template = """
def {name}({signature}):
    return (original({arguments}), request, num)
"""
    hook = compile_hook(method, template, {}, uses=("request", "num"))
    assert hook is not None
    assert hook(object(), "r") == (6, "r", 3)
    assert hook(object(), num=5, request="q") == (10, "q", 5)


def test_methods_it_cannot_mirror_get_none() -> None:
    def star(self: Any, *args: Any) -> None: ...

    def keyword_only(self: Any, *, request: Any) -> None: ...

    def clashing_with_a_name(self: Any, seen: Any) -> None: ...  # the namespace's

    def clashing_with_a_local(self: Any, result: Any) -> None: ...  # the body's

    def clashing_with_the_original(self: Any, original: Any) -> None: ...

    for method in (star, keyword_only, clashing_with_a_name, clashing_with_a_local):
        assert compile_hook(method, RECORDING_HOOK, {"seen": []}, uses=("self",)) is None
    assert compile_hook(clashing_with_the_original, RECORDING_HOOK, {"seen": []}) is None

    def without_request(self: Any, num: int) -> None: ...  # the hook reads ``request``

    assert compile_hook(without_request, RECORDING_HOOK, {"seen": []}, uses=("request",)) is None


def test_a_wrong_call_fails_like_the_method() -> None:
    def method(self: Any, request: Any, num: int = 0) -> None: ...

    hook = compile_hook(method, RECORDING_HOOK, {"seen": []}, uses=("self",))
    assert hook is not None
    with pytest.raises(TypeError, match="request"):
        hook(object())
    with pytest.raises(TypeError, match="unexpected keyword argument 'other'"):
        hook(object(), 1, other=2)
