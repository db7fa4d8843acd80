"""The free cores that the demo, the benchmark and the examples measure first, and what
they say when the machine cannot show the speed-up (multipy/_free_cores.py)."""
from __future__ import annotations

import os
import subprocess
import sys

from multipy import _free_cores
from multipy._free_cores import describe, measure

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_processes_at_once_are_measured_in_units_of_one_alone(monkeypatch):
    # (how much work two processes do depends on the machine's load: no bound on it here)
    assert measure(2, seconds=0.2) > 0
    counted = {1: 1000, 2: 1500}
    monkeypatch.setattr(_free_cores, "_rounds", lambda processes, seconds: counted[processes])
    assert measure(2) == 1.5
    counted[1] = 0  # (a process that counted nothing does not divide by zero)
    assert measure(2) == 1500


def test_a_busy_machine_is_said_plainly_and_a_free_one_is_not():
    busy = describe(2, 1.1)
    assert busy.splitlines()[0].startswith("free cores: 2 plain Python processes at once did "
                                           "1.10x the work of one alone")
    assert "cannot run faster than about 1.1x one here" in busy
    assert describe(2, 1.95).count("\n") == 0 and "cannot" not in describe(2, 1.95)


def test_the_demo_says_the_free_cores_before_its_ratio():
    result = subprocess.run([sys.executable, "-m", "multipy", "run", "benchmarks/core.py",
                             "--n", "100000", "--repeat", "1"], capture_output=True, text=True,
                            timeout=120, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("free cores: 2 plain Python processes at once did ")
    assert any(line.strip().startswith("ratio (one GIL / interpreters):") for line in lines)
