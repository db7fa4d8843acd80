"""`multipy shell`: a prompt, -c code or a script run inside interpreter 0 of a manager,
with a torch.package's importer and model bound.  Each test runs the command in a fresh
process (a process holds at most 15 interpreters), with a timeout."""
from __future__ import annotations

import os
import pty
import re
import select
import signal
import subprocess
import sys
import textwrap
import time

import pytest

HANG = 100  #: seconds a shell command may take before the test fails (torch is slow to import)


def _env() -> dict[str, str]:
    # No PYTHONUNBUFFERED: the shell must flush what the code inside printed itself.
    return {**{k: v for k, v in os.environ.items() if k not in ("PYTHONUNBUFFERED",)},
            "TERM": "dumb"}


def _command(*args: str) -> list[str]:
    return [sys.executable, "-m", "multipy", "shell", *args]


def shell(*args: str, input: str | None = None, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run(_command(*args), input=input, capture_output=True, text=True,
                          timeout=HANG, env=_env(), cwd=cwd)


def _read_until(fd: int, token: bytes, seen: bytearray, seconds: float = HANG) -> bytes:
    """Reads fd into seen until token is in it; returns what came up to the token and
    keeps the rest.  TimeoutError (with what came) if it does not come in time."""
    deadline = time.monotonic() + seconds
    while token not in seen:
        left = deadline - time.monotonic()
        ready, _, _ = select.select([fd], [], [], max(left, 0))
        if not ready:
            raise TimeoutError(f"no {token!r} within {seconds} s; got {bytes(seen)!r}")
        try:
            data = os.read(fd, 4096)
        except OSError:  # a pty whose other end closed
            data = b""
        if not data:
            raise EOFError(f"the shell closed its output before {token!r}; got {bytes(seen)!r}")
        seen += data
    end = seen.index(token) + len(token)
    text = bytes(seen[:end])
    del seen[:end]
    return text


#: A block that says when it runs and then spins in Python code until interrupted.
SPIN = textwrap.dedent("""\
    n = 0
    def spin():
        global n
        print("spinning", flush=True)
        while True:
            n += 1

    spin()
    """)


def test_c_runs_inside_an_interpreter_with_argv():
    code = ("import sys, multipy._inside as inside; "
            "print('multipy.manager' in sys.modules, inside._current is not None, sys.argv)")
    result = shell("-c", code, "x", "--interpreters", "3")
    assert result.returncode == 0, result.stderr
    # The host imported multipy.manager to make the manager; the interpreter did not.
    assert result.stdout == "False True ['-c', 'x', '--interpreters', '3']\n"


@pytest.mark.parametrize("code, status, stderr", [
    ("print('fine')", 0, ""),
    ("import sys; sys.exit(7)", 7, ""),
    ("raise SystemExit('bye')", 1, "bye\n"),
    ("1/0", 1, 'Traceback (most recent call last):\n  File "<string>", line 1, in <module>\n'
               "ZeroDivisionError: division by zero\n"),
    ("def f(:", 1, "SyntaxError: invalid syntax\n"),
])
def test_c_exits_with_the_codes_status(code, status, stderr):
    result = shell("-c", code)
    assert result.returncode == status, result.stderr
    if code.startswith("def"):  # shown as python shows it: the line, no frame of multipy's
        assert result.stderr.startswith('  File "<string>", line 1\n'), result.stderr
        assert result.stderr.endswith(stderr), result.stderr
    else:
        assert result.stderr == stderr


def test_file_runs_as_a_script_with_its_arguments(tmp_path):
    folder = tmp_path / "app"
    folder.mkdir()
    (folder / "helper.py").write_text("WORD = 'helped'\n")
    script = folder / "main.py"
    script.write_text(textwrap.dedent("""\
        import sys
        import helper  # the script's folder is sys.path[0], as with python FILE
        print(__name__, __file__, helper.WORD, sys.argv[1:])
        sys.exit(int(sys.argv[1]))
        """))
    result = shell(str(script), "5", "-c", "--interpreters", "2", cwd=tmp_path)
    assert result.returncode == 5, result.stderr
    assert result.stdout == f"__main__ {script} helped ['5', '-c', '--interpreters', '2']\n"
    from_stdin = shell("-", "a", input="import sys; print(sys.argv); sys.exit(3)\n")
    assert (from_stdin.returncode, from_stdin.stdout) == (3, "['-', 'a']\n"), from_stdin.stderr
    missing = shell(str(tmp_path / "nowhere.py"))
    assert missing.returncode == 2 and "can't open file" in missing.stderr


def test_a_file_neither_script_nor_archive_is_said_to_be_what_it_is(tmp_path):
    legacy = tmp_path / "weights.pt"  # what torch.save's legacy format starts with
    legacy.write_bytes(b"\x80\x02\x8a\x0al\xfc\x9cF\xf9 j\xa8P\x19" + bytes(64))
    result = shell(str(legacy))
    assert result.returncode == 2
    assert "neither a Python script nor a torch.package archive" in result.stderr
    assert "torch.save wrote in its legacy format" in result.stderr


def test_a_program_that_starts_interpreters_is_told_to_use_multipy_run(tmp_path):
    """Code inside an interpreter cannot start interpreters: it gets InterpreterStartError
    at once, saying so, and a program that ends with it is told in one line what to run
    instead (exit status 2)."""
    script = tmp_path / "starts.py"
    script.write_text("import multipy\nprint('before')\nmultipy.InterpreterManager(2)\n")
    result = shell(str(script))
    assert (result.returncode, result.stdout) == (2, "before\n"), result.stderr
    assert result.stderr == (
        f"multipy shell: the program starts interpreters of its own, which a program run "
        f"inside an interpreter cannot: run it with `multipy run {script}` instead\n")
    code = ("import multipy\ntry:\n    multipy.InterpreterManager(1)\n"
            "except multipy.InterpreterStartError as error:\n    print(error)")
    caught = shell("-c", code)
    assert caught.returncode == 0, caught.stderr
    assert "cannot start interpreters of their own" in caught.stdout
    assert "`multipy run SCRIPT`" in caught.stdout


def test_a_piped_prompt_runs_each_statement_inside_and_keeps_its_names():
    lines = ["x = 6 * 7", "x", "1/0", "for i in range(2):", "    print(i, x)", "",
             "import sys; 'multipy.manager' in sys.modules"]
    result = shell(input="\n".join(lines) + "\n")
    assert result.returncode == 0, result.stderr
    # Expression results echo as at Python's prompt; the prompts went to stderr.
    assert result.stdout == "42\n0 42\n1 42\nFalse\n"
    assert ('Traceback (most recent call last):\n  File "<console>", line 1, in <module>\n'
            'ZeroDivisionError: division by zero\n') in result.stderr
    assert "inside interpreter 0 of a manager of 1" in result.stderr  # the banner
    assert ">>> " in result.stderr and "... " in result.stderr


def test_exit_at_the_prompt_gives_its_status():
    result = shell("-q", input="print('before')\nexit(4)\nprint('after')\n")
    assert (result.returncode, result.stdout) == (4, "before\n"), result.stderr
    assert "multipy shell" not in result.stderr  # -q: no banner


def test_ctrl_c_stops_a_running_statement_and_the_prompt_goes_on():
    process = subprocess.Popen(_command("-q"), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, env=_env())
    try:
        process.stdin.write(SPIN.encode())
        process.stdin.flush()
        _read_until(process.stdout.fileno(), b"spinning\n", bytearray())
        process.send_signal(signal.SIGINT)
        out, err = process.communicate(b"print('alive', n >= 0)\n", timeout=HANG)
    finally:
        process.kill()
        process.wait()
    err = err.decode()
    assert process.returncode == 0, err
    assert out == b"alive True\n"
    assert err.count("KeyboardInterrupt") == 1, err  # the traceback's, printed once
    assert re.search(r'  File "<console>", line \d, in spin\nKeyboardInterrupt\n', err), err


def test_a_terminal_prompt_completes_names_inside_and_survives_ctrl_c():
    # (Ctrl-C at the prompt itself is input()'s, as in any Python; a signal sent just
    # before readline waits for a key is seen only at the next key, so no test sends one.)
    master, slave = pty.openpty()
    process = subprocess.Popen(_command("-q"), stdin=slave, stdout=slave, stderr=slave,
                               env=_env(), start_new_session=True)
    os.close(slave)
    seen = bytearray()
    try:
        # Each wait is for what the code prints, never for a prompt: text typed before
        # readline is back may be echoed by the terminal before the prompt.
        _read_until(master, b">>> ", seen)
        os.write(master, b"only_inside = 41\n")
        os.write(master, b"only_ins\t + 1\n")  # readline asks the interpreter to complete
        _read_until(master, b"42\r\n", seen)
        os.write(master, SPIN.encode())
        _read_until(master, b"spinning\r\n", seen)
        process.send_signal(signal.SIGINT)
        traceback = _read_until(master, b"KeyboardInterrupt\r\n", seen)
        assert b", in spin\r\nKeyboardInterrupt\r\n" in traceback  # stopped in the block
        os.write(master, b"print('alive', n >= 0)\n")
        _read_until(master, b"alive True\r\n", seen)
        os.write(master, b"exit(3)\n")
        assert process.wait(timeout=HANG) == 3
    finally:
        process.kill()
        process.wait()
        os.close(master)


# -- with a torch.package archive --


@pytest.fixture(scope="module")
def packages(tmp_path_factory):
    """(an archive with a Linear at model/model.pkl, an archive without one)."""
    torch = pytest.importorskip("torch")
    from torch.package import PackageExporter

    folder = tmp_path_factory.mktemp("shell_packages")
    model = torch.nn.Linear(3, 2)
    with torch.no_grad():
        model.weight.copy_(torch.arange(6.0).view(2, 3))
        model.bias.copy_(torch.tensor([0.5, -0.5]))
    with_model, without = folder / "linear.pt", folder / "notes.pt"
    with PackageExporter(str(with_model)) as exporter:
        exporter.extern("torch.**")
        exporter.save_pickle("model", "model.pkl", model)
        exporter.save_pickle("other", "twice.pkl", model)
    with PackageExporter(str(without)) as exporter:
        exporter.save_text("notes", "hello.txt", "hi")
    return with_model, without


@pytest.mark.timeout(HANG * 4 + 60)
def test_path_binds_the_interpreters_importer_and_model(packages):
    with_model, without = packages
    code = ("import torch; print(type(importer).__name__, type(importer.zip_reader).__name__, "
            "type(model).__name__, model(torch.ones(3)).tolist())")
    result = shell(str(with_model), "-c", code)
    assert result.returncode == 0, result.stderr
    # _SharedStorageReader: the importer that multipy's Package makes for serving
    assert result.stdout == "PackageImporter _SharedStorageReader Linear [3.5, 11.5]\n"

    other = shell(str(with_model), "--module", "other", "--resource", "twice.pkl", "-q",
                  input="model.bias.tolist()\n")
    assert (other.returncode, other.stdout) == (0, "[0.5, -0.5]\n"), other.stderr

    prompt = shell(str(without), input="print(importer.load_text('notes', 'hello.txt'))\n"
                                       "'model' in globals()\n")
    assert (prompt.returncode, prompt.stdout) == (0, "hi\nFalse\n"), prompt.stderr
    assert f"importer = the PackageImporter of {without}" in prompt.stderr
    assert "model: not bound, the archive has no model/model.pkl" in prompt.stderr

    asked = shell(str(without), "--module", "model", "-c", "pass")
    assert asked.returncode == 1
    assert "has no resource 'model.pkl' in package 'model'" in asked.stderr
    assert "('notes', 'hello.txt')" in asked.stderr  # what it has instead
