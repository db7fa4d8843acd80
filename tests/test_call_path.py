"""The call path in C (multipy/_host.c, Entry.call_value; multipy/_bootstrap.c,
fast_call) and the Python reference path (MULTIPY_CALL_PATH=python) give the same
answers: the call-path tests run again, in a process of their own, on the reference path.
"""
from __future__ import annotations

import gc
import os
import subprocess
import sys
import threading
import weakref

import pytest

torch = pytest.importorskip("torch")

import multipy  # noqa: E402
from multipy import _protocol, _sharing  # noqa: E402
from multipy import session as session_module  # noqa: E402
from multipy._runtime import exports as host_exports  # noqa: E402

ON_C_PATH = os.environ.get("MULTIPY_CALL_PATH", "c") != "python"
HERE = os.path.dirname(os.path.abspath(__file__))

#: The tests whose calls take the call path in every way it can end, run again on the
#: reference path: values and tensors each way, errors, faults, Ctrl-C and timeouts,
#: asyncio, the load balancer's layer.
REFERENCE_RUN = ["test_call_path.py", "test_entry.py", "test_interpreters.py", "test_torch.py",
                 "test_errors.py", "test_faults.py", "test_lifecycle.py", "test_async.py",
                 "test_manager.py"]


@pytest.fixture(scope="module")
def tools():
    with multipy.InterpreterManager(1) as m:
        m.register_module_source("call_path_tools", (
            "import torch\n"
            "def fail_after(t):\n"
            "    t.add_(1)\n"
            "    raise ValueError(f'failed with {t.tolist()}')\n"
            "def scale(t, by=2):\n"
            "    return t * by\n"
            "class Model(torch.nn.Module):\n"
            "    def forward(self, x):\n"
            "        return x + 1, x.sum().item()\n"
            "    def twice(self, x):\n"
            "        return x * 2\n"
            "from multipy import _sharing\n"
            "handled = []\n"
            "def count_handled_calls():\n"
            "    alias_flat = _sharing.alias_flat  # the handler's, not the fast path's\n"
            "    if getattr(alias_flat, 'counted', False):\n"
            "        return\n"
            "    def counted(*args):\n"
            "        handled.append(1)\n"
            "        return alias_flat(*args)\n"
            "    counted.counted = True\n"
            "    _sharing.alias_flat = counted\n"
            "def handled_calls():\n"
            "    return len(handled)\n"))
        with m[0].acquire_session() as s:
            yield m, s


def test_the_call_path_follows_the_environment(tools):
    _, s = tools
    assert session_module._C_CALL_PATH is ON_C_PATH
    assert s.global_("multipy._protocol", "C_CALL_PATH").deref() is ON_C_PATH


def test_calls_of_values_give_the_same_answers_on_either_path(tools):
    _, s = tools
    model = s.global_("call_path_tools", "Model")()
    x = torch.arange(6.0).reshape(2, 3)
    plus_one, total = model.call_value(None, (x,))
    assert torch.equal(plus_one, x + 1) and total == 15.0
    assert torch.equal(model.call_value("twice", (x,)), x * 2)
    scale = s.global_("call_path_tools", "scale")
    assert torch.equal(scale.call_value(None, (x,), {"by": 3}), x * 3)  # keyword arguments
    assert scale.call_value(None, (4,)) == 8  # plain both ways
    assert scale.call_value(None, ([1],)) == [1, 1]


def test_the_common_call_takes_the_path_the_environment_says(tools, monkeypatch):
    _, s = tools
    model = s.global_("call_path_tools", "Model")()
    x = torch.ones(2)
    model.call_value(None, (x,))  # the first call of an object names it: the handler's
    s.global_("call_path_tools", "count_handled_calls")()
    requests = []
    request = session_module.Interpreter.request
    monkeypatch.setattr(session_module.Interpreter, "request",
                        lambda *args: requests.append(args[1]) or request(*args))
    for _ in range(3):
        model.call_value(None, (x,))
    made = len(requests)  # before the calls below, which are requests
    handled = s.global_("call_path_tools", "handled_calls").call_value(None)
    assert (made, handled) == ((0, 0) if ON_C_PATH else (3, 3))


