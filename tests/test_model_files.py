"""A model's files run as they are now (multipy._inside.model_files): a model file and a
module beside it, rewritten at their size within the second of their last write, which
Python's bytecode cache takes as unchanged, run as they are now, as a class's model file
(``classes.load``) and as a Triton model's reloaded (``triton_imports.load_module``,
whose tracebacks show the new lines); no bytecode is written beside them.
"""
from __future__ import annotations

import os
import py_compile
import subprocess
import sys
import uuid

import pytest

STAMP = 1_700_000_000  #: the files' modification time, before and after each rewrite

CLASS = '''
from {helper} import VALUE

VERSION = {version}


class Versioned:
    def predict(self, inputs):
        return inputs
'''


def _write(path, text: str) -> None:
    path.write_text(text)
    os.utime(path, (STAMP, STAMP))


def _cached(*paths) -> dict:
    """Each file compiled into its bytecode cache as Python's import does (stamped with
    the source's size and modification time), and the bytecode files' contents."""
    compiled = [py_compile.compile(str(path), doraise=True,
                                   invalidation_mode=py_compile.PycInvalidationMode.TIMESTAMP)
                for path in paths]
    return {path: open(path, "rb").read() for path in compiled}


def _untouched(cached: dict) -> None:
    """No bytecode file of cached's folder was written since."""
    assert {path: open(path, "rb").read() for path in cached} == cached
    folder = os.path.dirname(next(iter(cached)))
    assert sorted(os.listdir(folder)) == sorted(map(os.path.basename, cached))


def test_a_class_models_file_and_its_neighbour_run_as_they_are_now(sessions, tmp_path):
    pytest.importorskip("numpy")  # (what serves a class reads its requests with)
    tag = uuid.uuid4().hex[:8]
    model, beside = tmp_path / f"model_{tag}.py", tmp_path / f"helper_{tag}.py"
    _write(model, CLASS.format(helper=f"helper_{tag}", version=1))
    _write(beside, "VALUE = 1\n")
    cached = _cached(model, beside)
    _write(model, CLASS.format(helper=f"helper_{tag}", version=2))
    _write(beside, "VALUE = 2\n")
    stock = subprocess.run(
        [sys.executable, "-c", f"import sys; sys.path.insert(0, {str(tmp_path)!r}); "
         f"import model_{tag} as m; print(m.VERSION, m.VALUE)"],
        capture_output=True, text=True, timeout=60)
    assert stock.stdout == "1 1\n", stock  # what Python's own import runs: the cache

    s = sessions[0]
    s.global_("multipy._inside.classes", "load")(str(model), f"model_{tag}", "Versioned", "v")
    assert (s.global_(f"model_{tag}", "VERSION").deref(),
            s.global_(f"model_{tag}", "VALUE").deref()) == (2, 2)
    _untouched(cached)


def test_a_triton_model_reloaded_runs_its_files_as_they_are_now(sessions, tmp_path):
    model, beside = tmp_path / "model.py", tmp_path / "utils.py"
    _write(model, "from utils import VALUE\nVERSION = 1\n")
    _write(beside, "VALUE = 1\n")
    cached = _cached(model, beside)
    load = sessions[1].global_("multipy._inside.triton_imports", "load_module")
    name = f"m{uuid.uuid4().hex[:8]}"
    first = load(name, str(model))
    assert (first.attr("VERSION").deref(), first.attr("VALUE").deref()) == (1, 1)
    line = sessions[1].global_("linecache", "getline")  # what tracebacks show
    assert line(str(model), 2).deref() == "VERSION = 1\n"
    _write(model, "from utils import VALUE\nVERSION = 2\n")
    _write(beside, "VALUE = 2\n")
    again = load(name, str(model))
    assert (again.attr("VERSION").deref(), again.attr("VALUE").deref()) == (2, 2)
    assert line(str(model), 2).deref() == "VERSION = 2\n"
    _untouched(cached)
