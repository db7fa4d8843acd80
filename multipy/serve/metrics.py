"""The server's Prometheus metrics (``GET /metrics``), kept where every interpreter of
the process can count and read them.

Requests are answered by every interpreter's front end (and, while the interpreters
start, by the host), each on its own GIL: none may take a lock that another holds.  So
the counts live in a ``Board``, a block of float64s that the host allocates once and
every interpreter addresses (one process, one address space): each writer has a row of
its own that only it writes, and ``render``, wherever ``/metrics`` is answered, sums the
rows (an aligned float64 is read whole).  Per model: requests, failures (by HTTP
status), latency, requests queued (waiting for their batch, or for the model to be
free), interpreters busy with it, and calls (a batch is one), with how many requests
each answered.  A row also counts the connections its writer has closed, by which the
host hands new connections to the least busy front end.
"""
from __future__ import annotations

import bisect
import ctypes
import mmap
from typing import Any, Iterator, Sequence

from prometheus_client import generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.metrics_core import (CounterMetricFamily, GaugeMetricFamily,
                                            HistogramMetricFamily)
from prometheus_client.registry import CollectorRegistry

#: Latency buckets (seconds): from a fast model's millisecond to a slow batch's seconds.
_LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
            30.0, 60.0)
#: Requests per call.
_BATCHED = (1, 2, 4, 8, 16, 32, 64, 128)
#: The HTTP statuses an inference request can fail with (499: the client went away);
#: any other is counted as 500.
STATUSES = (400, 404, 413, 499, 500, 503)

CONTENT_TYPE = CONTENT_TYPE_LATEST

# A row: [connections closed, then per model: requests, failures by status, latency
# (a count per bucket and one past the last, then the sum), queued, busy, calls,
# batched (the same)].
_CLOSED = 0
_REQUESTS = 0
_FAILURES = 1
_LATENCY_AT = _FAILURES + len(STATUSES)
_QUEUED = _LATENCY_AT + len(_LATENCY) + 2
_BUSY = _QUEUED + 1
_CALLS = _BUSY + 1
_BATCHED_AT = _CALLS + 1
_PER_MODEL = _BATCHED_AT + len(_BATCHED) + 2


class Board:
    """``rows`` rows of ``width`` float64s, zeroed, in memory that any interpreter of this
    process can address: made here (``address`` None) or addressed at ``address`` (one
    the host made, which outlives every user)."""

    def __init__(self, rows: int, width: int, address: int | None = None) -> None:
        self.rows, self.width = rows, width
        if address is None:
            self._memory = mmap.mmap(-1, rows * width * 8)  # zeroed
            address = ctypes.addressof(ctypes.c_char.from_buffer(self._memory))
        self.address = address
        self.values = memoryview((ctypes.c_double * (rows * width)).from_address(address)) \
            .cast("B").cast("d")

    def row(self, k: int) -> memoryview:
        return self.values[k * self.width:(k + 1) * self.width]

    def total(self, column: int) -> float:
        return sum(self.values[column::self.width])


class _Count:
    """One number of a row (counter or gauge), written by the row's owner only."""

    __slots__ = ("_values", "_at")

    def __init__(self, values: memoryview, at: int) -> None:
        self._values, self._at = values, at

    def inc(self, amount: float = 1.0) -> None:
        self._values[self._at] += amount

    def dec(self) -> None:
        self._values[self._at] -= 1.0


class _Histogram:
    """A histogram of a row: a count per bucket, one past the last bucket, and the sum."""

    __slots__ = ("_values", "_at", "_bounds")

    def __init__(self, values: memoryview, at: int, bounds: Sequence[float]) -> None:
        self._values, self._at, self._bounds = values, at, bounds

    def observe(self, value: float) -> None:
        self._values[self._at + bisect.bisect_left(self._bounds, value)] += 1.0
        self._values[self._at + len(self._bounds) + 1] += value


class ModelSeries:
    """One model's series in one row."""

    __slots__ = ("requests", "latency", "queued", "busy", "calls", "batched", "_values", "_at")

    def __init__(self, values: memoryview, at: int) -> None:
        self.requests = _Count(values, at + _REQUESTS)
        self.latency = _Histogram(values, at + _LATENCY_AT, _LATENCY)
        self.queued = _Count(values, at + _QUEUED)
        self.busy = _Count(values, at + _BUSY)
        self.calls = _Count(values, at + _CALLS)
        self.batched = _Histogram(values, at + _BATCHED_AT, _BATCHED)
        self._values, self._at = values, at

    def failed(self, status: int) -> None:
        """One request answered with an error of that HTTP status."""
        where = STATUSES.index(status) if status in STATUSES else STATUSES.index(500)
        self._values[self._at + _FAILURES + where] += 1.0


class Metrics:
    """The metrics of one server of ``models`` on ``interpreters`` interpreters, over a
    board of ``rows`` rows (made here, or the one at ``address``); this writer counts in
    row ``row``.  Every model's series exist (at 0) from the start."""

    def __init__(self, models: list[str], interpreters: int, rows: int = 1, row: int = 0,
                 address: int | None = None) -> None:
        self.names = list(models)
        self.interpreters = interpreters
        self.board = Board(rows, 1 + _PER_MODEL * len(self.names), address)
        values = self.board.row(row)
        self._closed = _Count(values, _CLOSED)
        #: model name -> its series in this writer's row
        self.models = {name: ModelSeries(values, 1 + _PER_MODEL * k)
                       for k, name in enumerate(self.names)}
        self._registry = CollectorRegistry(auto_describe=False)
        self._registry.register(_Collector(self))

    def closed_connection(self) -> None:
        self._closed.inc()

    def closed_connections(self, row: int) -> int:
        """How many connections the writer of row has closed."""
        return int(self.board.row(row)[_CLOSED])

    def busy(self, row: int) -> int:
        """How many calls the writer of row runs now."""
        values = self.board.row(row)
        return int(sum(values[1 + _PER_MODEL * k + _BUSY] for k in range(len(self.names))))

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric, summed over the rows."""
        return generate_latest(self._registry)


class _Collector:
    """Reads the board's rows into Prometheus's families."""

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Any]:
        board, names = self._metrics.board, self._metrics.names

        def total(k: int, offset: int) -> float:
            return board.total(1 + _PER_MODEL * k + offset)

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
        interpreters = GaugeMetricFamily("multipy_interpreters", "Interpreters serving the models")
        interpreters.add_metric([], self._metrics.interpreters)
        yield from (requests, failures, latency, queued, busy, calls, batched, interpreters)


def _bound(value: float) -> str:
    """A bucket's bound as Prometheus writes it (1.0, 0.005, 128.0)."""
    return repr(float(value))
