"""Load benchmark: 2N concurrent Open Inference Protocol clients (each a process of its
own) against `multipy serve` with N interpreters and against its peers (--peers), the
same model behind: KServe's own Python model server (kserve.ModelServer,
benchmarks/kserve_model.py) with N worker processes, each holding its own copy of the
model; and the floor of a process server (benchmarks/floor_app.py: a Starlette app under
`uvicorn --workers N`, each worker calling its own copy of the model inline, answering
the protocol's JSON form with no checks).  For each example model named (by default a
small one, the Python-heavy one and the text classifier, whose input is text: BYTES)
and each transport: HTTP (tritonclient.http, binary tensors, its default), gRPC
(tritonclient.grpc; `multipy serve --grpc-port`, KServe's gRPC server, which KServe 0.21
runs in its parent process alone, whatever the workers) and JSON (one keep-alive
http.client connection per client POSTing the protocol's JSON form, BYTES as strings,
Content-Type application/json); ``json-new`` is the same with a new connection per request.
``wrk`` and ``wrk-new`` send the same JSON through wrk, a load generator in C (Debian's
and most distributions' package ``wrk``), keep-alive or with ``Connection: close`` on each
request: the Python clients take about as much CPU per request as a server does, so on a
small machine they bound every server's figures alike, where wrk takes a tenth of that.
Each server is measured over the transports it speaks (the floor: JSON only).  Prints
requests/s, p50 and p99 latency, the memory (PSS) of each server's whole process tree,
and the cores each server (and the clients) kept busy while timed, measured in one run,
and the ratios multipy / each peer (requests/s and memory); every answer is checked
against the model run eagerly here.  Each server started serves every transport asked
for, measured one after the other.  With --rounds R each server runs R times, the servers
taking turns (who goes first rotates, and which transport goes first alternates), and
the figures are the medians: a busy spell on a shared machine then skews one round, not
the ratio.

KServe 0.21 pins protobuf<7 and psutil<6, so that peer gets a virtual environment of its
own, made here on first use (--peer-venv): kserve==0.21.0, torch==2.13.0, numpy==2.4.6
and tokenizers==0.23.3 (the text classifier's).  The tritonclient.http clients send
binary tensors: KServe's server rejects tritonclient's JSON requests, which carry no
Content-Type ("received byte inputs, but the 'inference-header-content-length' header
is missing"); the JSON clients say application/json.  The floor runs in this Python,
with torch's intra-op threads as multipy's default for N (--peers floor needs no
KServe).

With --device cuda every server runs the model on the GPU (multipy serve --device cuda:
its weights on the device once; each peer's worker its own copy), and the tables add the
device memory in use while each server ran, less what was in use before it started
(nvidia-smi).

    multipy run benchmarks/serve_load.py [--counts 2,4] [--clients 2] [--seconds 10] [--rounds 3]
        [--models simple,python_heavy,text_classifier] [--transports http,grpc,json]
        [--peers kserve,floor | --peers none | --no-peer] [--peer-python PYTHON] [--json FILE]
        [--device cuda] [--plot FILE.png]
    multipy run benchmarks/serve_load.py --replot FILE.json --plot FILE.png

--json keeps the figures with the machine, the date and the commit, written again after
each model and N, so that a run stopped part-way keeps what it measured; --plot draws, for
each model, requests/s, p50 and p99 latency and memory (and on a GPU the device memory)
against N, a line per server and transport, with the setting, the machine (and GPU), the
date and the commit in its title.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

from provenance import provenance, run_line

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
PEER_PACKAGES = ["kserve==0.21.0", "torch==2.13.0", "numpy==2.4.6", "tokenizers==0.23.3"]
TRANSPORTS = ("http", "grpc", "json", "json-new", "wrk", "wrk-new")
#: each transport's clients, as the tables name them
CLIENTS = {"http": "tritonclient.http, binary", "grpc": "tritonclient.grpc",
           "json": "http.client, keep-alive, the protocol's JSON form",
           "json-new": "http.client, a new connection per request, the protocol's JSON form",
           "wrk": "wrk, keep-alive, the protocol's JSON form",
           "wrk-new": "wrk, Connection: close on each request, the protocol's JSON form",
           "litserve": "http.client, keep-alive, LitServe's JSON body"}
#: the servers measured beside `multipy serve --interpreters N`: peers, and multipy's own
#: --processes N --interpreters 1 ("processes")
PEERS = ("kserve", "floor", "processes")
#: the transports each server speaks: it is measured over those of --transports only
SPEAKS = {"multipy": TRANSPORTS, "kserve": TRANSPORTS,
          "floor": ("json", "json-new", "wrk", "wrk-new"),
          "processes": TRANSPORTS}
LABELS = {"multipy": "multipy serve, {n} interp.", "kserve": "kserve.ModelServer, {n} workers",
          "floor": "floor (uvicorn), {n} workers",
          "processes": "multipy, {n} proc. x 1 interp."}
NAMES = {"multipy": "multipy", "kserve": "KServe", "floor": "the floor",
         "processes": "multipy --processes"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ensure_peer_venv(path: str, packages: tuple = tuple(PEER_PACKAGES),
                     modules: str = "kserve, torch, tokenizers") -> str:
    """The python of a virtual environment at path that has packages (by default
    KServe's, and tokenizers), that is, that imports modules; made, or completed, if
    missing."""
    python = os.path.join(path, "bin", "python")
    check = [python, "-c", f"import {modules}"]
    if os.path.exists(python) and subprocess.run(check, capture_output=True).returncode == 0:
        return python
    print(f"making an environment in {path}: {' '.join(packages)} (minutes)", flush=True)
    if not os.path.exists(python):
        subprocess.run([sys.executable, "-m", "venv", path], check=True)
    subprocess.run([python, "-m", "pip", "install", "--quiet", *packages], check=True)
    return python


def _tree(pid: int) -> list[int]:
    """pid and all its descendants."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parent = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(parent, []).append(int(entry))
    found, pending = [], [pid]
    while pending:
        each = pending.pop()
        found.append(each)
        pending += children.get(each, [])
    return found


def cpu_seconds(pid: int) -> dict[int, float]:
    """CPU seconds (user and system) used so far by pid and each of its descendants."""
    ticks = os.sysconf("SC_CLK_TCK")
    used = {}
    for each in _tree(pid):
        try:
            with open(f"/proc/{each}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            used[each] = (int(fields[11]) + int(fields[12])) / ticks
        except (OSError, ValueError, IndexError):
            pass
    return used


def pss_tree(pid: int) -> int:
    """The PSS of pid and all its descendants, in bytes."""
    total = 0
    for each in _tree(pid):
        try:
            with open(f"/proc/{each}/smaps_rollup") as f:
                total += next(int(line.split()[1]) for line in f if line.startswith("Pss:")) * 1024
        except (OSError, StopIteration):
            pass
    return total


def _gpu(query: str) -> str:
    """nvidia-smi's answer to --query-gpu=query for GPU 0."""
    return subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader,nounits",
                           "--id=0"], capture_output=True, text=True, check=True,
                          timeout=60).stdout.strip()


