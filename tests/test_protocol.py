"""multipy.serve.request.protocol on its own, without a server: BYTES tensors in JSON and in the
binary data extension's length-prefixed encoding, both ways."""
from __future__ import annotations

import contextlib
import json
import re
import struct
from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

np = pytest.importorskip("numpy")

from multipy.serve.request import messages, protocol  # noqa: E402
from multipy.serve.request.protocol import (ProtocolError, Tensor, decode_request,  # noqa: E402
                                    encode_response)
from multipy.serve.request.tensors import to_length_prefixed  # noqa: E402

#: The ways an answer's JSON is written: orjson's, where it is installed, and json's.
WRITERS = ["orjson", "json"]


@contextlib.contextmanager
def _by(way: str, module, name: str):
    """While it runs, module's orjson function name is used if way is "orjson" (skipped
    where orjson is not installed), or json's way instead (name set to None)."""
    if way == "orjson":
        if getattr(module, name) is None:
            pytest.skip("orjson is not installed")
        yield
        return
    with mock.patch.object(module, name, None):
        yield


def _writing_with(writer: str):
    """While it runs, answers are written by writer."""
    return _by(writer, protocol, "_orjson")


def _prefixed(*elements: bytes) -> bytes:
    return b"".join(struct.pack("<I", len(e)) + e for e in elements)


def _binary(shape: list[int], data: bytes, size: int | None = None):
    """The request for one BYTES input of shape whose binary data is data (and whose
    binary_data_size is size, len(data) unless given)."""
    header = json.dumps({"inputs": [{
        "name": "text", "datatype": "BYTES", "shape": shape,
        "parameters": {"binary_data_size": len(data) if size is None else size}}]}).encode()
    return decode_request(header + data, str(len(header)))


def _json(shape: list[int], data):
    return decode_request(json.dumps({"inputs": [
        {"name": "text", "datatype": "BYTES", "shape": shape, "data": data}]}).encode())


def test_bytes_from_binary_data_are_an_array_of_bytes_of_the_shape():
    elements = [b"hello", b"", b"\xff\x00", "w\u00f6rld".encode()]
    array = _binary([2, 2], _prefixed(*elements)).inputs[0].array
    assert array.dtype == object and array.shape == (2, 2)
    assert array.reshape(-1).tolist() == elements
    assert all(type(element) is bytes for element in array.reshape(-1))
    assert _binary([0, 3], b"").inputs[0].array.shape == (0, 3)
    assert _binary([], _prefixed(b"one")).inputs[0].array.tolist() == b"one"  # a scalar


@pytest.mark.parametrize("shape, data, message", [
    ([2], _prefixed(b"abc") + b"\x09\0\0\0ab",
     "input 'text': BYTES element 1 is cut short: its length says 9 bytes, but only 2 are "
     "left (binary_data_size 13)"),
    ([3], _prefixed(b"abc", b"") + b"\x01\0",
     "input 'text': BYTES element 2 is cut short: its 4-byte length at byte 11 has only 2 "
     "bytes before the data's end (binary_data_size 13)"),
    ([3], _prefixed(b"abcdefgh", b""),
     "input 'text': shape [3] has 3 elements, but its binary data holds 2"),
    ([1], _prefixed(b"a", b"b"),
     "input 'text': shape [1] has 1 elements, but 5 bytes of its binary data are left after "
     "them (binary_data_size 10)"),
    ([2, 2], _prefixed(b"a", b"b"),
     "input 'text': shape [2, 2] of BYTES has 4 elements, which need at least 16 bytes (a "
     "4-byte length each), but binary_data_size is 10"),
    ([1 << 40], b"",  # refused before anything is read or allocated
     f"input 'text': shape [{1 << 40}] of BYTES has {1 << 40} elements, which need at least "
     f"{4 << 40} bytes (a 4-byte length each), but binary_data_size is 0"),
])
def test_length_prefixed_data_that_does_not_match_says_what_is_wrong(shape, data, message):
    with pytest.raises(ProtocolError) as error:
        _binary(shape, data)
    assert error.value.status == 400 and str(error.value) == message


