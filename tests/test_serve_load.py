"""benchmarks/serve_load.py reads wrk's report as wrk prints it (wrk 4.1, ``--latency``):
requests/s, the latencies it reports, and every failure it counts."""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "benchmarks"))
serve_load = pytest.importorskip("serve_load")

REPORT = """Running 1s test @ http://127.0.0.1:48999/v2/models/simple/infer
  1 threads and 2 connections
  Thread Stats   Avg      Stdev     Max   +/- Stdev
    Latency     6.19ms    3.77ms  23.89ms   65.01%
    Req/Sec   324.70     62.92   460.00     70.00%
  Latency Distribution
     50%  {p50}
     75%    8.24ms
     90%   11.41ms
     99%  {p99}
  325 requests in 1.01s, 165.04KB read
{errors}Requests/sec:    323.33
Transfer/sec:    164.19KB
"""


def test_a_clean_report():
    figures = serve_load._wrk_figures(REPORT.format(p50="617.00us", p99="17.69ms", errors=""))
    assert figures == {"requests_per_second": 323.33, "p50_ms": pytest.approx(0.617),
                       "p99_ms": pytest.approx(17.69), "requests": 325, "wrong": 0}


def test_failures_are_counted_whatever_their_kind():
    errors = ("  Socket errors: connect 1, read 12, write 3, timeout 4\n"
              "  Non-2xx or 3xx responses: 20\n")
    figures = serve_load._wrk_figures(REPORT.format(p50="1.20s", p99="1.05m", errors=errors))
    assert figures["wrong"] == 1 + 12 + 3 + 4 + 20
    assert figures["p50_ms"] == pytest.approx(1200.0)
    assert figures["p99_ms"] == pytest.approx(63000.0)
