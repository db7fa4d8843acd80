"""How soon the call of a client that has gone stops, without --timeout: `multipy serve`
(one interpreter) runs a model class whose call spins in Python until it is cancelled
and notes when it stopped; a client sends a request, waits --wait seconds, then closes its
connection (HTTP) or lets its deadline pass (gRPC, a deadline of --wait seconds).  Prints
the time from the client's going to the call's stop, over --rounds rounds each (the
server's watch looks every 50 ms: multipy/_inside/hangups.py).

    python benchmarks/gone_clients.py [--rounds 10] [--wait 0.3]
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from serve_load import _stop, _wait_ready, free_port  # noqa: E402

from multipy._launch import launch_environment  # noqa: E402

MODEL = '''
import time

import numpy as np


class Spins:
    """Spins in Python until cancelled; then writes when it stopped to the file named
    by its input "note" (as UTF-8 bytes)."""

    def predict(self, inputs):
        try:
            while True:
                pass
        finally:
            with open(bytes(inputs["note"].astype(np.uint8)).decode(), "w") as f:
                f.write(repr(time.monotonic()))
'''


def _stopped_after(note: str, gone: float) -> float:
    """Seconds from gone to the time the call wrote in note (waiting up to 10 s for it)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            with open(note) as f:
                return float(f.read()) - gone
        except (OSError, ValueError):
            time.sleep(0.005)
    raise RuntimeError("the call did not stop within 10 s of its client's going")


def _http_round(port: int, note: str, wait: float) -> float:
    body = json.dumps({"inputs": [{"name": "note", "shape": [len(note)], "datatype": "UINT8",
                                   "data": list(note.encode())}]}).encode()
    with socket.create_connection(("127.0.0.1", port)) as connection:
        connection.sendall(b"POST /v2/models/spins/infer HTTP/1.1\r\nHost: x\r\n"
                           b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        time.sleep(wait)
        gone = time.monotonic()
    return _stopped_after(note, gone)


def _grpc_round(client, note: str, wait: float) -> float:
    import numpy as np
    import tritonclient.grpc as grpcclient

    tensor = grpcclient.InferInput("note", [len(note)], "UINT8")
    tensor.set_data_from_numpy(np.frombuffer(note.encode(), np.uint8))
    began = time.monotonic()
    try:
        client.infer("spins", [tensor], client_timeout=wait)
    except Exception:  # (its deadline passed)
        pass
    return _stopped_after(note, began + wait)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--wait", type=float, default=0.3,
                        help="seconds from a request to its client's going")
    args = parser.parse_args()
    import tritonclient.grpc as grpcclient

    with tempfile.TemporaryDirectory() as folder:
        with open(os.path.join(folder, "spins.py"), "w") as f:
            f.write(MODEL)
        port, grpc_port = free_port(), free_port()
        log = open(os.path.join(folder, "server.log"), "w+")
        server = subprocess.Popen(
            [sys.executable, "-m", "multipy.serve", f"{folder}/spins.py:Spins",
             "--interpreters", "1", "--port", str(port), "--grpc-port", str(grpc_port)],
            stdout=log, stderr=log, start_new_session=True, env=launch_environment())
        try:
            _wait_ready(port, server, grpc_port)
            client = grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_port}")
            for name, each in (("HTTP, connection closed", lambda note: _http_round(
                    port, note, args.wait)), ("gRPC, deadline passed", lambda note: _grpc_round(
                    client, note, args.wait))):
                delays = []
                for k in range(args.rounds):
                    note = os.path.join(folder, f"note-{name[:4]}-{k}")
                    delays.append(each(note) * 1000)
                print(f"{name}: the call stopped {statistics.median(delays):.0f} ms after "
                      f"(median; {min(delays):.0f}-{max(delays):.0f} ms over {args.rounds} "
                      f"rounds)")
        finally:
            _stop(server)


if __name__ == "__main__":
    main()
