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
import math
import time
from typing import TYPE_CHECKING, Any, Iterator, Sequence

from .board import (ABANDONED, ACCEPTED, BATCHED, BATCHED_AT, BATCHED_SUM, BUSY, Board,
                    CALLS, CLOSED, CRASHED, DECODING, FAILURES, FAILURE_NS, HEALTHY_AT,
                    INFER_NS, INPUT, INPUT_NS, LAST_CALL, LATENCY, LATENCY_AT, LATENCY_SUM,
                    LINGERING, OPENED, OUTPUT_NS, PER_MODEL, PIECES, QUEUED, QUEUE_NS, RECEIVED,
                    REQUESTS, ROW, SINCE, STATUSES, SUCCESSES, SUCCESS_NS, TAKEN,
                    UNHEALTHY_AT, WATCHING, board_width)

if TYPE_CHECKING:
    from prometheus_client.registry import CollectorRegistry

#: Seconds after which an interpreter in one call counts as stuck, without --timeout.
STUCK_AFTER = 30.0
#: Seconds between two looks of a front end at whether it is crowded (``crowded``).
CROWDED_EVERY = 0.1
#: Seconds between two looks at the CPU that the process uses (``Metrics._saturated``).
SATURATED_EVERY = 0.1


class Timing:
    """Where one request's time went, in nanoseconds: decoding it (input), waiting for
    its call (queue), the call (infer: a batch's, for each of its requests) and encoding
    its answer (output); filled in as it goes (multipy.serve.request.inference.infer)."""

    __slots__ = ("input_ns", "queue_ns", "infer_ns", "output_ns")

    def __init__(self) -> None:
        self.input_ns = self.queue_ns = self.infer_ns = self.output_ns = 0


class Count:
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
        self.requests = Count(values, at + REQUESTS)
        self.queued = Count(values, at + QUEUED)
        self._values, self._index = values, index
        self._own = values[at:at + PER_MODEL]  # (its series, at offsets from 0)

    def call_began(self, requests: int) -> None:
        """A call of the model for that many requests begins in this row's interpreter:
        one more call, and interpreter busy with it, since now (0 requests: a later step
        of a streamed answer, whose request's call is counted already: busy only)."""
        own = self._own
        own[BUSY] += 1.0
        if requests:
            own[CALLS] += 1.0
            own[BATCHED_AT + bisect.bisect_left(BATCHED, requests)] += 1.0
            own[BATCHED_SUM] += requests
        own[LAST_CALL] = time.time() * 1000.0
        self._values[SINCE] = time.monotonic()

    def call_ended(self) -> None:
        """The call that began last in this row's interpreter has ended."""
        self._values[SINCE] = 0.0
        self._own[BUSY] -= 1.0

    def streamed(self) -> None:
        """One more piece of a streamed answer has been sent."""
        self._own[PIECES] += 1.0

    def running(self, digest: int) -> None:
        """The call that begins now runs the one request of that digest
        (multipy.serve.request.poison; 0: it has ended)."""
        self._values[INPUT] = digest

    def abandoned(self, running: bool) -> None:
        """A call of the model that its request gave up on still runs (True), or has
        ended."""
        self._values[ABANDONED] = self._index + 1.0 if running else 0.0

    def health_said(self, healthy: bool) -> None:
        """The model's own health check (a LitAPI's ``health()``, a kserve.Model's
        ``healthy()``) has just said healthy, or not, in this row's interpreter."""
        self._own[HEALTHY_AT if healthy else UNHEALTHY_AT] = time.time() * 1000.0

    def answered(self, status: int, elapsed_ns: int, timing: Timing | None = None) -> None:
        """One request answered with that HTTP status elapsed_ns after it arrived: its
        latency, and its success with timing's parts (``Timing``), or its failure, under
        its status (one of ``STATUSES``), else its class's: 400 for another 4xx, 500 for
        the rest."""
        own = self._own
        seconds = elapsed_ns / 1e9
        own[LATENCY_AT + bisect.bisect_left(LATENCY, seconds)] += 1.0
        own[LATENCY_SUM] += seconds
        if status == 200:
            own[SUCCESSES] += 1.0
            own[SUCCESS_NS] += elapsed_ns
            own[QUEUE_NS] += timing.queue_ns
            own[INPUT_NS] += timing.input_ns
            own[INFER_NS] += timing.infer_ns
            own[OUTPUT_NS] += timing.output_ns
            return
        where = STATUSES.index(status if status in STATUSES else
                               400 if 400 <= status < 500 else 500)
        own[FAILURES + where] += 1.0
        own[FAILURE_NS] += elapsed_ns


