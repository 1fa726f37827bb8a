"""Who may use a router: one API key, sent as ``Authorization: Bearer <key>`` (as with vLLM's
``--api-key``).

The key comes from a file or from ``ELASTICKV_API_KEY``, never from a command line (where every
user of the machine reads it in ``ps``). It is never logged and never part of a message:
:class:`ApiKey` keeps it out of its ``repr``, and errors name where it came from, not what it
is. Keys are compared in constant time.
"""

from __future__ import annotations

import hmac
import ipaddress
import os
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

ENV_API_KEY = "ELASTICKV_API_KEY"
MIN_KEY_LENGTH = 16
_BEARER = "bearer "
_HOW = "e.g. the output of `openssl rand -hex 32`"


class ApiKeyError(ValueError):
    """A key that cannot be used; the message says where it came from and why (never the key)."""


@dataclass(frozen=True)
class ApiKey:
    """The key a router requires, and where it came from (for messages)."""

    source: str
    secret: str = field(repr=False)

    def __post_init__(self) -> None:
        if len(self.secret) < MIN_KEY_LENGTH:
            raise ApiKeyError(
                f"the API key from {self.source} is {len(self.secret)} characters long; use at "
                f"least {MIN_KEY_LENGTH} ({_HOW})"
            )
        if not self.secret.isascii() or not self.secret.isprintable() or " " in self.secret:
            raise ApiKeyError(
                f"the API key from {self.source} has spaces or characters an HTTP header cannot "
                f"carry; use letters, digits and punctuation ({_HOW})"
            )

    def matches(self, authorization: str | None) -> bool:
        """Whether an ``Authorization`` header carries this key (constant time)."""
        if authorization is None or authorization[: len(_BEARER)].lower() != _BEARER:
            return False
        offered = authorization[len(_BEARER) :].strip().encode("utf-8", "replace")
        return hmac.compare_digest(offered, self.secret.encode())

    def header(self) -> dict[str, str]:
        """The header a client sends."""
        return {"Authorization": f"Bearer {self.secret}"}

    @classmethod
    def generated(cls, source: str) -> ApiKey:
        """A random key (for a private link between two processes of one host)."""
        return cls(source, secrets.token_urlsafe(32))


def read_key_file(path: str | os.PathLike[str], label: str) -> ApiKey:
    """The key in a file (surrounding whitespace ignored); ``label`` names the setting."""
    where = f"{label} {os.fspath(path)}"
    try:
        text = Path(path).expanduser().read_text()
    except FileNotFoundError:
        raise ApiKeyError(f"{where}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ApiKeyError(f"{where}: cannot read it ({exc.__class__.__name__})") from None
    secret = text.strip()
    if not secret:
        raise ApiKeyError(f"{where} is empty; put the key in it ({_HOW})")
    return ApiKey(where, secret)


def key_from_environment(environ: Mapping[str, str]) -> ApiKey | None:
    """``ELASTICKV_API_KEY``, if set (set but empty is an error: it looks like a key)."""
    value = environ.get(ENV_API_KEY)
    if value is None:
        return None
    if not value.strip():
        raise ApiKeyError(f"{ENV_API_KEY} is set but empty; unset it or put the key in it")
    return ApiKey(ENV_API_KEY, value.strip())


def is_loopback(host: str) -> bool:
    """Whether a listener on ``host`` is reachable from this machine only."""
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip().strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to any interface
