"""The CUDA driver calls the CUDA VMM backend needs, behind one small typed object.

Why a wrapper: ``cuda.bindings.driver`` returns ``(CUresult, value...)`` tuples and takes its own
handle types. :class:`CudaDriver` turns that into plain ``int`` arguments and results and raises
:class:`CudaDriverError` (with the driver's error name and text) on any failure, so the backend
reads like ordinary Python and unit tests can swap in a fake that satisfies :class:`DriverApi`
on machines without a GPU.

``cuda-bindings`` is imported only when a :class:`CudaDriver` is constructed, so importing this
module (or :mod:`elastickv`) never needs CUDA.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any, Protocol

from elastickv.vmm.errors import BackendUnavailable, VmmError

CUDA_SUCCESS = 0
CUDA_ERROR_OUT_OF_MEMORY = 2
CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED = 102

# Sticky errors: after one of these the context is unusable and every later call fails with it
# (illegal address, launch timeout, hardware stack error, illegal instruction, misaligned
# address, invalid address space, invalid PC, launch failed, uncorrectable ECC).
STICKY_ERRORS = frozenset({700, 702, 714, 715, 716, 717, 718, 719, 214})


class CudaDriverError(VmmError):
    """A driver call returned an error code.

    ``name`` and ``text`` are the driver's own ``cuGetErrorName`` / ``cuGetErrorString``.
    """

    def __init__(self, call: str, code: int, name: str, text: str) -> None:
        super().__init__(f"{call} returned {name} ({text})")
        self.call = call
        self.code = code
        self.name = name
        self.text = text

    @property
    def out_of_memory(self) -> bool:
        return self.code == CUDA_ERROR_OUT_OF_MEMORY

    @property
    def context_lost(self) -> bool:
        """A sticky fault: the context is poisoned and no later call can succeed."""
        return self.code in STICKY_ERRORS


class DriverApi(Protocol):
    """What the backend needs from the driver; every failure raises :class:`CudaDriverError`.

    Addresses, sizes and handles are plain ints. Physical allocations are pinned device memory on
    :attr:`device`; access is granted to that device only, read-write or read-only.
    """

    @property
    def device(self) -> int: ...

    def uuid(self) -> str:
        """The device's UUID as nvidia-smi prints it (``GPU-…``)."""
        ...

    def current(self) -> AbstractContextManager[None]:
        """Make this driver's context current on the calling thread for the ``with`` body."""
        ...

    def granularity(self) -> int: ...

    def address_reserve(self, size: int, alignment: int) -> int: ...

    def address_free(self, address: int, size: int) -> None: ...

    def create(self, size: int) -> int: ...

    def release(self, handle: int) -> None: ...

    def map(self, address: int, size: int, handle: int) -> None: ...

    def set_access(self, address: int, size: int, *, read_only: bool = False) -> None:
        """Grant the device access to ``size`` mapped bytes: read-write, or read-only (a
        kernel's store there is then an illegal-address fault)."""
        ...

    def unmap(self, address: int, size: int) -> None: ...

    def mem_get_info(self) -> tuple[int, int]:
        """``(free, total)`` bytes of device memory, as the driver reports them."""
        ...

    def synchronize(self, stream: int | None) -> None:
        """Wait for the work queued on ``stream`` (``None``: on the whole context)."""
        ...

    def zero(self, address: int, size: int, stream: int | None) -> None:
        """Fill ``size`` mapped bytes with zeros and wait until that is done.

        Queued on ``stream`` (``None``: the legacy default stream).
        """
        ...

    def read(self, address: int, size: int) -> bytes:
        """Copy ``size`` readable device bytes to the host (synchronous)."""
        ...


def check(module: Any, call: str, result: tuple[Any, ...]) -> Any:
    """Return the value(s) after the result code of a ``cuda.bindings`` call, or raise.

    One value comes back as itself, several as a tuple, none as ``None``.
    """
    code = result[0]
    if int(code) != CUDA_SUCCESS:
        raise error_from(module, call, code)
    values = result[1:]
    if not values:
        return None
    return values[0] if len(values) == 1 else values


def error_from(module: Any, call: str, code: Any) -> CudaDriverError:
    """A :class:`CudaDriverError` naming ``code`` as the driver does (else by enum name)."""
    fallback = getattr(code, "name", f"CUresult {int(code)}")
    name = _describe(module, "cuGetErrorName", code) or fallback
    text = _describe(module, "cuGetErrorString", code) or "no description from the driver"
    return CudaDriverError(call, int(code), name, text)


