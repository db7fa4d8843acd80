"""The original's benchmark on the example packages: throughput and latency of n threads
calling a model, for several ways of running Python in parallel.

Strategies (each is a setup that yields one callable, shared by the n threads):

- ``one_python``: n threads calling a multipy ReplicatedObj on one interpreter (the
  original's one_python: its manager limited to one interpreter).
- ``multi_python``: n threads calling a multipy ReplicatedObj on n interpreters (at most 15).
- ``threads``: n threads sharing the host interpreter's model, loaded by
  torch.package.PackageImporter (the GIL baseline; n = 1 is plain single-thread Python).
- ``processes``: n threads submitting to a ProcessPoolExecutor(n) whose workers each
  loaded the package; inputs and outputs are pickled, as its users do.
- ``jit``: n threads on torch.jit.load of the TorchScript copy (models that have one).

Every thread warms up (calls for --warm-up seconds, at least once: the first calls of a
model in an interpreter run slower), then all call the model in a loop for the duration,
timing each call.  torch.set_num_threads(1) and grad off everywhere (host, worker
processes, interpreters), so the figures compare Python parallelism, not intra-op
threads.  Each strategy's output is checked against the package's expected output first.
Writes DIR/bench.csv (the original's columns and format, latencies in seconds, then
the device's memory in use) and DIR/bench.png, and prints a table and the ratios of
multi_python to its peers.

With ``--device cuda`` every strategy's model is on the GPU (its package loaded with that
map_location: on the interpreters, one copy of the weights that every replica aliases;
each worker process loads its own) and each work item ends with its output copied back
to host memory, so that it includes the GPU's work.  The input crosses to the
interpreters as a CUDA tensor, by device pointer; worker processes receive it by pickle
in host memory and copy it to the GPU.  ``device_memory_mib`` is the device's memory in
use (all processes, as cuMemGetInfo says) at the end of each timed run, while its
strategy is still set up; 0 on the CPU.  ``--batch N`` repeats the input along its first
dimension to N rows.

    multipy bench [--models python_heavy,simple,resnet] [--strategies ...] [--max-threads 4]
                  [--duration 1.5] [--warm-up 0.3] [--device cpu|cuda] [--batch N]
                  [--threads 1,8] [--out bench-results] [--no-plot]
"""
from __future__ import annotations

import argparse
import multiprocessing
import os
import platform
import shutil
import sys
import tempfile
import threading
import time
import warnings
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor, wait
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ContextManager, Iterator

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

import multipy
from multipy import _free_cores

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
from generate_examples import example_names, generate  # noqa: E402

THREAD_COUNTS = (1, 2, 4, 8, 16, 32, 40)
STRATEGIES = ("one_python", "multi_python", "threads", "processes", "jit")
COLUMNS = ("benchmark", "strategy", "n_threads", "work_items_completed", "work_items_per_second",
           "p25_latency", "p50_latency", "p95_latency", "device", "device_memory_mib")
PERCENTILES = (25, 50, 95)
MAX_INTERPRETERS = 15
SETTINGS = ("torch.set_num_threads(1) and grad off in the host, every worker process and "
            "every interpreter")

Call = Callable[[], Any]
Manager = multipy.InterpreterManager

warnings.filterwarnings("ignore", message="TypedStorage is deprecated")
warnings.filterwarnings("ignore", message="`torch.jit.load` is deprecated")


@dataclass
class Example:
    """One example package, loaded in the host (and on the manager, if there is one)."""

    name: str
    package: str
    jit: str | None
    inputs: tuple  # on the device
    expected: Any  # in host memory
    host_model: Any
    replicated: multipy.ReplicatedObj | None
    device: str = "cpu"
    host_inputs: tuple = ()  # in host memory, for worker processes


@dataclass
class Report:
    """One run: a row of the CSV (latencies in seconds)."""

    benchmark: str
    strategy: str
    n_threads: int
    work_items_completed: int
    work_items_per_second: float
    latencies: list[float]  # at PERCENTILES
    device: str = "cpu"
    device_memory_mib: float = 0.0

    def row(self) -> list[Any]:
        return [self.benchmark, self.strategy, self.n_threads, self.work_items_completed,
                self.work_items_per_second, *self.latencies, self.device,
                round(self.device_memory_mib)]


