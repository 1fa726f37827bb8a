"""The API key: where it comes from, what is refused (never naming the key), how a header is
matched, what counts as loopback."""

from __future__ import annotations

import string
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elastickv.serve.auth import (
    ENV_API_KEY,
    ApiKey,
    ApiKeyError,
    is_loopback,
    key_from_environment,
    read_key_file,
)

KEY = "k3y-" + "x" * 28
TOKEN_CHARS = string.ascii_letters + string.digits + "-._~+/="
keys = st.text(TOKEN_CHARS, min_size=16, max_size=64)


@settings(max_examples=200, deadline=None)
@given(keys, keys)
def test_a_header_matches_only_its_own_key(key: str, other: str) -> None:
    api = ApiKey("test", key)
    assert api.matches(f"Bearer {key}") and api.matches(f"bearer {key}")
    assert api.matches(api.header()["Authorization"])
    assert api.matches(f"Bearer {other}") is (other == key)
    assert not api.matches(None) and not api.matches(key) and not api.matches(f"Basic {key}")
    assert not api.matches(f"Bearer {key}x") and not api.matches("Bearer ")
    assert key not in repr(api)


@settings(max_examples=100, deadline=None)
@given(st.text(min_size=1, max_size=40))
def test_a_refused_key_is_never_in_the_message(secret: str) -> None:
    try:
        ApiKey("the file /etc/k", secret)
    except ApiKeyError as exc:
        assert "the file /etc/k" in str(exc)
        if len(secret.strip()) > 2:
            assert secret not in str(exc)


def test_short_or_unprintable_keys_are_refused() -> None:
    with pytest.raises(ApiKeyError, match="is 5 characters long; use at least 16"):
        ApiKey("x", "short")
    with pytest.raises(ApiKeyError, match="spaces or characters an HTTP header cannot carry"):
        ApiKey("x", "a key with spaces in it")
    with pytest.raises(ApiKeyError, match="spaces or characters"):
        ApiKey("x", "ключ-ключ-ключ-ключ")


def test_a_key_file_is_read_and_trimmed(tmp_path: Path) -> None:
    path = tmp_path / "key"
    path.write_text(f"\n  {KEY}  \n")
    key = read_key_file(path, "--api-key-file")
    assert key.secret == KEY and key.source == f"--api-key-file {path}"
    with pytest.raises(ApiKeyError, match="no such file"):
        read_key_file(tmp_path / "missing", "--api-key-file")
    (tmp_path / "empty").write_text(" \n")
    with pytest.raises(ApiKeyError, match="is empty; put the key in it"):
        read_key_file(tmp_path / "empty", "[router] api_key_file")


def test_the_environment_variable() -> None:
    assert key_from_environment({}) is None
    key = key_from_environment({ENV_API_KEY: KEY})
    assert key is not None and key.secret == KEY and key.source == ENV_API_KEY
    with pytest.raises(ApiKeyError, match="set but empty"):
        key_from_environment({ENV_API_KEY: " "})


def test_generated_keys_differ() -> None:
    assert ApiKey.generated("a").secret != ApiKey.generated("a").secret


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.3.2.1", True),
        ("localhost", True),
        ("::1", True),
        ("[::1]", True),
        ("0.0.0.0", False),
        ("::", False),
        ("10.0.0.5", False),
        ("example.com", False),
    ],
)
def test_loopback(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback
