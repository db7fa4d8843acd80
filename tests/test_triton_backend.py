"""`multipy serve --model-repository REPO` and `multipy serve REPO/MODEL`: Triton
Python-backend models (config.pbtxt, N/model.py with TritonPythonModel and
triton_python_backend_utils), served unchanged, checked through tritonclient over HTTP
and gRPC: add_sub, torch inside execute, per-request errors and a raising execute or a
wrong return (in Triton's words), outputs not asked for dropped, each model's own
modules, max_batch_size, dynamic batching (several requests in one execute, each
answered on its own), BYTES, request ids and parameters, initialize's args, an
initialize that fails, finalize; decoupled models (a response sender) streamed over
gRPC's ModelStreamInfer and /generate_stream, each response as it is sent, from a
thread after execute returned too, errors mid-stream, a cancelled request.
"""
from __future__ import annotations

import importlib.util
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import textwrap

import pytest

np = pytest.importorskip("numpy")
httpclient = pytest.importorskip("tritonclient.http")
grpcclient = pytest.importorskip("tritonclient.grpc")

from conftest import until, write_one  # noqa: E402
from serving import _client_error, _Events, _grpc_port, _start, _stop  # noqa: E402

pytestmark = pytest.mark.timeout(300)

HAS_TORCH = importlib.util.find_spec("torch") is not None

ADD_SUB_CONFIG = '''
name: "add_sub"
backend: "python"
input [
  { name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] },
  { name: "INPUT1" data_type: TYPE_FP32 dims: [ 4 ] }
]
output [
  { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] },
  { name: "OUTPUT1" data_type: TYPE_FP32 dims: [ 4 ] }
]
instance_group [ { count: 2 kind: KIND_CPU } ]
# Triton knows these; multipy skips them, and says so
optimization { execution_accelerators { cpu_execution_accelerator: [ { name: "x" } ] } }
model_warmup [ { name: "w" batch_size: 1 } ]
'''

# Triton's add_sub example, in its style: OUTPUT0 = INPUT0 + INPUT1, OUTPUT1 = the difference
ADD_SUB = '''
import json

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.model_config = model_config = json.loads(args["model_config"])
        output0_config = pb_utils.get_output_config_by_name(model_config, "OUTPUT0")
        output1_config = pb_utils.get_output_config_by_name(model_config, "OUTPUT1")
        self.output0_dtype = pb_utils.triton_string_to_numpy(output0_config["data_type"])
        self.output1_dtype = pb_utils.triton_string_to_numpy(output1_config["data_type"])

    def execute(self, requests):
        responses = []
        for request in requests:
            in_0 = pb_utils.get_input_tensor_by_name(request, "INPUT0")
            in_1 = pb_utils.get_input_tensor_by_name(request, "INPUT1")
            out_0 = in_0.as_numpy() + in_1.as_numpy()
            out_1 = in_0.as_numpy() - in_1.as_numpy()
            out_tensor_0 = pb_utils.Tensor("OUTPUT0", out_0.astype(self.output0_dtype))
            out_tensor_1 = pb_utils.Tensor("OUTPUT1", out_1.astype(self.output1_dtype))
            responses.append(pb_utils.InferenceResponse(output_tensors=[out_tensor_0,
                                                                        out_tensor_1]))
        return responses

    def finalize(self):
        print("Cleaning up...")
'''

PYTORCH_CONFIG = ADD_SUB_CONFIG.replace('"add_sub"', '"pytorch"').split("instance_group")[0]

# Triton's pytorch example's way: torch inside execute, tensors through DLPack
PYTORCH = '''
import torch
import triton_python_backend_utils as pb_utils
from torch.utils.dlpack import from_dlpack, to_dlpack


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            in_0 = from_dlpack(pb_utils.get_input_tensor_by_name(request, "INPUT0").to_dlpack())
            in_1 = torch.from_numpy(pb_utils.get_input_tensor_by_name(request, "INPUT1").as_numpy())
            assert pb_utils.get_input_tensor_by_name(request, "INPUT0").is_cpu()
            responses.append(pb_utils.InferenceResponse([
                pb_utils.Tensor.from_dlpack("OUTPUT0", to_dlpack(torch.add(in_0, in_1))),
                pb_utils.Tensor("OUTPUT1", torch.sub(in_0, in_1).numpy())]))
        return responses
'''

ERRORS_CONFIG = '''
name: "errors"
backend: "python"
max_batch_size: 8
input [ { name: "IN" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [
  { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] },
  { name: "SEEN" data_type: TYPE_INT32 dims: [ 1 ] }
]
dynamic_batching { max_queue_delay_microseconds: 500000 }
'''