def test_an_error_after_tensors_came_in_gives_back_what_was_lent(tools):
    m, s = tools
    fail_after = s.global_("call_path_tools", "fail_after")
    x = torch.zeros(2)
    before = len(host_exports)
    with pytest.raises(ValueError, match=r"failed with \[1.0, 1.0\]") as raised:
        fail_after.call_value(None, (x,))
    assert x.tolist() == [1.0, 1.0]  # the call ran once, on the host's memory
    assert "fail_after" in str(raised.value.__cause__)  # the remote traceback
    with m[0].acquire_session() as again:
        again.global_("gc", "collect")()
        again.global_("builtins", "abs")(-1)  # brings back the released tokens
    assert len(host_exports) == before


def test_a_replicated_object_s_calls_take_the_call_path(tools):
    m, s = tools
    replicated = m.create_movable(s.global_("call_path_tools", "Model")(), s)
    x = torch.ones(3)
    plus_one, total = replicated(x)
    assert torch.equal(plus_one, x + 1) and total == 3.0
    assert torch.equal(replicated.call_method("twice", x), x * 2)


_REPLICAS_TOOLS = (
    "class Scale:\n"
    "    def __call__(self, t, by=2):\n"
    "        if by == 0:\n"
    "            raise ValueError('by 0')\n"
    "        return t * by\n")


def test_a_replicated_call_runs_in_c_when_its_interpreter_is_free(monkeypatch):
    """A ReplicatedObj's call runs in C (_host.Replicas, no _call) on the calling
    thread's last pick when it is free and the object made there; by _call otherwise
    (not made yet, busy, under multipy.timeout, keyword arguments, unloaded, the manager
    closed), with the same answers; the interpreter is free again after every call, one
    that raised too.  On the reference path, every call is _call's."""
    from multipy.replicated import ReplicatedObj

    by_python = []
    python_call = ReplicatedObj._call

    def counted(self, method, args, kwargs):
        by_python.append(method)
        return python_call(self, method, args, kwargs)

    monkeypatch.setattr(ReplicatedObj, "_call", counted)
    x = torch.arange(4.0)
    with multipy.InterpreterManager(1) as m:
        m.register_module_source("replicas_tools", _REPLICAS_TOOLS)
        with m.acquire_one() as s:
            replicated = m.create_movable(s.global_("replicas_tools", "Scale")(), s)
        interpreter = m[0]

        def calls_by_python(call) -> int:
            before = len(by_python)
            call()
            assert interpreter.open_sessions == 0
            return len(by_python) - before

        def doubles():
            assert torch.equal(replicated(x), x * 2)

        in_c = 0 if ON_C_PATH else 1
        assert calls_by_python(doubles) == 1  # made on this first call
        assert calls_by_python(doubles) == in_c
        assert calls_by_python(lambda: replicated(3)) == in_c and replicated(3) == 6
        with pytest.raises(ValueError, match="by 0"):
            replicated(x, 0)
        assert interpreter.open_sessions == 0
        assert calls_by_python(doubles) == in_c  # after an error, in C again
        assert calls_by_python(lambda: torch.equal(replicated(x, by=3), x * 3)) == 1
        with multipy.timeout(30):
            assert calls_by_python(doubles) == 1
        with interpreter.acquire_session():  # busy: the load balancer's pick, by _call
            before = len(by_python)
            doubles()
            assert len(by_python) - before == 1
        replicated.unload()
        assert calls_by_python(doubles) == 1  # made again, by _call
        assert calls_by_python(doubles) == in_c
        with m.acquire_one() as s:
            other = m.create_movable(s.global_("replicas_tools", "Scale")(), s)
        assert torch.equal(other(x), x * 2) and torch.equal(other(x), x * 2)
        dropped = weakref.ref(other)
        gc.disable()  # dropped, it goes at once: its copies do not wait for the collector
        try:
            other = None
            assert dropped() is None
        finally:
            gc.enable()
    with pytest.raises(multipy.InterpreterClosedError):
        replicated(x)
    assert by_python[-1] is None


