"""What the GPU looks like from N interpreters at once: run with ``multipy run``.

Each interpreter imports torch, runs a matrix product on the GPU from a thread of its
own, and reports its CUDA context (cuCtxGetCurrent through its forwarded driver), its
current stream and its torch's device name; the host does the same.  Then the example
ResNet-18 package is loaded with map_location="cuda" and replicated onto 1, then all N
interpreters, without running it, and then run once at batch 8 in each.  Prints one
JSON object: every context seen, whether they are one, the weights' bytes, and the
device's memory in use (nvidia-smi's memory.used, every process) at each step; and how
many tiny kernels 1, then N interpreters launch a second at once (one context).

With --processes N instead (plain python, no interpreters): N worker processes each load
the same ResNet-18 onto the GPU and run it once at batch 8, as N process servers' workers
would; prints the device's memory in use before and while they all hold it, and how
many tiny kernels 1, then N processes launch a second at once (a context each).

    multipy run benchmarks/gpu/probe.py [--interpreters 8]
    python benchmarks/gpu/probe.py --processes 8
"""
from __future__ import annotations

import argparse
import ctypes
import json
import multiprocessing
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import multipy

INSIDE = r'''
import ctypes
import torch

def report(size):
    x = torch.randn(size, size, device="cuda")
    y = (x @ x).sum().item()
    cuda = ctypes.CDLL("libcuda.so.1")
    context = ctypes.c_void_p()
    failed = cuda.cuCtxGetCurrent(ctypes.byref(context))
    return {"context": context.value, "failed": failed, "finite": y == y,
            "stream": torch.cuda.current_stream().cuda_stream,
            "device": torch.cuda.get_device_name(), "torch": torch.__version__}

def launches(seconds):
    """Tiny kernels launched, one after another, for seconds: how many."""
    import time
    x = torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    count, end = 0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(100):
            x.add_(1)
        count += 100
    torch.cuda.synchronize()
    return count
'''


def used_mib() -> float:
    """The device's memory in use, by every process (nvidia-smi: no CUDA context here)."""
    out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, check=True).stdout
    return float(out.split()[0])


def resnet_package(folder: str) -> str:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
    from generate_examples import generate

    return generate(folder, ["resnet"])["resnet"]


def _worker(path: str, ready, done) -> None:
    import torch

    model = torch.package.PackageImporter(path).load_pickle("model", "model.pkl",
                                                            map_location="cuda")
    with torch.no_grad():
        model(torch.randn(8, 3, 64, 64, device="cuda"))
    torch.cuda.synchronize()
    ready.release()
    done.wait()


def _launching(seconds: float, start, results) -> None:
    """A worker process of process_launches: CUDA started, then launches() timed."""
    probe: dict = {}
    exec(INSIDE, probe)
    probe["torch"].ones(1, device="cuda")
    start.wait(timeout=120)
    results.put(probe["launches"](seconds))


def process_launches(count: int, seconds: float = 3.0) -> float:
    """Tiny-kernel launches per second of count processes at once, each its own context."""
    context = multiprocessing.get_context("spawn")
    start, results = context.Barrier(count), context.Queue()
    workers = [context.Process(target=_launching, args=(seconds, start, results))
               for _ in range(count)]
    for worker in workers:
        worker.start()
    total = sum(results.get(timeout=300) for _ in workers)
    for worker in workers:
        worker.join(60)
    return total / seconds


def interpreter_launches(manager: multipy.InterpreterManager, count: int,
                         seconds: float = 3.0) -> float:
    """Tiny-kernel launches per second of count interpreters at once, one context."""
    totals = [0] * count

    def run(i: int) -> None:
        totals[i] = manager.all_instances()[i].global_("gpu_probe", "launches")(seconds).deref()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return sum(totals) / seconds


def processes(count: int) -> dict:
    """count worker processes holding ResNet-18 on the GPU, run once at batch 8."""
    memory = {"before": used_mib()}
    context = multiprocessing.get_context("spawn")
    ready, done = context.Semaphore(0), context.Event()
    with tempfile.TemporaryDirectory() as folder:
        path = resnet_package(folder)
        workers = [context.Process(target=_worker, args=(path, ready, done)) for _ in range(count)]
        for worker in workers:
            worker.start()
        for _ in workers:
            ready.acquire(timeout=120)
        memory[f"{count} processes holding ResNet-18, run at batch 8"] = used_mib()
        done.set()
        for worker in workers:
            worker.join(60)
    return memory


def replicas(manager: multipy.InterpreterManager, memory: dict) -> int:
    """Loads the example ResNet-18 onto the GPU in 1, then every interpreter; notes the
    memory in use after each; returns the weights' bytes."""
    import torch

    with tempfile.TemporaryDirectory() as folder:
        path = resnet_package(folder)
        model = manager.load_package(path).load_pickle("model", "model.pkl", map_location="cuda")
        interpreters = manager.all_instances()
        memory["before the replicas"] = used_mib()
        model.instance(interpreters[0])
        memory["1 ResNet-18 replica"] = used_mib()
        for interpreter in interpreters[1:]:
            model.instance(interpreter)
        memory[f"{len(interpreters)} ResNet-18 replicas"] = used_mib()
        x = torch.randn(8, 3, 64, 64, device="cuda")
        for interpreter in interpreters:
            model.instance(interpreter)(x)
        torch.cuda.synchronize()
        memory[f"{len(interpreters)} replicas run at batch 8"] = used_mib()
        weights = torch.package.PackageImporter(path).load_pickle("model", "model.pkl")
        return sum(t.numel() * t.element_size() for t in weights.state_dict().values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--interpreters", type=int, default=8)
    parser.add_argument("--processes", type=int, default=0)
    args = parser.parse_args()
    if args.processes:
        print(json.dumps({"used_mib": processes(args.processes),
                          "launches_per_second": {
                              f"{n} processes": process_launches(n)
                              for n in (1, args.processes)}}, indent=1))
        return
    import torch

    torch.ones(1, device="cuda")
    memory = {"host torch": used_mib()}
    host = ctypes.c_void_p()
    ctypes.CDLL("libcuda.so.1").cuCtxGetCurrent(ctypes.byref(host))
    with multipy.InterpreterManager(args.interpreters, grad_enabled=False) as manager:
        manager.register_module_source("gpu_probe", INSIDE)
        reports: list = [None] * args.interpreters

        def run(i: int) -> None:
            with manager.all_instances()[i].acquire_session() as session:
                reports[i] = session.global_("gpu_probe", "report")(256).deref()

        threads = [threading.Thread(target=run, args=(i,)) for i in range(args.interpreters)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        memory[f"{args.interpreters} interpreters with torch"] = used_mib()
        launches = {f"{n} interpreters": interpreter_launches(manager, n)
                    for n in (1, args.interpreters)}
        weights = replicas(manager, memory)
    contexts = {r["context"] for r in reports} | {host.value}
    print(json.dumps({"host_context": host.value, "interpreters": reports,
                      "one_context": len(contexts) == 1, "weights_bytes": weights,
                      "launches_per_second": launches,
                      "used_mib": memory}, indent=1))


if __name__ == "__main__":
    main()
