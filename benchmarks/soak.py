"""Soak: many host threads making mixed calls on a few interpreters, every result checked.

Phases, each reporting figures:
1. load: ``--threads`` host threads on ``--interpreters`` interpreters for ``--seconds``:
   no-op calls, tensor and array arguments and results (when torch / numpy are
   installed), bytes, calls that raise (each error checked), and calls to a replicated
   model (with torch).  Then: live handles and lent tensors back at their baseline,
   and RSS at start and end.
2. bad input: random bytes and truncations of a real package to ``load_package``,
   unpicklable arguments and results, calls after ``close()``.
3. shutdown under load: ``--exit-runs`` fresh processes exit (normally, by exception,
   by Ctrl-C) while 16 threads have calls in flight; each must end promptly with its
   exit code.

    multipy run benchmarks/soak.py [--seconds 300] [--threads 64] [--interpreters 4]

The last line printed is the summary as JSON (the test suite runs a short soak).
"""
from __future__ import annotations

import argparse
import gc
import io
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time

import multipy
from multipy._runtime import exports as host_exports

try:
    import torch
except ImportError:
    torch = None
try:
    import numpy
except ImportError:
    numpy = None

WORK = '''
def noop():
    pass

def echo(value):
    return value

def scaled(value, factor):
    return value * factor

def fail(tag):
    raise ValueError(f"injected {tag}")
'''


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


