"""--max-batch-size: requests batched together and each answered with its own rows, shapes
kept apart, BYTES concatenated and split, a batch that cannot be split back the model's
fault; on a server of its own (``batching``: 1 interpreter, batches of up to 8).
"""
from __future__ import annotations

import threading

import pytest

torch = pytest.importorskip("torch")
np = pytest.importorskip("numpy")
from serving import _as_bytes, _eager, _input, _metrics, _start, _stop  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402


@pytest.fixture(scope="module")
def batching(packages, tmp_path_factory):
    server = _start(tmp_path_factory.mktemp("batching"),
                    [packages["rows"], packages["total"], packages["text"]],
                    "--interpreters", "1", "--max-batch-size", "8", "--batch-timeout-ms", "500")
    try:
        yield server
    finally:
        _stop(server)


def _at_once(count: int, request) -> list:
    """request(0), ..., request(count - 1), each on a thread of its own, at once: their
    values, in that order; the first error any raised, raised here."""
    answers, errors = {}, []

    def one(index: int) -> None:
        try:
            answers[index] = request(index)
        except BaseException as error:  # raised below
            errors.append(error)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=90)
    if errors:
        raise errors[0]
    assert sorted(answers) == list(range(count)), "a request was not answered in time"
    return [answers[index] for index in range(count)]


def test_batching_answers_each_request_with_its_rows(batching, packages):
    model = _eager(packages["rows"])
    before = _metrics(batching)
    requests = 16

    def one(index: int) -> tuple:
        x = np.full((1, 3), index, np.float32) + np.arange(3, dtype=np.float32)
        result = batching.client().infer("rows", [_input("x", x, "FP32", index % 2 == 0)])
        return x, result.as_numpy("output0")

    for x, answer in _at_once(requests, one):
        with torch.no_grad():
            np.testing.assert_array_equal(answer, model(torch.from_numpy(x)).numpy())
    after = _metrics(batching)
    key = (("model", "rows"),)
    assert after[("multipy_inference_requests_total", key)] - \
        before[("multipy_inference_requests_total", key)] == requests
    calls = after[("multipy_model_calls_total", key)] - before[("multipy_model_calls_total", key)]
    assert 2 <= calls < requests  # at most 8 rows a batch, so at least 2 calls
    assert after[("multipy_batch_requests_count", key)] - \
        before[("multipy_batch_requests_count", key)] == calls


def test_batching_keeps_shapes_apart_and_runs_big_requests_alone(batching, packages):
    model = _eager(packages["rows"])
    inputs = [np.ones((1, 3), np.float32), np.ones((2, 4), np.float32) * 2,
              np.arange(30, dtype=np.float32).reshape(10, 3)]  # 10 rows > 8: alone
    answers = _at_once(len(inputs), lambda index: batching.client().infer(
        "rows", [_input("x", inputs[index], "FP32", True)]).as_numpy("output0"))
    for index, x in enumerate(inputs):
        with torch.no_grad():
            np.testing.assert_array_equal(answers[index], model(torch.from_numpy(x)).numpy())


def test_batching_concatenates_and_splits_bytes(batching):
    before = _metrics(batching)
    requests = 12

    def one(index: int) -> tuple:
        rows = 1 + index % 2
        text = np.array([f"r{index}-{row}-\u00e9" * (index % 3) for row in range(rows)],
                        dtype=object)
        return text, batching.client().infer("text", [_input("text", text, "BYTES",
                                                             index % 3 != 0)])

    for text, result in _at_once(requests, one):
        assert _as_bytes(result.as_numpy("upper")) == [t.upper().encode() for t in text]
        np.testing.assert_array_equal(result.as_numpy("lengths"),
                                      [len(t.encode()) for t in text])
        assert _as_bytes(result.as_numpy("same")) == [t.encode() for t in text]
        assert _as_bytes(result.as_numpy("joined")) == [t.encode() for t in text]  # a list
    key = (("model", "text"),)
    calls = _metrics(batching)[("multipy_model_calls_total", key)] - \
        before[("multipy_model_calls_total", key)]
    assert 1 <= calls < requests  # some ran together


def test_a_batch_that_cannot_be_split_is_the_models_fault(batching):
    client = batching.client()
    with pytest.raises(InferenceServerException) as error:
        client.infer("total", [_input("x", np.ones((2, 3), np.float32), "FP32", True)])
    assert error.value.status() == "500" and "cannot be batched" in error.value.message()
    result = client.infer("rows", [_input("x", np.ones((1, 3), np.float32), "FP32", True)])
    np.testing.assert_array_equal(result.as_numpy("output0"), np.full((1, 3), 5, np.float32))
