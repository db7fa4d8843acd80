"""A served model, inside one interpreter: what ``multipy serve`` runs here.

The serving host never imports torch.  It sends numpy arrays, lent without copies
(multipy._sharing); here they become tensors over the same memory (``torch.from_numpy``),
the model runs under ``torch.no_grad()``, and its outputs go back as numpy arrays over
the outputs' own memory, lent the same way.  A model served on a CUDA device has its
weights in device memory that the host copied there once (multipy.serve.host.archive.
on_device), aliased here; its inputs are copied to the device and its outputs back.  On
the CPU, the weights alias this interpreter's mapping of the archive's file (the page
cache's pages, shared by every interpreter).  BF16 has no numpy dtype: a BF16 tensor
crosses, both ways, as a uint16 array of its bits (``tensor.view(torch.uint16)``).

BYTES (text, and other data of variable length) has no tensor: a BYTES input reaches the
model as the numpy array itself, of dtype object holding ``bytes`` (as Triton's Python
backend gives it), and an output of str or bytes goes back as BYTES, its str UTF-8
encoded: a str or bytes, a list of them, or a numpy array of them (of dtype object, or
numpy's ``S`` and ``U``).  Such arrays cross between host and interpreter pickled.

torch is imported on first use, not with this module.  Errors of types the host could
only re-create by importing torch (or a packaged module) are raised as RuntimeError,
their type named in the message and the original chained in the traceback.
"""
from __future__ import annotations

import inspect
import json
import linecache
import sys
import types
from typing import Any

#: The Open Inference Protocol's datatypes of torch's dtypes (by name: torch is not
#: imported here).  bfloat16 crosses as uint16 bits, under its own datatype.
_DATATYPES = {"bool": "BOOL", "uint8": "UINT8", "uint16": "UINT16", "uint32": "UINT32",
              "uint64": "UINT64", "int8": "INT8", "int16": "INT16", "int32": "INT32",
              "int64": "INT64", "float16": "FP16", "bfloat16": "BF16", "float32": "FP32",
              "float64": "FP64"}
#: ... and of numpy's dtypes (names), for outputs that are arrays or numbers.
_NUMPY_DATATYPES = {"bool": "BOOL", "uint8": "UINT8", "uint16": "UINT16", "uint32": "UINT32",
                    "uint64": "UINT64", "int8": "INT8", "int16": "INT16", "int32": "INT32",
                    "int64": "INT64", "float16": "FP16", "float32": "FP32", "float64": "FP64"}
#: Every datatype a model may declare for an input or output.
_DECLARABLE = (*_DATATYPES.values(), "BYTES")
#: How the names of a torch.package's own modules begin (its PackageImporter mangles them).
_MANGLED = "<torch_package_"
_INPUT_KINDS = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD,
                inspect.Parameter.KEYWORD_ONLY)


def load(path: str, module: str, resource: str, storages: dict[str, Any],
         device: str = "cpu", keeper: Any = None) -> Served:
    """The model pickled at (module, resource) of the torch.package archive at path,
    ready to serve on device.  storages: the archive's storage records (record name ->
    (offset, size) in the file, which this interpreter maps (``package.mapped``); on a
    CUDA device, (address, size) of the host's copy in device memory, which keeper, lent
    by the host, keeps), which the model's tensors alias instead of reading the file.
    The archive's (module, "example.pkl"), if it has one, is a tuple of example inputs:
    it names the inputs' datatypes and shapes in the metadata, and warms the model up.
    Its (module, "config.json"), if it has one, declares the inputs (and outputs): see
    ``declared``."""
    import torch

    from .package import importer, load_pickle, mapped

    if device == "cpu":
        shared = mapped(path, storages)
        location = None
    else:
        shared = {name: _on_device(torch, address, size, device)
                  for name, (address, size) in storages.items()}
        location = device
    package_importer = importer(path, shared)
    model = load_pickle(package_importer, module, resource, location)
    example = config = None
    folder = module.replace(".", "/")
    records = package_importer.zip_reader.get_all_records()
    if f"{folder}/example.pkl" in records:
        example = load_pickle(package_importer, module, "example.pkl", location)
        if not isinstance(example, tuple):
            example = (example,)
    if f"{folder}/config.json" in records:
        config = declared(package_importer.load_text(module, "config.json"))
    return Served(model, example, package_importer.modules.values(), config, device, keeper)


