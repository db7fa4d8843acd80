"""Readiness as Triton's ``--strict-readiness`` says it (docs/call/index.md, "The API"): by
default a server is ready only while every model that was not unloaded is ready, one
at least; ``--strict-readiness false`` asks nothing of the models once they have
loaded.  Over HTTP and gRPC, with two servers (subprocesses) that start with one model
(a class) and ``--model-control explicit``, and with the decision itself
(repository.not_ready).
"""
from __future__ import annotations

import json
import zipfile

import pytest

pytest.importorskip("starlette")
grpcclient = pytest.importorskip("tritonclient.grpc")

from serving import _grpc_port, _request, _start, _stop  # noqa: E402

from multipy.serve import command  # noqa: E402
from multipy.serve.request.repository import (LOADING, READY, UNAVAILABLE,  # noqa: E402
                                              UNLOADED, not_ready)

pytestmark = pytest.mark.timeout(300)

DOUBLE = '''
class Double:
    """y = 2 x."""

    def predict(self, inputs):
        return {"y": inputs["x"] * 2}
'''


def test_the_decision():
    unloaded, failed = (UNAVAILABLE, UNLOADED), (UNAVAILABLE, "loading broken.pt failed: X")
    assert not_ready({"a": (READY, "")}) is None
    assert not_ready({"a": (READY, ""), "b": unloaded}) is None
    assert not_ready({"a": unloaded}) == (
        "no model is loaded: every one was unloaded (POST /v2/repository/models/NAME/load "
        "loads one)")
    assert not_ready({"a": (READY, ""), "b": failed}) == (
        "model 'b' is UNAVAILABLE: loading broken.pt failed: X")
    assert not_ready({"a": (READY, ""), "b": (LOADING, "loading b.pt"), "c": failed}) == (
        "model 'b' is LOADING: loading b.pt (and 1 more model(s) not ready)")
    for states in ({"a": unloaded}, {"a": (READY, ""), "b": failed}):
        assert not_ready(states, strict=False) is None


def test_the_option(capsys):
    parse = command.parser()
    for given, strict in (("false", False), ("False", False), ("0", False), ("true", True),
                          ("yes", True)):
        assert parse.parse_args(["m.pt", "--strict-readiness", given]).strict_readiness is strict
    assert parse.parse_args(["m.pt"]).strict_readiness is True
    with pytest.raises(SystemExit):
        parse.parse_args(["m.pt", "--strict-readiness", "maybe"])
    assert "'maybe' is not true or false" in capsys.readouterr().err


def _repository(folder) -> None:
    """The model repository in folder: not_an_archive.pt, a file that is not a zip, and
    broken.pt, which looks like an archive until it is loaded."""
    (folder / "not_an_archive.pt").write_bytes(b"not a zip")
    with zipfile.ZipFile(folder / "broken.pt", "w") as broken:
        broken.writestr("broken/.data/version", "6\n")
        broken.writestr("broken/model/model.pkl", b"not a pickle")


def _served(tmp_path_factory, *options: str):
    folder = tmp_path_factory.mktemp("readiness")
    (folder / "double.py").write_text(DOUBLE)
    _repository(folder)
    return _start(folder, [f"{folder}/double.py:Double"], "--interpreters", "1",
                  "--model-control", "explicit", "--model-repository", str(folder),
                  "--grpc-port", "0", *options)


@pytest.fixture(scope="module")
def strict(tmp_path_factory):
    server = _served(tmp_path_factory)
    try:
        yield server
    finally:
        _stop(server)


@pytest.fixture(scope="module")
def lenient(tmp_path_factory):
    server = _served(tmp_path_factory, "--strict-readiness", "false")
    try:
        yield server
    finally:
        _stop(server)


def _ready(server) -> tuple[int, str | None]:
    """The status of /v2/health/ready, and its error; gRPC's ServerReady says the same."""
    status, _, body = _request(server, "GET", "/v2/health/ready")
    with grpcclient.InferenceServerClient(f"127.0.0.1:{_grpc_port(server)}") as client:
        assert client.is_server_ready() == (status == 200)
    return status, json.loads(body)["error"] if body else None


def _post(server, path: str, body: dict | None = None) -> tuple[int, str | None]:
    status, _, answer = _request(server, "POST", path, json.dumps(body or {}).encode())
    return status, json.loads(answer)["error"] if answer else None


def test_a_server_whose_only_model_is_unloaded_is_not_ready(strict):
    assert _ready(strict) == (200, None)
    assert _post(strict, "/v2/repository/models/double/unload") == (200, None)
    try:
        assert _ready(strict) == (400, "no model is loaded: every one was unloaded "
                                       "(POST /v2/repository/models/NAME/load loads one)")
        assert _request(strict, "GET", "/v2/health/live")[0] == 200
    finally:
        assert _post(strict, "/v2/repository/models/double/load") == (200, None)
    assert _ready(strict) == (200, None)


def test_a_load_refused_before_it_starts_changes_nothing(strict):
    status, error = _post(strict, "/v2/repository/models/other/load",
                          {"parameters": {"path": "not_an_archive.pt"}})
    assert status == 400 and "not a torch.package archive" in error
    assert _ready(strict) == (200, None)


def test_a_failed_load_makes_the_server_not_ready_until_that_model_is_unloaded(strict):
    status, error = _post(strict, "/v2/repository/models/broken/load",
                          {"parameters": {"path": "broken.pt"}})
    assert status == 500 and "model 'broken': loading" in error
    status, reason = _ready(strict)
    assert status == 400 and reason.startswith("model 'broken' is UNAVAILABLE: loading ")
    assert "broken.pt failed: " in reason
    assert _request(strict, "GET", "/v2/models/double/ready")[0] == 200  # it serves on
    assert _post(strict, "/v2/repository/models/broken/unload") == (200, None)
    assert _ready(strict) == (200, None)
    _, _, index = _request(strict, "POST", "/v2/repository/index", b"{}")
    assert {m["name"]: (m["state"], m["reason"]) for m in json.loads(index)} == {
        "double": (READY, ""), "broken": (UNAVAILABLE, UNLOADED)}


def test_without_strict_readiness_the_models_do_not_count(lenient):
    assert _ready(lenient) == (200, None)
    status, _ = _post(lenient, "/v2/repository/models/broken/load",
                      {"parameters": {"path": "broken.pt"}})
    assert status == 500 and _ready(lenient) == (200, None)
    assert _post(lenient, "/v2/repository/models/double/unload") == (200, None)
    assert _ready(lenient) == (200, None)
    assert _request(lenient, "GET", "/v2/models/double/ready")[0] == 400
