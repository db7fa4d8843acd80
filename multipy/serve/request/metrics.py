"""The server's Prometheus metrics (``GET /metrics``), kept where every interpreter of
the process can count and read them.

Requests are answered by every interpreter's front end (and, while the interpreters
start, by the host), each on its own GIL: none may take a lock that another holds.  So
the counts live in a ``Board``, a block of float64s that the host allocates once and
every interpreter addresses (one process, one address space): each writer has a row of
its own that only it writes, and ``render``, wherever ``/metrics`` is answered, sums the
rows (an aligned float64 is read whole).  With ``multipy serve --processes P``, the
supervisor makes the board, a shared memory file that every server process maps, with
rows for each process's host and front ends (multipy.serve.processes.supervisor): whichever process
answers, the counts are every process's.  Per model: requests, failures (by HTTP
status), latency, requests queued (waiting for their batch, or for the model to be
free), interpreters busy with it, and calls (a batch is one), with how many requests
each answered; and, for the statistics extension (``statistics``), the successes and
failures with their nanoseconds, and the nanoseconds that successful requests spent
queued, being decoded, in the model's call and being encoded.  A row also counts the
connections its writer has closed, says since when it runs a call and whether that
call's request gave up on it (the call passed --timeout, or its client went away, and
still runs), and counts the large requests it decodes on a thread: by these the host
hands new connections to the least busy front end, and the server says when its
interpreters are stuck.
"""
from __future__ import annotations

import bisect
import contextlib
import ctypes
import mmap
import os
import time
from typing import Any, Iterator, Sequence

#: Latency buckets (seconds): from a fast model's millisecond to a slow batch's seconds.
_LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
            30.0, 60.0)
#: Requests per call.
_BATCHED = (1, 2, 4, 8, 16, 32, 64, 128)
#: The HTTP statuses an inference request can fail with (499: the client went away);
#: any other is counted as 500.  (408 and 431 are a connection's, before any model is
#: named: multipy.serve.http.connection.)
STATUSES = (400, 404, 413, 499, 500, 503)
#: Seconds after which an interpreter in one call counts as stuck, without --timeout.
STUCK_AFTER = 30.0

# A row: [connections closed, since when it runs a call (time.monotonic(), 0 if it
# runs none), 1 + the index of the model whose call its request gave up on (0 if
# none), large requests it decodes on a thread, the digest of the one request of the
# call it runs (multipy.serve.request.poison; 0: none, or a batch), and in a process's first row
# (its host's) 1 + the interpreter whose call crashed it (multipy._host.crash_cell; 0:
# none; -1: a signal another process sent) and the number of the last connection its
# supervisor handed it that it has taken, then per model: requests, failures by
# status, latency (a count per bucket and one past the last, then the sum), queued,
# busy, calls, batched (the same), successes, then nanoseconds: of successes, of
# failures, and of successes queued, decoding, in calls and encoding; then when the
# last call began (milliseconds since the epoch)].
_CLOSED = 0
_SINCE = 1
_ABANDONED = 2
_DECODING = 3
_INPUT = 4
_CRASHED = 5
_TAKEN = 6
_ROW = 7
_REQUESTS = 0
_FAILURES = 1
_LATENCY_AT = _FAILURES + len(STATUSES)
_LATENCY_SUM = _LATENCY_AT + len(_LATENCY) + 1
_QUEUED = _LATENCY_SUM + 1
_BUSY = _QUEUED + 1
_CALLS = _BUSY + 1
_BATCHED_AT = _CALLS + 1
_BATCHED_SUM = _BATCHED_AT + len(_BATCHED) + 1
_SUCCESSES = _BATCHED_SUM + 1
_SUCCESS_NS = _SUCCESSES + 1
_FAILURE_NS = _SUCCESS_NS + 1
_QUEUE_NS = _FAILURE_NS + 1
_INPUT_NS = _QUEUE_NS + 1
_INFER_NS = _INPUT_NS + 1
_OUTPUT_NS = _INFER_NS + 1
_LAST_CALL = _OUTPUT_NS + 1
_PER_MODEL = _LAST_CALL + 1


