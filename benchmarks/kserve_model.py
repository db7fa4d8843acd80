"""The peer of `multipy serve` in benchmarks/serve_load.py: a torch.package model behind
KServe's own Python model server (kserve.ModelServer), N worker processes, each with its
own copy of the model, as KServe, TorchServe and Triton's Python backend run; with
--grpc-port, KServe's gRPC server too (which KServe 0.21 runs in the parent process only,
whatever --workers says).

Runs in the peer's own virtual environment (serve_load.py makes it: KServe 0.21 pins
protobuf and psutil versions that other packages of the project's environment clash with).

    python kserve_model.py PACKAGE --name NAME --workers N --port PORT [--grpc-port PORT]
        [--device cuda]
"""
from __future__ import annotations

import kserve
import numpy as np
import torch
import torch.package
from floor_app import peer_parser  # beside this file
from kserve.protocol.infer_type import InferOutput, InferRequest, InferResponse


class PackagedModel(kserve.Model):
    """The object at ("model", "model.pkl") of a torch.package archive; inputs in request
    order are its arguments, outputs are named output0, output1, ..."""

    def __init__(self, name: str, path: str, device: str = "cpu") -> None:
        super().__init__(name)
        self.path = path
        self.device = device
        self.model = None
        self.load()

    def __reduce__(self):  # KServe spawns its workers: each loads its own copy
        return PackagedModel, (self.name, self.path, self.device)

    def load(self) -> bool:
        torch.set_num_threads(1)  # one intra-op thread per worker, as multipy's interpreters
        self.model = torch.package.PackageImporter(self.path).load_pickle(
            "model", "model.pkl", map_location=self.device)
        self.ready = True
        return self.ready

    async def predict(self, payload: InferRequest, headers=None,
                      response_headers=None) -> InferResponse:
        arguments = [_argument(each, self.device) for each in payload.inputs]
        with torch.no_grad():
            result = self.model(*arguments)
        results = result if isinstance(result, (tuple, list)) else (result,)
        outputs = []
        for index, value in enumerate(results):
            if isinstance(value, np.ndarray) and value.dtype == object:
                output = InferOutput(f"output{index}", list(value.shape), "BYTES")
                output.set_data_from_numpy(value, binary_data=False)
            else:
                array = value.cpu().numpy().astype(np.float32)
                output = InferOutput(f"output{index}", list(array.shape), "FP32")
                output.set_data_from_numpy(array, binary_data=False)
            outputs.append(output)
        # binary outputs where the request asks for them, as KServe's own models answer
        # (kserve.utils.utils.get_predict_response): over HTTP the outputs' binary_data,
        # over gRPC raw outputs for raw inputs (tritonclient.grpc reads no typed contents
        # beside raw ones)
        return InferResponse(payload.id or "", self.name, outputs,
                             use_binary_outputs=payload.use_binary_outputs,
                             requested_outputs=payload.request_outputs)


def _argument(tensor, device: str):
    """A request's input as the model takes it, as `multipy serve` gives it: a tensor (on
    device), or for BYTES a numpy array of bytes (KServe gives binary data as bytes, JSON
    as str)."""
    array = tensor.as_numpy()
    if tensor.datatype != "BYTES":
        return torch.from_numpy(np.ascontiguousarray(array)).to(device)
    flat = [each if isinstance(each, bytes) else str(each).encode() for each in array.reshape(-1)]
    return np.array(flat, dtype=object).reshape(array.shape)


def main() -> None:
    parser = peer_parser(__doc__)
    parser.add_argument("--grpc-port", type=int,
                        help="gRPC port (default: no gRPC); served by the parent process alone")
    args = parser.parse_args()
    model = PackagedModel(args.name, args.package, args.device)
    kserve.ModelServer(http_port=args.port, workers=args.workers,
                       enable_grpc=args.grpc_port is not None,
                       grpc_port=args.grpc_port if args.grpc_port is not None else 8081,
                       enable_latency_logging=False).start([model])


if __name__ == "__main__":
    main()