class _DeviceBytes:
    """Bytes in device memory that the host holds, as torch.as_tensor takes them: the
    CUDA Array Interface (version 3), with no stream to wait for (the host's copy ended
    before the host sent the address)."""

    def __init__(self, address: int, size: int) -> None:
        self.__cuda_array_interface__ = {"shape": (size,), "typestr": "|u1",
                                         "data": (address, False), "version": 3,
                                         "strides": None, "stream": None}


def _on_device(torch: Any, address: int, size: int, device: str) -> Any:
    """A uint8 tensor on device over size bytes at address, which it does not own."""
    if not size:
        return torch.empty(0, dtype=torch.uint8, device=device)
    return torch.as_tensor(_DeviceBytes(address, size), device=device)


def declared(text: str) -> dict[str, list[dict]]:
    """What a model's config.json declares (see ``declaration``); ValueError saying what
    is wrong."""
    try:
        config = json.loads(text)
    except ValueError as error:
        raise ValueError(f"config.json is not JSON: {error}") from None
    return declaration(config)


def declaration(config: Any, where: str = "config.json") -> dict[str, list[dict]]:
    """The inputs and outputs that config declares: {"inputs": [...], "outputs": [...]},
    each an object {"name", "datatype" (the protocol's), "shape" (a list of sizes, -1 for
    any size)}, an input also "optional": true if it may be left out; "outputs" may be
    left out.  ValueError saying what is wrong (in where)."""
    if not isinstance(config, dict) or not isinstance(config.get("inputs"), list) \
            or not isinstance(config.get("outputs", []), list):
        raise ValueError(f'{where} must be an object with a list "inputs" (and a list '
                         f'"outputs")')
    found: dict[str, list[dict]] = {"inputs": [], "outputs": []}
    for kind in found:
        for spec in config.get(kind, []):
            if not isinstance(spec, dict) or not isinstance(spec.get("name"), str) \
                    or spec.get("datatype") not in _DECLARABLE \
                    or not isinstance(spec.get("shape"), list) \
                    or not all(type(size) is int and size >= -1 for size in spec["shape"]) \
                    or set(spec) - {"name", "datatype", "shape", "optional"}:
                raise ValueError(f"{where}: each of {kind!r} must be an object with a "
                                 f'"name", a "datatype" of {", ".join(_DECLARABLE)} and a '
                                 f'"shape" of sizes (-1: any), not {spec!r}')
            found[kind].append({"name": spec["name"], "datatype": spec["datatype"],
                                "shape": spec["shape"],
                                **({"optional": True} if spec.get("optional") else {})})
        names = [spec["name"] for spec in found[kind]]
        if len(set(names)) != len(names):
            raise ValueError(f"{where}: two of {kind!r} have one name")
    return found


