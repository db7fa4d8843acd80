"""Restricted APIs (``--http-restricted-api``, ``--grpc-restricted-protocol``, Triton's
options): their parsing and errors, the check of every HTTP route (an application run
here, without a server), and one server (a subprocess) whose model repository and
statistics need a header over HTTP, and whose model repository needs it over gRPC.
"""
from __future__ import annotations

import asyncio
import json

import pytest

pytest.importorskip("starlette")
grpcclient = pytest.importorskip("tritonclient.grpc")

from serving import _client_error, _grpc_port, _infer_json, _request, _start, _stop  # noqa: E402

from multipy.serve import command  # noqa: E402
from multipy.serve.request import restricted  # noqa: E402
from multipy.serve.request.messages import ProtocolError  # noqa: E402

pytestmark = pytest.mark.timeout(300)

SECRET = "s3cret"
ADMIN = {"admin-key": SECRET}
GRPC_ADMIN = {"triton-grpc-protocol-admin-key": SECRET}

DOUBLE = '''
class Double:
    """y = 2 x."""

    def predict(self, inputs):
        return {"y": inputs["x"] * 2}
'''


# -- the options --

def test_the_options_parse_as_triton_writes_them():
    assert restricted.parse(["model-repository,statistics:Admin-Key=s3:c=ret",
                             "inference:infer-key=abc"], "--http-restricted-api") == (
        ("model-repository", "Admin-Key", "s3:c=ret"), ("statistics", "Admin-Key", "s3:c=ret"),
        ("inference", "infer-key", "abc"))
    assert restricted.parse([], "--http-restricted-api") == ()


@pytest.mark.parametrize("given, said", [
    ("model-reposit:k=v", "unknown API 'model-reposit'"),
    (":k=v", "unknown API ''"),
    ("admin-key=s3cret", "has no ':'"),
    ("model-repository", "has no ':'"),
    ("model-repository:admin-key", "has no '='"),
    ("health:k/1=v", "KEY 'k/1'"),
    ("health:=v", "KEY ''"),
    ("health:k=", "VALUE"),
    ("health:k= s3cret", "VALUE"),
    ("health:k=s3cr\u00e9t", "VALUE"),
])
def test_an_option_that_makes_no_sense_is_refused_without_its_value(given, said):
    with pytest.raises(ValueError) as raised:
        restricted.parse([given], "--http-restricted-api")
    assert said in str(raised.value)
    assert "s3cret" not in str(raised.value) and "s3cr\u00e9t" not in str(raised.value)


def test_an_api_is_restricted_once():
    with pytest.raises(ValueError, match="API 'health' is given twice"):
        restricted.parse(["model-repository,health:k1=v1", "metadata,health:k2=v2"],
                         "--http-restricted-api")


def test_a_grpc_key_is_not_binary():
    with pytest.raises(ValueError, match="-bin"):
        restricted.parse(["health:key-bin=v"], "--grpc-restricted-protocol")
    assert restricted.parse(["health:key-bin=v"], "--http-restricted-api")


def _options(*argv: str):
    parse = command.parser()
    return command.options(parse.parse_args(["model.py:Model", *argv]), parse)


def _refused(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit) as raised:
        _options(*argv)
    assert raised.value.code == 2
    return capsys.readouterr().err


def test_the_command_line_says_what_is_wrong(capsys, tmp_path):
    assert "unknown API 'stats'" in _refused(capsys, "--http-restricted-api", "stats:k=v")
    assert "no '='" in _refused(capsys, "--grpc-restricted-protocol", "health:k",
                                "--grpc-port", "0")
    assert "give --grpc-port" in _refused(capsys, "--grpc-restricted-protocol", "health:k=v")
    assert "--ray" in _refused(capsys, "--ray", "--grpc-restricted-protocol", "health:k=v")
    (tmp_path / "model.py").write_text(DOUBLE)
    parse = command.parser()
    served = command.options(parse.parse_args([
        f"{tmp_path}/model.py:Double", "--http-restricted-api", "health:k=v",
        "--grpc-restricted-protocol", "model-repository:k=v", "--grpc-port", "0"]), parse)
    assert (served.http_restricted, served.grpc_restricted) == (
        (("health", "k", "v"),), (("model-repository", "k", "v"),))
    served = command.options(parse.parse_args([f"{tmp_path}/model.py:Double"]), parse)
    assert (served.http_restricted, served.grpc_restricted) == ((), ())


