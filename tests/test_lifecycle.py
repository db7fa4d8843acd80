"""Limits and exit behaviour, each in a fresh process (with a timeout)."""
from __future__ import annotations

import ast
import importlib.util

import math
import os
import signal
import subprocess
import sys
import textwrap

import pytest
from conftest import until, write_one

import multipy

HANG = 60  # seconds after which a scenario counts as hung


def test_exit_without_close(python):
    result = python("""
        import multipy
        m = multipy.InterpreterManager(2)
        with m.acquire_one() as s:
            print(s.global_("math", "factorial")(5).deref())
    """, timeout=HANG)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["120"]


def test_exit_code_of_sys_exit(python):
    result = python("""
        import sys, multipy
        m = multipy.InterpreterManager(1)
        sys.exit(3)
    """, timeout=HANG)
    assert result.returncode == 3, result.stderr


def test_exception_in_main_thread(python):
    result = python("""
        import multipy
        with multipy.InterpreterManager(2) as m:
            m[0].acquire_session().global_("builtins", "int")("boom")
    """, timeout=HANG)
    assert result.returncode == 1
    assert "ValueError: invalid literal" in result.stderr
    assert "raised inside an interpreter" in result.stderr


def test_exit_with_calls_in_flight(python):
    result = python("""
        import threading, multipy
        m = multipy.InterpreterManager(2)
        m.register_module_source("busy", "import time\\ndef work():\\n    time.sleep(0.01)\\n    return 1\\n")
        started = threading.Barrier(9)
        def loop():
            started.wait()
            while True:
                with m.acquire_one() as s:
                    s.global_("busy", "work")()
        for _ in range(8):
            threading.Thread(target=loop, daemon=True).start()
        started.wait()
        print("exiting")
    """, timeout=HANG)
    assert result.returncode == 0, result.stderr
    assert "exiting" in result.stdout
    # the daemon threads that call on as the process exits wait for its end: no error
    # of theirs is written while it finalises (CPython 3.14 and later abort on that)
    assert "Exception in thread" not in result.stderr, result.stderr


@pytest.mark.parametrize("attempt", range(3))
def test_exit_while_results_are_being_copied(python, attempt):
    result = python("""
        import threading, multipy
        m = multipy.InterpreterManager(2)
        m.register_module_source("blob", "DATA = bytes(16 << 20)\\n")
        copied = threading.Semaphore(0)
        def loop():
            with m.acquire_one() as s:
                data = s.global_("blob", "DATA")
                while True:
                    if len(data.deref()) == 16 << 20:
                        copied.release()
        for _ in range(4):
            threading.Thread(target=loop, daemon=True).start()
        for _ in range(8):  # copies are under way in every thread as the process exits
            copied.acquire()
        print("copying")
    """, timeout=HANG)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "copying"


def test_interrupted_call_does_not_confuse_the_next(python):
    result = python("""
        import signal, multipy
        class Interrupted(Exception):
            pass
        def interrupt(*_):
            raise Interrupted
        m = multipy.InterpreterManager(1)
        m.register_module_source("slow", "import time\\n"
                                 "def echo(x, delay):\\n    time.sleep(delay)\\n    return x\\n")
        s = m.acquire_one()
        echo = s.global_("slow", "echo")
        signal.signal(signal.SIGALRM, interrupt)
        signal.setitimer(signal.ITIMER_REAL, 0.2)
        try:
            echo("late", 0.6)
        except Interrupted:
            print("interrupted")
        print(echo("on time", 0).deref())
        print(echo("again", 0).deref())
    """, timeout=HANG)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n")[:3] == ["interrupted", "on time", "again"]


