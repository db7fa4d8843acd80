"""multipy on Ray Serve: examples/ray_serve.py (2 replicas x 2 interpreters, 100
concurrent requests checked against the eager model), and `multipy serve --ray` started,
asked once and stopped with SIGTERM.

Each run starts a local Ray of its own in a subprocess, with RAY_TMPDIR set to a
directory made for it: every process of that Ray inherits it, which is how the tests
find the processes they started, check that Ray was shut down, and kill what is left if
not.  Slow (a Ray starts, and replicas load torch): marked ``slow``, run by default.
"""
from __future__ import annotations

import http.client
import json
import importlib.util
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest

from conftest import export, free_port

torch = pytest.importorskip("torch")
np = pytest.importorskip("numpy")
for _module in ("ray", "uvicorn", "starlette", "prometheus_client"):
    pytest.importorskip(_module)
httpclient = pytest.importorskip("tritonclient.http")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "ray_serve.py")


@pytest.fixture
def ray_dir():
    """A RAY_TMPDIR for one test's Ray (short: Ray's socket paths live under it); the
    processes that inherited it are killed at the end if they outlived the test."""
    directory = tempfile.mkdtemp(prefix="mpray", dir="/tmp")
    try:
        yield directory
    finally:
        for pid in _processes_of(directory):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        shutil.rmtree(directory, ignore_errors=True)


def _processes_of(directory: str) -> list[int]:
    """The live processes of the Ray under directory: started with RAY_TMPDIR=directory
    in their environment, or holding a file under it open (Ray's workers retitle
    themselves, which can hide their environment, but write their logs there)."""
    marker = f"RAY_TMPDIR={directory}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    continue  # a zombie: already ended
            with open(f"/proc/{entry}/environ", "rb") as f:
                ours = marker in f.read().split(b"\0")
            if not ours:
                for fd in os.listdir(f"/proc/{entry}/fd"):
                    if os.readlink(f"/proc/{entry}/fd/{fd}").startswith(directory + "/"):
                        ours = True
                        break
        except OSError:  # gone, or not ours
            continue
        if ours:
            found.append(int(entry))
    return found


def _assert_ray_gone(directory: str, seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while _processes_of(directory):
        assert time.monotonic() < deadline, \
            f"Ray's processes outlived their driver: {_processes_of(directory)}"
        time.sleep(0.5)


def _env(directory: str) -> dict[str, str]:
    return {**{k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "RAY_ADDRESS")},
            "RAY_TMPDIR": directory, "RAY_USAGE_STATS_ENABLED": "0", "PYTHONUNBUFFERED": "1"}


def _kill(process: subprocess.Popen) -> None:
    if process.poll() is None:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    process.wait(timeout=60)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_example_answers_100_concurrent_requests_through_ray_serve(ray_dir, tmp_path):
    log = tmp_path / "stderr.log"
    with open(log, "w") as err:
        process = subprocess.Popen([sys.executable, EXAMPLE], stdout=subprocess.PIPE,
                                   stderr=err, text=True, env=_env(ray_dir),
                                   start_new_session=True)
        try:
            out, _ = process.communicate(timeout=840)
        finally:
            _kill(process)
    stderr = log.read_text()
    assert process.returncode == 0, out + stderr[-5000:]
    lines = out.strip().splitlines()
    assert lines[-1] == "ray-serve ok: 100/100 correct", out
    replicas = [line for line in lines if line.startswith("replica pid ")]
    assert len(replicas) == 2 and len({line.split(":")[0] for line in replicas}) == 2, out
    for line in replicas:  # the tunables reached each replica process at exec time
        assert "2 interpreters" in line, line
        assert ("GLIBC_TUNABLES glibc.rtld.nns=16:glibc.rtld.optional_static_tls=16384"
                in line), line
        assert "room for 15 interpreters" in line and "host imported torch: False" in line
    _assert_ray_gone(ray_dir)


@pytest.fixture(scope="module")
def python_heavy(tmp_path_factory):
    spec = importlib.util.spec_from_file_location(
        "generate_examples", os.path.join(ROOT, "examples", "generate_examples.py"))
    generator = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generator)
    return generator.generate(str(tmp_path_factory.mktemp("ray_models")),
                              ["python_heavy"])["python_heavy"]


