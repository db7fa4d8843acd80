"""Streaming tokens: multipy against LitServe and KServe, the same model code, measured in
one run.  The model (benchmarks/streaming/tiny_gpt.py) is a GPT-2-shaped decoder with
random weights (2 layers, 256 wide, seed 0, nothing downloaded) that generates
--tokens token ids greedily with its KV cache, one model step per token, each sent to
the client as it is made.  For each N of --counts, each server runs N workers or
interpreters:

- multipy: `multipy serve streaming/gpt_class.py:Generator --interpreters N`, a class
  whose predict is a generator; POST /v2/models/generator/generate_stream, one
  Server-Sent Event per token.
- litserve: streaming/gpt_litserve.py, `LitServer(GeneratorAPI(stream=True),
  workers_per_device=N)` (its API servers as many as the workers, LitServe's default),
  predict and encode_response generators; POST /predict, a chunked body of one JSON
  line per token.
- kserve: streaming/gpt_kserve.py, a kserve.Model whose predict is an async generator,
  `kserve.ModelServer(workers=N)` in KServe's environment (--peer-venv); KServe 0.21
  streams such a model on its V1 route only, POST /v1/models/generator:predict, a
  chunked body whose chunks are what predict yields (here one Server-Sent Event each).

Every server gets the same JSON body, {"prompt": "3 14 15 ...", "max_tokens": T}.  2N
closed-loop client processes (serve_load.py's way: processes, one keep-alive
http.client connection each) send requests back to back, each reading the answer line
by line as it comes; figures: tokens/s over all clients, time to first token (p50,
p99), whole-request latency (p50, p99), the time between tokens, and the PSS of the
server's whole process tree.  Every request's tokens are checked against the model run
eagerly here (the same seed, the same prompt).  The servers take turns round by round
(who goes first rotates), and the figures are the medians of --rounds rounds, so that a
busy spell on a shared machine skews one round, not the ratio.

    multipy run benchmarks/streaming.py [--counts 1,2] [--servers multipy,litserve,kserve]
        [--tokens 32] [--seconds 10] [--warm-up 3] [--rounds 3] [--json FILE]
        [--plot FILE.png]
    multipy run benchmarks/streaming.py --replot FILE.json --plot FILE.png
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from provenance import provenance, run_line  # noqa: E402
from serve_load import (HERE, ROOT, _medians, _stop, _wait_ready, cpu_seconds,  # noqa: E402
                        ensure_peer_venv, free_port, pss_tree)

MODELS = os.path.join(HERE, "streaming")
SERVERS = ("multipy", "litserve", "kserve")
#: KServe's environment: KServe 0.21's pins, and the model's transformers
PEER_PACKAGES = ("kserve==0.21.0", "torch==2.13.0", "numpy==2.4.6", "transformers==5.23.0")
NAMES = {"multipy": "multipy", "litserve": "LitServe", "kserve": "KServe"}
LABELS = {"multipy": "multipy serve, {n} interp.", "litserve": "litserve.LitServer, {n} workers",
          "kserve": "kserve.ModelServer, {n} workers"}
#: the path each server streams on, and the one that answers 200 once it is ready
PATHS = {"multipy": ("/v2/models/generator/generate_stream", "/v2/health/ready"),
         "litserve": ("/predict", "/health"),
         "kserve": ("/v1/models/generator:predict", "/v2/health/ready")}
#: the prompts the clients send in turn (token ids, as text)
PROMPTS = ("3 14 15 92 65 35 89 79", "2 71 828 182 845 904", "1 1 2 3 5 8 13 21 34 55",
           "577 215 664 901")


def expected_tokens(count: int) -> dict[str, str]:
    """Each prompt's answer, as the clients join it: the model run eagerly here."""
    sys.path.insert(0, MODELS)
    from tiny_gpt import generate, make_model, parse

    model = make_model()
    return {prompt: "".join(f"{token} " for token in generate(model, parse(prompt), count))
            for prompt in PROMPTS}


def commands(n: int, args) -> dict[str, list[str]]:
    """Each server's command at N, its port "{http}" to be filled in."""
    path = os.path.join(MODELS, "{}")
    return {"multipy": [sys.executable, "-m", "multipy", "serve",
                        path.format("gpt_class.py:Generator"), "--interpreters", str(n),
                        "--port", "{http}"],
            "litserve": [sys.executable, path.format("gpt_litserve.py"), "{http}", str(n)],
            "kserve": [args.kserve_python, path.format("gpt_kserve.py"), "{http}", str(n)]}


