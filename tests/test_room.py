"""Room for interpreters in programs that `multipy run` does not start: make_room(), the
error when an interpreter has no room for torch, and what `multipy info` says."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

HANG = 300


def test_make_room_reexecutes_once_with_room_and_gives_the_environment_back(python):
    result = python("""
        import os, sys
        print("before", flush=True)  # runs twice: before and after the re-execution
        import multipy
        multipy.make_room()
        from multipy import _pool
        from multipy._glibc import tunables_at_start
        print("argv", sys.argv[1:])
        print("fit", _pool.capacity()["more"])
        print("env", repr(os.environ.get("GLIBC_TUNABLES")))
        print("start", sorted(tunables_at_start()))
        multipy.make_room()  # with room: returns at once
        print("after")
    """, env={"GLIBC_TUNABLES": "glibc.malloc.tcache_count=5"}, timeout=HANG)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines.count("before") == 2 and lines.count("after") == 1
    assert "fit 15" in lines
    assert "env 'glibc.malloc.tcache_count=5'" in lines  # children get what the user gave
    start = next(line for line in lines if line.startswith("start"))
    assert "glibc.rtld.nns" in start and "glibc.malloc.tcache_count" in start


def test_make_room_under_the_launcher_does_nothing(python):
    result = python("""
        import multipy
        multipy.make_room()
        print("once")
    """, launcher=True, timeout=HANG)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["once"]


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch")
@pytest.mark.timeout(HANG + 60)
def test_interpreters_without_room_for_torch_leave_the_balancer(python):
    # glibc's default room: 8 interpreters start, and only about 4 of them can then
    # import torch (libgomp's static TLS).  Every call either imports torch and answers,
    # or says clearly that its interpreter had no room; then the others serve every call.
    result = python("""
        import json, threading, multipy
        m = multipy.InterpreterManager(8)
        m.register_module_source("uses_torch", "import torch\\ndef two():\\n    return int(torch.ones(2).sum())\\n")
        answers, limits, other = [], [], []
        lock = threading.Lock()
        def call():
            for _ in range(6):
                try:
                    with m.acquire_one() as s:
                        value = s.global_("uses_torch", "two")().deref()
                    with lock:
                        answers.append(value)
                except multipy.InterpreterLimitError as error:
                    with lock:
                        limits.append(str(error))
                except Exception as error:
                    with lock:
                        other.append(repr(error))
        threads = [threading.Thread(target=call) for _ in range(8)]
        for t in threads: t.start()
        for t in threads: t.join()
        out = [i.index for i in m.all_instances() if i.out_of_room]
        after = []  # once known, interpreters without room are passed by
        for _ in range(20):
            with m.acquire_one() as s:
                after.append(s.global_("uses_torch", "two")().deref())
        print(json.dumps({"answers": answers, "limits": limits, "other": other, "out": out,
                          "after": after}))
    """, timeout=HANG)
    assert result.returncode == 0, result.stderr
    seen = json.loads(result.stdout.strip().splitlines()[-1])
    assert seen["other"] == []
    assert 1 <= len(seen["out"]) < 8
    # an error only for the calls that met an interpreter before it was known to have
    # no room: those that started on it at about the same time
    assert len(seen["out"]) <= len(seen["limits"]) < 16
    assert seen["answers"] == [2] * (48 - len(seen["limits"]))
    assert seen["after"] == [2] * 20
    message = seen["limits"][0]
    assert "libgomp" in message and "make_room()" in message and "multipy run" in message
    assert "Environment=GLIBC_TUNABLES" in message


def test_limit_error_in_plain_words(python):
    result = python("""
        import multipy
        from multipy import _pool
        fits = _pool.capacity()["more"]  # glibc's defaults leave fewer than 15
        try:
            multipy.InterpreterManager(15)
        except multipy.InterpreterLimitError as error:
            print(fits, error)
    """, timeout=HANG)
    assert result.returncode == 0, result.stderr
    fits, _, message = result.stdout.partition(" ")
    assert message.startswith(f"15 interpreters were asked for, but this process can "
                              f"give only {fits}.") and int(fits) < 15
    assert "make_room()" in result.stdout and "started so far" not in result.stdout


def test_info_says_how_many_torch_interpreters_fit():
    env_free = subprocess.run([sys.executable, "-m", "multipy", "info"], capture_output=True,
                              text=True, timeout=HANG, env={"PATH": "/usr/bin:/bin"})
    assert env_free.returncode == 0, env_free.stderr
    # what a process with the same (empty) environment measures: the estimates' own
    # tests check them against what starts
    measured = subprocess.run(
        [sys.executable, "-c", "from multipy import _glibc; print(_glibc.namespaces_that_fit(0),"
         " _glibc.torch_interpreters_that_fit())"],
        capture_output=True, text=True, timeout=HANG, env={"PATH": "/usr/bin:/bin"})
    bare, torch_ = measured.stdout.split()
    assert int(torch_) < int(bare) < 15
    assert f"{bare} fit in this process" in env_free.stdout
    assert f"about {torch_} that import torch" in env_free.stdout
    assert "intra-op threads" in env_free.stdout
