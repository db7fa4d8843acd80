"""`multipy serve FILE.py:CLASS`: models written as Python classes (load, predict, async
predict, declared inputs, InvalidInput), beside an archive, over HTTP and gRPC, with
--timeout (calls on a worker thread) and with batching (calls on the loop); and the
errors named at start, before the server listens.
"""
from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from conftest import free_port

pytest.importorskip("torch")
np = pytest.importorskip("numpy")
pytest.importorskip("tritonclient.http")
grpcclient = pytest.importorskip("tritonclient.grpc")

from serving import (_grpc_port, _infer_json, _infer_together, _request,  # noqa: E402
                     _start, _stop)

pytestmark = pytest.mark.timeout(300)

CLASSES = '''
import asyncio
import os

import numpy as np
import torch

from multipy.serve import InvalidInput


class Scaler:
    """y = x times the factor that load() reads; declares its input and output."""

    inputs = [{"name": "x", "datatype": "FP32", "shape": [-1, 4]}]
    outputs = [{"name": "y", "datatype": "FP32", "shape": [-1, 4]}]

    def load(self):
        with open(os.path.join(os.path.dirname(__file__), "factor.txt")) as f:
            self.factor = float(f.read())

    def predict(self, inputs):
        x = inputs["x"]
        if (x < 0).any():
            raise InvalidInput("x must not be negative")
        return {"y": torch.from_numpy(x) * self.factor}


class Echo:
    """Its inputs back, after a turn of the event loop; rows counts the rows it got."""

    async def predict(self, inputs):
        await asyncio.sleep(0)
        rows = next(iter(inputs.values())).shape[0]
        return {**inputs, "rows": np.array([rows] * rows, np.int64)}


class Broken:
    def load(self):
        raise RuntimeError("no weights here")

    def predict(self, inputs):
        return inputs


class NoPredict:
    def load(self):
        pass


class BadInit:
    def __init__(self):
        raise ValueError("no config given")

    def predict(self, inputs):
        return inputs


class Net(torch.nn.Module):
    """A plain module: served as it is, in eval mode (its dropout then does nothing)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.linear = torch.nn.Linear(4, 2)
        self.dropout = torch.nn.Dropout(0.9)

    def forward(self, x, shift):
        return self.dropout(self.linear(x)) + shift


class DeclaredNet(Net):
    """Net with inputs declared under names that are not forward's parameters."""

    inputs = [{"name": "features", "datatype": "FP32", "shape": [-1, 4]},
              {"name": "offset", "datatype": "FP32", "shape": [-1, 1]}]


class OptionalNet(torch.nn.Module):
    """Two optional inputs, declared as a and b: forward's x and shift, by position."""

    inputs = [{"name": "a", "datatype": "FP32", "shape": [-1], "optional": True},
              {"name": "b", "datatype": "FP32", "shape": [-1], "optional": True}]

    def forward(self, x=None, shift=None):
        return (x if x is not None else 0) + (shift if shift is not None else 100)


class NeedsSize(torch.nn.Module):
    def __init__(self, size):
        super().__init__()
        self.linear = torch.nn.Linear(size, 1)

    def forward(self, x):
        return self.linear(x)


class Base:
    pass


class NoPredictOfItsBases(Base):
    pass
'''

IMPORT_FAILS = '''
import no_such_dependency_here


class Model:
    def predict(self, inputs):
        return inputs
'''


@pytest.fixture(scope="module")
def classes(tmp_path_factory):
    folder = tmp_path_factory.mktemp("classes")
    (folder / "models.py").write_text(CLASSES)
    (folder / "import_fails.py").write_text(IMPORT_FAILS)
    (folder / "factor.txt").write_text("3")
    return folder