def device_memory_mib() -> float:
    """The memory in use on GPU 0, as nvidia-smi reports it, in MiB."""
    return float(_gpu("memory.used"))


def _wait_ready(port: int, process: subprocess.Popen, grpc_port: int | None = None,
                seconds: float = 300, path: str = "/v2/health/ready") -> None:
    """Returns once the server on port answers path (GET) with 200 and, with
    grpc_port, accepts connections there too."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode} before it was ready")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=2) as r:
                if r.status == 200:
                    if grpc_port is not None:
                        socket.create_connection(("127.0.0.1", grpc_port), timeout=2).close()
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.5)
    raise TimeoutError(f"the server on port {port} was not ready after {seconds} s")


def _stop(process: subprocess.Popen) -> None:
    """SIGTERM to the server's whole process group (KServe's workers too), then SIGKILL."""
    try:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(60)
    except subprocess.TimeoutExpired:
        pass
    except ProcessLookupError:
        return
    try:
        os.killpg(process.pid, signal.SIGKILL)  # workers that outlived their parent
    except ProcessLookupError:
        pass
    process.wait()


def load(port: int, transport: str, model: str, clients: int, seconds: float, warm_up: float,
         inputs, expected, probe=None):
    """clients client processes (each one connection over transport, one of TRANSPORTS,
    one request at a time) sending inferences for warm_up + seconds; the timed part's
    requests/s, latencies,
    and the count of wrong or failed answers, and (with probe) probe()'s values as the
    timed part begins and ends, as "probed".  Processes, not threads: the clients' own
    Python (one GIL) must not be what limits the servers.  For "wrk" and "wrk-new", one
    wrk process with clients connections instead (``_wrk``)."""
    if transport.startswith("wrk"):
        return _wrk(port, model, clients, seconds, warm_up, inputs, expected, probe,
                    keep_alive=transport == "wrk")
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    start = context.Barrier(clients + 1)
    results = context.Queue()
    processes = [context.Process(target=_client, args=(port, transport, model, seconds, warm_up,
                                                       inputs, expected, start, results))
                 for _ in range(clients)]
    for process in processes:
        process.start()
    try:
        start.wait(timeout=300)
        begun = time.perf_counter()
        probed = [probe()] if probe is not None else []
        clients_before = sum(sum(cpu_seconds(p.pid).values()) for p in processes)
        answers = [results.get(timeout=seconds + 300) for _ in processes]
        elapsed = time.perf_counter() - begun
        probed += [probe()] if probe is not None else []
        clients_used = sum(sum(cpu_seconds(p.pid).values()) for p in processes) - clients_before
    finally:
        for process in processes:
            process.join(timeout=60)
            if process.is_alive():
                process.kill()
    every = sorted(x for latencies, _ in answers for x in latencies)
    return {"requests_per_second": len(every) / max(elapsed, seconds),
            "p50_ms": statistics.median(every) * 1e3,
            "p99_ms": every[min(len(every) - 1, int(len(every) * 0.99))] * 1e3,
            "requests": len(every), "wrong": sum(wrong for _, wrong in answers),
            "client_cores": clients_used / elapsed,
            **({"probed": probed} if probe is not None else {})}


def _wrk(port: int, model: str, clients: int, seconds: float, warm_up: float, inputs,
         expected, probe=None, keep_alive: bool = True) -> dict:
    """load() through wrk (a load generator in C, one thread, epoll): clients
    connections, each POSTing the protocol's JSON form of inputs, one request at a time,
    for warm_up seconds (not counted), then for seconds (each rounded to whole seconds,
    wrk's unit); unless keep_alive, each request says ``Connection: close`` (the server
    closes the connection once it has answered, and wrk opens a new one; wrk's latency
    starts at the request's first write, after the connection is made, where json-new's
    includes the connecting).  Its clients cost a fraction of the Python clients' CPU,
    so that the server, not its clients, is what the figures measure.  wrk reads answers'
    statuses only: "wrong" counts the answers with an error status (400 and above), the
    connections that failed and the answers not received within 60 s (wrk's socket
    errors, timeouts included), and one answer, fetched here over http.client before the
    timed part, is checked against the eager model.  Needs wrk on PATH."""
    right, close = _checked_connection(port, "json" if keep_alive else "json-new", model,
                                       inputs, expected)
    try:
        checked = right()
    finally:
        close()
    body = json.dumps(_json_body(inputs))
    with tempfile.NamedTemporaryFile("w", suffix=".lua") as script:
        script.write(f"wrk.method = \"POST\"\nwrk.body = {json.dumps(body)}\n"
                     "wrk.headers[\"Content-Type\"] = \"application/json\"\n"
                     + ("" if keep_alive else "wrk.headers[\"Connection\"] = \"close\"\n"))
        script.flush()

        def run(duration: float) -> tuple[str, float, float]:
            """wrk's report, its CPU seconds and the seconds it ran."""
            command = ["wrk", "-t1", f"-c{clients}", f"-d{max(1, round(duration))}s",
                       "--timeout", "60s", "--latency", "-s", script.name,
                       f"http://127.0.0.1:{port}/v2/models/{model}/infer"]
            before = resource.getrusage(resource.RUSAGE_CHILDREN)
            begun = time.perf_counter()
            done = subprocess.run(command, capture_output=True, text=True)
            ran = time.perf_counter() - begun
            after = resource.getrusage(resource.RUSAGE_CHILDREN)  # (wrk is the one reaped)
            if done.returncode != 0:
                raise RuntimeError(f"wrk failed ({done.returncode}): "
                                   f"{(done.stdout + done.stderr)[-500:]}")
            used = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
            return done.stdout, used, ran

        if warm_up > 0:
            run(warm_up)
        probed = [probe()] if probe is not None else []
        out, used, ran = run(seconds)
        probed += [probe()] if probe is not None else []
    figures = _wrk_figures(out)
    figures["wrong"] += 0 if checked else 1
    figures["client_cores"] = used / ran
    return {**figures, **({"probed": probed} if probe is not None else {})}


