"""The fake driver refuses what the VMM rules forbid, so a passing backend test means something.

These call the raw cuda-bindings API, as the backend's driver wrapper does.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from typing import Any

import pytest
from fakecuda_lib import (
    ACCESS_READ,
    ACCESS_READWRITE,
    CUDA_ERROR_ILLEGAL_ADDRESS,
    CUDA_ERROR_NOT_SUPPORTED,
    FakeCuda,
)

MiB = 1 << 20
GRAN = 2 * MiB


def code(result: tuple[Any, ...]) -> str:
    return str(result[0].name)


def ok(result: tuple[Any, ...]) -> Any:
    assert code(result) == "CUDA_SUCCESS", result
    return result[1] if len(result) == 2 else result[1:]


@pytest.fixture
def cu(fake: FakeCuda) -> Iterator[Any]:
    """``cuda.bindings.driver`` with the primary context current for the test."""
    from cuda.bindings import driver

    ok(driver.cuInit(0))
    device = ok(driver.cuDeviceGet(0))
    context = ok(driver.cuDevicePrimaryCtxRetain(device))
    ok(driver.cuCtxPushCurrent(context))
    yield driver
    ok(driver.cuCtxPopCurrent())
    ok(driver.cuDevicePrimaryCtxRelease(device))


def prop(cu: Any) -> Any:
    p = cu.CUmemAllocationProp()
    p.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    p.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    p.location.id = 0
    return p


def access(cu: Any, *, read_only: bool = False) -> list[Any]:
    desc = cu.CUmemAccessDesc()
    desc.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    desc.location.id = 0
    flags = cu.CUmemAccess_flags
    desc.flags = (
        flags.CU_MEM_ACCESS_FLAGS_PROT_READ
        if read_only
        else flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    )
    return [desc]


def test_every_call_needs_a_current_context(fake: FakeCuda) -> None:
    from cuda.bindings import driver

    ok(driver.cuInit(0))
    assert code(driver.cuMemGetInfo()) == "CUDA_ERROR_INVALID_CONTEXT"
    assert code(driver.cuMemAddressReserve(GRAN, 0, driver.CUdeviceptr(0), 0)) == (
        "CUDA_ERROR_INVALID_CONTEXT"
    )


def test_the_vmm_rules(cu: Any, fake: FakeCuda) -> None:
    minimum = cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
    assert ok(cu.cuMemGetAllocationGranularity(prop(cu), minimum)) == GRAN
    ptr = cu.CUdeviceptr
    handle_of = cu.CUmemGenericAllocationHandle
    assert code(cu.cuMemAddressReserve(GRAN + 1, 0, ptr(0), 0)) == "CUDA_ERROR_INVALID_VALUE"
    assert code(cu.cuMemAddressReserve(GRAN, 3 * GRAN, ptr(0), 0)) == "CUDA_ERROR_INVALID_VALUE"
    base = int(ok(cu.cuMemAddressReserve(4 * GRAN, 0, ptr(0), 0)))
    assert base % GRAN == 0
    assert code(cu.cuMemCreate(GRAN // 2, prop(cu), 0)) == "CUDA_ERROR_INVALID_VALUE"
    h1 = ok(cu.cuMemCreate(GRAN, prop(cu), 0))
    h2 = ok(cu.cuMemCreate(GRAN, prop(cu), 0))
    assert fake.live() == {"handles": 2, "mappings": 0, "reservations": 1}
    # Map only inside a reservation, aligned, never over a mapping.
    assert code(cu.cuMemMap(ptr(base + 4 * GRAN), GRAN, 0, h1, 0)) == "CUDA_ERROR_INVALID_VALUE"
    assert code(cu.cuMemMap(ptr(base + 4096), GRAN, 0, h1, 0)) == "CUDA_ERROR_INVALID_VALUE"
    ok(cu.cuMemMap(ptr(base), GRAN, 0, h1, 0))
    assert code(cu.cuMemMap(ptr(base), GRAN, 0, h2, 0)) == "CUDA_ERROR_INVALID_VALUE"
    assert code(cu.cuMemMap(ptr(base + GRAN), GRAN, 0, handle_of(99), 0)) != "CUDA_SUCCESS"
    # Access only over mapped bytes.
    assert code(cu.cuMemSetAccess(ptr(base), 2 * GRAN, access(cu), 1)) == (
        "CUDA_ERROR_INVALID_VALUE"
    )
    ok(cu.cuMemSetAccess(ptr(base), GRAN, access(cu), 1))
    # A handle may be mapped at a second address (the driver allows aliases): same memory.
    ok(cu.cuMemMap(ptr(base + GRAN), GRAN, 0, h1, 0))
    ok(cu.cuMemSetAccess(ptr(base + GRAN), GRAN, access(cu), 1))
    assert fake.handle_mappings(int(h1)) == 2
    ctypes.memset(base, 0x5A, 16)
    assert ctypes.c_uint8.from_address(base + GRAN).value == 0x5A
    ok(cu.cuMemUnmap(ptr(base + GRAN), GRAN))
    assert fake.handle_mappings(int(h1)) == 1
    # Unmap (everywhere) before release, release before the address is freed.
    assert code(cu.cuMemRelease(h1)) == "CUDA_ERROR_INVALID_VALUE"
    assert code(cu.cuMemAddressFree(ptr(base), 4 * GRAN)) == "CUDA_ERROR_INVALID_VALUE"
    assert code(cu.cuMemUnmap(ptr(base), GRAN // 2)) == "CUDA_ERROR_INVALID_VALUE"
    ok(cu.cuMemUnmap(ptr(base), GRAN))
    ok(cu.cuMemRelease(h1))
    ok(cu.cuMemRelease(h2))
    assert code(cu.cuMemRelease(h2)) == "CUDA_ERROR_INVALID_VALUE"
    assert code(cu.cuMemAddressFree(ptr(base), 2 * GRAN)) == "CUDA_ERROR_INVALID_VALUE"
    ok(cu.cuMemAddressFree(ptr(base), 4 * GRAN))
    assert fake.live() == {"handles": 0, "mappings": 0, "reservations": 0}


def test_new_memory_is_not_zeroed_and_memset_needs_access(cu: Any, fake: FakeCuda) -> None:
    ptr = cu.CUdeviceptr
    base = int(ok(cu.cuMemAddressReserve(GRAN, 0, ptr(0), 0)))
    handle = ok(cu.cuMemCreate(GRAN, prop(cu), 0))
    ok(cu.cuMemMap(ptr(base), GRAN, 0, handle, 0))
    assert code(cu.cuMemsetD8Async(ptr(base), 0, 16, cu.CUstream(0))) == (
        "CUDA_ERROR_ILLEGAL_ADDRESS"
    )
    assert fake.sticky_error() == 700
    assert code(cu.cuMemGetInfo()) == "CUDA_ERROR_ILLEGAL_ADDRESS", "the fault is sticky"
    fake.reset()
    base = int(ok(cu.cuMemAddressReserve(GRAN, 0, ptr(0), 0)))
    handle = ok(cu.cuMemCreate(GRAN, prop(cu), 0))
    ok(cu.cuMemMap(ptr(base), GRAN, 0, handle, 0))
    ok(cu.cuMemSetAccess(ptr(base), GRAN, access(cu), 1))
    assert ctypes.c_uint8.from_address(base).value == 0xFF
    ok(cu.cuMemsetD8Async(ptr(base), 0, GRAN, cu.CUstream(0)))
    assert ctypes.c_uint8.from_address(base + GRAN - 1).value == 0
    ok(cu.cuMemUnmap(ptr(base), GRAN))
    ok(cu.cuMemRelease(handle))
    ok(cu.cuMemAddressFree(ptr(base), GRAN))


def test_read_only_access(cu: Any, fake: FakeCuda) -> None:
    """Reads (a copy to the host, a reading kernel) work; a device write faults, stickily."""
    ptr = cu.CUdeviceptr
    base = int(ok(cu.cuMemAddressReserve(2 * GRAN, 0, ptr(0), 0)))
    handle = ok(cu.cuMemCreate(GRAN, prop(cu), 0))
    for at in (base, base + GRAN):
        ok(cu.cuMemMap(ptr(at), GRAN, 0, handle, 0))
    ok(cu.cuMemSetAccess(ptr(base), GRAN, access(cu), 1))
    ok(cu.cuMemsetD8Async(ptr(base), 0, GRAN, cu.CUstream(0)))
    ok(cu.cuMemSetAccess(ptr(base), 2 * GRAN, access(cu, read_only=True), 1))
    assert fake.mapping_at(base) == (int(handle), ACCESS_READ)
    buffer = bytearray(16)
    ok(cu.cuMemcpyDtoH(buffer, ptr(base + GRAN), 16))
    assert buffer == bytes(16)
    assert fake.launch(base, 2 * GRAN) == 0
    ok(cu.cuCtxSynchronize())
    assert fake.launch_write(base + GRAN, 16) == CUDA_ERROR_ILLEGAL_ADDRESS
    assert code(cu.cuMemGetInfo()) == "CUDA_ERROR_ILLEGAL_ADDRESS", "the fault is sticky"
    fake.reset()
    # Read-write again: a writing kernel writes, through every alias.
    base = int(ok(cu.cuMemAddressReserve(2 * GRAN, 0, ptr(0), 0)))
    handle = ok(cu.cuMemCreate(GRAN, prop(cu), 0))
    for at in (base, base + GRAN):
        ok(cu.cuMemMap(ptr(at), GRAN, 0, handle, 0))
    ok(cu.cuMemSetAccess(ptr(base), 2 * GRAN, access(cu), 1))
    assert fake.mapping_at(base + GRAN) == (int(handle), ACCESS_READWRITE)
    assert fake.launch_write(base, 16, 0x11) == 0
    ok(cu.cuMemcpyDtoH(buffer, ptr(base + GRAN), 16))
    assert buffer == bytes([0x11]) * 16
    ok(cu.cuMemUnmap(ptr(base), 2 * GRAN))  # several whole mappings in one call
    ok(cu.cuMemRelease(handle))
    ok(cu.cuMemAddressFree(ptr(base), 2 * GRAN))


def test_read_only_access_can_be_refused(cu: Any, fake: FakeCuda) -> None:
    ptr = cu.CUdeviceptr
    base = int(ok(cu.cuMemAddressReserve(GRAN, 0, ptr(0), 0)))
    handle = ok(cu.cuMemCreate(GRAN, prop(cu), 0))
    ok(cu.cuMemMap(ptr(base), GRAN, 0, handle, 0))
    fake.refuse_read_only(CUDA_ERROR_NOT_SUPPORTED)
    refused = cu.cuMemSetAccess(ptr(base), GRAN, access(cu, read_only=True), 1)
    assert code(refused) == "CUDA_ERROR_NOT_SUPPORTED"
    ok(cu.cuMemSetAccess(ptr(base), GRAN, access(cu), 1))
    assert fake.sticky_error() == 0
    ok(cu.cuMemUnmap(ptr(base), GRAN))
    ok(cu.cuMemRelease(handle))
    ok(cu.cuMemAddressFree(ptr(base), GRAN))


def test_a_copy_from_an_unmapped_page_faults(cu: Any, fake: FakeCuda) -> None:
    ptr = cu.CUdeviceptr
    base = int(ok(cu.cuMemAddressReserve(GRAN, 0, ptr(0), 0)))
    buffer = bytearray(16)
    assert code(cu.cuMemcpyDtoH(buffer, ptr(base), 16)) == "CUDA_ERROR_ILLEGAL_ADDRESS"
    assert fake.sticky_error() == CUDA_ERROR_ILLEGAL_ADDRESS
    fake.reset()
