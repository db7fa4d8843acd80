"""multipy's C++ API (multipy/cpp, docs/cpp.md): examples/cpp built with CMake against
this installation (find_package(multipy) through `multipy cmake-prefix`), then run.

Skipped where torch, cmake or a C++ compiler is missing.  The build (the library's one
translation unit and the three examples) takes about two minutes; MULTIPY_CPP_BUILD_DIR
names a build folder to keep between runs instead of a temporary one.
"""
from __future__ import annotations

import glob
import importlib.util
import os
import shutil
import subprocess
import sys

import pytest

from multipy._launch import LAUNCH_TUNABLES

torch = pytest.importorskip("torch")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")
BUILD_SECONDS = 900
RUN_SECONDS = 180

pytestmark = [
    pytest.mark.skipif(shutil.which("cmake") is None, reason="cmake is not installed"),
    pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None,
                       reason="no C++ compiler (c++ or g++)"),
    pytest.mark.timeout(BUILD_SECONDS + RUN_SECONDS),  # the first test pays for the build
]


def _cmake_prefix() -> str:
    return subprocess.run([sys.executable, "-m", "multipy", "cmake-prefix"], check=True,
                          capture_output=True, text=True, timeout=60).stdout.strip()


def _cuda_hints() -> list[str]:
    """What torch's CMake config needs for a CUDA build of torch (PyPI's default): the
    CUDA toolkit (skipped without one) and NVRTC, taken from the NVIDIA wheels beside
    torch (docs/cpp.md)."""
    spec = importlib.util.find_spec("torch")
    torch_dir = list(spec.submodule_search_locations)[0]
    if not glob.glob(os.path.join(torch_dir, "lib", "libtorch_cuda.so")):
        return []
    root = os.environ.get("CUDA_PATH", "/usr/local/cuda")
    if not os.path.isfile(os.path.join(root, "include", "cuda_runtime.h")):
        pytest.skip("a CUDA build of torch: find_package(Torch) needs the CUDA toolkit, "
                    f"not found at {root} (set CUDA_PATH)")
    hints = [f"-DCUDA_TOOLKIT_ROOT_DIR={root}"]
    nvrtc = glob.glob(os.path.join(torch_dir, "..", "nvidia", "*", "lib", "libnvrtc.so.*"))
    nvrtc = [path for path in nvrtc if "builtins" not in path and ".alt." not in path]
    if nvrtc:
        hints.append(f"-DCUDA_nvrtc_LIBRARY={os.path.realpath(nvrtc[0])}")
    return hints


@pytest.fixture(scope="session")
def built(tmp_path_factory):
    """The folder where examples/cpp is built (configure + build, once per session)."""
    build = os.environ.get("MULTIPY_CPP_BUILD_DIR") or str(tmp_path_factory.mktemp("cpp"))
    configure = ["cmake", "-S", os.path.join(EXAMPLES, "cpp"), "-B", build,
                 f"-DCMAKE_PREFIX_PATH={_cmake_prefix()}", "-DCMAKE_BUILD_TYPE=Release",
                 "-DCMAKE_CXX_FLAGS_RELEASE=-O1", *_cuda_hints()]
    for command in (configure, ["cmake", "--build", build, "-j", "2"]):
        done = subprocess.run(command, capture_output=True, text=True, timeout=BUILD_SECONDS)
        assert done.returncode == 0, (f"{' '.join(command)} failed:\n"
                                      f"{done.stdout[-6000:]}\n{done.stderr[-6000:]}")
    return build