def test_a_tensor_result_goes_back_however_the_host_reads_it(tools, monkeypatch):
    # On the C path a tensor result comes back in a TENSOR reply: read by the host's C
    # entry, or by Interpreter._finish under multipy.timeout
    _, s = tools
    statuses = []
    finish = session_module.Interpreter._finish
    monkeypatch.setattr(session_module.Interpreter, "_finish",
                        lambda self, reply, lent: statuses.append(reply[0]) or finish(
                            self, reply, lent))
    scale, stats = s.global_("call_path_tools", "scale"), s.global_("multipy._inside", "stats")
    x = torch.arange(4.0)
    scale.call_value(None, (x,))  # an object's first call takes the handler's path
    before = stats.call_value(None)["lent"]
    # a timed call runs on a worker thread, and a thread's first call here takes the
    # handler's path too: timed calls until one has taken C's (the workers are few)
    for calls in range(200):
        limit = None if calls == 0 else 60
        with multipy.timeout(limit):
            y = scale.call_value(None, (x,))
        assert torch.equal(y, x * 2)
        assert stats.call_value(None)["lent"] == before + 1
        del y
        assert stats.call_value(None)["lent"] == before  # this call carried the release
        if calls and _protocol.TENSOR in statuses:
            break
    assert (_protocol.TENSOR in statuses) is ON_C_PATH  # a timed call's reply


def _call_tensor(interpreter, target, x: torch.Tensor):
    """target(x) as a CALL_TENSOR request (x lent, its record's token and address the
    body), as the C entry makes it: the reply read by the host's Python."""
    lent = _sharing.Lent(host_exports)
    _, token, address = _sharing.describe(x, lent)
    body = _protocol.LENT_TENSOR.pack(token, address)
    reply = interpreter._runtime.call(_protocol.CALL_TENSOR, target._handle, interpreter._epoch,
                                      body, 0, lent)
    return interpreter._finish(reply, lent)


def test_a_call_with_one_tensor_alone_runs_on_either_side_s_path(tools):
    # CALL_TENSOR (the C entry's request for target(x), x a CPU tensor): run by C's fast
    # path on a thread that has called before, by the handler on a thread's first call
    # (and on the reference path); the alias is of the host's memory, and every token
    # goes back
    m, s = tools
    scale, fail_after = (s.global_("call_path_tools", name) for name in ("scale", "fail_after"))
    x = torch.arange(3.0)
    scale.call_value(None, (x,))  # an object's first call names it (the handler's)
    before = len(host_exports)
    s.global_("call_path_tools", "count_handled_calls")()
    handled = s.global_("call_path_tools", "handled_calls")
    counts = [handled.call_value(None)]
    assert torch.equal(_call_tensor(s.interpreter, scale, x), x * 2)
    counts.append(handled.call_value(None))
    answers = []
    thread = threading.Thread(target=lambda: answers.append(
        _call_tensor(s.interpreter, scale, x)))
    thread.start()
    thread.join()
    assert torch.equal(answers[0], x * 2)
    counts.append(handled.call_value(None))
    assert counts[1] - counts[0] == (0 if ON_C_PATH else 1)  # by C, or by the handler
    assert counts[2] - counts[1] == 1  # a thread's first call: the handler's
    with pytest.raises(ValueError, match=r"failed with \[1.0, 2.0, 3.0\]"):
        _call_tensor(s.interpreter, fail_after, x)
    assert x.tolist() == [1.0, 2.0, 3.0]  # the call ran on the host's memory
    answers.clear()  # the aliases of the results go
    with m[0].acquire_session() as again:
        again.global_("gc", "collect")()
        again.global_("builtins", "abs")(-1)  # brings back the released tokens
    assert len(host_exports) == before


