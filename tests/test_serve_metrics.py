"""`multipy serve`'s /metrics: the counters a request moves on the shared server ``served``
(conftest.py), and the board that every writer counts in, summed whoever renders it.
"""
from __future__ import annotations


import pytest

np = pytest.importorskip("numpy")
from serving import _input, _metrics  # noqa: E402
pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402


def test_metrics(served):
    before = _metrics(served)
    key = ("multipy_inference_requests_total", (("model", "python_heavy"),))
    client = served.client()
    x = np.zeros((1, 48, 16), np.float32)
    for _ in range(3):
        client.infer("python_heavy", [_input("x", x, "FP32", True)])
    after = _metrics(served)
    assert after[key] == before[key] + 3
    count = ("multipy_inference_request_duration_seconds_count", (("model", "python_heavy"),))
    assert after[count] == before[count] + 3
    calls = ("multipy_model_calls_total", (("model", "python_heavy"),))
    assert after[calls] == before[calls] + 3
    for model in ("python_heavy", "cast", "pair", "fails", "slow"):
        assert after[("multipy_inference_queue_length", (("model", model),))] == 0
        assert after[("multipy_busy_interpreters", (("model", model),))] == 0
    assert after[("multipy_interpreters", ())] == 2


def test_metrics_sum_every_writers_row():
    """Writers that each count in their own row of one board (as the interpreters'
    front ends do, at its address) are summed by /metrics's text, whoever renders it."""
    from multipy.serve.request.metrics import Metrics
    from multipy.serve.request.requests import Timing

    host = Metrics(["a", "b"], 2, rows=3, row=0)
    fronts = [Metrics(["a", "b"], 2, rows=3, row=k, address=host.board.address) for k in (1, 2)]
    for k, front in enumerate(fronts):
        series = front.models["a"]
        for _ in range(k + 1):
            series.requests.inc()
        series.answered(413, 3_000_000)
        timing = Timing()
        timing.input_ns, timing.queue_ns, timing.infer_ns, timing.output_ns = 1, 2, 3, 4
        series.answered(200, 100 * (k + 1), timing)
        series.call_began(1)
        front.accepted_connection()  # (one it accepted, and one the host handed it)
        front.opened_connection(received=False)
        front.opened_connection(received=True)
        front.closed_connection()
    fronts[0].models["b"].call_began(3)  # a batch of 3, ended
    fronts[0].models["b"].call_ended()
    samples = {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
               for family in text_string_to_metric_families(fronts[1].render()[0].decode())
               for sample in family.samples}
    assert samples[("multipy_inference_requests_total", (("model", "a"),))] == 3
    assert samples[("multipy_inference_requests_total", (("model", "b"),))] == 0
    assert samples[("multipy_inference_failures_total", (("model", "a"), ("status", "413")))] == 2
    latency = "multipy_inference_request_duration_seconds"
    assert samples[(f"{latency}_bucket", (("le", "0.0025"), ("model", "a")))] == 2
    assert samples[(f"{latency}_bucket", (("le", "0.005"), ("model", "a")))] == 4
    assert samples[(f"{latency}_count", (("model", "a"),))] == 4
    assert samples[(f"{latency}_sum", (("model", "a"),))] == pytest.approx(0.0060003)
    assert samples[("multipy_busy_interpreters", (("model", "a"),))] == 2
    assert samples[("multipy_batch_requests_bucket", (("le", "2.0"), ("model", "b")))] == 0
    assert samples[("multipy_batch_requests_bucket", (("le", "4.0"), ("model", "b")))] == 1
    # and the statistics extension reads the same rows
    stats = {s["name"]: s for s in host.statistics(["a", "b"])["model_stats"]}
    assert stats["a"]["inference_stats"]["success"] == {"count": 2, "ns": 300}
    assert stats["a"]["inference_stats"]["fail"] == {"count": 2, "ns": 6_000_000}
    assert [stats["a"]["inference_stats"][part]["ns"] for part in (
        "compute_input", "queue", "compute_infer", "compute_output")] == [2, 4, 6, 8]
    assert stats["b"]["inference_count"] == 3 and stats["b"]["execution_count"] == 1
    assert samples[("multipy_interpreters", ())] == 2
    assert samples[("multipy_connections_accepted_total", (("by", "interpreter"),))] == 2
    assert samples[("multipy_connections_handed_total", ())] == 2  # (one to each)
    assert [host.open_connections(k) for k in (0, 1, 2)] == [0, 1, 1]
    # (and one more handed to the second that it has not taken yet)
    assert [host.open_connections(k, handed) for k, handed in ((1, 1), (2, 2))] == [1, 2]
    assert host.accepted_connections() == 2
    assert [host.busy(k) for k in (0, 1, 2)] == [0, 1, 1]
    with fronts[1].decoding():  # a large request, decoded on a thread: busy too
        assert [host.busy(k) for k in (0, 1, 2)] == [0, 1, 2]
    assert host.busy(2) == 1
