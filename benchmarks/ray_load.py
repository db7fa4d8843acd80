"""Load benchmark on Ray Serve: N concurrent Open Inference Protocol clients
(tritonclient.http, binary tensors; serve_load.py's load()) against the example model
behind Ray Serve's HTTP proxy, served by

- multipy replicas, 2 replicas x 1 interpreter (multipy.serve.on_ray.deployment),
- multipy replicas, 1 replica x 2 interpreters,
- Ray Serve's plain deployment of the model: 2 replicas, each loading the archive with
  torch.package and calling the model in its own Python, answering the same route with
  the same protocol code (multipy.serve.request.protocol),

and, for reference, `multipy serve` without Ray (2 interpreters).  One local Ray
(ray.init(num_cpus=2 by default)) runs the three in turn; each replica reserves an equal
share of its CPUs.  Prints requests/s, p50 and p99 latency, and memory: the PSS of the
replica processes, and of every Ray process (replicas, proxy, controller, raylet, GCS,
agents) while they ran; every answer is checked against the model run eagerly here.

    python benchmarks/ray_load.py [--clients 4] [--seconds 10] [--warm-up 3] [--num-cpus 2]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


class PlainModel:
    """Ray Serve's plain deployment of a torch.package model: loaded in the replica's own
    Python, called there (one call at a time: one GIL), on the route multipy answers."""

    def __init__(self, path: str, name: str) -> None:
        import torch
        import torch.package

        self.torch = torch
        self.name = name
        self.model = torch.package.PackageImporter(path).load_pickle("model", "model.pkl")
        self.model.eval()

    async def __call__(self, request):
        from starlette.responses import Response

        from multipy.serve.request.protocol import (HEADER_LENGTH, Tensor, decode_request,
                                                    encode_response)

        if request.method != "POST" or request.url.path != f"/v2/models/{self.name}/infer":
            return Response(status_code=404)
        decoded = decode_request(await request.body(), request.headers.get(HEADER_LENGTH),
                                 request.headers.get("content-encoding"))
        with self.torch.no_grad():
            output = self.model(*[self.torch.from_numpy(t.array) for t in decoded.inputs])
        binary = dict(decoded.outputs or ()).get("output0", decoded.binary_outputs)
        body, headers = encode_response(self.name, "1", decoded.id,
                                        [(Tensor("output0", "FP32", output.numpy()), binary)])
        return Response(body, headers=headers)

    def about(self) -> dict:
        return {"pid": os.getpid(), "torch_threads": self.torch.get_num_threads()}


def _pss(pid: int) -> int:
    """PSS in bytes of process pid alone."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("Pss:")) * 1024
    except (OSError, StopIteration):
        return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=4, help="concurrent clients (4)")
    parser.add_argument("--seconds", type=float, default=10, help="timed seconds per run (10)")
    parser.add_argument("--warm-up", type=float, default=3, help="untimed seconds first (3)")
    parser.add_argument("--num-cpus", type=int, default=2,
                        help="the local Ray's CPUs, shared equally by a run's replicas (2)")
    parser.add_argument("--model", default="python_heavy", help="example package (python_heavy)")
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()

    import ray
    from ray import serve

    from multipy.serve.host.models import ModelSpec
    from multipy.serve.on_ray import deployment
    from multipy.serve.host.service import Options

    sys.path.insert(0, HERE)
    from serve_load import example, free_port, load, pss_tree, run_server

    rows = []
    with tempfile.TemporaryDirectory() as directory:
        path, arrays, expected = example(directory, args.model)
        figures = (args.clients, args.seconds, args.warm_up, arrays, expected)

        port = free_port()
        reference = run_server([sys.executable, "-m", "multipy", "serve", path,
                                "--interpreters", "2", "--port", str(port)],
                               port, args.model, *figures)
        reference["replicas_pss_mib"] = reference["ray_pss_mib"] = reference["pss_mib"]
        rows.append(("multipy serve (no Ray), 2 interp.", reference))

        options = Options((ModelSpec(args.model, path),), 1)
        runs = [
            ("multipy on Ray, 2 replicas x 1", 2,
             lambda: deployment(options, 2, replica_cpus=args.num_cpus / 2)),
            ("multipy on Ray, 1 replica x 2", 1,
             lambda: deployment(Options((ModelSpec(args.model, path),), 2), 1,
                                replica_cpus=args.num_cpus)),
            ("Ray Serve plain, 2 replicas", 2,
             lambda: serve.deployment(PlainModel, name="plain", num_replicas=2,
                                      ray_actor_options={"num_cpus": args.num_cpus / 2},
                                      logging_config={"enable_access_log": False}
                                      ).bind(path, args.model)),
        ]
        port = free_port()
        ray.init(address="local", num_cpus=args.num_cpus, include_dashboard=False)
        try:
            serve.start(http_options={"host": "127.0.0.1", "port": port})
            for label, replicas, app in runs:
                serve.run(app(), name="bench", route_prefix="/")
                handle = serve.get_app_handle("bench")
                seen: dict[int, dict] = {}
                for _ in range(200):
                    about = handle.about.remote().result(timeout_s=60)
                    seen[about["pid"]] = about
                    if len(seen) == replicas:
                        break
                result = load(port, args.model, *figures)
                result["replicas_pss_mib"] = sum(pss_tree(pid) for pid in seen) / (1 << 20)
                result["ray_pss_mib"] = (pss_tree(os.getpid()) - _pss(os.getpid())) / (1 << 20)
                result["torch_threads"] = sorted(a["torch_threads"] for a in seen.values())
                rows.append((label, result))
                serve.delete("bench")
                time.sleep(2)  # the replicas' processes exit
        finally:
            serve.shutdown()
            ray.shutdown()

    print(f"\n{args.model}: {args.clients} clients (tritonclient.http, binary), "
          f"{args.seconds:g} s after {args.warm_up:g} s of warm-up; Ray with "
          f"{args.num_cpus} CPUs")
    print(f"{'server':36s} {'req/s':>8s} {'p50 ms':>8s} {'p99 ms':>8s} {'replicas':>9s} "
          f"{'all Ray':>8s} {'wrong':>6s}")
    print(f"{'':36s} {'':>8s} {'':>8s} {'':>8s} {'PSS MiB':>9s} {'PSS MiB':>8s}")
    for label, f in rows:
        print(f"{label:36s} {f['requests_per_second']:8.1f} {f['p50_ms']:8.2f} "
              f"{f['p99_ms']:8.2f} {f['replicas_pss_mib']:9.1f} {f['ray_pss_mib']:8.1f} "
              f"{f['wrong']:6d}")
    print("(no Ray: the server process's PSS in both memory columns)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "clients": args.clients, "seconds": args.seconds,
                       "num_cpus": args.num_cpus, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
