"""A second process attaches to the physical pool (its fd passed on), sees the data and
commits/releases pages."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import elastickv.vmm
from elastickv.vmm import HostBackend

SRC = str(Path(elastickv.vmm.__file__).resolve().parents[2])

CHILD = """
import ctypes, json, sys
from elastickv.vmm import HostBackend

how, where, page_size = sys.argv[1], sys.argv[2], int(sys.argv[3])
backend = HostBackend(page_size=page_size)
vrange = backend.attach(int(where))
base = vrange.base_address

def first_byte(page):
    return ctypes.c_uint8.from_address(base + page * page_size).value

vrange.commit([0, 1])
seen = [first_byte(0), first_byte(1)]
ctypes.memset(base + page_size, 0x33, page_size)
vrange.commit([3])
ctypes.memset(base + 3 * page_size, 0x44, page_size)
vrange.release([0])
vrange.unmap(vrange.committed_pages())
print(json.dumps({"seen": seen, "footprint": vrange.footprint_bytes()}))
vrange.close()
"""


def run_child(how: str, where: str, page_size: int, pass_fds: tuple[int, ...]) -> dict[str, object]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [SRC, env.get("PYTHONPATH")]))
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(CHILD), how, where, str(page_size)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        pass_fds=pass_fds,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    report: dict[str, object] = json.loads(result.stdout.strip().splitlines()[-1])
    return report


def check_shared_pool(how: str) -> None:
    backend = HostBackend()
    page = backend.page_size
    with backend.reserve(8 * page) as vrange:
        tensor = vrange.as_tensor()
        vrange.commit([0, 1])
        tensor[:page].fill_(0x11)
        tensor[page : 2 * page].fill_(0x22)
        fd = vrange.pool.fd
        report = run_child("fd", str(fd), page, pass_fds=(fd,))

        assert report["seen"] == [0x11, 0x22], "the child sees the parent's data"
        assert report["footprint"] == 2 * page, "child released page 0, committed page 3"
        assert vrange.footprint_bytes() == 2 * page
        assert int(tensor[page : 2 * page].min()) == 0x33, "the parent sees the child's writes"

        assert vrange.release([0]) == 1, "syncing the parent's mapping of the punched page"
        assert vrange.footprint_bytes() == 2 * page
        assert vrange.commit([3]) == 1
        assert vrange.footprint_bytes() == 2 * page, "page 3 already exists in the pool"
        assert int(tensor[3 * page : 4 * page].max()) == 0x44
    assert vrange.footprint_bytes() == 0


def test_child_attaches_by_inherited_fd() -> None:
    check_shared_pool("fd")
