"""Micro-benchmarks, each printing a ratio against a peer measured in the same run.

- roundtrip: a no-op call, host thread -> interpreter -> host (median, p95), against a
  direct call and a multiprocessing pipe round trip.
- lending:   a small tensor or array in a call, or a new one in its result, against a
  no-op call (the cost of lending it, by DLPack, and of aliasing it).
- transfer:  a new tensor through a call and back, 1 KB to 256 MB, against a process
  pool (sent both ways as its users do: torch moves each new tensor into shared
  memory).  multipy aliases the tensors, copying nothing.
- startup:   n interpreters with torch imported, against n processes importing torch;
  and the exit of each (the process's end after the program's last line).
- memory:    ResNet-18 held by n interpreters (weights shared) against n processes each
  holding it: PSS of everything involved, and the weights' size W.
- threads:   tiny calls from n host threads, each on its own interpreter: calls/s in
  all, against n = 1 (the host's GIL is released for the whole of each call).
- ceiling:   the python_heavy model looped inside n interpreters at once, no calls
  crossing, against a loop in one host thread: the most any call path could reach;
  and the same model called from n host threads through calls, against that ceiling.
- small:     the `simple` model (a 3x10 input) and `Linear(8, 8)` on a (1, 8) input,
  each call against a plain host thread's: looped inside an interpreter, one entry per
  call with its input already inside (no tensor crossing), through Obj.call_value (a
  tensor each way), through a ReplicatedObj; each ratio per round, the median and range.
- keys:      pthread_getspecific and pthread_setspecific, looped in C inside an
  interpreter (each interpreter's own keys, docs/design.md) against glibc's in the host.
- defaults:  ResNet-18 (64x64) from n host threads on n interpreters with the manager's
  torch defaults, against the same with torch.set_num_threads(1) set by hand in every
  calling thread, torch's own thread count (cores per interpreter), and n plain host
  threads (grad off everywhere).

    multipy run benchmarks/micro.py [roundtrip lending transfer threads startup memory ceiling small keys defaults]
"""
from __future__ import annotations

import argparse
import concurrent.futures
import functools
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
from typing import Callable
import threading
import time

import multipy

EXAMPLES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples")
MB = 1 << 20


def _median_p95(call, count: int, make_argument=None) -> tuple[float, float]:
    """Median and p95 of call() (or call(make_argument()), the making not timed)."""
    samples = []
    for _ in range(count):
        arguments = () if make_argument is None else (make_argument(),)
        start = time.perf_counter()
        call(*arguments)
        samples.append(time.perf_counter() - start)
    samples.sort()
    return statistics.median(samples), samples[int(len(samples) * 0.95)]


def _noop() -> None:
    pass


def _echo(value):
    return value


def _serve_echo(connection) -> None:
    while (message := connection.recv()) is not None:
        connection.send(message)


def roundtrip(count: int) -> None:
    with multipy.InterpreterManager(1) as manager, manager.acquire_one() as s:
        manager.register_module_source("micro_noop", "def noop():\n    pass\n")
        noop = s.global_("micro_noop", "noop")
        _median_p95(noop, 2000)  # warm-up
        inside = _median_p95(noop, count)
    direct = _median_p95(_noop, count)
    here, there = multiprocessing.Pipe()
    process = multiprocessing.Process(target=_serve_echo, args=(there,))
    process.start()
    call = lambda: (here.send(("noop", ())), here.recv())  # noqa: E731
    _median_p95(call, 2000)
    pipe = _median_p95(call, count)
    here.send(None)
    process.join()
    print(f"\nno-op call round trip, {count} calls: median / p95")
    for label, (median, p95) in (("multipy interpreter", inside), ("direct call", direct),
                                 ("multiprocessing pipe", pipe)):
        print(f"  {label:22s} {median * 1e6:8.1f} / {p95 * 1e6:8.1f} us")
    print(f"  pipe / multipy: {pipe[0] / inside[0]:.2f}x")


def _calls_per_second(calls: list, seconds: float, prepare=None) -> float:
    """Total calls/s of len(calls) host threads, thread i calling calls[i] for seconds
    (after prepare(i), if given)."""
    done = [0] * len(calls)
    start = threading.Barrier(len(calls) + 1)

    def run(i: int) -> None:
        call = calls[i]
        if prepare is not None:
            prepare(i)
        call()
        start.wait()
        count, end = 0, time.perf_counter() + seconds
        while time.perf_counter() < end:
            call()
            count += 1
        done[i] = count

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for thread in threads:
        thread.start()
    start.wait()
    for thread in threads:
        thread.join()
    return sum(done) / seconds


