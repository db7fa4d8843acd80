"""The manager: registered modules, environments, load balancing, reuse, threads."""
from __future__ import annotations

import threading

import pytest

import multipy
from multipy import _host, session
from multipy._pool import capacity


def test_len_index_and_instances(manager):
    assert len(manager) == 2
    assert [i.index for i in manager.all_instances()] == [0, 1]
    assert manager[1] is manager.all_instances()[1]


def test_registered_module_in_every_interpreter(manager):
    before = manager.count_registered_module_sources()
    manager.register_module_source("greeting", "def hello(name):\n    return f'hello {name}'\n")
    assert manager.count_registered_module_sources() == before + 1
    for interpreter in manager.all_instances():
        with interpreter.acquire_session() as s:
            assert s.global_("greeting", "hello")("multipy").deref() == "hello multipy"


def test_registered_package_with_submodule(manager):
    manager.register_module_source("regpkg", "VALUE = 1\n")
    manager.register_module_source("regpkg.sub", "from regpkg import VALUE\nDOUBLE = VALUE * 2\n")
    with manager.acquire_one() as s:
        assert s.global_("regpkg.sub", "DOUBLE").deref() == 2


def test_register_rejects_syntax_errors(manager):
    before = manager.count_registered_module_sources()
    with pytest.raises(SyntaxError):
        manager.register_module_source("broken", "def (:\n")
    assert manager.count_registered_module_sources() == before


def test_load_balancer_prefers_free_then_least_used(manager):
    first = manager.acquire_one()
    second = manager.acquire_one()
    assert {first.interpreter.index, second.interpreter.index} == {0, 1}
    extra = first.interpreter.acquire_session()  # first's interpreter now has 2 uses
    third = manager.acquire_one()  # all busy: the least used
    assert third.interpreter is second.interpreter
    for s in (first, second, extra, third):
        s.close()
    # affinity: with everything free, a thread gets its last interpreter back
    with manager.acquire_one() as s:
        last = s.interpreter.index
    with manager.acquire_one() as s:
        assert s.interpreter.index == last


def test_take_if_idle_takes_only_a_free_interpreter(manager):
    interpreter = manager[0]
    assert interpreter.occupancy.take_if_idle()
    try:
        assert interpreter.open_sessions == 1
        assert not interpreter.occupancy.take_if_idle()  # busy: left to the full pick
    finally:
        interpreter.hand_back()
    assert interpreter.open_sessions == 0


class _Runtime:
    """What an occupancy reads of its runtime."""
    out_of_room: str | None = None

    def __init__(self) -> None:
        self.abandoned_calls: set = set()


@pytest.mark.parametrize("occupancy", [_host.Occupancy, session._Occupancy],
                         ids=["C", "reference"])
def test_an_occupancy_counts_users_and_is_taken_only_when_free(occupancy):
    runtime = _Runtime()
    seat = occupancy(runtime)
    assert seat.take_if_idle() and seat.users == 1
    assert not seat.take_if_idle() and seat.users == 1  # busy
    seat.take()  # a session opens anyway
    assert seat.users == 2
    seat.give_back()
    seat.give_back()
    assert seat.users == 0
    runtime.abandoned_calls.add("a call its caller gave up on")
    assert not seat.take_if_idle()
    runtime.abandoned_calls.clear()
    runtime.out_of_room = "no room (a test)"
    assert not seat.take_if_idle()
    runtime.out_of_room = None
    seat.close()
    assert not seat.take_if_idle() and seat.users == 0


def test_the_interpreters_count_users_as_the_call_path_says(manager):
    expected = _host.Occupancy if session._C_CALL_PATH else session._Occupancy
    assert all(type(i.occupancy) is expected for i in manager.all_instances())


def test_the_last_pick_is_passed_by_once_it_has_no_room(manager):
    with manager.acquire_one() as s:
        last = s.interpreter
    last._runtime.out_of_room = "no room (a test)"
    try:
        assert not last.occupancy.take_if_idle()
        chosen = manager.occupy_one()
        chosen.hand_back()
        assert chosen is not last
    finally:
        last._runtime.out_of_room = None


def test_debug_limit_interpreters(manager):
    manager.debug_limit_interpreters(1)
    try:
        held = [manager.acquire_one() for _ in range(3)]
        assert {s.interpreter.index for s in held} == {0}
        for s in held:
            s.close()
    finally:
        manager.debug_limit_interpreters(len(manager))
    with pytest.raises(ValueError):
        manager.debug_limit_interpreters(3)


def test_sixteen_threads_on_two_interpreters(manager):
    manager.register_module_source("work", (
        "import threading\n"
        "def square_sum(n, offset=0):\n"
        "    return sum(i * i for i in range(n)) + offset\n"))
    errors, results = [], []

    def worker(t):
        try:
            for k in range(40):
                with manager.acquire_one() as s:
                    value = s.global_("work", "square_sum")(100 + k, offset=t).deref()
                    results.append(value == sum(i * i for i in range(100 + k)) + t)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not any(thread.is_alive() for thread in threads), "deadlock"
    assert not errors
    assert len(results) == 16 * 40 and all(results)


