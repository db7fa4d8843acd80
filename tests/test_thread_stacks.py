"""Threads that an interpreter's libc starts on the stacks of threads that have ended
(docs/design.md, "Stacks from another libc")."""
from __future__ import annotations

import shutil
import subprocess

import pytest

#: Dynamic TLS of a library opened with dlopen, which the dynamic linker allocates with
#: the host's malloc on each thread that touches it; SIZE bytes (built three times).
LIBRARY = r"""
static __thread char block[SIZE];
int touch(int value) { block[0] = block[SIZE - 1] = (char)value; return block[0]; }
"""

#: Host threads touch the libraries' TLS and enter the interpreter, then end; the
#: interpreter's threads start on their stacks, while other host threads allocate.
SCENARIO = """
import ctypes, random, threading, multipy

libraries = [ctypes.CDLL(path) for path in LIBRARIES]
INSIDE = '''
import random, threading
def start_threads(n):
    def work():
        kept = [bytes(random.randrange(600, 9000)) for _ in range(30)]
        del kept[::2]
    threads = [threading.Thread(target=work) for _ in range(n)]
    for thread in threads: thread.start()
    for thread in threads: thread.join()
'''
stop = threading.Event()

def allocate():
    kept = []
    while not stop.is_set():
        kept.append(bytearray(random.randrange(600, 9000)))
        if len(kept) > 200:
            del kept[::2]

with multipy.InterpreterManager(1) as m:
    m.register_module_source("stacks_inside", INSIDE)
    start_threads = m[0].global_("stacks_inside", "start_threads")
    allocating = [threading.Thread(target=allocate) for _ in range(2)]
    for thread in allocating: thread.start()
    for round in range(15):
        def enter(round=round):
            for library in libraries:
                library.touch(round)
            start_threads(1)
        threads = [threading.Thread(target=enter) for _ in range(8)]
        for thread in threads: thread.start()
        for thread in threads: thread.join()
        start_threads(8)
    stop.set()
    for thread in allocating: thread.join()
    print("ok")
"""


@pytest.fixture(scope="module")
def libraries(tmp_path_factory) -> list[str]:
    if shutil.which("gcc") is None:
        pytest.skip("needs gcc")
    folder = tmp_path_factory.mktemp("stacks")
    (folder / "tls.c").write_text(LIBRARY)
    paths = []
    for size in (1024, 4096, 16384):
        path = folder / f"libtls{size}.so"
        subprocess.run(["gcc", "-shared", "-fPIC", f"-DSIZE={size}", "-o", str(path),
                        str(folder / "tls.c")], check=True)
        paths.append(str(path))
    return paths


@pytest.mark.timeout(120)
def test_threads_of_an_interpreter_reuse_host_threads_stacks_safely(python, libraries):
    # Each new thread of the interpreter frees the TLS blocks of the thread whose stack
    # it takes: given to the interpreter's free, those chunks of the host's heap were
    # taken into the interpreter's, and the process crashed within seconds.  One arena
    # for every thread puts all of the host threads' blocks in the host's main arena.
    result = python(f"LIBRARIES = {libraries!r}\n" + SCENARIO, launcher=True, timeout=110,
                    env={"GLIBC_TUNABLES": "glibc.malloc.arena_max=1"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["ok"]
