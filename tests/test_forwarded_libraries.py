"""Libraries kept once per process: an interpreter that opens one gets multipy's
forwarder, pointed at the host's copy (docs/design.md, "One copy per process").

Tested on any torch build with a fake cuBLASLt built here (a library named
libcublasLt.so.13 under ``nvidia/cu13/lib`` of a sys.path entry, as PyPI's CUDA wheels
install it, whose functions count their calls), and with the real one where the CUDA
build is installed.  Each scenario starts its own interpreters, so it runs in a fresh
process, with a timeout.
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from multipy import _cuda

HANG = 90

pytestmark = [pytest.mark.timeout(HANG + 30),
              pytest.mark.skipif(importlib.util.find_spec("multipy._cublaslt_forward") is None,
                                 reason="the forwarders are built on x86-64 only")]

FAKE_CUBLASLT = r"""
#include <stddef.h>
static size_t calls;
size_t cublasLtGetVersion(void) { return __atomic_add_fetch(&calls, 1, __ATOMIC_SEQ_CST); }
size_t cublasLtGetCudartVersion(void) { return 13000; }
"""

#: A library that needs libcublasLt.so.13 (with its symbol version), as libcublas does.
CONSUMER = r"""
#include <stddef.h>
size_t cublasLtGetVersion(void);
size_t consumer_version(void) { return cublasLtGetVersion(); }
"""

VERSIONS = "libcublasLt.so.13 { global: *; };\n"

#: Starts two interpreters; each opens the library by its path (as torch does), then the
#: consumer that needs it by soname; the host opens it last.  Prints what each saw.
SCENARIO = """
import ctypes, json, os, sys
sys.path.insert(0, {root!r})
import multipy
from multipy import _cuda

PATH = {path!r}
INSIDE = '''
import ctypes, os

def probe(path, consumer):
    try:
        ctypes.CDLL(path, mode=os.RTLD_NOLOAD)
        loaded_before = True
    except OSError:
        loaded_before = False
    library = ctypes.CDLL(path)
    return {{"loaded_before": loaded_before, "version": library.cublasLtGetVersion(),
            "cudart": library.cublasLtGetCudartVersion(),
            "missing": library.cublasLtMatmul() if hasattr(library, "cublasLtMatmul") else None,
            "again": ctypes.CDLL(path, mode=os.RTLD_NOLOAD)._handle == library._handle,
            "consumer": ctypes.CDLL(consumer).consumer_version()}}
'''
with multipy.InterpreterManager(2) as manager:
    manager.register_module_source("forward_probe", INSIDE)
    seen = [i.global_("forward_probe", "probe")(PATH, {consumer!r}).deref()
            for i in manager.all_instances()]
    copies = sum(1 for line in open("/proc/self/maps")
                 if line.split()[-1] == os.path.realpath(PATH) and int(line.split()[2], 16) == 0)
print("RESULT", json.dumps({{"seen": seen, "copies": copies,
                             "forwarded": _cuda.forwarded_libraries(),
                             "host": ctypes.CDLL(PATH).cublasLtGetVersion()}}))
