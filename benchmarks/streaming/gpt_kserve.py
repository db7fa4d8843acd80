"""tiny_gpt's decoder as a KServe model, as KServe's users write one that streams:
predict is an async generator.  KServe 0.21 streams only on its V1 route: POST
/v1/models/generator:predict with a JSON body ({"prompt": "3 14 15", "max_tokens": 32})
gives predict the body as a dict, and an AsyncIterator that predict returns is sent as
a chunked body (Starlette's StreamingResponse, no media type), each chunk what it
yields: here one Server-Sent Event per token, data: {"token": "92 "}.  (The V2 route,
/v2/models/NAME/infer, takes an InferResponse only.)

Started as a KServe script's __main__ does, N worker processes, with one change (as
benchmarks/anchors/kserve_server.py): the parent's liveness ping waits up to 60 s, not
5, for a worker that starts slowly on a busy machine.

    python gpt_kserve.py PORT WORKERS
"""
import json
import sys

import kserve
from kserve.protocol.rest.multiprocess.server import RESTServerProcess
from tiny_gpt import generate, make_model, parse  # beside this file


class Generator(kserve.Model):
    def __init__(self, name: str = "generator"):
        super().__init__(name)
        self.model = None
        self.load()

    def load(self) -> bool:
        self.model = make_model()
        self.ready = True
        return self.ready

    async def predict(self, payload, headers=None, response_headers=None):
        prompt, count = parse(payload["prompt"]), int(payload["max_tokens"])
        for token in generate(self.model, prompt, count):
            yield f"data: {json.dumps({'token': f'{token} '})}\n\n"


if __name__ == "__main__":
    RESTServerProcess.is_alive.__defaults__ = (60,)
    kserve.ModelServer(http_port=int(sys.argv[1]), workers=int(sys.argv[2]),
                       enable_grpc=False, enable_latency_logging=False).start([Generator()])
