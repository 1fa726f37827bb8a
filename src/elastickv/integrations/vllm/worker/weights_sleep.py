"""Sleep and wake for an engine whose process stays up: the model's weights released to the
operating system and reloaded in place from the checkpoint.

vLLM's sleep mode is CUDA's (its weights live in a memory pool it can unmap); the CPU worker's
``sleep`` and ``wake_up`` do nothing. On the CPU a model's weight memory is held in two places:

* its parameters (embeddings, norms, the LM head: vLLM keeps those tensors);
* each linear layer's ``cpu_linear``, a closure over the weight that vLLM's CPU GEMM dispatch
  prepacked (a oneDNN handle, an sgl-kernel or zentorch packed tensor); the layer's own
  ``weight`` parameter is left empty once packed.

Sleeping empties every parameter (the same ``Parameter`` objects stay in the model, so the
model's loaders, tied weights and references into it stay valid), drops every ``cpu_linear``
(the handle frees its packed copy) and asks glibc to return the freed heap (``malloc_trim``).
Waking gives the emptied parameters storage of their old shape again and runs vLLM's in-place
reload (the runner's ``reload_weights``): the checkpoint through the model's own loaders (the
page cache makes that fast), then each layer's ``process_weights_after_loading``, which packs
the linear layers again. The KV cache is not touched: its blocks stay valid because the
weights come back identical.

A step that reaches a sleeping runner wakes it first (:func:`wake_if_asleep`, called from the
runner's ``execute_model`` hook), so a request that arrives while the engine sleeps waits for
the reload and is answered; a sleeping model is never run.

Two worker RPCs for ``collective_rpc`` (plain names and plain values, so nothing pickled
travels): :data:`SLEEP_METHOD` and :data:`WAKE_METHOD`. On a GPU worker they drive vLLM's own
sleep mode instead, at the level asked (:mod:`.vllm_sleep`).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from elastickv.integrations.vllm.preflight import platform_name
from elastickv.integrations.vllm.worker import vllm_sleep

logger = logging.getLogger(__name__)

SLEEP_METHOD = "elastickv_sleep_weights"
WAKE_METHOD = "elastickv_wake_weights"
# The runner attribute that holds a sleeping model's emptied parameters (absent: awake).
_SLEPT = "_elastickv_slept_weights"
# The attribute through which vLLM's CPU linear layers reach their packed weight.
_CPU_LINEAR = "cpu_linear"


@dataclass(frozen=True)
class _Emptied:
    """A parameter whose storage was released, and the shape it gets back on wake."""

    param: torch.nn.Parameter
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype


def _asleep(*_args: Any, **_kwargs: Any) -> torch.Tensor:
    raise RuntimeError("elastickv: this model's weights are asleep; wake it before a forward")


def release_weights(model: torch.nn.Module) -> tuple[list[_Emptied], int, int]:
    """Empty every parameter of ``model`` and drop every packed CPU linear; returns the
    emptied parameters, their bytes and how many packed layers were dropped. Pure on the
    module (no vLLM needed), so it is testable on any ``nn.Module``."""
    if any(p.device.type != "cpu" for p in model.parameters()):
        raise RuntimeError(
            "elastickv's weight sleep releases CPU memory only; on a GPU use vLLM's sleep "
            "mode (--enable-sleep-mode)"
        )
    emptied: list[_Emptied] = []
    seen: set[int] = set()
    released = packed = 0
    for module in model.modules():
        for param in module.parameters(recurse=False):
            if id(param) in seen or param.numel() == 0:
                continue
            seen.add(id(param))
            released += param.numel() * param.element_size()
            emptied.append(_Emptied(param, tuple(param.shape), param.stride(), param.dtype))
            param.data = torch.empty(0, dtype=param.dtype)
        if module.__dict__.get(_CPU_LINEAR, _asleep) is not _asleep:
            module.__dict__[_CPU_LINEAR] = _asleep
            packed += 1
    return emptied, released, packed


def restore_storage(emptied: list[_Emptied]) -> None:
    """Give each emptied parameter uninitialised storage of its old shape (the reload
    copies the checkpoint's values into it)."""
    for item in emptied:
        item.param.data = torch.empty_strided(item.shape, item.stride, dtype=item.dtype)


def still_released(model: torch.nn.Module) -> list[str]:
    """The layers whose packed weight :func:`release_weights` dropped and no reload put back."""
    return [name for name, m in model.named_modules() if m.__dict__.get(_CPU_LINEAR) is _asleep]


def trim_heap() -> None:
    """Return glibc's free heap to the OS: a freed tensor below glibc's (adaptive, up to
    32 MiB) mmap threshold stays in the heap otherwise. No ``gc.collect()``: what sleeping
    drops is freed by reference counting (no cycles hold a weight), and a full collection
    costs 0.37 s in a multiprocess worker."""
    if _malloc_trim is not None:
        _malloc_trim(0)


def _find_malloc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):  # not glibc (musl has no malloc_trim)
        return None


_malloc_trim = _find_malloc_trim()


def process_pss(field: str = "Pss") -> int | None:
    """This process's proportional set size in bytes (Linux), None where it cannot be read.

    ``field="Pss_Anon"``: its anonymous part only, where a model's weights live. Total PSS
    also counts a share of every file page the process maps with others (torch's and
    vLLM's libraries: about 80 MB per process here), and that share moves when another
    process mapping them starts or exits: a comparison of two readings should use this."""
    prefix = f"{field}:"
    try:
        with open("/proc/self/smaps_rollup", encoding="ascii") as rollup:
            for line in rollup:
                if line.startswith(prefix):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