def _client(port: int, path: str, first: int, count: int, expected: dict, seconds: float,
            warm_up: float, start, results) -> None:
    """One client process: one keep-alive connection POSTing the prompts in turn (from
    the first-th), each answer read line by line as it comes (a JSON object a line, or a
    Server-Sent Event's "data: " line); warms up, waits for the others, then sends
    requests for seconds.  Puts on results, for each timed request, (time to first
    token, latency, tokens), and the count of requests whose tokens were not the
    expected ones (or that failed)."""
    import http.client

    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    headers = {"Content-Type": "application/json"}
    bodies = [(json.dumps({"prompt": prompt, "max_tokens": count}).encode(), expected[prompt])
              for prompt in PROMPTS]
    sent, wrong = first, 0

    def one() -> tuple[float, float, int] | None:
        nonlocal sent, wrong
        body, answer = bodies[sent % len(bodies)]
        sent += 1
        begin = time.perf_counter()
        arrived, tokens = None, []
        try:
            connection.request("POST", path, body, headers)
            response = connection.getresponse()
            if response.status != 200:
                raise RuntimeError(f"{response.status}: {response.read()[:200]!r}")
            for line in iter(response.readline, b""):
                line = line.strip()
                if not line or line.startswith(b":") or line.startswith(b"event:"):
                    continue
                event = json.loads(line[5:] if line.startswith(b"data:") else line)
                if "error" in event:
                    raise RuntimeError(event["error"])
                if arrived is None:
                    arrived = time.perf_counter()
                tokens.append(event["token"])
        except Exception:
            connection.close()  # the next request opens a new one
            wrong += 1
            return None
        if "".join(tokens) != answer:
            wrong += 1
            return None
        return arrived - begin, time.perf_counter() - begin, len(tokens)

    until = time.perf_counter() + warm_up
    one()
    while time.perf_counter() < until:
        one()
    start.wait(timeout=300)
    done, wrong = [], 0
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        each = one()
        if each is not None:
            done.append(each)
    connection.close()
    results.put((done, wrong))


def load(port: int, path: str, clients: int, count: int, expected: dict, seconds: float,
         warm_up: float, probe) -> dict:
    """clients client processes streaming from the server on port for warm_up + seconds;
    the timed part's figures, and probe()'s values as it begins and ends ("probed")."""
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    start = context.Barrier(clients + 1)
    results = context.Queue()
    processes = [context.Process(target=_client, args=(port, path, index, count, expected,
                                                       seconds, warm_up, start, results))
                 for index in range(clients)]
    for process in processes:
        process.start()
    try:
        start.wait(timeout=300)
        begun = time.perf_counter()
        probed = [probe()]
        answers = [results.get(timeout=seconds + 300) for _ in processes]
        elapsed = time.perf_counter() - begun
        probed.append(probe())
    finally:
        for process in processes:
            process.join(timeout=60)
            if process.is_alive():
                process.kill()
    done = [each for requests, _ in answers for each in requests]
    wrong = sum(wrong for _, wrong in answers)
    if not done:
        return {"tokens_per_second": 0.0, "requests_per_second": 0.0, "requests": 0,
                "wrong": wrong, "probed": probed}
    first = sorted(each[0] for each in done)
    whole = sorted(each[1] for each in done)
    gaps = sorted((latency - ttft) / (tokens - 1) for ttft, latency, tokens in done if tokens > 1)

    def p99(values: list[float]) -> float:
        return values[min(len(values) - 1, int(len(values) * 0.99))] * 1e3

    return {"tokens_per_second": sum(each[2] for each in done) / max(elapsed, seconds),
            "requests_per_second": len(done) / max(elapsed, seconds),
            "ttft_p50_ms": statistics.median(first) * 1e3, "ttft_p99_ms": p99(first),
            "latency_p50_ms": statistics.median(whole) * 1e3, "latency_p99_ms": p99(whole),
            "between_tokens_p50_ms": statistics.median(gaps) * 1e3 if gaps else 0.0,
            "requests": len(done), "wrong": wrong, "probed": probed}


