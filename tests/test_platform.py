"""What multipy needs from the platform, and how it says so when it is missing."""
from __future__ import annotations

import sysconfig

import pytest

import multipy
from multipy import _glibc
from multipy._launch import launch_environment


def test_libpython_of_this_python_is_found():
    path = _glibc.libpython_path()
    assert ".so" in path and "libpython" in path


def test_static_python_gets_a_clear_error(monkeypatch):
    real = sysconfig.get_config_var
    monkeypatch.setattr(sysconfig, "get_config_var",
                        lambda name: 0 if name == "Py_ENABLE_SHARED" else real(name))
    with pytest.raises(multipy.UnsupportedPythonError, match="--enable-shared"):
        _glibc.libpython_path()


def test_launch_environment_keeps_other_tunables():
    env = launch_environment({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2:glibc.rtld.nns=4"})
    items = env["GLIBC_TUNABLES"].split(":")
    assert "glibc.malloc.arena_max=2" in items
    assert "glibc.rtld.nns=16" in items and "glibc.rtld.nns=4" not in items
    assert "glibc.rtld.optional_static_tls=16384" in items




def test_a_cpython_without_a_shared_libpython_is_told_so_in_one_line(python):
    # this machine's CPythons all have one: the child's sysconfig says it has none, as a
    # static build's does (Py_ENABLE_SHARED 0)
    result = python("""
        import sysconfig
        real = sysconfig.get_config_var
        sysconfig.get_config_var = lambda name: 0 if name == "Py_ENABLE_SHARED" else real(name)
        import multipy
        from multipy.cli import main
        main(["info"])
        try:
            multipy.InterpreterManager(1)
        except multipy.UnsupportedPythonError as error:
            print("error:", error)
    """, timeout=60)
    assert result.returncode == 0, result.stderr
    (info,) = [line for line in result.stdout.splitlines() if line.startswith("libpython:")]
    (error,) = [line for line in result.stdout.splitlines() if line.startswith("error:")]
    for line in (info, error):
        assert "has none (built without --enable-shared)" in line
        assert "PYTHON_CONFIGURE_OPTS=--enable-shared" in line