def test_binary_data_size_of_bytes_is_checked_against_the_body():
    data = _prefixed(b"abc")
    with pytest.raises(ProtocolError, match="binary_data_size is 9, but only 7 bytes"):
        _binary([1], data, size=9)
    with pytest.raises(ProtocolError, match="2 bytes of binary data that no input claims"):
        _binary([1], data + b"xx", size=len(data))


def test_bytes_in_json_are_strings_utf8_encoded():
    array = _json([2, 2], [["a", "\u00e9"], ["", "\u20ac"]]).inputs[0].array
    assert array.dtype == object and array.shape == (2, 2)
    assert array.tolist() == [[b"a", b"\xc3\xa9"], [b"", b"\xe2\x82\xac"]]
    assert _json([2, 2], ["a", "b", "c", "d"]).inputs[0].array.tolist() == \
        [[b"a", b"b"], [b"c", b"d"]]  # flat, row-major
    assert _json([1], "alone").inputs[0].array.tolist() == [b"alone"]
    assert _json([0, 2], []).inputs[0].array.shape == (0, 2)


@pytest.mark.parametrize("shape, data, message", [
    ([2], ["a", 1], "input 'text': BYTES data must be strings; got a int"),
    ([1], [None], "input 'text': BYTES data must be strings; got a NoneType"),
    ([1], [{"b64": "AA=="}], "input 'text': BYTES data must be strings; got a dict"),
    ([3], ["a", "b"], "input 'text': shape [3] has 3 elements, but the data has 2"),
    ([1], ["a", "b"], "input 'text': shape [1] has 1 elements, but the data has more"),
    ([3], [["a"], ["b", "c"]],
     "input 'text': data must be a (nested) list of strings of one shape"),
    ([2], [["a"], "b"], "input 'text': data must be a (nested) list of strings of one shape"),
    ([2], ["a", ["b"]], "input 'text': data must be a (nested) list of strings of one shape"),
    ([1], ["\ud800"], "input 'text': string 0 is not Unicode text (it holds a lone "
                      "surrogate, '\\ud800')"),
])
def test_bytes_json_that_does_not_fit_says_what_is_wrong(shape, data, message):
    with pytest.raises(ProtocolError) as error:
        _json(shape, data)
    assert error.value.status == 400 and str(error.value) == message


def test_an_unknown_datatype_names_bytes_among_the_datatypes():
    with pytest.raises(ProtocolError, match="unknown datatype 'STRING'; the datatypes are "
                                            "BOOL, .*, FP64, BYTES$"):
        decode_request(json.dumps({"inputs": [
            {"name": "x", "datatype": "STRING", "shape": [1], "data": ["a"]}]}).encode())


def _answer(array: np.ndarray, binary: bool) -> tuple[dict, bytes]:
    """The JSON of the answer with one BYTES output, and its binary data."""
    body, headers = encode_response("m", "1", None, [(Tensor("out", "BYTES", array), binary)])
    length = int(headers.get("Inference-Header-Content-Length", len(body)))
    return json.loads(body[:length]), body[length:]


def test_bytes_outputs_as_json_strings_or_length_prefixed_binary_data():
    array = np.array([[b"a", "\u00e9".encode()], [b"", b"\x00"]], dtype=object)
    answer, rest = _answer(array, binary=False)
    assert answer["outputs"] == [{"name": "out", "datatype": "BYTES", "shape": [2, 2],
                                  "data": ["a", "\u00e9", "", "\x00"]}]
    assert rest == b""
    answer, rest = _answer(array, binary=True)
    expected = _prefixed(b"a", b"\xc3\xa9", b"", b"\x00")
    assert answer["outputs"] == [{"name": "out", "datatype": "BYTES", "shape": [2, 2],
                                  "parameters": {"binary_data_size": len(expected)}}]
    assert rest == expected == to_length_prefixed(array)
    assert _binary([2, 2], rest).inputs[0].array.tolist() == array.tolist()  # round trip