# The style of Triton's QA error models: an error response for some requests of a batch
ERRORS = '''
import numpy as np
import triton_python_backend_utils as pb_utils

CODES = {-1: pb_utils.TritonError.INVALID_ARG, -2: pb_utils.TritonError.NOT_FOUND,
         -3: pb_utils.TritonError.UNAVAILABLE, -4: pb_utils.TritonError.UNSUPPORTED}


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            value = int(pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()[0, 0])
            if value < 0:
                error = pb_utils.TritonError(f"refused value {value}", CODES[value])
                responses.append(pb_utils.InferenceResponse(output_tensors=[], error=error))
                continue
            seen = np.full((1, 1), len(requests), np.int32)
            responses.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("OUT", np.full((1, 1), value * 2, np.int32)),
                pb_utils.Tensor("SEEN", seen)]))
        return responses
'''

RAISES_CONFIG = '''
name: "raises"
backend: "python"
input [ { name: "IN" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
'''

RAISES = '''
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        raise pb_utils.TritonModelException("this model fails on purpose")
'''

ECHO_CONFIG = '''
name: "echo"
backend: "python"
max_batch_size: 16
input [ { name: "TEXT" data_type: TYPE_STRING dims: [ 1 ] } ]
output [
  { name: "UPPER" data_type: TYPE_STRING dims: [ 1 ] },
  { name: "ID" data_type: TYPE_STRING dims: [ 1 ] },
  { name: "PARAMETERS" data_type: TYPE_STRING dims: [ 1 ] },
  { name: "ARGS" data_type: TYPE_STRING dims: [ 1 ] },
  { name: "REQUESTS" data_type: TYPE_INT32 dims: [ 1 ] }
]
dynamic_batching { preferred_batch_size: [ 4, 8 ] max_queue_delay_microseconds: 500000 }
parameters { key: "greeting" value: { string_value: "hello" } }
'''

# BYTES in and out, the request's id and parameters, initialize's args, and how many
# requests its execute call got
ECHO = '''
import json

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        self.dtype = pb_utils.triton_string_to_numpy(
            pb_utils.get_output_config_by_name(config, "UPPER")["data_type"])
        self.args = {key: value for key, value in args.items() if key != "model_config"}
        self.args["greeting"] = config["parameters"]["greeting"]["string_value"]
        self.args["max_batch_size"] = config["max_batch_size"]
        pb_utils.Logger.log_info(f"echo initialised as {args['model_instance_name']}")

    def execute(self, requests):
        responses = []
        for request in requests:
            text = pb_utils.get_input_tensor_by_name(request, "TEXT").as_numpy()
            upper = np.array([[item.upper() for item in row] for row in text], self.dtype)
            def one(value):
                return np.array([[value.encode()]], dtype=self.dtype)
            responses.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("UPPER", upper),
                pb_utils.Tensor("ID", one(request.request_id())),
                pb_utils.Tensor("PARAMETERS", one(request.parameters())),
                pb_utils.Tensor("ARGS", one(json.dumps(self.args))),
                pb_utils.Tensor("REQUESTS", np.array([[len(requests)]], np.int32))]))
        return responses
'''

ASYNC_CONFIG = RAISES_CONFIG.replace('"raises"', '"async_triple"')

# an async execute, awaited on the front end's loop
ASYNC = '''
import asyncio

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    async def execute(self, requests):
        await asyncio.sleep(0.01)
        return [pb_utils.InferenceResponse([pb_utils.Tensor(
            "OUT", pb_utils.get_input_tensor_by_name(request, "IN").as_numpy() * 3)])
            for request in requests]
'''

OWN_CONFIG = '''
name: "NAME"
backend: "python"
input [ { name: "IN" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 3 ] } ]
'''

# a model with modules of its own beside it: utils (which another model has too) and a
# package that imports utils by its plain name
OWN = '''
import numpy as np
import triton_python_backend_utils as pb_utils
import utils
from helpers import scale


class TritonPythonModel:
    def execute(self, requests):
        from utils import VALUE  # (imported as execute runs, too)
        return [pb_utils.InferenceResponse([pb_utils.Tensor(
            "OUT", np.array([VALUE, utils.VALUE, scale(1)], np.int32))]) for _ in requests]
'''

HELPERS = '''
import utils


def scale(x):
    return x * utils.VALUE
'''

RETURNS_CONFIG = RAISES_CONFIG.replace('"raises"', '"returns"')

# what execute returns, other than one InferenceResponse per request, by the input
RETURNS = '''
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        value = int(pb_utils.get_input_tensor_by_name(requests[0], "IN").as_numpy()[0])
        if value == 0:
            return None
        if value == 1:
            return []
        if value == 2:
            return ["not a response"]
        # an output that the config does not declare: dropped, as Triton does
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([value], np.int32)),
                                            pb_utils.Tensor("EXTRA", np.array([9], np.int32))])]
'''

