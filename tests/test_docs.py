"""The documentation site's reference is made from the code (docs/hooks/reference.py, the
MkDocs hook that ``make docs-build`` runs): every option of the commands' parsers and every
metric the server renders is in what it makes, and the table of errors names every status
the server's code answers, and no other; the Kubernetes manifest's command starts a
server that answers its probes; and the user-facing text names no issue numbers, and the
README stays a first screen."""
from __future__ import annotations

import ast
import importlib.util
import http.client
import os
import re
import subprocess
import sys
import time

import pytest

from conftest import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def hook():
    spec = importlib.util.spec_from_file_location(
        "docs_reference", os.path.join(ROOT, "docs", "hooks", "reference.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _options(parser) -> set[str]:
    return {option for action in parser._actions for option in action.option_strings
            if action.help != "==SUPPRESS=="}


def test_the_cli_reference_has_every_option_of_each_parser(hook):
    pytest.importorskip("uvicorn")
    from multipy.cli import parsers
    from multipy.serve.command import parser as serve_parser
    from multipy.shell import parser as shell_parser

    main, run = parsers()
    for command, parser in (("multipy", main), ("run", run), ("serve", serve_parser()),
                            ("shell", shell_parser())):
        page = hook.on_page_markdown(f"# x\n\n<!-- generated: cli {command} -->\n")
        assert "generated:" not in page
        missing = [option for option in _options(parser) if f"`{option}" not in page]
        assert not missing, f"{command}: {missing}"
    assert "--processes" in hook.on_page_markdown("<!-- generated: cli serve -->")


def test_the_metrics_reference_has_every_metric_the_server_renders(hook):
    pytest.importorskip("prometheus_client")
    from multipy.serve.request.board import STATUSES
    from multipy.serve.request.metrics import Metrics

    text = Metrics(["m"], 1).render()[0].decode()
    rendered = {name.removesuffix("_total")
                for name in re.findall(r"^# TYPE (\w+) ", text, re.MULTILINE)}
    page = hook.on_page_markdown("<!-- generated: metrics -->")
    documented = {name.removesuffix("_total")  # counters: with or without it, by version
                  for name in re.findall(r"^\| `(\w+)` \|", page, re.MULTILINE)}
    assert len(rendered) > 5
    assert documented == rendered
    assert ", ".join(map(str, STATUSES)) in page


#: The code that answers HTTP requests: its statuses are its int literals 400-599 (it has
#: no other such numbers; generated protobuf code apart).
_SERVING_CODE = ("multipy/serve", "multipy/_inside")
#: Statuses that the server answers through a library, with no number in its code:
#: Starlette's router's 405 (tests/test_serve_errors.py has the server answer it).
_BY_LIBRARIES = {405}


def _statuses(source: str) -> set[int]:
    """The statuses that Python source writes: its int literals 400-599 (not its strings
    or comments)."""
    return {node.value for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Constant) and type(node.value) is int
            and 400 <= node.value < 600}


def _answered() -> dict[int, list[str]]:
    """Each status of the serving code, with the files that write it."""
    found: dict[int, list[str]] = {}
    for folder in _SERVING_CODE:
        for directory, _, names in os.walk(os.path.join(ROOT, folder)):
            for name in names:
                if name.endswith(".py") and not name.endswith("_pb2.py"):
                    path = os.path.join(directory, name)
                    with open(path) as f:
                        for status in _statuses(f.read()):
                            found.setdefault(status, []).append(os.path.relpath(path, ROOT))
    return found


def _drift(answered: dict[int, list[str]], table: dict[int, str]) -> tuple[dict, set]:
    """(the statuses answered that the table does not name, with where; those it names
    that nothing answers)."""
    return ({status: where for status, where in answered.items() if status not in table},
            set(table) - set(answered) - _BY_LIBRARIES)


def test_the_error_table_names_every_status_the_server_answers_and_no_other(hook):
    pytest.importorskip("grpc")
    from multipy.serve.request.messages import ANSWERS
    from multipy.serve.rpc.server import CODES

    assert _drift(_answered(), ANSWERS) == ({}, set())
    page = hook.on_page_markdown("<!-- generated: errors -->")
    assert {int(status) for status in re.findall(r"^\| (\d+) \|", page, re.MULTILINE)} \
        == set(ANSWERS)
    assert set(CODES) <= set(ANSWERS)
    for status, code in CODES.items():  # each gRPC code beside its status
        assert f"| {status} | {code.name} |" in page
    with open(os.path.join(ROOT, "docs", "call", "index.md")) as f:
        assert "<!-- generated: errors -->" in f.read()


def test_a_status_in_the_code_that_the_table_lacks_fails():
    from multipy.serve.request.messages import ANSWERS

    source = ("def answer(request):\n"
              "    note = 'answered 410'  # 411 in a comment\n"
              "    if request.teapot:\n"
              "        raise ProtocolError('a teapot', 418)\n"
              "    return _error(404, 'unknown')\n")
    assert _statuses(source) == {404, 418}
    assert _drift({404: ["a.py"], 418: ["a.py"]}, ANSWERS)[0] == {418: ["a.py"]}
    # and a status the table names that no code answers
    assert _drift({}, {**ANSWERS, 418: "never"})[1] >= {418}


def test_the_python_reference_documents_every_public_name(hook):
    import multipy

    page = hook.on_page_markdown("<!-- generated: python-api -->")
    for name in multipy.__all__:
        assert re.search(rf"^::: multipy\.[\w.]+\.{name}$", page, re.MULTILINE), name


def test_an_unknown_generated_part_fails_the_build(hook):
    with pytest.raises(ValueError, match="nothing generates 'nothing'"):
        hook.on_page_markdown("<!-- generated: nothing -->")


def test_no_issue_numbers_in_user_facing_text():
    pages = [os.path.join(ROOT, "README.md")] + [
        os.path.join(folder, name) for folder, _, names in os.walk(os.path.join(ROOT, "docs"))
        for name in names if name.endswith(".md")]
    found = [f"{os.path.relpath(path, ROOT)}: {match.group(0)}" for path in pages
             for match in re.finditer(r"\b[Ii]ssues? #?\d+", open(path).read())]
    assert not found


def test_the_readme_is_a_first_screen_with_the_two_commands():
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    assert readme.count("\n") < 150
    assert "make serve   # " in readme and "make test    # " in readme
    assert "multipy-interpreters" in readme


def _get(port: int, path: str) -> int:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        connection.request("GET", path)
        return connection.getresponse().status
    finally:
        connection.close()


def test_the_kubernetes_manifest_runs_and_its_probes_are_answered(tmp_path):
    """The manifest of docs/operate/kubernetes.md: its container's command is one that
    multipy serve takes, its ports are the command's, and the server it starts (with a
    model of the test's, on 127.0.0.1, free ports and one interpreter) answers its
    liveness and readiness probes with 200."""
    yaml = pytest.importorskip("yaml")
    pytest.importorskip("uvicorn")
    from multipy.serve.command import parser

    with open(os.path.join(ROOT, "docs", "operate", "kubernetes.md")) as f:
        manifest = yaml.safe_load(re.search(r"```yaml\n(.*?)```", f.read(), re.S).group(1))
    assert (manifest["apiVersion"], manifest["kind"]) == ("apps/v1", "Deployment")
    pod = manifest["spec"]["template"]["spec"]
    assert manifest["spec"]["selector"]["matchLabels"].items() <= \
        manifest["spec"]["template"]["metadata"]["labels"].items()
    [container] = pod["containers"]
    command = container["command"]
    assert command[:2] == ["multipy", "serve"]
    options = parser().parse_args(command[2:])
    ports = {port["name"]: port["containerPort"] for port in container["ports"]}
    assert ports == {"http": options.port, "grpc": options.grpc_port}
    assert pod["terminationGracePeriodSeconds"] > options.graceful_timeout
    probes = [container[probe]["httpGet"] for probe in ("livenessProbe", "readinessProbe")]
    assert {probe["port"] for probe in probes} == {"http"}

    model = tmp_path / "echo.py"
    model.write_text("class Echo:\n    def predict(self, inputs):\n"
                     "        return {'y': inputs['x']}\n")
    port = free_port()
    given = {"/models/model.pt": f"{model}:Echo", "0.0.0.0": "127.0.0.1",
             str(options.port): str(port), str(options.grpc_port): str(free_port()),
             str(options.interpreters): "1"}
    log = tmp_path / "server.log"
    with open(log, "w") as out:
        server = subprocess.Popen([sys.executable, "-m", "multipy", *[
            given.get(word, word) for word in command[1:]]], stdout=out,
            stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 90
        while "ready in" not in log.read_text():
            assert server.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        assert [_get(port, probe["path"]) for probe in probes] == [200, 200]
    finally:
        server.terminate()
        server.wait(timeout=60)
    assert server.returncode == 0, log.read_text()