"""


def _build(directory: Path, source: str, output: str, *arguments: str) -> None:
    (directory / "source.c").write_text(source)
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(directory / output),
                    str(directory / "source.c"), *arguments],
                   check=True, capture_output=True, timeout=60)


def _fake(root: Path, extra: str = "") -> dict[str, str]:
    """A fake cuBLASLt under root/nvidia/cu13/lib (with extra C appended), and a consumer
    linked against it; their paths."""
    if shutil.which("gcc") is None:
        pytest.skip("gcc is needed to build the fake cuBLASLt")
    lib = root / "nvidia" / "cu13" / "lib"
    lib.mkdir(parents=True)
    (lib / "versions.map").write_text(VERSIONS)
    _build(lib, FAKE_CUBLASLT + extra, "libcublasLt.so.13", "-Wl,-soname,libcublasLt.so.13",
           f"-Wl,--version-script={lib / 'versions.map'}")
    _build(root, CONSUMER, "libconsumer.so", f"-L{lib}", "-l:libcublasLt.so.13",
           f"-Wl,-rpath,{lib}")
    return {"root": str(root), "path": str(lib / "libcublasLt.so.13"),
            "consumer": str(root / "libconsumer.so")}


def _result(completed: subprocess.CompletedProcess) -> dict:
    assert completed.returncode == 0, completed.stderr
    line = next(text for text in completed.stdout.splitlines() if text.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


def test_every_interpreter_reaches_the_one_copy_in_the_host(python, tmp_path):
    fake = _fake(tmp_path)
    result = _result(python(SCENARIO.format(**fake), timeout=HANG))
    assert os.path.realpath(fake["path"]) in [library for library, _ in result["forwarded"]]
    assert result["copies"] == 1  # the host's, loaded when the first interpreter asked
    for calls, seen in zip(((1, 2), (3, 4)), result["seen"]):
        assert not seen["loaded_before"]
        assert seen["again"]  # once opened, it is the forwarder that is loaded there
        # The calls by path and through the consumer's dependency count in the one copy.
        assert (seen["version"], seen["consumer"]) == calls
        assert seen["cudart"] == 13000
        assert seen["missing"] == 15  # CUBLAS_STATUS_NOT_SUPPORTED: the fake has no Matmul
    assert result["host"] == 5


@pytest.mark.parametrize("extra, env", [
    ("int cublasLtFromALaterRelease(void) { return 0; }", {}),  # the forwarder lacks it
    ("int cublasLtData = 1;", {}),  # data: a forwarder forwards functions only
    ("", {"MULTIPY_FORWARD_LIBRARIES": "0"})], ids=["function", "data", "turned off"])
def test_otherwise_each_interpreter_loads_its_own_copy(python, tmp_path, extra, env):
    fake = _fake(tmp_path, extra + "\n")
    result = _result(python(SCENARIO.format(**fake), timeout=HANG, env=env))
    assert os.path.realpath(fake["path"]) not in [library for library, _ in result["forwarded"]]
    assert result["copies"] == 2  # one in each interpreter; the host had none yet
    for seen in result["seen"]:
        assert (seen["version"], seen["consumer"], seen["missing"]) == (1, 2, None)
    assert result["host"] == 1


def test_exported_symbols_are_the_dynamic_symbol_tables_defined_names(tmp_path):
    fake = _fake(tmp_path, "static int hidden(void) { return 0; }\nint data = 1;\n")
    # Not hidden, not the version's own name (absolute), not what it needs from libc.
    assert _cuda.exported_symbols(fake["path"]) == {"cublasLtGetVersion",
                                                     "cublasLtGetCudartVersion", "data"}
    assert _cuda.exported_symbols(fake["consumer"]) == {"consumer_version"}
    (tmp_path / "text.so").write_text("not a library")
    assert _cuda.exported_symbols(str(tmp_path / "text.so")) == frozenset()


REAL = [library for library, _ in _cuda.forwarded_libraries()]


@pytest.mark.skipif(not REAL, reason="PyPI's CUDA build of torch (with cuBLASLt 13) is not installed")
def test_interpreters_importing_the_cuda_build_share_one_copy_of_each(python):
    assert {os.path.basename(library) for library in REAL} == set(_cuda.FORWARDERS)
    result = _result(python(f"""
        import json, os
        import multipy
        INSIDE = '''
        def load():
            import torch
            return torch.nn.Linear(4, 2)(torch.ones(3, 4)).shape == (3, 2)
        '''
        with multipy.InterpreterManager(2) as manager:
            manager.register_module_source("torch_probe", INSIDE)
            ran = [i.global_("torch_probe", "load")().deref() for i in manager.all_instances()]
            copies = {{library: 0 for library in {REAL!r}}}
            for line in open("/proc/self/maps"):
                if line.split()[-1] in copies and int(line.split()[2], 16) == 0:
                    copies[line.split()[-1]] += 1
        print("RESULT", json.dumps({{"ran": ran, "copies": copies}}))
    """, timeout=HANG * 2))
    assert result == {"ran": [True, True], "copies": {library: 1 for library in REAL}}


@pytest.mark.skipif(not REAL, reason="PyPI's CUDA build of torch (with cuBLASLt 13) is not installed")
@pytest.mark.parametrize("variable, said", [
    ("1", "costs about 171 MiB of private memory with this CUDA build of torch; "
          "libcublasLt.so.13, libnvJitLink.so.13, libnvrtc.so.13 kept once per process"),
    ("0", "costs about 273 MiB of private memory with this CUDA build of torch; each "
          "interpreter loads its own CUDA libraries")])
def test_info_estimates_an_interpreter_by_whether_cuda_libraries_are_kept_once(variable, said):
    completed = subprocess.run([sys.executable, "-m", "multipy", "info"], capture_output=True,
                               text=True, timeout=HANG,
                               env={**os.environ, "MULTIPY_FORWARD_LIBRARIES": variable})
    assert completed.returncode == 0, completed.stderr
    assert said in completed.stdout