def use_one_thread() -> None:
    """The settings every host, worker process and interpreter runs with."""
    torch.set_num_threads(1)
    torch.set_grad_enabled(False)  # per thread: each benchmark thread calls it too


def to_host(value: Any) -> Any:
    """value with each tensor in it copied to host memory (tuples and lists kept)."""
    if isinstance(value, (tuple, list)):
        return type(value)(to_host(item) for item in value)
    return value.cpu() if isinstance(value, torch.Tensor) else value


def to_device(values: tuple, device: str) -> tuple:
    return tuple(v.to(device) if isinstance(v, torch.Tensor) else v for v in values)


def device_memory_mib(device: str) -> float:
    """The device's memory in use, by every process: 0 for the CPU."""
    if device == "cpu":
        return 0.0
    free, total = torch.cuda.mem_get_info(device)
    return (total - free) / 2**20


# -- strategies: (example, n, manager) -> a context manager yielding the call ---------------

@contextmanager
def threads(example: Example, n: int, manager: Manager | None) -> Iterator[Call]:
    """The model loaded in the host by PackageImporter."""
    yield lambda: to_host(example.host_model(*example.inputs))


def _replicated(example: Example, interpreters: int, manager: Manager) -> Call:
    """The ReplicatedObj, load-balanced over the manager's first ``interpreters``,
    materialised on each of them before timing."""
    manager.debug_limit_interpreters(interpreters)
    for interpreter in manager.all_instances()[:interpreters]:
        with example.replicated.acquire_session(interpreter):
            pass
    return lambda: to_host(example.replicated(*example.inputs))


@contextmanager
def one_python(example: Example, n: int, manager: Manager | None) -> Iterator[Call]:
    """The ReplicatedObj on one interpreter, shared by the n threads."""
    yield _replicated(example, 1, manager)


@contextmanager
def multi_python(example: Example, n: int, manager: Manager | None) -> Iterator[Call]:
    """The ReplicatedObj on min(n, 15) interpreters."""
    yield _replicated(example, min(n, len(manager)), manager)


_worker_model: Any = None
_worker_device = "cpu"


def _worker_load(package: str, device: str, ready: multiprocessing.synchronize.Barrier) -> None:
    """Process pool initializer: loads the model onto device, then waits for the other
    workers."""
    global _worker_model, _worker_device
    use_one_thread()
    _worker_device = device
    _worker_model = torch.package.PackageImporter(package).load_pickle(
        "model", "model.pkl", map_location=device)
    ready.wait(timeout=300)


def _worker_call(inputs: tuple) -> Any:
    """A work item in a pool worker: the inputs and the output cross by pickle, in host
    memory."""
    return to_host(_worker_model(*to_device(inputs, _worker_device)))


def _worker_ready() -> None:
    """A no-op work item, to start the pool's workers."""


@contextmanager
def processes(example: Example, n: int, manager: Manager | None) -> Iterator[Call]:
    """A ProcessPoolExecutor(n) (spawned: this process has interpreter threads) whose n
    workers have all loaded the model before timing starts."""
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(n, mp_context=context, initializer=_worker_load,
                             initargs=(example.package, example.device,
                                       context.Barrier(n))) as pool:
        # A pool starts a worker per submission while none is idle; none is until all n
        # have loaded the model (the barrier), so these n submissions start all n.
        for future in [pool.submit(_worker_ready) for _ in range(n)]:
            future.result()
        yield lambda: pool.submit(_worker_call, example.host_inputs).result()


@contextmanager
def jit(example: Example, n: int, manager: Manager | None) -> Iterator[Call]:
    """The TorchScript copy, loaded in the host."""
    module = torch.jit.load(example.jit, map_location=example.device)
    yield lambda: to_host(module(*example.inputs))


SETUPS: dict[str, Callable[..., ContextManager[Call]]] = {
    "one_python": one_python, "multi_python": multi_python, "threads": threads,
    "processes": processes, "jit": jit,
}
#: Strategies that run on the manager's interpreters.
ON_INTERPRETERS = ("one_python", "multi_python")