BAD_INIT_CONFIG = '''
name: "bad_init"
backend: "python"
input [ { name: "IN" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
'''

BAD_INIT = '''
class TritonPythonModel:
    def initialize(self, args):
        raise ValueError("the weights of " + args["model_name"] + " are missing")

    def execute(self, requests):
        return []
'''

FINALIZED_CONFIG = '''
name: "finalized"
backend: "python"
input [ { name: "IN" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
parameters { key: "marker" value: { string_value: "MARKER" } }
instance_group [ { count: 1 kind: KIND_CPU }, { count: 1 kind: KIND_CPU } ]
'''

FINALIZED = '''
import json
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        self.marker = config["parameters"]["marker"]["string_value"]

    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.get_input_tensor_by_name(r, "IN")])
                for r in requests]

    def finalize(self):
        with open(self.marker, "a") as f:
            f.write("finalized\\n")
'''

REPEAT_CONFIG = '''
name: "repeat"
backend: "python"
model_transaction_policy { decoupled: true }
input [
  { name: "IN" data_type: TYPE_INT32 dims: [ -1 ] },
  { name: "GATE" data_type: TYPE_STRING dims: [ 1 ] optional: true }
]
output [
  { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] },
  { name: "IDX" data_type: TYPE_UINT32 dims: [ 1 ] }
]
'''

# In the style of Triton's repeat example: a response for each element of IN (before
# each after the first, a byte from the FIFO GATE, if given), then the final flag; an
# error response for a negative element; execute raises for a zero, and returns a list
# (not None) for 99
REPEAT = '''
import json

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        model_config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(model_config):
            raise pb_utils.TritonModelException("repeat must be decoupled")
        self.idx_dtype = pb_utils.triton_string_to_numpy(
            pb_utils.get_output_config_by_name(model_config, "IDX")["data_type"])

    def execute(self, requests):
        for request in requests:
            values = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
            gate = pb_utils.get_input_tensor_by_name(request, "GATE")
            sender = request.get_response_sender()
            for index, value in enumerate(values):
                if gate is not None and index:  # (a FIFO of its own for each step)
                    with open(f"{gate.as_numpy()[0].decode()}{index}", "rb") as f:
                        f.read(1)
                if value == 0:
                    raise pb_utils.TritonModelException("zero is not repeated")
                if value == 99:
                    return []
                if value < 0:
                    error = pb_utils.TritonError(f"negative value {value}",
                                                 pb_utils.TritonError.INVALID_ARG)
                    sender.send(pb_utils.InferenceResponse(error=error))
                    continue
                sender.send(pb_utils.InferenceResponse([
                    pb_utils.Tensor("OUT", np.array([value], np.int32)),
                    pb_utils.Tensor("IDX", np.array([index], self.idx_dtype))]))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            try:
                sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            except pb_utils.TritonModelException as error:
                pb_utils.Logger.log_info(f"after the final flag: {error}")
        return None
'''

SQUARES_CONFIG = '''
name: "squares"
backend: "python"
model_transaction_policy { decoupled: true }
input [ { name: "IN" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
'''

# In the style of Triton's square example: execute starts a thread per request and
# returns; the thread (once execute has returned, and the thread that ran it has ended)
# sends IN responses, i * i, then the final flag; finalize waits for the threads
SQUARES = '''
import threading

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.inflight = []

    def execute(self, requests):
        caller = threading.current_thread()
        for request in requests:
            thread = threading.Thread(target=self.respond, args=(request, caller))
            thread.start()
            self.inflight.append(thread)
        return None

    def respond(self, request, caller):
        caller.join()
        n = int(pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()[0])
        sender = request.get_response_sender()
        for i in range(n):
            sender.send(pb_utils.InferenceResponse([
                pb_utils.Tensor("OUT", np.array([i * i], np.int32))]))
        sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def finalize(self):
        for thread in self.inflight:
            thread.join()
'''

WATCHER_CONFIG = '''
name: "watcher"
backend: "python"
model_transaction_policy { decoupled: true }
input [ { name: "NOTE" data_type: TYPE_STRING dims: [ 1 ] } ]
output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
'''

# one response, then (for at most a minute) it waits until its request is cancelled, and
# notes whether it was into the file NOTE
WATCHER = '''
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        request = requests[0]
        note = pb_utils.get_input_tensor_by_name(request, "NOTE").as_numpy()[0].decode()
        sender = request.get_response_sender()
        sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.ones(1, np.int32))]))
        for _ in range(6000):
            if request.is_cancelled() and sender.is_cancelled():
                break
            time.sleep(0.01)
        with open(note, "w") as f:
            f.write(f"cancelled: {request.is_cancelled()}")
        sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
'''


