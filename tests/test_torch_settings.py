"""torch's intra-op threads and grad mode inside interpreters: set by the manager, for
every host thread that calls in (torch keeps both per thread)."""
from __future__ import annotations

import json
import os
import threading

import pytest

pytest.importorskip("torch")

import multipy  # noqa: E402
from multipy.manager import default_torch_threads  # noqa: E402

INSIDE = "multipy._inside"


def _settings_seen_by_a_new_thread(interpreter) -> dict:
    seen = {}

    def run() -> None:
        with interpreter.acquire_session() as session:
            seen.update(session.global_(INSIDE, "torch_settings")().deref())

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(60)
    return seen


def test_default_threads_divide_the_cores_among_the_interpreters(manager):
    cores = len(os.sched_getaffinity(0))
    assert manager.torch_threads == default_torch_threads(len(manager)) == max(1, cores // 2)
    assert default_torch_threads(cores * 4) == 1
    assert manager.grad_enabled is True
    for interpreter in manager.all_instances():
        with interpreter.acquire_session() as session:
            session.global_("importlib", "import_module")("torch")
        for _ in range(2):  # new host threads, each with its own thread state inside
            assert _settings_seen_by_a_new_thread(interpreter) == {
                "threads": manager.torch_threads, "grad_enabled": True}


def test_settings_reach_threads_that_call_in_before_torch_is_imported(python):
    result = python("""
        import json, threading, multipy
        m = multipy.InterpreterManager(1, torch_threads=3, grad_enabled=False)
        m.register_module_source("model", (
            "import torch\\n"
            "layer = torch.nn.Linear(4, 2)\\n"
            "def run(x):\\n"
            "    y = layer(x)\\n"
            "    return torch.get_num_threads(), torch.is_grad_enabled(), y.requires_grad\\n"))
        with m.acquire_one() as s:
            assert s.global_("multipy._inside", "torch_settings")().deref() is None
        seen = []
        def call():
            with m.acquire_one() as s:
                run = s.global_("model", "run")  # imports torch in this call
                seen.append(list(run(s.global_("torch", "ones")(3, 4)).deref()))
        threads = [threading.Thread(target=call) for _ in range(3)]
        threads[0].start(); threads[0].join()
        for t in threads[1:]:
            t.start(); t.join()
        print(json.dumps([m.torch_threads, m.grad_enabled, seen]))
    """, launcher=True, timeout=180)
    assert result.returncode == 0, result.stderr
    threads, grad, seen = json.loads(result.stdout.strip().splitlines()[-1])
    assert (threads, grad) == (3, False)
    assert seen == [[3, False, False]] * 3


def test_a_threads_own_choice_inside_is_kept(manager):
    with manager[0].acquire_session() as session:
        session.global_("torch", "set_grad_enabled")(not manager.grad_enabled)
        assert session.global_("torch", "is_grad_enabled")().deref() is (not manager.grad_enabled)
        session.global_("torch", "set_grad_enabled")(manager.grad_enabled)


def test_bad_thread_count_is_refused():
    with pytest.raises(ValueError, match="torch_threads"):
        multipy.InterpreterManager(1, torch_threads=0)