def board_width(slots: int) -> int:
    """The float64s in a row of a board with room for the series of slots models."""
    return _ROW + _PER_MODEL * slots


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
        they say of the present (connections closed, a call running, requests decoding,
        requests queued, calls running) goes back to 0; the counts of what happened
        stay."""
        for k in range(first, first + count):
            row = self.row(k)
            row[_CLOSED] = row[_SINCE] = row[_ABANDONED] = row[_DECODING] = 0.0
            row[_INPUT] = row[_CRASHED] = row[_TAKEN] = 0.0
            for at in range(_ROW, self.width, _PER_MODEL):
                row[at + _QUEUED] = row[at + _BUSY] = 0.0

    def busy(self, first: int, count: int) -> int:
        """How many calls rows first to first + count - 1 run now."""
        return int(sum(self.row(k)[at + _BUSY] for k in range(first, first + count)
                       for at in range(_ROW, self.width, _PER_MODEL)))

    def taken(self, first: int) -> int:
        """The number of the last connection that the process whose host row is first
        has taken from its supervisor (``Metrics.took``)."""
        return int(self.row(first)[_TAKEN])

    def requests(self, first: int, count: int) -> int:
        """How many inference requests rows first to first + count - 1 have counted."""
        return int(sum(self.row(k)[at + _REQUESTS] for k in range(first, first + count)
                       for at in range(_ROW, self.width, _PER_MODEL)))

    def crashed_input(self, first: int, count: int) -> int | None:
        """The digest of the request whose call crashed the process of rows first to
        first + count - 1 (its host's, then its interpreters'): that of the interpreter
        its host's row names, else of the only call running; None if neither says, or
        the signal came from another process (the row says -1)."""
        crashed = int(self.row(first)[_CRASHED])
        if crashed < 0:
            return None
        if 0 < crashed < count:
            rows = [first + crashed]
        else:
            rows = [k for k in range(first + 1, first + count) if self.row(k)[_SINCE]]
        return int(self.row(rows[0])[_INPUT]) or None if len(rows) == 1 else None


class _Count:
    """One number of a row (counter or gauge), written by the row's owner only."""

    __slots__ = ("_values", "_at")

    def __init__(self, values: memoryview, at: int) -> None:
        self._values, self._at = values, at

    def inc(self, amount: float = 1.0) -> None:
        self._values[self._at] += amount

    def dec(self) -> None:
        self._values[self._at] -= 1.0


class ModelSeries:
    """One model's series in one row, and the row's state as its calls begin and end:
    each step of a request is one call that stores its counts."""

    __slots__ = ("requests", "queued", "_values", "_own", "_index")

    def __init__(self, values: memoryview, at: int, index: int) -> None:
        self.requests = _Count(values, at + _REQUESTS)
        self.queued = _Count(values, at + _QUEUED)
        self._values, self._index = values, index
        self._own = values[at:at + _PER_MODEL]  # (its series, at offsets from 0)

    def call_began(self, requests: int) -> None:
        """A call of the model for that many requests begins in this row's interpreter:
        one more call, and interpreter busy with it, since now."""
        own = self._own
        own[_BUSY] += 1.0
        own[_CALLS] += 1.0
        own[_BATCHED_AT + bisect.bisect_left(_BATCHED, requests)] += 1.0
        own[_BATCHED_SUM] += requests
        own[_LAST_CALL] = time.time() * 1000.0
        self._values[_SINCE] = time.monotonic()

    def call_ended(self) -> None:
        """The call that began last in this row's interpreter has ended."""
        self._values[_SINCE] = 0.0
        self._own[_BUSY] -= 1.0

    def running(self, digest: int) -> None:
        """The call that begins now runs the one request of that digest
        (multipy.serve.request.poison; 0: it has ended)."""
        self._values[_INPUT] = digest

    def abandoned(self, running: bool) -> None:
        """A call of the model that its request gave up on still runs (True), or has
        ended."""
        self._values[_ABANDONED] = self._index + 1.0 if running else 0.0

    def answered(self, status: int, elapsed_ns: int, timing: Any = None) -> None:
        """One request answered with that HTTP status elapsed_ns after it arrived: its
        latency, and its success with timing's parts (multipy.serve.request.requests.Timing), or
        its failure."""
        own = self._own
        seconds = elapsed_ns / 1e9
        own[_LATENCY_AT + bisect.bisect_left(_LATENCY, seconds)] += 1.0
        own[_LATENCY_SUM] += seconds
        if status == 200:
            own[_SUCCESSES] += 1.0
            own[_SUCCESS_NS] += elapsed_ns
            own[_QUEUE_NS] += timing.queue_ns
            own[_INPUT_NS] += timing.input_ns
            own[_INFER_NS] += timing.infer_ns
            own[_OUTPUT_NS] += timing.output_ns
            return
        where = STATUSES.index(status) if status in STATUSES else STATUSES.index(500)
        own[_FAILURES + where] += 1.0
        own[_FAILURE_NS] += elapsed_ns


