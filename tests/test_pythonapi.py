"""Code that finds CPython's functions through the program's handle, dlopen(NULL), calls
its own interpreter's CPython (docs/design.md, "dlopen(NULL)"): ctypes.pythonapi, and the
code numba compiles with LLVM.  Each scenario runs in a fresh process, since a call into
the host's CPython ends the process with signal 11."""
from __future__ import annotations

import ast
import importlib.util
import textwrap

import pytest

HANG = 240  # seconds after which a scenario counts as hung: numba compiles in each

needs_numba = pytest.mark.skipif(importlib.util.find_spec("numba") is None,
                                 reason="numba is not installed (the test extra has it)")


@pytest.mark.timeout(HANG + 60)
def test_ctypes_pythonapi_is_the_interpreters_own(python):
    """In two interpreters, on a host thread and on a thread started inside:
    ctypes.pythonapi and CDLL(None) find that interpreter's CPython, whose functions work
    there (they crashed, being the host's, before)."""
    result = python("""
        import ctypes, multipy
        SOURCE = '''
        import ctypes, threading

        def check():
            api = ctypes.pythonapi
            api.PyFloat_FromDouble.restype = ctypes.py_object
            api.PyFloat_FromDouble.argtypes = [ctypes.c_double]
            api.PyGILState_Check.restype = ctypes.c_int
            inside = []
            thread = threading.Thread(target=lambda: inside.append(api.PyGILState_Check()))
            thread.start()
            thread.join()
            program = ctypes.CDLL(None)
            return (api.PyFloat_FromDouble(2.5), api.PyGILState_Check(), inside[0],
                    ctypes.cast(api.Py_IsInitialized, ctypes.c_void_p).value,
                    ctypes.cast(program.Py_IsInitialized, ctypes.c_void_p).value)
        '''
        with multipy.InterpreterManager(2) as m:
            m.register_module_source("api", SOURCE)
            found = [i.acquire_session().global_("api", "check")().deref()
                     for i in m.all_instances()]
        host = ctypes.cast(ctypes.pythonapi.Py_IsInitialized, ctypes.c_void_p).value
        print([f[:3] for f in found])
        print([(f[3] == f[4], f[3] != host) for f in found], found[0][3] != found[1][3])
    """, timeout=HANG)
    assert result.returncode == 0, result.stderr
    values, addresses = result.stdout.strip().splitlines()
    assert ast.literal_eval(values) == [(2.5, 1, 1), (2.5, 1, 1)]
    # each interpreter's own function: the same through both handles, not the host's,
    # and not the other interpreter's
    assert addresses == "[(True, True), (True, True)] True"


_NUMBA_MODULE = '''
import threading

import numpy as np
from numba import njit, prange

try:  # with torch too where it is installed, as inference code has it
    import torch
except ImportError:
    torch = None


@njit
def scalar(x):
    return x * 2.5 + 1


@njit
def arrays(a, b):
    return (a * b + 1).cumsum()


@njit(parallel=True)
def parallel_sum(n):
    total = 0  # integers: the same sum however the threads split the range
    for i in prange(n):
        total += i * i
    return total


@njit(nogil=True)
def nogil_norm(a):
    return np.sqrt((a * a).sum())


@njit(cache=True)
def cached(x):
    return x ** 2 + 0.5


@njit
def checked(x):
    if x < 0:
        raise ValueError("negative input", x)
    return x


def run():
    """What each function returns, in one interpreter (or the host)."""
    a = np.arange(6.0)
    if torch is not None:
        a = torch.arange(6.0, dtype=torch.float64).numpy()
    norms = []
    threads = [threading.Thread(target=lambda: norms.append(nogil_norm(a))) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    try:
        checked(-3)
        raised = None
    except ValueError as error:
        raised = (type(error).__name__, error.args)
    return {"scalar": scalar(3.0), "arrays": arrays(a, a).tolist(),
            "parallel": parallel_sum(10_000), "nogil": norms, "raised": raised,
            "after": checked(4), "cached": cached(1.5)}


def cache_use():
    """The cached function's hits and misses in this interpreter."""
    return len(cached.stats.cache_hits), len(cached.stats.cache_misses)
'''

_NUMBA_SCENARIO = """
    import sys, threading
    sys.path.insert(0, {folder!r})
    import multipy
    with multipy.InterpreterManager(3) as m:
        found = [None] * 3

        def run(index):
            with m[index].acquire_session() as session:
                found[index] = (session.global_("numba_functions", "run")().deref(),
                                session.global_("numba_functions", "cache_use")().deref())

        threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    import numba_functions  # the host's own numba, after the interpreters'
    print([value == numba_functions.run() for value, _ in found])
    print([use for _, use in found])
"""


@needs_numba
@pytest.mark.timeout(2 * HANG + 60)
def test_numba_in_three_interpreters_at_once(python, tmp_path):
    """@njit scalars, arrays, parallel=True, nogil=True (from two threads inside), an
    exception raised in compiled code, and cache=True: in 3 interpreters called from 3
    host threads at once, each result equal to the host's own numba's.  The first run
    compiles and writes the cache (3 interpreters at once); the second reads it in all 3."""
    (tmp_path / "numba_functions.py").write_text(_NUMBA_MODULE)
    scenario = textwrap.dedent(_NUMBA_SCENARIO).format(folder=str(tmp_path))
    env = {"NUMBA_CACHE_DIR": str(tmp_path / "cache")}

    first = python(scenario, launcher=True, timeout=HANG, env=env)
    assert first.returncode == 0, first.stderr
    equal, uses = first.stdout.strip().splitlines()[-2:]
    assert equal == "[True, True, True]", first.stdout
    assert sum(misses for _, misses in ast.literal_eval(uses)) >= 1  # someone compiled it
    assert list((tmp_path / "cache").rglob("*.nbi")), "no cache index was written"

    second = python(scenario, launcher=True, timeout=HANG, env=env)
    assert second.returncode == 0, second.stderr
    equal, uses = second.stdout.strip().splitlines()[-2:]
    assert equal == "[True, True, True]", second.stdout
    assert ast.literal_eval(uses) == [(1, 0)] * 3  # loaded from the cache in each


@needs_numba
@pytest.mark.timeout(HANG + 60)
def test_llvm_finds_the_interpreters_own_cpython(python):
    """Where LLVM's symbol search (llvmlite's address_of_symbol, which numba's compiled
    code is linked through) finds PyFloat_FromDouble, in each of two interpreters: at that
    interpreter's own function."""
    result = python("""
        import multipy
        SOURCE = '''
        import ctypes
        import llvmlite.binding as llvm
        from numba import njit

        def where():
            njit(lambda x: x + 1.0)(1.0)  # numba has set up LLVM and its engine
            own = ctypes.cast(ctypes.pythonapi.PyFloat_FromDouble, ctypes.c_void_p).value
            return llvm.address_of_symbol("PyFloat_FromDouble") == own, own
        '''
        with multipy.InterpreterManager(2) as m:
            m.register_module_source("where", SOURCE)
            found = [i.acquire_session().global_("where", "where")().deref()
                     for i in m.all_instances()]
        print([same for same, _ in found], len({own for _, own in found}))
    """, timeout=HANG)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[True, True] 2"