def _model(repository, name: str, config: str, code: str, version: str = "1") -> str:
    folder = repository / name
    (folder / version).mkdir(parents=True, exist_ok=True)
    (folder / "config.pbtxt").write_text(config)
    (folder / version / "model.py").write_text(textwrap.dedent(code))
    return str(folder)


@pytest.fixture(scope="module")
def triton(tmp_path_factory):
    repository = tmp_path_factory.mktemp("triton_repository")
    _model(repository, "add_sub", ADD_SUB_CONFIG, "raise ImportError('version 1 is old')")
    _model(repository, "add_sub", ADD_SUB_CONFIG, ADD_SUB, version="2")  # served: the highest
    if HAS_TORCH:
        _model(repository, "pytorch", PYTORCH_CONFIG, PYTORCH)
    _model(repository, "errors", ERRORS_CONFIG, ERRORS)
    _model(repository, "raises", RAISES_CONFIG, RAISES)
    _model(repository, "echo", ECHO_CONFIG, ECHO)
    _model(repository, "async_triple", ASYNC_CONFIG, ASYNC)
    _model(repository, "returns", RETURNS_CONFIG, RETURNS)
    _model(repository, "repeat", REPEAT_CONFIG, REPEAT)
    _model(repository, "squares", SQUARES_CONFIG, SQUARES)
    _model(repository, "watcher", WATCHER_CONFIG, WATCHER)
    for name, value in (("own_a", 1), ("own-b", 2)):
        folder = _model(repository, name, OWN_CONFIG.replace("NAME", name), OWN)
        with open(os.path.join(folder, "1", "utils.py"), "w") as f:
            f.write(f"VALUE = {value}\n")
        os.mkdir(os.path.join(folder, "1", "helpers"))
        with open(os.path.join(folder, "1", "helpers", "__init__.py"), "w") as f:
            f.write(HELPERS)
    (repository / "not_a_model").mkdir()  # (no config.pbtxt: not served)
    # one interpreter (--interpreters wins over instance_group's count): every client's
    # requests reach the same batcher
    server = _start(tmp_path_factory.mktemp("triton_server"), [],
                    "--model-repository", str(repository), "--grpc-port", "0",
                    "--interpreters", "1")
    server.repository = str(repository)
    try:
        yield server
    finally:
        _stop(server)


def _grpc(server):
    return grpcclient.InferenceServerClient(f"127.0.0.1:{_grpc_port(server)}")


def _inputs(module, *named: tuple[str, np.ndarray, str]) -> list:
    found = []
    for name, array, datatype in named:
        tensor = module.InferInput(name, list(array.shape), datatype)
        tensor.set_data_from_numpy(array)
        found.append(tensor)
    return found


def test_add_sub_over_http_and_grpc(triton):
    a = np.array([1.0, 2.0, 3.0, 4.0], np.float32)
    b = np.array([0.5, 0.5, 1.0, 10.0], np.float32)
    for module, client in ((httpclient, triton.client()), (grpcclient, _grpc(triton))):
        result = client.infer("add_sub", _inputs(module, ("INPUT0", a, "FP32"),
                                                 ("INPUT1", b, "FP32")))
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + b)
        np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a - b)
        only = client.infer("add_sub", _inputs(module, ("INPUT0", a, "FP32"),
                                               ("INPUT1", b, "FP32")),
                            outputs=[module.InferRequestedOutput("OUTPUT1")])
        assert only.as_numpy("OUTPUT0") is None
        np.testing.assert_array_equal(only.as_numpy("OUTPUT1"), a - b)


def test_metadata_versions_and_start(triton):
    metadata = triton.client().get_model_metadata("add_sub")
    assert metadata["versions"] == ["2"] and metadata["platform"] == "python"
    assert metadata["inputs"] == [{"name": "INPUT0", "datatype": "FP32", "shape": [4]},
                                  {"name": "INPUT1", "datatype": "FP32", "shape": [4]}]
    echo = _grpc(triton).get_model_metadata("echo", as_json=True)
    assert echo["inputs"] == [{"name": "TEXT", "datatype": "BYTES", "shape": ["-1", "1"]}]
    assert [o["name"] for o in echo["outputs"]] == ["UPPER", "ID", "PARAMETERS", "ARGS",
                                                    "REQUESTS"]
    assert triton.client().is_model_ready("add_sub", "2")
    assert not triton.client().is_model_ready("not_a_model")
    output = triton.output()
    assert "config.pbtxt: multipy does not read optimization, model_warmup" in output
    # the start-up line says what loading a Triton model does (no archive is served)
    assert "in each: a Triton model's model.py imported and its initialize() run" in output
    assert "archive loaded" not in output
    status, message = _client_error(lambda: triton.client().infer(
        "add_sub", _inputs(httpclient, ("INPUT0", np.zeros(3, np.float32), "FP32"),
                           ("INPUT1", np.zeros(4, np.float32), "FP32"))))
    assert status == "400" and "input 'INPUT0' has shape [3], not [4]" in message


