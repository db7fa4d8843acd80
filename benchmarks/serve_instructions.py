"""What one request of a small model costs a server in instructions and system calls: counts
that a busy, shared machine does not skew, where requests/s and CPU time do.

Starts `multipy serve` (one interpreter) or the floor (benchmarks/floor_app.py, one
uvicorn worker, with torch's intra-op threads as many as multipy's interpreter has, as
serve_load.py gives them) on the example model `simple` (or `python_heavy`), under
callgrind with instrumentation off (`--tool callgrind`) or plainly (`--tool strace`);
warms it up with JSON requests over a keep-alive connection (or, with --new-connections,
a new connection per request, as clients without keep-alive send them); then counts,
over --requests more: the
instructions the server ran (callgrind, switched on for them alone with
callgrind_control; user space only), or its system calls by kind (strace -c, attached
for them alone).  Needs valgrind or strace.
With --keep FILE, callgrind's profile of those requests is kept there, for
`callgrind_annotate FILE` (where the instructions went, by function).

What a server runs by the clock (timers, watching threads) goes into a request's count
for as long as the request takes, and under callgrind, on a busy machine, that is
fifty times as long as it would be or more: so callgrind first counts --idle seconds
without requests, and the count of each request is also given net of that rate over
the time the requests took.

    python benchmarks/serve_instructions.py [--server multipy|floor] [--tool callgrind|strace]
        [--model simple|python_heavy] [--requests 1000] [--warm-up 20] [--keep FILE]
        [--new-connections] [--idle 5]
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Callable

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from serve_load import _stop, _wait_ready, free_port  # noqa: E402

from multipy._launch import launch_environment  # noqa: E402
from multipy.manager import default_torch_threads  # noqa: E402

#: model -> the JSON request that each count sends it
BODIES = {name: json.dumps({"inputs": [{"name": "x", "shape": shape, "datatype": "FP32",
                                        "data": [0.5] * size}]})
          for name, shape, size in (("simple", [3, 10], 30),
                                    ("python_heavy", [2, 48, 16], 2 * 48 * 16))}


def requests(port: int, count: int | None = None, seconds: float = 0.0,
             model: str = "simple", new: bool = False) -> None:
    """count requests of model, or as many as seconds allow, over one keep-alive
    connection (new: each on a connection of its own)."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    end = time.monotonic() + seconds
    done = 0
    while done < count if count is not None else time.monotonic() < end:
        connection.request("POST", f"/v2/models/{model}/infer", BODIES[model],
                           {"Content-Type": "application/json"})
        answer = connection.getresponse()
        answer.read()
        if answer.status != 200:
            raise RuntimeError(f"the server answered {answer.status}")
        done += 1
        if new:
            connection.close()
    connection.close()