class Served:
    """One model in this interpreter, called by the host with numpy arrays."""

    def __init__(self, model: Any, example: tuple | None, modules: Any = (),
                 config: dict[str, list[dict]] | None = None, device: str = "cpu",
                 keeper: Any = None) -> None:
        self.model = model
        self.config = config
        #: where the model runs: inputs are copied there
        self.device = device
        #: what keeps the memory that the model's weights alias, where the host holds it
        self.keeper = keeper
        # the package's own modules (mangled names; not its extern ones): see forget
        own = [module for module in modules if isinstance(module, types.ModuleType)
               and module.__name__.startswith(_MANGLED)]
        self._namespaces = {id(vars(module)) for module in own}
        self._files = {module.__file__ for module in own if getattr(module, "__file__", None)}
        self.example = example
        forward = getattr(model, "forward", model)
        parameters = inspect.signature(forward).parameters.values()
        #: The forward's parameters that an input can be given to (not *args, **kwargs).
        self.parameters = [p.name for p in parameters if p.kind in _INPUT_KINDS]
        import torch

        modules = [model] if isinstance(model, torch.nn.Module) else [
            value for value in vars(model).values() if isinstance(value, torch.nn.Module)]
        for module in modules:
            module.eval()
            # Parameters alias the archive, shared by every interpreter; buffers (running
            # statistics, caches) may be written by forward: each interpreter its own.
            for owner in module.modules():
                for name, buffer in owner._buffers.items():
                    if buffer is not None:
                        owner._buffers[name] = buffer.clone()
        self._torch = torch
        #: storages of the model's own state: an output over one is copied, or the next
        #: call here could change it while the host still reads it
        self.state = {tensor.untyped_storage().data_ptr() for module in modules
                      for tensor in (*module.parameters(), *module.buffers())}

    def infer(self, names: tuple[str, ...] | None, datatypes: tuple[str, ...], *arrays: Any
              ) -> tuple:
        """Runs the model on the arrays, each of its datatype, given by position, or by
        name when names are given (tensors, but BYTES arrays as they are), with autograd
        off (as ``torch.no_grad()``); returns its outputs as (names, datatypes, *arrays),
        named as ``named_outputs`` says.  Flat, so that the call takes multipy's fast path."""
        torch = self._torch
        try:
            tensors = [_tensor(torch, array, datatype, self.device)
                       for array, datatype in zip(arrays, datatypes)]
            enabled = torch.is_grad_enabled()  # (no_grad's calls of C, less its Python)
            torch._C._set_grad_enabled(False)
            try:
                result = self.model(*tensors) if names is None else \
                    self.model(**dict(zip(names, tensors)))
            finally:
                torch._C._set_grad_enabled(enabled)
            outputs = named_outputs(torch, result, self.state)
        except Exception as error:
            raise_plainly(error)
        return flat(outputs)

    def forget(self) -> None:
        """Lets go of what the process keeps of the model's package for good, so that
        the model's memory is given back once it is dropped (unloaded): the globals of
        its modules that called ``torch.fx.wrap``, which torch.fx registers for every
        later trace, and the source lines that tracebacks and tracing cached (linecache,
        whose lazy entries hold the package's importer)."""
        for file in self._files:
            linecache.cache.pop(file, None)
        fx = sys.modules.get("torch.fx._symbolic_trace")
        registry = getattr(fx, "_wrapped_fns_to_patch", None)
        if isinstance(registry, dict):
            for key, namespace in list(registry.items()):
                if id(namespace) in self._namespaces:
                    del registry[key]

    def metadata(self) -> dict[str, Any]:
        """The inputs (forward's parameters) and, when the archive has an example, the
        outputs, each as {"name", "datatype", "shape"}: shapes are the example's with
        -1 for the leading (batch) dimension (BYTES for an example of str or bytes, as
        ``output_array`` takes them); without an example, FP32 and [-1].  What config.json
        declares instead, where it does ("declared": True then, and requests are checked
        against the inputs)."""
        import torch

        if self.config is not None:
            outputs = self.config["outputs"]
            if not outputs and self.example is not None:
                outputs = self._example_outputs(torch)
            return {"inputs": self.config["inputs"], "outputs": outputs, "declared": True}
        inputs = []
        for position, name in enumerate(self.parameters):
            value = self.example[position] if self.example and position < len(self.example) else None
            inputs.append({"name": name, **_described(torch, value)})
        outputs = self._example_outputs(torch) if self.example is not None else []
        return {"inputs": inputs, "outputs": outputs}

    def _example_outputs(self, torch: Any) -> list[dict]:
        return [{"name": name, "datatype": datatype,
                 "shape": [-1, *array.shape[1:]] if array.ndim else []}
                for name, datatype, array in self._run_example(torch)]

    def warm_up(self) -> None:
        """Runs the example once, if the archive has one: first calls are slow."""
        if self.example is not None:
            import torch

            self._run_example(torch)

    def _run_example(self, torch: Any) -> list[tuple[str, str, Any]]:
        try:
            with torch.no_grad():
                return named_outputs(torch, self.model(*self.example), self.state)
        except Exception as error:
            raise_plainly(error)