@pytest.mark.skipif(not HAS_TORCH, reason="torch is not installed")
def test_torch_inside_execute(triton):
    a = np.arange(4, dtype=np.float32)
    b = np.full(4, 2.0, np.float32)
    result = _grpc(triton).infer("pytorch", _inputs(grpcclient, ("INPUT0", a, "FP32"),
                                                    ("INPUT1", b, "FP32")))
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + b)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a - b)


def _together(count: int, call) -> list:
    """call(k) for k in range(count), each on a thread of its own, started together:
    what each returned (or raised)."""
    results: list = [None] * count
    barrier = threading.Barrier(count)

    def run(k: int) -> None:
        barrier.wait()
        try:
            results[k] = call(k)
        except Exception as error:  # (the test looks at it)
            results[k] = error

    threads = [threading.Thread(target=run, args=(k,)) for k in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert all(result is not None for result in results)
    return results


def _errors_call(module, value: int, server):
    client = server.client() if module is httpclient else _grpc(server)
    return client.infer("errors", _inputs(module, ("IN", np.array([[value]], np.int32),
                                                   "INT32")))


def test_an_error_response_for_one_request_of_a_batch(triton):
    for module in (httpclient, grpcclient):
        good, bad = _together(2, lambda k: _errors_call(module, 21 if k == 0 else -1, triton))
        # one execute call answered both: the good one saw two requests
        assert good.as_numpy("OUT")[0, 0] == 42
        assert good.as_numpy("SEEN")[0, 0] == 2
        assert "refused value -1" in bad.message()
        assert bad.status() == ("400" if module is httpclient else "StatusCode.INVALID_ARGUMENT")


@pytest.mark.parametrize("value, http, grpc", [
    (-2, "404", "StatusCode.NOT_FOUND"), (-3, "503", "StatusCode.UNAVAILABLE"),
    (-4, "501", "StatusCode.UNIMPLEMENTED")])
def test_error_codes_as_triton_answers_them(triton, value, http, grpc):
    for module, status in ((httpclient, http), (grpcclient, grpc)):
        got, message = _client_error(lambda: _errors_call(module, value, triton))
        assert got == status and f"refused value {value}" in message


def test_an_exception_from_execute(triton):
    inputs = ("IN", np.array([7], np.int32), "INT32")
    said = ("Failed to process the request(s) for model instance 'raises_0_0', message: "
            "TritonModelException: this model fails on purpose")
    status, message = _client_error(lambda: triton.client().infer(
        "raises", _inputs(httpclient, inputs)))
    assert status == "500" and said in message and "multipy" not in message, message
    status, message = _client_error(lambda: _grpc(triton).infer(
        "raises", _inputs(grpcclient, inputs)))
    assert status == "StatusCode.INTERNAL" and said in message, message
    output = triton.output()  # the server's log has it, with the traceback
    assert said in output and 'model.py", line 7, in execute' in output


@pytest.mark.parametrize("value, said", [
    (0, "Expected a list in the execute return, found type '<class 'NoneType'>'."),
    (1, "Number of InferenceResponse objects do not match the number of InferenceRequest "
        "objects. InferenceRequest(s) size is:1, and InferenceResponse(s) size is:0"),
    (2, "Expected an 'InferenceResponse' object in the execute function return list, "
        "found type '<class 'str'>'.")])
def test_what_execute_returns_wrong_in_tritons_words(triton, value, said):
    inputs = ("IN", np.array([value], np.int32), "INT32")
    status, message = _client_error(lambda: triton.client().infer(
        "returns", _inputs(httpclient, inputs)))
    assert status == "500", message
    assert message.endswith("Failed to process the request(s) for model instance "
                            f"'returns_0_0', message: {said}"), message


def test_outputs_the_request_does_not_ask_for_are_dropped(triton):
    for module, client in ((httpclient, triton.client()), (grpcclient, _grpc(triton))):
        result = client.infer("returns", _inputs(module, ("IN", np.array([5], np.int32),
                                                          "INT32")))
        assert result.as_numpy("OUT").tolist() == [5]
        assert result.as_numpy("EXTRA") is None


def test_each_model_imports_its_own_modules(triton):
    # both models load in the one interpreter; each has its own utils.py
    for module, client in ((httpclient, triton.client()), (grpcclient, _grpc(triton))):
        for name, value in (("own_a", 1), ("own-b", 2)):
            result = client.infer(name, _inputs(module, ("IN", np.array([0], np.int32),
                                                         "INT32")))
            assert result.as_numpy("OUT").tolist() == [value] * 3, name


def test_more_rows_than_max_batch_size(triton):
    rows = np.arange(1, 10, dtype=np.int32).reshape(9, 1)
    for module, status in ((httpclient, "400"), (grpcclient, "StatusCode.INVALID_ARGUMENT")):
        client = triton.client() if module is httpclient else _grpc(triton)
        got, message = _client_error(lambda: client.infer(
            "errors", _inputs(module, ("IN", rows, "INT32"))))
        assert got == status
        assert "inference request batch-size must be <= 8 for 'errors'" in message
    # (the model answers for the first row) eight rows are taken
    result = triton.client().infer("errors", _inputs(httpclient, ("IN", rows[:8], "INT32")))
    assert result.as_numpy("OUT").tolist() == [[2]]


def _echo(module, server, k: int):
    client = server.client() if module is httpclient else _grpc(server)
    text = np.array([[f"word {k}".encode()]], dtype=np.object_)
    return client.infer("echo", _inputs(module, ("TEXT", text, "BYTES")),
                        request_id=f"request-{k}", parameters={"k": k, "tag": f"t{k}"})


def test_dynamic_batching_each_answered_on_its_own(triton):
    for module in (httpclient, grpcclient):
        results = _together(6, lambda k: _echo(module, triton, k))
        seen = []
        for k, result in enumerate(results):
            assert not isinstance(result, Exception), result
            assert result.as_numpy("UPPER").tolist() == [[f"WORD {k}".encode()]]
            assert result.as_numpy("ID")[0, 0] == f"request-{k}".encode()
            response = result.get_response()
            assert (response["id"] if module is httpclient else response.id) == f"request-{k}"
            assert json.loads(result.as_numpy("PARAMETERS")[0, 0]) == {"k": k, "tag": f"t{k}"}
            seen.append(int(result.as_numpy("REQUESTS")[0, 0]))
        # several clients' requests went into one execute call (six clients, a 0.5 s
        # window: at least one call held more than one)
        assert max(seen) > 1, seen


def test_initialize_gets_tritons_args(triton):
    args = json.loads(_echo(httpclient, triton, 0).as_numpy("ARGS")[0, 0])
    assert args["model_name"] == "echo" and args["model_version"] == "1"
    assert args["model_repository"] == os.path.join(triton.repository, "echo")
    assert args["model_instance_kind"] == "CPU"
    assert args["model_instance_name"] == "echo_0_0"
    assert args["model_instance_device_id"] == "0"
    assert args["greeting"] == "hello" and args["max_batch_size"] == 16
    assert "echo initialised as echo_0_0" in triton.output()


def test_an_async_execute(triton):
    for module, client in ((httpclient, triton.client()), (grpcclient, _grpc(triton))):
        result = client.infer("async_triple", _inputs(module, ("IN", np.array([5], np.int32),
                                                               "INT32")))
        assert result.as_numpy("OUT").tolist() == [15]


def test_config_pbtxt_as_triton_reads_it(tmp_path, caplog):
    from multipy.serve.host import triton_model

    text = ECHO_CONFIG + '''
        input [ { name: "EXTRA" data_type: TYPE_INT64 dims: [ -1, 3 ] optional: true
                  is_non_linear_format_io: false } ]
        response_cache { enable: true }
        version_policy: { specific: { versions: [ 1, 3 ] } }
        sequence_batching: < max_sequence_idle_microseconds: 5 >
        '''
    config = triton_model.as_dict(triton_model.parse(text, "config.pbtxt"))
    assert "input.is_non_linear_format_io, response_cache, sequence_batching" in caplog.text
    assert config["input"][1] == {"name": "EXTRA", "data_type": "TYPE_INT64",
                                  "dims": [-1, 3], "optional": True, "format": "FORMAT_NONE",
                                  "is_shape_tensor": False, "allow_ragged_batch": False}
    assert config["dynamic_batching"]["preferred_batch_size"] == [4, 8]
    assert config["dynamic_batching"]["max_queue_delay_microseconds"] == 500000
    assert config["parameters"] == {"greeting": {"string_value": "hello"}}
    folder = tmp_path / "echo"
    for version in ("1", "2", "3", "4"):
        (folder / version).mkdir(parents=True)
        (folder / version / "model.py").write_text("")
    (folder / "config.pbtxt").write_text(text)
    model = triton_model.read(str(folder))
    assert model.version == "3" and model.instances is None  # version_policy's highest
    with pytest.raises(triton_model.ModelConfigError, match="config.pbtxt: 1:"):
        triton_model.parse("max_batch_size: many", "config.pbtxt")
    decoupled = triton_model.parse("model_transaction_policy { decoupled: True }", "c")
    assert triton_model.as_dict(decoupled)["model_transaction_policy"] == {"decoupled": True}
    (folder / "config.pbtxt").write_text('backend: "onnxruntime"')
    with pytest.raises(triton_model.ModelConfigError, match="Python backend only"):
        triton_model.read(str(folder))


def test_bytes_tensors_serialised_as_triton_does():
    import multipy

    # (multipy._inside runs in interpreters only: its file, alone, here)
    path = os.path.join(os.path.dirname(multipy.__file__), "_inside", "triton_utils.py")
    spec = importlib.util.spec_from_file_location("triton_utils_alone", path)
    pb_utils = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pb_utils)
    array = np.array([[b"ab", "\u00e9".encode()], [b"", b"xyz"]], dtype=np.object_)
    flat = pb_utils.serialize_byte_tensor(array)
    assert bytes(flat) == b"\x02\x00\x00\x00ab\x02\x00\x00\x00\xc3\xa9" \
        b"\x00\x00\x00\x00\x03\x00\x00\x00xyz"
    assert pb_utils.deserialize_bytes_tensor(flat).tolist() == [b"ab", b"\xc3\xa9", b"",
                                                                 b"xyz"]
    assert pb_utils.triton_string_to_numpy("TYPE_STRING") is np.object_
    assert pb_utils.triton_to_numpy_type(11) is np.float32
    assert pb_utils.numpy_to_triton_type(np.int64) == 9


