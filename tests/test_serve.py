"""`multipy serve`: the Open Inference Protocol over HTTP and gRPC, checked with tritonclient.http and tritonclient.grpc
against servers running in subprocesses on free ports of 127.0.0.1.

Four servers serve the whole module: ``served`` (2 interpreters, --timeout 5, no
batching: one event loop), ``batching`` (1 interpreter, --max-batch-size 8: one loop),
``per_loop`` (2 interpreters, neither: a loop per interpreter) and ``large`` (1
interpreter, with gRPC: requests of millions of elements).  The last tests stop
``per_loop`` and ``served`` with SIGTERM while requests run.
"""
from __future__ import annotations

import asyncio
import contextlib
import errno
import gzip
import http.client
import importlib.util
import json
import logging
import os
import re
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import pytest

from conftest import export, until, write_one

torch = pytest.importorskip("torch")
np = pytest.importorskip("numpy")
for _module in ("uvicorn", "starlette", "prometheus_client"):
    pytest.importorskip(_module)
httpclient = pytest.importorskip("tritonclient.http")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402

import multipy  # noqa: E402

ml_dtypes = pytest.importorskip("ml_dtypes")  # tritonclient's BF16 arrays

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "examples")

MODELS = '''
import time

import numpy as np
import torch
from torch import nn


class Cast(nn.Module):
    """The input as it arrived, and its values as float64 (so BF16 is read as BF16)."""

    def forward(self, x):
        return {"same": x, "as_fp64": x.to(torch.float64)}


class Pair(nn.Module):
    def forward(self, a, b):
        return a - b


class Fails(nn.Module):
    def forward(self, x):
        if bool((x < 0).any()):
            raise ValueError("negative input")
        return x


RUNNING = 0  # calls of Slow running in this interpreter
ENDED = 0  # calls of Slow that ran to their end in this interpreter


class Slow(nn.Module):
    """Takes seconds[0] seconds, in Python (so that a cancel stops it at once); says how
    many calls of it ran in this interpreter at once, at most, while it ran, and how many
    ran to their end there before it."""

    def forward(self, seconds):
        global RUNNING, ENDED
        RUNNING += 1
        try:
            peak = RUNNING
            deadline = time.monotonic() + float(seconds.reshape(-1)[0])
            while time.monotonic() < deadline:
                time.sleep(0.005)
                peak = max(peak, RUNNING)
        finally:
            RUNNING -= 1
        ENDED += 1
        return {"doubled": seconds * 2, "together": torch.tensor([peak]),
                "ended": torch.tensor([ENDED - 1])}


class Exits(nn.Module):
    """Raises SystemExit for a negative input; else says which thread runs it: its
    interpreter's loop, or with --timeout its worker."""

    def forward(self, x):
        import threading
        if bool((x < 0).any()):
            raise SystemExit("asked to")
        return torch.tensor([threading.get_native_id()])


class Blocks(nn.Module):
    """Blocks in C, opening the FIFO whose path its input holds (as UINT8), until a
    writer opens it: a call that a cancel cannot stop."""

    def forward(self, path):
        with open(bytes(path.tolist()).decode(), "rb") as fifo:
            fifo.read(1)
        return path


class Crashes(nn.Module):
    """Writes to address 16: a segmentation fault."""

    def forward(self, x):
        import ctypes
        ctypes.memset(16, 0, 1)
        return x


class Where(nn.Module):
    """Where it runs: the process's id and this interpreter's torch module's address."""

    def forward(self, x):
        import os
        return torch.tensor([os.getpid(), id(torch)], dtype=torch.int64)


class Thread(nn.Module):
    """Says which host thread runs it: the one that entered the interpreter."""

    def forward(self, x):
        import threading
        return torch.tensor([threading.get_native_id()])


class Rows(nn.Module):
    """Row i of the output depends on row i of the input only: batches split back."""

    def forward(self, x):
        return x * 2 + x.sum(dim=1, keepdim=True)


class Total(nn.Module):
    """One number for the whole input: a batch of it cannot be split back."""

    def forward(self, x):
        return x.sum()


class Scratch(nn.Module):
    """Writes its input, through dropout, into a buffer and returns the buffer: state
    that forward changes, and an output over it."""

    def __init__(self):
        super().__init__()
        self.register_buffer("last", torch.zeros(2, 4))
        self.drop = nn.Dropout(0.9)

    def forward(self, x):
        self.last.copy_(self.drop(x))
        return self.last


class Wrapped:
    """Not a module, holding one, pickled in training mode."""

    def __init__(self):
        self.net = Scratch()

    def __call__(self, x):
        return self.net(x)


class Shape(nn.Module):
    """The input's shape, reading none of its elements: for requests of millions."""

    def forward(self, x):
        return torch.tensor(x.shape, dtype=torch.int64)


class Text(nn.Module):
    """BYTES in (a numpy array of bytes, of at least one dimension) and out: its strings
    upper-cased, as str ("upper"); their lengths in bytes, as a tensor ("lengths"); the
    input itself ("same"); and each row's strings joined by spaces, as a list of bytes
    ("joined")."""

    def forward(self, text):
        upper = np.vectorize(lambda s: s.decode(errors="replace").upper(), otypes=[object])
        lengths = torch.tensor([len(s) for s in text.reshape(-1)], dtype=torch.int64)
        return {"upper": upper(text), "lengths": lengths.reshape(text.shape), "same": text,
                "joined": [b" ".join(row) for row in text.reshape(len(text), -1)]}
'''

#: What the host of a server imports only to serve an inference request itself, or
#: never: torch (the interpreters' alone), numpy (decoding a request's tensors), uvicorn's
#: command line (click, watchfiles), rich (the progress bar, on a terminal only).
HOST_NEVER_IMPORTS = ("torch", "numpy", "click", "watchfiles", "rich", "websockets")

#: The wrapper a server runs as: `multipy serve`'s own entry (the launcher runs the
#: module the same way), and, at exit, which of HOST_NEVER_IMPORTS the host process had
#: imported.
WRAPPER = f'''
import atexit, json, os, runpy, sys

def report():
    with open(os.environ["SERVE_TEST_REPORT"], "w") as f:
        json.dump({{name: name in sys.modules for name in {HOST_NEVER_IMPORTS!r}}}, f)

atexit.register(report)
sys.argv[0] = "multipy serve"
runpy.run_module("multipy.serve", run_name="__main__")
'''

DATATYPES = ["BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64",
             "FP16", "BF16", "FP32", "FP64"]


@pytest.fixture(scope="module")
def packages(tmp_path_factory):
    """name -> path of each test model's torch.package archive, and python_heavy."""
    folder = tmp_path_factory.mktemp("serve_models")
    (folder / "serve_test_models.py").write_text(MODELS)
    spec = importlib.util.spec_from_file_location("serve_test_models",
                                                  folder / "serve_test_models.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["serve_test_models"] = module
    try:
        spec.loader.exec_module(module)
        paths = {}
        examples = {"pair": (torch.ones(2, 3), torch.zeros(2, 3)),
                    "text": (np.array([b"hello", "w\u00f6rld".encode()], dtype=object),)}
        for name in ("Cast", "Pair", "Fails", "Slow", "Exits", "Blocks", "Crashes", "Where",
                     "Thread", "Rows", "Total", "Wrapped", "Shape", "Text"):
            path = folder / f"{name.lower()}.pt"
            with torch.package.PackageExporter(str(path)) as exporter:
                exporter.extern(["torch.**", "numpy.**"])
                exporter.intern("serve_test_models")
                exporter.save_pickle("model", "model.pkl", getattr(module, name)())
                if name.lower() in examples:
                    exporter.save_pickle("model", "example.pkl", examples[name.lower()])
            paths[name.lower()] = str(path)
    finally:
        del sys.modules["serve_test_models"]
    generate = importlib.util.spec_from_file_location(
        "generate_examples", os.path.join(EXAMPLES, "generate_examples.py"))
    generator = importlib.util.module_from_spec(generate)
    generate.loader.exec_module(generator)
    paths.update(generator.generate(str(folder), ["python_heavy"]))
    return paths


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class Server:
    process: subprocess.Popen
    port: int
    log: str
    report: str

    @property
    def url(self) -> str:
        return f"127.0.0.1:{self.port}"

    def output(self) -> str:
        with open(self.log) as f:
            return f.read()

    def client(self) -> httpclient.InferenceServerClient:
        return httpclient.InferenceServerClient(self.url, network_timeout=60)


def _start(tmp_path, paths: list[str], *options: str) -> Server:
    """A server on a free port, ready (every model on every interpreter), its ready line
    logged (just after it is ready)."""
    wrapper = tmp_path / "serve_wrapper.py"
    wrapper.write_text(WRAPPER)
    port = _free_port()
    log = str(tmp_path / "server.log")
    report = str(tmp_path / "report.json")
    env = {**{k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"},
           "PYTHONUNBUFFERED": "1", "SERVE_TEST_REPORT": report}
    with open(log, "w") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "multipy", "run", str(wrapper), *paths, "--port", str(port),
             *options], stdout=out, stderr=subprocess.STDOUT, env=env)
    server = Server(process, port, log, report)
    deadline = time.monotonic() + 110
    while True:
        assert process.poll() is None, f"the server exited:\n{server.output()}"
        assert time.monotonic() < deadline, f"the server was not ready:\n{server.output()}"
        try:
            if _request(server, "GET", "/v2/health/ready")[0] == 200 and \
                    "ready in" in server.output():
                return server
        except OSError:
            pass  # not listening yet
        time.sleep(0.1)


def _stop(server: Server) -> None:
    if server.process.poll() is None:
        server.process.kill()
    server.process.wait(timeout=30)


@pytest.fixture(scope="module")
def served(packages, tmp_path_factory):
    names = ["python_heavy", "cast", "pair", "fails", "slow", "exits", "blocks", "text"]
    server = _start(tmp_path_factory.mktemp("served"), [packages[n] for n in names],
                    "--interpreters", "2", "--timeout", "5", "--grpc-port", "0")
    try:
        yield server
    finally:
        _stop(server)


@pytest.fixture(scope="module")
def batching(packages, tmp_path_factory):
    server = _start(tmp_path_factory.mktemp("batching"),
                    [packages["rows"], packages["total"], packages["text"]],
                    "--interpreters", "1", "--max-batch-size", "8", "--batch-timeout-ms", "500")
    try:
        yield server
    finally:
        _stop(server)


@pytest.fixture(scope="module")
def per_loop(packages, tmp_path_factory):
    server = _start(tmp_path_factory.mktemp("per_loop"),
                    [packages[n] for n in ("thread", "slow", "exits", "blocks")],
                    "--interpreters", "2")
    try:
        yield server
    finally:
        _stop(server)


@pytest.fixture(scope="module")
def large(packages, tmp_path_factory):
    server = _start(tmp_path_factory.mktemp("large"), [packages["shape"], packages["text"]],
                    "--interpreters", "1", "--grpc-port", "0")
    try:
        yield server
    finally:
        _stop(server)


def _request(server: Server, method: str, path: str, body: bytes | None = None,
             headers: dict | None = None) -> tuple[int, dict, bytes]:
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    try:
        connection.request(method, path, body=body, headers=headers or {})
        response = connection.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        connection.close()


def _infer_json(server: Server, model: str, request: dict, headers: dict | None = None):
    status, answer_headers, body = _request(server, "POST", f"/v2/models/{model}/infer",
                                            json.dumps(request).encode(), headers)
    return status, json.loads(body)


def _infer_together(server: Server, model: str, requests: list[dict]) -> list[tuple]:
    """_infer_json's (status, answer) of each of requests, sent at once (a thread each),
    in their order."""
    answers: list[tuple | None] = [None] * len(requests)

    def send(k: int) -> None:
        answers[k] = _infer_json(server, model, requests[k])

    threads = [threading.Thread(target=send, args=(k,)) for k in range(len(requests))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert None not in answers, "a request was not answered within 60 s"
    return answers


def _metrics(server: Server) -> dict[tuple[str, tuple], float]:
    """(sample name, sorted labels) -> value of every sample at /metrics."""
    status, _, body = _request(server, "GET", "/metrics")
    assert status == 200
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(body.decode())
            for sample in family.samples}


def _input(name: str, array: np.ndarray, datatype: str, binary: bool) -> httpclient.InferInput:
    tensor = httpclient.InferInput(name, list(array.shape), datatype)
    tensor.set_data_from_numpy(array, binary_data=binary)
    return tensor


def _eager(path: str):
    importer = torch.package.PackageImporter(path)
    return importer.load_pickle("model", "model.pkl")


# -- health and metadata --

def test_a_websocket_upgrade_is_answered_over_http(served):
    """multipy serve speaks no WebSocket (the host and the front ends do not import
    it): a request asking to upgrade is answered as any other, and the log says so."""
    status, _, body = _request(served, "GET", "/v2/health/live", headers={
        "Connection": "Upgrade", "Upgrade": "websocket", "Sec-WebSocket-Version": "13",
        "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ=="})
    assert status == 200 and body == b""
    until(lambda: "speaks no WebSocket" in served.output())


def test_health_and_server_metadata(served):
    client = served.client()
    assert client.is_server_live() and client.is_server_ready()
    for model in ("python_heavy", "cast", "pair", "fails", "slow"):
        assert client.is_model_ready(model)
        assert client.is_model_ready(model, "1")
    assert not client.is_model_ready("nope")
    metadata = client.get_server_metadata()
    assert metadata["name"] == "multipy" and "binary_tensor_data" in metadata["extensions"]
    status, _, body = _request(served, "GET", "/v2/models/nope/ready")
    assert status == 404 and "nope" in json.loads(body)["error"]
    assert _request(served, "GET", "/v2/health/live")[:3:2] == (200, b"")


def test_requests_are_checked_against_declared_inputs(served):
    """python_heavy declares x, FP32, [-1, -1, 16] (its config.json): an input of another
    name, datatype or shape, or none, is a 400 saying which and what was expected, before
    the model runs; a model that declares nothing (cast) takes any input as before."""
    def infer(model: str, inputs: list[dict]) -> tuple[int, dict]:
        return _infer_json(served, model, {"inputs": inputs})

    x = {"name": "x", "datatype": "FP32", "shape": [1, 1, 16], "data": list(range(16))}
    status, answer = infer("python_heavy", [x])
    assert status == 200 and answer["outputs"][0]["shape"] == [1, 16], answer
    cases = [
        ([{**x, "shape": [16]}],
         "model 'python_heavy': input 'x' has shape [16], not [-1, -1, 16] (-1: any size)"),
        ([{**x, "shape": [1, 2, 8]}],
         "model 'python_heavy': input 'x' has shape [1, 2, 8], not [-1, -1, 16] (-1: any size)"),
        ([{**x, "datatype": "FP64"}], "model 'python_heavy': input 'x' is FP64, not FP32"),
        ([{**x, "name": "y"}], "model 'python_heavy' has no input 'y'; its inputs are 'x'"),
    ]
    before = _metrics(served)[("multipy_model_calls_total", (("model", "python_heavy"),))]
    for inputs, message in cases:
        assert infer("python_heavy", inputs) == (400, {"error": message}), inputs
    after = _metrics(served)[("multipy_model_calls_total", (("model", "python_heavy"),))]
    assert after == before  # none reached the model
    status, answer = infer("cast", [{**x, "name": "anything", "shape": [16]}])
    assert status == 200 and answer["outputs"][0]["shape"] == [16]


def test_model_metadata_names_inputs_after_forward(served):
    client = served.client()
    heavy = client.get_model_metadata("python_heavy")
    assert heavy["name"] == "python_heavy" and heavy["versions"] == ["1"]
    assert heavy["inputs"] == [{"name": "x", "datatype": "FP32", "shape": [-1, -1, 16]}]
    assert heavy["outputs"] == [{"name": "output0", "datatype": "FP32", "shape": [-1, 16]}]
    pair = client.get_model_metadata("pair", "1")
    assert [(i["name"], i["datatype"], i["shape"]) for i in pair["inputs"]] == \
        [("a", "FP32", [-1, 3]), ("b", "FP32", [-1, 3])]
    cast = client.get_model_metadata("cast")  # no example in the archive
    assert cast["inputs"] == [{"name": "x", "datatype": "FP32", "shape": [-1]}]
    with pytest.raises(InferenceServerException) as unknown:
        client.get_model_metadata("nope")
    assert unknown.value.status() == "404"
    with pytest.raises(InferenceServerException) as version:
        client.get_model_metadata("pair", "7")
    assert version.value.status() == "404"


# -- inference --

def test_concurrent_inferences_match_eager(served, packages):
    model = _eager(packages["python_heavy"])
    errors, checked = [], []

    def client_thread(index: int) -> None:
        try:
            client = served.client()
            generator = np.random.default_rng(index)
            for request in range(4):
                x = generator.standard_normal((1 + (index + request) % 3, 48, 16), np.float32)
                binary = (index + request) % 2 == 0
                result = client.infer("python_heavy", [_input("x", x, "FP32", binary)],
                                      outputs=[httpclient.InferRequestedOutput("output0",
                                                                               binary_data=binary)])
                with torch.no_grad():
                    expected = model(torch.from_numpy(x)).numpy()
                actual = result.as_numpy("output0")
                assert actual.shape == expected.shape and actual.dtype == np.float32
                np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-6)
                checked.append(binary)
        except BaseException as error:  # reported below
            errors.append(error)

    threads = [threading.Thread(target=client_thread, args=(i,)) for i in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=90)
    assert not errors, errors[0]
    assert sorted(checked) == [False] * 12 + [True] * 12


