"""The server's Prometheus metrics (``GET /metrics``), through prometheus_client.

Per model: requests, failures (by HTTP status), latency, requests queued (waiting for
their batch, or for a free interpreter), interpreters busy with it, and calls into the
interpreters (a batch is one call).  A registry of its own: nothing else in the process
adds to it.
"""
from __future__ import annotations

from typing import Any, NamedTuple

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

#: Latency buckets (seconds): from a fast model's millisecond to a slow batch's seconds.
_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
            30.0, 60.0)

CONTENT_TYPE = CONTENT_TYPE_LATEST


class ModelSeries(NamedTuple):
    """One model's series of each family, looked up once (a lookup by label takes a
    lock and builds a key: every request would pay it several times)."""

    requests: Any
    latency: Any
    queued: Any
    busy: Any
    calls: Any
    batched: Any


class Metrics:
    """The metrics of one server; every model's series exist (at 0) from the start."""

    def __init__(self, models: list[str], interpreters: int) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter("multipy_inference_requests", "Inference requests received",
                                ["model"], registry=self.registry)
        self.failures = Counter("multipy_inference_failures",
                                "Inference requests answered with an error, by HTTP status",
                                ["model", "status"], registry=self.registry)
        self.latency = Histogram("multipy_inference_request_duration_seconds",
                                 "Time from receiving an inference request to its answer",
                                 ["model"], buckets=_BUCKETS, registry=self.registry)
        self.queued = Gauge("multipy_inference_queue_length",
                            "Requests received and not yet running: waiting for their "
                            "batch or for a free interpreter", ["model"],
                            registry=self.registry)
        self.busy = Gauge("multipy_busy_interpreters",
                          "Interpreters running a call of the model now", ["model"],
                          registry=self.registry)
        self.calls = Counter("multipy_model_calls",
                             "Calls of the model in an interpreter (a batch is one)",
                             ["model"], registry=self.registry)
        self.batched = Histogram("multipy_batch_requests",
                                 "Requests answered by one call of the model",
                                 ["model"], buckets=(1, 2, 4, 8, 16, 32, 64, 128),
                                 registry=self.registry)
        self.interpreters = Gauge("multipy_interpreters", "Interpreters serving the models",
                                  registry=self.registry)
        self.interpreters.set(interpreters)
        #: model name -> its series
        self.models = {model: ModelSeries(*(family.labels(model=model) for family in (
            self.requests, self.latency, self.queued, self.busy, self.calls, self.batched)))
            for model in models}

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)
