"""CUDA across interpreters on a real GPU: one context, a stream per interpreter, CUDA
tensors crossing calls by device pointer in stream order, and weights once on the
device (docs/gpu.md).  Skipped where torch sees no CUDA device; benchmarks/gpu/run.sh
runs them on a GPU machine.
"""
from __future__ import annotations

import ctypes
import http.client
import json
import socket
import subprocess
import sys
import threading
import time

import pytest
from conftest import export

torch = pytest.importorskip("torch")

import multipy  # noqa: E402
from multipy import _cuda  # noqa: E402

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.timeout(180)]

TOOLS = r'''
import ctypes
import torch

def context():
    torch.ones(1, device="cuda")
    current = ctypes.c_void_p()
    ctypes.CDLL("libcuda.so.1").cuCtxGetCurrent(ctypes.byref(current))
    return current.value

def stream():
    torch.ones(1, device="cuda")
    return torch.cuda.current_stream().cuda_stream

def pointer(x):
    return x.data_ptr(), tuple(x.stride())

def same(x):
    return x

def add_one(x):
    x.add_(1)

def busy_then_fill(x, value):
    """Keeps this interpreter's stream busy for a while, then writes x: a reader that
    does not wait for this stream reads x before the write."""
    y = torch.randn(4096, 4096, device=x.device)
    for _ in range(30):
        y = torch.tanh(y @ y)
    x.fill_(value)
    return None

def busy_then_copy(x):
    y = torch.randn(4096, 4096, device=x.device)
    for _ in range(30):
        y = torch.tanh(y @ y)
    return x * 2

kept = []

def keep(x):
    kept.append(x)

def kept_sum():
    return kept.pop().sum().item()

def weight_pointers(model):
    return [p.data_ptr() for p in model.parameters()]

def through_cublaslt(a, w, bias):
    torch.backends.cuda.preferred_blas_library("cublaslt")
    return torch.nn.functional.linear(a, w, bias), a @ w.T

def through_nvrtc(x):
    twice_plus = torch.cuda.jiterator._create_jit_fn(
        "template <typename T> T twice_plus(T x, T y) { return 2 * x + y; }")
    return twice_plus(x, x)
'''


@pytest.fixture(scope="module")
def gpu():
    """Three interpreters with TOOLS; the host's torch has CUDA started."""
    torch.ones(1, device="cuda")
    with multipy.InterpreterManager(3) as manager:
        manager.register_module_source("gpu_tools", TOOLS)
        yield manager


def on(manager, index: int, name: str):
    return manager.all_instances()[index].global_("gpu_tools", name)


def test_the_host_and_every_interpreter_share_one_cuda_context(gpu):
    host = ctypes.c_void_p()
    ctypes.CDLL("libcuda.so.1").cuCtxGetCurrent(ctypes.byref(host))
    contexts = {on(gpu, i, "context")().deref() for i in range(3)}
    assert host.value and contexts == {host.value}


def test_each_interpreter_queues_its_work_on_a_stream_of_its_own(gpu):
    for i in range(3):  # CUDA starts in each: the stream is a thread's from its next call
        on(gpu, i, "context")()
    streams = [on(gpu, i, "stream")().deref() for i in range(3)]
    assert len(set(streams)) == 3 and 0 not in streams
    seen = []  # another host thread calling into interpreter 0 gets its stream too
    thread = threading.Thread(target=lambda: seen.append(on(gpu, 0, "stream")().deref()))
    thread.start()
    thread.join(60)
    assert seen == [streams[0]]


def test_a_cuda_tensor_crosses_a_call_by_device_pointer_both_ways(gpu):
    x = torch.arange(1000, dtype=torch.float32, device="cuda")
    assert on(gpu, 0, "pointer")(x).deref() == (x.data_ptr(), (1,))
    back = on(gpu, 1, "same")(x).deref()
    assert back.is_cuda and back.data_ptr() == x.data_ptr() and torch.equal(back, x)


def test_a_view_crosses_as_the_same_view(gpu):
    base = torch.zeros(10, 12, device="cuda")
    view = base[2:, ::3]
    # the same memory with the same strides (its storage begins where the view does)
    assert on(gpu, 2, "pointer")(view).deref() == (view.data_ptr(), view.stride())
    on(gpu, 2, "add_one")(view)
    expected = torch.zeros(10, 12)
    expected[2:, ::3] = 1
    assert torch.equal(base.cpu(), expected)


def test_what_a_call_writes_into_a_tensor_is_seen_in_order_without_a_reply_tensor(gpu):
    for value in (5.0, 6.0):
        x = torch.zeros(1 << 20, device="cuda")
        on(gpu, 0, "busy_then_fill")(x, value)
        assert x.min().item() == value and x.max().item() == value  # the host's stream waited


def test_a_reply_tensor_is_read_in_order(gpu):
    x = torch.ones(1 << 20, device="cuda")
    doubled = on(gpu, 1, "busy_then_copy")(x).deref()
    assert doubled.min().item() == 2.0 and doubled.max().item() == 2.0