def run_server(name: str, command: list[str], clients: int, count: int, expected: dict,
               args) -> dict:
    """Starts a server (command, its port filled in), waits until it is ready, measures
    load() against it, with the cores its process tree kept busy and its PSS as the load
    ends; stops it (printing its log's end on an error)."""
    path, ready = PATHS[name]
    port = free_port()
    with tempfile.TemporaryFile("w+") as log:  # a pipe nobody reads would stall the server
        process = subprocess.Popen([part.format(http=port) for part in command], stdout=log,
                                   stderr=log, text=True, start_new_session=True)
        try:
            _wait_ready(port, process, path=ready)
            figures = load(port, path, clients, count, expected, args.seconds, args.warm_up,
                           probe=lambda: (cpu_seconds(process.pid), time.perf_counter()))
            (before, began), (after, ended) = figures.pop("probed")
            figures["server_cores"] = sum(after[pid] - before.get(pid, 0.0)
                                          for pid in after) / (ended - began)
            figures["pss_mib"] = pss_tree(process.pid) / (1 << 20)
            if figures["wrong"] or not figures["requests"]:
                log.seek(0)
                print(log.read()[-2000:], file=sys.stderr)
            return figures
        except BaseException:
            log.seek(0)
            print(log.read()[-3000:], file=sys.stderr)
            raise
        finally:
            _stop(process)


def measure(n: int, servers: tuple, expected: dict, args) -> dict:
    """The medians of args.rounds rounds of each server at N (2N clients), taking turns
    (who goes first rotates), and each round's figures."""
    every = commands(n, args)
    rounds: dict[str, list[dict]] = {name: [] for name in servers}
    for round_ in range(args.rounds):
        turn = round_ % len(servers)
        for name in servers[turn:] + servers[:turn]:
            figures = run_server(name, every[name], 2 * n, args.tokens, expected, args)
            rounds[name].append(figures)
            print(f"  N={n}, round {round_ + 1}: {name} {figures['tokens_per_second']:.0f} "
                  f"tokens/s, first token p50 {figures.get('ttft_p50_ms', 0):.1f} ms, "
                  f"{figures['wrong']} wrong", flush=True)
    return {"n": n, "clients": 2 * n, "servers": list(servers), "rounds": rounds,
            **{name: {**_medians([run for run in rounds[name] if run["requests"]]
                                 or rounds[name]),
                      "wrong": sum(run["wrong"] for run in rounds[name])}
               for name in servers}}


def _ratios(row: dict, peer: str) -> tuple[float, float, float]:
    """multipy's tokens/s, time to first token (p50) and PSS over peer's."""
    ours, theirs = row["multipy"], row[peer]
    return (ours["tokens_per_second"] / theirs["tokens_per_second"],
            ours["ttft_p50_ms"] / theirs["ttft_p50_ms"], ours["pss_mib"] / theirs["pss_mib"])


def report(figures: dict) -> None:
    """A table of each server's medians at each N, the ratios multipy / each peer on the
    peer's rows, then tokens/s by round."""
    from rich.console import Console
    from rich.table import Table

    console = Console(width=150)
    console.print(f"\n{figures['setting']}")
    table = Table(title="Streaming tokens: multipy, LitServe, KServe, the same model code")
    for column in ("server", "N", "tokens/s", "TTFT p50", "TTFT p99", "request p50",
                   "request p99", "gap p50", "PSS MiB", "cores", "wrong",
                   "multipy / this: tokens/s, TTFT, PSS"):
        table.add_column(column, justify="left" if column == "server" else "right")
    for row in figures["rows"]:
        for name in row["servers"]:
            f = row[name]
            ratio = ("" if name == "multipy" or "multipy" not in row
                     else "{:.2f}x, {:.2f}x, {:.2f}x".format(*_ratios(row, name)))
            table.add_row(NAMES[name], str(row["n"]),
                          f"{f['tokens_per_second']:.0f}", f"{f.get('ttft_p50_ms', 0):.1f}",
                          f"{f.get('ttft_p99_ms', 0):.1f}", f"{f.get('latency_p50_ms', 0):.1f}",
                          f"{f.get('latency_p99_ms', 0):.1f}",
                          f"{f.get('between_tokens_p50_ms', 0):.2f}", f"{f['pss_mib']:.0f}",
                          f"{f['server_cores']:.2f}", str(f["wrong"]), ratio)
    console.print(table)
    console.print("(TTFT: time to first token; request: the whole answer's; gap: between "
                  "tokens, each request's mean; all in ms.  The servers: "
                  + "; ".join(label.format(n="N") for label in LABELS.values()) + ")")
    for row in figures["rows"]:
        each = "; ".join(f"{NAMES[name]} " + ", ".join(f"{run['tokens_per_second']:.0f}"
                                                        for run in row["rounds"][name])
                         for name in row["servers"])
        console.print(f"  N={row['n']}: tokens/s by round: {each}")