def _described(torch: Any, value: Any) -> dict:
    if isinstance(value, torch.Tensor) and str(value.dtype).rpartition(".")[2] in _DATATYPES:
        datatype = _DATATYPES[str(value.dtype).rpartition(".")[2]]
        return {"datatype": datatype, "shape": [-1, *value.shape[1:]] if value.dim() else []}
    if _is_strings(value):
        import numpy

        shape = numpy.shape(value)
        return {"datatype": "BYTES", "shape": [-1, *shape[1:]] if shape else []}
    return {"datatype": "FP32", "shape": [-1]}


def _tensor(torch: Any, array: Any, datatype: str, device: str = "cpu") -> Any:
    """A tensor over array's memory (bits of BF16 arrive as uint16), or its copy on
    device; a BYTES array as it is (no tensor holds bytes)."""
    if datatype == "BYTES":
        return array
    tensor = torch.from_numpy(array)
    if device != "cpu":
        tensor = tensor.to(device)
    return tensor.view(torch.bfloat16) if datatype == "BF16" else tensor


def named_outputs(torch: Any, result: Any, state: set[int]) -> list[tuple[str, str, Any]]:
    """(name, datatype, array) of each output: ``output0``, ``output1``, ... for a tensor,
    tuple or list, the keys for a dict; nested tuples, lists and dicts are flattened,
    their names joined with dots (``output1.0``, ``scores.top``).  A list of str and
    bytes only (not empty) is one output, BYTES of shape [len], not a list of outputs.
    An output over one of the storages in state (the model's own) is a copy."""
    if torch is not None and isinstance(result, torch.Tensor):  # (the most common: at once)
        return [("output0", *output_array(torch, "output0", result, state))]
    if isinstance(result, dict):
        items = [(str(key), value) for key, value in result.items()]
    elif isinstance(result, (tuple, list)) and not _is_string_list(result):
        items = [(f"output{i}", value) for i, value in enumerate(result)]
    else:
        items = [("output0", result)]
    flat: list[tuple[str, str, Any]] = []
    while items:
        name, value = items.pop(0)
        if isinstance(value, dict):
            items[:0] = [(f"{name}.{key}", each) for key, each in value.items()]
        elif isinstance(value, (tuple, list)) and not _is_string_list(value):
            items[:0] = [(f"{name}.{i}", each) for i, each in enumerate(value)]
        else:
            flat.append((name, *output_array(torch, name, value, state)))
    return flat


def flat(outputs: list[tuple[str, str, Any]]) -> tuple:
    """(names, datatypes, *arrays) of outputs, each (name, datatype, array), as
    ``Served.infer`` returns them: flat, so that the call takes multipy's fast path."""
    names, datatypes, arrays = zip(*outputs) if outputs else ((), (), ())
    return (names, datatypes, *arrays)


def _is_string_list(value: Any) -> bool:
    """Whether value is a list (not empty) of str and bytes only: one BYTES output."""
    return isinstance(value, list) and bool(value) and all(
        isinstance(item, (str, bytes)) for item in value)


def _is_strings(value: Any) -> bool:
    """Whether value is BYTES as ``output_array`` takes it: a str or bytes, a list of
    them, or a numpy array of them."""
    if isinstance(value, (str, bytes)) or _is_string_list(value):
        return True
    numpy = sys.modules.get("numpy")
    if numpy is None or not isinstance(value, numpy.ndarray):
        return False
    if value.dtype.kind in "SU":
        return True
    return value.dtype.kind == "O" and all(
        isinstance(item, (str, bytes)) for item in value.reshape(-1))


