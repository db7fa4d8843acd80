"""The floor of a process server, a peer of `multipy serve` in benchmarks/serve_load.py: a
small Starlette app under `uvicorn --workers N` (httptools, uvloop, access log off), each
worker loading the same torch.package archive at start-up (its own copy, grad off, the
intra-op threads given) and calling the model inline in its handler.  It answers the
Open Inference Protocol's JSON form only, POST /v2/models/NAME/infer, with no checks
beyond parsing (inputs by position, outputs output0, output1, ...), and GET
/v2/health/ready, 200 once every worker has loaded the model.  What a server must spend
on a request at the least: what `multipy serve` does on top of it (the protocol's
checks, limits, metrics, batching, binary data, gRPC) is its own cost.

    python floor_app.py PACKAGE --name NAME --workers N --port PORT [--torch-threads T]
        [--device cuda]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
#: how main() tells each worker what to load: the archive, the model's name, torch's
#: intra-op threads, the workers, and a folder where each worker leaves its pid once ready
SETTINGS = "MULTIPY_FLOOR"


def _app():
    """The app of one worker: its model loads at start-up, before uvicorn serves."""
    import contextlib

    import numpy as np
    import torch
    import torch.package
    from starlette.applications import Starlette
    from starlette.responses import Response
    from starlette.routing import Route

    settings = json.loads(os.environ[SETTINGS])
    state = {}
    dtypes = {"FP32": torch.float32, "FP64": torch.float64, "FP16": torch.float16,
              "BF16": torch.bfloat16, "INT64": torch.int64, "INT32": torch.int32,
              "INT16": torch.int16, "INT8": torch.int8, "UINT8": torch.uint8,
              "BOOL": torch.bool}
    names = {dtype: name for name, dtype in dtypes.items()}

    def argument(tensor: dict):
        """An input as `multipy serve` gives it to the model: a tensor, or for BYTES a
        numpy array of bytes."""
        if tensor["datatype"] == "BYTES":
            return np.array([each.encode() for each in tensor["data"]],
                            dtype=object).reshape(tensor["shape"])
        return torch.tensor(tensor["data"], dtype=dtypes[tensor["datatype"]],
                            device=settings["device"]).reshape(tensor["shape"])

    def output(name: str, value) -> dict:
        if isinstance(value, torch.Tensor):
            return {"name": name, "datatype": names[value.dtype], "shape": list(value.shape),
                    "data": value.reshape(-1).tolist()}
        return {"name": name, "datatype": "BYTES", "shape": list(value.shape),
                "data": [each.decode() for each in value.reshape(-1)]}

    async def infer(request):
        body = json.loads(await request.body())
        result = state["model"](*[argument(each) for each in body["inputs"]])
        results = result if isinstance(result, (tuple, list)) else (result,)
        return Response(json.dumps({
            "model_name": settings["name"],
            "outputs": [output(f"output{index}", value) for index, value in enumerate(results)]}),
            media_type="application/json")

    async def ready(request):
        loaded = len(os.listdir(settings["ready"])) >= settings["workers"]
        return Response(status_code=200 if loaded else 503)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        torch.set_num_threads(settings["threads"])
        torch.set_grad_enabled(False)  # the event loop's thread, which calls the model
        state["model"] = torch.package.PackageImporter(settings["package"]).load_pickle(
            "model", "model.pkl", map_location=settings["device"])
        open(os.path.join(settings["ready"], str(os.getpid())), "w").close()
        yield

    return Starlette(routes=[Route(f"/v2/models/{settings['name']}/infer", infer,
                                   methods=["POST"]),
                             Route("/v2/health/ready", ready)], lifespan=lifespan)


def __getattr__(name: str):  # `floor_app:app`, made where uvicorn imports it: in a worker
    if name == "app" and SETTINGS in os.environ:
        return _app()
    raise AttributeError(name)


def peer_parser(doc: str) -> argparse.ArgumentParser:
    """The command line that serve_load.py gives each of its peers (this one and
    kserve_model.py, which imports it: this module's top imports the standard library
    only, so that it imports in KServe's environment too); doc is the peer's docstring."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("package", help="torch.package archive")
    parser.add_argument("--name", required=True, help="the model's name in the protocol")
    parser.add_argument("--workers", type=int, default=1, help="worker processes (default 1)")
    parser.add_argument("--port", type=int, default=8080, help="HTTP port (default 8080)")
    parser.add_argument("--device", default="cpu",
                        help="where the model runs, each worker its own copy (default cpu)")
    return parser


def main() -> None:
    parser = peer_parser(__doc__)
    parser.add_argument("--torch-threads", type=int, default=1,
                        help="torch's intra-op threads in each worker (default 1)")
    args = parser.parse_args()
    import uvicorn

    with tempfile.TemporaryDirectory() as ready:
        os.environ[SETTINGS] = json.dumps({"package": os.path.abspath(args.package),
                                           "name": args.name, "threads": args.torch_threads,
                                           "workers": args.workers, "ready": ready,
                                           "device": args.device})
        uvicorn.run("floor_app:app", app_dir=HERE, host="127.0.0.1", port=args.port,
                    workers=args.workers, http="httptools", loop="uvloop", access_log=False,
                    log_level="warning")


if __name__ == "__main__":
    sys.exit(main())
