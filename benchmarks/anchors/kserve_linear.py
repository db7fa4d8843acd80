"""A KServe model as KServe's users write one (benchmarks/anchors.py serves it with
KServe's own ModelServer and with `multipy serve kserve_linear.py:Linear`): a torch
Linear (8 -> 4, seed 0) on input "x" (FP32, [1, 8]); output "y" (FP32, [1, 4]).
kserve_server.py starts it as a KServe script's `__main__` would.
"""
import kserve
import torch
from kserve import InferOutput, InferRequest, InferResponse
from kserve.utils.utils import generate_uuid


class Linear(kserve.Model):
    def __init__(self, name: str = "linear"):
        super().__init__(name)
        self.net = None
        self.load()

    def load(self) -> bool:
        torch.set_num_threads(1)  # one intra-op thread per worker, as multipy's interpreters
        torch.manual_seed(0)
        self.net = torch.nn.Linear(8, 4).eval()
        self.ready = True
        return self.ready

    def predict(self, payload: InferRequest, headers=None, response_headers=None):
        x = torch.from_numpy(payload.inputs[0].as_numpy())
        with torch.no_grad():
            y = self.net(x).numpy()
        output = InferOutput("y", list(y.shape), "FP32")
        output.set_data_from_numpy(y, binary_data=False)
        return InferResponse(payload.id or generate_uuid(), self.name, [output])