def thread_counts(strategy: str, example: Example, max_threads: int,
                  chosen: list[int] | None = None) -> list[int]:
    """The n the strategy runs with on example (none for jit without a TorchScript copy):
    chosen, or THREAD_COUNTS up to max_threads."""
    if strategy == "jit" and example.jit is None:
        return []
    return chosen or [n for n in THREAD_COUNTS if n <= max_threads]


# -- measuring -----------------------------------------------------------------------------

def _leaves(value: Any) -> list[Any]:
    if isinstance(value, (tuple, list)):
        return [leaf for item in value for leaf in _leaves(item)]
    return [value]


def check(actual: Any, expected: Any, what: str) -> None:
    """Raises unless actual has expected's tensors (nesting of tuples and lists aside)."""
    got, want = _leaves(actual), _leaves(expected)
    if len(got) != len(want) or not all(
            torch.allclose(g, w, rtol=1e-4, atol=1e-5) for g, w in zip(got, want)):
        raise AssertionError(f"{what}: output differs from expected.pkl")


def measure(call: Call, n: int, duration: float, warm_up: float) -> tuple[list[float], float]:
    """Runs call on n threads: warm-up calls for warm_up seconds (at least one) each,
    then calls until duration has passed (at least one each).  Returns every timed
    call's latency and the elapsed seconds."""
    start: list[float] = []
    barrier = threading.Barrier(n, action=lambda: start.append(time.perf_counter()))

    def loop() -> list[float]:
        torch.set_grad_enabled(False)
        try:
            warm_until = time.perf_counter() + warm_up
            call()
            while time.perf_counter() < warm_until:
                call()
        except BaseException:
            barrier.abort()
            raise
        barrier.wait()
        deadline = start[0] + duration
        latencies: list[float] = []
        while not latencies or time.perf_counter() < deadline:
            begin = time.perf_counter()
            call()
            latencies.append(time.perf_counter() - begin)
        return latencies

    with ThreadPoolExecutor(n) as pool:
        futures = [pool.submit(loop) for _ in range(n)]
        wait(futures)
    elapsed = time.perf_counter() - start[0] if start else 0.0
    # A failed warm-up breaks the barrier for the others: raise the failure itself first.
    futures.sort(key=lambda f: isinstance(f.exception(), threading.BrokenBarrierError))
    return [latency for future in futures for latency in future.result()], elapsed


def percentiles(latencies: list[float]) -> list[float]:
    """The latencies at PERCENTILES, picked as the original does."""
    ordered = sorted(latencies)
    return [ordered[min(len(ordered) - 1, int(len(ordered) * p / 100))] for p in PERCENTILES]


def run(example: Example, strategy: str, n: int, duration: float, warm_up: float,
        manager: Manager | None) -> Report:
    """One benchmark run: set the strategy up, check its output, time it, tear it down."""
    with SETUPS[strategy](example, n, manager) as call:
        check(call(), example.expected, f"{example.name}/{strategy}")
        latencies, elapsed = measure(call, n, duration, warm_up)
        memory = device_memory_mib(example.device)
    return Report(example.name, strategy, n, len(latencies), len(latencies) / elapsed,
                  percentiles(latencies), example.device, memory)


# -- set-up and output ---------------------------------------------------------------------

def start_manager(count: int) -> Manager:
    """A manager of count interpreters running torch with one intra-op thread and grad
    off, as the host does (the manager gives every thread that calls in these settings)."""
    return multipy.InterpreterManager(count, torch_threads=1, grad_enabled=False)


def load_example(name: str, package: str, manager: Manager | None, device: str = "cpu",
                 batch: int | None = None) -> Example:
    """The example's model in the host (and on manager) on device, its input (repeated to
    batch rows) and expected output (the package's, or the host model's for a batch)."""
    importer = torch.package.PackageImporter(package)
    jit_path = package.replace(".pt", "_jit.pt")
    host_inputs = importer.load_pickle("model", "example.pkl")
    if batch is not None:
        host_inputs = tuple(v[:1].expand(batch, *v.shape[1:]).contiguous()
                            if isinstance(v, torch.Tensor) else v for v in host_inputs)
    model = importer.load_pickle("model", "model.pkl", map_location=device)
    inputs = to_device(host_inputs, device)
    expected = (importer.load_pickle("model", "expected.pkl") if batch is None
                else to_host(model(*inputs)))
    replicated = (manager.load_package(package).load_pickle("model", "model.pkl",
                                                            map_location=device)
                  if manager else None)
    return Example(name, package, jit_path if os.path.exists(jit_path) else None, inputs,
                   expected, model, replicated, device, host_inputs)


