"""A stand-in for vLLM's OpenAI server, as ``elastickv serve`` starts it, for serve's own
tests (the real server is tested in tests/integration_vllm): it answers ``/health`` and
``/v1/completions``, and does with the ledger and the temporary directory what an elastic
vLLM engine does.

- With ``ELASTICKV=1`` it registers as ``ELASTICKV_INSTANCE`` with ``ELASTICKV_BUDGET`` as its
  limit and holds one page from start to end (the null block: its floor).
- A completion commits two more pages and keeps them (a prefix cache); a prompt ``"hold"``
  is answered once the file ``$STANDIN_GATE`` exists.
- It answers a sleep request in its ledger record within 0.1 s, as an elastic engine's idle
  ticks do: asleep, awake again once the request is withdrawn or a completion arrives; with
  ``STANDIN_NO_SLEEP`` set it refuses, as an engine that cannot release its weights.
- Like vLLM, it leaves a ``vllm_dist_*`` file in the temporary directory on every start.
- SIGTERM: it unregisters and exits 0.
- With ``STANDIN_EXIT`` set it fails at once (exit status 3), as an engine that cannot start.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from elastickv.control import InstanceHandle, Ledger, open_ledger


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--served-model-name", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    args, _ = parser.parse_known_args()
    if os.environ.get("STANDIN_EXIT"):
        print(f"stand-in for {args.model}: failing on purpose", file=sys.stderr, flush=True)
        sys.exit(3)
    rendezvous = os.path.join(tempfile.gettempdir(), f"vllm_dist_{uuid.uuid4().hex}")
    with open(rendezvous, "w") as out:
        out.write("torch.distributed's file store\n")
    ledger: Ledger | None = None
    handle: InstanceHandle | None = None
    page = int(os.environ.get("ELASTICKV_PAGE_SIZE", "65536"))
    if os.environ.get("ELASTICKV") == "1":
        ledger = open_ledger("host")
        handle = ledger.register(
            os.environ["ELASTICKV_INSTANCE"], limit=int(os.environ["ELASTICKV_BUDGET"])
        )
        assert handle.try_admit(page)
        handle.set_floor_bytes(page)
    lock = threading.Lock()
    if handle is not None:
        threading.Thread(target=answer_sleep, args=(handle, lock), daemon=True).start()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *log_args: Any) -> None:
            print(format % log_args, file=sys.stderr, flush=True)

        def _answer(self, status: int, body: dict[str, Any]) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            if self.path == "/health":
                self._answer(200, {})
            else:
                self._answer(200, {"data": [{"id": args.served_model_name}]})

        def do_POST(self) -> None:
            request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if handle is not None:
                with lock:
                    handle.try_admit(2 * page)
                    handle.set_sleep_state(asleep=False)  # a step wakes a sleeping engine
            gate = os.environ.get("STANDIN_GATE")
            while request.get("prompt") == "hold" and gate and not os.path.exists(gate):
                time.sleep(0.05)
            self._answer(200, {"choices": [{"text": "ok", "index": 0}]})

    server = ThreadingHTTPServer((args.host, args.port), Handler)

    def stop(signum: int, frame: Any) -> None:
        threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, stop)
    print(f"stand-in for {args.model} on port {args.port}", file=sys.stderr, flush=True)
    server.serve_forever()
    if handle is not None:
        with lock:
            handle.close()
    if ledger is not None:
        ledger.close()


def answer_sleep(handle: InstanceHandle, lock: threading.Lock) -> None:
    refuse = bool(os.environ.get("STANDIN_NO_SLEEP"))
    while not handle.closed:
        with lock:
            if handle.closed:
                return
            info = handle.info()
            if info.sleep_wanted and not info.asleep and not info.sleep_refused:
                handle.set_sleep_state(asleep=not refuse, refused=refuse)
            elif not info.sleep_wanted and info.asleep:
                handle.set_sleep_state(asleep=False)
        time.sleep(0.1)


if __name__ == "__main__":
    main()