@pytest.fixture(scope="module")
def class_served(classes, packages, tmp_path_factory):
    """Scaler, Echo and three nn.Modules beside an archive, with --timeout and gRPC."""
    server = _start(tmp_path_factory.mktemp("class_served"),
                    [f"{classes}/models.py:Scaler", f"{classes}/models.py:Echo",
                     f"{classes}/models.py:Net", f"{classes}/models.py:DeclaredNet",
                     f"{classes}/models.py:OptionalNet",
                     packages["pair"]],
                    "--interpreters", "2", "--timeout", "10", "--grpc-port", "0")
    try:
        yield server
    finally:
        _stop(server)


def _x(values, shape=(1, 4), name="x", datatype="FP32"):
    return {"inputs": [{"name": name, "shape": list(shape), "datatype": datatype,
                        "data": values}]}


def test_a_class_serves_beside_an_archive(class_served):
    for _ in range(4):  # new connections: both interpreters
        status, answer = _infer_json(class_served, "scaler", _x([1, 2, 3, 4]))
        assert status == 200, answer
        assert answer["outputs"] == [{"name": "y", "datatype": "FP32", "shape": [1, 4],
                                      "data": [3.0, 6.0, 9.0, 12.0]}]
    status, answer = _infer_json(class_served, "pair", {"inputs": [
        {"name": "a", "shape": [1, 3], "datatype": "FP32", "data": [3, 3, 3]},
        {"name": "b", "shape": [1, 3], "datatype": "FP32", "data": [1, 1, 1]}]})
    assert status == 200 and answer["outputs"][0]["data"] == [2.0, 2.0, 2.0]
    status, _, body = _request(class_served, "GET", "/v2/models/scaler")
    assert status == 200 and json.loads(body) == {
        "name": "scaler", "versions": ["1"], "platform": "python",
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 4]}],
        "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1, 4]}]}


def test_a_class_says_400_and_its_declared_inputs_are_checked(class_served):
    assert _infer_json(class_served, "scaler", _x([-1, 2, 3, 4])) == (
        400, {"error": "x must not be negative"})
    assert _infer_json(class_served, "scaler", _x([1, 2, 3, 4], shape=(4,))) == (
        400, {"error": "model 'scaler': input 'x' has shape [4], not [-1, 4] (-1: any size)"})
    assert _infer_json(class_served, "scaler", _x([1, 2, 3, 4], name="z"))[0] == 400


def test_an_async_predict_gets_every_input_by_name(class_served):
    status, answer = _infer_json(class_served, "echo", {"inputs": [
        {"name": "text", "shape": [2], "datatype": "BYTES", "data": ["hi", "w\u00f6rld"]},
        {"name": "n", "shape": [2], "datatype": "INT32", "data": [7, 8]}]})
    assert status == 200, answer
    assert {o["name"]: o["data"] for o in answer["outputs"]} == {
        "text": ["hi", "w\u00f6rld"], "n": [7, 8], "rows": [2, 2]}


def test_a_class_over_grpc(class_served):
    with grpcclient.InferenceServerClient(f"127.0.0.1:{_grpc_port(class_served)}") as client:
        x = grpcclient.InferInput("x", [2, 4], "FP32")
        x.set_data_from_numpy(np.arange(8, dtype=np.float32).reshape(2, 4))
        answer = client.infer("scaler", [x])
        np.testing.assert_array_equal(answer.as_numpy("y"),
                                      3 * np.arange(8, dtype=np.float32).reshape(2, 4))
        assert client.get_model_metadata("echo").platform == "python"


def _net_inputs(x_name: str, shift_name: str) -> tuple[dict, object]:
    """A request of Net's two inputs under these names, shift first; and Net's answer."""
    import torch

    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    shift = np.ones((2, 1), dtype=np.float32)
    namespace: dict = {}
    exec(CLASSES, namespace)
    expected = namespace["Net"]().eval()(torch.from_numpy(x), torch.from_numpy(shift))
    return {"inputs": [
        {"name": shift_name, "datatype": "FP32", "shape": [2, 1], "data": shift.ravel().tolist()},
        {"name": x_name, "datatype": "FP32", "shape": [2, 4], "data": x.ravel().tolist()}]}, \
        expected.detach().numpy().ravel()


