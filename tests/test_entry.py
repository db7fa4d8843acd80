"""Host threads enter interpreters directly (docs/design.md, "The call path")."""
from __future__ import annotations

import threading
import time

import pytest

import multipy

WORK = "def square(x):\n    return x * x\n"


@pytest.fixture(scope="module")
def work(manager):
    manager.register_module_source("entry_work", WORK)
    return manager


def _thread_states(interpreter) -> int:
    with interpreter.acquire_session() as s:
        return s.global_("multipy._inside", "thread_states")().deref()


def test_threads_that_exit_leave_no_thread_state(work):
    before = [_thread_states(i) for i in work.all_instances()]

    def enter_both():
        for interpreter in work.all_instances():
            with interpreter.acquire_session() as s:
                assert s.global_("entry_work", "square")(3).deref() == 9

    for _ in range(5):
        threads = [threading.Thread(target=enter_both) for _ in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
    # a thread's states go as its last step, just after join() returns
    deadline = time.monotonic() + 10
    while [_thread_states(i) for i in work.all_instances()] != before:
        assert time.monotonic() < deadline, "thread states of exited threads remain"
        time.sleep(0.05)


def test_many_threads_share_one_interpreter(work):
    results: dict[int, list[int]] = {}

    def run(n: int) -> None:
        with work[0].acquire_session() as s:
            square = s.global_("entry_work", "square")
            results[n] = [square(n + i).deref() for i in range(200)]

    threads = [threading.Thread(target=run, args=(n,)) for n in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert results == {n: [(n + i) ** 2 for i in range(200)] for n in range(8)}


def test_one_thread_interleaves_interpreters(work):
    squares = [i.acquire_session().global_("entry_work", "square") for i in work.all_instances()]
    for n in range(1000):
        assert squares[n % 2](n).deref() == n * n


def test_errors_are_described_on_any_thread(work):
    # Formatting a traceback inside runs the tokenizer, which needs the <ctype.h> tables
    # that the interpreter's libc sets up only for threads it started itself.
    caught = []

    def fail() -> None:
        with work.acquire_one() as s:
            try:
                s.global_("builtins", "int")("not a number")
            except ValueError as error:
                caught.append(error)

    thread = threading.Thread(target=fail)
    thread.start()
    thread.join(timeout=60)
    assert len(caught) == 1 and "not a number" in str(caught[0])
    assert isinstance(caught[0].__cause__, multipy.RemoteTraceback)
    assert "ValueError" in caught[0].__cause__.traceback_text


def test_a_call_runs_on_the_calling_thread(work):
    seen = {}

    def run() -> None:
        with work.acquire_one() as s:
            seen["inside"] = s.global_("threading", "get_ident")().deref()
        seen["host"] = threading.get_ident()

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(timeout=60)
    assert seen["inside"] == seen["host"]
