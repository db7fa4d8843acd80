"""The text classifier example (examples/example_models.py, TextClassifier): its package
carries its tokenizer (trained in memory by examples/generate_examples.py), and
`multipy serve` serves it, BYTES in and out, to tritonclient.http (binary and JSON) and
tritonclient.grpc, each answer equal to the model run eagerly here.  The server runs in a
subprocess on free ports of 127.0.0.1."""
from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import subprocess
import sys
import time
import zipfile
from typing import Any, Iterator

import pytest

torch = pytest.importorskip("torch")
np = pytest.importorskip("numpy")
pytest.importorskip("tokenizers")
for _module in ("uvicorn", "starlette", "prometheus_client", "grpc"):
    pytest.importorskip(_module)
httpclient = pytest.importorskip("tritonclient.http")
grpcclient = pytest.importorskip("tritonclient.grpc")

import torch.package  # noqa: E402

pytestmark = pytest.mark.timeout(300)

EXAMPLES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples")
TEXTS = np.array([b"I love this wonderful movie", "the food was awful and cold".encode(),
                  b"the train leaves at nine", "caf\u00e9 \u00fcber alles".encode(), b""],
                 dtype=object)


def example(name: str) -> Any:
    """The module examples/NAME.py, imported here."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(EXAMPLES, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def package(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("text_classifier")
    return example("generate_examples").generate(str(folder), ["text_classifier"])[
        "text_classifier"]


@pytest.fixture(scope="module")
def eager(package):
    """The packaged model, loaded and called here (no server)."""
    model = torch.package.PackageImporter(package).load_pickle("model", "model.pkl")

    def call(texts):
        with torch.no_grad():
            probabilities, labels = model(texts)
        return probabilities.numpy(), labels

    return call


@contextlib.contextmanager
def serving(folder, *arguments: str, env: dict[str, str] | None = None
            ) -> Iterator[tuple[str, str]]:
    """(HTTP address, gRPC address) of `multipy serve ARGUMENTS --interpreters 2` on free
    ports, once it is ready, its log in folder, with env added to its environment."""
    log = folder / "server.log"
    env = {**{k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"},
           "PYTHONUNBUFFERED": "1", **(env or {})}
    with open(log, "w") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "multipy", "serve", *arguments, "--interpreters", "2",
             "--port", "0", "--grpc-port", "0"], stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 240
        while not (ready := re.search(r"ready in .* http://([^/]+)/.* gRPC on (\S+)",
                                      log.read_text())):
            assert process.poll() is None, f"the server exited:\n{log.read_text()}"
            assert time.monotonic() < deadline, f"the server was not ready:\n{log.read_text()}"
            time.sleep(0.2)
        yield ready.group(1), ready.group(2)
    finally:
        process.kill()
        process.wait(timeout=30)


def classify(server: tuple[str, str], transport: str, model: str, outputs: tuple[str, str],
             texts: np.ndarray = TEXTS) -> tuple[np.ndarray, list[bytes]]:
    """(probabilities, labels) that model served by server answers for texts over
    transport ("http-binary", "http-json" or "grpc"), its outputs named outputs; checks
    that they come as FP32 and BYTES."""
    http_address, grpc_address = server
    client_module = grpcclient if transport == "grpc" else httpclient
    if transport == "grpc":
        client, timeout = grpcclient.InferenceServerClient(grpc_address), {"client_timeout": 60}
    else:
        client, timeout = httpclient.InferenceServerClient(http_address, network_timeout=60), {}
    binary = {} if transport == "grpc" else {"binary_data": transport == "http-binary"}
    text = client_module.InferInput("text", [len(texts)], "BYTES")
    text.set_data_from_numpy(texts, **binary)
    requested = [client_module.InferRequestedOutput(name, **binary) for name in outputs]
    try:
        result = client.infer(model, [text], outputs=requested, **timeout)
    finally:
        client.close()
    # a protobuf message over gRPC (tritonclient's as_json=True gives None), a dict over HTTP
    datatypes = [output.datatype if transport == "grpc" else output["datatype"]
                 for output in map(result.get_output, outputs)]
    assert datatypes == ["FP32", "BYTES"]
    # tritonclient.http gives a JSON answer's BYTES as str
    return result.as_numpy(outputs[0]), [each.encode() if isinstance(each, str) else each
                                         for each in result.as_numpy(outputs[1])]


@pytest.fixture(scope="module")
def server(package, tmp_path_factory):
    """(HTTP address, gRPC address) of `multipy serve PACKAGE --interpreters 2`."""
    with serving(tmp_path_factory.mktemp("served"), package) as addresses:
        yield addresses


def test_the_package_carries_the_tokenizer(package, eager):
    with zipfile.ZipFile(package) as archive:
        code = [name for name in archive.namelist() if name.endswith(".py")]
    assert not any("tokenizers" in name for name in code)  # externed, not copied
    importer = torch.package.PackageImporter(package)
    model = importer.load_pickle("model", "model.pkl")
    assert model._tokenizer is None  # rebuilt from its JSON on first use
    example, = importer.load_pickle("model", "example.pkl")
    probabilities, labels = importer.load_pickle("model", "expected.pkl")
    assert example.dtype == object and all(isinstance(each, bytes) for each in example)
    got_probabilities, got_labels = eager(example)
    np.testing.assert_allclose(got_probabilities, probabilities.numpy(), rtol=1e-5, atol=1e-6)
    assert list(got_labels) == list(labels)
    assert probabilities.shape == (len(example), len(model.labels))
    np.testing.assert_allclose(probabilities.sum(-1).numpy(), 1, rtol=1e-5)
    # str elements are taken as their UTF-8 bytes are
    as_str = np.array([each.decode() for each in example], dtype=object)
    np.testing.assert_allclose(eager(as_str)[0], got_probabilities, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("transport", ["http-binary", "http-json", "grpc"])
def test_served_over_each_transport(server, eager, transport):
    got_probabilities, got_labels = classify(server, transport, "text_classifier",
                                             ("output0", "output1"))
    probabilities, labels = eager(TEXTS)
    np.testing.assert_allclose(got_probabilities, probabilities, rtol=1e-5, atol=1e-6)
    assert got_labels == list(labels)
    assert set(labels) <= {b"negative", b"neutral", b"positive"}
