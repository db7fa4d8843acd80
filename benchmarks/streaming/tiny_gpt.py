"""The model every server of benchmarks/streaming.py serves, and the one way it
generates: a GPT-2-shaped decoder (transformers' GPT2LMHeadModel: 2 layers, 256 wide,
4 heads, a vocabulary of 1,000 token ids, 128 positions) with random weights made in
memory from seed 0, nothing downloaded; greedy decoding with its KV cache, one token per
step, so that each step is a few milliseconds of eager Python and small matrix products.
Token ids stand for text: a prompt is ids written as decimal numbers ("3 14 15"), and
each new token is sent as its id and a space ("92 ").
"""
import torch
from transformers import GPT2Config, GPT2LMHeadModel

VOCABULARY = 1000


def make_model() -> GPT2LMHeadModel:
    """The decoder, the same weights in every process and interpreter (seed 0); one
    intra-op thread (the peers' workers, like multipy's interpreters at N=2 here)."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=VOCABULARY, n_positions=128, n_embd=256, n_layer=2,
                        n_head=4, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config).eval()


def parse(prompt) -> list[int]:
    """A prompt's token ids from its text (str or bytes): ids separated by spaces;
    ValueError for anything else, or an id outside the vocabulary."""
    if isinstance(prompt, bytes):
        prompt = prompt.decode()
    ids = [int(word) for word in prompt.split()]
    if not ids or not all(0 <= each < VOCABULARY for each in ids):
        raise ValueError(f"a prompt is 1 or more token ids below {VOCABULARY}")
    return ids


def generate(model: GPT2LMHeadModel, prompt: list[int], new_tokens: int):
    """Yields new_tokens token ids (ints), greedily, one model step each: the prompt
    once, then each new token alone with the cache of the steps before.  Each step has
    its own inference_mode, so that generators interleaved on one thread (KServe's event
    loop) do not leave one another's mode behind.  One intra-op thread, set here on the
    thread that generates: multipy serve gives each thread that calls a model its own
    count (the cores over the interpreters: 2 for one interpreter on 2 cores), which
    would undo make_model's on another thread."""
    if torch.get_num_threads() != 1:
        torch.set_num_threads(1)
    ids, past = torch.tensor([prompt]), None
    for _ in range(new_tokens):
        with torch.inference_mode():
            out = model(ids, past_key_values=past, use_cache=True)
            past = out.past_key_values
            ids = out.logits[:, -1].argmax(-1, keepdim=True)
        yield int(ids)