@pytest.fixture(scope="session")
def packages(tmp_path_factory):
    spec = importlib.util.spec_from_file_location(
        "generate_examples", os.path.join(EXAMPLES, "generate_examples.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.generate(str(tmp_path_factory.mktemp("cpp_examples")),
                           ["simple", "python_heavy"])


def run(built: str, program: str, *args: str) -> subprocess.CompletedProcess:
    """A C++ example, started with room for the interpreters (as docs/cpp.md says)."""
    env = {**os.environ, "GLIBC_TUNABLES": LAUNCH_TUNABLES}
    env.pop("PATH_TO_EXTERN_PYTHON_PACKAGES", None)
    return subprocess.run([os.path.join(built, program), *args], capture_output=True,
                          text=True, timeout=RUN_SECONDS, env=env)


def test_cmake_prefix_names_multipy_and_torch():
    import torch.utils

    mine, torchs = _cmake_prefix().split(";")
    assert os.path.isfile(os.path.join(mine, "multipyConfig.cmake"))
    assert os.path.isfile(os.path.join(mine, "include", "multipy", "runtime", "deploy.h"))
    assert os.path.samefile(torchs, torch.utils.cmake_prefix_path)


def test_example_app_loads_a_package(built, packages):
    done = run(built, "example-app", packages["simple"])
    assert done.returncode == 0, done.stderr
    assert done.stdout == "ok\n"


def test_a_bad_path_is_a_c10_error_the_program_catches(built, tmp_path):
    missing = str(tmp_path / "no_such_package.pt")
    done = run(built, "example-app", missing)
    assert done.returncode == 255, (done.stdout, done.stderr)  # main returned -1
    assert done.stderr.startswith("error loading the model\n")
    assert f"FileNotFoundError: no package file at {missing}" in done.stderr
    assert "Traceback" in done.stderr  # the Python traceback comes with the message


def _values(stdout: str) -> torch.Tensor:
    lines = dict(line.split(":", 1) for line in stdout.splitlines() if line[:6] in ("shape:", "values"))
    shape = [int(size) for size in lines["shape"].split()]
    return torch.tensor([float(value) for value in lines["values"].split()],
                        dtype=torch.float64).reshape(shape)


def test_forward_from_cpp_equals_python(built, packages):
    done = run(built, "example-forward", packages["simple"], "--interpreters", "2")
    assert done.returncode == 0, done.stderr
    importer = torch.package.PackageImporter(packages["simple"])
    model = importer.load_pickle("model", "model.pkl")
    example = importer.load_pickle("model", "example.pkl")
    with torch.no_grad():
        expected = model(*example).double()
    got = _values(done.stdout)
    assert got.shape == expected.shape
    assert torch.allclose(got, expected, rtol=1e-5, atol=1e-5), (got, expected)


def test_many_cpp_threads_on_one_replicated_obj(built, packages):
    # 6 threads, each with its own input, on 2 interpreters: every answer is checked
    # against a serial call of the same input (the program exits 1 on any wrong one).
    done = run(built, "example-forward", packages["simple"], "--interpreters", "2",
               "--threads", "6", "--calls", "30")
    assert done.returncode == 0, (done.stdout, done.stderr)
    assert "threads 6 calls 180 wrong 0 failed 0\nthreads ok\n" in done.stdout


def test_an_error_inside_the_model_is_a_c10_error(built, tmp_path, monkeypatch):
    # A package whose model raises: the forward example catches c10::Error (exit 2) and
    # prints the Python exception with the traceback from inside the interpreter.
    (tmp_path / "cpp_raising_model.py").write_text(
        "import torch\n\n\n"
        "class Raising(torch.nn.Module):\n"
        "    def forward(self, x):\n"
        "        raise ValueError(f'no thanks: {tuple(x.shape)}')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import cpp_raising_model

    path = str(tmp_path / "raises.pt")
    with torch.package.PackageExporter(path) as exporter:
        exporter.extern(["torch.**"])
        exporter.intern("cpp_raising_model")
        exporter.save_pickle("model", "model.pkl", cpp_raising_model.Raising())
        exporter.save_pickle("model", "example.pkl", (torch.ones(2, 3),))
    done = run(built, "example-forward", path, "--interpreters", "1")
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert done.stderr.startswith("error running the model\n")
    assert "ValueError: no thanks: (2, 3)" in done.stderr
    assert "raised inside an interpreter" in done.stderr


def test_the_session_api(built, packages):
    # example-session checks sessions, Obj (call, callKwargs, attr, hasattr, toIValue),
    # values both ways, tensors lent not copied (the same data_ptr inside and back),
    # createMovable/fromMovable, registerModuleSource, loadText/loadBinary,
    # ReplicatedObj::callKwargs/hasattr/acquireSession and an import error as c10::Error.
    done = run(built, "example-session", packages["simple"])
    assert done.returncode == 0, (done.stdout, done.stderr)
    assert "FAIL" not in done.stdout
    assert done.stdout.endswith("session api ok\n")


def test_the_benchmark_flag_runs(built, packages):
    # Only that it runs and reports: its figures depend on the machine (docs/cpp.md).
    done = run(built, "example-forward", packages["python_heavy"], "--interpreters", "2",
               "--bench", "1")
    assert done.returncode == 0, (done.stdout, done.stderr)
    line = done.stdout.splitlines()[-1]
    assert line.startswith("bench: 2 interpreters, best of 5 rounds") and "ratio" in line, line