def _values(datatype: str) -> np.ndarray:
    if datatype == "BOOL":
        return np.array([[True, False, True], [False, False, True]])
    if datatype == "BF16":
        return np.array([[1.5, -2.25, 0.0], [3.0, 256.0, -0.125]], dtype=ml_dtypes.bfloat16)
    dtype = np.dtype({"FP16": "float16", "FP32": "float32", "FP64": "float64"}.get(
        datatype, datatype.lower()))
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return np.array([[info.min, 0, 1], [2, info.max - 1, info.max]], dtype)
    return np.array([[0.5, -2.0, 65504.0], [1e-3, 0.0, -7.25]], dtype)


@pytest.mark.parametrize("datatype", DATATYPES)
def test_every_datatype_in_json_and_binary(served, datatype):
    x = _values(datatype)
    client = served.client()
    for binary in (True, False):
        if datatype == "BF16" and not binary:
            continue  # tritonclient sends BF16 as binary only: JSON is checked below
        result = client.infer("cast", [_input("x", x, datatype, binary)], outputs=[
            httpclient.InferRequestedOutput("same", binary_data=binary),
            httpclient.InferRequestedOutput("as_fp64", binary_data=binary)])
        outputs = {o["name"]: o for o in result.get_response()["outputs"]}
        assert outputs["same"]["datatype"] == datatype and outputs["same"]["shape"] == [2, 3]
        assert outputs["as_fp64"]["datatype"] == "FP64"
        same = result.as_numpy("same")
        assert same.dtype == x.dtype and np.array_equal(same, x), (binary, same)
        np.testing.assert_array_equal(result.as_numpy("as_fp64"), x.astype(np.float64))
    if datatype == "BF16":  # JSON numbers, rounded to BF16 on the way in
        request = {"inputs": [{"name": "x", "shape": [2, 3], "datatype": "BF16",
                               "data": [[1.5, -2.25, 0.0], [3.0, 256.0, -0.1251]]}]}
        status, answer = _infer_json(served, "cast", request)
        assert status == 200, answer
        outputs = {o["name"]: o for o in answer["outputs"]}
        assert outputs["same"]["datatype"] == "BF16"
        assert outputs["same"]["data"] == [1.5, -2.25, 0.0, 3.0, 256.0, -0.125]
        assert outputs["as_fp64"]["data"] == [1.5, -2.25, 0.0, 3.0, 256.0, -0.125]


def test_inputs_map_by_name_else_by_position(served):
    client = served.client()
    a = np.full((2, 3), 10, np.float32)
    b = np.ones((2, 3), np.float32)
    by_name = client.infer("pair", [_input("b", b, "FP32", True), _input("a", a, "FP32", True)])
    np.testing.assert_array_equal(by_name.as_numpy("output0"), a - b)
    by_position = client.infer("pair", [_input("first", b, "FP32", False),
                                        _input("second", a, "FP32", False)])
    np.testing.assert_array_equal(by_position.as_numpy("output0"), b - a)


def test_requested_outputs_select_among_the_model_outputs(served):
    client = served.client()
    x = np.arange(6, dtype=np.int32).reshape(2, 3)
    everything = client.infer("cast", [_input("x", x, "INT32", True)])
    assert sorted(o["name"] for o in everything.get_response()["outputs"]) == ["as_fp64", "same"]
    one = client.infer("cast", [_input("x", x, "INT32", True)],
                       outputs=[httpclient.InferRequestedOutput("as_fp64", binary_data=False)])
    assert [o["name"] for o in one.get_response()["outputs"]] == ["as_fp64"]
    assert one.get_response()["outputs"][0]["data"] == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    with pytest.raises(InferenceServerException) as missing:
        client.infer("cast", [_input("x", x, "INT32", True)],
                     outputs=[httpclient.InferRequestedOutput("nope")])
    assert missing.value.status() == "400" and "nope" in missing.value.message()


def test_compression_and_json_whatever_the_content_type(served):
    client = served.client()
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    for algorithm in ("gzip", "deflate"):
        result = client.infer("cast", [_input("x", x, "FP32", True)],
                              request_compression_algorithm=algorithm,
                              response_compression_algorithm=algorithm)
        np.testing.assert_array_equal(result.as_numpy("same"), x)
    request = {"inputs": [{"name": "x", "shape": [3], "datatype": "INT64", "data": [1, 2, 3]}]}
    status, answer = _infer_json(served, "cast", request,
                                 {"Content-Type": "application/octet-stream"})
    assert status == 200 and answer["outputs"][0]["data"] == [1, 2, 3]
    status, _, body = _request(served, "POST", "/v2/models/cast/infer",
                               gzip.compress(json.dumps(request).encode()),
                               {"Content-Encoding": "gzip"})
    assert status == 200, body


# -- BYTES --

#: Text for the Text model: UTF-8 beyond ASCII, an empty string, and a space.
TEXT = np.array([[b"hello", "w\u00f6rld".encode()], [b"", b"a b"]], dtype=object)


def _as_bytes(array: np.ndarray) -> list:
    """The elements of a BYTES array from tritonclient, row-major, as bytes (it gives
    bytes for binary data, str for JSON)."""
    return [v if isinstance(v, bytes) else v.encode() for v in array.reshape(-1)]


def test_bytes_in_and_out_in_json_and_binary(served):
    client = served.client()
    names = ["upper", "lengths", "same", "joined"]
    for binary_in in (True, False):
        for binary_out in (True, False):
            result = client.infer("text", [_input("text", TEXT, "BYTES", binary_in)], outputs=[
                httpclient.InferRequestedOutput(name, binary_data=binary_out) for name in names])
            outputs = {o["name"]: o for o in result.get_response()["outputs"]}
            assert [(outputs[n]["datatype"], outputs[n]["shape"]) for n in names] == [
                ("BYTES", [2, 2]), ("INT64", [2, 2]), ("BYTES", [2, 2]), ("BYTES", [2])]
            assert ("data" in outputs["upper"]) is not binary_out
            assert _as_bytes(result.as_numpy("upper")) == [
                b"HELLO", "W\u00d6RLD".encode(), b"", b"A B"]
            np.testing.assert_array_equal(result.as_numpy("lengths"), [[5, 6], [0, 3]])
            assert _as_bytes(result.as_numpy("same")) == list(TEXT.reshape(-1))
            assert _as_bytes(result.as_numpy("joined")) == [b"hello w\xc3\xb6rld", b" a b"]
    metadata = client.get_model_metadata("text")  # from the archive's example of bytes
    assert metadata["inputs"] == [{"name": "text", "datatype": "BYTES", "shape": [-1]}]
    assert [(o["name"], o["datatype"], o["shape"]) for o in metadata["outputs"]] == [
        ("upper", "BYTES", [-1]), ("lengths", "INT64", [-1]), ("same", "BYTES", [-1]),
        ("joined", "BYTES", [-1])]


def test_bytes_in_json_are_strings_and_bytes_that_are_not_text_go_back_as_binary(served):
    def text(data, shape):
        return _infer_json(served, "text", {"inputs": [
            {"name": "text", "shape": shape, "datatype": "BYTES", "data": data}]})

    status, answer = text([["a", "\u00e9"], ["", "b c"]], [2, 2])  # nested, UTF-8 in JSON
    assert status == 200, answer
    outputs = {o["name"]: o for o in answer["outputs"]}
    assert outputs["upper"]["data"] == ["A", "\u00c9", "", "B C"]
    assert outputs["lengths"]["data"] == [1, 2, 0, 3]
    status, answer = text(["a", "b", "c", "d"], [2, 2])  # flat, row-major
    assert status == 200 and answer["outputs"][3]["data"] == ["a b", "c d"], answer
    for data, shape, words in [([1, 2], [2], "must be strings"), (["a"], [2], "elements"),
                               ([["a"], ["b", "c"]], [3], "one shape"),
                               ([["a"], "b"], [2], "one shape")]:
        status, answer = text(data, shape)
        assert status == 400 and words in answer["error"], (data, answer)
    status, _, body = _request(served, "POST", "/v2/models/text/infer", json.dumps(
        {"inputs": [{"name": "text", "shape": [1], "datatype": "BYTES", "data": ["\ud800"]}]},
        ensure_ascii=True).encode())  # a lone surrogate, which no UTF-8 can encode
    assert status == 400 and "lone surrogate" in json.loads(body)["error"], body
    # bytes that are not UTF-8: JSON cannot carry them back, binary data can
    raw = np.array([b"\xff\xfe", b"ok"], dtype=object)
    client = served.client()
    with pytest.raises(InferenceServerException) as json_answer:
        client.infer("text", [_input("text", raw, "BYTES", True)],
                     outputs=[httpclient.InferRequestedOutput("same", binary_data=False)])
    assert json_answer.value.status() == "400", json_answer.value
    assert "element 0 is not UTF-8 text" in json_answer.value.message()
    assert '"binary_data": true' in json_answer.value.message()
    result = client.infer("text", [_input("text", raw, "BYTES", True)], outputs=[
        httpclient.InferRequestedOutput("same", binary_data=True),
        httpclient.InferRequestedOutput("upper", binary_data=False)])
    assert list(result.as_numpy("same")) == [b"\xff\xfe", b"ok"]
    assert list(result.as_numpy("upper")) == ["\ufffd\ufffd", "OK"]
    # binary data whose lengths do not match it: what is wrong, said
    header = json.dumps({"inputs": [{"name": "text", "shape": [2], "datatype": "BYTES",
                                     "parameters": {"binary_data_size": 13}}]}).encode()
    body = header + b"\x03\0\0\0abc" + b"\x09\0\0\0ab"  # 9 bytes said, 2 sent
    status, _, answer = _request(served, "POST", "/v2/models/text/infer", body,
                                 {"Inference-Header-Content-Length": str(len(header))})
    assert status == 400, answer
    assert json.loads(answer)["error"] == (
        "input 'text': BYTES element 1 is cut short: its length says 9 bytes, but only 2 "
        "are left (binary_data_size 13)")
    status, answer = text(["still", "served"], [2])
    assert status == 200 and answer["outputs"][0]["data"] == ["STILL", "SERVED"], answer


def test_bytes_cross_between_host_and_interpreter(manager, packages):
    """The host's own calls (Ray Serve's replicas; connections that arrive while the
    interpreters start) send BYTES arrays into an interpreter and get them back."""
    from multipy.serve.host import archive

    path = packages["text"]
    storages = archive.records(path)
    for interpreter in manager.all_instances():
        served = interpreter.global_("multipy._inside.serving", "load")(
            path, "model", "model.pkl", storages)
        names, datatypes, upper, lengths, same, joined = served.call_value(
            "infer", (("text",), ("BYTES",), TEXT))
        assert names == ("upper", "lengths", "same", "joined")
        assert datatypes == ("BYTES", "INT64", "BYTES", "BYTES")
        assert upper.dtype == object and upper.shape == (2, 2)
        assert upper.tolist() == [[b"HELLO", "W\u00d6RLD".encode()], [b"", b"A B"]]
        np.testing.assert_array_equal(lengths, [[5, 6], [0, 3]])
        assert same.dtype == object and same.tolist() == TEXT.tolist()
        assert joined.tolist() == [b"hello w\xc3\xb6rld", b" a b"]
        metadata = served.call_value("metadata")
        assert metadata["inputs"] == [{"name": "text", "datatype": "BYTES", "shape": [-1]}]


def test_str_and_bytes_outputs_of_every_form_are_bytes(manager):
    """What a model may return as BYTES, made outputs inside an interpreter: str and
    bytes, lists of them (one output each, even nested), numpy arrays of dtype object,
    S and U; an array of objects that are neither is the model's error."""
    interpreter = manager.all_instances()[0]
    outputs = interpreter.global_("multipy._inside.serving", "_outputs")
    inside_torch = interpreter.global_("importlib", "import_module")("torch")

    def made(value) -> list:
        return [(name, datatype, array.tolist(), array.shape)
                for name, datatype, array in outputs(inside_torch, value, set()).deref()]

    assert made(["a", b"b\x00"]) == [("output0", "BYTES", [b"a", b"b\x00"], (2,))]
    assert made("\u00e9") == [("output0", "BYTES", "\u00e9".encode(), ())]
    assert made(b"\x00") == [("output0", "BYTES", b"\x00", ())]
    assert made({"words": ["x"], "pair": (["y", "z"], [torch.tensor([1])])}) == [
        ("words", "BYTES", [b"x"], (1,)), ("pair.0", "BYTES", [b"y", b"z"], (2,)),
        ("pair.1.0", "INT64", [1], (1,))]
    assert made(np.array([[b"a"], [b"bc"]])) == [("output0", "BYTES", [[b"a"], [b"bc"]], (2, 1))]
    assert made(np.array(["\u00e9", "f"])) == [
        ("output0", "BYTES", ["\u00e9".encode(), b"f"], (2,))]
    assert made(np.array(["a", b"b"], dtype=object)) == [("output0", "BYTES", [b"a", b"b"], (2,))]
    assert made([]) == []  # no items: no outputs, as before
    with pytest.raises(TypeError, match="array of objects that holds a int"):
        made(np.array(["a", 1], dtype=object))


# -- errors --

def test_bad_requests_get_the_protocols_errors_and_the_server_keeps_serving(served):
    good = {"inputs": [{"name": "x", "shape": [2], "datatype": "FP32", "data": [1, 2]}]}

    def infer(model: str, request, headers=None, raw: bytes | None = None):
        body = raw if raw is not None else json.dumps(request).encode()
        status, _, answer = _request(served, "POST", f"/v2/models/{model}/infer", body, headers)
        error = json.loads(answer)
        assert set(error) == {"error"} and error["error"], error
        return status, error["error"]

    assert infer("cast", None, raw=b'{"inputs": [')[0] == 400
    assert infer("nope", good) == (404, infer("nope", good)[1]) and "nope" in infer("nope", good)[1]
    tensor = good["inputs"][0]
    for change, words in [({"datatype": "FP99"}, "FP99"), ({"datatype": "BYTES"}, "BYTES"),
                          ({"data": ["a", "b"]}, "numbers"), ({"data": [1, 2, 3]}, "elements"),
                          ({"shape": [2, 2]}, "elements"), ({"shape": [-2]}, "shape"),
                          ({"datatype": "INT8", "data": [1, 300]}, "range"),
                          ({"datatype": "BOOL", "data": [1, 0]}, "true or false"),
                          ({"data": [[1], [2, 3]]}, "data"),
                          ({"datatype": "INT32", "data": [1, None]}, "integers")]:
        status, message = infer("cast", {"inputs": [{**tensor, **change}]})
        assert status == 400 and words in message, (change, message)
    assert infer("cast", {"inputs": []})[0] == 400
    assert infer("cast", None, raw=b'{"inputs": ' + b"[" * 100000)[0] == 400  # too deep
    huge = (b'{"inputs": [{"name": "x", "shape": [1], "datatype": "INT64", "data": ['
            + b"9" * 5000 + b"]}]}")  # past Python's digit limit for int()
    assert infer("cast", None, raw=huge)[0] == 400
    # "outputs": [] asks for every output, as Triton answers
    status, answer = _infer_json(served, "cast", {**good, "outputs": []})
    assert status == 200 and {o["name"] for o in answer["outputs"]} == {"same", "as_fp64"}
    assert infer("cast", {"nothing": 1})[0] == 400
    # binary data that does not match the shape, or is missing
    header = json.dumps({"inputs": [{"name": "x", "shape": [2], "datatype": "FP32",
                                     "parameters": {"binary_data_size": 4}}]}).encode()
    assert infer("cast", None, {"Inference-Header-Content-Length": str(len(header))},
                 header + b"\0" * 4)[0] == 400
    header = header.replace(b'"binary_data_size": 4', b'"binary_data_size": 8')
    assert infer("cast", None, {"Inference-Header-Content-Length": str(len(header))},
                 header + b"\0" * 4)[0] == 400
    assert infer("cast", None, {"Inference-Header-Content-Length": "100000"}, header)[0] == 400
    # the model raises: the model's fault
    negative = {"inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": [-1]}]}
    status, message = infer("fails", negative)
    assert status == 500 and "negative input" in message and "ValueError" in message
    assert 'raise ValueError("negative input")' in served.output()  # the model's traceback
    # an unknown route
    status, _, body = _request(served, "GET", "/v2/nothing/here")
    assert status == 404 and "error" in json.loads(body)
    # a method the route does not take: 405, with the Allow header that HTTP requires
    status, headers, body = _request(served, "GET", "/v2/models/cast/infer")
    assert status == 405 and headers.get("allow") == "POST" and "error" in json.loads(body)
    # and the server still answers, every model
    for model in ("cast", "fails"):
        status, answer = _infer_json(served, model, good)
        assert status == 200 and answer["outputs"][0]["data"] in ([1.0, 2.0], [1, 2]), answer
    metrics = _metrics(served)
    assert metrics[("multipy_inference_failures_total",
                    (("model", "fails"), ("status", "500")))] == 1
    assert metrics[("multipy_inference_requests_total", (("model", "fails"),))] == 2


def _rss(server: Server, field: str = "VmRSS") -> int:
    """The server process's resident memory (VmHWM: its peak), in bytes."""
    with open(f"/proc/{server.process.pid}/status") as status:
        line = next(line for line in status if line.startswith(f"{field}:"))
    return int(line.split()[1]) * 1024


def _peak(server: Server, call):
    """call()'s value, and how far the server's resident memory rose, at its peak,
    while call() ran (bytes)."""
    with open(f"/proc/{server.process.pid}/clear_refs", "w") as refs:
        refs.write("5")  # the peak is reset to what the process holds now
    before = _rss(server)
    value = call()
    return value, _rss(server, "VmHWM") - before