def threads(counts: list[int], seconds: float = 2.0) -> None:
    print(f"\ntiny calls (a no-op returning None) from n host threads, each on its own "
          f"interpreter, {seconds} s: calls/s in all")
    with multipy.InterpreterManager(max(counts)) as manager:
        manager.register_module_source("micro_noop", "def noop():\n    pass\n")
        noops = []
        for interpreter in manager.all_instances():
            with interpreter.acquire_session() as s:
                noops.append(functools.partial(s.global_("micro_noop", "noop").call_value, None))
        one = None
        for n in counts:
            rate = _calls_per_second(noops[:n], seconds)
            one = one or rate
            print(f"  n={n:2d}  {rate:10.0f} calls/s   ({rate / one:.2f}x n=1)")


def transfer(count: int) -> None:
    import torch

    print(f"\ntensor through a call and back, median of {count}: multipy with the same tensor "
          f"each call | multipy, a new tensor each call | process pool, new tensor | ratio"
          f"\n  (a new tensor's time includes freeing the previous one, on both sides)")
    with multipy.InterpreterManager(1) as manager, manager.acquire_one() as s, \
            concurrent.futures.ProcessPoolExecutor(1) as pool:
        manager.register_module_source("micro_echo", "def echo(t):\n    return t\n")
        echo = s.global_("micro_echo", "echo")
        pool.submit(_echo, 0).result()
        first = None
        for size in (1 << 10, 64 << 10, 1 << 20, 16 << 20, 256 << 20):
            same = torch.ones(size // 4)
            ours_same = _median_p95(lambda: echo(same).deref(), count)[0]
            fresh = lambda: torch.ones(size // 4)  # noqa: E731
            ours = _median_p95(lambda t: echo(t).deref(), count, fresh)[0]
            theirs = _median_p95(lambda t: pool.submit(_echo, t).result(), max(5, count // 10),
                                 fresh)[0]
            first = first or ours_same
            print(f"  {size / 1024:>9.0f} KB  {ours_same * 1e6:9.1f} ({ours_same / first:4.2f}x 1 KB)"
                  f" | {ours * 1e6:9.1f} | {theirs * 1e6:10.1f} | {theirs / ours:6.1f}x")


def _interleaved_medians(calls: list, count: int) -> list[float]:
    """The median time of each call, the calls taking turns (a busy spell hits all)."""
    samples: list[list[float]] = [[] for _ in calls]
    for _ in range(count):
        for call, each in zip(calls, samples):
            start = time.perf_counter()
            call()
            each.append(time.perf_counter() - start)
    return [statistics.median(each) for each in samples]


def lending(count: int) -> None:
    import numpy
    import torch

    print(f"\na small tensor or array (2x48x16 float32) in a call or its result, medians of "
          f"{count} calls taking turns: the time, and what it adds to a no-op call")
    with multipy.InterpreterManager(1) as manager, manager.acquire_one() as s:
        manager.register_module_source("micro_lend", (
            "import numpy, torch\n"
            "tensor, array = torch.zeros(2, 48, 16), numpy.zeros((2, 48, 16), numpy.float32)\n"
            "def noop(*args):\n    pass\n"
            "def make_tensor():\n    return tensor.clone()\n"
            "def make_array():\n    return array.copy()\n"))
        noop = s.global_("micro_lend", "noop")
        make_tensor, make_array = (s.global_("micro_lend", name) for name in ("make_tensor", "make_array"))
        tensor, array = torch.zeros(2, 48, 16), numpy.zeros((2, 48, 16), numpy.float32)
        calls = {"no-op call": lambda: noop.call_value(None),
                 "a tensor in": lambda: noop.call_value(None, (tensor,)),
                 "an array in": lambda: noop.call_value(None, (array,)),
                 "a new tensor out": lambda: make_tensor.call_value(None),
                 "a new array out": lambda: make_array.call_value(None)}
        _interleaved_medians(list(calls.values()), 1000)  # warm-up
        medians = _interleaved_medians(list(calls.values()), count)
    for (label, _), median in zip(calls.items(), medians):
        print(f"  {label:18s} {median * 1e6:7.1f} us   +{(median - medians[0]) * 1e6:5.1f} us")


def _import_torch(index: int, manager) -> None:
    with manager[index].acquire_session() as s:
        s.global_("torch", "tensor")


def startup(counts: list[int]) -> None:
    print("\nstart n interpreters / processes with torch imported (all at once), and exit "
          "(from the end of the program's last line to the end of the process)")
    base = {}
    for n in counts:
        started = time.perf_counter()
        processes = [subprocess.Popen([sys.executable, "-c", "import time, torch; "
                                       "print(time.time(), flush=True)"],
                                      stdout=subprocess.PIPE, text=True) for _ in range(n)]
        stamps = [float(process.communicate()[0]) for process in processes]
        process_time = time.perf_counter() - started
        process_exit = time.time() - max(stamps)
        done = subprocess.run([sys.executable, __file__, "_start_interpreters", str(n)],
                              capture_output=True, text=True, check=True)
        ended = time.time()
        ours, last_line = (float(x) for x in done.stdout.split())
        base.setdefault("ours", ours)
        base.setdefault("processes", process_time)
        print(f"  n={n:2d}  multipy {ours:6.2f} s ({ours / base['ours']:.2f}x n=1)   "
              f"processes {process_time:6.2f} s ({process_time / base['processes']:.2f}x n=1)"
              f"   exit: multipy {ended - last_line:5.2f} s, processes {process_exit:5.2f} s")


def _start_interpreters(n: int) -> None:
    """In a fresh process: the time to start n interpreters and import torch in each;
    then the wall-clock time of the program's end, when exit begins."""
    started = time.perf_counter()
    with multipy.InterpreterManager(n) as manager:
        threads = [threading.Thread(target=_import_torch, args=(i, manager)) for i in range(n)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        print(time.perf_counter() - started)
    print(time.time(), flush=True)


def _pss(pid: int | str = "self") -> int:
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no Pss")


def _hold_model(path: str) -> None:
    import warnings

    import torch

    warnings.filterwarnings("ignore", message="TypedStorage is deprecated")
    global _held
    _held = torch.package.PackageImporter(path).load_pickle("model", "model.pkl")


def memory(counts: list[int]) -> None:
    sys.path.insert(0, EXAMPLES)
    from generate_examples import generate

    with tempfile.TemporaryDirectory() as directory:
        path = generate(directory, ["resnet"])["resnet"]
        print("\nResNet-18 held by n interpreters vs n worker processes: PSS (pages shared "
              "between processes split among them), whole = with the host / parent")
        for n in counts:
            done = subprocess.run([sys.executable, __file__, "_interpreters_memory", str(n), path],
                                  capture_output=True, text=True, check=True)
            host, whole, weights = map(int, done.stdout.split())
            done = subprocess.run([sys.executable, __file__, "_workers_memory", str(n), path],
                                  capture_output=True, text=True, check=True)
            parent, workers = map(int, done.stdout.split())
            print(f"  n={n}  per replica: multipy {(whole - host) / n / MB:6.1f} MB, processes "
                  f"{workers / n / MB:6.1f} MB   whole: multipy {whole / MB:7.1f} MB, processes "
                  f"{(parent + workers) / MB:7.1f} MB   (W = {weights / MB:.1f} MB)")


def _noop_pid(_) -> int:
    return os.getpid()


def _workers_memory(n: int, path: str) -> None:
    """In a fresh process (torch imported, as a pool's parent has): its PSS, and the sum
    of its n workers' PSS, each worker holding the model."""
    import torch  # noqa: F401

    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(n, mp_context=context, initializer=_hold_model,
                                                initargs=(path,)) as pool:
        list(pool.map(_noop_pid, range(n)))
        print(_pss(), sum(_pss(pid) for pid in pool._processes))


def _interpreters_memory(n: int, path: str) -> None:
    """In a fresh process: PSS of the host (torch imported), then with n interpreters
    each holding the model (whose weights the host read once); and W."""
    import warnings

    import torch  # noqa: F401

    warnings.filterwarnings("ignore", message="TypedStorage is deprecated")
    host = _pss()
    with multipy.InterpreterManager(n) as manager:
        package = manager.load_package(path)
        weights = sum(t.nbytes for t in package._shared_storages().values())
        replicated = package.load_pickle("model", "model.pkl")
        for interpreter in manager.all_instances():
            replicated.acquire_session(interpreter).close()
        print(host, _pss(), weights)


_LOOP = """
import time, torch
def loop(model, inputs, seconds):
    torch.set_num_threads(1)  # torch keeps both per thread
    torch.set_grad_enabled(False)
    calls, end = 0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        model(*inputs)
        calls += 1
    return calls / seconds
"""


def ceiling(counts: list[int], seconds: float = 2.0) -> None:
    import torch

    sys.path.insert(0, EXAMPLES)
    from generate_examples import generate

    torch.set_num_threads(1)
    torch.set_grad_enabled(False)
    print(f"\npython_heavy looped for {seconds} s inside n interpreters at once (no call "
          f"crossing) against one host thread: calls/s")
    with tempfile.TemporaryDirectory() as directory, \
            multipy.InterpreterManager(max(counts)) as manager:
        path = generate(directory, ["python_heavy"])["python_heavy"]
        importer = torch.package.PackageImporter(path)
        model = importer.load_pickle("model", "model.pkl")
        inputs = importer.load_pickle("model", "example.pkl")
        manager.register_module_source("micro_loop", _LOOP)
        replicated = manager.load_package(path).load_pickle("model", "model.pkl")
        loops = []
        for interpreter in manager.all_instances():
            with replicated.acquire_session(interpreter) as s:
                s.global_("torch", "set_num_threads")(1)
                s.global_("torch", "set_grad_enabled")(False)
                loops.append((s.global_("micro_loop", "loop"), s.self))
        host_loop = {}
        exec(_LOOP, host_loop)
        for n in counts:
            host = host_loop["loop"](model, inputs, seconds)
            rates = [0.0] * n

            def run(i: int) -> None:
                loop, instance = loops[i]
                rates[i] = loop(instance, inputs, seconds).deref()

            threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            looped = sum(rates)
            calls = [functools.partial(replicated.instance(manager[i]).call_value, None, inputs)
                     for i in range(n)]

            def settings(i: int) -> None:  # torch keeps these per thread, in each interpreter
                with manager[i].acquire_session() as s:
                    s.global_("torch", "set_num_threads")(1)
                    s.global_("torch", "set_grad_enabled")(False)

            through = _calls_per_second(calls, seconds, settings)
            print(f"  n={n}  looped inside {looped:8.1f}   one host thread {host:8.1f}   "
                  f"ratio {looped / host:.2f}x   through calls {through:8.1f} "
                  f"({through / looped:.2f}x looped inside)")


_SMALL = """
import statistics, time
held = {}
def hold(model, x):
    held["model"], held["x"] = model, x.clone()
def one():
    held["model"](held["x"])
def twice():
    held["model"](held["x"])
    held["model"](held["x"])
def noop(*args):
    pass
def loop(count):
    model, x, samples = held["model"], held["x"], []
    for _ in range(count):
        start = time.perf_counter()
        model(x)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)
"""


#: the models the small benchmark calls: name -> what it is
SMALL_MODELS = {"simple": "the simple model (relu(x @ w + b), a 3x10 input)",
                "linear": "Linear(8, 8) on a (1, 8) input"}


def _small_package(directory: str, model: str) -> str:
    """The archive of one of SMALL_MODELS, written into directory: its path."""
    import torch

    if model == "simple":
        sys.path.insert(0, EXAMPLES)
        from generate_examples import generate

        return generate(directory, ["simple"])["simple"]
    torch.manual_seed(0)
    path = os.path.join(directory, f"{model}.pt")
    with torch.package.PackageExporter(path) as exporter:
        exporter.extern("torch.**")
        exporter.save_pickle("model", "model.pkl", torch.nn.Linear(8, 8))
        exporter.save_pickle("model", "example.pkl", (torch.randn(1, 8),))
    return path


def simple_calls(directory: str, manager: multipy.InterpreterManager,
                 model: str = "simple") -> dict[str, Callable]:
    """A model of SMALL_MODELS, written to directory, called in each way that the
    benchmarks compare (also benchmarks/call_instructions.py): way -> a function that
    makes one call.  "host": a plain host thread; on manager's interpreter 0, "noop" and
    "tensor_in": a no-op call_value with nothing, or the input, crossing; "one": one
    entry a call, its input inside; "twice": the same entry calling it twice (what a
    call after the first costs inside); "call_value": Obj.call_value, a tensor each way;
    "replicated": a ReplicatedObj's call; "balancer": occupy_one() and hand_back()
    alone; and "loop" (count): the median of count calls looped inside."""
    import torch

    path = _small_package(directory, model)
    importer = torch.package.PackageImporter(path)
    host_model = importer.load_pickle("model", "model.pkl")
    inputs = importer.load_pickle("model", "example.pkl")
    replicated = manager.load_package(path).load_pickle("model", "model.pkl")
    replicated.warm_up(*inputs)
    manager.register_module_source("micro_small", _SMALL)
    with replicated.acquire_session(manager[0]) as s:
        s.global_("micro_small", "hold")(s.self, inputs[0])
        loop, one, twice, noop = (s.global_("micro_small", name)
                                  for name in ("loop", "one", "twice", "noop"))
        instance = s.self
    return {"host": lambda: host_model(*inputs),
            "noop": lambda: noop.call_value(None),
            "tensor_in": lambda: noop.call_value(None, inputs),
            "one": lambda: one.call_value(None),
            "twice": lambda: twice.call_value(None),
            "call_value": lambda: instance.call_value(None, inputs),
            "replicated": lambda: replicated(*inputs),
            "balancer": lambda: manager.occupy_one().hand_back(),
            "loop": lambda count: loop.call_value(None, (count,))}


def small(count: int, rounds: int = 5) -> None:
    """Each model of SMALL_MODELS called in each way, against a plain host thread in the
    same run: per way the median time of a call in a block of count, the blocks taking
    turns, and over the rounds the median and range of the ratio to the thread's."""
    import torch

    torch.set_num_threads(1)
    torch.set_grad_enabled(False)
    for model, title in SMALL_MODELS.items():
        print(f"\n{title}: the median time of a call in a block of {count}, the blocks "
              f"taking turns, the median of {rounds} rounds; and the host thread's time over "
              f"it (its throughput against a plain host thread's: median, [range])")
        with tempfile.TemporaryDirectory() as directory, \
                multipy.InterpreterManager(1, torch_threads=1, grad_enabled=False) as manager:
            ways = simple_calls(directory, manager, model)
            calls = {"a plain host thread": ways["host"],
                     "no-op call_value, nothing crossing": ways["noop"],
                     "one entry a call, its input inside": ways["one"],
                     "one entry, the model called twice": ways["twice"],
                     "Obj.call_value, a tensor each way": ways["call_value"],
                     "a ReplicatedObj's call": ways["replicated"],
                     "occupy_one() and hand_back() alone": ways["balancer"],
                     "looped inside the interpreter": lambda: ways["loop"](count)}
            blocks: list[list[float]] = [[] for _ in calls]
            for _ in range(rounds):  # each call in a block of its own: caches warm for it alone
                for (label, call), each in zip(calls.items(), blocks):
                    if label.startswith("looped"):
                        each.append(call())
                    else:
                        each.append(_median_p95(call, count)[0])
        for label, each in zip(calls, blocks):
            ratios = sorted(host / time for host, time in zip(blocks[0], each))
            ratio = "" if label.startswith("occupy") else (
                f"{statistics.median(ratios):5.2f}x  [{ratios[0]:.2f}-{ratios[-1]:.2f}]")
            print(f"  {label:36s} {statistics.median(each) * 1e6:7.2f} us   {ratio}")


def defaults(counts: list[int], seconds: float = 2.0, rounds: int = 3) -> None:
    import contextlib

    import torch

    sys.path.insert(0, EXAMPLES)
    from generate_examples import generate

    cores = len(os.sched_getaffinity(0))
    print(f"\nResNet-18 (64x64) from n host threads on n interpreters: calls/s, the median "
          f"of {rounds} rounds of {seconds} s, the set-ups taking turns ({cores} cores; grad "
          f"off everywhere)")
    with tempfile.TemporaryDirectory() as directory:
        path = generate(directory, ["resnet"])["resnet"]
        importer = torch.package.PackageImporter(path)
        host_model = importer.load_pickle("model", "model.pkl")
        inputs = (torch.randn(1, 3, 64, 64),)
        for n in counts:
            runs = {}
            with contextlib.ExitStack() as stack:
                for name, threads in (("defaults", None), ("by hand", cores), ("own", cores)):
                    manager = stack.enter_context(multipy.InterpreterManager(
                        n, torch_threads=threads, grad_enabled=False))
                    model = manager.load_package(path).load_pickle("model", "model.pkl")
                    model.warm_up(*inputs)
                    calls = [functools.partial(model.instance(manager[i]).call_value, None, inputs)
                             for i in range(n)]

                    def by_hand(i: int, manager=manager) -> None:  # torch keeps it per thread
                        with manager[i].acquire_session() as s:
                            s.global_("torch", "set_num_threads")(1)

                    runs[name] = (calls, by_hand if name == "by hand" else None)

                def plain(i: int) -> None:
                    torch.set_grad_enabled(False)

                runs["plain"] = ([functools.partial(host_model, *inputs)] * n, plain)
                figures = {name: [] for name in runs}
                for _ in range(rounds):
                    for name, (calls, prepare) in runs.items():
                        figures[name].append(_calls_per_second(calls, seconds, prepare))
            f = {name: statistics.median(values) for name, values in figures.items()}
            print(f"  n={n}  defaults ({max(1, cores // n)} thread(s) each) {f['defaults']:7.1f}"
                  f"   set_num_threads(1) by hand {f['by hand']:7.1f}   torch's own ({cores} "
                  f"each) {f['own']:7.1f}   plain host threads {f['plain']:7.1f}")
            print(f"        defaults / by hand {f['defaults'] / f['by hand']:.2f}x   defaults / "
                  f"plain threads {f['defaults'] / f['plain']:.2f}x   torch's own / by hand "
                  f"{f['own'] / f['by hand']:.2f}x")


_KEYS_LOOP = r"""
#include <pthread.h>
#include <time.h>
static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}
/* ns per pthread_getspecific (set: 0) or pthread_setspecific (set: 1), n of them */
double spin(long n, int set) {
    static pthread_key_t key;
    static int made;
    if (!made && pthread_key_create(&key, 0) == 0)
        made = 1;
    void *volatile sink = 0;
    pthread_setspecific(key, (void *)&sink);
    double start = now();
    for (long i = 0; i < n; i++) {
        if (set)
            pthread_setspecific(key, (void *)(i | 1));
        else
            sink = pthread_getspecific(key);
    }
    return (now() - start) / n * 1e9;
}
"""

_KEYS_INSIDE = """
import ctypes
def spin(path, n, set):
    lib = ctypes.CDLL(path)
    lib.spin.restype = ctypes.c_double
    lib.spin.argtypes = [ctypes.c_long, ctypes.c_int]
    return lib.spin(n, set)
"""


def keys(count: int = 20_000_000, rounds: int = 5) -> None:
    import ctypes

    with tempfile.TemporaryDirectory() as folder:
        source, library = os.path.join(folder, "loop.c"), os.path.join(folder, "libloop.so")
        with open(source, "w") as file:
            file.write(_KEYS_LOOP)
        subprocess.run(["gcc", "-O2", "-shared", "-fPIC", "-o", library, source], check=True)
        host = ctypes.CDLL(library)
        host.spin.restype = ctypes.c_double
        host.spin.argtypes = [ctypes.c_long, ctypes.c_int]
        with multipy.InterpreterManager(1) as manager, manager.acquire_one() as s:
            manager.register_module_source("micro_keys", _KEYS_INSIDE)
            inside = s.global_("micro_keys", "spin")
            print(f"\npthread keys, {count:,} calls looped in C, median of {rounds} rounds "
                  f"taking turns (ns per call)")
            for set_, name in ((0, "pthread_getspecific"), (1, "pthread_setspecific")):
                here, there = [], []
                for _ in range(rounds):
                    here.append(host.spin(count, set_))
                    there.append(inside(library, count, set_).deref())
                print(f"  {name}: glibc's in the host {statistics.median(here):5.2f}, an "
                      f"interpreter's own {statistics.median(there):5.2f} "
                      f"({statistics.median(there) / statistics.median(here):.2f}x)")


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1].startswith("_"):  # a measurement in a fresh process
        {"_start_interpreters": lambda: _start_interpreters(int(sys.argv[2])),
         "_interpreters_memory": lambda: _interpreters_memory(int(sys.argv[2]), sys.argv[3]),
         "_workers_memory": lambda: _workers_memory(int(sys.argv[2]), sys.argv[3]),
         }[sys.argv[1]]()
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("benchmarks", nargs="*",
                        default=["roundtrip", "lending", "transfer", "threads", "startup",
                                 "memory", "ceiling", "small", "defaults"])
    parser.add_argument("--calls", type=int, default=20_000, help="round trips to time (20000)")
    parser.add_argument("--counts", default="1,2,4",
                        help="n for threads, startup, memory and ceiling (1,2,4)")
    args = parser.parse_args()
    counts = [int(n) for n in args.counts.split(",")]
    for name in args.benchmarks:
        {"roundtrip": lambda: roundtrip(args.calls), "lending": lambda: lending(args.calls // 4),
         "transfer": lambda: transfer(50),
         "threads": lambda: threads(counts),
         "startup": lambda: startup(counts), "memory": lambda: memory(counts),
         "ceiling": lambda: ceiling(counts), "small": lambda: small(args.calls // 4),
         "keys": keys,
         "defaults": lambda: defaults(counts)}[name]()


if __name__ == "__main__":
    main()