#: torch's dtypes -> the protocol's datatypes (``_DATATYPES``), once torch is imported
_TENSOR_DATATYPES: dict[Any, str] = {}


def _tensor_datatypes(torch: Any) -> dict[Any, str]:
    """Fills in and returns _TENSOR_DATATYPES (every dtype of _DATATYPES that this torch
    has)."""
    _TENSOR_DATATYPES.update({getattr(torch, name): datatype for name, datatype in
                              _DATATYPES.items() if isinstance(getattr(torch, name, None),
                                                               torch.dtype)})
    return _TENSOR_DATATYPES


def output_array(torch: Any, name: str, value: Any, state: set[int]) -> tuple[str, Any]:
    """(datatype, numpy array over the same memory) for an output value (named name, for
    errors; torch: the module, or None where the model has no tensors); a copy of a
    tensor over one of the storages in state; for str and bytes (see the module's
    docstring), a new array of dtype object holding bytes.  TypeError for a value the
    protocol has no datatype for.  Every kind of served model's outputs go through it."""
    if torch is not None and isinstance(value, torch.Tensor):
        tensor = value.detach() if value.requires_grad else value
        if tensor.untyped_storage().data_ptr() in state:
            tensor = tensor.clone()
        if not tensor.is_cpu:
            tensor = tensor.cpu()
        if tensor.is_conj() or tensor.is_neg():
            tensor = tensor.resolve_conj().resolve_neg()
        datatype = (_TENSOR_DATATYPES or _tensor_datatypes(torch)).get(tensor.dtype)
        if datatype is None:
            raise TypeError(f"output {name!r} is a tensor of {tensor.dtype}, which the Open "
                            f"Inference Protocol has no datatype for")
        if datatype == "BF16":  # no numpy dtype: its bits, as uint16
            return datatype, tensor.view(torch.uint16).numpy()
        return datatype, tensor.numpy()
    import numpy

    if isinstance(value, (str, bytes)) or _is_string_list(value):
        value = numpy.array(value, dtype=object)
    array = numpy.asarray(value)
    if array.dtype.kind in "OSU":
        return "BYTES", _bytes_array(numpy, name, array)
    if array.dtype.name not in _NUMPY_DATATYPES:
        raise TypeError(f"output {name!r} is a {type(value).__name__} ({array.dtype}), which "
                        f"the Open Inference Protocol has no datatype for: return tensors")
    return _NUMPY_DATATYPES[array.dtype.name], numpy.array(array)  # owned and writable: lent


def _bytes_array(numpy: Any, name: str, array: Any) -> Any:
    """An array of dtype object holding bytes, of array's shape, for an array of str or
    bytes (of dtype object, S or U); str UTF-8 encoded.  TypeError for an array of
    objects that holds anything else."""
    elements = []
    for element in array.reshape(-1).tolist():
        if isinstance(element, str):
            element = element.encode()
        elif not isinstance(element, bytes):
            raise TypeError(f"output {name!r} is an array of objects that holds a "
                            f"{type(element).__name__}: the Open Inference Protocol's BYTES "
                            f"holds str or bytes only")
        elements.append(bytes(element))  # (numpy.bytes_: plain bytes)
    result = numpy.empty(len(elements), dtype=object)
    result[:] = elements
    return result.reshape(array.shape)


def raise_plainly(error: Exception) -> None:
    """Raises error as it is if the host can re-create its type without importing
    anything (a builtin exception), else as a RuntimeError that names it."""
    if type(error).__module__ == "builtins":
        raise error
    kind = type(error)
    raise RuntimeError(f"{kind.__module__}.{kind.__qualname__}: {error}") from error
