"""The Hugging Face text classifier written as a class (examples/hf_classifier.py,
its model and tokenizer written by examples/generate_hf_classifier.py): `multipy serve
FILE.py:CLASS` serves it, BYTES in and out, over HTTP (binary and JSON) and gRPC, each
answer equal to the class's own predict run here; and its weights are the safetensors
file, mapped, not copied."""
from __future__ import annotations

import os

import pytest

np = pytest.importorskip("numpy")
pytest.importorskip("transformers")

from test_text_classifier import EXAMPLES, TEXTS, classify, example, serving  # noqa: E402

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    return example("generate_hf_classifier").generate(
        str(tmp_path_factory.mktemp("hf_classifier")))


@pytest.fixture(scope="module")
def eager(folder):
    """The example's class, made and loaded here (no server)."""
    module = example("hf_classifier")
    module.FOLDER = folder
    classifier = module.Classifier()
    classifier.load()
    return classifier


@pytest.fixture(scope="module")
def server(folder, tmp_path_factory):
    with serving(tmp_path_factory.mktemp("served"),
                 os.path.join(EXAMPLES, "hf_classifier.py:Classifier"),
                 env={"HF_CLASSIFIER_DIR": folder}) as addresses:
        yield addresses


def test_the_folder_holds_a_safetensors_model_and_its_tokenizer(folder, eager):
    assert sorted(os.listdir(folder)) == ["config.json", "model.safetensors", "tokenizer.json"]
    answer = eager.predict({"text": TEXTS})
    assert answer["probabilities"].shape == (len(TEXTS), 3)
    np.testing.assert_allclose(answer["probabilities"].sum(-1).numpy(), 1, rtol=1e-5)
    assert set(answer["label"]) <= {b"negative", b"neutral", b"positive"}


def test_the_weights_are_the_mapped_file(folder, eager):
    """Every parameter lies in a mapping of model.safetensors: the pages are the page
    cache's, which every interpreter (and process) that maps the file shares."""
    path = os.path.realpath(os.path.join(folder, "model.safetensors"))
    with open("/proc/self/maps") as maps:
        mapped = [tuple(int(end, 16) for end in line.split()[0].split("-"))
                  for line in maps if line.rstrip().endswith(path)]
    parameters = list(eager.model.parameters())
    assert mapped and all(any(start <= p.data_ptr() < end for start, end in mapped)
                          for p in parameters)


@pytest.mark.parametrize("transport", ["http-binary", "http-json", "grpc"])
def test_served_over_each_transport(server, eager, transport):
    probabilities, labels = classify(server, transport, "classifier",
                                     ("probabilities", "label"))
    expected = eager.predict({"text": TEXTS})
    np.testing.assert_allclose(probabilities, expected["probabilities"].numpy(), rtol=1e-5,
                               atol=1e-6)
    assert labels == list(expected["label"])