@pytest.mark.timeout(240)
def test_nothing_stays_lent_after_interrupts_and_timeouts_on_the_fast_path(python):
    """Calls of scalars and tensors with tuple results (CALL_LENT and LENT), abandoned at
    every stage by timeouts, and interrupted by Ctrl-C while waiting for an interpreter
    another thread keeps busy (the reply says it never ran): afterwards no tensor stays
    lent on either side."""
    pytest.importorskip("torch")
    result = python("""
        import gc, os, random, signal, tempfile, threading, time, torch, multipy
        from multipy._runtime import exports as host_exports
        m = multipy.InterpreterManager(1)
        m.register_module_source("tt", "import time, torch\\n"
            "def f(*args):\\n"
            "    end = time.perf_counter() + args[-1]\\n"
            "    while time.perf_counter() < end:\\n        pass\\n"
            "    return tuple(a + 0 for a in args[:-1]) + tuple(torch.ones(2) for _ in range(50))\\n"
            "def busy(path, seconds):\\n    open(path, 'w').close()\\n"
            "    sum(range(int(seconds * 5e7)))\\n"
            "def g(a, b):\\n    return a, b\\n")
        s = m[0].acquire_session()
        stats, f = s.global_("multipy._inside", "stats"), s.global_("tt", "f")
        busy, g = s.global_("tt", "busy"), s.global_("tt", "g")
        xs = [torch.ones(3) for _ in range(10)]
        f.call_value(None, (*xs, 0.0))
        def settle():  # (what is lent is given back as each side collects and calls)
            deadline = time.monotonic() + 30
            while True:
                for _ in range(3):
                    gc.collect(); s.global_("gc", "collect")(); s.global_("builtins", "abs")(-1)
                lent = len(host_exports), stats.call_value(None)["lent"]
                if lent == (0, 0) or time.monotonic() > deadline:
                    return lent
                time.sleep(0.01)
        print("baseline", settle())
        random.seed(1)
        outcomes = set()
        for _ in range(150):
            try:
                with multipy.timeout(0.002):
                    f.call_value(None, (*xs, random.uniform(0.0, 0.004)))
                outcomes.add("ok")
            except TimeoutError:
                outcomes.add("timeout")
            while m[0].running_abandoned_call:
                time.sleep(0.001)
        folder = tempfile.mkdtemp()
        for round in range(5):
            started = os.path.join(folder, str(round))
            thread = threading.Thread(target=lambda: busy.call_value(None, (started, 1.0)))
            thread.start()
            while not os.path.exists(started):  # busy holds the interpreter from here
                time.sleep(0.001)
            timer = threading.Timer(0.05, lambda: os.kill(os.getpid(), signal.SIGINT))
            timer.start()
            try:
                g.call_value(None, (torch.ones(3), torch.ones(4)))
                timer.cancel()
            except KeyboardInterrupt:
                outcomes.add("interrupted")
            try:
                timer.join()
                thread.join()
            except KeyboardInterrupt:  # the signal came after g was answered after all
                thread.join()
        print(sorted(outcomes))
        print("after", settle())
    """, timeout=180)  # torch imported in the host and inside
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "baseline (0, 0)"
    assert {"interrupted", "timeout"} <= set(ast.literal_eval(lines[1])), lines  # "ok" too, mostly
    assert lines[2] == "after (0, 0)"


def test_forked_child_cannot_reach_the_parents_interpreters(python):
    result = python("""
        import os, multipy
        m = multipy.InterpreterManager(1)
        s = m.acquire_one()
        kept = s.global_("builtins", "list")([1, 2])
        pid = os.fork()
        if pid == 0:
            try:
                s.global_("builtins", "len")("x")
            except multipy.InterpreterClosedError:
                os._exit(0)
            os._exit(1)
        _, status = os.waitpid(pid, 0)
        print("child", os.waitstatus_to_exitcode(status))
        print("parent", kept.deref())
    """, timeout=HANG)
    assert result.returncode == 0, result.stderr
    assert "child 0" in result.stdout and "parent [1, 2]" in result.stdout


def test_forked_child_exits_at_once(python):
    result = python("""
        import os, multipy
        from multipy import _pool
        m = multipy.InterpreterManager(1)
        m[0].global_("math", "factorial")(3)
        pid = os.fork()
        if pid == 0:  # a normal exit, through atexit: it must not wait for the parent's
            print("waits for", sum(not r.closed_because for r in _pool._runtimes), flush=True)
            raise SystemExit(5)
        _, status = os.waitpid(pid, 0)
        print("child", os.waitstatus_to_exitcode(status))
    """, timeout=HANG)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["waits", "for", "0", "child", "5"]
    assert "still running" not in result.stderr


def test_exit_while_an_interpreter_never_returns(python):
    result = python("""
        import os, sys, tempfile, threading, time, multipy
        m = multipy.InterpreterManager(1)
        m.register_module_source("forever", "def spin(path):\\n    open(path, 'w').close()\\n"
                                            "    while True:\\n        pass\\n")
        s = m.acquire_one()
        started = os.path.join(tempfile.mkdtemp(), "started")
        threading.Thread(target=s.global_("forever", "spin"), args=(started,), daemon=True).start()
        deadline = time.monotonic() + 60
        while not os.path.exists(started):  # the call runs inside: exit must find it so
            assert time.monotonic() < deadline
            time.sleep(0.01)
        print("exiting")
        sys.exit(7)
    """, timeout=HANG)
    assert result.returncode == 7, result.stderr
    assert "interpreter(s) #0 still running a call at exit" in result.stderr


