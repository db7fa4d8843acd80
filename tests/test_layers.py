"""The shape of the code: layers import only downward, and the code inside interpreters
imports none of the host's modules (docs/design.md, "Layers")."""
from __future__ import annotations

import ast
import inspect
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "multipy"

#: Bottom-up: each module may import only modules before it.
LAYERS = ["errors", "_launch", "_parallel", "_free_cores", "_host", "_keys", "_bootstrap", "_root", "_glibc", "_cuda", "_protocol", "_sharing",
          "_runtime", "_pool", "session", "_aio", "environment", "replicated", "package", "manager", "_cpp", "shell", "serve",
          "cli",
          "__main__", "__init__"]
#: multipy.serve, bottom-up, as its sub-packages show: each module (a package: its
#: ``__init__``) may import only those before it, and of the rest of multipy only the
#: layers below "serve".  The request path that host and interpreters share, HTTP and
#: gRPC, then the host's models and start-up, the supervisor of --processes, Ray, the
#: command.
SERVE_LAYERS = ["request", "request.messages", "request.tensors", "request.protocol", "request.batching",
                "request.board", "request.metrics", "request.poison", "request.requests", "request.litserve",
                "request.contract",
                "request.restricted", "request.repository", "request.inference",
                "request.generate",
                "http", "http.connection", "http.uvicorn_server", "http.exchange",
                "http.uvicorn_protocol", "http.inbox", "http.litserve", "http.generate",
                "http.app",
                "rpc", "rpc.inference_pb2", "rpc.server",
                "host", "host.archive", "host.model_class", "host.model_config_pb2",
                "host.triton_model", "host.models", "host.control",
                "host.progress", "host.service", "host.front_ends",
                "processes", "processes.link", "processes.tasks", "processes.policy",
                "processes.handover", "processes.replication", "processes.rolling",
                "processes.supervised", "processes.supervisor",
                "on_ray", "command", "main", "__main__", "__init__"]
#: What the code inside interpreters may import of multipy: of multipy.serve, the
#: request path that the host and each interpreter's front end share.
INSIDE_MAY_IMPORT = {"_protocol", "_sharing", "_inside"}
SHARED_SERVE = SERVE_LAYERS[:SERVE_LAYERS.index("host")]


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, first component of the multipy module) of each import that runs (not the
    ones under ``if TYPE_CHECKING:``), relative or absolute."""
    return [(line, parts[0] if parts else "") for line, parts in _import_paths(path)]


def _import_paths(path: Path) -> list[tuple[int, list[str]]]:
    """(line, the multipy module's path within multipy, as a list) of each import that
    runs, as _imports reads them."""
    tree = ast.parse(path.read_text())
    skipped = {id(node) for block in ast.walk(tree)
               if isinstance(block, ast.If) and ast.unparse(block.test) == "TYPE_CHECKING"
               for child in block.body for node in ast.walk(child)}
    found = []
    depth = len(path.relative_to(PACKAGE).parts) - 1  # 1 inside _inside/
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.ImportFrom):
            if node.level:
                parts = (node.module or "").split(".") if node.module else []
                if node.level - 1 > depth:
                    continue
                # the package the import is relative to: "_inside", "serve" or multipy
                base = list(path.relative_to(PACKAGE).parts[:-1])[:depth - (node.level - 1)]
                if not parts:
                    names = [base + [a.name] for a in node.names]
                elif not PACKAGE.joinpath(*base, *parts).is_dir():
                    names = [base + parts]
                else:  # names in a package: its modules (or its own names)
                    names = [base + parts + [a.name] if PACKAGE.joinpath(
                        *base, *parts, f"{a.name}.py").exists() else base + parts
                        for a in node.names]
                for name in names:
                    found.append((node.lineno, name))
            elif node.module and node.module.split(".")[0] == "multipy":
                rest = node.module.split(".")[1:]
                if PACKAGE.joinpath(*rest).is_dir():  # names in a package: its modules
                    names = [rest + [a.name] for a in node.names]
                else:
                    names = [rest]
                for name in names:
                    found.append((node.lineno, name))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "multipy" and len(parts) > 1:
                    found.append((node.lineno, parts[1:]))
    return found


def test_layers_import_only_downward():
    upward = []
    for name in LAYERS:
        path = PACKAGE / f"{name}.py"
        if not path.exists():
            continue
        for line, target in _imports(path):
            if target not in LAYERS[:LAYERS.index(name)]:
                upward.append(f"{name}.py:{line} imports {target}")
    assert not upward, upward
    listed = {p.stem for p in PACKAGE.glob("*.py")}
    assert listed <= set(LAYERS), f"modules without a layer: {listed - set(LAYERS)}"


def _serve_path(name: str) -> Path:
    """The file of SERVE_LAYERS' name (a package's: its __init__.py)."""
    path = PACKAGE / "serve" / Path(*name.split("."))
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


def _serve_name(path: Path) -> str:
    """SERVE_LAYERS' name of a file of multipy/serve."""
    parts = path.relative_to(PACKAGE / "serve").with_suffix("").parts
    return ".".join(parts[:-1]) if parts[-1] == "__init__" and len(parts) > 1 \
        else ".".join(parts)


def test_serve_imports_only_downward():
    below = LAYERS[:LAYERS.index("serve")]
    wrong = []
    for name in SERVE_LAYERS:
        path = _serve_path(name)
        assert path.exists(), path
        for line, target in _import_paths(path):
            if target[:1] == ["serve"]:
                fine = ".".join(target[1:]) in SERVE_LAYERS[:SERVE_LAYERS.index(name)]
            else:
                fine = target[:1] and target[0] in below
            if not fine:
                wrong.append(f"serve/{name}:{line} imports {'.'.join(target)}")
    assert not wrong, wrong
    listed = {_serve_name(p) for p in (PACKAGE / "serve").rglob("*.py")}
    assert listed == set(SERVE_LAYERS), f"modules without a layer: {listed ^ set(SERVE_LAYERS)}"