def test_an_nn_module_class_is_served_as_it_is(class_served):
    request, expected = _net_inputs("x", "shift")
    status, answer = _infer_json(class_served, "net", request)
    assert status == 200, answer
    assert answer["outputs"][0]["data"] == pytest.approx(expected)
    status, _, body = _request(class_served, "GET", "/v2/models/net")
    assert [i["name"] for i in json.loads(body)["inputs"]] == ["x", "shift"]


def test_an_nn_modules_declared_inputs_go_by_position_in_declared_order(class_served):
    """Its inputs are not named as forward's parameters: forward gets them in the order
    the class declares them, whatever the request's order."""
    for _ in range(2):  # new connections: both interpreters
        request, expected = _net_inputs("features", "offset")
        status, answer = _infer_json(class_served, "declarednet", request)
        assert status == 200, answer
        assert answer["outputs"][0]["data"] == pytest.approx(expected)


def test_a_declared_input_left_out_before_one_given_is_a_400(class_served):
    """By position, a left-out optional input would move the next one into its place."""
    def infer(**given):
        return _infer_json(class_served, "optionalnet", {"inputs": [
            {"name": name, "datatype": "FP32", "shape": [2], "data": data}
            for name, data in given.items()]})

    status, answer = infer(b=[2, 2], a=[1, 1])
    assert status == 200 and answer["outputs"][0]["data"] == [3, 3], answer
    status, answer = infer(a=[1, 1])
    assert status == 200 and answer["outputs"][0]["data"] == [101, 101], answer
    status, answer = infer(b=[1, 1])
    assert status == 400 and "input 'a' is missing" in answer["error"], answer


def test_an_nn_module_that_needs_arguments_is_refused_with_its_wrapper(classes):
    port = free_port()
    run = subprocess.run([sys.executable, "-m", "multipy", "serve",
                          f"{classes}/models.py:NeedsSize", "--interpreters", "1",
                          "--port", str(port)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2, run.stderr
    assert "cannot be made without arguments (size)" in run.stderr
    assert run.stderr.count("class ServedNeedsSize:") == 1, run.stderr  # (said once)
    assert "def predict(self, inputs): return self.model(" in run.stderr


def test_requests_to_a_class_are_batched(classes, tmp_path):
    """With --max-batch-size, requests that arrive together reach predict as one batch
    (calls on the event loop: no --timeout), each answered with its own rows."""
    server = _start(tmp_path, [f"{classes}/models.py:Echo"], "--interpreters", "1",
                    "--max-batch-size", "8", "--batch-timeout-ms", "500")
    try:
        answers = _infer_together(server, "echo", [
            _x([k] * 2, shape=(2,), name="v", datatype="INT64") for k in range(3)])
        for k, (status, answer) in enumerate(answers):
            assert status == 200, answer
            outputs = {o["name"]: o["data"] for o in answer["outputs"]}
            assert outputs["v"] == [k, k]
            assert outputs["rows"] == [6, 6]  # predict got the three requests' rows at once
    finally:
        _stop(server)


def test_a_class_served_by_several_processes(classes, tmp_path):
    """With --processes, each process loads the class on its first interpreter before
    the supervisor listens, then serves it as a single server does."""
    server = _start(tmp_path, [f"{classes}/models.py:Scaler"], "--interpreters", "1",
                    "--processes", "2")
    try:
        for _ in range(4):  # new connections: both processes
            status, answer = _infer_json(server, "scaler", _x([1, 2, 3, 4]))
            assert status == 200 and answer["outputs"][0]["data"] == [3.0, 6.0, 9.0, 12.0]
        server.process.send_signal(signal.SIGTERM)
        assert server.process.wait(timeout=120) == 0, server.output()
    finally:
        _stop(server)


def _refused(target: str, *options: str) -> tuple[subprocess.CompletedProcess, bool]:
    """Runs ``multipy serve target`` on a free port, as a server that should refuse to
    start: (how it ended, whether a connection to its port ever succeeded while it ran,
    tried every 20 ms)."""
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "multipy", "serve", target, "--interpreters", "1",
         "--port", str(port), *options], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True)
    ended, connected = threading.Event(), []

    def probe() -> None:
        while not ended.is_set():
            try:
                socket.create_connection(("127.0.0.1", port), timeout=5).close()
                connected.append(port)
            except OSError:
                pass
            time.sleep(0.02)

    prober = threading.Thread(target=probe, daemon=True)
    prober.start()
    try:
        out, err = process.communicate(timeout=240)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
        ended.set()
        prober.join(30)
    return subprocess.CompletedProcess(process.args, process.returncode, out, err), \
        bool(connected)


