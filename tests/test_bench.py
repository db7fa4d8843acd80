"""`multipy bench`, end to end and small: three strategies on the simple model."""
from __future__ import annotations

import csv
import subprocess
import sys

import pytest

pytest.importorskip("torch")
pytest.importorskip("matplotlib")
pytest.importorskip("rich")

HEADER = ["benchmark", "strategy", "n_threads", "work_items_completed", "work_items_per_second",
          "p25_latency", "p50_latency", "p95_latency", "device", "device_memory_mib"]


@pytest.mark.timeout(240)
def test_bench_writes_csv_and_plot(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "multipy", "bench", "--models", "simple",
         "--strategies", "one_python,multi_python,threads", "--max-threads", "2",
         "--duration", "0.3", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stdout + result.stderr
    with open(tmp_path / "bench.csv") as f:
        header, *rows = list(csv.reader(f, skipinitialspace=True))
    assert header == HEADER
    runs = {(row[1], int(row[2])): row for row in rows}
    assert sorted(runs) == [("multi_python", 1), ("multi_python", 2), ("one_python", 1),
                            ("one_python", 2), ("threads", 1), ("threads", 2)]
    for row in rows:
        assert row[0] == "simple" and row[-2:] == ["cpu", "0"]
        assert int(row[3]) > 0 and float(row[4]) > 0, row
    assert (tmp_path / "bench.png").stat().st_size > 0
    ratios = result.stdout[result.stdout.index("multi_python throughput / peer's"):]
    assert [line.split()[1:4:2] for line in ratios.splitlines() if line.startswith("│ simple")] \
        == [["simple", "1"], ["simple", "2"]]
