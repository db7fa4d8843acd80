"""`multipy serve`'s command line and start-up: ports in use or out of range said in one
line, the first line that says it listens and loads, --help, errors, and the extra to
install when one is missing.
"""
from __future__ import annotations

import socket
import subprocess
import sys

import pytest

pytest.importorskip("torch")  # (archives, checked before the server starts)
pytest.importorskip("uvicorn")


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
    assert f"pip install 'multipy-interpreters[{extra}]'" in result.stderr and module in result.stderr
    assert "Traceback" not in result.stderr


def test_a_folder_or_a_file_that_is_no_archive_gets_the_recipe(tmp_path):
    """A folder that is neither an archive nor a Triton model's says so, and an archive
    that is not one shows how to make one (intern the model's code, extern the rest)."""
    folder = tmp_path / "models"
    folder.mkdir()
    not_a_package = tmp_path / "model.pt"
    not_a_package.write_bytes(b"not a zip")
    for path, said in [(folder, "is a folder, not a torch.package archive"),
                       (not_a_package, "is not a torch.package archive")]:
        result = _cli("serve", str(path))
        assert result.returncode == 2 and said in result.stderr, result.stderr
        assert "exporter.intern(" in result.stderr and "exporter.extern(" in result.stderr
        assert "no such file" not in result.stderr and "Traceback" not in result.stderr


def test_info_into_a_closed_pipe_ends_without_a_traceback():
    """`multipy info | head`: the reader gone before info writes, info stops quietly."""
    info = subprocess.Popen([sys.executable, "-m", "multipy", "info"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    info.stdout.close()  # (before the child has written: it takes longer to start)
    assert info.wait(timeout=60) == 1
    assert info.stderr.read() == ""