def test_bytes_that_are_not_utf8_cannot_go_as_json_but_can_as_binary_data():
    array = np.array([b"ok", b"\xff\xfe"], dtype=object)
    with pytest.raises(ProtocolError) as error:
        _answer(array, binary=False)
    assert error.value.status == 400
    assert str(error.value) == (
        "output 'out': element 1 is not UTF-8 text (invalid start byte at byte 0), which "
        'JSON cannot carry: ask for the output as binary data ("parameters": '
        '{"binary_data": true})')
    assert _answer(array, binary=True)[1] == _prefixed(b"ok", b"\xff\xfe")


def test_declared_inputs_missing_and_optional():
    """multipy.serve.request.requests checks a request against the inputs a model declares: a
    declared input left out is a 400 unless it is optional; a request that matches
    reaches the model, by name."""
    import asyncio

    pytest.importorskip("prometheus_client")
    from multipy.serve.request.metrics import Metrics
    from multipy.serve.request.protocol import InferRequest
    from multipy.serve.request.requests import ModelRequests, Timing

    metrics = Metrics(["m"], 1)  # (kept: its board is the series' memory)
    model = _echo(ModelRequests)("m", metrics.models["m"])
    model.describe({"declared": True, "outputs": [], "inputs": [
        {"name": "a", "datatype": "INT32", "shape": [-1, 2]},
        {"name": "b", "datatype": "FP32", "shape": [3], "optional": True}]})
    a = Tensor("a", "INT32", np.zeros((5, 2), np.int32))

    def infer(*inputs):
        return asyncio.run(model.infer(InferRequest(list(inputs), None), Timing()))

    with pytest.raises(ProtocolError, match=r"^model 'm': input 'a' is missing "
                                            r"\(INT32 \[-1, 2\]\)$") as missing:
        infer(Tensor("b", "FP32", np.zeros(3, np.float32)))
    assert missing.value.status == 400
    assert [t.name for t in infer(a)] == ["a"]  # b is optional
    assert [t.name for t in infer(a, Tensor("b", "FP32", np.ones(3, np.float32)))] == ["a", "b"]
    assert model.metadata()["inputs"][1] == {"name": "b", "datatype": "FP32", "shape": [3]}


def _echo(base: type) -> type:
    """A ModelRequests (base) whose model answers with its inputs, in one piece."""
    class Echo(base):
        async def _run(self, names, datatypes, arrays, started, given, request):
            with started:
                return (tuple(names), tuple(datatypes), *arrays)

        async def _steps(self, names, datatypes, arrays, started, given, request):
            yield await self._run(names, datatypes, arrays, started, given, request)

    return Echo


def test_a_model_that_wants_its_request_gets_its_id_and_parameters():
    """A model whose metadata says "wants_request" (a kserve.Model's) is called with the
    request's (id, parameters) as ``request``; any other model without it."""
    import asyncio

    pytest.importorskip("prometheus_client")
    from multipy.serve.request.metrics import Metrics
    from multipy.serve.request.protocol import InferRequest
    from multipy.serve.request.requests import ModelRequests, Timing

    class Given(_echo(ModelRequests)):
        async def _run(self, names, datatypes, arrays, started, given, request):
            self.given = given
            return await super()._run(names, datatypes, arrays, started, given, request)

    metrics = Metrics(["m"], 1)
    request = InferRequest([Tensor("a", "INT32", np.zeros(2, np.int32))], None, id="r7",
                           parameters={"k": 1})
    for wants, expected in ((True, {"request": ("r7", {"k": 1})}), (False, {})):
        model = Given("m", metrics.models["m"])
        model.describe({"inputs": [], "outputs": [], "platform": "python",
                        **({"wants_request": True} if wants else {})})
        asyncio.run(model.infer(request, Timing()))
        assert model.given == expected