def _wrk_figures(out: str) -> dict:
    """requests/s, p50 and p99 latency (ms), requests and failures from wrk --latency's
    report."""
    import re

    def ms(text: str) -> float:
        number, unit = re.fullmatch(r"([\d.]+)(us|ms|s|m|h)", text).groups()
        return float(number) * {"us": 1e-3, "ms": 1.0, "s": 1e3, "m": 6e4, "h": 3.6e6}[unit]

    latency = dict(re.findall(r"^\s+(50|99)%\s+(\S+)$", out, re.M))
    requests = int(re.search(r"(\d+) requests in", out).group(1))
    failed = sum(int(n) for n in re.findall(r"(?:connect|read|write|timeout) (\d+)", out))
    bad = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    return {"requests_per_second": float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1)),
            "p50_ms": ms(latency["50"]), "p99_ms": ms(latency["99"]), "requests": requests,
            "wrong": failed + (int(bad.group(1)) if bad else 0)}


def _matches(answer, expected) -> bool:
    """Whether an output as a client gives it equals the eager model's: numbers
    within 1e-4 (relative) or 1e-5, text (BYTES) exactly, str taken as its UTF-8 bytes."""
    import numpy as np

    if answer is None or answer.shape != expected.shape:
        return False
    if expected.dtype == object:
        return [each.encode() if isinstance(each, str) else each
                for each in answer.reshape(-1)] == list(expected.reshape(-1))
    return bool(np.allclose(answer, expected, rtol=1e-4, atol=1e-5))