class Metrics:
    """The metrics of one server of ``models`` on ``interpreters`` interpreters, over a
    board of ``rows`` rows (made here, the shared one mapped from ``fd``, or the one at
    ``address``) with room for the series of ``slots`` models (at least those); this
    writer counts in row ``row`` of its process's rows, which begin at row ``first``
    (with --processes, each of ``processes`` has interpreters + 1 rows: its host's,
    then its front ends').  Every model's series exist (at 0) from the start, or from
    when ``add`` gives a model loaded later a slot; a model keeps its slot, and its
    counts, once unloaded."""

    def __init__(self, models: list[str], interpreters: int, rows: int = 1, row: int = 0,
                 address: int | None = None, stuck_after: float = STUCK_AFTER,
                 slots: int = 0, *, fd: int | None = None, first: int = 0,
                 processes: int = 1) -> None:
        self.names: list[str] = []
        self.slots = max(len(models), slots)
        self.interpreters = interpreters
        self.stuck_after = stuck_after
        self.first, self.processes = first, processes
        self.board = Board(rows, board_width(self.slots), address, fd)
        self._values = values = self.board.row(first + row)
        self._closed = _Count(values, _CLOSED)
        self._decoding = _Count(values, _DECODING)
        #: model name -> its series in this writer's row
        self.models: dict[str, ModelSeries] = {}
        for name in models:
            self.add(name)
        self._registry: Any = None  # render's, made at its first call

    def add(self, name: str) -> None:
        """Gives model name the next slot (its series, at 0), unless it has one; every
        writer adds the same models in the same order.  ValueError if every slot is
        taken.  (It replaces ``names`` and ``models`` rather than change them: other
        threads may be reading them.)"""
        if name in self.models:
            return
        if len(self.names) == self.slots:
            raise ValueError(f"this server has room for the metrics of {self.slots} models, "
                             f"and every one is taken ({', '.join(map(repr, self.names))})")
        k = len(self.names)
        self.models = {**self.models, name: ModelSeries(self._values, _ROW + _PER_MODEL * k, k)}
        self.names = [*self.names, name]

    def closed_connection(self) -> None:
        self._closed.inc()

    def closed_connections(self, row: int) -> int:
        """How many connections the writer of row (of this process's rows) has closed."""
        return int(self.board.row(self.first + row)[_CLOSED])

    @contextlib.contextmanager
    def decoding(self) -> Iterator[None]:
        """While it runs, this writer decodes a large request on a thread (``busy``
        counts it)."""
        self._decoding.inc()
        try:
            yield
        finally:
            self._decoding.dec()

    def busy(self, row: int) -> int:
        """How many calls the writer of row (of this process's rows) runs now, and large
        requests it decodes."""
        at = self.first + row
        return self.board.busy(at, 1) + int(self.board.row(at)[_DECODING])

    def calling_for(self, row: int) -> float:
        """How long the writer of row (of this process's rows) has been in its current
        call (0: in none)."""
        return self._calling_for(self.first + row)

    def _calling_for(self, at: int) -> float:
        since = self.board.row(at)[_SINCE]
        return time.monotonic() - since if since else 0.0

    def stuck(self, row: int) -> str | None:
        """Why the interpreter of row (of this process's rows) is stuck, or None: it runs
        a call of a model that its request gave up on (it passed --timeout, or its client
        went away), or one that has run longer than stuck_after seconds."""
        return self._stuck(self.first + row)

    def _stuck(self, at: int) -> str | None:
        values = self.board.row(at)
        if values[_ABANDONED]:
            name = self.names[int(values[_ABANDONED]) - 1]
            return (f"it still runs a call of model {name!r} that its request gave up on "
                    f"(it passed --timeout, or its client went away)")
        running = self._calling_for(at)
        if running > self.stuck_after:
            return f"it has been in one call for {running:.0f} s"
        return None

    def free_elsewhere(self, row: int) -> bool:
        """Whether an interpreter other than the one of row (of this process's rows) is
        not stuck: of this process, or of another of the server's (--processes; the rows
        of a slot with no process, zeroed, count as free)."""
        per, this = self.interpreters + 1, self.first + row
        return any(self._stuck(at) is None for at in range(self.board.rows)
                   if at % per and at != this)

    def took(self, number: int) -> None:
        """This process has taken every connection its supervisor handed it up to the
        one of that number (read by the supervisor, alive or after its death)."""
        self.board.row(self.first)[_TAKEN] = number

    def crash_cell(self) -> int:
        """The address of the float64 in this process's host row where the fatal-signal
        handler notes which interpreter's call crashed it (multipy._host.crash_cell)."""
        return self.board.address + 8 * (self.first * self.board.width + _CRASHED)

    def health(self) -> dict[str, int]:
        """This process's interpreters: how many there are, how many are ``stuck``, how
        many are busy (in a call, or decoding a large request): its supervisor's health
        check."""
        rows = range(1, self.interpreters + 1)
        return {"interpreters": self.interpreters,
                "stuck": sum(self.stuck(k) is not None for k in rows),
                "busy": sum(self.busy(k) > 0 for k in rows)}

    def all_stuck(self) -> str | None:
        """Why no interpreter of this process can take a call (every one is stuck: see
        ``stuck``), or None if one can.  Rows 1 to interpreters are the interpreters'."""
        reasons = [self.stuck(k) for k in range(1, self.interpreters + 1)]
        if self.board.rows <= self.interpreters or not all(reasons):
            return None
        return "no interpreter can take a call: " + "; ".join(
            f"interpreter {k}: {reason}" for k, reason in enumerate(reasons))

    def render(self) -> tuple[bytes, str]:
        """The Prometheus text exposition of every metric, summed over the rows, and its
        Content-Type.  prometheus_client is imported at the first call: a process that
        only counts (on the board) never imports it."""
        from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
        from prometheus_client.registry import CollectorRegistry

        if self._registry is None:
            registry = CollectorRegistry(auto_describe=False)
            registry.register(_Collector(self))
            self._registry = registry
        return generate_latest(self._registry), CONTENT_TYPE_LATEST

    def statistics(self, names: list[str]) -> dict[str, Any]:
        """The statistics extension's answer (Triton's, which tritonclient's
        get_inference_statistics reads) for the models names, summed over the rows: per
        model, the requests answered and failed, with their nanoseconds; the nanoseconds
        that successful ones spent queued, being decoded (compute_input), in the model's
        calls (compute_infer: a batch's call counts for each of its requests) and being
        encoded (compute_output); the requests run in calls (inference_count), the calls
        (execution_count) and when the last began (last_inference, milliseconds since
        the epoch).  No result cache: cache_hit and cache_miss stay 0."""
        board = self.board
        stats = []
        for name in names:
            at = _ROW + _PER_MODEL * self.names.index(name)
            total = lambda offset: int(board.total(at + offset))  # noqa: E731
            successes = total(_SUCCESSES)
            failures = sum(total(_FAILURES + i) for i in range(len(STATUSES)))

            def duration(count: int, offset: int) -> dict[str, int]:
                return {"count": count, "ns": total(offset)}

            stats.append({
                "name": name, "version": "1",
                "last_inference": int(board.most(at + _LAST_CALL)),
                "inference_count": total(_BATCHED_SUM),
                "execution_count": total(_CALLS),
                "inference_stats": {
                    "success": duration(successes, _SUCCESS_NS),
                    "fail": duration(failures, _FAILURE_NS),
                    "queue": duration(successes, _QUEUE_NS),
                    "compute_input": duration(successes, _INPUT_NS),
                    "compute_infer": duration(successes, _INFER_NS),
                    "compute_output": duration(successes, _OUTPUT_NS),
                    "cache_hit": {"count": 0, "ns": 0},
                    "cache_miss": {"count": 0, "ns": 0}},
                "batch_stats": []})
        return {"model_stats": stats}


