"""Zero-copy torch tensors over raw device memory through a DLPack capsule made with ``ctypes``.

Why DLPack rather than ``__cuda_array_interface__``: torch derives the device of an array-interface
pointer with ``cudaPointerGetAttributes``, which is not meaningful for a reserved range whose first
page may be unmapped. A DLPack tensor names its device explicitly, so no pointer query happens.

The capsule keeps a Python object (``keepalive``) alive until the consumer's tensor is freed, so
the memory's owner can outlive every view of it.
"""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

KDL_CPU = 1
KDL_CUDA = 2
KDL_UINT = 1
_CAPSULE_NAME = b"dltensor"


class DLDevice(ctypes.Structure):
    _fields_ = (("device_type", ctypes.c_int), ("device_id", ctypes.c_int))


class DLDataType(ctypes.Structure):
    _fields_ = (("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16))


class DLTensor(ctypes.Structure):
    _fields_ = (
        ("data", ctypes.c_void_p),
        ("device", DLDevice),
        ("ndim", ctypes.c_int),
        ("dtype", DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    )


class DLManagedTensor(ctypes.Structure):
    pass


_Deleter = ctypes.CFUNCTYPE(None, ctypes.POINTER(DLManagedTensor))
DLManagedTensor._fields_ = (
    ("dl_tensor", DLTensor),
    ("manager_ctx", ctypes.c_void_p),
    ("deleter", _Deleter),
)

_CapsuleDestructor = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
_capsule_new = ctypes.PYFUNCTYPE(
    ctypes.py_object, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p
)(("PyCapsule_New", ctypes.pythonapi))
_capsule_is_valid = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_char_p)(
    ("PyCapsule_IsValid", ctypes.pythonapi)
)
_capsule_get_pointer = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_char_p)(
    ("PyCapsule_GetPointer", ctypes.pythonapi)
)
_incref = ctypes.PYFUNCTYPE(None, ctypes.py_object)(("Py_IncRef", ctypes.pythonapi))
_decref = ctypes.PYFUNCTYPE(None, ctypes.c_void_p)(("Py_DecRef", ctypes.pythonapi))


class _Export:
    """Everything one exported tensor needs to stay valid (owned by the capsule/tensor)."""

    def __init__(
        self, address: int, size: int, device_type: int, device_id: int, keepalive: object
    ) -> None:
        self.shape = (ctypes.c_int64 * 1)(size)
        self.strides = (ctypes.c_int64 * 1)(1)
        self.keepalive = keepalive
        self.managed = DLManagedTensor()
        tensor = self.managed.dl_tensor
        tensor.data = address
        tensor.device = DLDevice(device_type, device_id)
        tensor.ndim = 1
        tensor.dtype = DLDataType(KDL_UINT, 8, 1)
        tensor.shape = self.shape
        tensor.strides = self.strides
        tensor.byte_offset = 0
        self.managed.manager_ctx = id(self)
        self.managed.deleter = _DELETER


def _delete_managed(managed: ctypes._Pointer[DLManagedTensor]) -> None:
    """Called by the consumer when its tensor is freed: drop the reference the capsule held."""
    _decref(managed.contents.manager_ctx)


def _destroy_capsule(capsule: int | None) -> None:
    """A capsule that was never consumed still owns its tensor; free it."""
    if capsule and _capsule_is_valid(capsule, _CAPSULE_NAME):
        pointer = _capsule_get_pointer(capsule, _CAPSULE_NAME)
        if pointer:
            _decref(ctypes.cast(pointer, ctypes.POINTER(DLManagedTensor)).contents.manager_ctx)


_DELETER = _Deleter(_delete_managed)
_DESTRUCTOR = _CapsuleDestructor(_destroy_capsule)


def dlpack_capsule(
    address: int, size: int, *, device_type: int, device_id: int, keepalive: object
) -> object:
    """A ``dltensor`` capsule for a flat ``uint8`` array of ``size`` bytes at ``address``."""
    export = _Export(address, size, device_type, device_id, keepalive)
    _incref(export)
    try:
        return _capsule_new(
            ctypes.addressof(export.managed),
            _CAPSULE_NAME,
            ctypes.cast(_DESTRUCTOR, ctypes.c_void_p),
        )
    except BaseException:
        _decref(id(export))
        raise


def byte_tensor(
    address: int, size: int, *, device_type: int, device_id: int, keepalive: object
) -> torch.Tensor:
    """Flat ``uint8`` torch tensor over ``size`` bytes at ``address``, zero copy."""
    from torch.utils.dlpack import from_dlpack

    capsule = dlpack_capsule(
        address, size, device_type=device_type, device_id=device_id, keepalive=keepalive
    )
    return from_dlpack(capsule)
