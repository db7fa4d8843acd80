"""`multipy serve FILE.py:CLASS`: models written as Python classes (load, predict, async
predict, declared inputs, InvalidInput), beside an archive, over HTTP and gRPC, with
--timeout (calls on a worker thread) and with batching (calls on the loop); and the
errors named at start.
"""
from __future__ import annotations

import json
import sys

import pytest

pytest.importorskip("torch")
np = pytest.importorskip("numpy")
pytest.importorskip("tritonclient.http")
grpcclient = pytest.importorskip("tritonclient.grpc")

from test_serve import (_cli, _grpc_port, _infer_json, _infer_together,  # noqa: E402
                        _request, _start, _stop, packages)  # noqa: F401

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
'''


@pytest.fixture(scope="module")
def classes(tmp_path_factory):
    folder = tmp_path_factory.mktemp("classes")
    (folder / "models.py").write_text(CLASSES)
    (folder / "factor.txt").write_text("3")
    return folder


@pytest.fixture(scope="module")
def class_served(classes, packages, tmp_path_factory):
    """Scaler and Echo beside an archive, with --timeout and gRPC."""
    server = _start(tmp_path_factory.mktemp("class_served"),
                    [f"{classes}/models.py:Scaler", f"{classes}/models.py:Echo",
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


@pytest.mark.parametrize("target, says", [
    ("nowhere.py:Scaler", "nowhere.py: no such file"),
    ("{folder}/models.py:Missing", "has no class Missing at its top level (its classes: "
                                   "Scaler, Echo, Broken, NoPredict)"),
    ("{folder}/models.py:NoPredict", "class NoPredict of"),
    ("no_such_module_here:Scaler", "no module 'no_such_module_here' on the server's Python path"),
])
def test_a_class_that_cannot_be_served_is_named_at_start(classes, target, says):
    done = _cli("serve", target.format(folder=classes), "--interpreters", "1")
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and says in lines[0] and "Traceback" not in done.stderr, done.stderr


def test_a_class_whose_load_raises_stops_the_start(classes, tmp_path):
    """load() raising ends the start-up with exit status 1 and the interpreter's
    traceback, which names the class's own line."""
    import subprocess

    done = subprocess.run(
        [sys.executable, "-m", "multipy", "serve", f"{classes}/models.py:Broken",
         "--interpreters", "1", "--port", "0"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr
    assert "RuntimeError: no weights here" in done.stderr
    assert 'raise RuntimeError("no weights here")' in done.stderr