@pytest.mark.parametrize("text, says", [
    ("not json", "config.json is not JSON"),
    ('{"outputs": []}', 'must be an object with a list "inputs"'),
    ('{"inputs": [{"name": "x", "datatype": "FP33", "shape": [1]}]}', "not {'name': 'x'"),
    ('{"inputs": [{"name": "x", "datatype": "FP32", "shape": [-2]}]}', "sizes (-1: any)"),
    ('{"inputs": [{"name": "x", "datatype": "FP32", "shape": [1], "colour": 1}]}', "colour"),
    ('{"inputs": [{"name": "x", "datatype": "FP32", "shape": []},'
     ' {"name": "x", "datatype": "FP32", "shape": []}]}', "two of 'inputs' have one name"),
])
def test_a_config_json_that_declares_nothing_valid_says_why(manager, text, says):
    """Inside an interpreter, where a served model's config.json is read."""
    with manager.acquire_one() as session:
        declared = session.global_("multipy._inside.serving", "declared")
        with pytest.raises(ValueError, match=re.escape(says)):
            declared(text)
        assert declared('{"inputs": [{"name": "x", "datatype": "BYTES", "shape": [-1], '
                        '"optional": true}]}').deref() == {
            "inputs": [{"name": "x", "datatype": "BYTES", "shape": [-1], "optional": True}],
            "outputs": []}


_FLOAT_WIDTHS = {"FP16": 16, "FP32": 32, "FP64": 64}


@pytest.mark.parametrize("writer", WRITERS)
@settings(max_examples=200, deadline=None)
@given(datatype=st.sampled_from(["FP16", "BF16", "FP32", "FP64"]), data=st.data())
def test_float_outputs_in_json_read_back_as_the_same_values(writer, datatype, data):
    """Every float (subnormal, extreme, -0.0, infinite, NaN) of an output answered in
    JSON reads back (json.loads, then the datatype's dtype) as the value it was, beside
    the same output as binary data and an output with a name to escape, whichever writes
    the JSON."""
    with _writing_with(writer):
        _check_float_outputs(datatype, data)


def _check_float_outputs(datatype, data):
    width = _FLOAT_WIDTHS.get(datatype, 32)
    values = data.draw(st.lists(st.floats(width=width), max_size=40))
    if datatype == "BF16":  # its arrays hold the bits: values rounded to BF16's
        array = (np.array(values, np.float32).view(np.uint32) >> 16).astype(np.uint16)
        expected = (array.astype(np.uint32) << 16).view(np.float32)
    else:
        array = expected = np.array(values, {16: "<f2", 32: "<f4", 64: "<f8"}[width])
    body, headers = encode_response("m", None, 'a "quoted" id', [
        (Tensor("out", datatype, array), False), (Tensor("raw", datatype, array), True),
        (Tensor('\u00e9\n"', "INT8", np.array([1, -2], np.int8)), False)])
    answer = json.loads(body[:int(headers["Inference-Header-Content-Length"])])
    assert answer["id"] == 'a "quoted" id' and "model_version" not in answer
    out, raw, text = answer["outputs"]
    assert out["shape"] == raw["shape"] == [len(values)]
    assert raw["parameters"] == {"binary_data_size": array.nbytes}
    assert text == {"name": '\u00e9\n"', "datatype": "INT8", "shape": [2], "data": [1, -2]}
    assert all(type(x) is float for x in out["data"])  # whole ones too
    read = np.array(out["data"], expected.dtype)
    assert read.shape == expected.shape
    assert np.array_equal(np.isnan(read), np.isnan(expected))
    finite = ~np.isnan(expected)
    assert read[finite].tobytes() == expected[finite].tobytes()  # -0.0 included


@pytest.mark.parametrize("writer", WRITERS)
def test_whole_float_outputs_in_json_read_back_as_floats(writer):
    """A float output's whole numbers (0.0, -0.0, 1.0, 1e20) are written with a point
    or an exponent, as json writes them: read back, they are floats, not integers."""
    array = np.array([0.5, 1.0, -0.0, 0.0, 1e20, -3.0], np.float32)
    with _writing_with(writer):
        body, _ = encode_response("m", None, None, [(Tensor("out", "FP32", array), False)])
    data = json.loads(body)["outputs"][0]["data"]
    assert all(type(x) is float for x in data), data
    assert np.array(data, np.float32).tobytes() == array.tobytes()


