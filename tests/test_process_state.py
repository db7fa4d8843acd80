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


ARENAS = r'''
import multipy

PROBE = """
import ctypes, threading

def allocate():
    kept = [bytearray(4096) for _ in range(256)]  # malloc's, past Python's small blocks

def arenas_after_threads(count):
    threads = [threading.Thread(target=allocate) for _ in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    ctypes.CDLL("libc.so.6").malloc_stats()  # this interpreter's libc's: to stderr
"""

with multipy.InterpreterManager(1) as manager:
    manager.register_module_source("probe", PROBE)
    manager[0].global_("probe", "arenas_after_threads")(4)
'''


@pytest.mark.parametrize("env, arenas", [({}, 1), ({"MALLOC_ARENA_MAX": ""}, 1),
                                         ({"MALLOC_ARENA_MAX": "3"}, 3),
                                         ({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}, 2)])
def test_each_interpreter_s_libc_keeps_one_malloc_arena_unless_the_user_says(python, env,
                                                                             arenas):
    """Threads that allocate in an interpreter share its libc's one malloc arena (glibc
    gives each new thread one of its own by default): the memory that a front end's
    thread and the loading thread leave free in theirs is not kept twice.  A
    MALLOC_ARENA_MAX (not empty: glibc ignores an empty one) or glibc.malloc.arena_max
    that the process starts with is kept."""
    result = python(ARENAS, launcher=True, timeout=90, env=env)
    assert result.returncode == 0, result.stderr
    found = [line for line in result.stderr.splitlines() if line.startswith("Arena ")]
    assert len(found) == arenas, result.stderr