def test_the_check_names_the_header_and_not_its_value():
    http = restricted.Restrictions([("statistics", "Admin-Key", SECRET)])
    grpc = restricted.Restrictions([("statistics", "Admin-Key", SECRET)],
                                   restricted.GRPC_PREFIX)
    assert (http.header("statistics"), http.header("health"), http.header(None)) == (
        "admin-key", None, None)
    assert grpc.header("statistics") == "triton-grpc-protocol-admin-key"
    for given in (None, b"", b"s3cre", b"s3cret ", "S3CRET"):
        refused = http.refused("statistics", given)
        assert "'admin-key'" in refused and SECRET not in refused
    assert http.refused("statistics", SECRET.encode()) is None
    assert grpc.refused("statistics", SECRET) is None


# -- every HTTP route, without a server --

class _Service:
    """What create_app asks of a server, for requests that never reach a model."""

    ready, states, max_request_size = True, {}, 1 << 20
    grpc_restricted = ()

    def __init__(self, http_restricted) -> None:
        self.http_restricted = http_restricted

    def model(self, name, version=None):
        raise ProtocolError(f"unknown model {name!r}", 404)


def _call(app, method: str, path: str, headers: dict[str, str] | None = None) -> tuple:
    """(status, body) of app's answer to a request without a body."""
    sent = []

    async def receive() -> dict:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
             "method": method, "scheme": "http", "path": path, "raw_path": path.encode(),
             "root_path": "", "query_string": b"", "server": ("127.0.0.1", 8000),
             "client": ("127.0.0.1", 1),
             "headers": [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]}
    asyncio.run(app(scope, receive, send))
    return sent[0]["status"], b"".join(m.get("body", b"") for m in sent[1:])


def test_every_route_but_metrics_is_in_a_category_and_refused_without_its_header():
    from multipy.serve.http.app import create_app

    everything = [(category, "key", "value") for category in restricted.CATEGORIES]
    app = create_app(_Service(everything))
    assert set(restricted.HTTP_ROUTES.values()) - {None} <= set(restricted.CATEGORIES)
    assert [path for path, category in restricted.HTTP_ROUTES.items()
            if category is None] == ["/metrics"]
    for pattern, category in restricted.HTTP_ROUTES.items():
        if category is None:
            continue
        path = pattern.replace("{model}", "m").replace("{version}", "1")
        method = "POST" if path.endswith(("/infer", "/load", "/unload", "/index", "/generate",
                                          "/generate_stream")) else "GET"
        status, body = _call(app, method, path, {"Other": "value"})
        assert status == 403, path
        assert json.loads(body) == {"error": f"the {category!r} API is restricted: the "
                                             f"request must carry the header 'key' with the "
                                             f"value this server was started with"}
        assert _call(app, method, path, {"Key": "valuE"})[0] == 403, path
    # with the header, a request goes on to its endpoint: inference's, without Starlette
    status, body = _call(app, "POST", "/v2/models/m/infer", {"KEY": "value"})
    assert (status, json.loads(body)) == (404, {"error": "unknown model 'm'"})
    assert _call(app, "POST", "/v2/models/m/versions/1/infer", {"key": "value"})[0] == 404
    for path in ("/v2/models/m/generate", "/v2/models/m/versions/1/generate_stream"):
        status, body = _call(app, "POST", path, {"key": "value"})
        assert (status, json.loads(body)) == (404, {"error": "unknown model 'm'"})
    assert _call(app, "GET", "/v2/models/m", {"key": "value"})[0] == 404
    assert _call(app, "GET", "/v2/health/live", {"key": "value"})[0] == 200
    # and with none restricted, nothing asks for it
    assert _call(create_app(_Service(())), "GET", "/v2/health/live")[0] == 200