def _interrupt(process) -> str:
    """Sends SIGINT once the call inside an interpreter has begun (it creates the file
    whose path the script printed first); the script's stderr once it has ended."""
    try:
        started = process.stdout.readline().strip()
        until(lambda: os.path.exists(started))
        process.send_signal(signal.SIGINT)
        return process.communicate(timeout=HANG)[1]
    finally:
        process.kill()


def test_ctrl_c_interrupts_a_call(python):
    process = python("""
        import os, tempfile, multipy
        m = multipy.InterpreterManager(1)
        m.register_module_source("wait", "import time\\ndef forever(path):\\n"
                                         "    open(path, 'w').close()\\n"
                                         "    while True:\\n        time.sleep(0.05)\\n")
        forever = m.acquire_one().global_("wait", "forever")
        started = os.path.join(tempfile.mkdtemp(), "started")
        print(started, flush=True)
        forever(started)
    """, popen=True)
    stderr = _interrupt(process)
    assert "KeyboardInterrupt" in stderr
    assert stderr.count("Traceback (most recent call last)") == 1, stderr  # nothing chained
    assert "BlockingIOError" not in stderr and "InterpreterError" not in stderr
    assert process.returncode == -signal.SIGINT  # Python re-raises an unhandled Ctrl-C


def test_ctrl_c_while_a_timed_call_blocks_in_c(python):
    process = python("""
        import os, tempfile, multipy
        m = multipy.InterpreterManager(1)
        m.register_module_source("block", "import time\\ndef sleep(path, seconds):\\n"
                                          "    open(path, 'w').close()\\n"
                                          "    time.sleep(seconds)\\n")
        sleep = m.acquire_one().global_("block", "sleep")
        started = os.path.join(tempfile.mkdtemp(), "started")
        print(started, flush=True)
        with multipy.timeout(600):
            sleep(started, 300)
    """, popen=True)
    stderr = _interrupt(process)
    assert "KeyboardInterrupt" in stderr
    assert stderr.count("Traceback (most recent call last)") == 1, stderr  # nothing chained
    assert process.returncode == -signal.SIGINT  # Python re-raises an unhandled Ctrl-C


# glibc's defaults, and a smaller static TLS area than they give (on glibc 2.36 and 2.43
# alike, both leave fewer than 15: the area, not the namespaces, is the limit)
@pytest.mark.parametrize("tunables", [None, "glibc.rtld.optional_static_tls=300"])
def test_the_room_estimate_is_exact_for_bare_interpreters(python, tunables):
    result = python("""
        import multipy
        from multipy import _glibc, _pool
        fits = _pool.capacity()["more"]
        try:
            multipy.InterpreterManager(fits + 1)
        except multipy.InterpreterLimitError as error:
            print("LIMIT", error)
        assert _pool.capacity()["started"] == 0, "nothing may start before the limit error"
        with multipy.InterpreterManager(fits) as m:
            ids = {i.acquire_session().global_("builtins", "id")(None).deref()
                   for i in m.all_instances()}
        print("STARTED", len(ids) == fits, fits < 15)
        try:  # one more, past the estimate, straight to glibc
            _pool.Runtime(fits)
        except _glibc.NamespaceError as error:
            print("GLIBC", "static TLS" in str(error))
    """, timeout=HANG, env={"GLIBC_TUNABLES": tunables} if tunables else None)
    assert result.returncode == 0, result.stderr
    assert "multipy run" in result.stdout and "GLIBC_TUNABLES=glibc.rtld.nns=16" in result.stdout
    assert "STARTED True True" in result.stdout and "GLIBC True" in result.stdout


def test_fifteen_with_the_launcher(python):
    result = python("""
        import multipy
        from multipy._pool import capacity
        assert capacity()["more"] == 15
        with multipy.InterpreterManager(15) as m:
            ids = {i.acquire_session().global_("builtins", "id")(None).deref()
                   for i in m.all_instances()}
            print("STARTED", len(ids))
            try:
                multipy.InterpreterManager(1)
            except multipy.InterpreterLimitError as error:
                print("LIMIT", error)
        with multipy.InterpreterManager(15) as again:
            print("REUSED", capacity()["started"])
    """, launcher=True, timeout=HANG)
    assert result.returncode == 0, result.stderr
    assert "STARTED 15" in result.stdout
    assert "at most 15" in result.stdout
    assert "REUSED 15" in result.stdout


