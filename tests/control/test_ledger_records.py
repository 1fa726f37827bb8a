"""The record and header encodings round-trip exactly, and any damage is detected."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elastickv.control.records import (
    FLAG_IN_USE,
    MAX_CAPACITY,
    RECORD_PAYLOAD,
    RECORD_SIZE,
    STATIC_SIZE,
    FormatError,
    Header,
    Record,
    decode_header,
    decode_record,
    encode_header,
    encode_record,
)

U64 = st.integers(0, 2**64 - 1)
NAME_CHARS = st.sampled_from("abcXYZ019_.:@+-é")
names = st.text(NAME_CHARS, min_size=1, max_size=32)

records = st.builds(
    Record,
    nonce=U64,
    flags=st.sampled_from([0, FLAG_IN_USE]),
    pid=st.integers(0, 2**32 - 1),
    start_time=U64,
    registered_ns=U64,
    limit_desired=st.none() | st.integers(0, 2**63 - 1),
    limit_revision=U64,
    committed=U64,
    reserved=U64,
    peak=U64,
    admissions=U64,
    refusals=U64,
    releases=U64,
    name=names,
)

headers = st.builds(
    Header,
    device_key=st.sampled_from(["host", "cuda-gpu-1234abcd", "cuda-GPU-a.b_c"]),
    total_bytes=st.integers(1, 2**62),
    utilization=st.floats(0.01, 1.0),
    headroom_bytes=st.integers(0, 2**62),
    capacity=st.integers(1, MAX_CAPACITY),
    created_ns=U64,
    segment_id=U64,
)


@settings(max_examples=200, deadline=None)
@given(records)
def test_record_round_trip(record: Record) -> None:
    data = encode_record(record)
    assert len(data) == RECORD_SIZE
    assert decode_record(data) == record


@settings(max_examples=200, deadline=None)
@given(records, st.data())
def test_damaged_record_is_detected(record: Record, data: st.DataObject) -> None:
    raw = bytearray(encode_record(record))
    index = data.draw(st.integers(0, RECORD_PAYLOAD + 3))  # inside the payload or its CRC
    bit = data.draw(st.integers(0, 7))
    raw[index] ^= 1 << bit
    with pytest.raises(FormatError):
        decode_record(bytes(raw))


@settings(max_examples=100, deadline=None)
@given(headers)
def test_header_round_trip(header: Header) -> None:
    data = encode_header(header)
    assert len(data) == STATIC_SIZE
    assert decode_header(data) == header
    for index in (0, 9, 40, STATIC_SIZE - 1):
        damaged = bytearray(data)
        damaged[index] ^= 0x10
        with pytest.raises(FormatError):
            decode_header(bytes(damaged))


def test_invalid_fields_are_rejected_on_encode() -> None:
    with pytest.raises(ValueError, match="invalid instance name"):
        encode_record(Record(1, 1, 1, 1, 1, None, 1, 0, 0, 0, 0, 0, 0, "a b"))
    with pytest.raises(ValueError, match="longer than"):
        encode_record(Record(1, 1, 1, 1, 1, None, 1, 0, 0, 0, 0, 0, 0, "é" * 40))
    with pytest.raises(ValueError, match="utilization"):
        encode_header(Header("host", 1, 1.5, 0, 1, 0, 0))
