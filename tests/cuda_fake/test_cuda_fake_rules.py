"""The fake driver refuses what the VMM rules forbid, so a passing backend test means something.

These call the raw cuda-bindings API, as the backend's driver wrapper does.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from fakecuda_lib import FakeCuda

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


def access(cu: Any) -> list[Any]:
    desc = cu.CUmemAccessDesc()
    desc.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    desc.location.id = 0
    desc.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
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
    # Map only inside a reservation, aligned, never over a mapping, a handle once.
    assert code(cu.cuMemMap(ptr(base + 4 * GRAN), GRAN, 0, h1, 0)) == "CUDA_ERROR_INVALID_VALUE"
    assert code(cu.cuMemMap(ptr(base + 4096), GRAN, 0, h1, 0)) == "CUDA_ERROR_INVALID_VALUE"
    ok(cu.cuMemMap(ptr(base), GRAN, 0, h1, 0))
    assert code(cu.cuMemMap(ptr(base), GRAN, 0, h2, 0)) == "CUDA_ERROR_INVALID_VALUE"
    assert code(cu.cuMemMap(ptr(base + GRAN), GRAN, 0, h1, 0)) == "CUDA_ERROR_INVALID_VALUE"
    assert code(cu.cuMemMap(ptr(base + GRAN), GRAN, 0, handle_of(99), 0)) != "CUDA_SUCCESS"
    # Access only over mapped bytes.
    assert code(cu.cuMemSetAccess(ptr(base), 2 * GRAN, access(cu), 1)) == (
        "CUDA_ERROR_INVALID_VALUE"
    )
    ok(cu.cuMemSetAccess(ptr(base), GRAN, access(cu), 1))
    # Unmap before release, release before the address is freed.
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
    import ctypes

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