def test_inside_code_imports_no_host_module():
    wrong = [f"{path.name}:{line} imports {'.'.join(target)}"
             for path in (PACKAGE / "_inside").glob("*.py")
             for line, target in _import_paths(path)
             if target[0] not in INSIDE_MAY_IMPORT
             and not (target[0] == "serve" and ".".join(target[1:]) in SHARED_SERVE)]
    assert not wrong, wrong
    for name in SHARED_SERVE:  # and what they import, the same
        for line, target in _import_paths(_serve_path(name)):
            assert target[:1] == ["serve"] and ".".join(target[1:]) in SHARED_SERVE, \
                (name, line, target)
    for path in PACKAGE.glob("*.py"):
        assert all(target != "_inside" for _, target in _imports(path)), path.name


def test_an_interpreter_holds_none_of_the_host_api(manager):
    with manager.acquire_one() as s:
        modules = s.global_("builtins", "list")(s.global_("sys", "modules")).deref()
    names = sorted(n for n in modules if n == "multipy" or n.startswith("multipy."))
    assert {"multipy", "multipy._inside", "multipy._protocol", "multipy._sharing"} <= set(names)
    front_end = {"multipy._inside.front_end", "multipy._inside.hangups", "multipy.serve",
                 *(f"multipy.serve.{name}" for name in SHARED_SERVE)}  # in a server only
    assert set(names) <= {"multipy", "multipy._inside", "multipy._inside.package",
                          "multipy._inside.serving", "multipy._inside.served_class",
                          "multipy._inside.pieces",
                          "multipy._inside.classes", "multipy._inside.model_files",
                          "multipy._inside.triton_imports",
                          "multipy._inside.served_kserve",
                          "multipy._inside.served_litserve", "multipy._inside.served_module",
                          "multipy._protocol", "multipy._cuda",  # (the driver, both sides)
                          "multipy._sharing", *front_end}, names


def _members(path: Path, name: str) -> tuple[dict[str, list[str]], set[str]]:
    """Class name of the file at path, read from its source: its methods' parameters
    (after self), and the attributes its methods set on self."""
    tree = ast.parse(path.read_text())
    cls = next(node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == name)
    methods = {item.name: [a.arg for a in item.args.args[1:]] for item in cls.body
               if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef))}
    targets = [target for node in ast.walk(cls) if isinstance(node, (ast.Assign, ast.AnnAssign))
               for target in (node.targets if isinstance(node, ast.Assign) else [node.target])]
    attributes = {t.attr for t in targets if isinstance(t, ast.Attribute)
                  and isinstance(t.value, ast.Name) and t.value.id == "self"}
    return methods, attributes


#: The classes of a model loaded in an interpreter (module in _inside, class), which
#: contract.ServedCalls calls.
SERVED_KINDS = [("serving.py", "Served"), ("served_class.py", "ServedClass"),
                ("served_kserve.py", "ServedKServeModel"), ("served_triton.py", "ServedTriton"),
                ("served_litserve.py", "ServedLitAPI")]


def test_the_seams_of_the_server_hold():
    """Each of the host's calls of a front end (contract.FrontEndCalls) is a method of
    FrontEnd with the same parameters, each of its calls of a served model
    (contract.ServedCalls) a method of every kind of served model, and both servers that the request path answers
    for, the host's Service and an interpreter's FrontEnd, have every member of the
    contract.Server protocol (read from their source: neither is imported here)."""
    from multipy.serve.request import contract

    front, front_attributes = _members(PACKAGE / "_inside" / "front_end.py", "FrontEnd")
    calls = [name for name, value in vars(contract.FrontEndCalls).items()
             if callable(value) and not name.startswith("_")]
    assert calls
    for name in calls:
        parameters = list(inspect.signature(getattr(contract.FrontEndCalls, name)).parameters)
        assert front.get(name) == parameters[1:], name
    wanted = {name for name in vars(contract.Server) if not name.startswith("_")} \
        | set(contract.Server.__annotations__)
    service, service_attributes = _members(PACKAGE / "serve" / "host" / "service.py", "Service")
    served_calls = {name for name, value in vars(contract.ServedCalls).items()
                    if callable(value) and not name.startswith("_")}
    assert served_calls
    found: dict[str, set[str]] = {}  # each kind's methods, with its listed bases'
    for path, kind in SERVED_KINDS:
        methods, attributes = _members(PACKAGE / "_inside" / path, kind)
        tree = ast.parse((PACKAGE / "_inside" / path).read_text())
        bases = next(ast.unparse(b) for node in tree.body if isinstance(node, ast.ClassDef)
                     and node.name == kind for b in [*node.bases, ast.Name("object")])
        found[kind] = set(methods) | found.get(bases, set())
        streaming = "streams" in attributes or "stream" in found.get(bases, set())
        missing = served_calls - found[kind] - (set() if streaming else {"stream"})
        assert not missing, (kind, missing)  # (stream: only of the kinds that can stream)
    pieces, _ = _members(PACKAGE / "_inside" / "pieces.py", "Pieces")
    calls, _ = _members(PACKAGE / "serve" / "host" / "models.py", "PiecesCalls")
    assert not {name for name in calls if not name.startswith("_")} - set(pieces)
    for methods, attributes in ((front, front_attributes), (service, service_attributes)):
        assert not wanted - set(methods) - attributes, wanted - set(methods) - attributes