class Figures:
    """Counters shared by the load threads."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.calls = 0
        self.injected = 0
        self.injected_verified = 0
        self.wrong = 0
        self.unexpected: list[str] = []

    def add(self, **counts: int) -> None:
        with self.lock:
            for name, count in counts.items():
                setattr(self, name, getattr(self, name) + count)


def _one_call(manager, model, rng: random.Random, figures: Figures) -> None:
    """One randomly chosen call, checked."""
    kind = rng.randrange(6)
    with manager.acquire_one() as s:
        if kind == 0:
            ok = s.global_("soak_work", "noop")().deref() is None
        elif kind == 1:
            data = rng.randbytes(rng.choice((16, 4096, 1 << 16)))
            ok = s.global_("soak_work", "echo")(data).deref() == data
        elif kind == 2 and torch is not None:
            t = torch.randn(rng.randrange(1, 64), 8)
            ok = torch.equal(s.global_("soak_work", "scaled")(t, 2).deref(), t * 2)
        elif kind == 3 and numpy is not None:
            a = numpy.arange(rng.randrange(1, 500), dtype=numpy.float64)
            back = s.global_("soak_work", "echo")(a[::-1]).deref()
            ok = numpy.array_equal(back, a[::-1])
        elif kind == 4:
            tag = rng.randrange(1 << 30)
            figures.add(injected=1)
            try:
                s.global_("soak_work", "fail")(tag)
                ok = False
            except ValueError as error:
                ok = str(error) == f"injected {tag}"
                figures.add(injected_verified=int(ok))
        elif model is not None:
            replicated, x, expected = model
            ok = torch.allclose(replicated(x), expected)
        else:
            ok = s.global_("soak_work", "scaled")("ab", 3).deref() == "ababab"
    figures.add(calls=1, wrong=int(not ok))


def _load_model(manager, directory):
    if torch is None:
        return None
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
    from generate_examples import generate

    path = generate(directory, ["simple"])["simple"]
    direct = torch.package.PackageImporter(path)
    (x,) = direct.load_pickle("model", "example.pkl")
    return manager.load_package(path).load_pickle("model", "model.pkl"), x, \
        direct.load_pickle("model", "expected.pkl")


def _inside_counts(manager) -> list[tuple[int, int]]:
    counts = []
    for interpreter in manager.all_instances():
        with interpreter.acquire_session() as s:
            stats = s.global_("multipy._inside", "stats")().deref()
            counts.append((stats["objects"], stats["lent"]))
    return counts


def load_phase(manager, seconds: float, threads: int, model) -> dict:
    figures = Figures()
    stop = time.monotonic() + seconds

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        while time.monotonic() < stop:
            try:
                _one_call(manager, model, rng, figures)
            except BaseException as error:  # anything unexpected is a failure, counted
                with figures.lock:
                    figures.unexpected.append(repr(error))

    workers = [threading.Thread(target=worker, args=(seed,), daemon=True) for seed in range(threads)]
    for thread in workers:
        thread.start()
    for thread in workers:
        thread.join(timeout=max(0.0, stop - time.monotonic()) + 60)
    hangs = sum(thread.is_alive() for thread in workers)
    return {"calls": figures.calls, "errors_injected": figures.injected,
            "errors_verified": figures.injected_verified, "lost_or_wrong_results": figures.wrong,
            "unexpected_errors": len(figures.unexpected),
            "unexpected_examples": figures.unexpected[:3], "hangs": hangs}


def bad_input_phase(manager, directory: str, rng: random.Random, rounds: int, model) -> dict:
    """Damaged packages and unpicklable values: each must raise an exception with a
    message, or (a damage the archive does not notice) still give the right result."""
    tried = rejected = survived = wrong = 0
    package = None
    if torch is not None:
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
        from generate_examples import generate

        with open(generate(os.path.join(directory, "bad"), ["simple"])["simple"], "rb") as f:
            package = f.read()
    for _ in range(rounds):
        if package is not None:
            damaged = package[:rng.randrange(len(package))] if rng.random() < 0.5 else \
                bytes(b ^ 0xFF if rng.random() < 0.001 else b for b in package)
        else:
            damaged = rng.randbytes(rng.randrange(1, 4096))
        tried += 1
        try:
            loaded = manager.load_package(io.BytesIO(damaged))
            result = loaded.load_pickle("model", "model.pkl")(model[1] if model else None)
        except Exception as error:
            rejected += int(bool(str(error)))
            wrong += int(not str(error))  # an exception must say what is wrong
        else:
            ok = model is not None and torch.allclose(result, model[2])
            survived += int(ok)
            wrong += int(not ok)
    with manager.acquire_one() as s:
        tried += 2
        try:
            s.global_("soak_work", "echo")(threading.Lock())
        except TypeError:
            rejected += 1
        try:
            s.global_("threading", "Lock")().deref()
        except TypeError:
            rejected += 1
    return {"bad_inputs_tried": tried, "bad_inputs_rejected": rejected,
            "bad_inputs_harmless": survived, "bad_inputs_mishandled": wrong}


EXIT_SNIPPET = '''
import os, signal, sys, threading, time, multipy
how = sys.argv[1]
m = multipy.InterpreterManager(2)
m.register_module_source("busy", "import time\\ndef work(x):\\n    time.sleep(0.005)\\n    return x\\n")
go = threading.Barrier(17)
def loop():
    go.wait()
    while True:
        with m.acquire_one() as s:
            s.global_("busy", "work")(b"x" * 1000).deref()
for _ in range(16):
    threading.Thread(target=loop, daemon=True).start()
go.wait()
time.sleep(0.2)
if how == "exception":
    raise RuntimeError("exit by exception")
if how == "interrupt":
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(30)
sys.exit(3)
'''
EXPECTED_EXIT = {"normal": 3, "exception": 1, "interrupt": -signal.SIGINT}


def exit_phase(runs: int, limit: float) -> dict:
    results = {"exit_runs": 0, "exit_wrong_code": 0, "exit_slow": 0, "exit_slowest_s": 0.0}
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(textwrap.dedent(EXIT_SNIPPET))
    try:
        for run in range(runs):
            how = list(EXPECTED_EXIT)[run % len(EXPECTED_EXIT)]
            start = time.monotonic()
            try:
                done = subprocess.run([sys.executable, "-m", "multipy", "run", f.name, how],
                                      capture_output=True, timeout=limit * 4)
                code = done.returncode
            except subprocess.TimeoutExpired:
                code = None
            took = time.monotonic() - start
            results["exit_runs"] += 1
            results["exit_wrong_code"] += int(code != EXPECTED_EXIT[how])
            results["exit_slow"] += int(took > limit)
            results["exit_slowest_s"] = round(max(results["exit_slowest_s"], took), 2)
    finally:
        os.unlink(f.name)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=300, help="length of the load phase (300)")
    parser.add_argument("--threads", type=int, default=64, help="host threads (64)")
    parser.add_argument("--interpreters", type=int, default=4, help="interpreters (4)")
    parser.add_argument("--bad-inputs", type=int, default=50, help="damaged packages to try (50)")
    parser.add_argument("--exit-runs", type=int, default=30, help="shutdown-under-load runs (30)")
    parser.add_argument("--exit-limit", type=float, default=15, help="seconds an exit may take (15)")
    args = parser.parse_args()
    summary: dict = {}
    with tempfile.TemporaryDirectory() as directory, \
            multipy.InterpreterManager(args.interpreters) as manager:
        manager.register_module_source("soak_work", WORK)
        model = _load_model(manager, directory)
        if model is not None:  # materialised everywhere before the baseline is taken
            for interpreter in manager.all_instances():
                model[0].acquire_session(interpreter).close()
        warm = load_phase(manager, min(2.0, args.seconds), args.threads, model)  # imports, caches
        gc.collect()
        inside_before, lent_before, rss_start = _inside_counts(manager), len(host_exports), rss_mb()
        started = time.monotonic()
        summary.update(load_phase(manager, args.seconds, args.threads, model))
        summary["load_seconds"] = round(time.monotonic() - started, 1)
        gc.collect()
        summary["rss_start_mb"], summary["rss_end_mb"] = round(rss_start, 1), round(rss_mb(), 1)
        inside_after = _inside_counts(manager)
        summary["handles_and_aliases_at_baseline"] = (
            inside_after == inside_before and len(host_exports) == lent_before)
        summary["handles_and_lent_per_interpreter"] = f"{inside_before} -> {inside_after}"
        summary["host_lent"] = f"{lent_before} -> {len(host_exports)}"
        summary["warm_up_calls"] = warm["calls"]
        summary.update(bad_input_phase(manager, directory, random.Random(1), args.bad_inputs, model))
        if model is None:
            summary["note"] = "torch and numpy not installed: tensor, array and model calls skipped"
    summary.update(exit_phase(args.exit_runs, args.exit_limit))
    for key, value in summary.items():
        print(f"{key:34s} {value}")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
