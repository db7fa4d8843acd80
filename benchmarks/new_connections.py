"""Requests/s with a new connection per request against `multipy serve --processes 2
--interpreters 1` (a small class, numpy only), this checkout against another (a checkout
of another commit, its C built in place: `python setup.py build_ext --inplace`), in turn
for --rounds rounds: what a change to the supervisor's hand-over costs.

    python benchmarks/new_connections.py --against /path/to/other/checkout [--clients 4]
        [--seconds 8] [--rounds 4]
"""
from __future__ import annotations

import argparse
import http.client
import json
import multiprocessing
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from serve_load import free_port  # noqa: E402

MODEL = '''
import numpy as np


class Echo:
    def predict(self, inputs):
        return {"y": inputs["x"]}
'''
BODY = json.dumps({"inputs": [{"name": "x", "shape": [1], "datatype": "FP32",
                               "data": [1]}]}).encode()


def _client(port: int, until: float, counts) -> None:
    answered = 0
    while time.time() < until:
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        try:
            connection.request("POST", "/v2/models/echo/infer", BODY)
            answer = connection.getresponse()
            answer.read()
            answered += answer.status == 200
        except OSError:
            pass
        finally:
            connection.close()
    with counts.get_lock():
        counts.value += answered


def measure(root: str, model: str, clients: int, seconds: float) -> float:
    """Requests/s answered 200 by the checkout at root."""
    port = free_port()
    with tempfile.TemporaryFile("w+") as log:
        server = subprocess.Popen(
            [sys.executable, "-m", "multipy", "serve", f"{model}:Echo", "--port", str(port),
             "--processes", "2", "--interpreters", "1"], cwd=root, stdout=log, stderr=log,
            env={**os.environ, "PYTHONPATH": root}, start_new_session=True)
        try:
            deadline = time.monotonic() + 120
            while True:
                log.seek(0)
                if "ready: 2 server processes" in log.read():
                    break
                if server.poll() is not None or time.monotonic() > deadline:
                    log.seek(0)
                    raise RuntimeError(f"the server of {root} did not start:\n{log.read()}")
                time.sleep(0.2)
            counts = multiprocessing.Value("q", 0)
            until = time.time() + seconds
            workers = [multiprocessing.Process(target=_client, args=(port, until, counts))
                       for _ in range(clients)]
            for worker in workers:
                worker.start()
            for worker in workers:
                worker.join()
        finally:
            os.killpg(server.pid, signal.SIGTERM)
            server.wait(60)
    return counts.value / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--against", required=True, help="the other checkout")
    parser.add_argument("--clients", type=int, default=4, help="client processes (4)")
    parser.add_argument("--seconds", type=float, default=8, help="seconds a run (8)")
    parser.add_argument("--rounds", type=int, default=4, help="rounds (4)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        model = os.path.join(directory, "echo_model.py")
        with open(model, "w") as f:
            f.write(MODEL)
        ratios = []
        for k in range(args.rounds):
            here = measure(HERE, model, args.clients, args.seconds)
            there = measure(os.path.abspath(args.against), model, args.clients, args.seconds)
            ratios.append(here / there)
            print(f"round {k + 1}: this checkout {here:,.0f} req/s, the other {there:,.0f} "
                  f"req/s: {here / there:.2f}x", flush=True)
    print(f"median {statistics.median(ratios):.2f}x ({min(ratios):.2f}x to {max(ratios):.2f}x)")


if __name__ == "__main__":
    main()