def count(pid: int, out: str, dump: int, work: Callable[[], None],
          poke: Callable[[], None]) -> tuple[int, float]:
    """The instructions that server pid ran while work() ran, and the seconds it took,
    from its dump number dump (callgrind's output out.dump; poke() makes the server run
    meanwhile, and take the dump command sooner).  RuntimeError if callgrind dumped none."""
    subprocess.run(["callgrind_control", "-i", "on", str(pid)], check=True,
                   capture_output=True)
    began = time.monotonic()
    work()
    took = time.monotonic() - began
    for command in (["-i", "off"], ["-d"]):
        subprocess.run(["callgrind_control", *command, str(pid)], check=True,
                       capture_output=True)
    dumped = f"{out}.{dump}"
    deadline = time.monotonic() + 120
    while not os.path.exists(dumped) and time.monotonic() < deadline:
        poke()
        time.sleep(0.5)
    time.sleep(1)  # written whole
    totals = re.findall(r"^totals: (\d+)", open(dumped).read() if os.path.exists(dumped)
                        else "", re.MULTILINE)
    if not totals:
        raise RuntimeError("callgrind dumped no count")
    return int(totals[0]), took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--server", choices=("multipy", "floor"), default="multipy")
    parser.add_argument("--tool", choices=("callgrind", "strace"), default="callgrind")
    parser.add_argument("--model", choices=tuple(BODIES), default="simple")
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--warm-up", type=float, default=20, help="seconds of requests first")
    parser.add_argument("--keep", metavar="FILE", help="where to keep callgrind's profile")
    parser.add_argument("--new-connections", action="store_true",
                        help="a new connection per request (default: one keep-alive connection)")
    parser.add_argument("--idle", type=float, default=5, metavar="SECONDS",
                        help="seconds without requests counted first (callgrind)")
    args = parser.parse_args()
    sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))
    from generate_examples import generate

    with tempfile.TemporaryDirectory() as folder:
        path = generate(folder, [args.model])[args.model]
        port = free_port()
        out = os.path.join(folder, "callgrind.out")
        command = ([sys.executable, "-m", "multipy.serve", path, "--interpreters", "1",
                    "--port", str(port)] if args.server == "multipy" else
                   [sys.executable, os.path.join(HERE, "floor_app.py"), path, "--name",
                    args.model, "--workers", "1", "--port", str(port),
                    # torch's intra-op threads as multipy's one interpreter has them
                    "--torch-threads", str(default_torch_threads(1))])
        if args.tool == "callgrind":
            command = ["valgrind", "--tool=callgrind", "--instr-atstart=no",
                       f"--callgrind-out-file={out}", *command]
        log = open(os.path.join(folder, "server.log"), "w+")
        # with the launcher's environment already: a server that had to re-exec itself
        # to get it would leave valgrind behind
        server = subprocess.Popen(command, stdout=log, stderr=log, start_new_session=True,
                                  env=launch_environment())
        try:
            _wait_ready(port, server, seconds=1200)  # (minutes to start under callgrind)
            new = args.new_connections
            requests(port, seconds=args.warm_up, model=args.model, new=new)
            if args.tool == "callgrind":
                def poke() -> None:
                    requests(port, 1, model=args.model)

                idle = count(server.pid, out, 1, lambda: time.sleep(args.idle), poke) \
                    if args.idle else (0, 1.0)
                counted = count(server.pid, out, 2 if args.idle else 1, lambda: requests(
                    port, args.requests, model=args.model, new=new), poke)
            else:
                summary = os.path.join(folder, "strace.txt")
                tracer = subprocess.Popen(["strace", "-f", "-c", "-o", summary, "-p",
                                           str(server.pid)], stderr=subprocess.DEVNULL)
                time.sleep(1)  # attached to every thread
                requests(port, args.requests, model=args.model, new=new)
                tracer.send_signal(signal.SIGINT)
                tracer.wait(60)
        except RuntimeError as error:
            log.seek(0)
            sys.exit(f"{error}; the server's log:\n" + log.read()[-2000:])
        finally:
            _stop(server)
        log.seek(0)
        if args.tool == "callgrind":
            if args.keep:
                shutil.copyfile(f"{out}.{2 if args.idle else 1}", args.keep)
            (total, took), rate = counted, idle[0] / idle[1]
            print(f"{args.server}: {total / args.requests:,.0f} instructions per request "
                  f"({args.requests} requests of {args.model}"
                  f"{', each on a new connection' if new else ''}, in {took:.1f} s); "
                  f"{(total - rate * took) / args.requests:,.0f} net of what it runs "
                  f"while idle ({rate:,.0f} a second)")
        else:
            calls = {}
            for line in open(summary):
                fields = line.split()
                if len(fields) >= 5 and fields[3].isdigit():
                    calls[fields[-1]] = int(fields[3])
            total = calls.pop("total", sum(calls.values()))
            each = ", ".join(f"{name} {count / args.requests:.2f}"
                             for name, count in sorted(calls.items(), key=lambda kv: -kv[1]))
            print(f"{args.server}: {total / args.requests:.2f} system calls per request "
                  f"({each}; {args.requests} requests"
                  f"{', each on a new connection' if new else ''})")


if __name__ == "__main__":
    main()
