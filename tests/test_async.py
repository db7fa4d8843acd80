"""The asyncio API: ``await r.acall(...)`` and ``await r.acall_method(...)`` never block
the event loop, and cancelling the awaiting task cancels the call inside."""
from __future__ import annotations

import asyncio
import time

import pytest

import multipy

WORK = '''
import os, time

state = {"steps": 0, "stopped_by": None, "started": 0}

def square(x):
    return x * x

def fail(message):
    raise ValueError(message)

def wait_for_file(path, limit):
    """Runs Python until path exists (at most limit seconds): only a loop that keeps
    running while this runs can create it."""
    deadline = time.monotonic() + limit
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            return "gave up"
        time.sleep(0.001)
    return "seen"

def count(deadline):
    while time.monotonic() < deadline:
        state["steps"] += 1

def spin(started_path, limit):
    """Counts in Python until cancelled (at most limit seconds); notes what stopped it.
    The loop is a function of its own: CPython 3.11-3.13 can skip the handlers of the
    frame whose loop back edge the exception lands on (CPython gh-108214), not those of
    its callers."""
    state["stopped_by"] = None
    try:  # a cancel may land anywhere from here: once counted, it is noted
        state["started"] += 1
        open(started_path, "w").close()
        count(time.monotonic() + limit)
        return "not cancelled"
    except BaseException as error:
        state["stopped_by"] = type(error).__name__
        raise

class Counter:
    def __init__(self):
        self.total = 0

    def add(self, n):
        self.total += n
        return self.total
'''


@pytest.fixture(scope="module")
def work(manager):
    manager.register_module_source("aio_work", WORK)
    return manager


def _replicated(manager, name):
    return multipy.ReplicatedObj(manager, lambda i: i.global_("aio_work", name))


def _states(manager):
    states = []
    for interpreter in manager.all_instances():
        with interpreter.acquire_session() as session:
            states.append(session.global_("aio_work", "state").deref())
    return states


async def _until(predicate, limit=30.0):
    """Waits (asynchronously) until predicate() is true; fails after limit seconds."""
    deadline = time.monotonic() + limit
    while not predicate():
        assert time.monotonic() < deadline, "the condition never became true"
        await asyncio.sleep(0.005)


@pytest.mark.timeout(60)
def test_acall_returns_what_the_blocking_call_returns(work):
    square = _replicated(work, "square")

    async def main():
        values = await asyncio.gather(*(square.acall(n) for n in range(20)))
        assert values == [n * n for n in range(20)] == [square(n) for n in range(20)]
        assert await square.acall(x=3) == 9
        with pytest.raises(ValueError, match="no good"):
            await _replicated(work, "fail").acall("no good")
        # a method: the counter class's instance is made by calling the class inside
        made = multipy.ReplicatedObj(work, lambda i: i.global_("aio_work", "Counter")())
        first = await made.acall_method("add", 2)
        assert first == 2 and await made.acall_method("add", n=5) in (5, 7)

    asyncio.run(main())


@pytest.mark.timeout(60)
def test_the_loop_keeps_running_during_a_call(work, tmp_path):
    wait = _replicated(work, "wait_for_file")
    flag = tmp_path / "flag"
    ticks = []

    async def main():
        call = asyncio.ensure_future(wait.acall(str(flag), 30))
        while len(ticks) < 5:  # the call is running inside meanwhile
            await asyncio.sleep(0.01)
            ticks.append(call.done())
        flag.touch()  # only the running loop can end the call
        return await call

    assert asyncio.run(main()) == "seen"
    assert ticks == [False] * 5


@pytest.mark.timeout(90)
@pytest.mark.parametrize("how", ["task.cancel", "wait_for"])
def test_cancelling_the_task_cancels_the_call_inside(work, tmp_path, how):
    spin = _replicated(work, "spin")
    square = _replicated(work, "square")
    started = tmp_path / "started"
    before = [state["started"] for state in _states(work)]

    async def main():
        if how == "task.cancel":
            call = asyncio.ensure_future(spin.acall(str(started), 60))
            await _until(started.exists)
            call.cancel()
            with pytest.raises(asyncio.CancelledError):
                await call
        else:
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(spin.acall(str(started), 60), 2.0)
        # the call stops inside (CallCancelled at its next bytecode), soon, not in 60 s
        await _until(lambda: not any(i.running_abandoned_call for i in work.all_instances()))
        states = _states(work)
        ran = [(state, was) for state, was in zip(states, before) if state["started"] != was]
        if ran:  # on one interpreter, once, stopped by the cancel
            assert len(ran) == 1 and ran[0][0]["started"] == ran[0][1] + 1
            assert ran[0][0]["stopped_by"] == "CallCancelled"
        else:  # given up before it started (a very slow machine): it never ran
            assert not started.exists()
        # the manager keeps serving, asynchronously and not
        assert await asyncio.gather(*(square.acall(n) for n in range(8))) == \
            [n * n for n in range(8)]
        assert square(12) == 144

    asyncio.run(main())


@pytest.mark.timeout(60)
def test_a_cancelled_call_stops_counting(work, tmp_path):
    """Once cancelled and stopped, the loop inside makes no more steps."""
    spin = _replicated(work, "spin")
    started = tmp_path / "started"

    async def main():
        call = asyncio.ensure_future(spin.acall(str(started), 60))
        await _until(started.exists)
        call.cancel()
        await asyncio.gather(call, return_exceptions=True)
        await _until(lambda: not any(i.running_abandoned_call for i in work.all_instances()))

    asyncio.run(main())
    steps = [state["steps"] for state in _states(work)]
    time.sleep(0.05)
    assert [state["steps"] for state in _states(work)] == steps


@pytest.mark.timeout(60)
def test_acall_on_a_closed_manager_raises(tmp_path):
    with multipy.InterpreterManager(1) as manager:
        manager.register_module_source("aio_closed", "def one():\n    return 1\n")
        one = multipy.ReplicatedObj(manager, lambda i: i.global_("aio_closed", "one"))
        assert asyncio.run(one.acall()) == 1
    with pytest.raises(multipy.InterpreterClosedError):
        asyncio.run(one.acall())

