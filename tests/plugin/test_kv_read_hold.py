"""The P/D read hold without vLLM: which expired leases are held and for how long, and when a
decoder must compute a prompt itself instead of reading the prefiller's blocks. vLLM's own
methods run under these hooks in ``tests/vllm/test_transfer_v032.py`` and end to end in
``tests/integration_vllm/test_vllm_plugin_v032_pd.py``."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elastickv.integrations.vllm.transfer.kv_read_hold import (
    HOLD_AHEAD_S,
    READ_BY_KEY,
    READ_MARGIN_S,
    UnreadLeaseHold,
    expired,
    read_by,
)


def test_an_expired_lease_is_held_once_then_left_to_expire() -> None:
    hold = UnreadLeaseHold(20.0, ahead_s=0.0)
    leases = {"a": 10.0, "b": 50.0}
    assert hold.extend(leases, now=5.0) == []
    assert leases == {"a": 10.0, "b": 50.0}
    assert hold.extend(leases, now=10.0) == ["a"]  # expiry reached: held 20 s more
    assert leases == {"a": 30.0, "b": 50.0}
    assert hold.extend(leases, now=29.0) == []
    assert hold.extend(leases, now=30.0) == []  # held before: vLLM reaps it now
    assert leases["a"] == 30.0


def test_a_lease_about_to_run_out_is_held_already() -> None:
    """vLLM's reaper reads its clock after the hook: a lease ending in between must be held
    by the hook, or vLLM frees blocks no decoder has read."""
    hold = UnreadLeaseHold(20.0)
    assert hold.ahead_s == HOLD_AHEAD_S > 0
    leases = {"soon": 10.0 + HOLD_AHEAD_S / 2, "later": 10.0 + 2 * HOLD_AHEAD_S}
    assert hold.extend(leases, now=10.0) == ["soon"]
    assert leases == {"soon": 30.0 + HOLD_AHEAD_S / 2, "later": 10.0 + 2 * HOLD_AHEAD_S}


def test_a_request_done_in_between_is_forgotten() -> None:
    hold = UnreadLeaseHold(5.0, ahead_s=0.0)
    leases = {"a": 1.0}
    assert hold.extend(leases, now=2.0) == ["a"]
    del leases["a"]  # the decoder read it: vLLM reported it done
    leases["b"] = 3.0
    assert hold.extend(leases, now=4.0) == ["b"]
    leases["a"] = 4.0  # a new request under a reused id is a new lease
    assert hold.extend(leases, now=4.0) == ["a"]


# No deadline: a loaded machine may stall an example past hypothesis's 200 ms.
@settings(deadline=None)
@given(
    st.dictionaries(st.text(max_size=3), st.floats(0, 100), max_size=8),
    st.floats(0, 100),
    st.floats(0, 100),
    st.floats(0, 5),
)
def test_no_lease_ends_earlier_and_none_is_held_twice(
    leases: dict[str, float], hold_s: float, now: float, ahead_s: float
) -> None:
    hold = UnreadLeaseHold(hold_s, ahead_s)
    before = dict(leases)
    held = hold.extend(leases, now)
    assert set(held) == {r for r, t in before.items() if now + ahead_s >= t}
    for req_id, deadline in before.items():
        assert leases[req_id] == (deadline + hold_s if req_id in held else deadline)
    assert hold.extend(leases, now) == []  # each lease is held once


def test_a_negative_hold_is_refused() -> None:
    with pytest.raises(ValueError, match="hold must be >= 0 seconds"):
        UnreadLeaseHold(-1.0)
    with pytest.raises(ValueError, match="look-ahead must be >= 0 seconds"):
        UnreadLeaseHold(1.0, ahead_s=-1.0)


def test_a_decoder_reads_only_well_before_the_read_by_time() -> None:
    deadline = read_by(lease_s=30.0, hold_s=300.0, now=1000.0)
    assert deadline == 1330.0
    params = {"do_remote_prefill": True, READ_BY_KEY: deadline}
    assert not expired(params, now=1000.0)
    assert not expired(params, now=deadline - READ_MARGIN_S)
    assert expired(params, now=deadline - READ_MARGIN_S + 0.1)
    # Nothing to read, or a prefiller without elastickv: never "expired".
    assert not expired({**params, "do_remote_prefill": False}, now=2000.0)
    assert not expired({"do_remote_prefill": True}, now=2000.0)
    assert not expired({"do_remote_prefill": True, READ_BY_KEY: "soon"}, now=2000.0)
    assert not expired(None)