def _checked_connection(port: int, transport: str, model: str, inputs, expected):
    """_connect()'s connection, whose function sends one inference and says whether its
    answer was right: every output as expected (the arrays of output0, output1, ... or a
    dict of arrays by output name), and no error on the way; and the function that closes
    the connection."""
    if not isinstance(expected, dict):
        expected = {f"output{index}": array for index, array in enumerate(expected)}
    infer, close = _connect(port, transport, model, inputs, list(expected))

    def right() -> bool:
        try:
            return all(_matches(answer, array)
                       for answer, array in zip(infer(), expected.values()))
        except Exception:  # (an answer that fails is a wrong one)
            return False

    return right, close


def _connect(port: int, transport: str, model: str, inputs, names: list[str]):
    """One connection over transport to the server on port: a function that sends one
    inference of inputs ((name, datatype, array) triples) to model and returns its
    outputs named names as numpy arrays, and one that closes the connection.  For
    "litserve", model is the path LitServe serves the API on ("predict")."""
    if transport in ("json", "json-new"):
        return _json_connection(port, model, inputs, names, keep_alive=transport == "json")
    if transport == "litserve":
        return _litserve_connection(port, model, inputs, names)
    if transport == "grpc":
        import tritonclient.grpc as client

        connection = client.InferenceServerClient(f"127.0.0.1:{port}")
        binary, timeout = {}, {"client_timeout": 60}
    else:
        import tritonclient.http as client

        connection = client.InferenceServerClient(f"127.0.0.1:{port}", connection_timeout=60,
                                                  network_timeout=60)
        binary, timeout = {"binary_data": True}, {}
    tensors = []
    for name, datatype, array in inputs:
        tensor = client.InferInput(name, list(array.shape), datatype)
        tensor.set_data_from_numpy(array, **binary)
        tensors.append(tensor)
    outputs = [client.InferRequestedOutput(name, **binary) for name in names]

    def infer() -> list:
        answer = connection.infer(model, tensors, outputs=outputs, **timeout)
        return [answer.as_numpy(name) for name in names]

    return infer, connection.close


def _json_connection(port: int, model: str, inputs, names: list[str], keep_alive: bool = True):
    """_connect() for "json": one keep-alive http.client connection POSTing the
    protocol's JSON form (flat data, BYTES as strings, Content-Type application/json);
    for "json-new" (not keep_alive), a new connection for each request."""
    import numpy as np

    body = _json_body(inputs)

    def outputs(answer: dict) -> list:
        given = {each["name"]: each for each in answer["outputs"]}
        return [np.array(given[name]["data"],
                         dtype=object if given[name]["datatype"] == "BYTES" else None
                         ).reshape(given[name]["shape"]) if name in given else None
                for name in names]

    return _post_json(port, f"/v2/models/{model}/infer", body, outputs, keep_alive)


def _json_body(inputs) -> dict:
    """The protocol's JSON form of an inference of inputs ((name, datatype, array)
    triples): flat data, BYTES as strings."""
    return {"inputs": [
        {"name": name, "shape": list(array.shape), "datatype": datatype,
         "data": ([each.decode() if isinstance(each, bytes) else str(each)
                   for each in array.reshape(-1)] if datatype == "BYTES"
                  else array.reshape(-1).tolist())}
        for name, datatype, array in inputs]}


def _litserve_connection(port: int, path: str, inputs, names: list[str]):
    """_connect() for "litserve": one keep-alive http.client connection POSTing a JSON
    object of each input's values as a list (by its name) to /path, as LitServe's clients
    do; each output is the answer's field of its name."""
    import numpy as np

    body = {name: array.tolist() for name, _, array in inputs}
    return _post_json(port, f"/{path}", body,
                      lambda answer: [np.array(answer[name]) if name in answer else None
                                      for name in names])