def _answer_while_sending(server: Server, pieces: list[bytes],
                          sent: threading.Event | None = None) -> tuple[int, Any]:
    """Sends pieces of a request on a new connection, as far as the server reads them
    (then sets sent), then reads its answer: (status, its error message, or the answer
    if it is not an error)."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=60) as sock:
        try:
            for piece in pieces:
                sock.sendall(piece)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server answered and closed before reading it all
        if sent is not None:
            sent.set()
        response = http.client.HTTPResponse(sock)
        response.begin()
        answer = json.loads(response.read())
        return response.status, answer["error"] if "error" in answer else answer


def test_small_hostile_requests_are_refused_without_stalling_or_exhausting(served):
    # Each request is small; before, each took the loop for seconds or the process's
    # memory by gigabytes before (or instead of) its error.
    good = {"inputs": [{"name": "x", "shape": [2], "datatype": "FP32", "data": [1, 2]}]}
    before = _rss(served)

    def infer(body: bytes, headers=None) -> tuple[int, str]:
        status, _, answer = _request(served, "POST", "/v2/models/cast/infer", body, headers)
        return status, json.loads(answer)["error"]

    def tensor(**change) -> bytes:
        return json.dumps({"inputs": [{**good["inputs"][0], **change}]}).encode()

    # a shape of 100,000 huge dimensions (2 MB): refused by its rank, the message short
    status, message = infer(tensor(shape=[2 ** 62] * 100_000))
    assert status == 400 and "at most 64" in message and len(message) < 1000
    # (the fourth: empty, but numpy refuses its other sizes' product; found by the fuzzer)
    for shape in ([2 ** 40] * 3, [0, 10 ** 30], [1] * 100, [0, 13, 842287639, 842337135],
                  [2, "2"]):
        status, message = infer(tensor(shape=shape))
        assert status == 400 and "shape" in message, (shape, message)
    # a body that expands to 1 GB: refused past the limit, never expanded whole
    bomb = gzip.compress(b"\0" * (1 << 30), compresslevel=9)
    assert len(bomb) < 2 << 20
    status, message = infer(bomb, {"Content-Encoding": "gzip"})
    assert status == 413 and "expands" in message
    # one output asked for 10,000 times
    status, message = infer(json.dumps({**good, "outputs": [{"name": "same"}] * 10_000}).encode())
    assert status == 400 and "once" in message and len(message) < 1000
    # strings where numbers go, the first long: refused before any array is built
    status, message = infer(tensor(shape=[25_001], data=["x" * 10_000] + [""] * 25_000))
    assert status == 400 and "numbers" in message and "str" in message
    # far more values than the shape claims
    status, message = infer(tensor(shape=[2], data=[1.0] * 1_000_000))
    assert status == 400 and "more" in message
    # a datatype that is not a string
    for datatype in (["FP32"], {"a": 1}, 7):
        status, message = infer(tensor(datatype=datatype))
        assert status == 400 and "datatype" in message, (datatype, message)
    # a body past --max-request-size (64 MiB by default): said by its length, before
    # anything is read, or as it arrives (chunked, no length)
    start = b"POST /v2/models/cast/infer HTTP/1.1\r\nHost: test\r\n"
    status, message = _answer_while_sending(served, [start + b"Content-Length: %d\r\n\r\n{"
                                                     % (1 << 40)] + [b" " * (1 << 20)] * 8)
    assert status == 413 and "--max-request-size" in message
    chunk = b"100000\r\n" + b" " * (1 << 20) + b"\r\n"
    status, message = _answer_while_sending(
        served, [start + b"Transfer-Encoding: chunked\r\n\r\n1\r\n[\r\n"] + [chunk] * 70)
    assert status == 413 and "--max-request-size" in message
    # and the server still answers, in bounded memory
    status, answer = _infer_json(served, "cast", good)
    assert status == 200 and answer["outputs"][0]["data"] == [1.0, 2.0]
    assert _rss(served) - before < 400 << 20


def test_request_heads_are_bounded_in_size_and_fields(served):
    """A head past --max-header-size (64 KiB by default), in one huge header or in many,
    or with more than --max-headers fields (100), is a 431 before the rest is parsed;
    a head just inside both is served, and so is the next request."""
    good = json.dumps({"inputs": [{"name": "x", "shape": [1], "datatype": "FP32",
                                   "data": [3]}]}).encode()
    start = b"POST /v2/models/cast/infer HTTP/1.1\r\nHost: test\r\n"
    end = b"Content-Length: %d\r\n\r\n" % len(good) + good
    huge = start + b"X-Huge: " + b"a" * (1 << 20) + b"\r\n" + end
    status, message = _answer_while_sending(served, [huge[i:i + 65536]
                                                     for i in range(0, len(huge), 65536)])
    assert status == 431 and "--max-header-size" in message
    many = start + b"".join(b"X-%d: %s\r\n" % (i, b"b" * 1000) for i in range(70)) + end
    assert _answer_while_sending(served, [many])[0] == 431
    fields = start + b"".join(b"X-%d: c\r\n" % i for i in range(150)) + end
    status, message = _answer_while_sending(served, [fields])
    assert status == 431 and "--max-headers" in message
    inside = start + b"".join(b"X-%d: %s\r\n" % (i, b"d" * 500) for i in range(90)) + end
    with socket.create_connection(("127.0.0.1", served.port), timeout=60) as sock:
        sock.sendall(inside)
        response = http.client.HTTPResponse(sock)
        response.begin()
        assert response.status == 200, response.read()
        assert json.loads(response.read())["outputs"][0]["data"] == [3.0]
    status, answer = _infer_json(served, "cast", json.loads(good))
    assert status == 200 and answer["outputs"][0]["data"] == [3.0]


def test_slow_requests_idle_connections_and_a_stalled_stop_are_bounded(packages, tmp_path):
    """With --read-timeout 1: a request whose head, or body, stops arriving is a 408, a
    connection that sends nothing is closed, and a client that keeps its request
    coming in time is served, as is one whose request waits 2 s behind another.  With
    --graceful-timeout 1, a client stalled in the middle of its body does not keep
    SIGTERM from ending the server (exit status 0)."""
    server = _start(tmp_path, [packages["cast"], packages["slow"]], "--interpreters", "1",
                    "--read-timeout", "1", "--graceful-timeout", "1")
    try:
        good = json.dumps({"inputs": [{"name": "x", "shape": [1], "datatype": "FP32",
                                       "data": [5]}]}).encode()
        start = b"POST /v2/models/cast/infer HTTP/1.1\r\nHost: test\r\n"
        status, message = _answer_while_sending(server, [start + b"X-Slow: "])
        assert status == 408 and "--read-timeout" in message
        status, message = _answer_while_sending(
            server, [start + b"Content-Length: %d\r\n\r\n" % len(good) + good[:5]])
        assert status == 408
        with socket.create_connection(("127.0.0.1", server.port), timeout=60) as idle:
            assert idle.recv(1) == b""  # closed by the server
        with socket.create_connection(("127.0.0.1", server.port), timeout=60) as sock:
            for piece in (start, b"Content-Length: %d\r\n\r\n" % len(good), good):
                sock.sendall(piece)
                time.sleep(0.2)  # in time: well inside the second
            response = http.client.HTTPResponse(sock)
            response.begin()
            assert response.status == 200
            assert json.loads(response.read())["outputs"][0]["data"] == [5.0]
        # a request pipelined behind a call of 2 s, which uvicorn does not read meanwhile
        slow = json.dumps({"inputs": [{"name": "seconds", "shape": [1], "datatype": "FP32",
                                       "data": [2]}]}).encode()
        with socket.create_connection(("127.0.0.1", server.port), timeout=60) as sock:
            sock.sendall(b"POST /v2/models/slow/infer HTTP/1.1\r\nHost: test\r\n"
                         b"Content-Length: %d\r\n\r\n%s" % (len(slow), slow) + start
                         + b"Content-Length: %d\r\n\r\n" % len(good) + good)
            for expected, (status, body) in zip(([4.0], [5.0]), _http_answers(sock)):
                assert status.startswith(b"HTTP/1.1 200 "), (status, body)
                assert json.loads(body)["outputs"][0]["data"] == expected
        # a client that stalls halfway through its body, as SIGTERM comes
        stalled = socket.create_connection(("127.0.0.1", server.port), timeout=60)
        try:
            stalled.sendall(start + b"Content-Length: 1000\r\n\r\n{")
            _until_accepted(server.port)
            server.process.send_signal(signal.SIGTERM)
            assert server.process.wait(timeout=60) == 0, server.output()
            answer = stalled.recv(1 << 16)  # answered (408) or closed: not left open
            assert answer == b"" or answer.startswith(b"HTTP/1.1 408 "), answer
        finally:
            stalled.close()
    finally:
        _stop(server)


#: uvicorn's keep-alive timeout, which multipy serve keeps (seconds)
_KEEP_ALIVE = 5.0


def _answered(sock: socket.socket) -> http.client.HTTPResponse:
    """The next answer on sock, read whole."""
    response = http.client.HTTPResponse(sock)
    response.begin()
    response.read()
    return response


def _open_until(sock: socket.socket, until_time: float) -> None:
    """Asserts that the server has not closed sock (or written to it) before until_time
    (time.monotonic's)."""
    left = until_time - time.monotonic()
    assert left <= 0 or not select.select([sock], [], [], left)[0], "closed too early"


def test_keep_alive_closes_only_a_connection_idle_for_its_timeout(served):
    """One connection: requests 3 s apart keep it (the timeout counts from each answer);
    a request whose head began while it was idle is answered though its rest comes after
    the timeout; once idle, it is closed when the timeout has passed, not before, and an
    empty line (no request's start) does not change that."""
    live = b"GET /v2/health/live HTTP/1.1\r\nHost: test\r\n\r\n"
    with socket.create_connection(("127.0.0.1", served.port), timeout=60) as sock:
        for _ in range(3):  # the second and third past 5 s from the first answer
            sock.sendall(live)
            assert _answered(sock).status == 200
            _open_until(sock, time.monotonic() + 3)
        sent = time.monotonic()
        sock.sendall(live[:10])  # a head begun while idle, finished after the timeout
        _open_until(sock, sent + _KEEP_ALIVE + 1)
        sock.sendall(live[10:])
        assert _answered(sock).status == 200
        sent = time.monotonic()
        sock.sendall(live)
        assert _answered(sock).status == 200
        sock.sendall(b"\r\n")  # an empty line, which does not begin a request
        _open_until(sock, sent + _KEEP_ALIVE - 0.1)  # (idle from the answer, after sent)
        assert sock.recv(1) == b""  # then closed by the server (within recv's 60 s)


def test_a_request_begun_while_the_answer_before_it_is_written_is_not_cut_by_keep_alive(
        served):
    """A pipelined request whose head is cut short arrives while the one before it runs:
    when that one is answered the connection is not idle, so keep-alive does not close it
    while the rest of the head takes longer than the timeout to come."""
    body = json.dumps({"inputs": [{"name": "seconds", "shape": [1], "datatype": "FP32",
                                   "data": [0.5]}]}).encode()
    slow = (b"POST /v2/models/slow/infer HTTP/1.1\r\nHost: test\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    live = b"GET /v2/health/live HTTP/1.1\r\nHost: test\r\n\r\n"
    with socket.create_connection(("127.0.0.1", served.port), timeout=60) as sock:
        sock.sendall(slow + live[:10])
        response = _answered(sock)
        assert response.status == 200
        _open_until(sock, time.monotonic() + _KEEP_ALIVE + 1)
        sock.sendall(live[10:])
        assert _answered(sock).status == 200


def test_keep_alive_counts_from_an_answer_given_before_its_body_came(served):
    """An answer given before the request's body came (404: no such model): if the body
    never comes, the connection is closed at the keep-alive timeout, with nothing written
    after the answer (no 408 for a request answered); if it comes after the answer, the
    connection is closed the keep-alive timeout after it, not left open, unless a next
    request began in the same piece: that one is answered, however late its rest."""
    body = b"x" * 100_000
    head = (b"POST /v2/models/nonexistent/infer HTTP/1.1\r\nHost: test\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body))
    for sends_body in (False, True):
        with socket.create_connection(("127.0.0.1", served.port), timeout=60) as sock:
            sent = time.monotonic()
            sock.sendall(head)
            assert _answered(sock).status == 404
            if sends_body:
                sent = time.monotonic()
                sock.sendall(body)
            _open_until(sock, sent + _KEEP_ALIVE - 0.1)
            assert sock.recv(1 << 16) == b""  # closed by the server, nothing written
    # the body, then in the same piece a next request's head, whose rest comes late
    live = b"GET /v2/health/live HTTP/1.1\r\nHost: test\r\n\r\n"
    with socket.create_connection(("127.0.0.1", served.port), timeout=60) as sock:
        sock.sendall(head)
        assert _answered(sock).status == 404
        sent = time.monotonic()
        sock.sendall(body + live[:10])
        _open_until(sock, sent + _KEEP_ALIVE + 1)
        sock.sendall(live[10:])
        assert _answered(sock).status == 200


def _busy(server: Server, model: str) -> float:
    return _metrics(server)[("multipy_busy_interpreters", (("model", model),))]


def test_interpreters_stuck_past_the_timeout_are_named_counted_and_passed_by(served, tmp_path):
    """Calls blocked in C run on past --timeout (5 s) in both interpreters: their
    requests get a 500 naming their model; then the server is not ready and says why,
    counts 2 stuck interpreters, answers liveness at once, and answers another model's
    request with a 503 naming the model that holds them; once the calls end, it serves
    again."""
    fifos = [str(tmp_path / f"gate{k}") for k in range(2)]
    for fifo in fifos:
        os.mkfifo(fifo)
    answers: list = []

    def blocked(fifo: str) -> None:
        path = np.frombuffer(fifo.encode(), np.uint8)
        try:
            served.client().infer("blocks", [_input("path", path, "UINT8", True)])
            answers.append(None)
        except InferenceServerException as error:
            answers.append(error)

    threads = []
    for k, fifo in enumerate(fifos):  # one on each interpreter: the second goes to the free one
        threads.append(threading.Thread(target=blocked, args=(fifo,)))
        threads[-1].start()
        until(lambda: _busy(served, "blocks") == k + 1)
    try:
        for thread in threads:
            thread.join(timeout=60)
        assert [a.status() for a in answers] == ["500", "500"], answers
        assert all("'blocks' did not answer" in a.message() for a in answers)
        status, _, body = _request(served, "GET", "/v2/health/ready")
        reason = json.loads(body)["error"]
        assert status == 400 and "no interpreter can take a call" in reason and "'blocks'" in reason
        status, _, body = _request(served, "GET", "/v2/models/cast/ready")
        assert status == 400 and "'blocks'" in json.loads(body)["error"]
        assert _request(served, "GET", "/v2/health/live")[0] == 200
        assert _metrics(served)[("multipy_stuck_interpreters", ())] == 2
        status, answer = _infer_json(served, "cast", {"inputs": [
            {"name": "x", "shape": [1], "datatype": "FP32", "data": [1]}]})
        assert status == 503 and "'blocks'" in answer["error"], answer
    finally:
        for fifo in fifos:
            until(lambda: write_one(fifo))
    # (each interpreter is free again once its own call has ended: one may be first)
    until(lambda: _metrics(served)[("multipy_stuck_interpreters", ())] == 0)
    assert _request(served, "GET", "/v2/health/ready")[0] == 200
    status, answer = _infer_json(served, "cast", {"inputs": [
        {"name": "x", "shape": [1], "datatype": "FP32", "data": [1]}]})
    assert status == 200 and answer["outputs"][0]["data"] == [1.0]


def _requests_to_fuzz():
    """Inference requests, well formed and not: any JSON the protocol's request object
    could be confused with, and valid requests with one field changed."""
    from hypothesis import strategies as st

    leaf = st.one_of(st.integers(-2 ** 70, 2 ** 70), st.floats(), st.booleans(),
                     st.text(max_size=4), st.none())
    data = st.recursive(leaf, lambda inner: st.lists(inner, max_size=4)
                        | st.dictionaries(st.text(max_size=3), inner, max_size=2), max_leaves=16)
    datatype = st.one_of(st.sampled_from(DATATYPES + ["BYTES", "FP8", "", "fp32"]), data)
    shape = st.one_of(st.lists(st.integers(-2, 2 ** 64), max_size=4),
                      st.lists(st.integers(0, 3), max_size=3), data)
    tensor = st.fixed_dictionaries(
        {"name": st.sampled_from(["x", "y", ""]), "datatype": datatype, "shape": shape,
         "data": data}, optional={"parameters": st.dictionaries(st.text(max_size=12), data,
                                                                 max_size=2)})
    request = st.fixed_dictionaries(
        {"inputs": st.one_of(st.lists(tensor, max_size=3), data)},
        optional={"id": data, "parameters": st.dictionaries(st.text(max_size=12), data, max_size=2),
                  "outputs": st.one_of(st.lists(st.fixed_dictionaries(
                      {"name": st.sampled_from(["same", "as_fp64", "other"])},
                      optional={"parameters": data}), max_size=3), data)})

    @st.composite
    def changed(draw):
        rows = draw(st.integers(0, 3))
        kind = draw(st.sampled_from(DATATYPES))
        good = {"name": "x", "datatype": kind, "shape": [rows],
                "data": [1] * rows if kind != "BOOL" else [True] * rows}
        field = draw(st.sampled_from(["name", "datatype", "shape", "data", None]))
        if field is not None:
            good[field] = draw({"name": st.text(max_size=3), "datatype": datatype,
                                "shape": shape, "data": data}[field])
        return {"inputs": [good]}

    return st.one_of(request, changed(), data)


def _as_grpc(body):
    """The ModelInferRequest of model cast that says what it can of body (a generated
    HTTP request's JSON), and whether it says all of it: then it must be answered as
    body is.  Typed contents say a flat list of values that fit its datatype's field
    (JSON's numbers, true and false, and strings, as UTF-8); the messages' strings,
    integers and parameters say the rest."""
    from multipy.serve.rpc import inference_pb2 as messages
    from multipy.serve.rpc.server import _CONTENTS

    request = messages.ModelInferRequest(model_name="cast")
    said = [isinstance(body, dict)]  # False for each part of body that is not said
    body = body if isinstance(body, dict) else {}

    def put(set_to, value, fits: bool) -> None:
        """set_to(value), if value fits and the message can hold it."""
        try:
            if fits:
                set_to(value)
                return
        except (TypeError, ValueError, OverflowError):  # out of range, or not UTF-8
            pass
        said.append(False)

    def parameters(into, given) -> None:
        said.append(isinstance(given, (dict, type(None))))
        for key, value in (given if isinstance(given, dict) else {}).items():
            choice = {bool: "bool_param", int: "int64_param", str: "string_param",
                      float: "double_param"}.get(type(value))
            put(lambda v, key=key, choice=choice: setattr(into[key], choice, v), value,
                choice is not None)

    def values(value, kinds: tuple) -> bool:
        return type(value) in kinds or (
            "int64" in kinds and type(value) is int and -2 ** 63 <= value < 2 ** 63)

    parameters(request.parameters, body.get("parameters"))
    if body.get("id") is not None:
        put(lambda v: setattr(request, "id", v), body["id"], isinstance(body["id"], str))
    outputs = body.get("outputs") or []
    said.append(isinstance(outputs, list))
    for output in outputs if isinstance(outputs, list) else []:
        named = isinstance(output, dict) and isinstance(output.get("name"), str)
        said.append(named)
        if named:
            parameters(request.outputs.add(name=output["name"]).parameters,
                       output.get("parameters"))
    inputs = body.get("inputs")
    said.append(isinstance(inputs, list))
    for spec in inputs if isinstance(inputs, list) else []:
        said.append(isinstance(spec, dict) and "data" in spec)
        spec = spec if isinstance(spec, dict) else {}
        tensor = request.inputs.add()
        for key in ("name", "datatype"):
            put(lambda v, key=key: setattr(tensor, key, v), spec.get(key),
                isinstance(spec.get(key), str))
        shape = spec.get("shape")
        put(tensor.shape.extend, shape,
            isinstance(shape, list) and all(type(size) is int for size in shape))
        parameters(tensor.parameters, spec.get("parameters"))
        data = spec.get("data") if isinstance(spec.get("data"), list) else [spec.get("data")]
        field = _CONTENTS.get(tensor.datatype)
        kinds = {"bool_contents": (bool,), "fp32_contents": (float, "int64"),
                 "fp64_contents": (float, "int64"), "bytes_contents": (str,)}.get(field, (int,))
        if field is not None and data:
            put(lambda data: getattr(tensor.contents, field).extend(
                [v.encode() if isinstance(v, str) else v for v in data]), data,
                all(values(v, kinds) for v in data))
    return request, all(said)


#: The gRPC code of each HTTP status that a fuzzed request may be answered with.
_FUZZ_CODES = {200: "OK", 400: "INVALID_ARGUMENT", 500: "INTERNAL"}


def test_fuzzed_requests_get_an_answer_that_says_what_is_wrong(served):
    """Generated requests (hypothesis: 300, the same each run; with FUZZ_EXAMPLES, that
    many, new each run), over HTTP and, as far as its messages can say them, gRPC: each
    is answered 200 (OK), or 400 (INVALID_ARGUMENT) with a message, or 500 (INTERNAL)
    only where the model itself raised; never a server error, never no answer; over
    gRPC, as over HTTP where the message says all the request does; and a normal
    request is served after."""
    import grpc
    from hypothesis import HealthCheck, given, settings

    from multipy.serve.rpc import inference_pb2 as messages

    examples = int(os.environ.get("FUZZ_EXAMPLES", "300"))
    seen: dict[int, int] = {}
    codes: dict[str, int] = {}
    channel = grpc.insecure_channel(f"127.0.0.1:{_grpc_port(served)}")
    infer = _unary(channel, "ModelInfer", messages.ModelInferResponse)

    @settings(max_examples=examples, deadline=None, database=None,
              derandomize="FUZZ_EXAMPLES" not in os.environ,
              suppress_health_check=list(HealthCheck))
    @given(_requests_to_fuzz())
    def answered(body):
        status, headers, answer = _request(served, "POST", "/v2/models/cast/infer",
                                           json.dumps(body).encode())
        seen[status] = seen.get(status, 0) + 1
        reply = json.loads(answer)
        if status == 200:
            assert reply["model_name"] == "cast" and "outputs" in reply
        else:
            assert status in (400, 500), (status, body, reply)
            assert isinstance(reply["error"], str) and reply["error"], (body, reply)
            if status == 500:
                assert reply["error"].startswith("model 'cast' raised"), (body, reply)
        request, exact = _as_grpc(body)
        try:
            code, message = "OK", infer(request, timeout=60).model_name
        except grpc.RpcError as error:
            code, message = error.code().name, error.details()
        codes[code] = codes.get(code, 0) + 1
        assert code in _FUZZ_CODES.values() and message, (code, message, request)
        if code == "INTERNAL":
            assert message.startswith("model 'cast' raised"), (message, request)
        if exact:
            codes["as HTTP"] = codes.get("as HTTP", 0) + 1
            assert code == _FUZZ_CODES[status], (status, reply, code, message, body, request)

    try:
        answered()
    finally:
        channel.close()
    print(f"fuzzed requests by status: {dict(sorted(seen.items()))}; over gRPC, by code: "
          f"{codes}")  # (pytest -s)
    assert sum(seen.values()) >= examples and seen.get(400), seen
    assert codes.get("OK") and codes.get("as HTTP", 0) >= examples // 10, codes
    status, answer = _infer_json(served, "cast", {"inputs": [
        {"name": "x", "shape": [1], "datatype": "FP32", "data": [2]}]})
    assert status == 200 and answer["outputs"][0]["data"] == [2.0]
    assert _grpc(served).infer("cast", [_grpc_input("x", np.ones(1, np.float32), "FP32")]) \
        .as_numpy("same").tolist() == [1.0]


def test_a_crash_report_names_the_model_and_the_request(packages, tmp_path):
    """A model that crashes its interpreter ends the process (one address space); the
    report on stderr names the interpreter, the model and the request."""
    server = _start(tmp_path, [packages["crashes"]], "--interpreters", "1")
    try:
        with pytest.raises((ConnectionError, http.client.HTTPException)):
            _infer_json(server, "crashes", {"id": "req-42", "inputs": [
                {"name": "x", "shape": [1], "datatype": "FP32", "data": [1]}]})
        assert server.process.wait(timeout=60) != 0
        output = server.output()
        assert "fatal signal 11 in interpreter #0" in output, output
        assert "inference of model 'crashes', request 'req-42'" in output, output
    finally:
        _stop(server)


def test_a_request_past_the_timeout_is_answered_and_cancelled(served):
    seconds = np.array([30.0], np.float32)  # --timeout is 5
    client = served.client()
    with pytest.raises(InferenceServerException) as timed_out:
        client.infer("slow", [_input("seconds", seconds, "FP32", True)])
    assert timed_out.value.status() == "500" and "did not answer" in timed_out.value.message()
    # Cancelled inside, the call stops long before its 30 s: then two calls at once each
    # run alone in an interpreter.  (While the call runs on, the load balancer sends both
    # to the other interpreter, where they run together.)
    quick = np.array([0.3], np.float32)
    deadline = time.monotonic() + 15
    while True:
        answers = []
        pair = [threading.Thread(target=lambda: answers.append(served.client().infer(
            "slow", [_input("seconds", quick, "FP32", True)]))) for _ in range(2)]
        for thread in pair:
            thread.start()
        for thread in pair:
            thread.join(timeout=30)
        assert [a.as_numpy("doubled")[0] for a in answers] == [np.float32(0.6)] * 2
        if [a.as_numpy("together")[0] for a in answers] == [1, 1]:
            break
        assert time.monotonic() < deadline, "the timed-out call was not cancelled"


def _exits(connection: http.client.HTTPConnection, x: float) -> tuple[int, dict]:
    """Model exits's answer to x on connection: (status, its JSON)."""
    connection.request("POST", "/v2/models/exits/infer", body=json.dumps({"inputs": [
        {"name": "x", "shape": [1], "datatype": "FP32", "data": [x]}]}).encode())
    response = connection.getresponse()
    return response.status, json.loads(response.read())


@contextlib.contextmanager
def _by_interpreter(server: Server, enough) -> Iterator[dict[int, list]]:
    """Keep-alive connections to server, opened one at a time (at most 8) until
    enough(found) holds, found mapping each interpreter (the thread that runs model exits
    there) to its connections, in order; closed at the end.  (Connections open at once
    go to different interpreters.)"""
    found: dict[int, list[http.client.HTTPConnection]] = {}
    connections: list[http.client.HTTPConnection] = []
    try:
        while not enough(found):
            assert len(connections) < 8, found
            connections.append(http.client.HTTPConnection("127.0.0.1", server.port, timeout=60))
            status, answer = _exits(connections[-1], 1)
            assert status == 200, answer
            found.setdefault(answer["outputs"][0]["data"][0], []).append(connections[-1])
        yield found
    finally:
        for connection in connections:
            connection.close()


def _system_exit_is_the_models_error(server: Server) -> None:
    """On a connection to each interpreter (told apart by the thread that runs the model),
    a model that raises SystemExit gets a 500 naming it; then each interpreter answers
    the next requests, on the same thread, and none is left busy or stuck."""
    with _by_interpreter(server, lambda found: len(found) == 2) as found:
        by_thread = {thread: connections[0] for thread, connections in found.items()}
        for connection in by_thread.values():
            status, answer = _exits(connection, -1)
            assert (status, answer) == (500, {"error": "model 'exits' raised SystemExit: asked to"})
        for thread, connection in by_thread.items():
            for _ in range(3):
                status, answer = _exits(connection, 1)
                assert status == 200 and answer["outputs"][0]["data"] == [thread], answer
    assert _busy(server, "exits") == 0
    assert _metrics(server)[("multipy_stuck_interpreters", ())] == 0


def test_a_model_that_raises_system_exit_under_the_timeout_is_answered(served):
    _system_exit_is_the_models_error(served)


def _slow_answer(connection: http.client.HTTPConnection) -> dict[str, list]:
    """The slow model's answer to what _send_slow sent on connection: each output's data."""
    response = connection.getresponse()
    answer = json.loads(response.read())
    assert response.status == 200, answer
    return {output["name"]: output["data"] for output in answer["outputs"]}


def _gone(server: Server) -> float:
    """How many of the slow model's requests were answered 499: their client went away."""
    return _metrics(server).get(("multipy_inference_failures_total",
                                 (("model", "slow"), ("status", "499"))), 0)


def test_a_call_whose_client_leaves_is_cancelled_and_counted(served):
    """A client closes its connection while its call runs (4.5 s in Python, within
    --timeout): the call is cancelled and its request counted as 499, and the next
    request on that interpreter is answered, the abandoned call never having run to
    its end."""
    with _by_interpreter(served, lambda found: any(len(c) == 2 for c in found.values())) \
            as found:
        leaving, staying = next(c for c in found.values() if len(c) == 2)
        ended = _slow_answer(_send_slow(served, 0, staying))["ended"][0]
        gone = _gone(served)
        _send_slow(served, 4.5, leaving)
        until(lambda: _busy(served, "slow") == 1)
        leaving.close()
        until(lambda: _busy(served, "slow") == 0)
        answer = _slow_answer(_send_slow(served, 0.5, staying))
        assert answer["doubled"] == [1.0] and answer["ended"] == [ended + 1], answer
    until(lambda: _gone(served) == gone + 1)


def _grpc_alone(server: Server):
    """A gRPC client of server on a connection of its own (grpcio's channels to one
    address otherwise share one)."""
    import tritonclient.grpc as grpcclient

    return grpcclient.InferenceServerClient(f"127.0.0.1:{_grpc_port(server)}", channel_args=[
        ("grpc.use_local_subchannel_pool", 1)])


def _grpc_thread(client) -> int:
    """The thread that runs model exits for client: its connection's interpreter's."""
    answer = client.infer("exits", [_grpc_input("x", np.ones(1, np.float32), "FP32")])
    return int(answer.as_numpy("output0")[0])


def test_a_grpc_call_past_its_deadline_is_cancelled_and_counted(served):
    """A gRPC call whose deadline (0.5 s) passes while its call runs (4.5 s in Python):
    the call is cancelled and its request counted as 499, and the channel's next call,
    on the same interpreter, is answered, the abandoned call never having run to its
    end."""
    client = _grpc_alone(served)

    def slow(seconds: float, **options):
        return client.infer("slow", [_grpc_input("seconds", np.array([seconds], np.float32),
                                                 "FP32")], **options)

    try:
        ended = slow(0).as_numpy("ended")[0]
        gone = _gone(served)
        status, _ = _client_error(lambda: slow(4.5, client_timeout=0.5))
        assert status == "StatusCode.DEADLINE_EXCEEDED"
        until(lambda: _busy(served, "slow") == 0)
        answer = slow(0.5)
        assert answer.as_numpy("doubled")[0] == 1.0
        assert answer.as_numpy("ended")[0] == ended + 1
    finally:
        client.close()
    until(lambda: _gone(served) == gone + 1)


@pytest.mark.parametrize("over", ["http", "grpc"])
def test_a_stuck_interpreters_clients_move_to_a_free_one(served, tmp_path, over):
    """A call blocked in C (its request sent over HTTP, or gRPC) passes --timeout (5 s)
    on one interpreter, stuck until the call ends: the answer to its request closes its
    connection (HTTP: Connection: close; gRPC: that interpreter's gRPC server stops, a
    GOAWAY, before it answers), and so does the 503 that another client's keep-alive
    connection to that interpreter gets next; each client's next request, on a new
    connection, reaches the other interpreter and is answered.  Once the call has
    ended, that interpreter serves gRPC again."""
    fifo = str(tmp_path / "gate")
    os.mkfifo(fifo)
    x = {"inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": [2]}]}

    def cast(connection: http.client.HTTPConnection) -> tuple[int, str | None, dict]:
        connection.request("POST", "/v2/models/cast/infer", body=json.dumps(x).encode())
        response = connection.getresponse()
        return response.status, response.getheader("connection"), json.loads(response.read())

    with _by_interpreter(served, lambda found: any(len(c) == 2 for c in found.values())) \
            as found:
        stuck, (blocked, pinned) = next((thread, c) for thread, c in found.items()
                                        if len(c) == 2)
        channels = [_grpc_alone(served)]
        while _grpc_thread(channels[-1]) != stuck:  # (the kernel picks their interpreters)
            assert len(channels) < 40
            channels.append(_grpc_alone(served))
        answers: list = []

        def block() -> None:
            path = np.frombuffer(fifo.encode(), np.uint8)
            if over == "grpc":
                answers.append(_client_error(lambda: channels[-1].infer(
                    "blocks", [_grpc_input("path", path, "UINT8")])))
                return
            blocked.request("POST", "/v2/models/blocks/infer", body=json.dumps({"inputs": [
                {"name": "path", "shape": [len(path)], "datatype": "UINT8",
                 "data": path.tolist()}]}).encode())
            response = blocked.getresponse()
            answers.append((response.status, response.getheader("connection"),
                            json.loads(response.read())["error"]))

        calling = threading.Thread(target=block)
        calling.start()
        try:
            calling.join(3)  # then pinned's keep-alive (5 s) outlasts the call
            pinned.request("GET", "/v2/health/live")
            assert pinned.getresponse().read() == b""
            calling.join(60)
            if over == "grpc":
                status, error = answers[0]
                assert status == "StatusCode.INTERNAL", error
            else:
                status, close, error = answers[0]
                assert (status, close) == (500, "close"), error
                status, _, answer = cast(blocked)
                assert status == 200 and answer["outputs"][0]["data"] == [2.0], answer
            assert "'blocks' did not answer" in error
            assert _grpc_thread(channels[-1]) != stuck
            status, close, answer = cast(pinned)
            assert (status, close) == (503, "close") and "'blocks'" in answer["error"], answer
            status, _, answer = cast(pinned)
            assert status == 200 and answer["outputs"][0]["data"] == [2.0], answer
        finally:
            until(lambda: write_one(fifo))
            calling.join(60)
            for channel in channels:
                channel.close()
    until(lambda: _metrics(served)[("multipy_stuck_interpreters", ())] == 0)

    def reaches_it() -> bool:
        client = _grpc_alone(served)
        try:
            return _grpc_thread(client) == stuck
        finally:
            client.close()

    until(reaches_it)  # (each a new connection, which the kernel gives either interpreter)


#: Run inside an interpreter: a front end's call worker, driven by hand.
WORKER = '''
import asyncio, functools, threading

import _multipy_bootstrap
from multipy._inside import front_end


class Started:
    """Counts the calls begun and ended, as the metrics do."""

    def __init__(self):
        self.entered = self.exited = 0

    def __enter__(self):
        self.entered += 1

    def __exit__(self, *exc_info):
        self.exited += 1

    def pin(self, running):  # (no digest: a server of one process)
        pass


class Series:
    def abandoned(self, stuck):
        pass


async def _cancelled_as_it_ends():
    worker = front_end._Worker(lambda: None)
    started = Started()
    run = lambda call: asyncio.wait_for(worker.run(call, started, Series(), "m"), 30)
    try:
        thread = await run(threading.get_ident)
        serial = next(front_end.serials) + 1  # the next job's
        cancelled = await run(functools.partial(_multipy_bootstrap.cancel, thread, serial))
        return cancelled, await run(lambda: "next"), started.entered, started.exited
    finally:
        worker.stop()


def cancelled_as_it_ends():
    """A job whose call, in C, cancels itself: the cancel lands as the call ends."""
    return asyncio.run(_cancelled_as_it_ends())


def cancelled_before_it_starts():
    """Whether the cancel found a call, and whether the call ran."""
    serial, ran = next(front_end.serials), []
    found = _multipy_bootstrap.cancel(threading.get_ident(), serial)
    try:
        _multipy_bootstrap.call(serial, lambda: ran.append(serial))
    except _multipy_bootstrap.CallCancelled:
        return found, ran
    raise AssertionError("not cancelled")
'''


def test_a_timeout_as_the_call_ends_leaves_the_worker_serving(manager):
    """A front end's call worker: a cancel that lands as its call ends (no bytecode runs
    between the two) is cleared there; the job is answered, its Started left, and the
    worker's next job runs.  A cancel that comes before its call means it never runs."""
    manager.register_module_source("serve_worker", WORKER)
    interpreter = manager.all_instances()[0]
    answered = interpreter.global_("serve_worker", "cancelled_as_it_ends")().deref()
    assert answered == (True, "next", 3, 3)
    assert interpreter.global_("serve_worker", "cancelled_before_it_starts")().deref() == (
        False, [])


def test_metrics(served):
    before = _metrics(served)
    key = ("multipy_inference_requests_total", (("model", "python_heavy"),))
    client = served.client()
    x = np.zeros((1, 48, 16), np.float32)
    for _ in range(3):
        client.infer("python_heavy", [_input("x", x, "FP32", True)])
    after = _metrics(served)
    assert after[key] == before[key] + 3
    count = ("multipy_inference_request_duration_seconds_count", (("model", "python_heavy"),))
    assert after[count] == before[count] + 3
    calls = ("multipy_model_calls_total", (("model", "python_heavy"),))
    assert after[calls] == before[calls] + 3
    for model in ("python_heavy", "cast", "pair", "fails", "slow"):
        assert after[("multipy_inference_queue_length", (("model", model),))] == 0
        assert after[("multipy_busy_interpreters", (("model", model),))] == 0
    assert after[("multipy_interpreters", ())] == 2


def test_metrics_sum_every_writers_row():
    """Writers that each count in their own row of one board (as the interpreters'
    front ends do, at its address) are summed by /metrics's text, whoever renders it."""
    from multipy.serve.request.metrics import Metrics
    from multipy.serve.request.requests import Timing

    host = Metrics(["a", "b"], 2, rows=3, row=0)
    fronts = [Metrics(["a", "b"], 2, rows=3, row=k, address=host.board.address) for k in (1, 2)]
    for k, front in enumerate(fronts):
        series = front.models["a"]
        for _ in range(k + 1):
            series.requests.inc()
        series.answered(413, 3_000_000)
        timing = Timing()
        timing.input_ns, timing.queue_ns, timing.infer_ns, timing.output_ns = 1, 2, 3, 4
        series.answered(200, 100 * (k + 1), timing)
        series.call_began(1)
        front.closed_connection()
    fronts[0].models["b"].call_began(3)  # a batch of 3, ended
    fronts[0].models["b"].call_ended()
    samples = {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
               for family in text_string_to_metric_families(fronts[1].render()[0].decode())
               for sample in family.samples}
    assert samples[("multipy_inference_requests_total", (("model", "a"),))] == 3
    assert samples[("multipy_inference_requests_total", (("model", "b"),))] == 0
    assert samples[("multipy_inference_failures_total", (("model", "a"), ("status", "413")))] == 2
    latency = "multipy_inference_request_duration_seconds"
    assert samples[(f"{latency}_bucket", (("le", "0.0025"), ("model", "a")))] == 2
    assert samples[(f"{latency}_bucket", (("le", "0.005"), ("model", "a")))] == 4
    assert samples[(f"{latency}_count", (("model", "a"),))] == 4
    assert samples[(f"{latency}_sum", (("model", "a"),))] == pytest.approx(0.0060003)
    assert samples[("multipy_busy_interpreters", (("model", "a"),))] == 2
    assert samples[("multipy_batch_requests_bucket", (("le", "2.0"), ("model", "b")))] == 0
    assert samples[("multipy_batch_requests_bucket", (("le", "4.0"), ("model", "b")))] == 1
    # and the statistics extension reads the same rows
    stats = {s["name"]: s for s in host.statistics(["a", "b"])["model_stats"]}
    assert stats["a"]["inference_stats"]["success"] == {"count": 2, "ns": 300}
    assert stats["a"]["inference_stats"]["fail"] == {"count": 2, "ns": 6_000_000}
    assert [stats["a"]["inference_stats"][part]["ns"] for part in (
        "compute_input", "queue", "compute_infer", "compute_output")] == [2, 4, 6, 8]
    assert stats["b"]["inference_count"] == 3 and stats["b"]["execution_count"] == 1
    assert samples[("multipy_interpreters", ())] == 2
    assert [host.closed_connections(k) for k in (0, 1, 2)] == [0, 1, 1]
    assert [host.busy(k) for k in (0, 1, 2)] == [0, 1, 1]
    with fronts[1].decoding():  # a large request, decoded on a thread: busy too
        assert [host.busy(k) for k in (0, 1, 2)] == [0, 1, 2]
    assert host.busy(2) == 1


def test_turns_are_shared_by_event_loops_and_taken_in_arrival_order():
    """Turns(1): calls waiting on two loops on two threads get the turn in the order
    they asked for it; one whose wait is cancelled takes none; a turn given back goes
    to a waiting call, not back to the free ones."""
    from multipy.serve.host.models import Turns

    turns = Turns(1)
    order: list[str] = []
    loops = [asyncio.new_event_loop() for _ in range(2)]
    threads = [threading.Thread(target=loop.run_forever) for loop in loops]
    for thread in threads:
        thread.start()
    asyncio.run_coroutine_threadsafe(turns.__aenter__(), loops[0]).result(timeout=10)
    assert turns._free == 0

    async def call(name: str) -> None:
        async with turns:
            order.append(name)

    def waiting() -> int:
        with turns._lock:
            return len(turns._waiting)

    def until(count: int) -> None:
        deadline = time.monotonic() + 10
        while waiting() != count:
            assert time.monotonic() < deadline, waiting()
            time.sleep(0.001)

    try:
        first = asyncio.run_coroutine_threadsafe(call("first"), loops[1])
        until(1)
        cancelled = asyncio.run_coroutine_threadsafe(call("cancelled"), loops[0])
        until(2)
        second = asyncio.run_coroutine_threadsafe(call("second"), loops[0])
        until(3)
        cancelled.cancel()
        until(2)
        turns.give()
        first.result(timeout=10)
        second.result(timeout=10)
        assert order == ["first", "second"]
        assert turns._free == 1  # given back by second
    finally:
        for loop in loops:
            loop.call_soon_threadsafe(loop.stop)
        for thread in threads:
            thread.join(timeout=10)
        for loop in loops:
            loop.close()


# -- batching --

def _at_once(count: int, request) -> list:
    """request(0), ..., request(count - 1), each on a thread of its own, at once: their
    values, in that order; the first error any raised, raised here."""
    answers, errors = {}, []

    def one(index: int) -> None:
        try:
            answers[index] = request(index)
        except BaseException as error:  # raised below
            errors.append(error)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=90)
    if errors:
        raise errors[0]
    assert sorted(answers) == list(range(count)), "a request was not answered in time"
    return [answers[index] for index in range(count)]


