"""Errors a new user meets, one step further: each says what went wrong and what to do.

Missing package resources list what the archive has; WrongInterpreterError says how to
copy or move the object; load_package names the kind of file it was given (TorchScript,
torch.save, pickle, anything else); remote tracebacks show only the user's frames, with
their source lines, under a heading that is not an empty error line.
"""
from __future__ import annotations

import pickle
import re
import sys
import traceback
import zipfile

import pytest

import multipy
from multipy._protocol import DEREF
from multipy.replicated import ReplicatedObj

_MODEL_MODULE = "multipy_test_errors_model"  # unique: the host imports it to package it
_MODEL_SOURCE = '''\
import torch


class Model(torch.nn.Module):
    def forward(self, x):
        return self.check(x)

    def check(self, x):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"expected a tensor, got {type(x).__name__}")
        return x * 2
'''

_WORK_SOURCE = '''\
def inner(x):
    return 1 / x


def outer(x):
    y = x - x
    return inner(y)


def wrapped():
    try:
        {}["key"]
    except KeyError as error:
        raise RuntimeError("wrapped it") from error
'''


@pytest.fixture(scope="session")
def torch_files(tmp_path_factory):
    """A torch.package archive with a packaged model and 20 text resources, and the
    same model saved in the ways that are not torch.package archives."""
    torch = pytest.importorskip("torch")
    directory = tmp_path_factory.mktemp("error_files")
    (directory / f"{_MODEL_MODULE}.py").write_text(_MODEL_SOURCE)
    sys.path.insert(0, str(directory))
    try:
        module = __import__(_MODEL_MODULE)
        model = module.Model()
        paths = {name: directory / f"{name}.pt" for name in
                 ("package", "script", "trace", "state_dict", "module", "legacy")}
        with torch.package.PackageExporter(paths["package"]) as exporter:
            exporter.extern(["torch.**"])
            exporter.intern(_MODEL_MODULE)
            exporter.save_pickle("model", "model.pkl", model)
            exporter.save_text("model", "notes.txt", "notes")
            for i in range(20):
                exporter.save_text("many", f"r{i:02d}.txt", str(i))
        linear = torch.nn.Linear(2, 2)
        torch.jit.script(linear).save(str(paths["script"]))
        torch.jit.trace(linear, torch.randn(1, 2)).save(str(paths["trace"]))
        torch.save(linear.state_dict(), paths["state_dict"])
        torch.save(linear, paths["module"])
        torch.save(linear.state_dict(), paths["legacy"], _use_new_zipfile_serialization=False)
    finally:
        sys.path.remove(str(directory))
        sys.modules.pop(_MODEL_MODULE, None)
    paths["pickle"] = directory / "plain.pkl"
    paths["pickle"].write_bytes(pickle.dumps({"weights": [1, 2, 3]}))
    paths["text"] = directory / "notes.txt"
    paths["text"].write_text("not a model\n")
    paths["zip"] = directory / "other.zip"
    with zipfile.ZipFile(paths["zip"], "w") as archive:
        archive.writestr("other/readme.txt", "hello")
    return paths


@pytest.fixture(scope="session")
def package(manager, torch_files):
    return manager.load_package(torch_files["package"])


@pytest.fixture(scope="session")
def work(manager):
    manager.register_module_source("errors_work", _WORK_SOURCE)
    return "errors_work"


# -- 1. missing resources --

@pytest.mark.parametrize("load", ["load_pickle", "load_text", "load_binary"])
def test_missing_resource_lists_the_package_resources(package, load):
    with pytest.raises(FileNotFoundError) as info:
        getattr(package, load)("model", "modle.pkl")
    message = str(info.value)
    assert "'modle.pkl'" in message and "'model'" in message
    assert "'model.pkl'" in message and "'notes.txt'" in message


def test_missing_resource_of_many_lists_the_closest(package):
    with pytest.raises(FileNotFoundError) as info:
        package.load_text("many", "r07.tx")
    message = str(info.value)
    assert "20 resources" in message and "'r07.txt'" in message
    assert len(re.findall(r"'r\d\d\.txt'", message)) <= 8, message