def _post_json(port: int, path: str, body: dict, outputs, keep_alive: bool = True):
    """One keep-alive http.client connection (or, unless keep_alive, one per request,
    closed once answered): a function that POSTs body as JSON to path and returns
    outputs(the answer's JSON) (RuntimeError unless the status is 200), and one that
    closes the connection."""
    import http.client

    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    encoded = json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}

    def infer() -> list:
        try:
            connection.request("POST", path, encoded, headers)
            response = connection.getresponse()
            answer = response.read()
        except Exception:
            connection.close()  # the next request opens a new one
            raise
        if not keep_alive:
            connection.close()
        if response.status != 200:
            raise RuntimeError(f"{response.status}: {answer[:200]!r}")
        return outputs(json.loads(answer))

    return infer, connection.close


def _client(port: int, transport: str, model: str, seconds: float, warm_up: float, inputs,
            expected, start, results) -> None:
    """One client process of load(): warms up, waits for the others, then sends
    requests for seconds; puts (latencies, wrong answers) on results.  inputs are
    (name, datatype, array) triples, expected the arrays of output0, output1, ... (or a
    dict of arrays by output name)."""
    right, close = _checked_connection(port, transport, model, inputs, expected)
    wrong = 0

    def one() -> float:
        nonlocal wrong
        begin = time.perf_counter()
        wrong += not right()
        return time.perf_counter() - begin

    until = time.perf_counter() + warm_up
    one()
    while time.perf_counter() < until:
        one()
    start.wait(timeout=300)
    latencies = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        latencies.append(one())
    close()
    results.put((latencies, wrong))


def run_server(command: list[str], ports: dict[str, int], order: tuple, model: str,
               clients: int, seconds: float, warm_up: float, inputs, expected,
               on_gpu: bool = False, ready: str = "/v2/health/ready") -> dict[str, dict]:
    """Starts the server (command), which serves HTTP on ports["http"] (binary and JSON
    alike; and gRPC on ports["grpc"] if "grpc" is in order), waits until it answers
    ready (a path) with 200, and measures load() over
    each transport of order, in turn, with the server's cores and the PSS of its process
    tree as each ends (and, on_gpu, the device memory it added); transport -> figures.
    The server is stopped at the end, or on an error (its log's end printed)."""
    idle = device_memory_mib() if on_gpu else 0.0
    with tempfile.TemporaryFile("w+") as log:  # a pipe nobody reads would stall the server
        process = subprocess.Popen(command, stdout=log, stderr=log, text=True,
                                   start_new_session=True)
        try:
            _wait_ready(ports["http"], process, ports["grpc"] if "grpc" in order else None,
                        path=ready)
            measured = {}
            for transport in order:
                port = ports["grpc" if transport == "grpc" else "http"]
                figures = load(port, transport, model, clients, seconds, warm_up, inputs,
                               expected,
                               probe=lambda: (cpu_seconds(process.pid), time.perf_counter()))
                (before, began), (after, ended) = figures.pop("probed")
                elapsed = ended - began
                # The cores each process of the server kept busy: whether a multi-process
                # server spread the N connections over its N workers shows here.
                busy = [(after[pid] - before.get(pid, 0.0)) / elapsed for pid in after]
                figures["busy_processes"] = sum(cores >= 0.1 for cores in busy)
                figures["server_cores"] = sum(busy)
                figures["pss_mib"] = pss_tree(process.pid) / (1 << 20)
                if on_gpu:
                    figures["device_mib"] = device_memory_mib() - idle
                measured[transport] = figures
            return measured
        except BaseException:
            _stop(process)
            log.seek(0)
            print(log.read()[-3000:], file=sys.stderr)
            raise
        finally:
            _stop(process)


def _medians(runs: list[dict]) -> dict:
    """The median of each figure over runs; wrong answers summed."""
    return {key: (sum(run[key] for run in runs) if key == "wrong"
                  else statistics.median(run[key] for run in runs)) for key in runs[0]}


