"""The CUDA backend through the real cuda-bindings, against the strict fake libcuda.so.1.

This folder runs in its own pytest process (``make test`` runs it once per cuda-bindings
version), because the fake replaces libcuda for the whole process. The fake is loaded at import,
before any test can make cuda-bindings open a driver. After every test the fake must hold no
physical handle, mapping or reservation and no pushed context; then it is reset, so one leak
fails one test only.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path

import pytest
from fakecuda_lib import FakeCuda, load

from elastickv.vmm import cuda_dlpack

FAKE = load()


def bindings_version() -> str:
    from cuda.bindings import __version__

    return str(__version__)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Refuse to share the process: other folders' tests would see the fake as the driver."""
    here = Path(__file__).parent
    outside = [item.nodeid for item in items if Path(item.path).parent != here]
    if outside:
        raise pytest.UsageError(
            f"tests/cuda_fake must run in its own pytest process (the fake libcuda replaces the "
            f"driver for the whole process), but {len(outside)} other test(s) were collected, "
            f"e.g. {outside[0]}; run `pytest tests --ignore=tests/cuda_fake` and "
            "`pytest tests/cuda_fake` separately, as `make test` does"
        )


def pytest_report_header() -> str:
    return f"cuda-bindings {bindings_version()} against the fake driver {FAKE.path}"


@pytest.fixture(autouse=True)
def fake() -> Iterator[FakeCuda]:
    # The fake's device memory is host memory: tensors over it must be CPU tensors. A patch of
    # its own, so that a test's monkeypatch.undo() (after an interrupt) keeps it.
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cuda_dlpack, "KDL_CUDA", cuda_dlpack.KDL_CPU)
        FAKE.reset()
        try:
            yield FAKE
            gc.collect()
            assert FAKE.live() == {"handles": 0, "mappings": 0, "reservations": 0}, "driver leak"
            assert FAKE.context_depth() == 0, "a context was left pushed"
        finally:
            FAKE.reset()
