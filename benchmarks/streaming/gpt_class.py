"""tiny_gpt's decoder as a multipy model class whose predict is a generator: served with
`multipy serve gpt_class.py:Generator --interpreters N`, each yielded dict is one event
of POST /v2/models/generator/generate_stream (Server-Sent Events).  Inputs: "prompt"
(BYTES, token ids as text) and "max_tokens" (INT64); each event's output "token" is one
token id and a space.
"""
from tiny_gpt import generate, make_model, parse  # beside this file


class Generator:
    def load(self):
        self.model = make_model()

    def predict(self, inputs):
        prompt = parse(inputs["prompt"].reshape(-1)[0])
        count = int(inputs["max_tokens"].reshape(-1)[0])
        for token in generate(self.model, prompt, count):
            yield {"token": f"{token} "}
