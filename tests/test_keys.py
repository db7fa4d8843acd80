"""pthread keys: every interpreter keeps its own (docs/design.md, "pthread keys").

A small C library, built here, creates keys inside an interpreter the way any library
does, through the pthread_key_create its namespace binds it to; each namespace loads
its own copy, with its own counters.
"""
from __future__ import annotations

import shutil
import subprocess
import sys
import threading
import time

import pytest

import multipy

LIBRARY = r"""
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>

#define MANY 1100
static pthread_key_t keys[MANY];
static int made;
static atomic_int destroyed;
static atomic_long last_destroyed;

static void destroy(void *value) { atomic_fetch_add(&destroyed, 1); last_destroyed = (long)value; }

/* Creates up to n keys with a destructor; how many it got (errno: why it stopped). */
int make(int n) {
    while (made < n && made < MANY) {
        int failed = pthread_key_create(&keys[made], destroy);
        if (failed) { errno = failed; break; }
        made++;
    }
    return made;
}
int drop(void) { int failed = 0; while (made) failed |= pthread_key_delete(keys[--made]); return failed; }
long key(int i) { return keys[i]; }
int set(int i, long value) { return pthread_setspecific(keys[i], (void *)value); }
long get(int i) { return (long)pthread_getspecific(keys[i]); }
int destroyed_count(void) { return destroyed; }
long destroyed_last(void) { return last_destroyed; }
"""

INSIDE = """
import ctypes, threading
lib = None

def load(path):
    global lib
    lib = ctypes.CDLL(path, use_errno=True)
    lib.get.restype = lib.key.restype = lib.destroyed_last.restype = ctypes.c_long
    lib.set.argtypes = [ctypes.c_int, ctypes.c_long]

def make(n):
    ctypes.set_errno(0)
    got = lib.make(n)
    return got, ctypes.get_errno()

def drop():
    return lib.drop()

def key(i):
    return lib.key(i)

def set_all(n, base):
    return [lib.set(i, base + i) for i in range(n)]

def get_all(n):
    return [lib.get(i) for i in range(n)]

def destroyed():
    return lib.destroyed_count(), lib.destroyed_last()

def in_a_thread_of_its_own(value):
    # a thread that this interpreter's own libc starts and ends
    thread = threading.Thread(target=lib.set, args=(0, value))
    thread.start()
    thread.join()

def libc_key():
    # the namespace's libc itself, past the functions every library here binds to
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    key = ctypes.c_uint()
    return libc.pthread_key_create(ctypes.byref(key), None)
"""


@pytest.fixture(scope="module")
def library(tmp_path_factory) -> str:
    if shutil.which("gcc") is None:
        pytest.skip("needs gcc")
    folder = tmp_path_factory.mktemp("keys")
    (folder / "keys.c").write_text(LIBRARY)
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(folder / "libkeys.so"),
                    str(folder / "keys.c")], check=True)
    return str(folder / "libkeys.so")


@pytest.fixture(scope="module")
def loaded(manager, library):
    manager.register_module_source("keys_inside", INSIDE)
    for interpreter in manager.all_instances():
        with interpreter.acquire_session() as s:
            s.global_("keys_inside", "load")(library)
    return manager


def _call(interpreter, name, *args):
    with interpreter.acquire_session() as s:
        return s.global_("keys_inside", name)(*args).deref()


def test_interpreters_with_many_keys_never_share_one(loaded):
    # 100 keys each: more than a fixed share of the process's 1024 slots per interpreter
    # would give, all set on one host thread, then read back in every interpreter.
    first, second = loaded.all_instances()
    try:
        for ordinal, interpreter in enumerate((first, second)):
            assert _call(interpreter, "make", 100) == (100, 0)
            assert _call(interpreter, "set_all", 100, 1000 * (ordinal + 1)) == [0] * 100
        assert _call(first, "get_all", 100) == [1000 + i for i in range(100)]
        assert _call(second, "get_all", 100) == [2000 + i for i in range(100)]
        # and none of them is a slot that the host's libc could hand out
        assert all(_call(first, "key", i) >= 1024 for i in range(100))
    finally:
        for interpreter in (first, second):
            assert _call(interpreter, "drop") == 0


def test_the_namespaces_libc_hands_out_no_key(loaded):
    # were it to, the key could be a slot that the host or another interpreter uses
    assert _call(loaded[0], "libc_key") == 11  # EAGAIN


def _destroyed_since(before, interpreters, expected):
    # a thread's key destructors run as its last step, just after join() returns
    deadline = time.monotonic() + 10
    while True:
        counts = [_call(i, "destroyed")[0] - b for i, b in zip(interpreters, before)]
        if counts == expected or time.monotonic() > deadline:
            return counts
        time.sleep(0.05)


