"""Small helpers to wrap a vLLM method once, recognisably, so re-registration is a no-op."""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap
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


def compile_hook(
    original: Callable[..., Any],
    template: str,
    namespace: dict[str, Any],
    uses: tuple[str, ...] = (),
) -> Callable[..., Any] | None:
    """``template`` compiled into a function with ``original``'s own parameters: its source
    is one ``def {name}({signature}):`` whose body may call ``original({arguments})`` (every
    argument in ``original``'s order) and read the parameters named in ``uses``; every other
    name it reads is ``original``, ``namespace``'s or a builtin. None when ``original`` takes
    anything but plain positional-or-keyword parameters, lacks one of ``uses``, or has a
    parameter the body uses for something else (then a ``*args, **kwargs`` wrapper must do).

    Why: vLLM's scheduler calls the methods we hook for every running request in every step,
    with keyword arguments. A generic wrapper packs them into a dict and unpacks them again
    (0.53 µs per call of ``get_num_blocks_to_allocate``, nine keywords), and a forwarder to a
    separate hook function still costs a call and a tuple. The hook's own body compiled with
    the method's signature costs neither. The source is built from ``original``'s parameter
    names only (identifiers); defaults are the original's own objects."""
    params = list(inspect.signature(original).parameters.values())
    if not params or any(
        p.kind is not inspect.Parameter.POSITIONAL_OR_KEYWORD or not p.name.isidentifier()
        for p in params
    ):
        return None
    names = [p.name for p in params]
    body_names = {
        node.id
        for node in ast.walk(ast.parse(template.format(name="hook", signature="", arguments="")))
        if isinstance(node, ast.Name)
    }
    reserved = (body_names - set(uses)) | set(namespace) | {"original", "defaults", "make"}
    if len(set(names)) != len(names) or reserved & set(names) or not set(uses) <= set(names):
        return None
    defaults = {p.name: p.default for p in params if p.default is not inspect.Parameter.empty}
    signature = ", ".join(f"{n}=defaults[{n!r}]" if n in defaults else n for n in names)
    function = template.format(
        name=original.__name__, signature=signature, arguments=", ".join(names)
    )
    source = "def make(original, defaults):\n" + textwrap.indent(function.strip("\n"), "    ")
    source += f"\n    return {original.__name__}\n"
    scope = dict(namespace)
    exec(compile(source, f"<elastickv hook of {original.__qualname__}>", "exec"), scope)
    hook: Callable[..., Any] = scope["make"](original, defaults)
    return hook