def _serve(argv: list[str]) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    return subprocess.Popen([sys.executable, "-m", "multipy", "serve", *argv],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env)


def test_an_initialize_that_fails_stops_the_start(tmp_path):
    folder = _model(tmp_path, "bad_init", BAD_INIT_CONFIG, BAD_INIT)
    process = _serve([folder, "--interpreters", "1", "--port", "0"])
    output, _ = process.communicate(timeout=120)
    assert process.returncode == 2, output
    assert "Triton model 'bad_init'" in output
    assert "ValueError: the weights of bad_init are missing" in output


def test_one_model_folder_and_finalize_at_the_stop(tmp_path):
    marker = tmp_path / "finalized.txt"
    folder = _model(tmp_path, "finalized",
                    FINALIZED_CONFIG.replace("MARKER", str(marker)), FINALIZED)
    process = _serve([folder, "--port", "0"])  # instance_group: 2 instances
    lines = []
    try:
        for line in process.stdout:
            lines.append(line)
            if "ready in" in line:
                break
        assert any("ready in" in line for line in lines), "".join(lines)
        process.send_signal(signal.SIGTERM)
        output, _ = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=30)
    assert process.returncode == 0, "".join(lines) + output
    assert "finalized on 2 interpreter(s)" in "".join(lines)
    assert marker.read_text() == "finalized\n" * 2  # each interpreter's instance