def test_an_alias_keeps_the_memory_after_the_owner_drops_its_tensor(gpu):
    x = torch.full((1 << 16,), 3.0, device="cuda")
    on(gpu, 2, "keep")(x)
    del x
    torch.cuda.synchronize()
    others = [torch.full((1 << 16,), 9.0, device="cuda") for _ in range(64)]  # reuse bait
    torch.cuda.empty_cache()
    assert on(gpu, 2, "kept_sum")().deref() == 3.0 * (1 << 16)
    del others


def test_replicas_loaded_onto_cuda_alias_one_copy_of_the_weights(gpu, tmp_path):
    path = tmp_path / "linear.pt"
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Tanh(),
                                torch.nn.Linear(256, 8)).eval()
    with torch.package.PackageExporter(str(path)) as exporter:
        exporter.extern("torch.**")
        exporter.save_pickle("model", "model.pkl", model)
    x = torch.randn(4, 256, device="cuda")
    expected = model.cuda()(x)
    replicated = gpu.load_package(path).load_pickle("model", "model.pkl", map_location="cuda")
    pointers = [on(gpu, i, "weight_pointers")(replicated.instance(interpreter)).deref()
                for i, interpreter in enumerate(gpu.all_instances())]
    assert pointers[0] == pointers[1] == pointers[2]  # a copy each would differ
    assert torch.allclose(replicated(x), expected, atol=1e-5)


def test_interpreters_run_cublaslt_and_nvrtc_in_the_hosts_one_copy(gpu):
    # cuBLASLt and NVRTC are loaded once, in the host's namespace; each interpreter's
    # dlopen of them gets multipy's forwarders (docs/design.md, "One copy per process").
    a, w, bias = (torch.randn(*shape, device="cuda") for shape in ((64, 128), (32, 128), (32,)))
    results = [None] * 3
    compiled = [None] * 3

    def run(i: int) -> None:
        results[i] = on(gpu, i, "through_cublaslt")(a, w, bias).deref()
        compiled[i] = on(gpu, i, "through_nvrtc")(a).deref()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    for linear, product in results:
        assert torch.allclose(linear, torch.nn.functional.linear(a, w, bias), rtol=1e-3, atol=1e-3)
        assert torch.allclose(product, a @ w.T, rtol=1e-3, atol=1e-3)
    for result in compiled:  # a jiterator kernel, compiled by NVRTC inside
        assert torch.allclose(result, 3 * a)
    forwarded = [library for library, _ in _cuda.forwarded_libraries()]
    if not forwarded:
        pytest.skip("the installed CUDA libraries export names the forwarders lack")
    copies = [line.split()[-1] for line in open("/proc/self/maps")
              if line.split()[-1] in forwarded and int(line.split()[2], 16) == 0]
    assert sorted(copies) == sorted(set(copies))  # one copy of each


SERVED = """
import torch


class Weights(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 3)

    def forward(self, x):
        weight = self.linear.weight
        return (self.linear(x), torch.tensor([weight.data_ptr()]),
                torch.tensor([weight.is_cuda, x.is_cuda]), torch.tensor([id(torch)]))
"""


def test_serve_copies_an_archives_weights_to_the_device_once(tmp_path):
    # multipy serve --device cuda: the host copies the weights to the GPU once (through the
    # driver), every interpreter's model aliases them, inputs go there and outputs back.
    pytest.importorskip("uvicorn")
    path = export(tmp_path, "gpu_served", SERVED, lambda module: module.Weights(), "weights.pt")
    expected = torch.package.PackageImporter(path).load_pickle("model", "model.pkl")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "multipy", "serve", path, "--device", "cuda",
                               "--interpreters", "3", "--port", str(port)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 150
        while True:
            assert server.poll() is None, server.stdout.read()
            assert time.monotonic() < deadline, "the server was not ready"
            try:
                ready = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
                ready.request("GET", "/v2/health/ready")
                if ready.getresponse().status == 200:
                    break
            except OSError:
                pass
            time.sleep(0.2)
        # Three connections open at once: each goes to an interpreter of its own.
        connections = [http.client.HTTPConnection("127.0.0.1", port, timeout=60) for _ in range(3)]
        for connection in connections:
            connection.connect()
        x = [[1.0, 2.0, 3.0, 4.0]]
        answers = []
        for connection in connections:
            connection.request("POST", "/v2/models/weights/infer", json.dumps({"inputs": [
                {"name": "x", "shape": [1, 4], "datatype": "FP32", "data": x[0]}]}),
                {"Content-Type": "application/json"})
            response = connection.getresponse()
            assert response.status == 200
            answers.append({o["name"]: o["data"] for o in json.loads(response.read())["outputs"]})
        with torch.no_grad():
            wanted = expected(torch.tensor(x))[0].flatten().tolist()
        for answer in answers:
            assert answer["output0"] == pytest.approx(wanted, rel=1e-5)
            assert answer["output2"] == [True, True]
        assert len({answer["output3"][0] for answer in answers}) == 3  # three interpreters
        assert len({answer["output1"][0] for answer in answers}) == 1  # one copy of the weights
    finally:
        server.kill()
        server.wait(30)