def write_csv(reports: list[Report], path: Path) -> None:
    """The original's format: a header, then comma-and-space separated rows."""
    lines = [", ".join(COLUMNS)] + [", ".join(map(str, r.row())) for r in reports]
    path.write_text("\n".join(lines) + "\n")


def table(reports: list[Report]) -> Table:
    """The reports as a terminal table, latencies in milliseconds."""
    result = Table(title="multipy bench", caption=SETTINGS)
    for heading in ("model", "strategy", "n", "items", "items/s",
                    *(f"p{p} ms" for p in PERCENTILES), "device MiB"):
        result.add_column(heading, justify="left" if heading in ("model", "strategy") else "right")
    for r in reports:
        result.add_row(r.benchmark, r.strategy, str(r.n_threads), str(r.work_items_completed),
                       f"{r.work_items_per_second:,.1f}", *(f"{s * 1e3:.3f}" for s in r.latencies),
                       f"{r.device_memory_mib:,.0f}" if r.device != "cpu" else "-")
    return result


#: multi_python's peers in the ratio table: (strategy, n), None for the same n.
PEERS = (("one_python", 1), ("one_python", None), ("threads", 1), ("threads", None),
         ("processes", None))


def ratios(reports: list[Report]) -> Table:
    """multi_python's throughput at each n over each peer's (see PEERS)."""
    rate = {(r.benchmark, r.strategy, r.n_threads): r.work_items_per_second for r in reports}
    result = Table(title="multi_python throughput / peer's",
                   caption="threads n=1 is plain single-thread Python")
    for heading in ("model", "n", *(f"{s} n={n or 'same'}" for s, n in PEERS)):
        result.add_column(heading, justify="left" if heading == "model" else "right")
    for r in reports:
        if r.strategy != "multi_python":
            continue
        cells = []
        for strategy, n in PEERS:
            peer = rate.get((r.benchmark, strategy, n or r.n_threads))
            cells.append(f"{r.work_items_per_second / peer:.2f}x" if peer else "-")
        result.add_row(r.benchmark, str(r.n_threads), *cells)
    return result


