"""`multipy serve --processes 2`'s supervisor against what takes servers down: an input
that crashes processes, sent again and again; a process that freezes (SIGSTOP); one whose
every interpreter is stuck; kills (SIGKILL, and kill -ABRT by hand); an oversized load
request; many loads and unloads before a replacement; a deploy by SIGHUP, and processes
recycled by --max-requests, under load.  The models are a class with numpy only, so
that each process starts in about a second.
"""
from __future__ import annotations

import http.client
import json
import os
import re
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass

import pytest

from conftest import free_port, until

np = pytest.importorskip("numpy")
pytest.importorskip("uvicorn")
pytest.importorskip("starlette")

pytestmark = pytest.mark.timeout(300)

MODELS = '''
import ctypes
import os
import time

import numpy as np

VERSION = 1


class Echo:
    """x back, with the answering process's id and VERSION; segfaults on a negative x,
    and blocks in C (time.sleep) for x - 1000 s on an x above 1000."""

    def predict(self, inputs):
        x = inputs["x"]
        if (x < 0).any():
            ctypes.memset(16, 0, 1)
        if (x > 1000).any():
            time.sleep(float(x.max()) - 1000)
        return {"y": x, "pid": np.array([os.getpid()], dtype=np.int64),
                "version": np.array([VERSION], dtype=np.int64)}
'''


@dataclass
class Served:
    process: subprocess.Popen
    port: int
    log: str
    models: str

    def output(self) -> str:
        with open(self.log, errors="replace") as f:
            return f.read()

    def request(self, method: str, path: str, body: bytes = b"", timeout: float = 60):
        """(status, body) of one request on a connection of its own."""
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            connection.request(method, path, body)
            answer = connection.getresponse()
            return answer.status, answer.read()
        finally:
            connection.close()

    def infer(self, x: float, timeout: float = 60) -> tuple[int, dict]:
        status, body = self.request("POST", "/v2/models/echo/infer", json.dumps(
            {"inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": [x]}]}).encode(),
            timeout)
        return status, json.loads(body)

    def pid(self) -> int:
        """The process that answers a new connection."""
        status, answer = self.infer(1)
        assert status == 200, answer
        return answer["outputs"][1]["data"][0]

    def pids_at_once(self) -> set[int]:
        """The processes that answer 20 new connections, one after another (the kernel
        wakes the front ends of both: each takes some)."""
        return {self.pid() for _ in range(20)}

    def pids(self) -> set[int]:
        return {int(p) for p in re.findall(r"server process \d \(pid (\d+)\) ready",
                                           self.output())} - self.ended()

    def ended(self) -> set[int]:
        return {int(p) for p in re.findall(
            r"server process \d \(pid (\d+)\),? (?:replaced, )?(?:was killed|exited)",
            self.output())}


def _serve(folder, *options: str) -> Served:
    """multipy serve of folder/models.py:Echo with options, once every process is ready."""
    models = folder / "models.py"
    models.write_text(MODELS)
    port = free_port()
    log = str(folder / "server.log")
    # (the model file's bytecode cached where Python caches it, as on most machines)
    env = {**{k: v for k, v in os.environ.items()
              if k not in ("GLIBC_TUNABLES", "PYTHONDONTWRITEBYTECODE")},
           "PYTHONUNBUFFERED": "1"}
    with open(log, "w") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "multipy", "serve", f"{models}:Echo", "--port", str(port),
             "--processes", "2", "--interpreters", "1", *options],
            stdout=out, stderr=subprocess.STDOUT, env=env)
    served = Served(process, port, log, str(models))
    _ready(served)
    return served


def _ready(served: Served, count: int = 1) -> None:
    """Waits until the server has said count times that every process is ready."""
    until(lambda: served.output().count("ready: 2 server processes") >= count
          or served.process.poll() is not None, 120)
    assert served.process.poll() is None, served.output()


def _stop(served: Served) -> None:
    if served.process.poll() is None:
        served.process.send_signal(signal.SIGTERM)
        try:
            served.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            served.process.kill()
            served.process.wait(timeout=30)