def example(directory: str, model: str, device: str = "cpu") -> tuple[str, list, list]:
    """The example package `model` written into directory: its path, its example inputs
    as (name, datatype, numpy array) triples (named after forward's parameters, as a
    model that declares its inputs names them; FP32, or BYTES for arrays of bytes), and
    the model's outputs for them, run eagerly here on device, where the servers run it
    (on a GPU torch's defaults change the arithmetic: cuDNN convolutions in TF32, about
    1e-3 relative), as numpy arrays (output0, output1, ...)."""
    import inspect

    import numpy as np
    import torch
    import torch.package
    from tritonclient.utils import np_to_triton_dtype

    sys.path.insert(0, os.path.join(ROOT, "examples"))
    from generate_examples import generate

    path = generate(directory, [model])[model]
    importer = torch.package.PackageImporter(path)
    inputs = importer.load_pickle("model", "example.pkl")
    packaged = importer.load_pickle("model", "model.pkl", map_location=device)
    with torch.no_grad():
        result = packaged(*(x.to(device) if isinstance(x, torch.Tensor) else x
                            for x in inputs))
    names = list(inspect.signature(packaged.forward).parameters)
    arrays = [x.numpy() if isinstance(x, torch.Tensor) else np.asarray(x) for x in inputs]
    expected = [x.cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)
                for x in (result if isinstance(result, (tuple, list)) else (result,))]
    return path, [(name, np_to_triton_dtype(x.dtype), x) for name, x in zip(names, arrays)], \
        expected


