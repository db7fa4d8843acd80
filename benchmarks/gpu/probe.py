"""What the GPU looks like from N interpreters at once: run with ``multipy run``.

Each interpreter imports torch, runs a matrix product on the GPU from a thread of its
own, and reports its CUDA context (cuCtxGetCurrent through its forwarded driver), its
current stream and its torch's device name; the host does the same.  Then the example
ResNet-18 package is loaded with map_location="cuda" and replicated onto 1, then all N
interpreters, without running it.  Prints one JSON object: every context seen, whether
they are one, the weights' bytes, and the device's memory in use (cuMemGetInfo, every
process) at each step.

    multipy run benchmarks/gpu/probe.py [--interpreters 8]
"""
from __future__ import annotations

import argparse
import ctypes
import json
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
'''


def used_mib() -> float:
    import torch

    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return (total - free) / 2**20


def replicas(manager: multipy.InterpreterManager, memory: dict) -> int:
    """Loads the example ResNet-18 onto the GPU in 1, then every interpreter; notes the
    memory in use after each; returns the weights' bytes."""
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
    from generate_examples import generate

    with tempfile.TemporaryDirectory() as folder:
        path = generate(folder, ["resnet"])["resnet"]
        model = manager.load_package(path).load_pickle("model", "model.pkl", map_location="cuda")
        interpreters = manager.all_instances()
        memory["before the replicas"] = used_mib()
        model.instance(interpreters[0])
        memory["1 ResNet-18 replica"] = used_mib()
        for interpreter in interpreters[1:]:
            model.instance(interpreter)
        memory[f"{len(interpreters)} ResNet-18 replicas"] = used_mib()
        weights = torch.package.PackageImporter(path).load_pickle("model", "model.pkl")
        return sum(t.numel() * t.element_size() for t in weights.state_dict().values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--interpreters", type=int, default=8)
    args = parser.parse_args()
    import torch

    torch.ones(1, device="cuda")
    memory = {"host torch": used_mib()}
    host = ctypes.c_void_p()
    ctypes.CDLL("libcuda.so.1").cuCtxGetCurrent(ctypes.byref(host))
    with multipy.InterpreterManager(args.interpreters) as manager:
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
        weights = replicas(manager, memory)
    contexts = {r["context"] for r in reports} | {host.value}
    print(json.dumps({"host_context": host.value, "interpreters": reports,
                      "one_context": len(contexts) == 1, "weights_bytes": weights,
                      "used_mib": memory}, indent=1))


if __name__ == "__main__":
    main()
