"""The supervisor's decisions without processes (multipy.serve.processes.supervisor, .poison,
.link): what follows a process's end, the repository's present state that a replacement
redoes, the digests of inputs that crash processes and their table, and link messages
that cannot wedge a reader."""
from __future__ import annotations

import decimal
import json
import os
import socket

import pytest

pytest.importorskip("httptools")  # (the supervisor accepts with multipy.serve.http.connection)

from multipy.serve.request import poison  # noqa: E402
from multipy.serve.processes.link import (LARGEST, Ask, Do, Link, Pong, RepositoryRequest,  # noqa: E402
                                          Start, TooLarge, decode, encode, pair)
from multipy.serve.request.messages import ProtocolError  # noqa: E402
from multipy.serve.request.repository import PATH_MAX, archive  # noqa: E402
from multipy.serve.processes.policy import START_FAILURES, Present, decide  # noqa: E402

pytestmark = pytest.mark.timeout(60)


# -- what follows a process's end --

def test_a_process_that_served_is_replaced_at_once_whatever_came_before():
    for status in (-11, -6, -9, 1, 2, 0):
        restart = decide(status, served=True, failures=START_FAILURES - 1, listening=True,
                         ever_ready=True)
        assert (restart.pause, restart.stop, restart.failures) == (0.0, None, 0)
    # before any process was ready too: a request's crash is never a start failure
    restart = decide(-11, served=True, failures=3, listening=True, ever_ready=False)
    assert (restart.pause, restart.stop, restart.failures) == (0.0, None, 0)


def test_processes_that_die_while_starting_back_off_then_stop_the_server():
    failures, pauses = 0, []
    while True:
        restart = decide(-11, served=False, failures=failures, listening=True, ever_ready=True)
        failures = restart.failures
        if restart.stop is not None:
            break
        pauses.append(restart.pause)
    assert pauses == [1.0, 2.0, 4.0, 8.0]
    assert (restart.stop, failures) == (1, START_FAILURES)
    assert "5 processes in a row died while starting" in restart.why


def test_models_that_fail_at_the_first_start_stop_the_server_at_once():
    before_listening = decide(2, served=False, failures=0, listening=False, ever_ready=False)
    assert before_listening.stop == 2 and "cannot be served" in before_listening.why
    assert decide(1, served=False, failures=0, listening=True, ever_ready=False).stop == 1
    # once the server has been ready, a replacement whose models fail is retried
    assert decide(1, served=False, failures=0, listening=True, ever_ready=True).pause == 1.0


# -- the repository's present state --

def _replayed(present: Present) -> list[tuple]:
    return [(r.what, r.name, tuple(sorted(r.archive.items()))) for r in present.requests()]


def _note(present: Present, what: str, name: str, archive: dict, statuses: list) -> None:
    present.note(RepositoryRequest(what, name, archive), statuses)


def test_the_present_is_one_entry_per_name_however_many_requests_came():
    present = Present(["a", "b"])
    for _ in range(50):
        _note(present, "unload", "a", {}, [200, 200])
        _note(present, "load", "a", {}, [200, 200])
    for _ in range(50):
        _note(present, "load", "nothing", {"path": "x" * 3000}, [404, 404])  # failed: kept not
    assert _replayed(present) == [("load", "a", ())]
    _note(present, "unload", "b", {}, [200, None])  # one process ended meanwhile
    _note(present, "load", "c", {"path": "c.pt"}, [200, 200])
    _note(present, "load", "c", {"path": "c2.pt"}, [500, 500])  # c serves on from c.pt
    _note(present, "unload", "c", {}, [200, 200])
    assert _replayed(present) == [("load", "a", ()), ("unload", "b", ()),
                                  ("load", "c", (("path", "c.pt"),)), ("unload", "c", ())]