def server_command(name: str, path: str, model: str, n: int, grpc: bool,
                   kserve_python: str | None, device: str = "cpu") -> list[str]:
    """The command that starts server name (multipy, or a peer) for the archive at path
    with n interpreters or workers, the model on device, its HTTP port "{http}" and,
    with grpc, its gRPC port "{grpc}" to be filled in."""
    grpc_port = ["--grpc-port", "{grpc}"] if grpc else []
    if name in ("multipy", "processes"):
        shape = ["--interpreters", str(n)] if name == "multipy" else \
            ["--processes", str(n), "--interpreters", "1"]
        return [sys.executable, "-m", "multipy", "serve", path, *shape,
                "--port", "{http}", "--device", device, *grpc_port]
    peer = [path, "--name", model, "--workers", str(n), "--port", "{http}", "--device", device]
    if name == "kserve":
        return [kserve_python, os.path.join(HERE, "kserve_model.py"), *peer, *grpc_port]
    from multipy.manager import default_torch_threads

    return [sys.executable, os.path.join(HERE, "floor_app.py"), *peer,
            "--torch-threads", str(default_torch_threads(n))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--counts", default="2,4", help="N: interpreters and workers (2,4)")
    parser.add_argument("--clients", type=int, default=2,
                        help="client processes per interpreter or worker (2: 2N clients)")
    parser.add_argument("--seconds", type=float, default=10, help="timed seconds per run (10)")
    parser.add_argument("--warm-up", type=float, default=3, help="untimed seconds first (3)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="runs of each server, taking turns; medians reported (3)")
    parser.add_argument("--models", default="simple,python_heavy,text_classifier",
                        help="example packages, each measured in turn "
                             "(simple,python_heavy,text_classifier)")
    parser.add_argument("--transports", default="http,grpc,json",
                        help="http (tritonclient.http, binary), grpc (tritonclient.grpc), json "
                             "(http.client, keep-alive, the protocol's JSON form), json-new "
                             "(the same, a new connection per request), wrk and wrk-new (the "
                             "JSON through wrk, keep-alive or Connection: close; wrk on PATH), "
                             "each measured in every run of a server that speaks it "
                             "(http,grpc,json)")
    parser.add_argument("--peers", default="kserve,floor",
                        help="the servers multipy is measured beside: kserve "
                             "(kserve.ModelServer), floor (benchmarks/floor_app.py, json "
                             "and json-new only), processes (multipy serve --processes N "
                             "--interpreters 1), or none (kserve,floor)")
    parser.add_argument("--no-peer", action="store_true", help="--peers none")
    parser.add_argument("--peer-venv", default=os.path.join(ROOT, ".venv", "kserve-peer"),
                        help="KServe's virtual environment, made if missing (.venv/kserve-peer)")
    parser.add_argument("--peer-python",
                        help="a python that already has KServe, instead of --peer-venv")
    parser.add_argument("--json", help="also write the figures to this file")
    parser.add_argument("--device", default="cpu",
                        help="where every server runs the model: cpu, or cuda (the GPU's "
                             "memory measured too) (cpu)")
    parser.add_argument("--plot", help="also plot the figures into this PNG")
    parser.add_argument("--replot", help="plot (--plot) this --json file's figures, and print "
                             "their tables; run nothing")
    args = parser.parse_args()
    if args.replot:
        if not args.plot:
            parser.error("--replot needs --plot")
        with open(args.replot) as f:
            figures = json.load(f)
        report(figures)
        plot(figures, args.plot)
        return
    counts = [int(n) for n in args.counts.split(",")]
    transports = tuple(args.transports.split(","))
    if not transports or set(transports) - set(TRANSPORTS):
        parser.error(f"--transports: from {', '.join(TRANSPORTS)}")
    if any(t.startswith("wrk") for t in transports) and shutil.which("wrk") is None:
        parser.error("--transports wrk and wrk-new need wrk on PATH (its package: wrk)")
    peers = () if args.no_peer or args.peers == "none" else tuple(args.peers.split(","))
    if set(peers) - set(PEERS):
        parser.error(f"--peers: from {', '.join(PEERS)}, or none")
    # the servers that speak a transport of --transports, multipy first
    servers = tuple(name for name in ("multipy", *peers)
                    if set(SPEAKS[name]) & set(transports))
    kserve_python = (args.peer_python or ensure_peer_venv(args.peer_venv)
                     if "kserve" in servers else None)
    gpu = _gpu("name") if args.device != "cpu" else None
    rows = []
    with tempfile.TemporaryDirectory() as directory:
        for model in args.models.split(","):
            path, inputs, expected = example(directory, model, args.device)
            for n in counts:
                speaks = {name: tuple(t for t in transports if t in SPEAKS[name])
                          for name in servers}
                commands = {name: server_command(name, path, model, n, "grpc" in speaks[name],
                                                 kserve_python, args.device)
                            for name in servers}
                rounds = {(name, transport): [] for name in servers for transport in speaks[name]}
                for round_ in range(args.rounds):
                    # who goes first turns round by round, and which transport alternates
                    turn = round_ % len(servers)
                    for name in servers[turn:] + servers[:turn]:
                        order = speaks[name] if round_ % 2 == 0 else speaks[name][::-1]
                        ports = {"http": free_port(), "grpc": free_port()}
                        command = [part.format(**ports) for part in commands[name]]
                        measured = run_server(command, ports, order, model, args.clients * n,
                                              args.seconds, args.warm_up, inputs, expected,
                                              args.device != "cpu")
                        for transport in order:
                            rounds[name, transport].append(measured[transport])
                for transport in transports:
                    here = [name for name in servers if transport in speaks[name]]
                    rows.append({"model": model, "transport": transport, "n": n,
                                 "clients": args.clients * n, "servers": here,
                                 "rounds": {name: rounds[name, transport] for name in here},
                                 **{name: _medians(rounds[name, transport]) for name in here}})
                if args.json:  # so far: a run stopped part-way keeps what it measured
                    _write(args.json, _figures(rows, peers, gpu, args))
    figures = _figures(rows, peers, gpu, args)
    report(figures)
    if args.json:
        _write(args.json, figures)
    if args.plot:
        plot(figures, args.plot)


def _figures(rows: list[dict], peers: tuple, gpu: str | None, args) -> dict:
    """What --json keeps: the rows measured, with the setting, the machine (and gpu, the
    GPU's name, where the models ran on one), the date and the commit."""
    return {**provenance(), "models": args.models, "transports": args.transports,
            "peers": list(peers), "seconds": args.seconds, "device": args.device,
            **({"gpu": gpu} if gpu is not None else {}),
            "setting": f"N interpreters or workers, {args.clients}N closed-loop clients "
                       f"(processes; wrk's: connections), {args.seconds:g} s after "
                       f"{args.warm_up:g} s of warm-up; the median of {args.rounds} "
                       f"round(s), the servers taking turns",
            "rows": rows}


def _write(path: str, figures: dict) -> None:
    """figures into the JSON file at path, whole or not at all (a new file renamed over
    it)."""
    with open(path + ".new", "w") as f:
        json.dump(figures, f, indent=1)
    os.replace(path + ".new", path)


def plot(figures: dict, path: str) -> None:
    """A PNG at path: for each model, a row of panels against N (requests/s; p50, solid,
    and p99, dashed, latency; PSS; on a GPU, the device memory each server added), a line
    per server and transport, titled with the setting, the machine, the date and the
    commit (figures, as --json writes them)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = figures["rows"]
    models = list(dict.fromkeys(row["model"] for row in rows))
    panels = ["requests/s", "latency, ms (p50 solid, p99 dashed)", "memory, PSS MiB"]
    if figures.get("device", "cpu") != "cpu":
        panels.append("device memory added, MiB")
    fig, axes = plt.subplots(len(models), len(panels), squeeze=False,
                             figsize=(4.4 * len(panels), 3.8 * len(models)))
    for line, model in zip(axes, models):
        mine = [row for row in rows if row["model"] == model]
        lines = dict.fromkeys((name, row["transport"]) for row in mine for name in row["servers"])
        for index, (name, transport) in enumerate(lines):
            points = [(row["n"], row[name]) for row in mine
                      if row["transport"] == transport and name in row["servers"]]
            ns = [n for n, _ in points]
            style = {"color": f"C{index}", "marker": "o", "label": f"{NAMES[name]}, {transport}"}
            line[0].plot(ns, [f["requests_per_second"] for _, f in points], **style)
            line[1].plot(ns, [f["p50_ms"] for _, f in points], **style)
            line[1].plot(ns, [f["p99_ms"] for _, f in points], linestyle="--",
                         color=style["color"], marker="x")
            line[2].plot(ns, [f["pss_mib"] for _, f in points], **style)
            if len(panels) > 3:
                line[3].plot(ns, [f["device_mib"] for _, f in points], **style)
        for ax, label in zip(line, panels):
            ax.set_xlabel("N (interpreters or workers)")
            ax.set_ylabel(label)
            ax.set_xticks(sorted({row["n"] for row in mine}))
            ax.set_ylim(bottom=0)
            ax.set_title(model, fontsize=9)
        line[0].legend(fontsize=8)
    fig.suptitle(f"multipy serve and its peers: {figures['setting']}\n" + _run_line(figures),
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _run_line(figures: dict) -> str:
    """run_line(figures), with the GPU's name where the models ran on one."""
    return run_line(figures) + (f", {figures['gpu']}" if "gpu" in figures else "")


def _ratios(ours: dict, theirs: dict) -> tuple[float, float]:
    """multipy's requests/s and memory over a peer's."""
    return (ours["requests_per_second"] / theirs["requests_per_second"],
            ours["pss_mib"] / theirs["pss_mib"])


def report(figures: dict) -> None:
    """Prints, from figures (as --json writes them), a table per transport, with on each
    peer's row the ratios multipy / that peer, then each ratio with each round's
    requests/s, and multipy's growth from the first N to the last."""
    rows, transports = figures["rows"], figures["transports"].split(",")
    gpu = figures.get("device", "cpu") != "cpu"
    print(f"\n{figures['setting']}; {_run_line(figures)}")
    for transport in transports:
        print(f"\n{transport} ({CLIENTS[transport]})")
        print(f"{'model':15s} {'server':28s} {'N':>2s} {'req/s':>8s} {'p50 ms':>8s} "
              f"{'p99 ms':>8s} {'PSS MiB':>8s} " + (f"{'GPU MiB':>8s} " if gpu else "")
              + f"{'cores':>6s} {'clients':>7s} {'wrong':>6s} {'ratio':>12s}")
        for row in (row for row in rows if row["transport"] == transport):
            for name in row["servers"]:
                f = row[name]
                ratio = ("" if name == "multipy"
                         else "{:.2f}x/{:.2f}x".format(*_ratios(row["multipy"], f)))
                print(f"{row['model']:15s} {LABELS[name].format(n=row['n']):28s} {row['n']:2d} "
                      f"{f['requests_per_second']:8.1f} {f['p50_ms']:8.2f} {f['p99_ms']:8.2f} "
                      f"{f['pss_mib']:8.1f} " + (f"{f['device_mib']:8.0f} " if gpu else "")
                      + f"{f['server_cores']:6.2f} {f['client_cores']:7.2f} "
                      f"{f['wrong']:6d} {ratio:>12s}")
    print("\n(ratio, on a peer's row: multipy / that peer, requests/s / memory)")
    for row in rows:
        # multipy against every other server; --processes against the peers
        pairs = [("multipy", peer) for peer in row["servers"][1:]]
        if "processes" in row["servers"]:
            pairs += [("processes", peer) for peer in row["servers"][1:] if peer != "processes"]
        for ours, peer in pairs:
            requests, memory = _ratios(row[ours], row[peer])
            each = ", ".join(f"{a['requests_per_second']:.0f}/{b['requests_per_second']:.0f}"
                             for a, b in zip(row["rounds"][ours], row["rounds"][peer]))
            device = (f", GPU memory {row[ours]['device_mib'] / row[peer]['device_mib']:.2f}x"
                      if gpu else "")
            print(f"  {row['model']}, {row['transport']}, N={row['n']}: {NAMES[ours]} / "
                  f"{NAMES[peer]}: requests/s {requests:.2f}x, memory {memory:.2f}x{device}   "
                  f"(req/s by round, {NAMES[ours]}/{NAMES[peer]}: {each})")
    for model in figures["models"].split(","):
        for transport in transports:
            mine = [row for row in rows if row["model"] == model and row["transport"] == transport]
            if len(mine) > 1:
                first, last = mine[0]["multipy"], mine[-1]["multipy"]
                print(f"  {model}, {transport}: multipy's requests/s from N={mine[0]['n']} to "
                      f"N={mine[-1]['n']}: "
                      f"{last['requests_per_second'] / first['requests_per_second']:.2f}x")


if __name__ == "__main__":
    main()
