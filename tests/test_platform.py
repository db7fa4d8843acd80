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