def test_info_command():
    result = subprocess.run([sys.executable, "-m", "multipy", "run", "-m", "multipy", "info"],
                            capture_output=True, text=True, timeout=HANG)
    assert result.returncode == 0, result.stderr
    assert "glibc.rtld.optional_static_tls=16384" in result.stdout
    assert "15 fit" in result.stdout
    assert "libpython" in result.stdout
    if importlib.util.find_spec("torch") is None:  # the memory line names torch's build
        assert "torch is not installed" in result.stdout
    else:
        import torch
        build = "CUDA" if torch.version.cuda else "CPU"
        assert f"of private memory with this {build} build of torch" in result.stdout


@pytest.mark.parametrize("users", [None, "glibc.malloc.tcache_count=5"])
def test_run_passes_arguments_and_gives_the_environment_back(tmp_path, users):
    script = tmp_path / "args.py"
    script.write_text(
        "import os, sys\n"
        "from multipy._glibc import tunables_at_start\n"
        "print(sys.argv[1:], __name__, sys.path[0] == os.path.dirname(__file__))\n"
        "print(repr(os.environ.get('GLIBC_TUNABLES')))\n"
        "print(sorted(tunables_at_start()))\n")
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    if users:
        env["GLIBC_TUNABLES"] = users
    result = subprocess.run([sys.executable, "-m", "multipy", "run", str(script), "-x", "--flag", "1"],
                            capture_output=True, text=True, timeout=HANG, env=env)
    assert result.returncode == 0, result.stderr
    argv, environ, at_start = result.stdout.splitlines()
    assert argv == "['-x', '--flag', '1'] __main__ True"
    assert environ == repr(users)  # children of the program get what the user gave
    assert "glibc.rtld.nns" in at_start and "glibc.rtld.optional_static_tls" in at_start
    if users:
        assert "glibc.malloc.tcache_count" in at_start