def test_batching_answers_each_request_with_its_rows(batching, packages):
    model = _eager(packages["rows"])
    before = _metrics(batching)
    requests = 16

    def one(index: int) -> tuple:
        x = np.full((1, 3), index, np.float32) + np.arange(3, dtype=np.float32)
        result = batching.client().infer("rows", [_input("x", x, "FP32", index % 2 == 0)])
        return x, result.as_numpy("output0")

    for x, answer in _at_once(requests, one):
        with torch.no_grad():
            np.testing.assert_array_equal(answer, model(torch.from_numpy(x)).numpy())
    after = _metrics(batching)
    key = (("model", "rows"),)
    assert after[("multipy_inference_requests_total", key)] - \
        before[("multipy_inference_requests_total", key)] == requests
    calls = after[("multipy_model_calls_total", key)] - before[("multipy_model_calls_total", key)]
    assert 2 <= calls < requests  # at most 8 rows a batch, so at least 2 calls
    assert after[("multipy_batch_requests_count", key)] - \
        before[("multipy_batch_requests_count", key)] == calls


def test_batching_keeps_shapes_apart_and_runs_big_requests_alone(batching, packages):
    model = _eager(packages["rows"])
    inputs = [np.ones((1, 3), np.float32), np.ones((2, 4), np.float32) * 2,
              np.arange(30, dtype=np.float32).reshape(10, 3)]  # 10 rows > 8: alone
    answers = _at_once(len(inputs), lambda index: batching.client().infer(
        "rows", [_input("x", inputs[index], "FP32", True)]).as_numpy("output0"))
    for index, x in enumerate(inputs):
        with torch.no_grad():
            np.testing.assert_array_equal(answers[index], model(torch.from_numpy(x)).numpy())