def native_handle(obj: Any) -> int:
    """The address behind a driver handle object (``CUcontext``, ``CUstream``...).

    ``int(obj)`` is deprecated for handle objects since cuda-bindings 12.9.1 / 13.0 in favour of
    ``cuda.bindings.utils.get_cuda_native_handle``, which older releases (12.8) do not have.
    """
    try:
        from cuda.bindings.utils import get_cuda_native_handle
    except ImportError:
        return int(obj)
    try:
        return int(get_cuda_native_handle(obj))
    except TypeError:
        return int(obj)


def format_uuid(raw: bytes) -> str:
    """16 bytes → ``GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`` (nvidia-smi's spelling)."""
    if len(raw) != 16:
        raise ValueError(f"a device UUID has 16 bytes, got {len(raw)}")
    text = raw.hex()
    return f"GPU-{text[:8]}-{text[8:12]}-{text[12:16]}-{text[16:20]}-{text[20:]}"


def _describe(module: Any, function: str, code: Any) -> str | None:
    try:
        status, value = getattr(module, function)(code)
    except Exception:
        return None
    if int(status) != CUDA_SUCCESS or value is None:
        return None
    return value.decode() if isinstance(value, bytes) else str(value)


class CudaDriver:
    """:class:`DriverApi` over ``cuda.bindings.driver`` for one device's primary context.

    The primary context is the one PyTorch uses, so tensors over our mappings work in torch
    without any context juggling. It is retained here and released when this object goes away.
    ``module`` is for tests; by default ``cuda.bindings.driver`` is imported.
    """

    def __init__(self, device: int = 0, *, module: Any = None) -> None:
        if module is None:
            try:
                from cuda.bindings import driver as bindings
            except ImportError as exc:
                raise BackendUnavailable(
                    "the CUDA VMM backend needs the optional 'cuda-bindings' package "
                    f"({exc}); install it with: pip install 'elastickv[cuda]'"
                ) from exc
            module = bindings
        self._cu = module
        try:
            self._call("cuInit", module.cuInit(0))
            count = int(self._call("cuDeviceGetCount", module.cuDeviceGetCount()))
        except CudaDriverError as exc:
            raise BackendUnavailable(
                f"the CUDA driver cannot start: {exc}; check that an NVIDIA GPU is visible "
                "(nvidia-smi, CUDA_VISIBLE_DEVICES) and the driver is loaded"
            ) from exc
        except (RuntimeError, OSError) as exc:
            raise BackendUnavailable(
                f"the CUDA driver library (libcuda) could not be loaded: {exc}; the CUDA VMM "
                "backend needs an NVIDIA GPU and driver (use the host backend otherwise)"
            ) from exc
        if isinstance(device, bool) or not isinstance(device, int) or not 0 <= device < count:
            raise BackendUnavailable(
                f"CUDA device {device!r} does not exist; the driver sees {count} device(s)"
            )
        self._device = device
        try:
            self._cu_device = self._call("cuDeviceGet", module.cuDeviceGet(device))
            vmm = module.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED
            supported = self._call(
                "cuDeviceGetAttribute", module.cuDeviceGetAttribute(vmm, self._cu_device)
            )
        except CudaDriverError as exc:
            raise BackendUnavailable(f"cannot use CUDA device {device}: {exc}") from exc
        if not int(supported):
            raise BackendUnavailable(
                f"CUDA device {device} does not support virtual memory management "
                "(CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED is 0; e.g. an old GPU, "
                "some vGPU/MIG setups or WSL); use the host backend or another GPU"
            )
        try:
            self._context = self._call(
                "cuDevicePrimaryCtxRetain", module.cuDevicePrimaryCtxRetain(self._cu_device)
            )
        except CudaDriverError as exc:
            raise BackendUnavailable(f"cannot use CUDA device {device}: {exc}") from exc
        self._context_id = native_handle(self._context)
        self._closer = weakref.finalize(self, _release_primary, module, self._cu_device)
        self._closer.atexit = False
        self._prop = module.CUmemAllocationProp()
        self._prop.type = module.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        self._prop.location.type = module.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        self._prop.location.id = device
        access = module.CUmemAccessDesc()
        access.location.type = module.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        access.location.id = device
        access.flags = module.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        self._access = [access]
        read_only = module.CUmemAccessDesc()
        read_only.location.type = module.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        read_only.location.id = device
        read_only.flags = module.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READ
        self._read_only = [read_only]

    @property
    def device(self) -> int:
        return self._device

    def uuid(self) -> str:
        """The device's UUID as nvidia-smi prints it (``GPU-8f3a…``; a MIG instance's own UUID
        under MIG), for :func:`elastickv.control.cuda_device_key`."""
        cu = self._cu
        query = getattr(cu, "cuDeviceGetUuid_v2", None) or cu.cuDeviceGetUuid
        raw = bytes(self._call("cuDeviceGetUuid", query(self._cu_device)).bytes)
        return format_uuid(raw)

    @contextmanager
    def current(self) -> Iterator[None]:
        cu = self._cu
        active = self._call("cuCtxGetCurrent", cu.cuCtxGetCurrent())
        if active is not None and native_handle(active) == self._context_id:
            yield
            return
        self._call("cuCtxPushCurrent", cu.cuCtxPushCurrent(self._context))
        try:
            yield
        finally:
            self._call("cuCtxPopCurrent", cu.cuCtxPopCurrent())

    def granularity(self) -> int:
        cu = self._cu
        minimum = cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
        return int(
            self._call(
                "cuMemGetAllocationGranularity",
                cu.cuMemGetAllocationGranularity(self._prop, minimum),
            )
        )

    def address_reserve(self, size: int, alignment: int) -> int:
        cu = self._cu
        ptr = self._call(
            "cuMemAddressReserve", cu.cuMemAddressReserve(size, alignment, cu.CUdeviceptr(0), 0)
        )
        return int(ptr)

    def address_free(self, address: int, size: int) -> None:
        cu = self._cu
        self._call("cuMemAddressFree", cu.cuMemAddressFree(cu.CUdeviceptr(address), size))

    def create(self, size: int) -> int:
        return int(self._call("cuMemCreate", self._cu.cuMemCreate(size, self._prop, 0)))

    def release(self, handle: int) -> None:
        cu = self._cu
        self._call("cuMemRelease", cu.cuMemRelease(cu.CUmemGenericAllocationHandle(handle)))

    def map(self, address: int, size: int, handle: int) -> None:
        cu = self._cu
        result = cu.cuMemMap(
            cu.CUdeviceptr(address), size, 0, cu.CUmemGenericAllocationHandle(handle), 0
        )
        self._call("cuMemMap", result)

    def set_access(self, address: int, size: int, *, read_only: bool = False) -> None:
        cu = self._cu
        access = self._read_only if read_only else self._access
        result = cu.cuMemSetAccess(cu.CUdeviceptr(address), size, access, len(access))
        self._call("cuMemSetAccess", result)

    def unmap(self, address: int, size: int) -> None:
        cu = self._cu
        self._call("cuMemUnmap", cu.cuMemUnmap(cu.CUdeviceptr(address), size))

    def mem_get_info(self) -> tuple[int, int]:
        free, total = self._call("cuMemGetInfo", self._cu.cuMemGetInfo())
        return int(free), int(total)

    def synchronize(self, stream: int | None) -> None:
        cu = self._cu
        if stream is None:
            self._call("cuCtxSynchronize", cu.cuCtxSynchronize())
        else:
            self._call("cuStreamSynchronize", cu.cuStreamSynchronize(cu.CUstream(stream)))

    def zero(self, address: int, size: int, stream: int | None) -> None:
        cu = self._cu
        handle = cu.CUstream(0 if stream is None else stream)
        result = cu.cuMemsetD8Async(cu.CUdeviceptr(address), 0, size, handle)
        self._call("cuMemsetD8Async", result)
        self._call("cuStreamSynchronize", cu.cuStreamSynchronize(handle))

    def read(self, address: int, size: int) -> bytes:
        cu = self._cu
        buffer = bytearray(size)
        self._call("cuMemcpyDtoH", cu.cuMemcpyDtoH(buffer, cu.CUdeviceptr(address), size))
        return bytes(buffer)

    def close(self) -> None:
        """Release the primary context (also done when this object is collected)."""
        self._closer()

    def _call(self, name: str, result: tuple[Any, ...]) -> Any:
        return check(self._cu, name, result)


def _release_primary(module: Any, cu_device: Any) -> None:
    """Finalizer: nothing useful can be done with an error here."""
    try:
        module.cuDevicePrimaryCtxRelease(cu_device)
    except Exception:
        return