class _Collector:
    """Reads the board's rows into Prometheus's families."""

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Any]:
        from prometheus_client.metrics_core import (  # (imported by render already)
            CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily)

        board, names = self._metrics.board, self._metrics.names

        def total(k: int, offset: int) -> float:
            return board.total(_ROW + _PER_MODEL * k + offset)

        def histogram(family: HistogramMetricFamily, k: int, at: int,
                      bounds: Sequence[float]) -> None:
            counts = [total(k, at + i) for i in range(len(bounds) + 1)]
            cumulative, running = [], 0.0
            for bound, count in zip([*map(_bound, bounds), "+Inf"], counts):
                running += count
                cumulative.append((bound, running))
            family.add_metric([names[k]], cumulative, total(k, at + len(bounds) + 1))

        requests = CounterMetricFamily("multipy_inference_requests",
                                       "Inference requests received", labels=["model"])
        failures = CounterMetricFamily(
            "multipy_inference_failures",
            "Inference requests answered with an error, by HTTP status",
            labels=["model", "status"])
        latency = HistogramMetricFamily("multipy_inference_request_duration_seconds",
                                        "Time from receiving an inference request to its answer",
                                        labels=["model"])
        queued = GaugeMetricFamily("multipy_inference_queue_length",
                                   "Requests received and not yet running: waiting for their "
                                   "batch or for the model to be free", labels=["model"])
        busy = GaugeMetricFamily("multipy_busy_interpreters",
                                 "Interpreters running a call of the model now", labels=["model"])
        calls = CounterMetricFamily("multipy_model_calls",
                                    "Calls of the model in an interpreter (a batch is one)",
                                    labels=["model"])
        batched = HistogramMetricFamily("multipy_batch_requests",
                                        "Requests answered by one call of the model",
                                        labels=["model"])
        for k, name in enumerate(names):
            requests.add_metric([name], total(k, _REQUESTS))
            for i, status in enumerate(STATUSES):
                failed = total(k, _FAILURES + i)
                if failed:
                    failures.add_metric([name, str(status)], failed)
            histogram(latency, k, _LATENCY_AT, _LATENCY)
            queued.add_metric([name], total(k, _QUEUED))
            busy.add_metric([name], total(k, _BUSY))
            calls.add_metric([name], total(k, _CALLS))
            histogram(batched, k, _BATCHED_AT, _BATCHED)
        metrics = self._metrics
        interpreters = GaugeMetricFamily("multipy_interpreters", "Interpreters serving the models")
        interpreters.add_metric([], metrics.interpreters * metrics.processes)
        stuck = GaugeMetricFamily(
            "multipy_stuck_interpreters",
            "Interpreters that take no call: each runs one that its request gave up on "
            "(past --timeout, or its client went away), or has run one call longer than "
            "the time after which it counts as stuck")
        per = metrics.interpreters + 1  # each process's host row, then its interpreters'
        rows = [p * per + k for p in range(board.rows // per)
                for k in range(1, per)] if board.rows > 1 else []
        stuck.add_metric([], sum(metrics._stuck(at) is not None for at in rows))
        yield from (requests, failures, latency, queued, busy, calls, batched, interpreters, stuck)


def _bound(value: float) -> str:
    """A bucket's bound as Prometheus writes it (1.0, 0.005, 128.0)."""
    return repr(float(value))
