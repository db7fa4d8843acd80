"""Shared weights and zero-copy tensors, measured in one run.

1. Process RSS as a model with W bytes of weights (ResNet-18) is materialised on 1,
   2 and 4 interpreters: the growth from 1 to 4 stays far below W, because every
   interpreter aliases the same storages.
2. Time to pass a 1 KB and a 256 MB tensor through a call and back (median): the
   tensors are aliased, not copied, so the two are close.

    multipy run benchmarks/sharing.py
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch

import multipy

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from generate_examples import generate  # noqa: E402


def rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def weights_memory(manager: multipy.InterpreterManager, path: str) -> None:
    for interpreter in manager.all_instances():  # torch imported everywhere first
        with interpreter.acquire_session() as s:
            s.global_("torch.package", "PackageImporter")
    package = manager.load_package(path)
    before_read = rss()
    weights = sum(t.nbytes for t in package._shared_storages().values())
    host_copy = rss() - before_read
    replicated = package.load_pickle("model", "model.pkl")
    x = torch.randn(1, 3, 64, 64)
    start = rss()
    figures = []
    for count in (1, 2, 4):
        for interpreter in manager.all_instances()[:count]:
            with replicated.acquire_session(interpreter):
                pass  # materialised (once) by acquiring a session on it
        figures.append((count, rss() - start))
    assert torch.allclose(replicated(x), replicated(x))  # and it runs
    mb = 1 << 20
    print(f"ResNet-18 weights W = {weights / mb:.1f} MB, read once into the host: "
          f"RSS +{host_copy / mb:.1f} MB")
    for count, growth in figures:
        print(f"  materialised on {count} interpreter(s): RSS growth {growth / mb:7.1f} MB")
    one_to_four = figures[-1][1] - figures[0][1]
    print(f"  growth from 1 to 4 interpreters: {one_to_four / mb:.1f} MB = "
          f"{one_to_four / weights:.2f} W (copies would add {3 * weights / mb:.0f} MB = 3 W)")


def transfer(manager: multipy.InterpreterManager, calls: int) -> None:
    manager.register_module_source("bench_echo", "def echo(t):\n    return t\n")
    with manager.acquire_one() as s:
        echo = s.global_("bench_echo", "echo")
        medians = {}
        for label, numel in (("1 KB", 256), ("256 MB", 64 << 20)):
            tensor = torch.ones(numel)
            samples = []
            for _ in range(calls):
                begin = time.perf_counter()
                back = echo(tensor).deref()
                samples.append(time.perf_counter() - begin)
                assert back.data_ptr() == tensor.data_ptr()
                del back
            medians[label] = statistics.median(samples)
    print(f"tensor through a call and back (echo, then deref), median of {calls}")
    for label, seconds in medians.items():
        print(f"  {label:>6}: {seconds * 1e6:8.1f} us")
    print(f"  ratio 256 MB / 1 KB: {medians['256 MB'] / medians['1 KB']:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=200, help="calls per tensor size (200)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory, multipy.InterpreterManager(4) as manager:
        weights_memory(manager, generate(directory)["resnet"])
        transfer(manager, args.calls)


if __name__ == "__main__":
    main()