def test_config_errors_stop_the_start(tmp_path):
    folder = _model(tmp_path, "wrong", BAD_INIT_CONFIG.replace("bad_init", "other"), BAD_INIT)
    process = _serve([folder, "--port", "0"])
    output, _ = process.communicate(timeout=120)
    assert process.returncode == 2
    assert "name 'other' is not the folder's name 'wrong'" in output
    process = _serve(["--model-repository", str(tmp_path / "wrong" / "1"), "--port", "0"])
    output, _ = process.communicate(timeout=120)
    assert process.returncode == 2 and "no model folder" in output


def test_a_decoupled_model_streams_over_grpc(triton):
    """Triton's repeat: a response per element, then (enable_empty_final_response) an
    empty one with the final flag; an error response, what execute raises, or a return
    other than None, ends its request's answer with that error (in Triton's words),
    after the responses sent before it."""
    client = _grpc(triton)
    answers: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: answers.put((result, error)))

    def repeat(values: list[int], request_id: str, **options) -> None:
        client.async_stream_infer("repeat", _inputs(grpcclient, (
            "IN", np.array(values, np.int32), "INT32")), request_id=request_id, **options)

    try:
        repeat([4, 5, 6], "r1", enable_empty_final_response=True)
        pieces = []
        while True:
            result, error = answers.get(timeout=60)
            assert error is None, error
            response = result.get_response()
            assert response.id == "r1"
            if response.parameters["triton_final_response"].bool_param:
                assert not response.outputs
                break
            pieces.append((int(result.as_numpy("OUT")[0]), int(result.as_numpy("IDX")[0])))
        assert pieces == [(4, 0), (5, 1), (6, 2)]
        failed = "Failed to process the request(s) for model instance 'repeat_0_0', message: "
        for values, said in (([7, -1, 8], "negative value -1"),
                             ([7, 0, 8], failed + "TritonModelException: zero is not repeated"),
                             ([7, 99], failed + "Python model 'repeat' is using the decoupled "
                                                "mode and the execute function must return "
                                                "None.")):
            repeat(values, "r2")
            result, error = answers.get(timeout=60)
            assert error is None and result.as_numpy("OUT").tolist() == [7]
            result, error = answers.get(timeout=60)
            assert result is None and said in str(error), error
    finally:
        client.stop_stream()
        client.close()
    assert "zero is not repeated" in triton.output()  # (logged, with its traceback)