def test_batching_concatenates_and_splits_bytes(batching):
    before = _metrics(batching)
    requests = 12

    def one(index: int) -> tuple:
        rows = 1 + index % 2
        text = np.array([f"r{index}-{row}-\u00e9" * (index % 3) for row in range(rows)],
                        dtype=object)
        return text, batching.client().infer("text", [_input("text", text, "BYTES",
                                                             index % 3 != 0)])

    for text, result in _at_once(requests, one):
        assert _as_bytes(result.as_numpy("upper")) == [t.upper().encode() for t in text]
        np.testing.assert_array_equal(result.as_numpy("lengths"),
                                      [len(t.encode()) for t in text])
        assert _as_bytes(result.as_numpy("same")) == [t.encode() for t in text]
        assert _as_bytes(result.as_numpy("joined")) == [t.encode() for t in text]  # a list
    key = (("model", "text"),)
    calls = _metrics(batching)[("multipy_model_calls_total", key)] - \
        before[("multipy_model_calls_total", key)]
    assert 1 <= calls < requests  # some ran together


def test_a_batch_that_cannot_be_split_is_the_models_fault(batching):
    client = batching.client()
    with pytest.raises(InferenceServerException) as error:
        client.infer("total", [_input("x", np.ones((2, 3), np.float32), "FP32", True)])
    assert error.value.status() == "500" and "cannot be batched" in error.value.message()
    result = client.infer("rows", [_input("x", np.ones((1, 3), np.float32), "FP32", True)])
    np.testing.assert_array_equal(result.as_numpy("output0"), np.full((1, 3), 5, np.float32))


# -- memory --

def test_the_weights_alias_the_archive_mapped_from_the_page_cache(packages):
    """Each interpreter's weights lie in a mapping of the archive's file, at the records'
    offsets: the page cache's pages, in memory once whatever the interpreters."""
    from multipy.serve.host import archive

    path = packages["python_heavy"]
    spans = archive.records(path)
    assert spans and all(size for _, size in spans.values())
    found = []
    with multipy.InterpreterManager(2) as manager:
        for interpreter in manager.all_instances():
            served = interpreter.global_("multipy._inside.serving", "load")(
                path, "model", "model.pkl", spans)
            pointers = interpreter.global_("builtins", "eval")(
                "[p.data_ptr() for p in served.model.parameters()]", {"served": served})
            found.append(pointers.deref())
            maps = [line.split() for line in open("/proc/self/maps")]
            mappings = [(int(first, 16), int(offset, 16))
                        for first, offset in ((m[0].split("-")[0], m[2]) for m in maps
                                              if m[-1] == os.path.realpath(path))]
            for pointer in found[-1]:  # in a mapping of the file, in a record's span
                assert any(0 <= pointer - (base - offset + at) < size
                           for base, offset in mappings
                           for at, size in spans.values()), pointer
    assert len(found[0]) == 4 and found[0] != found[1]  # each interpreter's own mapping


def test_a_host_whose_front_ends_answer_imports_none_of_what_it_never_uses(packages, tmp_path):
    """The host answers liveness, readiness and inference (503) while the models load, and
    the front ends every request once they are ready: it never decodes a request, so it
    never imports numpy (nor torch, uvicorn's command line or rich: HOST_NEVER_IMPORTS)."""
    (tmp_path / "serve_wrapper.py").write_text(WRAPPER)
    port, report = _free_port(), str(tmp_path / "report.json")
    env = {**{k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"},
           "PYTHONUNBUFFERED": "1", "SERVE_TEST_REPORT": report}
    with open(tmp_path / "server.log", "w") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "multipy", "run", str(tmp_path / "serve_wrapper.py"),
             packages["cast"], "--interpreters", "1", "--port", str(port)],
            stdout=out, stderr=subprocess.STDOUT, env=env)
    server = Server(process, port, str(tmp_path / "server.log"), report)
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    request = {"inputs": [{"name": "x", "shape": [2, 3], "datatype": "FP32",
                           "data": x.reshape(-1).tolist()}]}
    try:
        deadline = time.monotonic() + 60
        while True:  # as soon as it listens: the models load
            assert process.poll() is None and time.monotonic() < deadline, server.output()
            try:
                status, answer = _infer_json(server, "cast", request)
                break
            except OSError:
                time.sleep(0.02)
        assert status in (503, 200), answer  # (200: the models were ready already)
        until(lambda: _request(server, "GET", "/v2/health/ready")[0] == 200, 110)
        for _ in range(3):
            status, answer = _infer_json(server, "cast", request)
            assert status == 200 and answer["outputs"][0]["data"] == x.reshape(-1).tolist()
        assert _request(server, "GET", "/metrics")[0] == 200
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0, server.output()
    finally:
        _stop(server)
    with open(report) as f:
        imported = json.load(f)
    assert not any(imported.values()), f"the host imported {imported}"


def test_state_that_forward_writes_is_each_interpreters_own_and_never_lent(packages):
    from multipy.serve.host import archive

    path = packages["wrapped"]
    storages = archive.records(path)
    x = np.arange(8, dtype=np.float32).reshape(2, 4) + 1
    buffers, answers = [], []
    with multipy.InterpreterManager(2) as manager:
        for interpreter in manager.all_instances():
            served = interpreter.global_("multipy._inside.serving", "load")(
                path, "model", "model.pkl", storages)
            buffer = interpreter.global_("builtins", "eval")(
                "served.model.net.last", {"served": served})
            buffers.append(buffer.attr("data_ptr")().deref())
            (name,), (datatype,), array = served.call_value("infer", (None, ("FP32",), x))
            answers.append((name, datatype, array.copy(),
                            array.__array_interface__["data"][0]))
            training = interpreter.global_("builtins", "eval")(
                "served.model.net.training or served.model.net.drop.training",
                {"served": served})
            assert training.deref() is False  # eval() reached the module inside the wrapper
    assert buffers[0] != buffers[1]  # a buffer per interpreter, not one shared
    for (name, datatype, array, pointer), buffer in zip(answers, buffers):
        assert (name, datatype) == ("output0", "FP32")
        assert np.array_equal(array, x)  # dropout off: eval mode
        assert pointer != buffer  # a copy, not the buffer the next call writes


# -- gRPC (the served server also serves it, with --grpc-port 0) --

def _grpc_port(server: Server) -> int:
    """The gRPC port that server's ready line names (which it may write just after it
    answers that it is ready)."""
    until(lambda: "gRPC on" in server.output())
    return int(re.search(r"gRPC on [^ ]*:(\d+)", server.output()).group(1))


def _grpc(server: Server):
    import tritonclient.grpc as grpcclient

    return grpcclient.InferenceServerClient(f"127.0.0.1:{_grpc_port(server)}")


def _grpc_input(name: str, array: np.ndarray, datatype: str):
    import tritonclient.grpc as grpcclient

    tensor = grpcclient.InferInput(name, list(array.shape), datatype)
    tensor.set_data_from_numpy(array)
    return tensor


def _unary(channel, name: str, response):
    """The protocol's RPC name on channel (grpc's), called with multipy's request
    message: its answer, a response message."""
    return channel.unary_unary(f"/inference.GRPCInferenceService/{name}",
                               request_serializer=lambda message: message.SerializeToString(),
                               response_deserializer=response.FromString)


def _client_error(call) -> tuple[str, str]:
    """(status, message) of the InferenceServerException that a tritonclient call
    (HTTP or gRPC) raises."""
    with pytest.raises(InferenceServerException) as raised:
        call()
    return raised.value.status(), raised.value.message()


def test_grpc_health_and_metadata(served):
    client = _grpc(served)
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready("pair") and client.is_model_ready("pair", "1")
    status, message = _client_error(lambda: client.is_model_ready("nope"))
    assert status == "StatusCode.NOT_FOUND" and "unknown model 'nope'" in message
    metadata = client.get_server_metadata(as_json=True)
    assert metadata["name"] == "multipy"
    assert {"binary_tensor_data", "statistics"} <= set(metadata["extensions"])
    model = client.get_model_metadata("pair", as_json=True)
    http = served.client().get_model_metadata("pair")
    assert [i["name"] for i in model["inputs"]] == ["a", "b"]
    assert model["inputs"] == [{**i, "shape": [str(s) for s in i["shape"]]}
                               for i in http["inputs"]]  # int64 as JSON strings


