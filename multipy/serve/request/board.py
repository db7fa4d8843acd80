"""The block of float64s where every interpreter of a process (and, with ``multipy
serve --processes``, every process) counts the server's metrics (``Board``), and its
layout: a row per writer, each column's index named below.  Only the row's owner writes
it; anyone reads it (an aligned float64 is read whole).  multipy.serve.request.metrics
writes and reads the counts; the supervisor of --processes reads a process's rows
(multipy.serve.processes).
"""
from __future__ import annotations

import ctypes
import mmap
import os

#: Latency buckets (seconds): from a fast model's millisecond to a slow batch's seconds.
LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
            30.0, 60.0)
#: Requests per call.
BATCHED = (1, 2, 4, 8, 16, 32, 64, 128)
#: The HTTP statuses an inference request can fail with (499: the client went away);
#: any other is counted as its class's: another 4xx as 400 (a LitAPI's HTTPException
#: may answer 422, say), the rest as 500.  (408 and 431 are a connection's, before any model is
#: named: multipy.serve.http.connection.)
STATUSES = (400, 404, 413, 499, 500, 503)

# A row: [connections closed, since when it runs a call (time.monotonic(), 0 if it
# runs none), 1 + the index of the model whose call its request gave up on (0 if
# none), large requests it decodes on a thread, the digest of the one request of the
# call it runs (multipy.serve.request.poison; 0: none, or a batch), and in a process's first row
# (its host's) 1 + the interpreter whose call crashed it (multipy._host.crash_cell; 0:
# none; -1: a signal another process sent) and the number of the last connection its
# supervisor handed it that it has taken, connections it accepted from the server's
# listening socket itself (an interpreter's front end: multipy._inside.front_end),
# connections it has served in all (those too, and those the host handed it), of which
# those the host handed it, 1 while it accepts on the listening socket (0: not), and
# how many of its connections linger (answered once, idle since), then per model:
# requests, failures by status, latency (a count per bucket and one past the last, then
# the sum), queued, busy, calls, batched (the same), successes, then nanoseconds: of
# successes, of failures, and of successes queued, decoding, in calls and encoding; then when the
# last call began, and when this writer last heard the model's own health check say it
# is healthy, and say it is not (milliseconds since the epoch; 0: never), and the pieces
# of answers streamed].
CLOSED = 0
SINCE = 1
ABANDONED = 2
DECODING = 3
INPUT = 4
CRASHED = 5
TAKEN = 6
ACCEPTED = 7
OPENED = 8
RECEIVED = 9
WATCHING = 10
LINGERING = 11
ROW = 12
REQUESTS = 0
FAILURES = 1
LATENCY_AT = FAILURES + len(STATUSES)
LATENCY_SUM = LATENCY_AT + len(LATENCY) + 1
QUEUED = LATENCY_SUM + 1
BUSY = QUEUED + 1
CALLS = BUSY + 1
BATCHED_AT = CALLS + 1
BATCHED_SUM = BATCHED_AT + len(BATCHED) + 1
SUCCESSES = BATCHED_SUM + 1
SUCCESS_NS = SUCCESSES + 1
FAILURE_NS = SUCCESS_NS + 1
QUEUE_NS = FAILURE_NS + 1
INPUT_NS = QUEUE_NS + 1
INFER_NS = INPUT_NS + 1
OUTPUT_NS = INFER_NS + 1
LAST_CALL = OUTPUT_NS + 1
HEALTHY_AT = LAST_CALL + 1
UNHEALTHY_AT = HEALTHY_AT + 1
PIECES = UNHEALTHY_AT + 1
PER_MODEL = PIECES + 1


def board_width(slots: int) -> int:
    """The float64s in a row of a board with room for the series of slots models."""
    return ROW + PER_MODEL * slots


class Board:
    """``rows`` rows of ``width`` float64s in memory that any interpreter of this
    process can address: made here, zeroed (``address`` and ``fd`` None), mapped from
    the shared memory file ``fd`` (the supervisor's, which every server process maps:
    ``shared``), or addressed at ``address`` (one the host mapped, which outlives every
    user)."""

    def __init__(self, rows: int, width: int, address: int | None = None,
                 fd: int | None = None) -> None:
        self.rows, self.width = rows, width
        if address is None:
            self._memory = mmap.mmap(-1 if fd is None else fd, rows * width * 8)
            address = ctypes.addressof(ctypes.c_char.from_buffer(self._memory))
        self.address = address
        self.values = memoryview((ctypes.c_double * (rows * width)).from_address(address)) \
            .cast("B").cast("d")

    def row(self, k: int) -> memoryview:
        return self.values[k * self.width:(k + 1) * self.width]

    def total(self, column: int) -> float:
        return sum(self.values[column::self.width])

    def most(self, column: int) -> float:
        return max(self.values[column::self.width])

    @classmethod
    def shared(cls, rows: int, width: int) -> Board:
        """A zeroed board in a new shared memory file, whose descriptor (``fd``) other
        processes map with ``Board(rows, width, fd=...)``."""
        fd = os.memfd_create("multipy-serve-metrics")
        os.ftruncate(fd, rows * width * 8)
        board = cls(rows, width, fd=fd)
        board.fd = fd
        return board

    def reset(self, first: int, count: int) -> None:
        """Rows first to first + count - 1 belonged to a process that has ended: what
        they say of the present (connections opened and closed, a call running, requests decoding,
        requests queued, calls running) goes back to 0; the counts of what happened
        stay (the connections accepted among them: the supervisor's watch over the
        socket counts on from them, and a count that fell would make it take the whole
        queue)."""
        for k in range(first, first + count):
            row = self.row(k)
            row[CLOSED] = row[SINCE] = row[ABANDONED] = row[DECODING] = 0.0
            row[INPUT] = row[CRASHED] = row[TAKEN] = 0.0
            row[OPENED] = row[RECEIVED] = row[WATCHING] = 0.0
            for at in range(ROW, self.width, PER_MODEL):
                row[at + QUEUED] = row[at + BUSY] = 0.0

    def busy(self, first: int, count: int) -> int:
        """How many calls rows first to first + count - 1 run now."""
        return int(sum(self.row(k)[at + BUSY] for k in range(first, first + count)
                       for at in range(ROW, self.width, PER_MODEL)))

    def taken(self, first: int) -> int:
        """The number of the last connection that the process whose host row is first
        has taken from its supervisor (``Metrics.took``)."""
        return int(self.row(first)[TAKEN])

    def requests(self, first: int, count: int) -> int:
        """How many inference requests rows first to first + count - 1 have counted."""
        return int(sum(self.row(k)[at + REQUESTS] for k in range(first, first + count)
                       for at in range(ROW, self.width, PER_MODEL)))

    def crashed_input(self, first: int, count: int) -> int | None:
        """The digest of the request whose call crashed the process of rows first to
        first + count - 1 (its host's, then its interpreters'): that of the interpreter
        its host's row names, else of the only call running; None if neither says, or
        the signal came from another process (the row says -1)."""
        crashed = int(self.row(first)[CRASHED])
        if crashed < 0:
            return None
        if 0 < crashed < count:
            rows = [first + crashed]
        else:
            rows = [k for k in range(first + 1, first + count) if self.row(k)[SINCE]]
        return int(self.row(rows[0])[INPUT]) or None if len(rows) == 1 else None
