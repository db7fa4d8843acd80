"""Faults inside interpreters, timeouts, and bad input: clear errors, nothing else breaks."""
from __future__ import annotations

import os
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import multipy
from conftest import until, write_one

RAISERS = (
    "import sys\n"
    "def system_exit():\n    sys.exit(4)\n"
    "def keyboard_interrupt():\n    raise KeyboardInterrupt\n"
    "def recurse(n=0):\n    return recurse(n + 1)\n"
    "def memory_error():\n    raise MemoryError('no room')\n"
    "def big_alloc():\n    return bytearray(1 << 62)\n"
    "def echo(*args, **kwargs):\n    return args, kwargs\n"
    "def sleep(seconds, value=None):\n"
    "    import time\n    time.sleep(seconds)\n    return value\n"
    # blocked in C (where a cancel cannot reach it) until the test writes to the FIFO
    "def wait_for(fifo, value=None):\n"
    "    with open(fifo, 'rb') as f:\n        f.read(1)\n    return value\n")


def _release(fifo) -> None:
    """Lets a wait_for(fifo) inside return, once it has opened the FIFO (60 s at most)."""
    until(lambda: write_one(fifo))


@pytest.fixture(scope="module")
def raisers(manager):
    manager.register_module_source("raisers", RAISERS)
    return manager


@pytest.mark.parametrize("name, expected", [
    ("system_exit", (multipy.InterpreterError, "builtins.SystemExit")),
    ("keyboard_interrupt", (multipy.InterpreterError, "builtins.KeyboardInterrupt")),
    ("recurse", (RecursionError, None)),
    ("memory_error", (MemoryError, None)),
    ("big_alloc", (MemoryError, None)),
])
def test_any_exception_reaches_the_caller(raisers, name, expected):
    kind, type_name = expected
    for interpreter in raisers.all_instances():
        with interpreter.acquire_session() as s:
            with pytest.raises(kind) as info:
                s.global_("raisers", name)()
            if type_name:
                assert info.value.type_name == type_name
            assert isinstance(info.value.__cause__, multipy.RemoteTraceback)
            assert s.global_("builtins", "sum")([1, 2, 3]).deref() == 6  # still usable


def test_timeout_holds_the_interpreter_until_the_call_ends(raisers, tmp_path):
    fifo = str(tmp_path / "gate")
    os.mkfifo(fifo)
    first = raisers[0].acquire_session()
    wait_for = first.global_("raisers", "wait_for")
    with multipy.timeout(2):  # long enough for the call to have started, under any load
        with pytest.raises(TimeoutError, match=r"runs \(or waits\) on there"):
            wait_for(fifo, "late")
        assert raisers[0].running_abandoned_call  # control came back before the call ended
    first.close()
    # while the abandoned call runs, the balancer hands out only the other interpreter
    for _ in range(5):
        with raisers.acquire_one() as s:
            assert s.interpreter is raisers[1]
            assert s.global_("raisers", "echo")(7).deref() == ((7,), {})
    _release(fifo)
    until(lambda: not raisers[0].running_abandoned_call)
    seen = set()
    for _ in range(4):
        held = [raisers.acquire_one() for _ in range(2)]
        seen.update(s.interpreter.index for s in held)
        for s in held:
            s.close()
    assert seen == {0, 1}
    # the caller that timed out gets its own answers afterwards, not the late one
    with raisers[0].acquire_session() as s:
        assert s.global_("raisers", "echo")("fresh").deref() == (("fresh",), {})


def test_timeout_on_acquire_when_every_interpreter_is_held(raisers):
    sessions = [i.acquire_session() for i in raisers.all_instances()]
    sleeps = [s.global_("raisers", "sleep") for s in sessions]
    with multipy.timeout(0.1):
        for sleep in sleeps:
            with pytest.raises(TimeoutError):
                sleep(1.0)
        with pytest.raises(TimeoutError, match="every interpreter"):
            raisers.acquire_one()
    for s in sessions:
        s.close()
    # the calls that timed out run on to their end (a second), then the interpreters are free
    until(lambda: not any(i.running_abandoned_call for i in raisers.all_instances()), 30)
    with raisers.acquire_one() as s:
        assert s.global_("builtins", "abs")(-2).deref() == 2


