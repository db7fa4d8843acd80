"""A short soak (benchmarks/soak.py) in a fresh process: every result checked, nothing
lost, nothing hung, handles and lent tensors back at their baseline."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

SOAK = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "soak.py")


@pytest.mark.timeout(450)
def test_stress_64_threads_on_4_interpreters():
    done = subprocess.run(
        [sys.executable, "-m", "multipy", "run", SOAK, "--seconds", "30", "--threads", "64",
         "--interpreters", "4", "--bad-inputs", "20", "--exit-runs", "3"],
        capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    assert figures["calls"] > 1000
    assert figures["lost_or_wrong_results"] == 0
    assert figures["unexpected_errors"] == 0, figures["unexpected_examples"]
    assert figures["hangs"] == 0
    assert figures["errors_injected"] > 0
    assert figures["errors_verified"] == figures["errors_injected"]
    assert figures["handles_and_aliases_at_baseline"], (
        figures["handles_and_lent_per_interpreter"], figures["host_lent"])
    assert figures["bad_inputs_mishandled"] == 0
    assert figures["bad_inputs_rejected"] + figures["bad_inputs_harmless"] == figures["bad_inputs_tried"]
    assert figures["exit_runs"] == 3 and figures["exit_wrong_code"] == 0 and figures["exit_slow"] == 0