def test_missing_package_lists_the_archive_resources(package):
    with pytest.raises(FileNotFoundError) as info:
        package.load_pickle("modl", "model.pkl")
    message = str(info.value)
    assert "'modl'" in message and "('model', 'model.pkl')" in message
    assert ".data" not in message


def test_missing_resource_inside_lists_the_package_resources(package):
    with package.acquire_session() as session:
        load_pickle = session.global_("multipy._inside.package", "load_pickle")
        with pytest.raises(FileNotFoundError) as info:
            load_pickle(session.self, "model", "absent.pkl")
        assert "'absent.pkl'" in str(info.value) and "'model.pkl'" in str(info.value)
        assert load_pickle(session.self, "model", "model.pkl").hasattr("forward")


# -- 2. WrongInterpreterError says what to do --

def test_obj_in_another_interpreter_says_how_to_copy_or_move_it(sessions):
    first, second = sessions
    numbers = first.global_("builtins", "list")([1, 2])
    for use in (lambda: second.global_("builtins", "len")(numbers),
                lambda: second.interpreter.request(DEREF, numbers)):
        with pytest.raises(multipy.WrongInterpreterError) as info:
            use()
        message = str(info.value)
        assert "obj.deref()" in message
        assert "manager.create_movable(obj, session)" in message
        assert "session.from_movable(r)" in message
    # and what it says works
    assert second.global_("builtins", "len")(numbers.deref()).deref() == 2


def test_replicated_object_on_another_managers_interpreter_says_what_to_do(manager):
    replicated = ReplicatedObj(object(), lambda interpreter: None)  # made by another manager
    with pytest.raises(multipy.WrongInterpreterError) as info:
        replicated.instance(manager[0])
    message = str(info.value)
    assert "another manager" in message and "acquire_session()" in message
    assert "create_movable" in message and "load_package" in message


def test_obj_of_another_manager_says_to_copy_it(python):
    result = python("""
        import multipy
        with multipy.InterpreterManager(1) as first, multipy.InterpreterManager(1) as second:
            numbers = first[0].global_("builtins", "list")([1, 2])
            try:
                second[0].global_("builtins", "len")(numbers)
            except multipy.WrongInterpreterError as error:
                print(error)
    """)
    assert result.returncode == 0, result.stderr
    assert "another manager" in result.stdout and "obj.deref()" in result.stdout
    assert "from_movable" not in result.stdout  # it would fail across managers


# -- 3. load_package names what it was given --

@pytest.mark.parametrize("kind, expected", [
    ("script", r"TorchScript archive.*torch\.jit\.load"),
    ("trace", r"TorchScript archive.*torch\.jit\.load"),
    ("state_dict", r"torch\.save wrote: load it with torch\.load"),
    ("module", r"torch\.save wrote: load it with torch\.load"),
    ("legacy", r"torch\.save wrote in its legacy format: load it with torch\.load"),
    ("pickle", r"pickle file: load it with pickle\.load"),
    ("text", r"not a zip file \(it starts with b'not a mo"),
    ("zip", r"zip file without the \.data/version"),
])
def test_load_package_names_the_file_it_was_given(manager, torch_files, kind, expected):
    with open(torch_files[kind], "rb") as file:
        for given in (torch_files[kind], file):  # a path, and a file object
            with pytest.raises(ValueError, match=expected) as info:
                manager.load_package(given)
            message = str(info.value)
            assert "not a torch.package archive" in message
            assert "torch.package.PackageExporter" in message


def test_load_package_names_an_empty_file(manager, tmp_path):
    empty = tmp_path / "empty.pt"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match="is empty"):
        manager.load_package(empty)


# -- 4. remote tracebacks --

def _printed(error: BaseException) -> str:
    """What Python prints for error, uncaught."""
    return "".join(traceback.format_exception(error))


def _remote_part(printed: str) -> str:
    return printed.split("The above exception was the direct cause")[0]


