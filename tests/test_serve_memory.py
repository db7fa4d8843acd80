"""What `multipy serve` holds in memory: weights aliased from the archive's mapping, state
each interpreter's own, a host that imports nothing it does not use, and requests of
millions of elements (decoded while the server answers others, bytes_contents bounded);
on a server of its own for the large requests (``large``: 1 interpreter, with gRPC).
"""
from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any

import pytest

from conftest import free_port, until

torch = pytest.importorskip("torch")
np = pytest.importorskip("numpy")
from serving import (TEXT, WRAPPER, Server, _all_read, _answer_while_sending,  # noqa: E402
                     _as_bytes, _grpc, _grpc_input, _grpc_port,
                     _infer_json, _input, _metrics, _request, _rss, _start, _stop,
                     _unary)

import multipy  # noqa: E402


@pytest.fixture(scope="module")
def large(packages, tmp_path_factory):
    server = _start(tmp_path_factory.mktemp("large"), [packages["shape"], packages["text"]],
                    "--interpreters", "1", "--grpc-port", "0")
    try:
        yield server
    finally:
        _stop(server)


def _peak(server: Server, call):
    """call()'s value, and how far the server's resident memory rose, at its peak,
    while call() ran (bytes)."""
    with open(f"/proc/{server.process.pid}/clear_refs", "w") as refs:
        refs.write("5")  # the peak is reset to what the process holds now
    before = _rss(server)
    value = call()
    return value, _rss(server, "VmHWM") - before


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


def test_a_host_whose_front_ends_answer_imports_none_of_what_it_never_uses(packages, tmp_path):
    """The host answers liveness, readiness and inference (503) while the models load, and
    the front ends every request once they are ready: it never decodes a request, so it
    never imports numpy (nor torch, uvicorn's command line or rich: HOST_NEVER_IMPORTS)."""
    (tmp_path / "serve_wrapper.py").write_text(WRAPPER)
    port, report = free_port(), str(tmp_path / "report.json")
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


def _meanwhile(send, decoding, asks: dict) -> tuple[Any, list[str]]:
    """send()'s value, sent on a thread of its own; once decoding() (the server has read
    all of the request and counted it: its front end's loop begins to decode it before
    it reads anything sent after), each of asks (name -> a function that asks the
    server something and checks its answer) is asked in turn: and the names of those
    answered, in order, with "large" where send() returned."""
    answered: list[str] = []
    value = []

    def sending() -> None:
        value.append(send())
        answered.append("large")

    thread = threading.Thread(target=sending)
    thread.start()
    try:
        until(decoding, 120)
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

    def received() -> float:
        """The large requests counted (as each is read, before it is decoded)."""
        return _metrics(large)[("multipy_inference_requests_total", (("model", "shape"),))]

    asks = {"kept": kept_ready, "new": new_ready, "grpc": grpc_ready}
    try:
        kept_ready()  # its connection is the front end's, as is the channel's
        grpc_ready()
        header = json.dumps({"inputs": [{"name": "x", "shape": [count], "datatype": "BYTES",
                                         "parameters": {"binary_data_size": len(data)}}]}).encode()
        head = (b"POST /v2/models/shape/infer HTTP/1.1\r\nHost: test\r\nContent-Length: %d\r\n"
                b"Inference-Header-Content-Length: %d\r\n\r\n" % (len(header) + len(data),
                                                                   len(header)))
        sent, before = threading.Event(), received()
        answer, answered = _meanwhile(
            lambda: _answer_while_sending(large, [head + header, data], sent),
            lambda: sent.is_set() and _all_read(large.port) and received() > before, asks)
        assert answer == (400, message) and answered == ["kept", "new", "grpc", "large"], \
            answered

        with grpc.insecure_channel(f"127.0.0.1:{_grpc_port(large)}") as other:
            infer = _unary(other, "ModelInfer", messages.ModelInferResponse)
            request = messages.ModelInferRequest(
                model_name="shape", raw_input_contents=[data],
                inputs=[messages.ModelInferRequest.InferInputTensor(name="x", datatype="BYTES",
                                                                    shape=[count])])
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
        sent, before = threading.Event(), received()
        answer, answered = _meanwhile(
            lambda: _answer_while_sending(large, [b"POST /v2/models/shape/infer HTTP/1.1\r\n"
                                                  b"Host: test\r\nContent-Length: %d\r\n\r\n"
                                                  % len(body), body], sent),
            lambda: sent.is_set() and _all_read(large.port) and received() > before,
            {"new": new_ready})
        assert answer[0] == 200 and answer[1]["outputs"][0]["data"] == [count]
        assert answered == ["new", "large"], answered
    finally:
        kept[0].close()
        channel.close()
    result = large.client().infer("text", [_input("text", TEXT, "BYTES", True)])
    assert _as_bytes(result.as_numpy("upper")) == [b"HELLO", "W\u00d6RLD".encode(), b"", b"A B"]
    result = _grpc(large).infer("shape", [_grpc_input("x", TEXT, "BYTES")])
    assert result.as_numpy("output0").tolist() == [2, 2]