def test_calls_after_close_and_objects_of_a_closed_manager():
    m = multipy.InterpreterManager(1)
    s = m.acquire_one()
    obj = s.global_("builtins", "list")([1])
    m.close()
    with pytest.raises(multipy.InterpreterClosedError, match="closed"):
        obj.deref()
    with pytest.raises(multipy.InterpreterClosedError, match="closed"):
        s.global_("builtins", "len")
    with pytest.raises(multipy.InterpreterClosedError, match="closed"):
        m.acquire_one()
    with pytest.raises(multipy.InterpreterClosedError, match="closed"):
        m.register_module_source("late", "X = 1\n")


def test_unpicklable_result_names_the_type(raisers):
    with raisers.acquire_one() as s:
        gen = s.global_("builtins", "eval")("(x for x in range(3))")
        with pytest.raises(TypeError, match="generator"):
            gen.deref()
        assert s.global_("builtins", "list")(gen).deref() == [0, 1, 2]


values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text()
    | st.binary(),
    lambda children: st.lists(children, max_size=4) | st.tuples(children, children)
    | st.dictionaries(st.text(max_size=5), children, max_size=4),
    max_leaves=12)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(args=st.lists(values, max_size=3), kwargs=st.dictionaries(
    st.from_regex(r"[a-z]{1,6}", fullmatch=True), values, max_size=3))
def test_random_structures_round_trip(raisers, args, kwargs):
    with raisers.acquire_one() as s:
        assert s.global_("raisers", "echo")(*args, **kwargs).deref() == (tuple(args), kwargs)


def test_close_under_a_timeout_returns_every_interpreter(tmp_path):
    from multipy._pool import capacity

    fifo = str(tmp_path / "gate")
    os.mkfifo(fifo)
    m = multipy.InterpreterManager(1)
    m.register_module_source("slow_close", "def nap(fifo):\n    with open(fifo, 'rb') as f:\n"
                                           "        f.read(1)\n")
    s = m.acquire_one()
    with multipy.timeout(2):  # long enough for the call to have started
        with pytest.raises(TimeoutError):
            s.global_("slow_close", "nap")(fifo)
        free = capacity()["free"]
        m.close()  # close does not wait for the abandoned call ...
    assert capacity()["free"] == free  # ... which still holds the interpreter, ...
    _release(fifo)
    until(lambda: capacity()["free"] == free + 1)  # ... but back once it ends
    with multipy.InterpreterManager(1) as again, again.acquire_one() as fresh:
        with pytest.raises(ModuleNotFoundError):  # the reset ran before anything new
            fresh.global_("slow_close", "nap")


def test_objects_with_strange_attribute_lookup_can_be_called(raisers):
    raisers.register_module_source("strange", (
        "class Strange:\n"
        "    def __getattr__(self, name):\n"
        "        raise KeyError(name)\n"
        "    def __call__(self):\n"
        "        return 'called'\n"
        "thing = Strange()\n"))
    with raisers.acquire_one() as s:
        assert s.global_("strange", "thing")().deref() == "called"


def test_a_timeout_cancels_python_code(raisers):
    raisers.register_module_source("spin", "def forever():\n    while True:\n        pass\n")
    with raisers[1].acquire_session() as s:
        forever = s.global_("spin", "forever")
        with multipy.timeout(0.2), pytest.raises(TimeoutError):
            forever()
        # Without the cancellation the loop would never end; with it, it stops at its
        # next bytecode and the interpreter is handed out again.
        deadline = time.monotonic() + 30
        while raisers[1].running_abandoned_call:
            assert time.monotonic() < deadline, "the cancelled call still runs"
            time.sleep(0.01)
        assert s.global_("raisers", "echo")(1).deref() == ((1,), {})


def test_running_out_of_memory_while_reading_a_request_fails_only_that_call(python):
    # Under an address-space limit, the host can build a large request that the
    # interpreter then cannot read: that call fails with MemoryError, and the
    # interpreter goes on serving.
    result = python("""
        import resource, multipy
        m = multipy.InterpreterManager(1)
        length = m[0].global_("builtins", "len")
        assert length(b"warm").deref() == 4
        size = 256 << 20
        with open("/proc/self/status") as f:
            used = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize"))
        resource.setrlimit(resource.RLIMIT_AS, (used + int(2.6 * size), resource.RLIM_INFINITY))
        data = bytes(size)
        try:
            length(data)
        except MemoryError as error:  # raised inside, where the request is read
            print("MemoryError", type(error.__cause__).__name__)
        del data
        print(length(b"after").deref())
    """, timeout=60)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["MemoryError", "RemoteTraceback", "5"]