def _ready(port: int) -> bool:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        connection.request("GET", "/v2/health/ready")
        return connection.getresponse().status == 200
    except OSError:
        return False
    finally:
        connection.close()


def _serve(ray_dir: str, log, path: str | list[str], *options: str,
           env: dict[str, str] | None = None) -> tuple[subprocess.Popen, int]:
    """`multipy serve PATH... --ray OPTIONS` on a free port, once ready (its driver said
    so and the proxy answers ready), its output in log; and the port."""
    port = free_port()
    with open(log, "w") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "multipy", "serve",
             *([path] if isinstance(path, str) else path), "--ray", *options,
             "--port", str(port)],
            stdout=out, stderr=subprocess.STDOUT, env={**_env(ray_dir), **(env or {})},
            start_new_session=True)
    try:
        deadline = time.monotonic() + 400
        while not ("interpreter(s) through Ray Serve" in log.read_text() and _ready(port)):
            assert process.poll() is None, f"it exited:\n{log.read_text()}"
            assert time.monotonic() < deadline, f"not ready:\n{log.read_text()}"
            time.sleep(0.5)
    except BaseException:
        _kill(process)
        raise
    return process, port


def _get(port: int, path: str) -> tuple[int, dict[str, str], bytes]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        connection.request("GET", path)
        response = connection.getresponse()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
    finally:
        connection.close()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_cli_serves_through_ray_and_stops_on_sigterm(ray_dir, tmp_path, python_heavy):
    """An archive and a class that streams, through Ray Serve's proxy: the archive's
    answers are the model's; the stream's pieces come as events (the replica's host
    makes them in one of its interpreters); SIGTERM ends it all."""
    log = tmp_path / "serve.log"
    (tmp_path / "counting.py").write_text(
        "import asyncio\n"
        "class Counting:\n"
        "    async def predict(self, inputs):  # (each step on a loop of its own, there)\n"
        "        for i in range(int(inputs['n'][0])):\n"
        "            await asyncio.sleep(0)\n"
        "            yield {'token': f't{i}'}\n")
    process, port = _serve(ray_dir, log, [python_heavy, f"{tmp_path}/counting.py:Counting"],
                           "--replicas", "1", "--interpreters", "1")
    try:
        x = np.random.default_rng(1).standard_normal((3, 48, 16), np.float32)
        tensor = httpclient.InferInput("x", [3, 48, 16], "FP32")
        tensor.set_data_from_numpy(x)
        client = httpclient.InferenceServerClient(f"127.0.0.1:{port}", network_timeout=120)
        result = client.infer("python_heavy", [tensor])
        model = torch.package.PackageImporter(python_heavy).load_pickle("model", "model.pkl")
        with torch.no_grad():
            expected = model(torch.from_numpy(x)).numpy()
        np.testing.assert_allclose(result.as_numpy("output0"), expected, rtol=1e-5, atol=1e-6)
        # Ray Serve's proxy answered (it adds a request id), not a server of multipy's own
        status, headers, body = _get(port, "/v2/models/python_heavy")
        assert status == 200 and headers.get("x-request-id"), headers
        assert b'"name":"python_heavy"' in body
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        try:
            connection.request("POST", "/v2/models/counting/generate_stream", b'{"n": 3}')
            events = connection.getresponse().read().decode().split("\n\n")
        finally:
            connection.close()
        assert [json.loads(event[len("data: "):])["token"] for event in events if event] == \
            ["t0", "t1", "t2"]
        text = log.read_text()
        assert "1 interpreter(s), room for 15, has_room True" in text, text
        replica = int(re.search(r"INFO: +replica pid (\d+) ", text).group(1))
        assert replica in _processes_of(ray_dir)  # seen: so is its end, below
        with open(f"/proc/{process.pid}/maps") as f:  # the driver, as the host: no torch
            assert "libtorch" not in f.read()
        with open(f"/proc/{replica}/maps") as f:  # its interpreter has torch
            assert "libtorch" in f.read()
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=180) == 0, log.read_text()
    finally:
        _kill(process)
    assert "stopping: deleting the deployment and Ray" in log.read_text()
    _assert_ray_gone(ray_dir)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_cli_deploys_on_a_running_cluster_and_leaves_it_running(ray_dir, tmp_path,
                                                                 python_heavy):
    """--ray-address auto: the Ray that `ray start --head` runs (found through
    RAY_TMPDIR); SIGTERM deletes the application only."""
    env = {**_env(ray_dir), "RAY_AUTH_MODE": "disabled"}  # Ray's token auth: not the point
    ray = os.path.join(os.path.dirname(sys.executable), "ray")
    started = subprocess.run([ray, "start", "--head", "--port", "0", "--num-cpus", "2",
                              "--include-dashboard=false", "--disable-usage-stats"],
                             capture_output=True, text=True, env=env, timeout=180)
    assert started.returncode == 0, started.stdout + started.stderr
    log = tmp_path / "serve.log"
    process, port = _serve(ray_dir, log, python_heavy, "--ray-address", "auto",
                           "--interpreters", "1", env={"RAY_AUTH_MODE": "disabled"})
    try:
        assert _get(port, "/v2/models/python_heavy")[0] == 200
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=180) == 0, log.read_text()
    finally:
        _kill(process)
    assert "stopping: deleting the deployment\n" in log.read_text()
    applications = subprocess.run(
        [sys.executable, "-c", "import ray; from ray import serve; ray.init(address='auto'); "
                               "print(sorted(serve.status().applications))"],
        capture_output=True, text=True, env=env, timeout=180)
    assert applications.returncode == 0, applications.stderr  # the cluster still runs
    assert applications.stdout.strip().splitlines()[-1] == "[]", applications.stdout