def test_an_unread_tensor_reply_names_its_token():
    # what the host gives back when a TENSOR reply is not read (Ctrl-C, say)
    payload = _protocol.LENT_TENSOR.pack(7, 0x7F00DEAD0000)
    assert _sharing.lent_tokens(payload, _protocol.TENSOR) == [7]


_REPOINTED = """
import torch, multipy
with multipy.InterpreterManager(1) as m:
    m.register_module_source("kept", (
        "import torch\\n"
        "kept = []\\n"
        "def keep(t):\\n"
        "    kept.append(t)\\n"
        "    out = t * 3\\n"
        "    kept.append(out)\\n"
        "    return out\\n"
        "def repoint():\\n"
        "    kept.pop().set_(torch.zeros(1))\\n"
        "    return kept.pop().sum().item()\\n"))
    with m[0].acquire_session() as s:
        keep, repoint = s.global_("kept", "keep"), s.global_("kept", "repoint")
        for _ in range(2):  # an object's first call takes the handler's path, then C's
            x = torch.ones(4 << 20)  # 16 MB: once freed, its pages go back to the system
            y = keep.call_value(None, (x,))
            x.set_(torch.zeros(1))
            print(repoint.call_value(None), y.sum().item())
"""


@pytest.mark.timeout(300)
def test_lent_memory_survives_either_owner_repointing_its_tensor(python):
    # Each side keeps what it lent alive, not only the tensor: re-pointing the tensor
    # (set_) on the side that lent it leaves the other side's alias its memory; in a
    # process of its own, as a regression reads freed memory
    result = python(_REPOINTED, launcher=True, timeout=240)
    assert result.returncode == 0, result.stderr[-4000:]
    size = 4 << 20
    assert result.stdout.split() == [str(float(size)), str(float(3 * size))] * 2


_WEAKLY_HELD = """
import torch, multipy
with multipy.InterpreterManager(1) as m:
    m.register_module_source("weakly", (
        "import torch, weakref\\n"
        "refs = []\\n"
        "def weakly(t):\\n"
        "    out = t * 3\\n"
        "    refs.append(weakref.ref(out))\\n"
        "    return out\\n"
        "def repoint():\\n"
        "    refs.pop()().set_(torch.zeros(1))\\n"))
    with m[0].acquire_session() as s:
        weakly, repoint = s.global_("weakly", "weakly"), s.global_("weakly", "repoint")
        for _ in range(2):  # an object's first call takes the handler's path, then C's
            y = weakly.call_value(None, (torch.ones(4 << 20),))
            repoint.call_value(None)
            print(y.sum().item())
"""


@pytest.mark.timeout(300)
def test_a_result_held_only_by_a_weak_reference_keeps_its_memory(python):
    # A result that no one else holds is lent without its storage (nothing can re-point
    # it); one that a weak reference still reaches is not: re-pointed there, the host's
    # alias keeps its memory
    result = python(_WEAKLY_HELD, launcher=True, timeout=240)
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.split() == [str(float(3 * (4 << 20)))] * 2


@pytest.mark.skipif(not ON_C_PATH, reason="the reference run itself")
@pytest.mark.timeout(1500)  # a few minutes on a busy 2-core machine
def test_the_reference_path_passes_the_call_path_tests():
    result = subprocess.run(
        [sys.executable, "-m", "multipy", "run", "-m", "pytest", "-q", "-x", "-p",
         "no:cacheprovider", *(os.path.join(HERE, name) for name in REFERENCE_RUN)],
        capture_output=True, text=True, timeout=1200,
        env={**os.environ, "MULTIPY_CALL_PATH": "python"})
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
