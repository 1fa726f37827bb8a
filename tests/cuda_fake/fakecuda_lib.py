"""Build and load the strict fake ``libcuda.so.1`` (fakecuda.c) for the real cuda-bindings.

Why loading it first is enough: cuda-bindings opens the driver with ``dlopen("libcuda.so.1")``
(12.x directly, 13.x through cuda-pathfinder's system search), and the dynamic loader answers
that name with an already loaded library whose soname matches. So once this module has loaded
the fake with its soname ``libcuda.so.1``, every driver call the bindings make lands in it, with
the same argument marshalling as on a GPU.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
from pathlib import Path

SOURCE = Path(__file__).with_name("fakecuda.c")
REPO = Path(__file__).resolve().parents[2]
BUILD_DIR = REPO / "build" / "fakecuda"
LIBRARY = BUILD_DIR / "libcuda.so.1"
CUDA_ERROR_ILLEGAL_ADDRESS = 700
CUDA_ERROR_INVALID_VALUE = 1
CUDA_ERROR_OUT_OF_MEMORY = 2
CUDA_ERROR_NOT_SUPPORTED = 801
# CUmemAccess_flags, as fake_mapping_at reports them.
ACCESS_NONE = 0
ACCESS_READ = 1
ACCESS_READWRITE = 3


class FakeBuildError(RuntimeError):
    """The fake driver could not be compiled."""


def compiler() -> str:
    """The system C compiler (``$CC``, else ``cc``, else ``gcc``)."""
    found = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not found:
        raise FakeBuildError(
            "no C compiler found: the CUDA fake-driver tests compile tests/cuda_fake/fakecuda.c; "
            "install gcc (e.g. apt-get install gcc) or set CC"
        )
    return found


def build() -> Path:
    """Compile the fake into build/fakecuda/ unless an up-to-date build is there."""
    if LIBRARY.exists() and LIBRARY.stat().st_mtime >= SOURCE.stat().st_mtime:
        return LIBRARY
    BUILD_DIR.mkdir(parents=True, exist_ok=True)
    partial = LIBRARY.with_name(f"libcuda.so.1.{os.getpid()}.tmp")
    command = [
        compiler(),
        "-shared",
        "-fPIC",
        "-O1",
        "-Wall",
        "-Wextra",
        "-Wl,-soname,libcuda.so.1",
        "-o",
        str(partial),
        str(SOURCE),
        "-lpthread",
    ]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise FakeBuildError(f"compiling the fake CUDA driver failed:\n{done.stderr}")
    os.replace(partial, LIBRARY)
    return LIBRARY


class FakeCuda:
    """Typed access to the fake's test hooks (the ``fake_*`` functions of fakecuda.c)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lib = ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
        lib = self._lib
        for name in (
            "fake_live_handles",
            "fake_live_mappings",
            "fake_live_reservations",
            "fake_primary_retains",
            "fake_context_depth",
            "fake_sticky_error",
            "fake_pending_kernels",
        ):
            getattr(lib, name).restype = ctypes.c_int
            getattr(lib, name).argtypes = ()
        lib.fake_used_bytes.restype = ctypes.c_size_t
        lib.fake_calls.restype = ctypes.c_long
        lib.fake_calls.argtypes = (ctypes.c_char_p,)
        lib.fake_fail.argtypes = (ctypes.c_char_p, ctypes.c_long, ctypes.c_int)
        lib.fake_set_device_count.argtypes = (ctypes.c_int,)
        lib.fake_set_vmm_supported.argtypes = (ctypes.c_int,)
        lib.fake_set_total_memory.argtypes = (ctypes.c_size_t,)
        lib.fake_set_granularity.argtypes = (ctypes.c_size_t,)
        lib.fake_last_access.restype = ctypes.c_int
        lib.fake_last_access.argtypes = (ctypes.POINTER(ctypes.c_int), ctypes.c_int)
        lib.fake_launch.restype = ctypes.c_int
        lib.fake_launch.argtypes = (ctypes.c_ulonglong, ctypes.c_size_t)
        lib.fake_launch_write.restype = ctypes.c_int
        lib.fake_launch_write.argtypes = (ctypes.c_ulonglong, ctypes.c_size_t, ctypes.c_int)
        lib.fake_mapping_at.restype = ctypes.c_int
        lib.fake_mapping_at.argtypes = (
            ctypes.c_ulonglong,
            ctypes.POINTER(ctypes.c_ulonglong),
            ctypes.POINTER(ctypes.c_int),
        )
        lib.fake_handle_mappings.restype = ctypes.c_int
        lib.fake_handle_mappings.argtypes = (ctypes.c_ulonglong,)
        lib.fake_refuse_read_only.argtypes = (ctypes.c_int,)
        lib.fake_reset.argtypes = ()

    def live(self) -> dict[str, int]:
        """What the driver still holds: handles, mappings, reservations."""
        return {
            "handles": self._lib.fake_live_handles(),
            "mappings": self._lib.fake_live_mappings(),
            "reservations": self._lib.fake_live_reservations(),
        }

    def calls(self, name: str) -> int:
        return int(self._lib.fake_calls(name.encode()))

    def fail(self, name: str, nth: int = 1, code: int = CUDA_ERROR_INVALID_VALUE) -> None:
        """The ``nth`` next call of ``name`` returns ``code`` and changes nothing."""
        self._lib.fake_fail(name.encode(), nth, code)

    def disarm(self, name: str) -> None:
        """Forget a failure of ``name`` set by :meth:`fail` that has not happened yet."""
        self._lib.fake_fail(name.encode(), 0, 0)

    def launch(self, address: int, size: int) -> int:
        """Queue a simulated kernel reading the bytes; returns the sticky error (0: none)."""
        return int(self._lib.fake_launch(address, size))

    def launch_write(self, address: int, size: int, value: int = 0xAB) -> int:
        """Queue a simulated kernel writing ``value`` to the bytes (it faults unless they are all
        mapped read-write); returns the sticky error (0: none)."""
        return int(self._lib.fake_launch_write(address, size, value))

    def mapping_at(self, address: int) -> tuple[int, int] | None:
        """``(handle, access)`` mapped at ``address`` (access: ``ACCESS_*``), or None."""
        handle = ctypes.c_ulonglong()
        access = ctypes.c_int()
        if not self._lib.fake_mapping_at(address, ctypes.byref(handle), ctypes.byref(access)):
            return None
        return int(handle.value), int(access.value)

    def handle_mappings(self, handle: int) -> int:
        """How many addresses ``handle`` is mapped at."""
        return int(self._lib.fake_handle_mappings(handle))

    def refuse_read_only(self, code: int = CUDA_ERROR_NOT_SUPPORTED) -> None:
        """Make ``cuMemSetAccess`` refuse read-only access with ``code`` (0: accept it)."""
        self._lib.fake_refuse_read_only(code)

    def last_access_devices(self) -> list[int]:
        devices = (ctypes.c_int * 8)()
        count = self._lib.fake_last_access(devices, 8)
        return list(devices[:count])

    def sticky_error(self) -> int:
        return int(self._lib.fake_sticky_error())

    def pending_kernels(self) -> int:
        return int(self._lib.fake_pending_kernels())

    def context_depth(self) -> int:
        return int(self._lib.fake_context_depth())

    def primary_retains(self) -> int:
        return int(self._lib.fake_primary_retains())

    def used_bytes(self) -> int:
        return int(self._lib.fake_used_bytes())

    def set_vmm_supported(self, supported: bool) -> None:
        self._lib.fake_set_vmm_supported(int(supported))

    def set_device_count(self, count: int) -> None:
        self._lib.fake_set_device_count(count)

    def set_total_memory(self, nbytes: int) -> None:
        self._lib.fake_set_total_memory(nbytes)

    def set_granularity(self, nbytes: int) -> None:
        self._lib.fake_set_granularity(nbytes)

    def reset(self) -> None:
        """Free whatever a test left behind and restore the defaults."""
        self._lib.fake_reset()


def load() -> FakeCuda:
    """Build the fake, load it as ``libcuda.so.1`` and check cuda-bindings really uses it."""
    fake = FakeCuda(build())
    from cuda.bindings import driver

    before = fake.calls("cuDriverGetVersion")
    status, _ = driver.cuDriverGetVersion()
    if int(status) != 0 or fake.calls("cuDriverGetVersion") != before + 1:
        raise RuntimeError(
            "cuda-bindings did not call the fake libcuda.so.1 (another libcuda was loaded "
            "first?); run tests/cuda_fake in its own pytest process, as `make test` does"
        )
    return fake
