"""The fatal-signal report (multipy/_host.c): a fatal signal that another process sends
(kill -SEGV, kill -ABRT) ends the process the first time and is said to come from that
process, not from the call an interpreter ran; the crash cell records which interpreter
a crash of the process's own hit, and nothing for a signal from outside."""
from __future__ import annotations

import os
import signal
import struct
import subprocess

import pytest

from conftest import until

# No core files: the crashes are on purpose.
QUIET = "import resource\nresource.setrlimit(resource.RLIMIT_CORE, (0, 0))\n"

# Maps the 8 bytes of the file CELL (shared, so the test reads what the crash stored) and
# hands their address to the crash cell.
CELL = """
import ctypes, mmap
from multipy import _host
with open({cell!r}, "r+b") as file:
    mapping = mmap.mmap(file.fileno(), 8, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
value = ctypes.c_double.from_buffer(mapping)
_host.crash_cell(ctypes.addressof(value))
"""

# Interpreter 0's call says it runs (the file STARTED appears), then sleeps: a signal to
# the process most likely reaches the main thread inside that call.
WAITS = """
import multipy
with multipy.InterpreterManager(1) as manager:
    manager.register_module_source("waiter", (
        "import time\\n"
        "def wait(started):\\n"
        "    open(started, 'w').close()\\n"
        "    time.sleep(60)\\n"))
    with manager.all_instances()[0].acquire_session() as session:
        session.global_("waiter", "wait")({started!r})
print("the call returned")
"""


def _cell(path) -> float:
    return struct.unpack("d", path.read_bytes())[0]


def _sent(python, tmp_path, signal_number: int, cell: bool,
          env: dict[str, str] | None = None) -> tuple[int, str]:
    """Starts a process whose interpreter sleeps in a call, sends it signal_number from
    this process once the call runs; how it ended and its stderr (it must end within 15 s
    of the signal, killed otherwise)."""
    started = tmp_path / "started"
    code = QUIET + (CELL.format(cell=str(tmp_path / "cell")) if cell else "")
    process = python(code + WAITS.format(started=str(started)), launcher=True, popen=True,
                     env=env)
    try:
        until(lambda: started.exists() or process.poll() is not None, 60)
        assert process.poll() is None, process.communicate(timeout=30)
        os.kill(process.pid, signal_number)
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            pytest.fail(f"signal {signal_number} sent with kill did not end the process")
        _, stderr = process.communicate(timeout=30)
        return process.returncode, stderr
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate(timeout=30)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("signal_number", [signal.SIGABRT, signal.SIGSEGV])
def test_a_fatal_signal_from_another_process_ends_the_process_at_once(
        python, tmp_path, signal_number):
    returncode, stderr = _sent(python, tmp_path, signal_number, cell=False)
    assert returncode == -signal_number, stderr[-3000:]
    assert f"multipy: signal {int(signal_number)} sent by process {os.getpid()}" in stderr, \
        stderr[-3000:]
    # not the call's doing: the call it interrupted is not named as the cause
    assert "in interpreter #" not in stderr and "while it ran" not in stderr, stderr[-3000:]


@pytest.mark.timeout(120)
def test_a_fatal_signal_from_another_process_passed_on_by_faulthandler_ends_it(
        python, tmp_path):
    """With faulthandler on (PYTHONFAULTHANDLER), each interpreter's faulthandler sits in
    front of multipy's handler and passes the signal on with raise(): to multipy it looks
    sent by the process itself, and it must still end the process, not be dropped."""
    returncode, stderr = _sent(python, tmp_path, signal.SIGSEGV, cell=False,
                               env={"PYTHONFAULTHANDLER": "1"})
    assert returncode == -signal.SIGSEGV, stderr[-3000:]
    assert "Fatal Python error: Segmentation fault" in stderr, stderr[-3000:]


@pytest.mark.timeout(120)
def test_the_crash_cell_says_a_signal_came_from_another_process(python, tmp_path):
    """Not the call's doing: the cell says -1, not the interpreter."""
    cell = tmp_path / "cell"
    cell.write_bytes(bytes(8))
    returncode, stderr = _sent(python, tmp_path, signal.SIGSEGV, cell=True)
    assert returncode == -signal.SIGSEGV, stderr[-3000:]
    assert _cell(cell) == -1.0, stderr[-3000:]


# Interpreter `which` of two crashes in a call (ctypes.memset(16, 0, 1) writes to
# address 16; os.abort() is the process's own SIGABRT).
CRASHES = """
import multipy
with multipy.InterpreterManager(2) as manager:
    with manager.all_instances()[{which}].acquire_session() as session:
        {crash}
print("still here")
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("which, crash, signal_number", [
    (0, 'session.global_("ctypes", "memset")(16, 0, 1)', signal.SIGSEGV),
    (1, 'session.global_("os", "abort")()', signal.SIGABRT),
])
def test_the_crash_cell_names_the_interpreter_whose_call_crashed(
        python, tmp_path, which, crash, signal_number):
    cell = tmp_path / "cell"
    cell.write_bytes(bytes(8))
    code = QUIET + CELL.format(cell=str(cell)) + CRASHES.format(which=which, crash=crash)
    result = python(code, launcher=True, timeout=90)
    assert result.returncode == -signal_number, result.stderr[-3000:]
    assert f"fatal signal {int(signal_number)} in interpreter #{which}" in result.stderr, \
        result.stderr[-3000:]
    assert "sent by process" not in result.stderr, result.stderr[-3000:]
    assert _cell(cell) == which + 1.0


@pytest.mark.timeout(120)
def test_the_crash_cell_stays_empty_for_a_crash_outside_any_call(python, tmp_path):
    """A crash on a thread that runs no interpreter's call (the host's own code, with an
    interpreter started) stores nothing."""
    cell = tmp_path / "cell"
    cell.write_bytes(bytes(8))
    code = QUIET + CELL.format(cell=str(cell)) + (
        "import multipy\n"
        "manager = multipy.InterpreterManager(1)\n"
        "ctypes.memset(16, 0, 1)\n")
    result = python(code, launcher=True, timeout=90)
    assert result.returncode == -signal.SIGSEGV, result.stderr[-3000:]
    assert "in interpreter #" not in result.stderr, result.stderr[-3000:]
    assert _cell(cell) == 0.0