def plot(figures: dict, path: str) -> None:
    """A PNG at path: three panels, tokens/s, time to first token (p50) and PSS, each
    server's bar at each N, and on each peer's bar multipy's figure over the peer's; the
    machine, the date and the commit in the title."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = figures["rows"]
    servers = list(dict.fromkeys(name for row in rows for name in row["servers"]))
    panels = (("tokens_per_second", "tokens/s, all clients (higher is better)"),
              ("ttft_p50_ms", "time to first token, p50, ms (lower is better)"),
              ("pss_mib", "PSS of the server's processes, MiB (lower is better)"))
    fig, axes = plt.subplots(1, 3, figsize=(13, 4.6))
    width = 0.8 / len(servers)
    for ax, (key, title) in zip(axes, panels):
        for index, name in enumerate(servers):
            here = [row for row in rows if name in row]
            spots = [rows.index(row) + (index - (len(servers) - 1) / 2) * width for row in here]
            bars = ax.bar(spots, [row[name].get(key, 0.0) for row in here], width,
                          label=NAMES[name])
            labels = [f"{row[name].get(key, 0.0):.0f}" if name == "multipy" or "multipy" not in row
                      else f"{row[name].get(key, 0.0):.0f}\n"
                           f"({row['multipy'].get(key, 0.0) / row[name][key]:.2f}x)"
                      for row in here]
            ax.bar_label(bars, labels, fontsize=7)
        ax.set_xticks(range(len(rows)), [f"N={row['n']}" for row in rows])
        ax.set_title(title, fontsize=9)
        ax.margins(y=0.2)
    handles, names = axes[0].get_legend_handles_labels()
    fig.legend(handles, names, loc="lower center", ncol=len(servers), fontsize=8)
    fig.suptitle(f"Streaming {figures['tokens']} tokens a request from a small GPT-2 (random "
                 f"weights), N workers or interpreters, 2N closed-loop clients; in brackets: "
                 "multipy / that server\n" + run_line(figures), fontsize=9)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--counts", default="1,2", help="N: interpreters and workers (1,2)")
    parser.add_argument("--servers", default=",".join(SERVERS),
                        help="from multipy, litserve, kserve (all three)")
    parser.add_argument("--tokens", type=int, default=32, help="new tokens a request (32)")
    parser.add_argument("--seconds", type=float, default=10, help="timed seconds per run (10)")
    parser.add_argument("--warm-up", type=float, default=3, help="untimed seconds first (3)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="runs of each server, taking turns; medians reported (3)")
    parser.add_argument("--peer-venv", default=os.path.join(ROOT, ".venv", "kserve-stream"),
                        help="KServe's environment with transformers, made if missing "
                             "(.venv/kserve-stream)")
    parser.add_argument("--peer-python", help="a python that has KServe and transformers, "
                                              "instead of --peer-venv")
    parser.add_argument("--json", help="also write the figures to this file")
    parser.add_argument("--plot", help="also plot the figures, and the ratios, into this PNG")
    parser.add_argument("--replot", help="plot (--plot) and print this --json file's figures; "
                                         "run nothing")
    args = parser.parse_args()
    if args.replot:
        with open(args.replot) as f:
            figures = json.load(f)
    else:
        servers = tuple(args.servers.split(","))
        if not servers or set(servers) - set(SERVERS):
            parser.error(f"--servers: from {', '.join(SERVERS)}")
        args.kserve_python = (args.peer_python or ensure_peer_venv(
            args.peer_venv, PEER_PACKAGES, "kserve, torch, transformers")
            if "kserve" in servers else None)
        expected = expected_tokens(args.tokens)
        figures = {**provenance(), "tokens": args.tokens,
                   "setting": f"{args.tokens} new tokens a request; N workers or "
                              f"interpreters, 2N closed-loop client processes, "
                              f"{args.seconds:g} s after {args.warm_up:g} s of warm-up; the "
                              f"median of {args.rounds} round(s), the servers taking turns; "
                              f"{os.cpu_count()} cores",
                   "rows": []}
        for n in (int(n) for n in args.counts.split(",")):
            figures["rows"].append(measure(n, servers, expected, args))
            if args.json:  # what is measured so far survives a later failure
                with open(args.json, "w") as f:
                    json.dump(figures, f, indent=1)
    report(figures)
    if args.plot:
        plot(figures, args.plot)


if __name__ == "__main__":
    main()
