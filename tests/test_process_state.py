"""What each interpreter has of its own and what it shares with the host and the other
interpreters, as docs/design.md's table says ("What an interpreter has of its own"):
the kernel's per-process state is shared, libc's and Python's state is each
interpreter's.  Run in a fresh process: the scenario changes the working directory,
umask and resource limits of the whole process."""
from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.timeout(120)

SCENARIO = r'''
import json
import multipy

PROBE = """
import locale, os, resource, signal, sys, time

def state():
    mask = os.umask(0)
    os.umask(mask)
    return {"cwd": os.getcwd(), "umask": mask, "nofile": resource.getrlimit(resource.RLIMIT_NOFILE)[0],
            "numeric": locale.setlocale(locale.LC_NUMERIC), "tz": time.tzname[0],
            "recursion": sys.getrecursionlimit(), "pid": os.getpid()}

def change():
    os.chdir("/")
    os.umask(0o077)
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    locale.setlocale(locale.LC_NUMERIC, "C.UTF-8")
    os.environ["TZ"] = "Asia/Tokyo"
    time.tzset()
    sys.setrecursionlimit(321)
    try:
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)
        return "set"
    except ValueError as error:
        return str(error)

"""
exec(PROBE, globals())  # the host reads its state with the same state()

os.umask(0o022)
with multipy.InterpreterManager(2) as manager:
    manager.register_module_source("probe", PROBE)
    first, second = manager.all_instances()
    before = state()
    signal = first.global_("probe", "change")().deref()
    print(json.dumps({"before": before, "signal": signal, "host": state(),
                      "first": first.global_("probe", "state")().deref(),
                      "second": second.global_("probe", "state")().deref()}))
'''


def test_kernel_state_is_the_process_s_and_libc_and_python_state_each_interpreter_s(python):
    result = python(SCENARIO, launcher=True, timeout=90)
    assert result.returncode == 0, result.stderr
    seen = json.loads(result.stdout.strip().splitlines()[-1])
    before, first, second, host = seen["before"], seen["first"], seen["second"], seen["host"]
    # shared by the whole process, as between threads: what the kernel keeps
    for everyone in (first, second, host):
        assert everyone["cwd"] == "/" and everyone["umask"] == 0o077
        assert everyone["nofile"] == 256 and everyone["pid"] == before["pid"]
    # each interpreter's own: its libc's (locale, time zone) and its Python's
    assert (first["numeric"], first["tz"], first["recursion"]) == ("C.UTF-8", "JST", 321)
    for other in (second, host):
        assert (other["numeric"], other["tz"], other["recursion"]) == (
            before["numeric"], before["tz"], before["recursion"])
    # signal handlers are the host's alone
    assert "main thread of the main interpreter" in seen["signal"]
