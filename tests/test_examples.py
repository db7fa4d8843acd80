"""Every script under examples/ and benchmarks/ answers --help with its usage, and writes
nothing (a mistyped option once made a folder named after it, full of packages)."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = sorted(os.path.join(folder, name) for folder in ("examples", "benchmarks")
                 for name in os.listdir(os.path.join(ROOT, folder)) if name.endswith(".py"))

NEED_NO_TORCH = {"benchmarks/core.py", "examples/hello.py"}
#: scripts that need a module beyond torch (the bench extra's, or, run by
#: benchmarks/serve_load.py in KServe's own environment, KServe)
PEER_SCRIPTS = {"benchmarks/kserve_model.py": "kserve", "benchmarks/bench.py": "rich"}


@pytest.mark.parametrize("script", SCRIPTS)
def test_help_prints_usage_and_writes_nothing(script, tmp_path):
    if script not in NEED_NO_TORCH and importlib.util.find_spec("torch") is None:
        pytest.skip("the script imports torch")
    if script in PEER_SCRIPTS and importlib.util.find_spec(PEER_SCRIPTS[script]) is None:
        pytest.skip(f"the script runs where {PEER_SCRIPTS[script]} is installed")
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    result = subprocess.run([sys.executable, os.path.join(ROOT, script), "--help"],
                            capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage:")
    assert list(tmp_path.iterdir()) == []