def plot(reports: list[Report], path: Path) -> None:
    """Per model: throughput against n, and p50 (solid) / p95 (dashed) latency against n;
    plain single-thread Python (threads, n = 1) as a dotted line."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib import ticker

    models = list(dict.fromkeys(r.benchmark for r in reports))
    figure, axes = plt.subplots(len(models), 2, figsize=(11, 3.6 * len(models)), squeeze=False)
    colours = dict(zip(STRATEGIES, plt.rcParams["axes.prop_cycle"].by_key()["color"]))
    for (throughput, latency), model in zip(axes, models):
        for strategy in STRATEGIES:
            runs = [r for r in reports if r.benchmark == model and r.strategy == strategy]
            if not runs:
                continue
            colour = colours[strategy]
            if strategy == "threads" and runs[0].n_threads == 1:  # the reference across every n
                throughput.axhline(runs[0].work_items_per_second, color="grey", linestyle=":",
                                   label="plain Python, 1 thread")
                latency.axhline(runs[0].latencies[1] * 1e3, color="grey", linestyle=":")
            n = [r.n_threads for r in runs]
            throughput.plot(n, [r.work_items_per_second for r in runs], "o-", color=colour,
                            label=strategy)
            latency.plot(n, [r.latencies[1] * 1e3 for r in runs], "o-", color=colour)
            latency.plot(n, [r.latencies[2] * 1e3 for r in runs], "x--", color=colour)
        throughput.set(title=f"{model}: throughput", ylabel="items/s")
        latency.set(title=f"{model}: latency, p50 (solid) and p95 (dashed)", ylabel="ms")
        for ax in (throughput, latency):
            ax.set(xlabel="threads (n)", yscale="log")
            ax.set_xscale("log", base=2)
            ax.set_xticks(sorted({r.n_threads for r in reports}), minor=False)
            ax.xaxis.set_major_formatter(ticker.ScalarFormatter())
            ax.xaxis.set_minor_locator(ticker.NullLocator())
            ax.yaxis.set_major_formatter(ticker.LogFormatter())
            ax.yaxis.set_minor_formatter(ticker.LogFormatter(labelOnlyBase=False))
            ax.grid(alpha=0.3, which="both")
        throughput.legend(fontsize="small")
    figure.suptitle(f"multipy bench ({os.cpu_count()} cores; {SETTINGS})", fontsize="small")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="multipy bench", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--models", default="python_heavy,simple,resnet",
                        help="comma-separated example names (examples/generate_examples.py)")
    parser.add_argument("--strategies", default=",".join(STRATEGIES),
                        help="comma-separated, from " + ", ".join(STRATEGIES))
    parser.add_argument("--max-threads", type=int, default=4,
                        help=f"largest n; n runs through {', '.join(map(str, THREAD_COUNTS))}")
    parser.add_argument("--duration", type=float, default=1.5, help="seconds per run")
    parser.add_argument("--warm-up", type=float, default=0.3,
                        help="seconds each thread calls before the timed run")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                        help="where every strategy runs the model")
    parser.add_argument("--batch", type=int, default=None,
                        help="rows of input: the example's first row repeated (default: "
                             "the example's input as it is)")
    parser.add_argument("--threads", default=None,
                        help="comma-separated n to run (default: every n up to --max-threads)")
    parser.add_argument("--out", type=Path, default=Path("bench-results"), help="output folder")
    parser.add_argument("--no-plot", action="store_true", help="skip DIR/bench.png")
    args = parser.parse_args(argv)
    args.models = args.models.split(",")
    args.strategies = args.strategies.split(",")
    unknown = set(args.strategies) - set(STRATEGIES)
    if unknown:
        parser.error(f"unknown strategies: {', '.join(sorted(unknown))}")
    if args.max_threads < 1 or args.duration <= 0 or args.warm_up < 0:
        parser.error("--max-threads and --duration must be positive, --warm-up not negative")
    if args.batch is not None and args.batch < 1:
        parser.error("--batch must be positive")
    if args.threads is not None:
        args.threads = sorted({int(n) for n in args.threads.split(",")})
        args.max_threads = args.threads[-1]
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device here")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    console = Console(width=max(100, shutil.get_terminal_size().columns))
    console.print(f"{SETTINGS}; {os.cpu_count()} cores, Python {platform.python_version()}, "
                  f"torch {torch.__version__}"
                  + (f", {torch.cuda.get_device_name()}" if args.device == "cuda" else ""))
    most = min(args.max_threads, os.cpu_count() or 1)
    console.print(_free_cores.describe(most, _free_cores.measure(most)))
    use_one_thread()
    with ExitStack() as stack:
        unknown = set(args.models) - set(example_names())
        if unknown:
            sys.exit(f"multipy bench: unknown models {', '.join(sorted(unknown))} "
                     f"(known: {', '.join(example_names())})")
        packages = generate(stack.enter_context(tempfile.TemporaryDirectory()), args.models)
        manager = (stack.enter_context(start_manager(min(args.max_threads, MAX_INTERPRETERS)))
                   if set(ON_INTERPRETERS) & set(args.strategies) else None)
        examples = [load_example(name, packages[name], manager, args.device, args.batch)
                    for name in args.models]
        plan = [(example, strategy, n) for example in examples for strategy in args.strategies
                for n in thread_counts(strategy, example, args.max_threads, args.threads)]
        reports = []
        columns = (TextColumn("{task.description:32}"), BarColumn(), MofNCompleteColumn(),
                   TimeElapsedColumn())
        with Progress(*columns, console=console) as progress:
            task = progress.add_task("starting", total=len(plan))
            for example, strategy, n in plan:
                progress.update(task, description=f"{example.name} {strategy} n={n}")
                reports.append(run(example, strategy, n, args.duration, args.warm_up, manager))
                progress.advance(task)
    args.out.mkdir(parents=True, exist_ok=True)
    write_csv(reports, args.out / "bench.csv")
    console.print(table(reports))
    console.print(ratios(reports))
    written = [args.out / "bench.csv"]
    if not args.no_plot:
        plot(reports, args.out / "bench.png")
        written.append(args.out / "bench.png")
    console.print("wrote " + ", ".join(map(str, written)))


if __name__ == "__main__":
    main()
