"""The model repository (--model-control explicit): models loaded and unloaded while the
others serve, loads that cannot be done saying why, loads that read only the model
repository, model names checked, reloads, and an unload that answers the requests
received before it; on a server of its own (``repository_served``).
"""
from __future__ import annotations

import importlib.util
import json
import os
import socket
import sys
import threading

import pytest

from conftest import until

torch = pytest.importorskip("torch")
np = pytest.importorskip("numpy")
from serving import (Server, _client_error, _eager, _evil, _grpc, _grpc_input,  # noqa: E402
                     _http_answers, _infer_json, _input, _metrics, _request, _start,
                     _stop, _until_opened)


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
        # the server stays ready: it answers its other models (docs/operate/repository.md)
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
            # each look on a new connection: the host hands it to the free interpreter (a
            # connection kept from before may be the blocked one's, and wait with it)
            until(lambda: {m["name"]: m["state"] for m in json.loads(_request(
                repository_served, "POST", "/v2/repository/index", b"{}")[2])}
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