def test_a_new_name_whose_load_failed_keeps_its_place_and_is_tried_again():
    present = Present(["a"])
    _note(present, "load", "d", {"path": "d.pt"}, [500, 500])  # in the index, UNAVAILABLE
    _note(present, "load", "e", {"path": "e.pt"}, [400, 400])  # not an archive: nothing
    _note(present, "unload", "zzz", {}, [404, 404])
    _note(present, "load", "f", {}, [None, None])  # every process ended: nothing known
    assert _replayed(present) == [("load", "d", (("path", "d.pt"),))]
    _note(present, "load", "d", {"path": "d2.pt"}, [200, 200])
    assert _replayed(present) == [("load", "d", (("path", "d2.pt"),))]


# -- inputs that crash processes --

def test_a_digest_is_the_inputs_not_their_encoding_nor_the_request_id():
    np = pytest.importorskip("numpy")
    key = os.urandom(16)
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    same = poison.digest(key, "m", ("x",), ("FP32",), [x])
    assert 0 < same < 2 ** 52
    assert poison.digest(key, "m", ("x",), ("FP32",), [x.copy()]) == same
    assert poison.digest(key, "m", ("x",), ("FP32",), [np.asfortranarray(x)]) == same
    others = {poison.digest(key, "n", ("x",), ("FP32",), [x]),
              poison.digest(key, "m", ("y",), ("FP32",), [x]),
              poison.digest(key, "m", ("x",), ("FP32",), [x.reshape(4, 3)]),
              poison.digest(key, "m", ("x",), ("FP32",), [x + 1]),
              poison.digest(key, "m", ("x",), ("FP32",), [x], {"p": 1}),
              poison.digest(os.urandom(16), "m", ("x",), ("FP32",), [x])}
    assert same not in others and len(others) == 6
    def text(*items: str):  # new bytes objects each time, as a request's decoding makes
        return np.array([item.encode() for item in items], dtype=object)

    assert poison.digest(key, "m", None, ("BYTES",), [text("a", "bc")]) == \
        poison.digest(key, "m", None, ("BYTES",), [text("a", "bc")])
    assert poison.digest(key, "m", None, ("BYTES",), [text("a", "bc")]) != \
        poison.digest(key, "m", None, ("BYTES",), [text("ab", "c")])
    assert poison.digest(key, "m", None, (), [], {"a": 1, "b": 2}) == \
        poison.digest(key, "m", None, (), [], {"b": 2, "a": 1})
    # values that marshal cannot write (a model's own objects) are digested by their repr
    odd = poison.digest(key, "m", None, (), [], {"a": decimal.Decimal("1.5")})
    assert odd == poison.digest(key, "m", None, (), [], {"a": decimal.Decimal("1.5")})
    assert odd not in {poison.digest(key, "m", None, (), [], {"a": decimal.Decimal("2")}),
                       poison.digest(key, "m", None, (), [], {"a": 1.5}),
                       poison.digest(key, "m", None, (), [], {"a": "Decimal('1.5')"})}


def test_a_digest_is_refused_after_two_crashes_in_every_mapping_until_forgotten():
    table = poison.Table.shared()
    reader = poison.Table(fd=table.fd)  # a server process's mapping
    inside = poison.Table(address=reader.address)  # an interpreter's view of it
    assert inside.key == table.key and len(table.key) == 16
    crashes = poison.Crashes(table)
    assert not crashes.crashed(7, now=100.0)
    assert not crashes.crashed(8, now=101.0)
    assert inside.refused() == frozenset()
    assert crashes.crashed(7, now=102.0)
    assert inside.refused() == reader.refused() == frozenset({7})
    crashes.forget(now=102.0 + poison.REMEMBER - 1)
    assert inside.refused() == frozenset({7})
    crashes.forget(now=102.0 + poison.REMEMBER)
    assert inside.refused() == frozenset()
    # a crash more than REMEMBER after the last is a first one again
    assert not crashes.crashed(7, now=102.0 + 2 * poison.REMEMBER)
    os.close(table.fd)


def test_the_table_keeps_the_newest_refused_digests():
    table = poison.Table.shared()
    crashes = poison.Crashes(table)
    for digest in range(1, 101):
        crashes.crashed(digest, now=float(digest))
        crashes.crashed(digest, now=float(digest))
    refused = poison.Table(address=table.address).refused()
    assert refused == frozenset(range(101 - poison._ROOM, 101))
    os.close(table.fd)


