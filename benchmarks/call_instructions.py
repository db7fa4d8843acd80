"""Instructions per call of the `simple` model (a 3x10 input), or of `Linear(8, 8)` on a
(1, 8) input (`--model linear`), by each way of calling it,
and of the steps between them, against a plain host thread's call: counts that a busy,
shared machine does not skew, where times do (docs/log/call-path.md, "The call path,
2026-11-26").

Each way runs in a process of its own under callgrind with instrumentation off until its
timed loop (switched on and off around the loop through CALLGRIND_START_INSTRUMENTATION
and CALLGRIND_STOP_INSTRUMENTATION, in a helper compiled here with cc); the instructions
that the loop ran, divided by its calls.  User space only; each interpreter's copies of
libpython and torch show in callgrind's report as unnamed code ("???").  Needs valgrind,
its headers and a C compiler.

With --caches, callgrind also simulates the caches (its I1, D1 and last-level
model of this machine's): misses per call, and callgrind's estimate of cycles (an
instruction each, 10 a first-level miss, 100 a last-level one), which shows where time
goes beyond the instruction count (code and data that two interpreters' copies of the
same libraries keep apart).

    python benchmarks/call_instructions.py [--calls 2000] [--model simple|linear]
        [--caches] [WAY ...]
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))

_HELPER = """
#include <valgrind/callgrind.h>
void start(void) { CALLGRIND_ZERO_STATS; CALLGRIND_START_INSTRUMENTATION; }
void stop(void) { CALLGRIND_STOP_INSTRUMENTATION; CALLGRIND_DUMP_STATS; }
"""

#: way -> what it is, in the order printed
WAYS = {
    "host": "a plain host thread",
    "noop": "no-op call_value, nothing crossing",
    "tensor_in": "no-op call_value, a tensor in",
    "one": "one entry a call, its input inside",
    "twice": "one entry, the model called twice",
    "call_value": "Obj.call_value, a tensor each way",
    "replicated": "a ReplicatedObj's call",
    "balancer": "occupy_one() and hand_back() alone",
}


def _measure(way: str, calls: int, helper: str, model: str) -> None:
    """In the process under callgrind: calls of way, instrumented alone."""
    import ctypes

    import torch

    import multipy
    from micro import simple_calls  # beside this file

    torch.set_num_threads(1)
    torch.set_grad_enabled(False)
    with tempfile.TemporaryDirectory() as folder, \
            multipy.InterpreterManager(1, torch_threads=1, grad_enabled=False) as manager:
        call = simple_calls(folder, manager, model)[way]
        for _ in range(200):  # warm: first calls fill caches and import
            call()
        counter = ctypes.CDLL(helper)
        counter.start()
        for _ in range(calls):
            call()
        counter.stop()


def _count(way: str, calls: int, helper: str, folder: str, model: str,
           caches: bool) -> dict[str, float]:
    """callgrind's events per call of way (Ir, and with caches the misses, I1mr ...),
    from a process of its own under callgrind."""
    from multipy._launch import launch_environment

    out = os.path.join(folder, f"callgrind.{way}")
    subprocess.run(["valgrind", "--tool=callgrind", "--instr-atstart=no",
                    *(["--cache-sim=yes"] if caches else []),
                    f"--callgrind-out-file={out}", sys.executable, os.path.abspath(__file__),
                    "_measure", way, str(calls), helper, model],
                   check=True, capture_output=True, env=launch_environment())
    totals: dict[str, float] = {}
    for name in os.listdir(folder):  # the loop's dump: out.1
        if name.startswith(f"callgrind.{way}"):
            with open(os.path.join(folder, name)) as dump:
                text = dump.read()
            events = re.search(r"^events: (.+)$", text, re.M).group(1).split()
            for line in re.findall(r"^totals: (.+)$", text, re.M):
                for event, n in zip(events, line.split()):
                    totals[event] = totals.get(event, 0) + int(n)
    return {event: n / calls for event, n in totals.items()}


def _cycles(events: dict[str, float]) -> float:
    """callgrind's cycle estimate: an instruction each, 10 a first-level miss, 100 a
    last-level one."""
    first = sum(events.get(e, 0) for e in ("I1mr", "D1mr", "D1mw"))
    last = sum(events.get(e, 0) for e in ("ILmr", "DLmr", "DLmw"))
    return events["Ir"] + 10 * first + 100 * last


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "_measure":
        _measure(sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5])
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("ways", nargs="*", default=list(WAYS), help=", ".join(WAYS))
    parser.add_argument("--calls", type=int, default=2000, help="calls counted per way (2000)")
    parser.add_argument("--model", choices=("simple", "linear"), default="simple",
                        help="the model called (simple)")
    parser.add_argument("--caches", action="store_true",
                        help="simulate the caches too: misses and estimated cycles per call")
    args = parser.parse_args()
    unknown = set(args.ways) - set(WAYS)
    if unknown:
        parser.error(f"no such way: {', '.join(sorted(unknown))}")
    ways = args.ways if "host" in args.ways else ["host", *args.ways]
    with tempfile.TemporaryDirectory() as folder:
        helper = os.path.join(folder, "counter.so")
        subprocess.run(["cc", "-O2", "-shared", "-fPIC", "-x", "c", "-", "-o", helper],
                       input=_HELPER.encode(), check=True)
        counts = {way: _count(way, args.calls, helper, folder, args.model, args.caches)
                  for way in ways}
    print(f"\ninstructions per call of the {args.model} model ({args.calls} calls counted by "
          f"callgrind), against a plain host thread's")
    for way in WAYS:
        if way in counts:
            ratio = counts[way]["Ir"] / counts["host"]["Ir"]
            print(f"  {WAYS[way]:38s} {counts[way]['Ir']:9,.0f}   {ratio:5.2f}x the thread's")
    if args.caches:
        print("\nsimulated caches, per call: first-level misses (code, data), last-level "
              "misses, and the estimated cycles against the thread's")
        for way in WAYS:
            if way in counts:
                c = counts[way]
                ratio = _cycles(c) / _cycles(counts["host"])
                print(f"  {WAYS[way]:38s} I1 {c['I1mr']:7,.0f}  D1 {c['D1mr'] + c['D1mw']:7,.0f}"
                      f"  LL {c['ILmr'] + c['DLmr'] + c['DLmw']:6,.0f}   {_cycles(c):9,.0f} cycles"
                      f"  {ratio:5.2f}x")


if __name__ == "__main__":
    main()
