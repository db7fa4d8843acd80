"""tiny_gpt's decoder as a LitServe streaming API, as LitServe's users write one: predict
and encode_response are generators, the API made with stream=True.  LitServe 0.2.19
answers POST /predict ({"prompt": "3 14 15", "max_tokens": 32}) with a chunked body,
one JSON object and a newline per token ({"token": "92 "}).

    python gpt_litserve.py PORT WORKERS      # LitServe: WORKERS inference workers
"""
import sys

import litserve as ls
from tiny_gpt import generate, make_model, parse  # beside this file


class GeneratorAPI(ls.LitAPI):
    def setup(self, device):
        self.model = make_model()

    def decode_request(self, request):
        return parse(request["prompt"]), int(request["max_tokens"])

    def predict(self, x):
        prompt, count = x
        yield from generate(self.model, prompt, count)

    def encode_response(self, tokens):
        for token in tokens:
            yield {"token": f"{token} "}


if __name__ == "__main__":
    # stream=True on the API: LitServer(api, stream=True) says it is deprecated in 0.2.19
    server = ls.LitServer(GeneratorAPI(stream=True), accelerator="cpu",
                          workers_per_device=int(sys.argv[2]))
    server.run(port=int(sys.argv[1]), log_level="warning", generate_client_file=False)