BROKEN = '''
import torch


class Broken(torch.nn.Module):
    def forward(self, x):
        raise ValueError("broken on purpose")
'''


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_cli_exits_1_when_the_replicas_cannot_load(ray_dir, tmp_path):
    """The model fails its warm-up in every replica: Ray gives up on the deployment, the
    model's error is in the log, and everything is taken down."""
    path = export(tmp_path, "broken_model", BROKEN, lambda module: module.Broken(),
                  "broken.pt", example=(torch.ones(2, 3),))
    log = tmp_path / "serve.log"
    with open(log, "w") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "multipy", "serve", path, "--ray", "--interpreters", "1",
             "--port", str(free_port())],
            stdout=out, stderr=subprocess.STDOUT, env=_env(ray_dir), start_new_session=True)
    try:
        assert process.wait(timeout=500) == 1, log.read_text()
    finally:
        _kill(process)
    text = log.read_text()
    assert "serving on Ray failed" in text and "broken on purpose" in text, text
    _assert_ray_gone(ray_dir)


def test_ray_options_belong_to_ray(tmp_path, python_heavy):
    for option in (["--replicas", "2"], ["--ray-address", "auto"], ["--replica-cpus", "1"]):
        result = subprocess.run([sys.executable, "-m", "multipy", "serve", python_heavy,
                                 *option], capture_output=True, text=True, timeout=120)
        assert result.returncode == 2 and "is an option of --ray" in result.stderr, result.stderr
    result = subprocess.run([sys.executable, "-m", "multipy", "serve", python_heavy, "--ray",
                             "--replicas", "0"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "--replicas must be at least 1" in result.stderr
    result = subprocess.run([sys.executable, "-m", "multipy", "serve", "--help"],
                            capture_output=True, text=True, timeout=120)
    for option in ("--ray", "--replicas", "--replica-cpus", "--ray-address"):
        assert option in result.stdout


def test_ray_says_which_extra_to_install(python, python_heavy):
    result = python(f"""
        import importlib.util
        real = importlib.util.find_spec
        importlib.util.find_spec = lambda name, *a: None if name == "ray" else real(name, *a)
        from multipy.serve.main import main
        main([{python_heavy!r}, "--ray"])
    """, launcher=True, timeout=120)
    assert result.returncode == 1, result.stderr
    assert "pip install 'multipy-interpreters[ray]'" in result.stderr and "Traceback" not in result.stderr