def test_run_a_module(tmp_path):
    (tmp_path / "runme.py").write_text("import sys\nprint(__name__, sys.argv[1:])\n")
    result = subprocess.run([sys.executable, "-m", "multipy", "run", "-m", "runme", "a"],
                            capture_output=True, text=True, timeout=HANG, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "__main__ ['a']"


def test_run_c_runs_code_as_python_c_does(tmp_path):
    (tmp_path / "helper.py").write_text("WORD = 'found'\n")
    code = ("import sys, helper; from multipy._launch import has_room; "
            "print(__name__, sys.argv, repr(sys.path[0]), helper.WORD, has_room())")
    result = subprocess.run([sys.executable, "-m", "multipy", "run", "-c", code, "a", "-m"],
                            capture_output=True, text=True, timeout=HANG, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "__main__ ['-c', 'a', '-m'] '' found True\n"


def test_run_needs_a_program():
    result = subprocess.run([sys.executable, "-m", "multipy", "run"], capture_output=True,
                            text=True, timeout=HANG)
    assert result.returncode == 2
    assert "a script, -m MODULE or -c CODE is required" in result.stderr


def test_run_says_in_one_line_that_a_script_is_not_there(tmp_path):
    result = subprocess.run([sys.executable, "-m", "multipy", "run", "nosuch.py", "-c", "x"],
                            capture_output=True, text=True, timeout=HANG, cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr == (f"multipy run: can't open file {str(tmp_path / 'nosuch.py')!r}: no "
                             f"such file (give the program's path, or -m MODULE, or -c CODE)\n")


def test_small_stack_threads_work_under_the_launcher(python):
    # The launcher's static TLS reserve comes out of every thread's stack: it is small.
    result = python("""
        import threading, multipy
        m = multipy.InterpreterManager(4)
        threading.stack_size(256 * 1024)
        out = []
        thread = threading.Thread(target=lambda: out.append(m[0].global_("math", "factorial")(5).deref()))
        thread.start()
        thread.join()
        print(out)
    """, launcher=True, timeout=HANG)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[120]"


def test_a_signal_handler_may_call_an_interpreter(python):
    # The handler runs when the outer call returns to the host, on the same thread: its
    # own call is a call like any other, and neither takes the other's reply.
    result = python("""
        import signal, multipy
        m = multipy.InterpreterManager(1)
        m.register_module_source("slowly", "import time\\ndef echo(x):\\n    time.sleep(0.3)\\n    return x\\n")
        length = m[0].global_("builtins", "len")
        echo = m[0].global_("slowly", "echo")
        seen = []
        signal.signal(signal.SIGALRM, lambda *_: seen.append(length("inner").deref()))
        signal.setitimer(signal.ITIMER_REAL, 0.05)
        print(echo("outer").deref(), seen)
    """, timeout=HANG)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "outer [5]"


#: Library code inside that starts a thread which is not a daemon, and an atexit handler
#: that says when the interpreter's finalisation gets past waiting for it.
_LINGERING = '''
import atexit, os, threading

def start(fifo):
    atexit.register(lambda: print("finalised", flush=True))
    inherited = threading.Thread(target=lambda: None)  # started in a call: a daemon
    lingering = threading.Thread(target=lambda: open(fifo).read(1), daemon=False)
    lingering.start()
    return inherited.daemon, lingering.daemon
'''


def _lingering_program(fifo: str, before: str = "", exit_code: int = 0) -> str:
    """A program whose interpreter has a thread that is not a daemon, waiting on fifo."""
    return textwrap.dedent(f"""
        import sys, multipy
        {before}
        m = multipy.InterpreterManager(1)
        m.register_module_source("lingering", {_LINGERING!r})
        print(m[0].global_("lingering", "start")({fifo!r}).deref(), flush=True)
        print("exiting", flush=True)
        sys.exit({exit_code})
    """)


def test_exit_timeout_of_multipy_run_leaves_a_lingering_thread(tmp_path):
    """multipy run --exit-timeout: the interpreter whose thread (not a daemon) still runs
    is not finalised, the message says why and how to give more time, and the exit code
    is the program's."""
    fifo = str(tmp_path / "fifo")
    os.mkfifo(fifo)
    script = tmp_path / "lingering.py"
    script.write_text(_lingering_program(fifo, exit_code=4))
    result = subprocess.run([sys.executable, "-m", "multipy", "run", "--exit-timeout", "0.5",
                             str(script)], capture_output=True, text=True, timeout=HANG)
    assert result.returncode == 4, result.stderr
    assert result.stdout.split("\n")[:2] == ["(True, False)", "exiting"]
    assert "finalised" not in result.stdout
    assert ("interpreter(s) #0 not finalised within the exit timeout of 0.5 s (finalising "
            "waits for the threads started inside that are not daemons; multipy run "
            "--exit-timeout or multipy.set_exit_timeout gives more time): leaving without "
            "finalising them") in result.stderr


def test_exit_waits_for_a_lingering_thread_without_limit(python, tmp_path):
    """multipy.set_exit_timeout(inf): exit waits, as CPython does, until the thread that
    is not a daemon ends, then finalises the interpreter."""
    fifo = str(tmp_path / "fifo")
    os.mkfifo(fifo)
    process = python(_lingering_program(fifo, "multipy.set_exit_timeout(float('inf'))"),
                     popen=True)
    try:
        assert process.stdout.readline().strip() == "(True, False)"
        assert process.stdout.readline().strip() == "exiting"
        until(lambda: write_one(fifo))  # the thread ends now: finalising goes on
        out, err = process.communicate(timeout=HANG)
    finally:
        process.kill()
    assert process.returncode == 0, err
    assert out.strip() == "finalised"
    assert "leaving without finalising" not in err


@pytest.mark.parametrize("given", ["-1", "nan", "soon"])
def test_a_wrong_exit_timeout_is_refused(python, given):
    """By multipy run (before the program runs) and by the environment variable (when the
    first interpreter would start)."""
    result = subprocess.run([sys.executable, "-m", "multipy", "run", "--exit-timeout", given,
                             "-c", "print('ran')"], capture_output=True, text=True, timeout=HANG)
    assert result.returncode == 2 and result.stdout == ""
    assert (f"--exit-timeout must be a number of seconds, 0 or more (inf: no limit), not "
            f"{given!r}") in result.stderr
    result = python("""
        import multipy
        try:
            multipy.InterpreterManager(1)
        except ValueError as error:
            print(error)
    """, env={"MULTIPY_EXIT_TIMEOUT": given}, timeout=HANG)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("MULTIPY_EXIT_TIMEOUT must be a number of seconds")


@pytest.mark.parametrize("given", [-1.0, math.nan])
def test_set_exit_timeout_refuses_what_is_not_a_duration(given):
    with pytest.raises(ValueError, match="the exit timeout must be a number of seconds"):
        multipy.set_exit_timeout(given)