class Metrics:
    """The metrics of one server of ``models`` on ``interpreters`` interpreters, over a
    board of ``rows`` rows (made here, the shared one mapped from ``fd``, or the one at
    ``address``) with room for the series of ``slots`` models (at least those); this
    writer counts in row ``row`` of its process's rows, which begin at row ``first``
    (with --processes, each of ``processes`` has interpreters + 1 rows: its host's,
    then its front ends'), on a machine of ``cores`` cores (None: as many as front ends,
    see ``freer_front_end``).  Every model's series exist (at 0) from the start, or from
    when ``add`` gives a model loaded later a slot; a model keeps its slot, and its
    counts, once unloaded."""

    def __init__(self, models: list[str], interpreters: int, rows: int = 1, row: int = 0,
                 address: int | None = None, stuck_after: float = STUCK_AFTER,
                 slots: int = 0, *, fd: int | None = None, first: int = 0,
                 processes: int = 1, cores: int | None = None) -> None:
        self.names: list[str] = []
        self.slots = max(len(models), slots)
        self.interpreters = interpreters
        self.stuck_after = stuck_after
        self.first, self.processes, self.row, self.cores = first, processes, row, cores
        self.board = Board(rows, board_width(self.slots), address, fd)
        self._values = values = self.board.row(first + row)
        self._decoding = Count(values, DECODING)
        self._crowded_at = 0.0  # (when ``crowded`` looks next)
        # (whether a front end spreads the connections it accepts: see freer_front_end)
        self._spreads = cores is None or processes * interpreters <= cores
        # (the process's share of the cores, rounded up, and the CPU time a second that
        # saturates it, asked only when it does not spread; its CPU time when ``_load``
        # looked last, when, and the cores it saw used; whether ``surplus`` said so last)
        self._share = max(1, math.ceil((cores or 0) / processes))
        self._saturating = 0.75 * (cores or 0) / processes
        self._cpu, self._cpu_at, self._used = 0.0, float("-inf"), 0.0
        self._aside = False
        #: whether this writer is a front end past its process's share of the cores,
        #: which stands aside while the share's front ends keep them busy (``surplus``)
        self.may_be_surplus = not self._spreads and row > self._share
        #: model name -> its series in this writer's row
        self.models: dict[str, ModelSeries] = {}
        for name in models:
            self.add(name)
        self._registry: CollectorRegistry | None = None  # render's, made at its first call

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
        self.models = {**self.models, name: ModelSeries(self._values, ROW + PER_MODEL * k, k)}
        self.names = [*self.names, name]

    def last_health(self, name: str) -> bool | None:
        """What the last of model name's own health checks said, in any row (whichever
        front end ran it), or None if none has run."""
        at = ROW + PER_MODEL * self.names.index(name)
        healthy, unhealthy = (self.board.most(at + HEALTHY_AT),
                              self.board.most(at + UNHEALTHY_AT))
        return None if healthy == unhealthy == 0.0 else healthy > unhealthy

    # (the three below, once or twice a connection, write the board's row directly)
    def opened_connection(self, received: bool) -> None:
        """This writer (a front end) serves a new connection: one the host handed it
        (received), or one it accepted."""
        values = self._values
        values[OPENED] += 1.0
        if received:
            values[RECEIVED] += 1.0

    def accepted_connection(self) -> None:
        """This writer accepted a connection from the listening socket (whoever serves
        it)."""
        self._values[ACCEPTED] += 1.0

    def closed_connection(self) -> None:
        self._values[CLOSED] += 1.0

    def lingering(self, delta: int) -> None:
        """One more (delta 1) or one fewer (-1) of this writer's connections has
        answered its first request and waits, idle, for a second: one its client is
        closing, most likely (multipy.serve.http.uvicorn_protocol.guarded)."""
        self._values[LINGERING] += delta

    def open_connections(self, row: int, handed: int | None = None) -> int:
        """How many connections the writer of row (of this process's rows) serves now,
        or, given how many the host has handed it, will once it has taken them."""
        values = self.board.row(self.first + row)
        pending = 0 if handed is None else handed - values[RECEIVED]
        return int(values[OPENED] - values[CLOSED] + pending)

    def _active_at(self, at: int) -> int:
        """How many connections the writer of the board's row at serves now, those that
        linger (``lingering``) aside."""
        values = self.board.row(at)
        return int(values[OPENED] - values[CLOSED] - values[LINGERING])

    def watching(self, on: bool) -> None:
        """This writer (a front end) watches the listening socket (on), or not."""
        self._values[WATCHING] = float(on)

    def freer_front_end(self, busy: bool) -> bool:
        """Whether another front end that accepts on the listening socket and runs no
        call serves fewer connections than this writer's (a front end's; two fewer once
        this one takes a new one), of its process, unless it serves just one, the server
        has more front ends than the machine has cores, and its process keeps its share
        of them busy (``_saturated``); or, if this one is busy, whether another, of any
        process, runs no call (of this process, one past the cores counts even while it
        stands aside: ``surplus``).  Lingering connections (``lingering``), this writer's and
        the others', do not count: a client that sends one request a connection has
        closed the one before, most likely, by the time its next one is accepted.  (With
        more front ends than busy cores, one that polls is not one that runs: a
        connection handed on costs its request the switches and the host's hop, and the
        kernel wakes the loops that get to poll.  A model that waits, on a device or
        I/O, leaves the cores free: then connections spread.)"""
        mine = self._active_at(self.first + self.row)
        if not busy and (mine == 0  # (none serves fewer: a client's new connection)
                         or mine == 1 and not self._spreads and self._saturated()):
            return False
        aside = 0 if not busy or self._spreads else self._share  # (rows past it: see surplus)
        for row in range(1, self.interpreters + 1):
            if row != self.row and (busy or self._active_at(self.first + row) < mine) \
                    and self._free(self.first + row, row > aside > 0):
                return True
        return busy and self.idle_elsewhere()

    def _saturated(self) -> bool:
        """Whether this process used three quarters of its share of the machine's cores
        (the cores over the server's processes) or more (``_load``)."""
        return self._load() >= self._saturating

    def _load(self) -> float:
        """The cores this process used since this writer's last look, when that was
        SATURATED_EVERY seconds ago (a timer's look a little early counts) to twice
        that.  It looks once every SATURATED_EVERY seconds at most (what it saw stands
        between); a look after a longer pause begins anew, and says 0."""
        now = time.monotonic()
        elapsed = now - self._cpu_at
        if elapsed >= 0.9 * SATURATED_EVERY:
            cpu = time.process_time()
            self._used = (cpu - self._cpu) / elapsed \
                if elapsed <= 2 * SATURATED_EVERY else 0.0
            self._cpu, self._cpu_at = cpu, now
        return self._used

    def surplus(self) -> bool:
        """Whether this writer, a front end past its process's share of the cores
        (``may_be_surplus``: with more front ends than cores, the rows past the cores
        over the processes, rounded up), stands aside: it neither accepts nor keeps a
        kept-alive connection while every front end within the share accepts and the
        process keeps three quarters of its share of the cores busy (``_load``); once
        aside, until every one within the share accepts no more or the process uses
        under half its share.  (Four event loops taking turns on two busy cores cost
        each request more CPU than two that run; a model that waits leaves the cores
        free, and then every front end serves.)"""
        if not self.may_be_surplus:
            return False
        self._aside = all(self.accepts(row) for row in range(1, self._share + 1)) \
            and self._load() >= self._saturating * (2 / 3 if self._aside else 1)
        return self._aside

    @property
    def sheds(self) -> bool:
        """Whether a front end may close a kept-alive connection once it has answered a
        request (``crowded``): with more processes than one, or more front ends than
        cores."""
        return self.processes > 1 or not self._spreads

    def accepts(self, row: int) -> bool:
        """Whether the front end of row (of this process's rows) accepts on the
        listening socket (``watching``)."""
        return bool(self.board.row(self.first + row)[WATCHING])

    def crowded(self) -> bool:
        """Whether this writer (a front end) should close a kept-alive connection once
        it has answered it: it stands aside (``surplus``), or serves two connections or
        more beyond the fewest that a front end of another process that accepts on the
        listening socket serves, lingering ones aside (``lingering``), looked at once
        every CROWDED_EVERY seconds at most (False between).  Keep-alive clients land
        on the processes as the kernel's wake-ups fall, and the client's next
        connection most likely lands on a freer one (a front end of this process is
        given one at once: ``freer_front_end``)."""
        if self.may_be_surplus and self.surplus():
            return True
        now = time.monotonic()
        if now < self._crowded_at:
            return False
        self._crowded_at = now + CROWDED_EVERY
        board = self.board
        fewest = min((self._active_at(at) for at in self._front_ends_elsewhere()
                      if board.row(at)[WATCHING]), default=None)
        mine = self._active_at(self.first + self.row)
        return fewest is not None and mine >= fewest + 2

    def idle_elsewhere(self) -> bool:
        """Whether a front end of another process accepts and runs no call."""
        return any(self._free(at) for at in self._front_ends_elsewhere())

    def _front_ends_elsewhere(self) -> Iterator[int]:
        """The board's rows of the front ends of the other processes (each process has
        its host's row, then its interpreters')."""
        per = self.interpreters + 1
        return (at for at in range(self.board.rows)
                if at % per and not self.first <= at <= self.first + self.interpreters)

    def _free(self, at: int, aside: bool = False) -> bool:
        """Whether the writer of the board's row at accepts (or, if aside, may stand
        aside: ``surplus``) and runs no call."""
        values = self.board.row(at)
        return (aside or bool(values[WATCHING])) and not self.board.busy(at, 1) \
            and not values[DECODING]

    def accepted_connections(self) -> int:
        """How many connections every writer of the board (of every process) has accepted
        from the listening socket itself."""
        return int(self.board.total(ACCEPTED))

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
        return self.board.busy(at, 1) + int(self.board.row(at)[DECODING])

    def calling_for(self, row: int) -> float:
        """How long the writer of row (of this process's rows) has been in its current
        call (0: in none)."""
        return self._calling_for(self.first + row)

    def _calling_for(self, at: int) -> float:
        since = self.board.row(at)[SINCE]
        return time.monotonic() - since if since else 0.0

    def stuck(self, row: int) -> str | None:
        """Why the interpreter of row (of this process's rows) is stuck, or None: it runs
        a call of a model that its request gave up on (it passed --timeout, or its client
        went away), or one that has run longer than stuck_after seconds."""
        return self._stuck(self.first + row)

    def _stuck(self, at: int) -> str | None:
        values = self.board.row(at)
        if values[ABANDONED]:
            name = self.names[int(values[ABANDONED]) - 1]
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
        self.board.row(self.first)[TAKEN] = number

    def crash_cell(self) -> int:
        """The address of the float64 in this process's host row where the fatal-signal
        handler notes which interpreter's call crashed it (multipy._host.crash_cell)."""
        return self.board.address + 8 * (self.first * self.board.width + CRASHED)

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
            at = ROW + PER_MODEL * self.names.index(name)
            total = lambda offset: int(board.total(at + offset))  # noqa: E731
            successes = total(SUCCESSES)
            failures = sum(total(FAILURES + i) for i in range(len(STATUSES)))

            def duration(count: int, offset: int) -> dict[str, int]:
                return {"count": count, "ns": total(offset)}

            stats.append({
                "name": name, "version": "1",
                "last_inference": int(board.most(at + LAST_CALL)),
                "inference_count": total(BATCHED_SUM),
                "execution_count": total(CALLS),
                "inference_stats": {
                    "success": duration(successes, SUCCESS_NS),
                    "fail": duration(failures, FAILURE_NS),
                    "queue": duration(successes, QUEUE_NS),
                    "compute_input": duration(successes, INPUT_NS),
                    "compute_infer": duration(successes, INFER_NS),
                    "compute_output": duration(successes, OUTPUT_NS),
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
            return board.total(ROW + PER_MODEL * k + offset)

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
        pieces = CounterMetricFamily("multipy_streamed_pieces",
                                     "Pieces of streamed answers sent (one per response of "
                                     "a model that streams)", labels=["model"])
        for k, name in enumerate(names):
            requests.add_metric([name], total(k, REQUESTS))
            for i, status in enumerate(STATUSES):
                failed = total(k, FAILURES + i)
                if failed:
                    failures.add_metric([name, str(status)], failed)
            histogram(latency, k, LATENCY_AT, LATENCY)
            queued.add_metric([name], total(k, QUEUED))
            busy.add_metric([name], total(k, BUSY))
            calls.add_metric([name], total(k, CALLS))
            histogram(batched, k, BATCHED_AT, BATCHED)
            pieces.add_metric([name], total(k, PIECES))
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
        accepted = CounterMetricFamily(
            "multipy_connections_accepted",
            "Connections accepted from the listening socket, by who accepted them: an "
            "interpreter's front end, or the host of a server of one process (while the "
            "models load, or when every front end has left one waiting)", labels=["by"])
        by_interpreters = sum(board.row(at)[ACCEPTED] for at in rows)
        accepted.add_metric(["interpreter"], by_interpreters)
        accepted.add_metric(["host"], board.total(ACCEPTED) - by_interpreters)
        handed = CounterMetricFamily(
            "multipy_connections_handed",
            "Connections the host handed to a front end: those a front end gave back "
            "unread, having just accepted them while another one was freer, and those the "
            "host accepted itself (or, with --processes, its supervisor gave it)")
        handed.add_metric([], sum(board.row(at)[RECEIVED] for at in rows))
        yield from (requests, failures, latency, queued, busy, calls, batched, pieces,
                    interpreters, stuck, accepted, handed)


def _bound(value: float) -> str:
    """A bucket's bound as Prometheus writes it (1.0, 0.005, 128.0)."""
    return repr(float(value))