def test_path_environment_and_reuse(tmp_path, manager):
    (tmp_path / "from_environment.py").write_text("WHERE = 'environment'\n")
    started = []
    for _ in range(3):  # managers come and go; interpreters are reused
        with multipy.InterpreterManager(2, multipy.PathEnvironment(tmp_path)) as m:
            with m.acquire_one() as s:
                assert s.global_("from_environment", "WHERE").deref() == "environment"
                assert str(tmp_path) in s.global_("sys", "path").deref()
                leftover = s.global_("builtins", "object")()
        with pytest.raises(multipy.InterpreterClosedError, match="closed"):
            leftover.attr("__class__")
        with pytest.raises(multipy.InterpreterClosedError):
            m.acquire_one()
        started.append(capacity()["started"])
    assert started[0] == started[1] == started[2], "a closed manager's interpreters are reused"
    # a manager without the environment sees neither its path nor its modules
    with multipy.InterpreterManager(2) as m:
        for interpreter in m.all_instances():
            with interpreter.acquire_session() as s:
                assert str(tmp_path) not in s.global_("sys", "path").deref()
                with pytest.raises(ModuleNotFoundError):
                    s.global_("from_environment", "WHERE")


def test_custom_environment(manager):
    class Flagged(multipy.Environment):
        def configure(self, session):
            session.global_("os", "environ.__setitem__")("MULTIPY_FLAG", "on")

        def unconfigure(self, session):
            session.global_("os", "environ.pop")("MULTIPY_FLAG")

    with multipy.InterpreterManager(2, Flagged()) as m:
        for interpreter in m.all_instances():
            with interpreter.acquire_session() as s:
                assert s.global_("os", "environ.get")("MULTIPY_FLAG").deref() == "on"
    with multipy.InterpreterManager(2) as m:  # the same interpreters, unconfigured
        for interpreter in m.all_instances():
            with interpreter.acquire_session() as s:
                assert s.global_("os", "environ.get")("MULTIPY_FLAG").deref() is None


def test_failing_unconfigure_still_returns_every_interpreter(manager):
    class Broken(multipy.Environment):
        def unconfigure(self, session):
            raise RuntimeError("cannot undo")

    free_before = capacity()["free"]
    m = multipy.InterpreterManager(2, Broken())
    with pytest.raises(RuntimeError, match="cannot undo"):
        m.close()
    assert capacity()["free"] == free_before


def test_reregistering_a_source_replaces_the_module(manager):
    manager.register_module_source("versioned", "VERSION = 1\n")
    with manager.acquire_one() as s:
        assert s.global_("versioned", "VERSION").deref() == 1
        manager.register_module_source("versioned", "VERSION = 2\n")
        assert s.global_("versioned", "VERSION").deref() == 2




def test_registering_a_module_leaves_the_others_alone(manager):
    manager.register_module_source("counter", (
        "count = 0\n"
        "class Thing:\n    pass\n"
        "def bump():\n    global count\n    count += 1\n    return count\n"))
    with manager[0].acquire_session() as s:
        bump = s.global_("counter", "bump")
        assert [bump().deref() for _ in range(3)] == [1, 2, 3]
        thing = s.global_("counter", "Thing")()
        manager.register_module_source("unrelated", "X = 1\n")
        assert bump().deref() == 4  # the counter kept its state
        is_thing = s.global_("builtins", "isinstance")(thing, s.global_("counter", "Thing"))
        assert is_thing.deref() is True


def test_a_dropped_manager_gives_its_interpreters_back(python):
    result = python("""
        import gc, multipy
        from multipy._pool import capacity
        m = multipy.InterpreterManager(2)
        m.register_module_source("left_behind", "X = 1\\n")
        del m
        gc.collect()
        print("FREE", capacity()["free"])
        with multipy.InterpreterManager(2) as again:
            try:
                again[0].global_("left_behind", "X")
            except ModuleNotFoundError:
                print("RESET")
        print("STARTED", capacity()["started"])
    """, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["FREE", "2", "RESET", "STARTED", "2"]


def test_a_request_that_raced_close_does_not_run_in_the_next_manager():
    m = multipy.InterpreterManager(1)
    stale = m[0]
    make_list = stale.global_("builtins", "list")
    m.close()
    with multipy.InterpreterManager(1) as again:  # the same interpreter, reset
        with again[0].acquire_session() as s:
            stats = s.global_("multipy._inside", "stats")
            before = stats().deref()["objects"]
            stale._closed = False  # as if the request had passed the check just before close()
            with pytest.raises(multipy.InterpreterClosedError):
                make_list([1, 2])
            assert stats().deref()["objects"] == before
    assert stale._runtime.idle(), "the refused request left its entry counted"


def test_validation(manager):
    session = manager[0].acquire_session()
    session.close()
    with pytest.raises(multipy.InterpreterClosedError):
        session.global_("math", "pi")
    with pytest.raises(ValueError):
        with multipy.timeout(-1):
            pass
    with pytest.raises(ValueError, match="standard library"):
        manager.register_module_source("json", "X = 1\n")
    manager.register_module_source("fake_tls", (
        "def fail():\n    raise ValueError('cannot allocate memory in static TLS block')\n"))
    with manager.acquire_one() as s:
        with pytest.raises(ValueError):  # not a library load: it stays what it is
            s.global_("fake_tls", "fail")()
    with multipy.InterpreterManager(1) as other:
        replicated = multipy.ReplicatedObj(manager, lambda i: i.global_("math", "pi"))
        with pytest.raises(multipy.WrongInterpreterError):
            replicated.acquire_session(other[0])
        with other[0].acquire_session() as s, pytest.raises(multipy.WrongInterpreterError):
            s.from_movable(replicated)
