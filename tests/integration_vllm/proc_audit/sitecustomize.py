"""Loaded at start-up by every Python process of a test engine (this folder is put first on
``PYTHONPATH``): records each time a process opens another process's file descriptor
through ``/proc/<pid>/fd``, which no elastickv engine process may do (each worker maps its
own memory; nothing reaches into another process's).

Only active when ``PROC_FD_AUDIT_LOG`` names a file; one JSON line per open, appended.
"""

from __future__ import annotations

import json
import os
import re
import sys

_LOG = os.environ.get("PROC_FD_AUDIT_LOG")
_OTHER_FD = re.compile(r"^/proc/(\d+)/fd/")


def _audit(event: str, args: tuple[object, ...]) -> None:
    if event != "open" or not args:
        return
    path = args[0]
    if isinstance(path, bytes):
        path = os.fsdecode(path)
    if not isinstance(path, str):
        return
    found = _OTHER_FD.match(path)
    if found is None or int(found.group(1)) == os.getpid():
        return
    line = json.dumps({"pid": os.getpid(), "argv": sys.argv[:2], "path": path})
    with open(_LOG, "a", encoding="utf-8") as log:  # type: ignore[arg-type]
        log.write(line + "\n")


if _LOG:
    sys.addaudithook(_audit)
