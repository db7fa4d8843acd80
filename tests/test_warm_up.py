"""ReplicatedObj.warm_up: materialise on every interpreter at once, optionally call once."""
from __future__ import annotations

import importlib.util
import itertools
import os
import threading
import time

import pytest

import multipy

WORK = '''
import os, threading, time

made = {}   # key -> how many times this interpreter built the object
calls = {}  # key -> [(args, kwargs, host thread), ...]


class Worker:
    def __init__(self, key):
        self.key = key

    def __call__(self, *args, **kwargs):
        calls.setdefault(self.key, []).append((args, kwargs, threading.get_ident()))
        if kwargs.get("fail"):
            raise ValueError("bad input")
        meet = kwargs.get("meet")
        if meet:  # wait until `count` threads (one per interpreter) are here at once
            directory, count = meet
            open(os.path.join(directory, str(threading.get_ident())), "w").close()
            deadline = time.monotonic() + 30
            while len(os.listdir(directory)) < count:
                if time.monotonic() > deadline:
                    raise RuntimeError("the other interpreters never came: warm-up was serial")
                time.sleep(0.005)
        return len(args)


def make(key, index, fail_on=None):
    if index == fail_on:
        raise RuntimeError(f"cannot build {key} in interpreter {index}")
    made[key] = made.get(key, 0) + 1
    return Worker(key)


def count_made(key):
    return made.get(key, 0)


def recorded_calls(key):
    return calls.get(key, [])
'''

_keys = itertools.count()


@pytest.fixture(scope="module")
def work(manager):
    manager.register_module_source("warm_up_work", WORK)
    return manager


def _replicated(manager, fail_on=None):
    """A fresh replicated Worker with its own key, built by the registered module."""
    key = f"worker-{next(_keys)}"

    def load(interpreter):
        return interpreter.global_("warm_up_work", "make")(key, interpreter.index, fail_on)

    return key, multipy.ReplicatedObj(manager, load)


def _ask(interpreter, function, key):
    with interpreter.acquire_session() as session:
        return session.global_("warm_up_work", function)(key).deref()


def _idle(manager):
    return all(i.open_sessions == 0 for i in manager.all_instances())


def test_warm_up_materialises_on_every_interpreter_without_calling(work):
    key, replicated = _replicated(work)
    assert not any(i in replicated._instances for i in work.all_instances())
    assert replicated.warm_up() is None
    for interpreter in work.all_instances():
        assert interpreter in replicated._instances
        assert _ask(interpreter, "count_made", key) == 1
        assert _ask(interpreter, "recorded_calls", key) == []
    assert _idle(work)


def test_warm_up_builds_nothing_twice(work):
    key, replicated = _replicated(work)
    replicated.instance(work[0])  # already there: only the others are built
    replicated.warm_up()
    replicated.warm_up()
    assert replicated(1, 2) == 2
    assert [_ask(i, "count_made", key) for i in work.all_instances()] == [1] * len(work)


def test_warm_up_calls_once_on_each_interpreter_at_once(work, tmp_path):
    key, replicated = _replicated(work)
    n = len(work)
    # each call waits until one call per interpreter is inside at the same time: a
    # warm-up that went through the interpreters one after the other fails here
    assert replicated.warm_up(7, "x", meet=(str(tmp_path), n)) is None
    threads = set()
    for interpreter in work.all_instances():
        assert interpreter in replicated._instances
        (args, kwargs, thread), = _ask(interpreter, "recorded_calls", key)
        assert args == (7, "x") and kwargs == {"meet": (str(tmp_path), n)}
        threads.add(thread)
    assert len(threads) == n  # one host thread per interpreter...
    assert threading.get_ident() not in threads  # ...none of them the caller
    assert len(os.listdir(tmp_path)) == n
    assert _idle(work)


def test_warm_up_raises_the_error_of_building(work):
    key, replicated = _replicated(work, fail_on=1)
    with pytest.raises(RuntimeError, match="cannot build .* in interpreter 1"):
        replicated.warm_up()
    assert work[0] in replicated._instances  # the others finished before it raised
    assert work[1] not in replicated._instances
    assert _idle(work)


def test_warm_up_raises_the_error_of_the_call(work):
    key, replicated = _replicated(work)
    with pytest.raises(ValueError, match="bad input"):
        replicated.warm_up(fail=True)
    for interpreter in work.all_instances():
        assert interpreter in replicated._instances
        assert len(_ask(interpreter, "recorded_calls", key)) == 1
    assert _idle(work)


def test_warm_up_keeps_the_callers_timeout(work, tmp_path):
    key, replicated = _replicated(work)
    # one participant more than there are interpreters: the calls wait until cancelled
    with multipy.timeout(0.5), pytest.raises(TimeoutError):
        replicated.warm_up(meet=(str(tmp_path), len(work) + 1))
    deadline = time.monotonic() + 30  # the cancelled calls end at their next bytecode
    while any(i.running_abandoned_call for i in work.all_instances()):
        assert time.monotonic() < deadline, "a cancelled warm-up call is still running"
        time.sleep(0.01)
    assert _idle(work)


def _generate(directory, names):
    path = os.path.join(os.path.dirname(__file__), "..", "examples", "generate_examples.py")
    spec = importlib.util.spec_from_file_location("generate_examples", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.generate(directory, names)


def test_warm_up_of_a_torch_package_and_a_movable(manager, tmp_path):
    torch = pytest.importorskip("torch")
    path = _generate(str(tmp_path), ["simple"])["simple"]
    importer = torch.package.PackageImporter(path)
    example = importer.load_pickle("model", "example.pkl")
    expected = importer.load_pickle("model", "expected.pkl")
    package = manager.load_package(path)
    model = package.load_pickle("model", "model.pkl")
    assert model.warm_up(*example) is None
    for interpreter in manager.all_instances():
        assert interpreter in model._instances
        assert interpreter in package._importers[None]  # the importers over host memory
    assert torch.allclose(model(*example), expected, rtol=1e-5, atol=1e-5)

    with manager[0].acquire_session() as session:
        torch.manual_seed(0)
        linear = session.global_("torch.nn", "Linear")(4, 2)
        movable = manager.create_movable(linear, session)
    movable.warm_up()
    assert all(i in movable._instances for i in manager.all_instances())
    x = torch.randn(3, 4)
    with manager[1].acquire_session() as session:
        weight = session.from_movable(movable).attr("weight").deref()
    assert weight.shape == (2, 4)
    assert movable(x).shape == (3, 2)
    assert _idle(manager)