def test_remote_traceback_heading_is_not_an_empty_error(sessions, work):
    with pytest.raises(ZeroDivisionError) as info:
        sessions[0].global_(work, "outer")(3)
    printed = _printed(info.value)
    assert not [line for line in printed.splitlines()
                if re.fullmatch(r"[\w.]+(Error|Exception|Traceback)?:\s*", line)], printed
    assert printed.splitlines()[0].startswith(
        "multipy.errors.RemoteTraceback: the exception below was raised inside an interpreter")


def test_remote_traceback_has_only_the_users_frames_with_their_lines(sessions, work):
    with pytest.raises(ZeroDivisionError) as info:
        sessions[1].global_(work, "outer")(3)
    text = info.value.__cause__.traceback_text
    remote = _remote_part(_printed(info.value))
    for shown in (text, remote):
        assert "multipy/_inside" not in shown and "in handle" not in shown, shown
        assert "in _call" not in shown and "importlib" not in shown, shown
        assert 'File "<multipy:errors_work>", line 7, in outer' in shown, shown
        assert "    return inner(y)" in shown and "    return 1 / x" in shown, shown
        assert shown.rstrip().endswith("ZeroDivisionError: division by zero"), shown


def test_remote_traceback_keeps_chained_exceptions(sessions, work):
    with pytest.raises(RuntimeError, match="wrapped it") as info:
        sessions[0].global_(work, "wrapped")()
    text = info.value.__cause__.traceback_text
    assert "KeyError: 'key'" in text and '{}["key"]' in text
    assert 'raise RuntimeError("wrapped it") from error' in text
    assert "multipy/_inside" not in text


def test_remote_traceback_of_an_import_shows_the_module_not_the_machinery(manager, sessions):
    manager.register_module_source("errors_broken", "x = 1\nraise ImportError('no good')\n")
    with pytest.raises(ImportError, match="no good") as info:
        sessions[0].global_("errors_broken", "x")
    text = info.value.__cause__.traceback_text
    assert text.startswith("Traceback (most recent call last):\n"
                           '  File "<multipy:errors_broken>", line 2, in <module>\n'
                           "    raise ImportError('no good')"), text


def test_remote_traceback_keeps_the_frames_of_a_library_called_directly(sessions):
    version = sessions[0].global_("importlib.metadata", "version")
    with pytest.raises(Exception, match="no_such_distribution_xyz") as info:
        version("no_such_distribution_xyz")
    text = info.value.__cause__.traceback_text
    assert "importlib/metadata/__init__.py" in text and ", in version" in text, text


def test_remote_traceback_without_user_frames_is_just_the_error(sessions):
    with pytest.raises(ValueError) as info:
        sessions[0].global_("builtins", "int")("seven")
    text = info.value.__cause__.traceback_text
    assert text.strip() == "ValueError: invalid literal for int() with base 10: 'seven'"


def test_registered_source_lines_survive_a_cleared_linecache(sessions, work):
    assert sessions[1].global_(work, "inner")(2).deref() == 0.5  # imported before the clear
    sessions[1].global_("linecache", "clearcache")()
    with pytest.raises(ZeroDivisionError) as info:
        sessions[1].global_(work, "outer")(3)
    assert "    return 1 / x" in info.value.__cause__.traceback_text


def test_remote_traceback_of_a_packaged_model_shows_its_lines(package):
    model = package.load_pickle("model", "model.pkl")
    with pytest.raises(TypeError, match="expected a tensor, got str") as info:
        model("not a tensor")
    text = info.value.__cause__.traceback_text
    assert f"{_MODEL_MODULE}.py\", line 6, in forward" in text, text
    assert "    return self.check(x)" in text
    assert 'raise TypeError(f"expected a tensor, got {type(x).__name__}")' in text
    assert "multipy/_inside" not in text


def test_remote_traceback_that_cannot_be_described_says_so():
    heading = str(multipy.RemoteTraceback(""))
    assert heading.startswith("the exception below was raised inside an interpreter")
    assert "could not be described" in heading
    assert str(multipy.RemoteTraceback("ValueError: x\n")).endswith("\n\nValueError: x")