@pytest.mark.parametrize("datatype", DATATYPES)
def test_grpc_every_datatype(served, datatype):
    import tritonclient.grpc as grpcclient

    x = _values(datatype)
    result = _grpc(served).infer("cast", [_grpc_input("x", x, datatype)], request_id="r-7",
                                 outputs=[grpcclient.InferRequestedOutput("same"),
                                          grpcclient.InferRequestedOutput("as_fp64")])
    response = result.get_response(as_json=True)
    assert response["id"] == "r-7" and response["model_name"] == "cast"
    assert [o["name"] for o in response["outputs"]] == ["same", "as_fp64"]
    same = result.as_numpy("same")
    assert same.dtype == x.dtype and np.array_equal(same, x)
    np.testing.assert_array_equal(result.as_numpy("as_fp64"), x.astype(np.float64))


def test_grpc_typed_contents_and_requested_outputs(served):
    """Inputs in typed contents (as KServe's client sends them) are read as raw ones are,
    and the outputs asked for are answered."""
    import grpc

    from multipy.serve.rpc import inference_pb2 as messages

    with grpc.insecure_channel(f"127.0.0.1:{_grpc_port(served)}") as channel:
        infer = _unary(channel, "ModelInfer", messages.ModelInferResponse)
        tensor = messages.ModelInferRequest.InferInputTensor
        request = messages.ModelInferRequest(model_name="pair", inputs=[
            tensor(name="a", datatype="FP32", shape=[1, 3],
                   contents=messages.InferTensorContents(fp32_contents=[5, 6, 7])),
            tensor(name="b", datatype="FP32", shape=[1, 3],
                   contents=messages.InferTensorContents(fp32_contents=[1, 1, 2]))])
        answer = infer(request, timeout=60)
        assert [o.name for o in answer.outputs] == ["output0"]
        assert list(answer.outputs[0].shape) == [1, 3] and answer.outputs[0].datatype == "FP32"
        np.testing.assert_array_equal(np.frombuffer(answer.raw_output_contents[0], "<f4"),
                                      [4, 5, 5])
        request.inputs[1].contents.Clear()
        request.inputs[1].contents.int64_contents.extend([1, 1, 2])
        with pytest.raises(grpc.RpcError) as wrong:
            infer(request, timeout=60)
        assert wrong.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert wrong.value.details() == ("input 'b': FP32 values go in fp32_contents, not in "
                                         "int64_contents")


def test_grpc_errors_are_codes_with_the_http_messages(served):
    """The same mistakes give the same messages over both transports, as gRPC codes."""
    client, http = _grpc(served), served.client()
    x = np.ones((1, 3), np.float32)
    cases = [  # (model, inputs, HTTP status, gRPC code)
        ("nope", [("x", x, "FP32")], "404", "StatusCode.NOT_FOUND"),
        ("fails", [("x", -x, "FP32")], "500", "StatusCode.INTERNAL"),
        ("pair", [("a", x, "FP32"), ("a", x, "FP32")], "400", "StatusCode.INVALID_ARGUMENT"),
    ]
    for model, inputs, http_status, code in cases:
        over_http = _client_error(lambda: http.infer(
            model, [_input(name, array, datatype, True) for name, array, datatype in inputs]))
        over_grpc = _client_error(lambda: client.infer(
            model, [_grpc_input(name, array, datatype) for name, array, datatype in inputs]))
        assert over_http[0] == http_status and over_grpc[0] == code, (over_http, over_grpc)
        assert over_grpc[1] == over_http[1], (over_grpc, over_http)
    assert client.is_server_ready()  # and it serves on


def test_statistics_count_both_transports_in_one_place(served):
    """Triton's statistics extension, over HTTP and gRPC alike: each request, whichever
    carried it, counts once, with its nanoseconds."""
    http, client = served.client(), _grpc(served)

    def stats() -> dict:
        over_http = http.get_inference_statistics("pair")["model_stats"]
        over_grpc = client.get_inference_statistics("pair", as_json=True)["model_stats"]
        assert len(over_http) == len(over_grpc) == 1
        for part in ("success", "fail"):  # (gRPC's JSON: uint64 as strings, 0 left out)
            assert int(over_grpc[0]["inference_stats"][part].get("count", 0)) == \
                over_http[0]["inference_stats"][part]["count"]
        return over_http[0]

    before = stats()
    x = np.ones((1, 3), np.float32)
    for _ in range(3):
        http.infer("pair", [_input("a", x, "FP32", True), _input("b", x, "FP32", True)])
        client.infer("pair", [_grpc_input("a", x, "FP32"), _grpc_input("b", x, "FP32")])
    _client_error(lambda: http.infer("pair", [_input("a", x, "FP32", True)]))  # a missing input
    after = stats()
    counts = lambda s, part: s["inference_stats"][part].get("count", 0)  # noqa: E731
    nanos = lambda s, part: int(s["inference_stats"][part].get("ns", 0))  # noqa: E731
    assert after["name"] == "pair" and after["version"] == "1"
    assert counts(after, "success") == counts(before, "success") + 6
    assert counts(after, "fail") == counts(before, "fail") + 1
    for part in ("success", "fail", "queue", "compute_input", "compute_infer", "compute_output"):
        assert nanos(after, part) > nanos(before, part), part
    assert nanos(after, "success") - nanos(before, "success") >= sum(
        nanos(after, part) - nanos(before, part)
        for part in ("compute_input", "compute_infer", "compute_output"))
    assert after["execution_count"] >= before.get("execution_count", 0) + 6
    assert int(after["last_inference"]) > time.time() * 1000 - 60_000
    every = http.get_inference_statistics()["model_stats"]
    assert {s["name"] for s in every} == {"python_heavy", "cast", "pair", "fails", "slow",
                                          "exits", "blocks", "text"}
    status, _, body = _request(served, "GET", "/v2/models/nope/stats")
    assert status == 404 and "unknown model 'nope'" in json.loads(body)["error"]
    assert _client_error(lambda: client.get_inference_statistics("nope"))[0] == \
        "StatusCode.NOT_FOUND"


def test_grpc_bytes_raw_and_typed(served):
    """BYTES over gRPC: tritonclient's raw (length-prefixed) contents, and bytes_contents;
    any bytes, UTF-8 or not, go both ways."""
    import grpc

    from multipy.serve.rpc import inference_pb2 as messages

    result = _grpc(served).infer("text", [_grpc_input("text", TEXT, "BYTES")])
    assert _as_bytes(result.as_numpy("upper")) == [b"HELLO", "W\u00d6RLD".encode(), b"", b"A B"]
    np.testing.assert_array_equal(result.as_numpy("lengths"), [[5, 6], [0, 3]])
    assert _as_bytes(result.as_numpy("same")) == list(TEXT.reshape(-1))
    with grpc.insecure_channel(f"127.0.0.1:{_grpc_port(served)}") as channel:
        infer = _unary(channel, "ModelInfer", messages.ModelInferResponse)
        request = messages.ModelInferRequest(model_name="text", inputs=[
            messages.ModelInferRequest.InferInputTensor(
                name="text", datatype="BYTES", shape=[3],
                contents=messages.InferTensorContents(bytes_contents=[b"ab", b"\xff\x00", b""]))])
        answer = infer(request, timeout=60)
    raw = dict(zip((o.name for o in answer.outputs), answer.raw_output_contents))
    assert raw["same"] == b"\x02\x00\x00\x00ab\x02\x00\x00\x00\xff\x00\x00\x00\x00\x00"
    np.testing.assert_array_equal(np.frombuffer(raw["lengths"], "<i8"), [2, 2, 0])


def _typed_bytes(model: str, elements: list[bytes]):
    """A ModelInferRequest of model with one BYTES input, x, of elements in bytes_contents."""
    from multipy.serve.rpc import inference_pb2 as messages

    return messages.ModelInferRequest(model_name=model, inputs=[
        messages.ModelInferRequest.InferInputTensor(
            name="x", datatype="BYTES", shape=[len(elements)],
            contents=messages.InferTensorContents(bytes_contents=elements))])


def test_grpc_bytes_contents_cost_what_binary_data_costs_and_are_bounded(large):
    """3,000,000 one-byte elements in bytes_contents (a 9 MB message) raise the server's
    peak memory by about what the same elements as HTTP binary data do (before, by 850
    MB: 300 bytes an element); bytes_contents with more elements than a body of
    --max-request-size (64 MiB) holds as binary data (a 4-byte length each) are refused
    with RESOURCE_EXHAUSTED before any is read, and the memory that its message took is
    given back at once (before, only by the garbage collector's next pass); and the
    server answers on."""
    import grpc

    from multipy.serve.rpc import inference_pb2 as messages

    count = 3_000_000
    header = json.dumps({"inputs": [{"name": "x", "shape": [count], "datatype": "BYTES",
                                     "parameters": {"binary_data_size": 5 * count}}]}).encode()
    (status, _, body), over_http = _peak(large, lambda: _request(
        large, "POST", "/v2/models/shape/infer", header + b"\x01\x00\x00\x00a" * count,
        {"Inference-Header-Content-Length": str(len(header))}))
    assert status == 200 and json.loads(body)["outputs"][0]["data"] == [count]
    with grpc.insecure_channel(f"127.0.0.1:{_grpc_port(large)}") as channel:
        infer = _unary(channel, "ModelInfer", messages.ModelInferResponse)
        answer, over_grpc = _peak(large, lambda: infer(_typed_bytes("shape", [b"a"] * count),
                                                       timeout=120))
        assert np.frombuffer(answer.raw_output_contents[0], "<i8").tolist() == [count]
        print(f"peak memory over HTTP: {over_http >> 20} MiB; over gRPC: {over_grpc >> 20} MiB")
        # (grpcio's own parse of the message takes about 40 bytes an element)
        assert over_grpc < over_http + (200 << 20), (over_http, over_grpc)
        past = (64 << 20) // 4 + 1
        before = _rss(large)
        with pytest.raises(grpc.RpcError) as refused:
            infer(_typed_bytes("shape", [b""] * past), timeout=120)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert refused.value.details() == (
            f"the request's bytes_contents hold {past} BYTES elements, which as binary data "
            f"(a 4-byte length each) take more than the {64 << 20} bytes this server takes "
            f"(--max-request-size)")
        # what grpcio's parse of it took (500 MB) is given back once it is answered
        until(lambda: _rss(large) < before + (200 << 20), 30)
        answer = infer(_typed_bytes("text", [b"ab", b"\xff\x00", b""]), timeout=60)
    raw = dict(zip((o.name for o in answer.outputs), answer.raw_output_contents))
    assert raw["same"] == b"\x02\x00\x00\x00ab\x02\x00\x00\x00\xff\x00\x00\x00\x00\x00"
    np.testing.assert_array_equal(np.frombuffer(raw["lengths"], "<i8"), [2, 2, 0])
    result = _grpc(large).infer("text", [_grpc_input("text", TEXT, "BYTES")])
    assert _as_bytes(result.as_numpy("upper")) == [b"HELLO", "W\u00d6RLD".encode(), b"", b"A B"]


# -- the model repository (--model-control explicit) --

@pytest.fixture(scope="module")
def repository_served(packages, tmp_path_factory):
    """Serves pair and python_heavy, with the folder of every test archive as its model
    repository."""
    server = _start(tmp_path_factory.mktemp("repository"), [packages["pair"], packages["python_heavy"]],
                    "--interpreters", "2", "--model-control", "explicit", "--grpc-port", "0",
                    "--model-repository", os.path.dirname(packages["pair"]))
    try:
        yield server
    finally:
        _stop(server)


def _mapped(server: Server, path: str) -> bool:
    """Whether the server process maps the file at path (an archive whose weights the
    interpreters alias)."""
    with open(f"/proc/{server.process.pid}/maps") as maps:
        return any(line.rstrip("\n").endswith(os.path.realpath(path)) for line in maps)


def test_models_unload_and_load_while_the_others_serve(repository_served, packages):
    server, client = repository_served, repository_served.client()
    x = np.ones((1, 3), np.float32)
    stop, answered, failures = threading.Event(), [], []

    def other_model() -> None:  # pair, all along: never refused
        own = server.client()
        while not stop.is_set():
            try:
                result = own.infer("pair", [_input("a", x, "FP32", True),
                                            _input("b", x, "FP32", True)])
                answered.append(result.as_numpy("output0").sum())
            except Exception as error:  # reported below
                failures.append(error)

    index = {m["name"]: m for m in client.get_model_repository_index()}
    assert {n: (m["state"], m["version"]) for n, m in index.items()} == {
        "pair": ("READY", "1"), "python_heavy": ("READY", "1")}
    heavy = np.ones((1, 48, 16), np.float32)
    assert _mapped(server, packages["python_heavy"])
    thread = threading.Thread(target=other_model)
    thread.start()
    try:
        client.unload_model("python_heavy")
        index = {m["name"]: m for m in client.get_model_repository_index()}
        assert (index["python_heavy"]["state"], index["python_heavy"]["reason"]) == (
            "UNAVAILABLE", "unloaded")
        assert not client.is_model_ready("python_heavy") and client.is_model_ready("pair")
        # the server stays ready: it answers its other models (docs/serving.md)
        for _ in range(4):  # new connections: every interpreter's front end
            assert server.client().is_server_ready()
        status, message = _client_error(
            lambda: client.infer("python_heavy", [_input("x", heavy, "FP32", True)]))
        assert status == "503" and "model 'python_heavy' is not loaded: unloaded" in message
        assert "/v2/repository/models/python_heavy/load" in message
        # its weights, which every interpreter aliased, are given back
        assert not _mapped(server, packages["python_heavy"])
        client.load_model("python_heavy")
        assert client.is_model_ready("python_heavy") and _mapped(server, packages["python_heavy"])
        again = client.infer("python_heavy", [_input("x", heavy, "FP32", True)])
        np.testing.assert_allclose(again.as_numpy("output0"),
                                   _eager(packages["python_heavy"])(torch.from_numpy(heavy))
                                   .detach().numpy(),
                                   rtol=1e-5)
        # a new model, from the archive that the load request's config names (in the
        # model repository)
        client.load_model("negative_fails", config=json.dumps({"path": "fails.pt"}))
        assert client.is_model_ready("negative_fails")
        np.testing.assert_array_equal(
            client.infer("negative_fails", [_input("x", x, "FP32", True)]).as_numpy("output0"), x)
        status, message = _client_error(
            lambda: client.infer("negative_fails", [_input("x", -x, "FP32", True)]))
        assert status == "500" and "negative input" in message
    finally:
        stop.set()
        thread.join(timeout=60)
    assert not failures, failures[0]
    assert len(answered) > 0 and all(value == 0 for value in answered)
    metrics = _metrics(server)
    assert metrics[("multipy_inference_requests_total", (("model", "negative_fails"),))] == 2


def test_repository_requests_that_cannot_be_done_say_why(repository_served, packages):
    client = repository_served.client()
    status, message = _client_error(lambda: client.load_model("nope"))
    assert status == "404" and "unknown model 'nope'" in message and "nope.pt" in message
    not_an_archive = os.path.join(os.path.dirname(packages["pair"]), "not_an_archive.pt")
    with open(not_an_archive, "wb") as f:
        f.write(b"not a zip")
    status, message = _client_error(lambda: client.load_model(
        "broken", config=json.dumps({"path": "not_an_archive.pt"})))
    assert status == "400" and "model 'broken' cannot be loaded" in message
    status, message = _client_error(lambda: client.load_model("cast", config="{not json"))
    assert status == "400" and '"config" must be a JSON object' in message
    status, _, body = _request(repository_served, "POST", "/v2/repository/models/cast/load",
                               json.dumps({"parameters": {"colour": "red"}}).encode())
    assert status == 400 and "'colour'" in json.loads(body)["error"]
    status, message = _client_error(lambda: client.unload_model("nope"))
    assert status == "404" and "unknown model 'nope'" in message
    assert "broken" not in {m["name"] for m in client.get_model_repository_index()}
    client.unload_model("python_heavy")
    try:
        status, _, body = _request(repository_served, "POST", "/v2/repository/index",
                                   json.dumps({"ready": True}).encode())
        assert status == 200 and "pair" in {m["name"] for m in json.loads(body)}
        assert "python_heavy" not in {m["name"] for m in json.loads(body)}
        assert "python_heavy" in {m["name"] for m in client.get_model_repository_index()}
    finally:
        client.load_model("python_heavy")


