"""Inputs that crash server processes (``multipy serve --processes``), refused once they
have crashed two.

A request whose call crashes its process (a segfault in a C extension, an abort) would
crash every process it is sent to, and its client, or anyone who knows it, can send it
again and again.  So each front end of a server of several processes notes, in its row
of the metrics board, the digest of the one request its call runs (``digest``: a keyed
hash of the model's name, the inputs' names, datatypes, shapes and contents, and the
parameters the model is given, not the request's id); when a process dies, the
supervisor reads which interpreter's call crashed (the fatal-signal handler marks it,
multipy._host.crash_cell) and that call's digest (``Crashes``).  A digest that crashed
REFUSE_AFTER processes within REMEMBER seconds goes into the ``Table`` of refused
digests, a block of shared memory that the supervisor alone writes and every front
end reads: an identical request is answered 500, saying why, instead of being run, until
REMEMBER seconds after its last crash.  A call of a batch of several requests notes no
digest: its crash is not pinned on one of them.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import marshal
import mmap
import operator
import os
import time
from typing import TYPE_CHECKING, Any, Sequence

from .messages import ProtocolError

if TYPE_CHECKING:
    import numpy as np

#: Processes that a digest must have crashed before it is refused.
REFUSE_AFTER = 2
#: Seconds a crash is remembered, and a refusal lasts after its digest's last crash.
REMEMBER = 3600.0
#: Digests whose crashes are remembered at once (the oldest are forgotten first).
_REMEMBERED = 1024
#: Digests refused at once (the table's room; the oldest give way).
_ROOM = 64
_KEY = 16  # bytes of the hash's key, at the table's start
# Then float64s: [the generation (odd while the supervisor writes), how many digests are
# refused, the digests].
_GENERATION, _COUNT, _DIGESTS = 0, 1, 2
_SIZE = _KEY + 8 * (_DIGESTS + _ROOM)


def digest(key: bytes, model: str, names: Sequence[str] | None, datatypes: Sequence[str],
           arrays: Sequence[np.ndarray], parameters: object = None) -> int:
    """The digest of a call of model on arrays (numpy arrays: their shapes, types and
    contents; a BYTES array's elements), with their names (None: by position) and
    datatypes, and the request's parameters if the model is given them: a 52-bit
    number above 0 (a float64 holds it exactly), keyed by key, so that a client cannot
    make a request whose digest is another's."""
    hashed = _keyed(key).copy()
    if isinstance(parameters, dict):  # (in any order)
        parameters = sorted(parameters.items(), key=operator.itemgetter(0))
    hashed.update(_written((model, names, tuple(datatypes), parameters,
                            [_described(array) for array in arrays])))
    for array in arrays:
        if getattr(getattr(array, "dtype", None), "hasobject", True):  # BYTES: its elements
            hashed.update(_written(list(getattr(array, "flat", array))))
        else:
            view = memoryview(array)
            hashed.update(view if view.c_contiguous else view.tobytes())
    return (int.from_bytes(hashed.digest(), "little") >> 12) or 1


@functools.lru_cache(maxsize=4)
def _keyed(key: bytes) -> Any:
    """A hash keyed by key, nothing hashed yet: each digest hashes into a copy of it (the
    key is hashed once)."""
    return hashlib.blake2b(key=key, digest_size=8)


def _described(array: Any) -> tuple[Any, str]:
    """What array's contents are: its shape, and its type (a numpy dtype's short name,
    which numpy makes in C: its long name takes Python code)."""
    dtype = getattr(array, "dtype", None)
    return getattr(array, "shape", None), str(getattr(dtype, "str", dtype))


def _written(value: Any) -> bytes:
    """value's bytes, the same for equal values: marshal's (its version 2, which writes no
    references: those would depend on how shared an object is), else, for a value that
    marshal cannot write, its repr's; each with a tag that tells the two apart."""
    try:
        return b"m" + marshal.dumps(value, 2)
    except ValueError:
        return b"r" + repr(value).encode(errors="surrogatepass")


def check(table: Table, model: str, names: Sequence[str] | None, datatypes: Sequence[str],
          arrays: Sequence[Any], given: dict[str, Any]) -> int:
    """The digest of a call of model (as ``digest``; given: the keyword arguments the
    call gets, whose request parameters count); ProtocolError (500) if table refuses
    it."""
    parameters = given["request"][1] if "request" in given else None
    found = digest(table.key, model, names, datatypes, arrays, parameters)
    if found in table.refused():
        raise ProtocolError(
            f"model {model!r} refuses this request: identical requests (the same inputs and "
            f"parameters) crashed {REFUSE_AFTER} server processes, and are refused until "
            f"{REMEMBER / 3600:g} hour after the last crash", 500)
    return found


class Table:
    """The refused digests, in shared memory: made by the supervisor (``shared``, with a
    random key), mapped by each server process from ``fd``, or addressed at ``address``
    (the process's mapping, from inside an interpreter)."""

    def __init__(self, fd: int | None = None, address: int | None = None) -> None:
        if address is None:
            self._memory = mmap.mmap(-1 if fd is None else fd, _SIZE)
            address = ctypes.addressof(ctypes.c_char.from_buffer(self._memory))
        self.address = address
        self.key = ctypes.string_at(address, _KEY)
        self._values = (ctypes.c_double * (_DIGESTS + _ROOM)).from_address(address + _KEY)
        self._seen = -1.0
        self._refused: frozenset[int] = frozenset()

    @classmethod
    def shared(cls) -> Table:
        """An empty table, with a random key, in a new shared memory file (``fd``)."""
        fd = os.memfd_create("multipy-serve-refused")
        os.ftruncate(fd, _SIZE)
        os.pwrite(fd, os.urandom(_KEY), 0)
        table = cls(fd=fd)
        table.fd = fd
        return table

    def refused(self) -> frozenset[int]:
        """The digests refused now (read again only when the supervisor has changed
        them)."""
        values = self._values
        generation = values[_GENERATION]
        if generation != self._seen:
            while True:  # (a reader never waits for the writer: it reads again)
                if generation % 2 == 0:
                    count = int(values[_COUNT])
                    refused = frozenset(int(values[_DIGESTS + k]) for k in range(count))
                    if values[_GENERATION] == generation:
                        break
                generation = values[_GENERATION]
            self._seen, self._refused = generation, refused
        return self._refused

    def write(self, digests: Sequence[int]) -> None:
        """Refuses digests (the supervisor's, the only writer), the last _ROOM if more."""
        digests = list(digests)[-_ROOM:]
        values = self._values
        values[_GENERATION] += 1.0
        values[_COUNT] = len(digests)
        for k, value in enumerate(digests):
            values[_DIGESTS + k] = float(value)
        values[_GENERATION] += 1.0


class Crashes:
    """The supervisor's memory of the digests whose calls crashed a process, which
    writes table: ``crashed`` notes one; ``forget`` what is older than REMEMBER."""

    def __init__(self, table: Table) -> None:
        self._table = table
        self._crashes: dict[int, list[float]] = {}  # digest -> when it crashed, oldest first
        self._refused: list[int] = []

    def crashed(self, digest: int, now: float | None = None) -> bool:
        """Notes that a call of digest crashed a process; whether it is refused now
        (it has crashed REFUSE_AFTER within REMEMBER seconds)."""
        now = time.monotonic() if now is None else now
        self.forget(now)
        times = self._crashes.pop(digest, [])
        self._crashes[digest] = times = [*times, now][-REFUSE_AFTER:]
        while len(self._crashes) > _REMEMBERED:
            del self._crashes[next(iter(self._crashes))]
        if len(times) >= REFUSE_AFTER:
            self._refuse([d for d in self._refused if d != digest] + [digest])
            return True
        return False

    def forget(self, now: float | None = None) -> None:
        """Forgets the crashes older than REMEMBER seconds, and refuses no digest whose
        last crash is."""
        now = time.monotonic() if now is None else now
        self._crashes = {d: times for d, times in self._crashes.items()
                         if now - times[-1] < REMEMBER}
        kept = [d for d in self._refused if d in self._crashes]
        if kept != self._refused:
            self._refuse(kept)

    def _refuse(self, digests: list[int]) -> None:
        self._refused = digests[-_ROOM:]
        self._table.write(self._refused)
