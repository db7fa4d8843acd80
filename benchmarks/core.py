"""Core figures of multipy, each against a peer measured in the same run.

1. The same CPU-bound pure-Python function on N host threads in one interpreter (one
   GIL) against N threads each driving its own interpreter: wall time and ratio.
2. The round trip of a no-op call (host thread -> interpreter -> host): median and
   p95, against a direct call and a multiprocessing pipe round trip.

Run it with room for 15 interpreters:  multipy run benchmarks/core.py [--threads N]
"""
from __future__ import annotations

import argparse
import multiprocessing
import statistics
import threading
import time

import multipy

WORK = '''
def work(n):
    total = 0
    for i in range(n):
        total += (i * i) % 7
    return total

def noop():
    pass
'''
namespace: dict = {}
exec(WORK, namespace)


def _wall(functions) -> float:
    """Wall time for running each function on its own thread, all at once."""
    threads = [threading.Thread(target=f) for f in functions]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return time.perf_counter() - start


def cpu_bound(manager: multipy.InterpreterManager, threads: int, n: int, repeat: int) -> None:
    expected = namespace["work"](n)
    results: list[int] = []

    def host():
        results.append(namespace["work"](n))

    def inside(interpreter):
        def run():
            with interpreter.acquire_session() as s:
                results.append(s.global_("bench_work", "work")(n).deref())
        return run

    one_gil = min(_wall([host] * threads) for _ in range(repeat))
    many = min(_wall([inside(manager[i]) for i in range(threads)]) for _ in range(repeat))
    assert results == [expected] * len(results), "a result was wrong"
    print(f"cpu-bound work({n}) on {threads} threads")
    print(f"  one interpreter, {threads} threads (one GIL): {one_gil:8.3f} s")
    print(f"  {threads} interpreters, one thread each:     {many:8.3f} s")
    print(f"  ratio (one GIL / interpreters):           {one_gil / many:8.2f}x")


def _median_p95(samples: list[float]) -> tuple[float, float]:
    samples = sorted(samples)
    return statistics.median(samples) * 1e6, samples[int(len(samples) * 0.95)] * 1e6


def _timed(call, count: int) -> list[float]:
    samples = []
    for _ in range(count):
        start = time.perf_counter()
        call()
        samples.append(time.perf_counter() - start)
    return samples


def _echo(connection) -> None:
    while (message := connection.recv()) is not None:
        connection.send(message)


def round_trip(manager: multipy.InterpreterManager, count: int) -> None:
    with manager.acquire_one() as s:
        noop = s.global_("bench_work", "noop")
        _timed(noop, 1000)  # warm-up
        inside = _median_p95(_timed(noop, count))
    direct = _median_p95(_timed(namespace["noop"], count))
    here, there = multiprocessing.Pipe()
    process = multiprocessing.Process(target=_echo, args=(there,))
    process.start()
    _timed(lambda: (here.send(("noop", ())), here.recv()), 1000)
    pipe = _median_p95(_timed(lambda: (here.send(("noop", ())), here.recv()), count))
    here.send(None)
    process.join()
    print(f"no-op call round trip, {count} calls (median / p95)")
    print(f"  multipy interpreter:       {inside[0]:7.1f} / {inside[1]:7.1f} us")
    print(f"  direct call in the host:   {direct[0]:7.1f} / {direct[1]:7.1f} us")
    print(f"  multiprocessing pipe:      {pipe[0]:7.1f} / {pipe[1]:7.1f} us")
    print(f"  ratio (pipe / multipy):    {pipe[0] / inside[0]:7.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2, help="threads and interpreters (2)")
    parser.add_argument("--n", type=int, default=10_000_000, help="loop length of the work (1e7)")
    parser.add_argument("--repeat", type=int, default=3, help="best of this many runs (3)")
    parser.add_argument("--calls", type=int, default=20_000, help="round trips to time (20000)")
    args = parser.parse_args()
    with multipy.InterpreterManager(args.threads) as manager:
        manager.register_module_source("bench_work", WORK)
        cpu_bound(manager, args.threads, args.n, args.repeat)
        round_trip(manager, args.calls)


if __name__ == "__main__":
    main()