def test_thread_exit_runs_each_destructor_once_in_its_interpreter(loaded):
    first, second = loaded.all_instances()
    for interpreter in (first, second):
        assert _call(interpreter, "make", 1)[0] == 1
    try:
        before = [_call(i, "destroyed")[0] for i in (first, second)]

        def enter_both(n: int) -> None:
            _call(first, "set_all", 1, 100 + n)
            if n % 2:  # odd threads only: the other interpreter must not count them
                _call(second, "set_all", 1, 200 + n)

        threads = [threading.Thread(target=enter_both, args=(n,)) for n in range(6)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        assert not any(thread.is_alive() for thread in threads)
        assert _destroyed_since(before, (first, second), [6, 3]) == [6, 3]
        # a thread of the interpreter's own (started and ended by its libc)
        _call(second, "in_a_thread_of_its_own", 4242)
        assert _destroyed_since(before, (first, second), [6, 4]) == [6, 4]
        assert _call(second, "destroyed")[1] == 4242
    finally:
        for interpreter in (first, second):
            assert _call(interpreter, "drop") == 0


def test_a_deleted_keys_values_read_as_null_once_it_is_made_again(loaded):
    interpreter = loaded[0]
    assert _call(interpreter, "make", 1)[0] == 1
    first_key = _call(interpreter, "key", 0)
    _call(interpreter, "set_all", 1, 77)
    assert _call(interpreter, "drop") == 0
    assert _call(interpreter, "make", 1)[0] == 1
    try:
        assert _call(interpreter, "key", 0) == first_key  # the same number, a new key
        assert _call(interpreter, "get_all", 1) == [0]
    finally:
        assert _call(interpreter, "drop") == 0


def test_an_interpreter_that_runs_out_of_keys_says_which_and_what(python, library):
    result = python(f"""
        import multipy
        with multipy.InterpreterManager(1) as m:
            m.register_module_source("keys_inside", {INSIDE!r})
            with m[0].acquire_session() as s:
                s.global_("keys_inside", "load")({library!r})
                in_use = s.global_("multipy._inside", "pthread_keys_in_use")().deref()
                got, error = s.global_("keys_inside", "make")(1100).deref()
                print(got + in_use, error)
                print(s.global_("multipy._inside", "pthread_keys_in_use")().deref())
                s.global_("keys_inside", "drop")()
                print(s.global_("keys_inside", "make")(3).deref())
                s.global_("keys_inside", "drop")()
    """, timeout=60)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split("\n")[:3] == ["1024 11", "1024", "(3, 0)"]
    assert "interpreter #0 has no pthread key left" in result.stderr
    assert "libkeys.so" in result.stderr


#: Run first in a fresh process: the host takes the keys up to 62, so that multipy's exit
#: key is 63 and the interpreters' keys of the process 64 and on, in a block of glibc's
#: of their own: past the first 32, whose values glibc keeps in the thread itself, a block
#: of 32 values is memory that glibc allocates on a thread when one of them is first set,
#: and that the libc which started the thread frees as it ends.
HOST_KEYS = """
import ctypes
libc = ctypes.CDLL(None)
key = ctypes.c_uint()
while key.value < 62:
    assert libc.pthread_key_create(ctypes.byref(key), None) == 0
"""


@pytest.mark.timeout(120)
def test_short_lived_host_threads_with_many_keys_set(python, library):
    # Each thread sets values of 200 keys in each interpreter and exits: the memory
    # that holds them must come from, and go back to, the heap of the libc that frees it.
    result = python(HOST_KEYS + f"""
import threading, time, multipy
with multipy.InterpreterManager(2) as m:
    m.register_module_source("keys_inside", {INSIDE!r})
    fns = []
    for i in range(2):
        with m[i].acquire_session() as s:
            s.global_("keys_inside", "load")({library!r})
            assert s.global_("keys_inside", "make")(200).deref()[0] == 200
            fns.append(m[i].global_("keys_inside", "set_all"))
    for n in range(120):
        t = threading.Thread(target=lambda: [f(200, 1000 + n) for f in fns])
        t.start()
        t.join()
    deadline = time.monotonic() + 10  # the last thread's destructors run as it ends
    with m[0].acquire_session() as s:
        while s.global_("keys_inside", "destroyed")().deref()[0] < 120 * 200:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        print(s.global_("keys_inside", "destroyed")().deref()[0])
""", timeout=110)
    assert result.returncode == 0, result.stderr[-3000:]
    assert int(result.stdout) == 120 * 200


def test_info_counts_the_process_keys():
    result = subprocess.run([sys.executable, "-m", "multipy", "info"], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    line = next(l for l in result.stdout.splitlines() if l.startswith("pthread keys:"))
    used, total = map(int, line.split()[2:7:4])
    assert total == 1024 and 0 < used < 100
    assert f"{total - used} free" in line