# -- a server --

@pytest.fixture(scope="module")
def admin_only(tmp_path_factory):
    """Serves double (a class), its model repository and statistics restricted over
    HTTP, its model repository over gRPC."""
    folder = tmp_path_factory.mktemp("restricted")
    (folder / "double.py").write_text(DOUBLE)
    server = _start(folder, [f"{folder}/double.py:Double"], "--interpreters", "1",
                    "--model-control", "explicit", "--grpc-port", "0",
                    "--http-restricted-api", f"model-repository,statistics:admin-key={SECRET}",
                    "--grpc-restricted-protocol", f"model-repository:admin-key={SECRET}")
    try:
        yield server
    finally:
        _stop(server)


def _doubles(server) -> bool:
    status, answer = _infer_json(server, "double", {"inputs": [
        {"name": "x", "shape": [2], "datatype": "FP32", "data": [1, 2]}]})
    return status == 200 and answer["outputs"][0]["data"] == [2.0, 4.0]


def _post(server, path: str, headers: dict | None = None) -> tuple[int, dict | None]:
    status, _, body = _request(server, "POST", path, b"", headers)
    return status, json.loads(body) if body else None


def test_an_unload_without_the_header_is_refused_and_the_model_serves_on(admin_only):
    wanted = ("the 'model-repository' API is restricted: the request must carry the "
              "header 'admin-key' with the value this server was started with")
    for headers in (None, {"admin-key": "wrong"}, {"admin-key": SECRET.upper()},
                    {"x-admin-key": SECRET}):
        assert _post(admin_only, "/v2/repository/models/double/unload", headers) == (
            403, {"error": wanted}), headers
        assert _post(admin_only, "/v2/repository/index", headers)[0] == 403
    assert _request(admin_only, "GET", "/v2/models/double/ready")[0] == 200
    assert _doubles(admin_only)
    assert SECRET not in admin_only.output()


def test_the_header_opens_the_restricted_apis(admin_only):
    status, index = _post(admin_only, "/v2/repository/index", {"Admin-Key": SECRET})
    assert status == 200 and [m["name"] for m in index] == ["double"]
    assert _request(admin_only, "GET", "/v2/models/double/stats")[0] == 403
    assert _request(admin_only, "GET", "/v2/models/stats", headers=ADMIN)[0] == 200
    try:
        assert _post(admin_only, "/v2/repository/models/double/unload", ADMIN) == (200, None)
        assert _request(admin_only, "GET", "/v2/models/double/ready")[0] == 400
    finally:
        assert _post(admin_only, "/v2/repository/models/double/load", ADMIN) == (200, None)
    assert _doubles(admin_only)


def test_unrestricted_apis_need_no_header(admin_only):
    for path in ("/v2/health/live", "/v2/health/ready", "/v2", "/v2/models/double",
                 "/v2/models/double/ready", "/metrics"):
        assert _request(admin_only, "GET", path)[0] == 200, path
    assert _doubles(admin_only)


def test_over_grpc_the_model_repository_needs_its_metadata(admin_only):
    with grpcclient.InferenceServerClient(f"127.0.0.1:{_grpc_port(admin_only)}") as client:
        for headers in (None, {"triton-grpc-protocol-admin-key": "wrong"},
                        {"admin-key": SECRET}):
            status, message = _client_error(
                lambda: client.unload_model("double", headers=headers))
            assert status == "StatusCode.PERMISSION_DENIED", headers
            assert message == ("the 'model-repository' API is restricted: the request must "
                               "carry the header 'triton-grpc-protocol-admin-key' with the "
                               "value this server was started with")
        assert client.is_model_ready("double")
        # statistics are restricted over HTTP only
        assert client.get_inference_statistics("double").model_stats[0].name == "double"
        try:
            client.unload_model("double", headers=GRPC_ADMIN)
            assert not client.is_model_ready("double")
        finally:
            client.load_model("double", headers=GRPC_ADMIN)
        assert client.is_model_ready("double") and client.is_server_ready()