def test_answers_are_written_by_orjson_where_it_is_installed():
    """With orjson installed, an answer is orjson's JSON (text as UTF-8, where json
    escapes it); json writes what orjson would write otherwise: NaN and infinities
    (orjson's null), and an id with a lone surrogate (which UTF-8 cannot hold)."""
    orjson = pytest.importorskip("orjson")
    out = Tensor("out", "FP32", np.array([0.25, -0.0], np.float32))
    texts = Tensor("text", "BYTES", np.array(["\u00e9t\u00e9".encode()], dtype=object))
    body, _ = encode_response("m", "1", "id", [(out, False), (texts, False)])
    assert body == orjson.dumps({"model_name": "m", "model_version": "1", "id": "id",
                                 "outputs": [
                                     {"name": "out", "datatype": "FP32", "shape": [2],
                                      "data": [0.25, -0.0]},
                                     {"name": "text", "datatype": "BYTES", "shape": [1],
                                      "data": ["\u00e9t\u00e9"]}]})
    assert "\u00e9t\u00e9".encode() in body
    odd = Tensor("odd", "FP64", np.array([np.nan, np.inf, -np.inf, 1.5]))
    body, _ = encode_response("m", None, "id", [(odd, False)])
    assert b"NaN,Infinity,-Infinity,1.5" in body and b"null" not in body
    body, _ = encode_response("m", None, "\ud800", [(out, False)])
    answer = json.loads(body)
    assert answer["id"] == "\ud800" and answer["outputs"][0]["data"] == [0.25, -0.0]


_JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats()
    | st.text(st.characters(blacklist_categories=())),  # (lone surrogates too)
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=5), inner,
                                                                 max_size=5),
    max_leaves=30)


@pytest.mark.parametrize("reader", ["orjson", "json"])
@settings(max_examples=300, deadline=None)
@given(value=st.dictionaries(st.text(max_size=5), _JSON_VALUES, max_size=5),
       ascii_only=st.booleans())
def test_a_request_s_json_reads_as_json_reads_it(reader, value, ascii_only):
    """A request's JSON object (NaN, infinities, -0.0, lone surrogates, integers of 64
    bits, text escaped or in UTF-8 included) reads as json.loads reads it, value and
    types alike, whether orjson reads it first or json alone."""
    text = json.dumps(value, ensure_ascii=ascii_only).encode("utf-8", "surrogatepass")
    with _reading_with(reader):
        found = messages.json_object(text)
    assert json.dumps(found) == json.dumps(json.loads(text))  # (1 and 1.0, -0.0, NaN)


@pytest.mark.parametrize("reader", ["orjson", "json"])
def test_what_orjson_refuses_is_read_as_json_reads_it(reader):
    """What orjson refuses and json reads (NaN, numbers past a double's range, lone
    surrogates, UTF-16) is json's value, and what both refuse says why as json does
    (nesting past orjson's 1,024: as json reads it); an integer literal past 64 bits is
    the nearest double where orjson reads it (an integer with json alone)."""
    with _reading_with(reader):
        for text in (b'{"a": NaN, "b": -Infinity}', b'{"a": 1e400}', b'{"a": "\\ud800"}',
                     '{"a": 1}'.encode("utf-16"),
                     b' {"a": [1, 2.5, -0.0, 18446744073709551615, -9223372036854775808]} '):
            assert json.dumps(messages.json_object(text)) == json.dumps(json.loads(text))
        for text in (b'{"a": 1,}', b'{"a": "\xff"}', b"",
                     b'{"a":' + b"[" * 1100 + b"]" * 1100 + b"}"):  # (past orjson's 1,024)
            try:  # (json's messages, and how deep it nests, differ between versions)
                expected = json.loads(text)
            except (ValueError, RecursionError) as error:
                with pytest.raises(ProtocolError, match=re.escape(
                        f"malformed JSON in the request: {error}")):
                    messages.json_object(text)
            else:
                assert messages.json_object(text) == expected
        with pytest.raises(ProtocolError, match="the request must be a JSON object"):
            messages.json_object(b"[1]")
        big = messages.json_object(b'{"a": 18446744073709551616, "b": -9223372036854775809}')
    exact = {"a": 2**64, "b": -2**63 - 1}
    assert json.dumps(big) == json.dumps(
        {k: float(v) for k, v in exact.items()} if reader == "orjson" else exact)


def _reading_with(reader: str):
    """While it runs, requests' JSON is read by reader first."""
    return _by(reader, messages, "_orjson_loads")