@contextmanager
def _timed_cpu_repack(spent: list[float]) -> Iterator[None]:
    """Time vLLM's CPU GEMM dispatch (the repack of each linear layer) during a reload: the
    "restore" part of a wake. vLLM's ``process_weights_after_loading`` imports the function
    from its module at each call, so wrapping the module attribute sees every call."""
    try:
        from vllm.model_executor.layers import utils
    except ImportError:
        yield
        return
    original = getattr(utils, "dispatch_cpu_unquantized_gemm", None)
    if original is None:
        yield
        return

    def dispatch(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            spent[0] += time.perf_counter() - start

    utils.dispatch_cpu_unquantized_gemm = dispatch
    try:
        yield
    finally:
        utils.dispatch_cpu_unquantized_gemm = original


def sleep(runner: Any) -> dict[str, Any]:
    """Release the weights of ``runner``'s model (a vLLM model runner); idempotent."""
    if getattr(runner, _SLEPT, None) is not None:
        return {"asleep": True, "released_bytes": 0, "packed_layers": 0, "pss": process_pss()}
    start = time.perf_counter()
    trim_heap()  # so that the fall measured below is the weights', not garbage's
    pss_before, anon_before = process_pss(), process_pss("Pss_Anon")
    emptied, released, packed = release_weights(runner.get_model())
    setattr(runner, _SLEPT, emptied)
    trim_heap()
    pss, anon = process_pss(), process_pss("Pss_Anon")
    logger.info(
        "elastickv: weights asleep: %d parameter bytes and %d packed layers released in %.3f s",
        released,
        packed,
        time.perf_counter() - start,
    )
    return {
        "asleep": True,
        "released_bytes": released,
        "packed_layers": packed,
        "sleep_s": time.perf_counter() - start,
        "pss_before": pss_before,
        "pss": pss,
        "pss_anon_before": anon_before,
        "pss_anon": anon,
    }


def wake(runner: Any) -> dict[str, Any]:
    """Reload ``runner``'s model weights from the checkpoint in place; idempotent. The reply
    splits the time: ``reload_s`` (storage, reading and copying the checkpoint) and
    ``restore_s`` (the CPU backend's repacking of the linear layers); ``cpu_s`` is the
    process's CPU time for it (all threads), which a machine's other load does not inflate."""
    emptied: list[_Emptied] | vllm_sleep.GpuSleep | None = getattr(runner, _SLEPT, None)
    if emptied is None:
        return {"woken": False, "pss": process_pss()}
    if isinstance(emptied, vllm_sleep.GpuSleep):
        reply = vllm_sleep.wake(emptied)
        delattr(runner, _SLEPT)
        return reply
    from vllm.config import set_current_vllm_config

    start, cpu = time.perf_counter(), time.process_time()
    restore_storage(emptied)
    spent = [0.0]
    with _timed_cpu_repack(spent), set_current_vllm_config(runner.vllm_config):
        runner.reload_weights()
    unpacked = still_released(runner.get_model())
    if unpacked:
        raise RuntimeError(
            f"elastickv: the reload did not repack {len(unpacked)} linear layers "
            f"({', '.join(unpacked[:3])}, ...); the model cannot run"
        )
    delattr(runner, _SLEPT)
    total, cpu = time.perf_counter() - start, time.process_time() - cpu
    trim_heap()  # the reload's transient buffers
    logger.info("elastickv: weights awake in %.3f s (repacking %.3f s)", total, spent[0])
    return {
        "woken": True,
        "wake_s": total,
        "reload_s": total - spent[0],
        "restore_s": spent[0],
        "cpu_s": cpu,
        "pss": process_pss(),
    }


def wake_if_asleep(runner: Any) -> None:
    """Before a step: a sleeping runner is woken (the step's requests wait for the reload)."""
    if getattr(runner, _SLEPT, None) is not None:
        logger.info("elastickv: a step reached a sleeping engine; waking it first")
        wake(runner)


def install(worker_cls: type) -> None:
    """Add the sleep and wake RPCs to ``worker_cls`` (vLLM's GPU worker, which the CPU worker
    inherits); each acts on the worker's own model runner."""

    def sleep_weights(self: Any, level: int = 1) -> dict[str, Any]:
        """RPC: release this worker's model weights (the process stays up). On the CPU they
        are emptied and reloaded from the checkpoint on wake (``level`` does not apply); on
        a GPU, vLLM's sleep mode at ``level``."""
        runner = self.model_runner
        if platform_name() == "cpu":  # no sleep mode of vLLM's own: elastickv's
            return sleep(runner)
        if getattr(runner, _SLEPT, None) is not None:  # a second level-2 sleep would fault
            return {"asleep": True, "released_bytes": 0}
        slept, reply = vllm_sleep.sleep(self, level)
        setattr(runner, _SLEPT, slept)
        return reply

    def wake_weights(self: Any) -> dict[str, Any]:
        """RPC: reload this worker's model weights from the checkpoint."""
        return wake(self.model_runner)

    for name, method in ((SLEEP_METHOD, sleep_weights), (WAKE_METHOD, wake_weights)):
        if not hasattr(worker_cls, name):
            setattr(worker_cls, name, method)
