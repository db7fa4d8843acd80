"""multipy against each anchor serving the same model code, measured in one run: for
each anchor of --anchors and each N of --counts, the anchor's own server and `multipy
serve` serve the one model file of benchmarks/anchors/ (unchanged), each with N workers
or interpreters, under 2N closed-loop client processes (serve_load.py's); requests/s,
p50 and p99 latency, and the PSS of the server's whole process tree.  The servers take
turns round by round (who goes first alternates), and the figures are the medians of
--rounds rounds, so that a busy spell on a shared machine skews one round, not the
ratio.  Every answer is checked against the model run eagerly here.

- litserve: benchmarks/anchors/litserve_linear.py (a LitAPI: a torch Linear 8 -> 4)
  served by `litserve.LitServer(api, accelerator="cpu", workers_per_device=N)` (its
  API servers: as many as the workers, LitServe's default) and by `multipy serve
  litserve_linear.py:LinearAPI --interpreters N`; clients POST /predict {"x": [...]}.
- kserve: benchmarks/anchors/kserve_linear.py (a kserve.Model: the same Linear) served
  by `kserve.ModelServer(workers=N)` (benchmarks/anchors/kserve_server.py: its liveness
  ping waits 60 s, not 5, for a worker that starts slowly) in KServe's own environment
  (--peer-venv, as serve_load.py makes it: KServe's pins) and by `multipy serve
  kserve_linear.py:Linear --interpreters N` run by --kserve-multipy-python, a Python with
  kserve and multipy's serve extra (`make test-kserve` makes .venv/3.11-kserve); clients
  POST the protocol's JSON to /v2/models/linear/infer.
- triton: benchmarks/anchors/triton/ (Triton's add_sub example for its Python backend,
  instance_group count N) served by `tritonserver --model-repository` and by `multipy
  serve --model-repository --interpreters N`; clients POST the protocol's JSON to
  /v2/models/add_sub/infer.  The tritonserver is the one nvidia-pytriton's wheel bundles
  (with its Python backend and a backend stub per Python version; no GPU needed),
  installed into --triton-venv if missing, or --tritonserver.

    multipy run benchmarks/anchors.py [--anchors litserve,kserve,triton] [--counts 2,1]
        [--seconds 10] [--warm-up 3] [--rounds 3] [--json FILE] [--plot FILE.png]
    multipy run benchmarks/anchors.py --replot FILE.json --plot FILE.png
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from provenance import provenance, run_line  # noqa: E402
from serve_load import (HERE, ROOT, _medians, ensure_peer_venv, free_port,  # noqa: E402
                        run_server)

MODELS = os.path.join(HERE, "anchors")
ANCHORS = ("litserve", "kserve", "triton")
TRITON_PACKAGES = ("nvidia-pytriton==0.7.0",)
NAMES = {"litserve": "LitServe", "kserve": "KServe", "triton": "Triton"}
#: the anchor's server, as the tables and the plot name it
LABELS = {"litserve": "litserve.LitServer, {n} workers",
          "kserve": "kserve.ModelServer, {n} workers",
          "triton": "tritonserver, python backend, {n} instances"}


@dataclasses.dataclass
class Case:
    """One anchor at N: the two servers' commands (ports "{http}", "{grpc}", "{metrics}"
    to be filled in), the transport and model the clients ask (serve_load's), the path
    that answers 200 once a server is ready, the inputs and the expected outputs."""

    commands: dict[str, list[str]]
    transport: str
    model: str
    ready: str
    inputs: list
    expected: dict


def _linear_case_inputs():
    """The input x (8 values) and the LitAPI's answer to it, its own code run eagerly
    here (kserve_linear.py makes the same Linear, seed 0)."""
    import numpy as np

    sys.path.insert(0, MODELS)
    from litserve_linear import LinearAPI

    x = (np.arange(8, dtype=np.float32) - 4) / 4
    api = LinearAPI()
    api.setup("cpu")
    y = api.encode_response(api.predict(api.decode_request({"x": x.tolist()})))["y"]
    return x, np.array(y, dtype=np.float32)


def litserve_case(n: int, args) -> Case:
    """LitServe's LinearAPI: LitServe's server against multipy's, both in this Python."""
    x, y = _linear_case_inputs()
    path = os.path.join(MODELS, "litserve_linear.py")
    return Case({"multipy": [sys.executable, "-m", "multipy", "serve", f"{path}:LinearAPI",
                             "--interpreters", str(n), "--port", "{http}"],
                 "litserve": [sys.executable, path, "{http}", str(n)]},
                "litserve", "predict", "/health", [("x", "FP32", x)], {"y": y})


def kserve_case(n: int, args) -> Case:
    """KServe's Linear: kserve.ModelServer in KServe's environment against multipy's."""
    x, y = _linear_case_inputs()
    path = os.path.join(MODELS, "kserve_linear.py")
    peer = args.peer_python or ensure_peer_venv(args.peer_venv)
    return Case({"multipy": [args.kserve_multipy_python, "-m", "multipy", "serve",
                             f"{path}:Linear", "--interpreters", str(n), "--port", "{http}"],
                 "kserve": [peer, os.path.join(MODELS, "kserve_server.py"), "{http}",
                            str(n)]},
                "json", "linear", "/v2/health/ready", [("x", "FP32", x.reshape(1, 8))],
                {"y": y.reshape(1, 4)})


def triton_case(n: int, args) -> Case:
    """Triton's add_sub (Python backend), its instance_group count N, in a copy of the
    repository under args.scratch: tritonserver against multipy's --model-repository."""
    import numpy as np

    repository = os.path.join(args.scratch, f"triton-{n}")
    if not os.path.exists(repository):
        shutil.copytree(os.path.join(MODELS, "triton"), repository)
        config = os.path.join(repository, "add_sub", "config.pbtxt")
        with open(config) as f:
            text = re.sub(r"count: \d+", f"count: {n}", f.read())
        with open(config, "w") as f:
            f.write(text)
    a = np.arange(4, dtype=np.float32)
    b = np.full(4, 0.5, dtype=np.float32)
    return Case({"multipy": [sys.executable, "-m", "multipy", "serve", "--model-repository",
                             repository, "--interpreters", str(n), "--port", "{http}"],
                 "triton": [*triton_command(args), "--model-repository", repository,
                            "--http-port", "{http}", "--grpc-port", "{grpc}",
                            "--metrics-port", "{metrics}", "--log-info", "false"]},
                "json", "add_sub", "/v2/health/ready",
                [("INPUT0", "FP32", a), ("INPUT1", "FP32", b)],
                {"OUTPUT0": a + b, "OUTPUT1": a - b})


def triton_command(args) -> list[str]:
    """The start of the command that runs a tritonserver with the Python backend:
    --tritonserver as it is, or nvidia-pytriton's (installed into --triton-venv if
    missing; CalledProcessError if that fails), with its own libraries, the venv's python
    first on PATH (the backend stub's numpy) and a backend directory in args.scratch: its
    Python backend with the stub made for the venv's Python version."""
    if args.tritonserver:
        return [args.tritonserver]
    python = ensure_peer_venv(args.triton_venv, TRITON_PACKAGES, "pytriton")
    where = subprocess.run([python, "-c", "import os, sys, pytriton; print(os.path.dirname("
                            "pytriton.__file__)); print('%d.%d' % sys.version_info[:2])"],
                           capture_output=True, text=True, check=True).stdout.split()
    bundled, version = os.path.join(where[0], "tritonserver"), where[1]
    backend = os.path.join(args.scratch, "backends", "python")
    if not os.path.exists(backend):
        os.makedirs(backend)
        for name in ("libtriton_python.so", "triton_python_backend_utils.py"):
            shutil.copy(os.path.join(bundled, "backends", "python", name), backend)
        shutil.copy(os.path.join(bundled, "python_backend_stubs", version,
                                 "triton_python_backend_stub"), backend)
    libraries = os.path.join(os.path.dirname(where[0]), "nvidia_pytriton.libs")
    return ["env", f"LD_LIBRARY_PATH={libraries}",
            f"PATH={os.path.dirname(python)}:{os.environ['PATH']}",
            os.path.join(bundled, "bin", "tritonserver"),
            "--backend-directory", os.path.dirname(backend)]


CASES = {"litserve": litserve_case, "kserve": kserve_case, "triton": triton_case}


def measure(anchor: str, n: int, args) -> dict:
    """The medians of args.rounds rounds of multipy and the anchor at N (2N clients),
    taking turns, and each round's figures."""
    case = CASES[anchor](n, args)
    servers = ("multipy", anchor)
    rounds: dict[str, list[dict]] = {name: [] for name in servers}
    for round_ in range(args.rounds):
        for name in servers if round_ % 2 == 0 else servers[::-1]:
            ports = {"http": free_port(), "grpc": free_port(), "metrics": free_port()}
            command = [part.format(**ports) for part in case.commands[name]]
            measured = run_server(command, ports, (case.transport,), case.model, 2 * n,
                                  args.seconds, args.warm_up, case.inputs, case.expected,
                                  ready=case.ready)
            rounds[name].append(measured[case.transport])
            print(f"  {anchor}, N={n}, round {round_ + 1}: {name} "
                  f"{rounds[name][-1]['requests_per_second']:.0f} req/s", flush=True)
    return {"anchor": anchor, "n": n, "clients": 2 * n, "transport": case.transport,
            "rounds": rounds, **{name: _medians(rounds[name]) for name in servers}}


def _ratios(row: dict) -> tuple[float, float]:
    """multipy's requests/s and PSS over the anchor's."""
    ours, theirs = row["multipy"], row[row["anchor"]]
    return (ours["requests_per_second"] / theirs["requests_per_second"],
            ours["pss_mib"] / theirs["pss_mib"])


def report(figures: dict) -> None:
    """A table per anchor: each server's medians, and the ratios multipy / anchor."""
    from rich.console import Console
    from rich.table import Table

    console = Console(width=120)
    console.print(f"\n{figures['setting']}")
    for anchor in dict.fromkeys(row["anchor"] for row in figures["rows"]):
        table = Table(title=f"multipy against {NAMES[anchor]}")
        for column in ("server", "N", "req/s", "p50 ms", "p99 ms", "PSS MiB", "wrong",
                       "multipy / anchor: req/s, PSS"):
            table.add_column(column, justify="left" if column == "server" else "right")
        for row in (row for row in figures["rows"] if row["anchor"] == anchor):
            for name in ("multipy", anchor):
                f = row[name]
                ratio = "" if name == "multipy" else "{:.2f}x, {:.2f}x".format(*_ratios(row))
                label = (f"multipy serve, {row['n']} interp." if name == "multipy"
                         else LABELS[anchor].format(n=row["n"]))
                table.add_row(label, str(row["n"]), f"{f['requests_per_second']:.1f}",
                              f"{f['p50_ms']:.2f}", f"{f['p99_ms']:.2f}",
                              f"{f['pss_mib']:.1f}", str(f["wrong"]), ratio)
        console.print(table)
        for row in (row for row in figures["rows"] if row["anchor"] == anchor):
            each = ", ".join(f"{a['requests_per_second']:.0f}/{b['requests_per_second']:.0f}"
                             for a, b in zip(row["rounds"]["multipy"], row["rounds"][anchor]))
            console.print(f"  N={row['n']}: req/s by round, multipy/{NAMES[anchor]}: {each}")


def plot(figures: dict, path: str) -> None:
    """A PNG at path: per anchor and N, multipy's requests/s and PSS over the anchor's
    (bars), with the machine, the date and the commit in the title."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = figures["rows"]
    labels = [f"{NAMES[row['anchor']]}\nN={row['n']}" for row in rows]
    ratios = [_ratios(row) for row in rows]
    fig, ax = plt.subplots(figsize=(max(6.0, 1.4 * len(rows) + 2), 4.5))
    width = 0.38
    spots = range(len(rows))
    for offset, index, label in ((-width / 2, 0, "requests/s"), (width / 2, 1, "memory (PSS)")):
        bars = ax.bar([spot + offset for spot in spots], [ratio[index] for ratio in ratios],
                      width, label=label)
        ax.bar_label(bars, fmt="%.2fx", fontsize=8)
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_ylim(0, 1.25 * max(max(ratio) for ratio in ratios))  # room for the legend
    ax.set_xticks(list(spots), labels)
    ax.set_ylabel("multipy / anchor")
    ax.legend(loc="upper right")
    ax.set_title("multipy serve / each anchor, same model code, 2N closed-loop clients\n"
                 + run_line(figures),
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--anchors", default=",".join(ANCHORS),
                        help="from litserve, kserve, triton (all three)")
    parser.add_argument("--counts", default="2", help="N: interpreters and workers (2)")
    parser.add_argument("--seconds", type=float, default=10, help="timed seconds per run (10)")
    parser.add_argument("--warm-up", type=float, default=3, help="untimed seconds first (3)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="runs of each server, taking turns; medians reported (3)")
    parser.add_argument("--peer-venv", default=os.path.join(ROOT, ".venv", "kserve-peer"),
                        help="KServe's environment, made if missing (.venv/kserve-peer)")
    parser.add_argument("--peer-python", help="a python that has KServe, instead of --peer-venv")
    parser.add_argument("--kserve-multipy-python",
                        default=os.path.join(ROOT, ".venv", "3.11-kserve", "bin", "python"),
                        help="the python that runs `multipy serve` for KServe's model: kserve "
                             "and multipy's serve extra (.venv/3.11-kserve, make test-kserve)")
    parser.add_argument("--triton-venv", default=os.path.join(ROOT, ".venv", "pytriton"),
                        help="nvidia-pytriton's environment, whose tritonserver serves Triton's "
                             "model, made if missing (.venv/pytriton)")
    parser.add_argument("--tritonserver",
                        help="a tritonserver with the Python backend, instead of --triton-venv's")
    parser.add_argument("--json", help="also write the figures to this file")
    parser.add_argument("--plot", help="also plot the ratios into this PNG")
    parser.add_argument("--replot", help="plot (--plot) and print this --json file's figures; "
                                         "run nothing")
    args = parser.parse_args()
    if args.replot:
        with open(args.replot) as f:
            figures = json.load(f)
    else:
        anchors = args.anchors.split(",")
        if set(anchors) - set(ANCHORS):
            parser.error(f"--anchors: from {', '.join(ANCHORS)}")
        if "kserve" in anchors and not os.path.exists(args.kserve_multipy_python):
            parser.error(f"--kserve-multipy-python: no {args.kserve_multipy_python} "
                         f"(`make test-kserve` makes .venv/3.11-kserve)")
        figures = {**provenance(),
                   "setting": f"N workers or interpreters, 2N closed-loop client processes, "
                              f"{args.seconds:g} s after {args.warm_up:g} s of warm-up; the "
                              f"median of {args.rounds} round(s), the servers taking turns; "
                              f"{os.cpu_count()} cores",
                   "rows": []}
        with tempfile.TemporaryDirectory() as scratch:
            args.scratch = scratch
            for anchor in anchors:
                for n in (int(n) for n in args.counts.split(",")):
                    figures["rows"].append(measure(anchor, n, args))
                    if args.json:  # what is measured so far survives a later failure
                        with open(args.json, "w") as f:
                            json.dump(figures, f, indent=1)
    report(figures)
    if args.plot:
        plot(figures, args.plot)


if __name__ == "__main__":
    main()