@pytest.mark.parametrize("target, says", [
    ("nowhere.py:Scaler", "nowhere.py: no such file"),
    ("{folder}/models.py:Missing", "has no class Missing at its top level (its classes: "
                                   "Scaler, Echo, Broken, NoPredict, BadInit, Net, "
                                   "DeclaredNet, OptionalNet, NeedsSize, Base, "
                                   "NoPredictOfItsBases)"),
    ("{folder}/models.py:NoPredict", "class NoPredict of"),
    ("no_such_module_here:Scaler", "no module 'no_such_module_here' on the server's Python path"),
])
def test_a_class_that_cannot_be_found_is_named_in_one_line(classes, target, says):
    """Checked without an interpreter, before the port is bound."""
    done, connected = _refused(target.format(folder=classes))
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and says in lines[0] and "Traceback" not in done.stderr, done.stderr
    assert not connected


@pytest.mark.parametrize("target, says, traceback, options", [
    ("import_fails.py:Model", "ModuleNotFoundError: No module named 'no_such_dependency_here'",
     'import_fails.py", line 2, in <module>', ()),
    ("models.py:Broken", "RuntimeError: no weights here", 'raise RuntimeError("no weights here")',
     ()),
    ("models.py:BadInit", "ValueError: no config given", 'raise ValueError("no config given")',
     ()),
    ("models.py:NoPredictOfItsBases", "TypeError: models.NoPredictOfItsBases has no predict "
                                      "method", None, ()),
    ("models.py:Broken", "RuntimeError: no weights here", 'raise RuntimeError("no weights here")',
     ("--processes", "2")),
], ids=["import", "load", "init", "predict", "load-processes"])
def test_a_class_whose_code_fails_stops_the_server_before_it_listens(
        classes, target, says, traceback, options):
    """An error of the class's own code, as the first interpreter loads it, is said in one
    line that names the class, with the interpreter's traceback (which names the class's
    own line), and the server exits with status 2 without ever listening; with
    --processes too (the supervisor listens once a process has loaded its classes)."""
    done, connected = _refused(f"{classes}/{target}", *options)
    assert done.returncode == 2, done.stderr
    assert f"multipy serve: {classes}/{target}: loading it in an interpreter raised {says}" \
        in done.stderr.splitlines(), done.stderr
    if traceback is not None:
        assert traceback in done.stderr
    assert not connected and "listening on" not in done.stderr, done.stderr


SLOW_LOAD = '''
import time

import numpy as np


class SlowLoad:
    def load(self):
        time.sleep(2)  # (before the server listens: the first interpreter loads it then)

    def predict(self, inputs):
        return {"y": np.asarray(inputs["x"])}
'''


def test_ready_in_counts_the_load_before_listening(tmp_path):
    """A class loads on the first interpreter before the server listens: "ready in"
    counts that load too, from the command's start."""
    (tmp_path / "slow_load.py").write_text(SLOW_LOAD)
    server = _start(tmp_path, [f"{tmp_path}/slow_load.py:SlowLoad"], "--interpreters", "1")
    try:
        (ready,) = [line for line in server.output().splitlines() if "ready in" in line]
        assert float(ready.split("ready in ")[1].split(" s")[0]) >= 2.0, ready
    finally:
        _stop(server)
