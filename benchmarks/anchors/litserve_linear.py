"""A LitServe API as LitServe's users write one (benchmarks/anchors.py serves it with
LitServe itself and with `multipy serve litserve_linear.py:LinearAPI`): a torch Linear
(8 -> 4, seed 0) on the JSON body's "x", a list of 8 numbers; answers {"y": [4 numbers]}.

    python litserve_linear.py PORT WORKERS      # LitServe: WORKERS inference workers
"""
import sys

import litserve as ls
import torch


class LinearAPI(ls.LitAPI):
    def setup(self, device):
        torch.set_num_threads(1)  # one intra-op thread per worker, as multipy's interpreters
        torch.manual_seed(0)
        self.net = torch.nn.Linear(8, 4).eval().to(device)

    def decode_request(self, request):
        return torch.tensor(request["x"], dtype=torch.float32)

    def predict(self, x):
        with torch.no_grad():
            return self.net(x)

    def encode_response(self, output):
        return {"y": output.tolist()}


if __name__ == "__main__":
    server = ls.LitServer(LinearAPI(), accelerator="cpu", workers_per_device=int(sys.argv[2]))
    server.run(port=int(sys.argv[1]), log_level="warning", generate_client_file=False)