def test_each_response_is_written_as_the_model_sends_it(triton, tmp_path):
    """The model waits on a FIFO before each response after the first, in execute: the
    test reads each event before it lets the model go on."""
    gates = [tmp_path / f"gate{index}" for index in (1, 2)]
    for gate in gates:
        os.mkfifo(gate)
    events = _Events(triton, "repeat", {"IN": [4, 5, 6], "GATE": str(tmp_path / "gate"),
                                        "id": "e1"})
    try:
        assert events.status == 200
        for index, value in enumerate([4, 5, 6]):
            assert events.next() == {"model_name": "repeat", "model_version": "1",
                                     "id": "e1", "OUT": value, "IDX": index}
            if index < 2:
                until(lambda: write_one(gates[index]))
        assert events.next() is None
    finally:
        events.close()
    # a send after the final flag raises, in Triton's words
    until(lambda: "after the final flag: Unable to send response. Response sender has "
                  "been closed." in triton.output())


def test_a_decoupled_model_sends_from_a_thread_after_execute_returned(triton):
    events = _Events(triton, "squares", {"IN": 4})
    try:
        assert [event["OUT"] for event in events.rest()] == [0, 1, 4, 9]
    finally:
        events.close()
    # /infer and ModelInfer answer with a model's one response; a second is refused there
    for module, client in ((httpclient, triton.client()), (grpcclient, _grpc(triton))):
        result = client.infer("squares", _inputs(module, ("IN", np.array([1], np.int32),
                                                          "INT32")))
        assert result.as_numpy("OUT").tolist() == [0]
        _, message = _client_error(lambda: client.infer("squares", _inputs(
            module, ("IN", np.array([2], np.int32), "INT32"))))
        assert "answers in pieces" in message and "generate_stream" in message


def test_an_error_response_answers_infer_with_its_code(triton):
    for module, client, status in ((httpclient, triton.client(), "400"),
                                   (grpcclient, _grpc(triton), "StatusCode.INVALID_ARGUMENT")):
        got, message = _client_error(lambda: client.infer("repeat", _inputs(
            module, ("IN", np.array([-3], np.int32), "INT32"))))
        assert got == status and "negative value -3" in message


def test_a_client_that_goes_cancels_its_request(triton, tmp_path):
    note = tmp_path / "note"
    events = _Events(triton, "watcher", {"NOTE": str(note)})
    try:
        assert events.next()["OUT"] == 1
    finally:
        events.close()
    until(lambda: note.exists() and note.read_text() != "")
    assert note.read_text() == "cancelled: True"


def test_timeout_cancels_a_decoupled_request(tmp_path):
    """With --timeout, steps run on the interpreter's call thread: the wait for the
    model's next response is cancelled there too, the request is cancelled, and the
    interpreter answers on."""
    for name, config, code in (("watcher", WATCHER_CONFIG, WATCHER),
                               ("squares", SQUARES_CONFIG, SQUARES)):
        _model(tmp_path / "repository", name, config, code)
    (tmp_path / "server").mkdir()
    server = _start(tmp_path / "server", [], "--model-repository",
                    str(tmp_path / "repository"), "--interpreters", "1", "--timeout", "2")
    try:
        note = tmp_path / "note"
        events = _Events(server, "watcher", {"NOTE": str(note)})
        try:
            assert events.next()["OUT"] == 1
            assert "did not answer within 2.0 s (--timeout)" in events.next()["error"]
        finally:
            events.close()
        until(lambda: note.exists() and note.read_text() != "")
        assert note.read_text() == "cancelled: True"
        result = server.client().infer("squares", _inputs(httpclient, (
            "IN", np.array([1], np.int32), "INT32")))
        assert result.as_numpy("OUT").tolist() == [0]
    finally:
        _stop(server)
