"""The demo: the same CPU-bound pure-Python function on N host threads in one
interpreter (one GIL) against N threads each driving its own interpreter, both wall
times and their ratio.  (benchmarks/micro.py measures the call path itself.)

Run it with room for 15 interpreters:  multipy run benchmarks/core.py [--threads N]
"""
from __future__ import annotations

import argparse
import threading
import time

import multipy
from multipy._free_cores import describe, measure

WORK = '''
def work(n):
    total = 0
    for i in range(n):
        total += (i * i) % 7
    return total
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2, help="threads and interpreters (2)")
    parser.add_argument("--n", type=int, default=10_000_000, help="loop length of the work (1e7)")
    parser.add_argument("--repeat", type=int, default=3, help="best of this many runs (3)")
    args = parser.parse_args()
    print(describe(args.threads, measure(args.threads)))
    with multipy.InterpreterManager(args.threads) as manager:
        manager.register_module_source("bench_work", WORK)
        cpu_bound(manager, args.threads, args.n, args.repeat)


if __name__ == "__main__":
    main()