def _fails_at_load(packages) -> str:
    """An archive, in the test archives' folder, of a model whose example fails (so its
    load does): its name there."""
    spec = importlib.util.spec_from_file_location("serve_test_models",
                                                  os.path.dirname(packages["fails"]) +
                                                  "/serve_test_models.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["serve_test_models"] = module
    try:
        spec.loader.exec_module(module)
        with torch.package.PackageExporter(os.path.join(os.path.dirname(packages["pair"]),
                                                        "fails_at_load.pt")) as exporter:
            exporter.extern(["torch.**", "numpy.**"])
            exporter.intern("serve_test_models")
            exporter.save_pickle("model", "model.pkl", module.Fails())
            exporter.save_pickle("model", "example.pkl", (-torch.ones(1, 3),))
    finally:
        del sys.modules["serve_test_models"]
    return "fails_at_load.pt"


def test_a_load_that_fails_leaves_the_model_unavailable_and_the_metrics_in_order(
        repository_served, packages):
    """A model whose archive is one but that fails as it loads (its example raises) is
    UNAVAILABLE with the reason; the next model loaded is counted under its own name,
    whichever interpreter answers it (the host and every front end give it the same
    slot)."""
    client = repository_served.client()
    status, message = _client_error(lambda: client.load_model(
        "fails_at_load", config=json.dumps({"path": _fails_at_load(packages)})))
    assert status == "500" and "negative input" in message
    index = {m["name"]: m for m in client.get_model_repository_index()}
    assert index["fails_at_load"]["state"] == "UNAVAILABLE"
    assert "failed" in index["fails_at_load"]["reason"] and "negative input" in \
        index["fails_at_load"]["reason"]
    assert not client.is_model_ready("fails_at_load")
    stats = client.get_inference_statistics("fails_at_load")["model_stats"][0]
    assert stats["inference_stats"]["success"]["count"] == 0
    client.load_model("after_failure", config=json.dumps({"path": packages["pair"]}))
    x = np.ones((1, 3), np.float32)
    for _ in range(4):  # new connections: both interpreters' front ends answer some
        repository_served.client().infer("after_failure", [_input("a", x, "FP32", True),
                                                           _input("b", x, "FP32", True)])
    metrics = _metrics(repository_served)
    assert metrics[("multipy_inference_requests_total", (("model", "after_failure"),))] == 4
    assert metrics[("multipy_inference_requests_total", (("model", "fails_at_load"),))] == 0
    stats = client.get_inference_statistics("after_failure")["model_stats"][0]
    assert stats["inference_stats"]["success"]["count"] == 4


def test_repository_over_grpc(repository_served):
    client = _grpc(repository_served)
    client.unload_model("python_heavy")
    index = {m.name: m for m in client.get_model_repository_index().models}
    assert (index["python_heavy"].state, index["python_heavy"].reason) == (
        "UNAVAILABLE", "unloaded")
    assert not client.is_model_ready("python_heavy")
    status, message = _client_error(lambda: client.infer(
        "python_heavy", [_grpc_input("x", np.ones((1, 48, 16), np.float32), "FP32")]))
    assert status == "StatusCode.UNAVAILABLE" and "is not loaded" in message
    client.load_model("python_heavy")
    assert client.is_model_ready("python_heavy")
    assert "model_repository" in client.get_server_metadata(as_json=True)["extensions"]


EVIL = '''
class Evil:
    """Writes the file its state names when it is unpickled: code a load would run."""

    def __init__(self, marker):
        self.marker = marker

    def __getstate__(self):
        return {"marker": self.marker}

    def __setstate__(self, state):
        with open(state["marker"], "w") as f:
            f.write("ran")
'''


def _evil(folder, marker: str) -> str:
    """An archive in folder whose model, unpickled, writes the file marker."""
    return export(folder, "evil_model", EVIL, lambda module: module.Evil(marker), "evil.pt")


def test_loads_read_only_the_model_repository(repository_served, packages, tmp_path):
    """A load that names an archive outside --model-repository (an absolute path, "..",
    a symbolic link out of it, a device, a directory) is refused alike, whether the file
    exists or not, and runs nothing; naming a served model with such a path leaves it
    serving; over gRPC too."""
    marker = tmp_path / "ran"
    outside = tmp_path / "outside"
    outside.mkdir()
    evil = _evil(outside, str(marker))
    repository = os.path.dirname(packages["pair"])
    link = os.path.join(repository, "link_out.pt")
    if not os.path.lexists(link):
        os.symlink(evil, link)
    relative = os.path.relpath(evil, repository)
    client = repository_served.client()
    for path in (evil, relative, "link_out.pt", "/etc/shadow", "/dev/zero", "/nonexistent.pt",
                 "/", ".", "../" * 20 + "etc/passwd"):
        for name in ("evil", "pair"):
            status, message = _client_error(lambda: client.load_model(
                name, config=json.dumps({"path": path})))
            assert (status, message) == (
                "404", f"model {name!r}: the model repository has no archive {path!r}"), path
    grpc_client = _grpc(repository_served)
    status, message = _client_error(lambda: grpc_client.load_model(
        "evil", config=json.dumps({"path": evil})))
    assert status == "StatusCode.NOT_FOUND" and "has no archive" in message
    assert not marker.exists()
    assert "evil" not in {m["name"] for m in client.get_model_repository_index()}
    x = np.ones((1, 3), np.float32)
    assert client.is_model_ready("pair")
    answer = client.infer("pair", [_input("a", x, "FP32", True), _input("b", x, "FP32", True)])
    np.testing.assert_array_equal(answer.as_numpy("output0"), x - x)
    # NAME.pt in the repository, when the load names no path
    status, message = _client_error(lambda: client.load_model("evil"))
    assert status == "404" and "it has no evil.pt" in message


def test_model_names_are_checked(repository_served):
    """Loads of names outside the documented set (empty, control characters, "/", too
    long) are refused with 400 over HTTP and gRPC, and leave nothing in the index or the
    metrics."""
    client = repository_served.client()
    for quoted in ("a%0Ab", "a%09b", "-x", ".hidden", "x" * 129, "caf%C3%A9"):
        status, _, body = _request(repository_served, "POST",
                                   f"/v2/repository/models/{quoted}/load",
                                   json.dumps({"parameters": {"path": "pair.pt"}}).encode())
        assert status == 400 and "cannot name a model" in json.loads(body)["error"], quoted
    grpc_client = _grpc(repository_served)
    for name in ("", "a/b", "a\nb", "x" * (1 << 20)):
        status, message = _client_error(lambda: grpc_client.load_model(
            name, config=json.dumps({"path": "pair.pt"})))
        assert status == "StatusCode.INVALID_ARGUMENT" and "cannot name a model" in message
        assert len(message) < 1000
    names = {m["name"] for m in client.get_model_repository_index()}
    assert not [n for n in names if not n or len(n) > 128 or set(n) & set("/\n\t")], names
    assert len(_request(repository_served, "GET", "/metrics")[2]) < 200_000
    client.load_model("Ok_name-1.2", config=json.dumps({"path": "pair.pt"}))
    assert client.is_model_ready("Ok_name-1.2")
    client.unload_model("Ok_name-1.2")


def test_a_reload_that_fails_leaves_the_loaded_model_serving(repository_served, packages):
    """Loading pair again from an archive that fails to load answers 500 and leaves the
    pair loaded before ready and answering; a reload that succeeds replaces it."""
    repository = os.path.dirname(packages["pair"])
    broken = os.path.join(repository, "broken_pair.pt")
    with open(broken, "wb") as f:  # not a zip file: pair.pt's end cut off
        with open(packages["pair"], "rb") as good:
            f.write(good.read()[:-200])
    client = repository_served.client()
    x = np.ones((1, 3), np.float32)
    failing = _fails_at_load(packages)  # an archive whose example fails as it loads
    status, message = _client_error(lambda: client.load_model(
        "pair", config=json.dumps({"path": failing})))
    assert status == "500" and "the model loaded before serves on" in message, message
    assert client.is_model_ready("pair")
    index = {m["name"]: m for m in client.get_model_repository_index()}
    assert index["pair"]["state"] == "READY"
    for _ in range(4):  # new connections: both interpreters
        answer = repository_served.client().infer(
            "pair", [_input("a", 3 * x, "FP32", True), _input("b", x, "FP32", True)])
        np.testing.assert_array_equal(answer.as_numpy("output0"), 2 * x)
    status, message = _client_error(lambda: client.load_model(
        "pair", config=json.dumps({"path": "broken_pair.pt"})))
    assert status == "400" and client.is_model_ready("pair")
    client.load_model("pair", config=json.dumps({"path": "cast.pt"}))  # a success replaces it
    try:
        answer = client.infer("pair", [_input("x", x, "FP32", True)])
        np.testing.assert_array_equal(answer.as_numpy("same"), x)
    finally:
        client.load_model("pair", config=json.dumps({"path": "pair.pt"}))
    answer = client.infer("pair", [_input("a", x, "FP32", True), _input("b", x, "FP32", True)])
    np.testing.assert_array_equal(answer.as_numpy("output0"), 0 * x)


def test_an_unload_answers_the_requests_received_before(repository_served, tmp_path):
    """An interpreter is in a call (blocked until released) when a request for another
    model arrives, pipelined behind it on the same connection, unread; that model is then
    unloaded, through the other interpreter: the request received before is answered
    once the call ends, and the unload answers then; a request after it gets 503."""
    client = repository_served.client()
    for name in ("blocks", "slow"):
        client.load_model(name)  # blocks.pt and slow.pt, from the model repository
    fifo = str(tmp_path / "gate")
    os.mkfifo(fifo)
    slow = json.dumps({"inputs": [{"name": "seconds", "shape": [1], "datatype": "FP32",
                                   "data": [0.1]}]}).encode()
    blocks = json.dumps({"inputs": [{"name": "path", "shape": [len(fifo)], "datatype": "UINT8",
                                     "data": list(fifo.encode())}]}).encode()
    unloaded: list = []
    writer = None
    with socket.create_connection(("127.0.0.1", repository_served.port), timeout=60) as sock:
        try:
            for model, body in (("blocks", blocks), ("slow", slow)):  # pipelined
                sock.sendall(b"POST /v2/models/%s/infer HTTP/1.1\r\nHost: test\r\n"
                             b"Content-Length: %d\r\n\r\n%s" % (model.encode(), len(body), body))
                if model == "blocks":
                    writer = _until_opened(fifo)  # that interpreter is in the call
            unload = threading.Thread(target=lambda: unloaded.append(_request(
                repository_served, "POST", "/v2/repository/models/slow/unload")))
            unload.start()
            until(lambda: {m["name"]: m["state"] for m in client.get_model_repository_index()}
                  ["slow"] == "UNAVAILABLE")
        finally:
            if writer is not None:
                os.write(writer, b"x")
                os.close(writer)
        for model, (status, body) in zip(("blocks", "slow"), _http_answers(sock)):
            assert status.startswith(b"HTTP/1.1 200 "), (model, status, body)
        unload.join(60)
    assert unloaded and unloaded[0][0] == 200, unloaded
    status, answer = _infer_json(repository_served, "slow", json.loads(slow))
    assert status == 503 and "not loaded: unloaded" in answer["error"]
    client.unload_model("blocks")


def test_repository_load_and_unload_are_off_by_default(served):
    client = served.client()
    for call in (lambda: client.load_model("pair"), lambda: client.unload_model("pair")):
        status, message = _client_error(call)
        assert status == "400" and "--model-control explicit" in message
    assert all(m["state"] == "READY" for m in client.get_model_repository_index())
    assert client.is_model_ready("pair")


# -- the command line --

def _cli(*args: str, patch: str = "", timeout: float = 60) -> subprocess.CompletedProcess:
    code = "\n".join(["import importlib.util", patch, "from multipy.cli import main",
                      f"main({list(args)!r})"])
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=timeout)


def test_a_port_in_use_is_said_in_one_line(packages):
    """The server exits with status 2 and one line that names the address and --port,
    before anything else, when its port is taken."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = _cli("serve", packages["cast"], "--interpreters", "1", "--port", str(port),
                    timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines() == [
        f"ERROR:    cannot listen on 127.0.0.1:{port}: [Errno 98] Address already in use "
        f"(--port picks another port)"], done.stderr


@pytest.mark.parametrize("option", ["--port", "--grpc-port"])
def test_a_port_out_of_range_is_said_in_one_line(packages, option):
    done = _cli("serve", packages["cast"], option, "99999")
    assert done.returncode == 2
    assert done.stderr == (f"multipy serve: error: {option} must be a port number, 0 to 65535 "
                           f"(0: a free one), not 99999\n")


def test_the_first_line_says_it_listens_and_loads_and_a_later_one_that_it_is_ready(served):
    """Listening is not readiness: the first line that names the address says the models
    are loading; "ready" comes once they are."""
    lines = served.output().splitlines()
    listening = [k for k, line in enumerate(lines) if "listening on" in line]
    ready = [k for k, line in enumerate(lines) if "ready in" in line]
    assert len(listening) == 1 and len(ready) == 1 and listening[0] < ready[0], lines
    assert lines[listening[0]].startswith(
        f"INFO:     listening on http://127.0.0.1:{served.port}; loading models"), lines
    assert not any("Uvicorn running" in line for line in lines), lines


def test_cli_serve_help_and_errors(tmp_path):
    result = _cli("serve", "--help")
    assert result.returncode == 0, result.stderr
    for option in ("--module", "--resource", "--name", "--interpreters", "--host", "--port",
                   "--max-batch-size", "--batch-timeout-ms", "--timeout"):
        assert option in result.stdout
    result = _cli("serve", str(tmp_path / "missing.pt"))
    assert result.returncode == 2 and "missing.pt: no such file" in result.stderr
    not_a_package = tmp_path / "model.pt"
    not_a_package.write_bytes(b"not a zip")
    result = _cli("serve", str(not_a_package))
    assert result.returncode == 2 and "not a torch.package archive" in result.stderr


@pytest.mark.parametrize("command, extra, module", [("serve", "serve", "uvicorn"),
                                                     ("bench", "bench", "rich")])
def test_cli_says_which_extra_to_install(command, extra, module):
    hide = (f"real = importlib.util.find_spec\n"
            f"importlib.util.find_spec = lambda name, *a: None if name == {module!r} "
            f"else real(name, *a)")
    result = _cli(command, "--help", patch=hide)
    assert result.returncode == 1
    assert f"pip install 'multipy[{extra}]'" in result.stderr and module in result.stderr
    assert "Traceback" not in result.stderr


# -- last: it stops the shared server --

def test_each_connection_gets_a_loop_of_its_own_that_runs_its_calls(per_loop):
    """Two clients' connections go to the two event loops, and a loop that serves one
    connection runs its calls on its own thread (the same thread for every request); a
    third connection shares a loop, whose calls then go to worker threads: every answer
    is still right."""
    x = np.zeros((1, 2), np.float32)
    threads_seen: list[list[int]] = [[], [], []]
    errors = []

    def client(k: int, requests: int, started: threading.Barrier) -> None:
        try:
            connection = per_loop.client()
            started.wait(timeout=30)  # every connection open before any request
            for _ in range(requests):
                answer = connection.infer("thread", [_input("x", x, "FP32", True)])
                threads_seen[k].append(int(answer.as_numpy("output0")[0]))
            connection.close()
        except BaseException as error:  # reported below
            errors.append(error)

    for clients in (2, 3):
        started = threading.Barrier(clients)
        workers = [threading.Thread(target=client, args=(k, 8, started)) for k in range(clients)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join(timeout=60)
        assert not errors, (errors[0], per_loop.output())
        if clients == 2:
            assert [len(set(seen)) for seen in threads_seen[:2]] == [1, 1], threads_seen
            assert threads_seen[0][0] != threads_seen[1][0], threads_seen
        assert all(len(seen) == 8 for seen in threads_seen[:clients]), threads_seen
        threads_seen = [[], [], []]


def test_at_most_one_call_per_interpreter_whatever_the_loop(per_loop):
    """Four connections on two loops (two each, so their calls go to worker threads)
    with two interpreters: two calls run at once, each alone in its interpreter, and
    two wait; every one is answered."""
    array = np.array([0.5], np.float32)
    answers, errors = [], []
    started = threading.Barrier(4)

    def client() -> None:
        try:
            connection = per_loop.client()
            connection.is_server_live()  # the connection is open, on its loop
            started.wait(timeout=30)
            answers.append(connection.infer("slow", [_input("seconds", array, "FP32", True)]))
            connection.close()
        except BaseException as error:  # reported below
            errors.append(error)

    clients = [threading.Thread(target=client) for _ in range(4)]
    for thread in clients:
        thread.start()
    for thread in clients:
        thread.join(timeout=60)
    assert not errors, (errors[0], per_loop.output())
    assert [a.as_numpy("doubled")[0] for a in answers] == [np.float32(1.0)] * 4
    assert [a.as_numpy("together")[0] for a in answers] == [1] * 4


@contextlib.contextmanager
def _every_interpreter_in_a_call(server: Server, tmp_path) -> Iterator[list]:
    """Both interpreters of server in a call of model blocks that does not end (each on
    a connection of its own: the connections, yielded), until the block is left: then
    the calls end, and each is answered."""
    fifos = [str(tmp_path / f"gate{k}") for k in range(2)]
    writers: list[int] = []
    calls = []
    try:
        for fifo in fifos:  # the second connection goes to the interpreter not in a call
            calls.append(_send_blocks(server, fifo))
            writers.append(_until_opened(fifo))  # the call runs: it opened the FIFO
        yield calls
    finally:
        for writer in writers:
            os.write(writer, b"x")
            os.close(writer)
    for call, fifo in zip(calls, fifos):
        response = call.getresponse()
        assert response.status == 200
        assert bytes(json.loads(response.read())["outputs"][0]["data"]).decode() == fifo
        call.close()


def _send_blocks(server: Server, fifo: str,
                 connection: http.client.HTTPConnection | None = None) -> http.client.HTTPConnection:
    """connection (default: a new one) once it has sent the blocks model a request that
    blocks until fifo (made here) is opened for writing and written to."""
    os.mkfifo(fifo)
    if connection is None:
        connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    connection.request("POST", "/v2/models/blocks/infer", body=json.dumps({"inputs": [
        {"name": "path", "shape": [len(fifo)], "datatype": "UINT8",
         "data": list(fifo.encode())}]}).encode())
    return connection


def test_health_and_metrics_are_answered_while_every_interpreter_is_in_a_call(per_loop,
                                                                            tmp_path):
    """Both interpreters are in a call that does not end (no --timeout): liveness,
    readiness and the metrics, each on a new connection, are answered meanwhile; then
    the calls end and are answered."""
    with _every_interpreter_in_a_call(per_loop, tmp_path) as calls:
        for path in ("/v2/health/live", "/v2/health/ready", "/metrics"):
            assert _request(per_loop, "GET", path)[0] == 200, path
        assert _metrics(per_loop)[("multipy_busy_interpreters", (("model", "blocks"),))] == 2
        assert not any(_readable(call.sock) for call in calls)  # still running


def _sent_in_pieces(server: Server, line: bytes, rest: bytes) -> socket.socket:
    """A new connection to server once it has sent line a byte at a time, then rest."""
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=20)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for k in range(len(line)):
        sock.sendall(line[k:k + 1])
        time.sleep(0.01)
    sock.sendall(rest)
    return sock


def test_a_get_that_arrives_in_pieces_is_answered_while_every_interpreter_is_in_a_call(
        per_loop, tmp_path):
    """While both interpreters are in a call that does not end, a GET whose request line
    arrives a byte at a time is answered (the host waits for the whole line before it
    chooses), and a POST that arrives so is handed to an interpreter, which answers it
    once its call has ended."""
    body = json.dumps({"inputs": [{"name": "x", "shape": [1], "datatype": "FP32",
                                   "data": [1]}]}).encode()
    with _every_interpreter_in_a_call(per_loop, tmp_path) as calls:
        get = _sent_in_pieces(per_loop, b"GET /v2/health/live HTTP/1.1\r\n",
                              b"Host: test\r\n\r\n")
        with get:
            response = http.client.HTTPResponse(get)
            response.begin()  # (before, it waited for a call: a timeout, 20 s)
            assert response.status == 200 and response.read() == b""
        post = _sent_in_pieces(per_loop, b"POST /v2/models/thread/infer HTTP/1.1\r\n",
                               b"Host: test\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        assert not any(_readable(sock) for sock in [post] + [call.sock for call in calls])
    with post:
        post.settimeout(60)
        response = http.client.HTTPResponse(post)
        response.begin()
        assert response.status == 200
        assert len(json.loads(response.read())["outputs"][0]["data"]) == 1


def _until_opened(fifo: str) -> int:
    """A writer's descriptor of fifo, once a reader has opened it (60 s at most)."""
    deadline = time.monotonic() + 60
    while True:
        try:
            return os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        except OSError:  # no reader yet
            assert time.monotonic() < deadline
            time.sleep(0.01)