def test_the_crash_is_pinned_on_the_call_the_handler_names_or_the_only_one():
    from multipy.serve.request.board import CRASHED, INPUT, SINCE, Board

    board = Board(3, 20)  # a process's host row, then its two interpreters'
    board.row(1)[INPUT], board.row(2)[INPUT] = 11.0, 22.0
    board.row(1)[SINCE] = board.row(2)[SINCE] = 5.0
    assert board.crashed_input(0, 3) is None  # two calls ran, and nothing says which
    board.row(0)[CRASHED] = 2.0  # the handler: interpreter 1's call
    assert board.crashed_input(0, 3) == 22
    board.row(0)[CRASHED] = -1.0  # a signal another process sent
    assert board.crashed_input(0, 3) is None
    board.row(0)[CRASHED], board.row(1)[SINCE] = 0.0, 0.0  # one call ran: that one
    assert board.crashed_input(0, 3) == 22
    board.row(2)[INPUT] = 0.0  # a batch's call: no digest
    assert board.crashed_input(0, 3) is None


# -- link messages --

def test_a_message_too_large_is_refused_where_it_is_sent_and_the_link_serves_on():
    here, there = pair()
    process = Link(there)
    with pytest.raises(TooLarge):
        here.send(Do(1, RepositoryRequest("load", "m", {"path": "\u00e9" * LARGEST})))
    fits = Do(2, RepositoryRequest("load", "m", {"path": "\u00e9" * 20_000}))  # 40 KB of UTF-8
    here.send(fits)
    [(message, fds)] = process.receive()
    assert message == fits and fds == []
    here.close()
    process.close()


def test_messages_that_are_not_ones_are_dropped_and_the_next_is_read():
    here, there = pair()
    with there:
        there.send(b"x" * (LARGEST + 100))  # cut
        there.send(b"[1, 2]")  # not an object
        there.send(b'{"no": "op"}')
        there.send(b"\xff\xfe")
        with socket.socket(socket.AF_UNIX) as spare:  # a descriptor that comes with one
            socket.send_fds(there, [b"{not json"], [spare.fileno()])
        for wrong in ({"op": "pong", "stuck": True}, {"op": "pong", "stuck": "1"},
                      {"op": "pong", "stuck": 0, "more": 1}, {"op": "start", "process": 1},
                      {"op": "nothing"}, {"op": "ask", "number": 1, "request": {"what": 1}},
                      {"op": "do", "number": 1, "request": {"what": "load", "name": "m",
                                                            "archive": {"path": 1}}}):
            there.send(json.dumps(wrong).encode())  # a field of another type, unknown, missing
        there.send(json.dumps({"op": "pong", "stuck": 1}).encode())
        assert here.receive() == [(Pong(stuck=1), [])]
    assert here.receive() is None
    here.close()


def test_every_message_is_read_back_as_it_was_sent():
    for message in (Start(3, 4, 5), Pong(4, 1, 2),
                    Ask(7, RepositoryRequest("load", "m\u00e9", {"path": "/a b", "x": ""})),
                    Do(8, RepositoryRequest("unload", "m"))):
        assert decode(encode(message)) == message
        assert json.loads(encode(message))["op"] == type(message).__name__.lower()


def test_a_load_request_that_names_no_file_is_refused_where_it_arrives():
    long = "\u00e9" * (PATH_MAX // 2)  # PATH_MAX bytes in UTF-8
    for parameters in ({"path": long}, {"config": json.dumps({"path": long})},
                       {"module": "m" * PATH_MAX}):
        with pytest.raises(ProtocolError) as raised:
            archive(parameters)
        assert raised.value.status == 400 and "longer than any path" in str(raised.value)
        assert len(str(raised.value)) < 300
    assert archive({"path": "\u00e9" * (PATH_MAX // 2 - 1)})["path"]  # it fits
    with pytest.raises(ProtocolError) as raised:
        archive({f"k{k}" * 1000: "v" for k in range(100)})
    assert raised.value.status == 400 and len(str(raised.value)) < 500
