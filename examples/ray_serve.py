"""multipy on Ray Serve: the example Python-heavy package served by replicas of a Ray
Serve deployment, each a process of several interpreters, answering the Open Inference
Protocol through Ray Serve's HTTP proxy, exactly as `multipy serve` answers it.

Starts a local Ray (ray.init(num_cpus=2)), deploys 2 replicas x 2 interpreters, checks
in each replica that it started with room for 15 interpreters (the glibc tunables that
the deployment's runtime environment gives it), sends 100 concurrent inference requests
with tritonclient.http, checks every answer against the model run eagerly here, shuts
Ray down and prints, as its last line, `ray-serve ok: N/100 correct`.  Exits 1 if any
answer was wrong.  Needs the 'ray' extra (pip install -e '.[ray]').

    python examples/ray_serve.py [--replicas 2] [--interpreters 2] [--requests 100]
"""
from __future__ import annotations

import argparse
import os
import socket
import sys
import tempfile
import threading

HERE = os.path.dirname(os.path.abspath(__file__))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, default=2, help="replica processes (2)")
    parser.add_argument("--interpreters", type=int, default=2,
                        help="interpreters in each replica (2)")
    parser.add_argument("--requests", type=int, default=100,
                        help="concurrent requests, all sent at once (100)")
    parser.add_argument("--num-cpus", type=int, default=2,
                        help="the local Ray's CPUs, shared by the replicas (2)")
    parser.add_argument("--port", type=int, default=0,
                        help="Ray Serve's HTTP port (default: a free one)")
    args = parser.parse_args()

    import numpy as np
    import ray
    import torch
    import torch.package
    import tritonclient.http as httpclient
    from ray import serve

    from multipy.serve.host.models import ModelSpec
    from multipy.serve.on_ray import APP_NAME, deployment, replicas_seen
    from multipy.serve.host.service import Options

    sys.path.insert(0, HERE)
    from generate_examples import generate

    port = args.port or _free_port()
    with tempfile.TemporaryDirectory() as directory:
        path = generate(directory, ["python_heavy"])["python_heavy"]
        model = torch.package.PackageImporter(path).load_pickle("model", "model.pkl")
        generator = np.random.default_rng(0)
        inputs = [generator.standard_normal((1 + k % 3, 48, 16), np.float32)
                  for k in range(args.requests)]
        with torch.no_grad():
            expected = [model(torch.from_numpy(x)).numpy() for x in inputs]

        ray.init(address="local", num_cpus=args.num_cpus, include_dashboard=False)
        try:
            serve.start(http_options={"host": "127.0.0.1", "port": port})
            options = Options((ModelSpec("python_heavy", path),), args.interpreters)
            # Each replica reserves an equal share of the CPUs, so that all of them fit.
            serve.run(deployment(options, args.replicas,
                                 replica_cpus=args.num_cpus / args.replicas),
                      name=APP_NAME, route_prefix="/")
            replicas = replicas_seen(APP_NAME, args.replicas)
            for about in replicas:
                room = about["room"]
                print(f"replica pid {about['pid']}: {about['interpreters']} interpreters, "
                      f"started with GLIBC_TUNABLES "
                      f"{':'.join(f'{k}={v}' for k, v in about['tunables'].items())}, room for "
                      f"{room['started'] + room['more']} interpreters, "
                      f"host imported torch: {about['host_imported_torch']}", flush=True)
            roomy = [a for a in replicas if a["has_room"]
                     and a["room"]["started"] + a["room"]["more"] >= 15]
            correct = _send(httpclient, np, f"127.0.0.1:{port}", inputs, expected)
        finally:
            serve.shutdown()
            ray.shutdown()
    if len(roomy) != args.replicas:
        print(f"only {len(roomy)} of {args.replicas} replicas answered with room for 15 "
              f"interpreters", file=sys.stderr)
    print(f"ray-serve ok: {correct}/{args.requests} correct", flush=True)
    return 0 if correct == args.requests and len(roomy) == args.replicas else 1


def _send(httpclient, np, url: str, inputs: list, expected: list) -> int:
    """Sends every input at once, each from a thread of its own with its own connection;
    the number of answers that match expected."""
    start = threading.Barrier(len(inputs))
    right = [False] * len(inputs)

    def one(k: int) -> None:
        client = httpclient.InferenceServerClient(url, connection_timeout=300,
                                                  network_timeout=300)
        try:
            tensor = httpclient.InferInput("x", list(inputs[k].shape), "FP32")
            tensor.set_data_from_numpy(inputs[k], binary_data=k % 2 == 0)
            start.wait(timeout=120)
            answer = client.infer("python_heavy", [tensor]).as_numpy("output0")
            right[k] = (answer.shape == expected[k].shape
                        and np.allclose(answer, expected[k], rtol=1e-5, atol=1e-6))
        except Exception as error:  # counted as wrong
            print(f"request {k} failed: {type(error).__name__}: {error}", file=sys.stderr)
        finally:
            client.close()

    threads = [threading.Thread(target=one, args=(k,)) for k in range(len(inputs))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return sum(right)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


if __name__ == "__main__":
    sys.exit(main())