def test_a_new_connection_goes_to_a_loop_that_is_not_in_a_call(per_loop, tmp_path):
    """While one loop is in a call (its one connection's request, which blocks until
    released), a new connection goes to the other loop, which serves another client's
    idle connection, and is answered while the call still runs."""
    calling = http.client.HTTPConnection("127.0.0.1", per_loop.port, timeout=60)
    idle = http.client.HTTPConnection("127.0.0.1", per_loop.port, timeout=60)
    fifo = str(tmp_path / "gate")
    writer = None
    try:
        for connection in (calling, idle):  # one on each loop, in this order
            connection.request("GET", "/v2/health/live")
            response = connection.getresponse()
            assert (response.status, response.read()) == (200, b"")
        _send_blocks(per_loop, fifo, calling)
        writer = _until_opened(fifo)  # the call has begun, and runs until released
        assert _request(per_loop, "GET", "/v2/health/ready")[0] == 200
        assert not _readable(calling.sock)  # the call still runs
    finally:
        if writer is not None:
            os.write(writer, b"x")
            os.close(writer)
    try:
        response = calling.getresponse()
        assert response.status == 200
        assert bytes(json.loads(response.read())["outputs"][0]["data"]).decode() == fifo
    finally:
        calling.close()
        idle.close()


def _meanwhile(send, decoding, asks: dict) -> tuple[Any, list[str]]:
    """send()'s value, sent on a thread of its own; once decoding() (the server decodes
    it), each of asks (name -> a function that asks the server something and checks its
    answer) is asked in turn: and the names of those answered, in order, with "large"
    where send() returned."""
    answered: list[str] = []
    value = []

    def sending() -> None:
        value.append(send())
        answered.append("large")

    thread = threading.Thread(target=sending)
    thread.start()
    try:
        until(decoding, 120)
        time.sleep(0.2)  # (it has the whole request: it decodes within milliseconds)
        for name, ask in asks.items():
            ask()
            answered.append(name)
    finally:
        thread.join(timeout=120)
    assert value, "the large request was not answered"
    return value[0], answered


def test_a_large_request_is_decoded_while_the_server_answers_others(large):
    """Requests of 16,000,000 BYTES elements (64 MB, which take seconds to decode), over
    HTTP and gRPC: while each decodes, readiness is answered on a connection that the
    one front end serves already, on a new connection and over gRPC, before the large
    request (refused: its data holds one element more than its shape, which is found
    once all are read); a JSON body whose parse holds the interpreter in C (json.loads)
    for a second: a new connection's readiness is answered meanwhile; then the server
    serves as before."""
    import grpc

    from multipy.serve.rpc import inference_pb2 as messages

    count = 16_000_000
    data = b"\x00" * 4 * (count + 1)
    message = (f"input 'x': shape [{count}] has {count} elements, but 4 bytes of its binary "
               f"data are left after them (binary_data_size {len(data)})")
    kept = [http.client.HTTPConnection("127.0.0.1", large.port, timeout=60)]
    channel = grpc.insecure_channel(f"127.0.0.1:{_grpc_port(large)}")
    ready = _unary(channel, "ServerReady", messages.ServerReadyResponse)

    def kept_ready() -> None:
        kept[0].request("GET", "/v2/health/ready")
        response = kept[0].getresponse()
        assert response.status == 200 and response.read() == b""

    def keep_anew() -> None:
        """A new kept connection, which the front end serves once it is answered (the
        one before may have passed its keep-alive time, 5 s, while a large request was
        answered)."""
        kept[0].close()
        kept[0] = http.client.HTTPConnection("127.0.0.1", large.port, timeout=60)
        kept_ready()

    def new_ready() -> None:
        assert _request(large, "GET", "/v2/health/ready")[0] == 200

    def grpc_ready() -> None:
        assert ready(messages.ServerReadyRequest(), timeout=60).ready

    asks = {"kept": kept_ready, "new": new_ready, "grpc": grpc_ready}
    try:
        kept_ready()  # its connection is the front end's, as is the channel's
        grpc_ready()
        header = json.dumps({"inputs": [{"name": "x", "shape": [count], "datatype": "BYTES",
                                         "parameters": {"binary_data_size": len(data)}}]}).encode()
        head = (b"POST /v2/models/shape/infer HTTP/1.1\r\nHost: test\r\nContent-Length: %d\r\n"
                b"Inference-Header-Content-Length: %d\r\n\r\n" % (len(header) + len(data),
                                                                   len(header)))
        sent = threading.Event()
        answer, answered = _meanwhile(
            lambda: _answer_while_sending(large, [head + header, data], sent),
            lambda: sent.is_set() and _all_read(large.port), asks)
        assert answer == (400, message) and answered == ["kept", "new", "grpc", "large"], \
            answered

        with grpc.insecure_channel(f"127.0.0.1:{_grpc_port(large)}") as other:
            infer = _unary(other, "ModelInfer", messages.ModelInferResponse)
            request = messages.ModelInferRequest(
                model_name="shape", raw_input_contents=[data],
                inputs=[messages.ModelInferRequest.InferInputTensor(name="x", datatype="BYTES",
                                                                    shape=[count])])
            received = lambda: _metrics(large)[  # noqa: E731
                ("multipy_inference_requests_total", (("model", "shape"),))]
            before = received()

            def refused() -> tuple:
                with pytest.raises(grpc.RpcError) as error:
                    infer(request, timeout=120)
                return error.value.code(), error.value.details()

            keep_anew()
            answer, answered = _meanwhile(refused, lambda: received() > before, asks)
        assert answer == (grpc.StatusCode.INVALID_ARGUMENT, message)
        assert answered == ["kept", "new", "grpc", "large"], answered

        count = 33_000_000
        body = json.dumps({"inputs": [{"name": "x", "shape": [count], "datatype": "INT8",
                                       "data": [0] * count}]}, separators=(",", ":")).encode()
        sent = threading.Event()
        answer, answered = _meanwhile(
            lambda: _answer_while_sending(large, [b"POST /v2/models/shape/infer HTTP/1.1\r\n"
                                                  b"Host: test\r\nContent-Length: %d\r\n\r\n"
                                                  % len(body), body], sent),
            lambda: sent.is_set() and _all_read(large.port), {"new": new_ready})
        assert answer[0] == 200 and answer[1]["outputs"][0]["data"] == [count]
        assert answered == ["new", "large"], answered
    finally:
        kept[0].close()
        channel.close()
    result = large.client().infer("text", [_input("text", TEXT, "BYTES", True)])
    assert _as_bytes(result.as_numpy("upper")) == [b"HELLO", "W\u00d6RLD".encode(), b"", b"A B"]
    result = _grpc(large).infer("shape", [_grpc_input("x", TEXT, "BYTES")])
    assert result.as_numpy("output0").tolist() == [2, 2]


def test_a_model_that_raises_system_exit_on_the_loop_is_answered(per_loop):
    _system_exit_is_the_models_error(per_loop)


def _http_answers(sock: socket.socket) -> Iterator[tuple[bytes, bytes]]:
    """The answers that come on sock, in order, each as (status line, body): read
    through one buffered reader, so that an answer that came with the one before it is
    not lost."""
    answers = sock.makefile("rb")
    while True:
        status = answers.readline()
        length = 0
        while (line := answers.readline()) not in (b"\r\n", b""):
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":")[1])
        yield status, answers.read(length)


def _readable(sock: socket.socket) -> bool:
    """Whether sock has something to read now (or is closed)."""
    return bool(select.select([sock], [], [], 0)[0])


def _requests_on_threads(server: Server, requests: list[tuple[str, str, np.ndarray, str]],
                         received: Callable[[int], bool]):
    """Each of requests, (model, input name, array, "http" or "grpc"), sent by a client
    of its own on a thread of its own, the next one once received(k) is true of request
    k: (the threads, the answers by request, the errors), filled as they end."""
    answers: list = [None] * len(requests)
    errors: list = []

    def send(k: int, client, tensor) -> None:
        try:
            answers[k] = client.infer(requests[k][0], [tensor]).as_numpy(_OUTPUT[requests[k][0]])
        except BaseException as error:  # reported by _sigterm_answers_all
            errors.append(error)

    threads = []
    for k, (model, name, array, over) in enumerate(requests):
        datatype = "UINT8" if array.dtype == np.uint8 else "FP32"
        client, tensor = ((_grpc(server), _grpc_input(name, array, datatype)) if over == "grpc"
                          else (server.client(), _input(name, array, datatype, True)))
        threads.append(threading.Thread(target=send, args=(k, client, tensor)))
    for k, thread in enumerate(threads):
        thread.start()
        until(lambda: received(k))
    return threads, answers, errors


_OUTPUT = {"slow": "doubled", "blocks": "output0"}


def _sigterm_answers_all(server: Server, requests, expected: list, release=()) -> None:
    """SIGTERM to server, then each fifo of release written to: every request in flight
    is answered with its expected output, it stops accepting, and it exits 0."""
    threads, answers, errors = requests
    server.process.send_signal(signal.SIGTERM)
    for fifo in release:
        until(lambda: write_one(fifo))
    for thread in threads:
        thread.join(timeout=60)
    assert not errors, (errors[0], server.output())
    assert [a.tolist() for a in answers] == [e.tolist() for e in expected]
    assert server.process.wait(timeout=60) == 0, server.output()
    with pytest.raises(OSError):
        _request(server, "GET", "/v2/health/live")  # it stopped accepting
    assert "Shutting down" in server.output()


def test_sigterm_with_a_loop_per_interpreter_answers_requests_in_flight(per_loop, tmp_path):
    """Each loop is in a call (that blocks until released) when two new connections
    come, so that they reach their loops only once the server is stopping: the one that
    sent a request is answered, the idle one is closed, and the server exits 0."""
    fifos = [str(tmp_path / f"gate{k}") for k in range(2)]
    blocked = [_send_blocks(per_loop, fifo) for fifo in fifos]
    writers = [_until_opened(fifo) for fifo in fifos]  # both calls have begun
    late = _send_slow(per_loop, 0.5)
    idle = socket.create_connection(("127.0.0.1", per_loop.port), timeout=60)
    try:
        _until_accepted(per_loop.port)  # a stop closes the listening socket
        per_loop.process.send_signal(signal.SIGTERM)
        for writer in writers:  # the calls end once the server is stopping
            os.write(writer, b"x")
            os.close(writer)
        writers.clear()
        for connection, fifo in zip(blocked, fifos):
            response = connection.getresponse()
            assert response.status == 200, per_loop.output()
            assert bytes(json.loads(response.read())["outputs"][0]["data"]).decode() == fifo
        response = late.getresponse()
        assert response.status == 200, per_loop.output()
        assert json.loads(response.read())["outputs"][0]["data"] == [1.0]
        assert idle.recv(1) == b""  # closed by the server
        assert per_loop.process.wait(timeout=60) == 0, per_loop.output()
    finally:
        for writer in writers:
            os.close(writer)
        for connection in blocked + [late]:
            connection.close()
        idle.close()
    assert per_loop.output().count("Started server process") == 1  # one server's lines


def _tcp(port: int, state: str) -> list[list[str]]:
    """The rows of /proc/net/tcp in state (hex: 01 established, 0A listening) whose local
    or remote port is port, split: sl, local address, remote address, state,
    tx_queue:rx_queue, ..."""
    with open("/proc/net/tcp") as table:
        rows = [line.split() for line in table.readlines()[1:]]
    return [row for row in rows if row[3] == state
            and port in (int(row[1].split(":")[1], 16), int(row[2].split(":")[1], 16))]


def _all_read(port: int) -> bool:
    """Whether the server on port has read every byte sent to it on this machine: no
    connection to it has any queued, on either side."""
    return all(row[4] == "00000000:00000000" for row in _tcp(port, "01"))


def _until_accepted(port: int, seconds: float = 30) -> None:
    """Waits until the server has accepted every connection made to port: its listening
    socket's accept queue (rx_queue of its LISTEN row in /proc/net/tcp) is empty."""
    deadline = time.monotonic() + seconds
    while True:
        waiting = [int(row[4].split(":")[1], 16) for row in _tcp(port, "0A")]
        if waiting and not any(waiting):
            return
        assert time.monotonic() < deadline, waiting
        time.sleep(0.01)


def _send_slow(server: Server, seconds: float,
               connection: http.client.HTTPConnection | None = None) -> http.client.HTTPConnection:
    """connection (default: a new one) once it has sent the slow model a request of
    seconds, in JSON."""
    if connection is None:
        connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    connection.request("POST", "/v2/models/slow/infer", body=json.dumps({"inputs": [
        {"name": "seconds", "shape": [1], "datatype": "FP32", "data": [seconds]}]}).encode())
    return connection


class _FailsOnce(socket.socket):
    """A listening socket whose first accept fails as when the process is out of file
    descriptors."""

    failed = False

    def accept(self):
        if not self.failed:
            self.failed = True
            raise OSError(errno.EMFILE, "Too many open files")
        return super().accept()


def test_accepting_goes_on_after_an_error(caplog):
    """The server's accept loop (in this process) hands a client's connection on
    although accepting it failed once: the error is logged and accepting tries again."""
    from multipy.serve.http.connection import accept

    listener = _FailsOnce(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.setblocking(False)
    port = listener.getsockname()[1]

    def hand(connection: socket.socket) -> None:
        connection.setblocking(True)
        connection.recv(1 << 16)
        connection.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 8\r\n\r\nanswered")
        connection.close()

    def get() -> tuple[int, bytes]:
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        try:
            connection.request("GET", "/")
            response = connection.getresponse()
            return response.status, response.read()
        finally:
            connection.close()

    async def serve() -> tuple[int, bytes]:
        accepting = asyncio.create_task(accept(listener, hand))
        try:
            return await asyncio.wait_for(asyncio.to_thread(get), 60)
        finally:
            accepting.cancel()

    with caplog.at_level(logging.ERROR, logger="multipy.serve"):
        assert asyncio.run(serve()) == (200, b"answered")
    assert listener.failed and "Too many open files" in caplog.text


def test_sigterm_answers_requests_in_flight_and_exits_0(served, tmp_path):
    """A call that blocks until released runs in each interpreter (a new HTTP connection
    goes to a free one) and two slow requests, over HTTP and gRPC, wait behind them when
    SIGTERM comes; then the calls are released, and all four are answered."""
    fifos = [str(tmp_path / f"gate{k}") for k in range(2)]
    for fifo in fifos:
        os.mkfifo(fifo)
    paths = [np.frombuffer(fifo.encode(), np.uint8) for fifo in fifos]
    seconds = np.array([0.2], np.float32)

    def received(k: int) -> bool:
        metrics = _metrics(served)
        return (metrics[("multipy_busy_interpreters", (("model", "blocks"),))] == min(k + 1, 2)
                and metrics[("multipy_inference_queue_length", (("model", "slow"),))]
                == max(k - 1, 0))

    requests = _requests_on_threads(served, [
        ("blocks", "path", paths[0], "http"), ("blocks", "path", paths[1], "http"),
        ("slow", "seconds", seconds, "http"), ("slow", "seconds", seconds, "grpc")], received)
    _sigterm_answers_all(served, requests, [*paths, 2 * seconds, 2 * seconds], release=fifos)
    with open(served.report) as f:
        imported = json.load(f)
    # (numpy: the host decoded the requests it served while every interpreter was stuck)
    assert not any(imported[name] for name in imported if name != "numpy"), imported
