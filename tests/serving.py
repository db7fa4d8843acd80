"""What the tests of `multipy serve` share: the test models (MODELS, exported by
make_packages), servers started in subprocesses on free ports of 127.0.0.1 (_start,
_stop: the wrapper reports what the host imported), and their clients over HTTP and
gRPC (tritonclient's, http.client's and raw sockets; _Events reads a generate_stream's
events one by one).  The servers that several test
modules use are conftest.py's session fixtures.
"""
from __future__ import annotations

import contextlib
import http.client
import importlib.util
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Iterator

import pytest

from conftest import export, free_port, until

torch = pytest.importorskip("torch")
np = pytest.importorskip("numpy")
for _module in ("uvicorn", "starlette", "prometheus_client"):
    pytest.importorskip(_module)
httpclient = pytest.importorskip("tritonclient.http")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402


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


def make_packages(folder) -> dict[str, str]:
    """name -> path of the torch.package archive, in folder, of each of MODELS's models
    (by its name in lower case), and of python_heavy (examples/)."""
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
    port = free_port()
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
    try:
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
    except BaseException:  # (a server that is not ready does not outlive its test)
        _stop(server)
        raise


def _stop(server: Server) -> None:
    if server.process.poll() is None:
        server.process.kill()
    server.process.wait(timeout=30)


def _request(server: Server, method: str, path: str, body: bytes | None = None,
             headers: dict | None = None, timeout: float = 60) -> tuple[int, dict, bytes]:
    """(status, headers, body) of server's answer to a request on a new connection;
    TimeoutError if none comes within timeout seconds."""
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=timeout)
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


class _Events:
    """A generate_stream request on a connection of its own, its events read one by one
    as they arrive."""

    def __init__(self, server, model: str, request: dict) -> None:
        self.socket = socket.create_connection(("127.0.0.1", server.port), timeout=60)
        body = json.dumps(request).encode()
        self.socket.sendall(f"POST /v2/models/{model}/generate_stream HTTP/1.1\r\nHost: x\r\n"
                            f"Content-Type: application/json\r\nContent-Length: {len(body)}"
                            f"\r\n\r\n".encode() + body)
        self._reader = self.socket.makefile("rb")
        self.status = int(self._reader.readline().split()[1])
        self.headers = {}
        while (line := self._reader.readline()) != b"\r\n":
            key, _, value = line.decode().partition(":")
            self.headers[key.lower()] = value.strip()
        assert self.headers.get("transfer-encoding") == "chunked"

    def next(self) -> dict | None:
        """The next event's data, or None at the answer's end."""
        data = b""
        while not data.endswith(b"\n\n"):
            size = int(self._reader.readline(), 16)
            if size == 0:
                self._reader.readline()
                return None
            data += self._reader.read(size)
            self._reader.readline()  # (the chunk's CRLF)
        assert data.startswith(b"data: "), data
        return json.loads(data[len(b"data: "):])

    def rest(self) -> list[dict]:
        found = []
        while (event := self.next()) is not None:
            found.append(event)
        return found

    def close(self) -> None:
        self._reader.close()
        self.socket.close()


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


def _metrics(server: Server, timeout: float = 60) -> dict[tuple[str, tuple], float]:
    """(sample name, sorted labels) -> value of every sample at /metrics (see _request)."""
    status, _, body = _request(server, "GET", "/metrics", timeout=timeout)
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


def _values(datatype: str) -> np.ndarray:
    if datatype == "BOOL":
        return np.array([[True, False, True], [False, False, True]])
    if datatype == "BF16":
        import ml_dtypes  # tritonclient's BF16 arrays (the modules that test BF16 skip without it)

        return np.array([[1.5, -2.25, 0.0], [3.0, 256.0, -0.125]], dtype=ml_dtypes.bfloat16)
    dtype = np.dtype({"FP16": "float16", "FP32": "float32", "FP64": "float64"}.get(
        datatype, datatype.lower()))
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return np.array([[info.min, 0, 1], [2, info.max - 1, info.max]], dtype)
    return np.array([[0.5, -2.0, 65504.0], [1e-3, 0.0, -7.25]], dtype)


#: Text for the Text model: UTF-8 beyond ASCII, an empty string, and a space.
TEXT = np.array([[b"hello", "w\u00f6rld".encode()], [b"", b"a b"]], dtype=object)


def _as_bytes(array: np.ndarray) -> list:
    """The elements of a BYTES array from tritonclient, row-major, as bytes (it gives
    bytes for binary data, str for JSON)."""
    return [v if isinstance(v, bytes) else v.encode() for v in array.reshape(-1)]


def _rss(server: Server, field: str = "VmRSS") -> int:
    """The server process's resident memory (VmHWM: its peak), in bytes."""
    with open(f"/proc/{server.process.pid}/status") as status:
        line = next(line for line in status if line.startswith(f"{field}:"))
    return int(line.split()[1]) * 1024


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


def _grpc_port(server: Server) -> int:
    """The gRPC port that server's ready line names (which it may write just after it
    answers that it is ready)."""
    until(lambda: "gRPC on" in server.output())
    return int(re.search(r"gRPC on [^ ]*:(\d+)", server.output()).group(1))


def _grpc(server: Server):
    import tritonclient.grpc as grpcclient

    return grpcclient.InferenceServerClient(f"127.0.0.1:{_grpc_port(server)}")


def _grpc_alone(server: Server):
    """A gRPC client of server on a connection of its own (grpcio's channels to one
    address otherwise share one)."""
    import tritonclient.grpc as grpcclient

    return grpcclient.InferenceServerClient(f"127.0.0.1:{_grpc_port(server)}", channel_args=[
        ("grpc.use_local_subchannel_pool", 1)])


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


def _until_opened(fifo: str) -> int:
    """A writer's descriptor of fifo, once a reader has opened it (60 s at most)."""
    deadline = time.monotonic() + 60
    while True:
        try:
            return os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        except OSError:  # no reader yet
            assert time.monotonic() < deadline
            time.sleep(0.01)


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


def _send_slow(server: Server, seconds: float,
               connection: http.client.HTTPConnection | None = None) -> http.client.HTTPConnection:
    """connection (default: a new one) once it has sent the slow model a request of
    seconds, in JSON."""
    if connection is None:
        connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    connection.request("POST", "/v2/models/slow/infer", body=json.dumps({"inputs": [
        {"name": "seconds", "shape": [1], "datatype": "FP32", "data": [seconds]}]}).encode())
    return connection


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


def _tcp(port: int, state: str) -> list[list[str]]:
    """The rows of /proc/net/tcp in state (hex: 01 established, 08 closed by the other
    end only, 0A listening) whose local or remote port is port, split: sl, local
    address, remote address, state, tx_queue:rx_queue, ..."""
    with open("/proc/net/tcp") as table:
        rows = [line.split() for line in table.readlines()[1:]]
    return [row for row in rows if row[3] == state
            and port in (int(row[1].split(":")[1], 16), int(row[2].split(":")[1], 16))]


def _all_read(port: int) -> bool:
    """Whether the server on port has read every byte sent to it on this machine: no
    connection to it has any queued, on either side."""
    return all(row[4] == "00000000:00000000" for row in _tcp(port, "01"))


def _all_closed(port: int) -> bool:
    """Whether the server on port has closed every connection made to it on this machine
    (and so has counted it closed: a front end counts a connection as its loop closes
    it): none of its sockets on port is established, or closed by the client only
    (CLOSE_WAIT)."""
    return not any(int(row[1].split(":")[1], 16) == port
                   for state in ("01", "08") for row in _tcp(port, state))


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