def _at_once(count: int, call) -> list:
    """call()'s result on count threads started together."""
    results: list = []
    threads = [threading.Thread(target=lambda: results.append(call())) for _ in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert len(results) == count, "not every call returned"
    return results


def _replaced(served: Served, pid: int) -> None:
    """Waits until the process pid has ended and both processes are ready again."""
    until(lambda: pid in served.ended() and len(served.pids()) == 2, 120)


class _Load:
    """Clients that each send a request on a new connection, again and again, until
    stopped; each answer's (status, version or error)."""

    def __init__(self, served: Served, clients: int) -> None:
        self.answers: list[tuple] = []
        self._served, self._going = served, True
        self._threads = [threading.Thread(target=self._client) for _ in range(clients)]
        for thread in self._threads:
            thread.start()

    def _client(self) -> None:
        while self._going:
            try:
                status, answer = self._served.infer(1)
            except (OSError, http.client.HTTPException) as error:
                self.answers.append((type(error).__name__, str(error)))
                continue
            self.answers.append((status, answer["outputs"][2]["data"][0] if status == 200
                                 else answer))

    def stop(self) -> list[tuple]:
        self._going = False
        for thread in self._threads:
            thread.join(120)
        return self.answers


# -- crashes --

@pytest.fixture(scope="module")
def crashing(tmp_path_factory):
    served = _serve(tmp_path_factory.mktemp("crashing"))
    try:
        yield served
    finally:
        _stop(served)


def test_an_input_that_crashes_processes_is_refused_and_the_server_stays_up(crashing):
    """4 clients send an input that segfaults its process, again and again, while
    another asks the healthy model: after 2 crashes that input is refused with a 500
    that says why, no process dies of it any more, the server never stops, and the
    healthy requests are answered once the replacements are ready (a replacement's
    death with a call in it is not a start failure)."""
    healthy = _Load(crashing, 1)
    answers = []
    for _ in range(6):
        answers += _at_once(4, lambda: _attempt(crashing, -1))
    until(lambda: len(crashing.pids()) == 2, 120)
    since = len(healthy.answers)
    until(lambda: len(healthy.answers) > since + 20)
    assert all(status == 200 for status, _ in healthy.stop()[-10:]), healthy.answers
    output = crashing.output()
    assert crashing.process.poll() is None, output
    deaths = re.findall(r"was killed by signal 11 \(SIGSEGV\)", output)
    assert 2 <= len(deaths) <= 8, output  # the first two, and those already under way
    assert "identical requests are refused from now on" in output
    assert "stopping the server" not in output and "while starting" not in output
    refused = [a for a in answers if a[0] == 500]
    assert refused and all("crashed 2 server processes" in a[1]["error"] for a in refused)
    assert answers[-4:] == refused[-4:]  # the last round: every one refused at once
    status, answer = crashing.infer(-1)
    assert status == 500 and "crashed 2 server processes" in answer["error"]
    status, answer = crashing.infer(1)
    assert status == 200 and answer["outputs"][0]["data"] == [1.0]


def _attempt(served: Served, x: float) -> tuple:
    try:
        return served.infer(x)
    except (ConnectionError, http.client.HTTPException, OSError):
        return ("crashed", None)


def test_a_fault_signal_sent_with_kill_ends_the_process_and_is_said(crashing):
    """kill -ABRT of a process (as an operator does for a core dump) ends it at once:
    its report says who sent the signal, and a replacement serves."""
    until(lambda: len(crashing.pids()) == 2, 120)
    pid = crashing.pid()
    os.kill(pid, signal.SIGABRT)
    _replaced(crashing, pid)
    output = crashing.output()
    assert f"(pid {pid}) was killed by signal 6 (SIGABRT)" in output
    assert f"multipy: signal 6 sent by process {os.getpid()}" in output
    assert crashing.infer(1)[0] == 200


# -- health, stuck interpreters, kills, the repository --

@pytest.fixture(scope="module")
def guarded(tmp_path_factory):
    served = _serve(tmp_path_factory.mktemp("guarded"), "--timeout", "1",
                    "--health-timeout", "4", "--model-control", "explicit")
    try:
        yield served
    finally:
        _stop(served)


def test_an_oversized_load_request_is_refused_and_the_next_load_works(guarded):
    body = json.dumps({"parameters": {"path": "\u00e9" * 30_000}}, ensure_ascii=False)
    status, answer = guarded.request("POST", "/v2/repository/models/echo/load", body.encode())
    assert status == 400 and b"longer than any path" in answer, answer
    assert len(answer) < 1000
    for _ in range(2):  # both processes answer, neither is wedged
        assert guarded.request("POST", "/v2/repository/models/echo/load")[0] == 200
        assert guarded.request("POST", "/v2/repository/models/nothing/unload")[0] == 404


def test_a_replacement_redoes_the_present_not_the_past(guarded):
    """After 50 unload and load pairs, a replacement redoes one request, and serves."""
    for _ in range(50):
        assert guarded.request("POST", "/v2/repository/models/echo/unload")[0] == 200
        assert guarded.request("POST", "/v2/repository/models/echo/load")[0] == 200
    assert guarded.request("POST", "/v2/repository/models/zzz/load")[0] == 404  # kept not
    pid = guarded.pid()
    os.kill(pid, signal.SIGKILL)
    _replaced(guarded, pid)
    redone = re.findall(r"ready in [\d.]+ s \(its models as the repository has them: "
                        r"(\d+) request\(s\) redone\)", guarded.output())
    assert redone and int(redone[-1]) == 1, guarded.output()
    # the replacement serves: it takes some of a round's connections (a round may go to
    # the other process alone, when the kernel wakes its front end first each time)
    until(lambda: guarded.pids_at_once() == guarded.pids(), 60)


def test_a_process_whose_interpreters_are_all_stuck_gets_no_new_connections(guarded):
    """A call blocked in C past --timeout leaves its process's only interpreter stuck:
    new connections go to the other process until the call ends."""
    until(lambda: len(guarded.pids()) == 2, 120)
    # 12 s in C: answered at --timeout, the call runs on.  Only then do answers from one
    # process say which is stuck (before, the kernel may give every one of a few
    # connections in a row to the same free front end)
    blocked = _attempt(guarded, 1012)
    assert blocked[0] == 500 and "did not answer within 1" in blocked[1]["error"], blocked
    stuck = None

    def other_answers_only() -> bool:  # the supervisor hears of it within a health check
        nonlocal stuck
        answers = [guarded.infer(1) for _ in range(6)]  # (the stuck one answers 503)
        pids = {answer["outputs"][1]["data"][0] if status == 200 else None
                for status, answer in answers}
        if len(pids) == 1 and None not in pids:
            stuck = (guarded.pids() - pids).pop()
            return True
        return False

    until(other_answers_only, 11)
    answered = _at_once(20, lambda: guarded.infer(1))
    assert all(status == 200 for status, _ in answered), answered
    assert stuck not in {answer["outputs"][1]["data"][0] for _, answer in answered}
    until(lambda: len(guarded.pids_at_once()) == 2, 60)  # it takes them again


def test_a_frozen_process_is_bypassed_then_replaced_and_loses_nothing(guarded):
    """SIGSTOP one process: every request sent at once is answered (those handed to it
    before the supervisor noticed, by another process once it is killed), the log says
    why it was killed, and a replacement serves."""
    until(lambda: len(guarded.pids()) == 2, 120)
    frozen = guarded.pid()
    os.kill(frozen, signal.SIGSTOP)
    try:
        answered = _at_once(10, lambda: guarded.infer(1))
        assert all(status == 200 for status, _ in answered), answered
        assert frozen not in {answer["outputs"][1]["data"][0] for _, answer in answered}
        _replaced(guarded, frozen)
    finally:
        try:
            os.kill(frozen, signal.SIGCONT)
        except ProcessLookupError:
            pass
    assert re.search(rf"\(pid {frozen}\) has not answered a health check for \d+ s "
                     r"\(--health-timeout\): killing it", guarded.output())


def test_a_kill_loses_no_new_connection(guarded):
    """SIGKILL a ready process, then at once 20 new connections: every one is answered,
    none reset, though some were handed to the process as it died."""
    for _ in range(3):
        until(lambda: len(guarded.pids()) == 2, 120)
        pid = guarded.pid()
        os.kill(pid, signal.SIGKILL)
        answered = _at_once(20, lambda: _attempt(guarded, 1))
        assert [status for status, _ in answered] == [200] * 20, answered
        _replaced(guarded, pid)


# -- deploys --

def test_sighup_deploys_a_new_model_file_under_load_with_no_failed_request(tmp_path):
    """The model file rewritten (its size and modification time as before), then SIGHUP
    under load: every request is answered, the last ones by the new file, and each
    process says it was replaced."""
    served = _serve(tmp_path)
    try:
        load = _Load(served, 3)
        until(lambda: len(load.answers) > 100)
        with open(served.models) as f:
            changed = f.read().replace("VERSION = 1", "VERSION = 2")
        written = os.stat(served.models)
        with open(served.models, "w") as f:
            f.write(changed)
        # as if rewritten within the second of its last write, at its size: a bytecode
        # cache would take it as unchanged (multipy._inside.model_files)
        os.utime(served.models, ns=(written.st_atime_ns, written.st_mtime_ns))
        old = served.pids()
        served.process.send_signal(signal.SIGHUP)
        until(lambda: old <= served.ended() and len(served.pids()) == 2, 120)
        before = len(load.answers)
        until(lambda: len(load.answers) > before + 100)
        answers = load.stop()
        assert [a for a in answers if a[0] != 200] == []
        assert {version for _, version in answers[-50:]} == {2}
        assert served.output().count("is replaced: it answers what it has received") == 2
    finally:
        _stop(served)


def test_max_requests_recycles_processes_under_load_with_no_failed_request(tmp_path):
    served = _serve(tmp_path, "--max-requests", "150", "--max-requests-jitter", "50")
    try:
        load = _Load(served, 3)
        first = served.pids()
        until(lambda: first <= served.ended(), 120)  # both replaced at least once
        answers = load.stop()
        assert [a for a in answers if a[0] != 200] == []
        recycled = re.findall(r"has answered (\d+) requests \(--max-requests\): replacing it",
                              served.output())
        assert len(recycled) >= 2 and all(int(n) >= 150 for n in recycled)
    finally:
        _stop(served)
