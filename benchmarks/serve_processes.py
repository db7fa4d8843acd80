"""What `multipy serve --processes` costs and gives, measured in one run on this machine:

1. Load: the same total of interpreters T as one process (--processes 1 --interpreters T)
   and as two (--processes 2 --interpreters T/2), 2T closed-loop HTTP clients (each a
   process of its own, benchmarks/serve_load.py's), the two taking turns for --rounds
   rounds; requests/s, p50/p99 and the PSS of the server's process tree, medians, with
   the ratio two processes / one.
2. Weights once per machine: a model of --weights-mb MB of weights served by one process
   of 2 interpreters and by two processes of 1; the PSS of the whole process tree, each
   process's RSS and PSS (a process's RSS counts the weights' pages whole; PSS shares them
   among the processes that map them).
3. A crash: a model that segfaults, served by two processes; the time from the crash to
   the replacement serving (the supervisor's line "server process K ... ready"), and
   requests answered meanwhile by the other process.
4. Kills under load: --clients client processes, each opening a new connection per
   request, against two processes of one interpreter, while one of the processes is
   killed (SIGKILL) every --kill-every seconds for --kill-seconds: the requests answered,
   and those that failed (connection reset or refused, or an error status).  A kill
   takes the requests in flight in the killed process (at most one per client); any
   other failure is a connection lost by the supervisor.

    multipy run benchmarks/serve_processes.py [--total 2] [--rounds 3] [--seconds 5]
        [--model simple] [--weights-mb 256] [--clients 4] [--kill-every 10]
        [--kill-seconds 90] [--only kills]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from serve_load import _medians, _stop, _tree, example, free_port, run_server  # noqa: E402

WEIGHTS = '''
import torch
from torch import nn


class Big(nn.Module):
    """Layers of 1024 x 1024 float32 weights (4 MiB each); x: [B, 1024]."""

    def __init__(self, layers):
        super().__init__()
        self.layers = nn.Sequential(*[nn.Linear(1024, 1024, bias=False) for _ in range(layers)])

    def forward(self, x):
        return self.layers(x)


class Crashes(nn.Module):
    """Writes to address 16: a segmentation fault; x < 0 only."""

    def forward(self, x):
        if bool((x < 0).any()):
            import ctypes
            ctypes.memset(16, 0, 1)
        return x * 2
'''


def _packages(directory: str, weights_mb: int) -> dict[str, str]:
    """Archives of the Big model (weights_mb MB of weights) and of Crashes."""
    import torch
    import torch.package

    with open(os.path.join(directory, "processes_models.py"), "w") as f:
        f.write(WEIGHTS)
    sys.path.insert(0, directory)
    import processes_models

    paths = {}
    for name, model, example_input in (
            ("big", processes_models.Big(max(1, weights_mb // 4)), torch.zeros(1, 1024)),
            ("crashes", processes_models.Crashes(), torch.ones(1))):
        paths[name] = os.path.join(directory, f"{name}.pt")
        with torch.package.PackageExporter(paths[name]) as exporter:
            exporter.extern(["torch.**", "numpy.**"])
            exporter.intern("processes_models")
            exporter.save_pickle("model", "model.pkl", model)
            exporter.save_pickle("model", "example.pkl", (example_input,))
    return paths


def _serve(paths: list[str], processes: int, interpreters: int, log) -> tuple:
    port = free_port()
    command = [sys.executable, "-m", "multipy", "serve", *paths, "--port", str(port),
               "--processes", str(processes), "--interpreters", str(interpreters)]
    process = subprocess.Popen(command, stdout=log, stderr=log, text=True,
                               start_new_session=True)
    return process, port


def _wait_all(process, log, processes: int, seconds: float = 300) -> None:
    """Until every process is ready (the supervisor's ready line; one process: ready)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        log.seek(0)
        text = log.read()
        if (f"ready: {processes} server processes" in text if processes > 1
                else "ready in" in text):
            return
        if process.poll() is not None:
            raise RuntimeError(f"the server exited:\n{text[-3000:]}")
        time.sleep(0.2)
    raise TimeoutError("the server was not ready")


def _memory(pid: int) -> list[tuple[int, int, int]]:
    """(pid, RSS, PSS) in bytes of pid and each descendant."""
    rows = []
    for each in _tree(pid):
        try:
            with open(f"/proc/{each}/smaps_rollup") as f:
                fields = {line.split(":")[0]: int(line.split()[1]) * 1024
                          for line in f if line.split(":")[0] in ("Rss", "Pss")}
            rows.append((each, fields["Rss"], fields["Pss"]))
        except (OSError, KeyError):
            pass
    return rows


def _infer(port: int, model: str, data: list[float], shape: list[int]) -> int:
    body = json.dumps({"inputs": [{"name": "x", "shape": shape, "datatype": "FP32",
                                   "data": data}]}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v2/models/{model}/infer", body)
    try:
        with urllib.request.urlopen(request, timeout=30) as answer:
            return answer.status
    except urllib.error.HTTPError as error:
        return error.code
    except OSError:
        return 0


def load(args, directory: str) -> None:
    path, inputs, expected = example(directory, args.model)
    total = args.total
    rounds = {1: [], 2: []}
    for round_ in range(args.rounds):
        for processes in ((1, 2) if round_ % 2 == 0 else (2, 1)):
            port = free_port()
            command = [sys.executable, "-m", "multipy", "serve", path, "--port", str(port),
                       "--processes", str(processes),
                       "--interpreters", str(total // processes)]
            measured = run_server(command, {"http": port}, ("http",), args.model, 2 * total,
                                  args.seconds, args.warm_up, inputs, expected)
            rounds[processes].append(measured["http"])
    one, two = _medians(rounds[1]), _medians(rounds[2])
    print(f"\n1. load: {args.model}, {total} interpreters in all, {2 * total} HTTP clients, "
          f"{args.seconds:g} s after {args.warm_up:g} s, median of {args.rounds} round(s)")
    print(f"{'server':32s} {'req/s':>8s} {'p50 ms':>7s} {'p99 ms':>7s} {'PSS MiB':>8s} "
          f"{'wrong':>5s}")
    for label, f in ((f"1 process of {total}", one), (f"2 processes of {total // 2}", two)):
        print(f"{label:32s} {f['requests_per_second']:8.1f} {f['p50_ms']:7.2f} "
              f"{f['p99_ms']:7.2f} {f['pss_mib']:8.1f} {f['wrong']:5d}")
    print(f"two processes / one: requests/s {two['requests_per_second'] / one['requests_per_second']:.2f}x, "
          f"memory {two['pss_mib'] / one['pss_mib']:.2f}x (req/s by round: "
          + ", ".join(f"{a['requests_per_second']:.0f}/{b['requests_per_second']:.0f}"
                      for a, b in zip(rounds[2], rounds[1])) + ")")


def weights(args, paths: dict[str, str]) -> None:
    print(f"\n2. memory: a model of {args.weights_mb} MB of weights on 2 interpreters in all")
    figures = {}
    for processes in (1, 2):
        with tempfile.TemporaryFile("w+") as log:
            process, port = _serve([paths["big"]], processes, 2 // processes, log)
            try:
                _wait_all(process, log, processes)
                for _ in range(4):  # every interpreter has run it
                    assert _infer(port, "big", [0.0] * 1024, [1, 1024]) == 200
                rows = _memory(process.pid)
            finally:
                _stop(process)
        total = sum(pss for _, _, pss in rows)
        figures[processes] = total
        print(f"  {processes} process(es): PSS of the tree {total / 2 ** 20:.0f} MiB; "
              + "; ".join(f"pid {pid}: RSS {rss / 2 ** 20:.0f} MiB, PSS {pss / 2 ** 20:.0f} MiB"
                          for pid, rss, pss in rows))
    print(f"  two processes cost {(figures[2] - figures[1]) / 2 ** 20:+.0f} MiB more than one "
          f"(the weights: {args.weights_mb} MB)")


def crash(args, paths: dict[str, str]) -> None:
    print("\n3. a crash: a model that segfaults, 2 processes of 1 interpreter")
    with tempfile.TemporaryFile("w+") as log:
        process, port = _serve([paths["crashes"]], 2, 1, log)
        try:
            _wait_all(process, log, 2)
            crashed = time.monotonic()
            status = _infer(port, "crashes", [-1.0], [1])
            answered = []
            while time.monotonic() - crashed < 120:
                answered.append(_infer(port, "crashes", [1.0], [1]))
                log.seek(0)
                if len(re.findall(r"server process \d \(pid \d+\) ready", log.read())) == 3:
                    break
            replaced = time.monotonic() - crashed
            log.seek(0)
            text = log.read()
        finally:
            _stop(process)
    took = re.findall(r"server process \d \(pid \d+\) ready in ([\d.]+) s", text)
    print(f"  the crashing request: status {status or 'none (connection closed)'}; "
          f"replacement serving {replaced:.1f} s after the crash (its own start: {took[-1]} s); "
          f"meanwhile {answered.count(200)} of {len(answered)} requests answered 200")


def _hammer(port: int, going, counts) -> None:
    """A client process: requests on new connections until going is cleared; counts
    each status (0: the connection failed)."""
    while going.is_set():
        status = _infer(port, "crashes", [1.0], [1])
        with counts.get_lock():
            counts[min(status // 100, 5) if status else 0] += 1


def kills(args, paths: dict[str, str]) -> None:
    import multiprocessing

    print(f"\n4. kills under load: {args.clients} clients, a new connection per request, "
          f"2 processes of 1 interpreter, a SIGKILL every {args.kill_every:g} s for "
          f"{args.kill_seconds:g} s")
    with tempfile.TemporaryFile("w+") as log:
        process, port = _serve([paths["crashes"]], 2, 1, log)
        going, counts = multiprocessing.Event(), multiprocessing.Array("q", 6)
        clients = []
        try:
            _wait_all(process, log, 2)
            going.set()
            clients = [multiprocessing.Process(target=_hammer, args=(port, going, counts))
                       for _ in range(args.clients)]
            for client in clients:
                client.start()
            killed, dead, started = 0, set(), time.monotonic()
            while time.monotonic() - started < args.kill_seconds:
                time.sleep(args.kill_every)
                log.seek(0)
                ready = re.findall(r"server process \d \(pid (\d+)\) ready", log.read())
                oldest = [int(pid) for pid in ready if int(pid) not in dead][0]
                os.kill(oldest, signal.SIGKILL)
                dead.add(oldest)
                killed += 1
                _wait_for_ready(log, 2 + killed)
            time.sleep(1)
        finally:
            going.clear()
            for client in clients:
                client.join(60)
            _stop(process)
    answered, failed = counts[2], counts[0] + counts[3] + counts[4] + counts[5]
    print(f"  {killed} kills: {answered} requests answered 200, {failed} failed (connection "
          f"{counts[0]}, 4xx {counts[4]}, 5xx {counts[5]}); a kill takes what is in flight "
          f"in its process, at most {args.clients} requests")


def _wait_for_ready(log, count: int, seconds: float = 120) -> None:
    """Until the supervisor has logged count processes ready."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        log.seek(0)
        if len(re.findall(r"server process \d \(pid \d+\) ready", log.read())) >= count:
            return
        time.sleep(0.1)
    raise TimeoutError("the replacement was not ready")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--total", type=int, default=2, help="interpreters in all, even (2)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the load (3)")
    parser.add_argument("--seconds", type=float, default=5, help="timed seconds per run (5)")
    parser.add_argument("--warm-up", type=float, default=2, help="untimed seconds first (2)")
    parser.add_argument("--model", default="simple", help="example model for the load (simple)")
    parser.add_argument("--weights-mb", type=int, default=256, help="the big model's MB (256)")
    parser.add_argument("--clients", type=int, default=4, help="clients of the kills (4)")
    parser.add_argument("--kill-every", type=float, default=10, help="seconds between kills (10)")
    parser.add_argument("--kill-seconds", type=float, default=90, help="seconds of kills (90)")
    parser.add_argument("--only", choices=("load", "weights", "crash", "kills"),
                        help="run that part only")
    args = parser.parse_args()
    if args.total < 2 or args.total % 2:
        parser.error("--total must be even")
    with tempfile.TemporaryDirectory() as directory:
        paths = _packages(directory, args.weights_mb)
        for part in (load, weights, crash, kills):
            if args.only in (None, part.__name__):
                part(args, directory if part is load else paths)


if __name__ == "__main__":
    main()
