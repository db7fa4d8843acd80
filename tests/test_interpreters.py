"""Interpreters are isolated, callable through Obj, and report errors faithfully."""
from __future__ import annotations

import collections
import decimal
import enum
import subprocess
import sys
import threading
import types

import pytest

import multipy


def test_interpreters_are_distinct(sessions):
    ids = [s.global_("builtins", "id")(s.global_("builtins", "None")).deref() for s in sessions]
    assert len(set(ids)) == len(ids)
    here = threading.get_ident()
    for s in sessions:  # a call runs on the thread that makes it
        assert s.global_("threading", "get_ident")().deref() == here


def test_module_globals_are_not_shared(sessions):
    first, second = sessions
    first.global_("builtins", "setattr")(first.global_("json", "decoder"), "marker", 41)
    assert first.global_("json", "decoder.marker").deref() == 41
    assert not second.global_("json", "decoder").hasattr("marker")


def test_call_forms(sessions):
    s = sessions[0]
    assert s.global_("builtins", "pow")(2, 10).deref() == 1024
    assert s.global_("builtins", "sorted")([3, 1, 2], reverse=True).deref() == [3, 2, 1]
    assert s.global_("builtins", "dict")(a=1).deref() == {"a": 1}
    assert s.global_("builtins", "int")("ff", base=16).deref() == 255
    assert s.global_("builtins", "int")("12", **{}).deref() == 12
    assert s.global_("os.path", "join")("a", "b").deref() == "a/b"
    text = s.global_("builtins", "str")("multipy")
    assert text.attr("upper")().deref() == "MULTIPY"
    assert text.hasattr("upper") and not text.hasattr("make_prediction")
    assert s.global_("collections", "OrderedDict.fromkeys")("ab").deref() == {"a": None, "b": None}


class _Flag(enum.IntEnum):
    ON = 1


def _nested(depth: int) -> list:
    value: list = []
    for _ in range(depth):
        value = [value]
    return value


def test_values_cross_with_their_types_whatever_the_path(sessions):
    """Plain values cross by marshal, the rest by pickle: both ways, every value comes
    back equal and of its own type (marshal would make a bytearray bytes, an IntEnum an
    int), however deep, and a list that contains itself too."""
    s = sessions[0]
    echo = s.global_("builtins", "tuple")
    cyclic: list = [1]
    cyclic.append(cyclic)
    values = [None, True, -(2**70), 1.5, float("inf"), 2j, "é\ud800", b"\x80", (), [], {},
              ((1, "a"), [b"b", None]), {"k": [1, {2: (3.0,)}]}, bytearray(b"x"), _Flag.ON,
              collections.OrderedDict(a=1), {1, 2}, frozenset({"a"}), _nested(15),
              _nested(40), decimal.Decimal("1.1")]
    for value in values:
        for back in (echo((value,)).deref()[0], echo.call_value(None, ((value,),))[0]):
            assert back == value and type(back) is type(value), value
    for back in (echo((cyclic,)).deref()[0], echo.call_value(None, ((cyclic,),))[0]):
        assert back[0] == 1 and back[1] is back
    plain = multipy._sharing.plain
    assert plain(_nested(15)) is not None and plain(_nested(40)) is None  # deep: pickle
    assert plain(bytearray(b"x")) is None  # marshal would make it bytes


def test_values_cross_while_the_host_imports_torch_or_numpy(sessions, monkeypatch):
    """Another host thread may be half-way through importing torch or numpy (its module in
    sys.modules, not yet naming its classes): a call still pickles its values."""
    echo = sessions[0].global_("builtins", "tuple")
    for name in ("torch", "numpy"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    assert echo.call_value(None, (([1.5, b"x", _Flag.ON],),)) == ([1.5, b"x", _Flag.ON],)
    assert echo(([2j, _Flag.ON],)).deref() == ([2j, _Flag.ON],)


def test_objects_met_twice_stay_shared(sessions):
    """A list, dict or long text met twice in a value crosses once and comes back
    shared, both ways (marshal would copy it, and a value that nests such sharing would
    grow exponentially: pickle takes it)."""
    s = sessions[0]
    echo = s.global_("builtins", "tuple")
    row, text, empty = [0, 1], "x" * 300, []
    config = {"k": 1}
    for value in ([row, row], {"a": config, "b": config}, [text, text], [empty, empty]):
        for back in (echo((value,)).deref()[0], echo.call_value(None, ((value,),))[0]):
            first, second = back.values() if isinstance(back, dict) else back
            assert back == value and first is second
    huge = [0] * 10
    for _ in range(12):  # 10 ** 13 leaves, each list met ten times
        huge = [huge] * 10
    assert multipy._sharing.plain(huge) is None
    back = echo.call_value(None, ((huge,),))[0]
    assert back[0] is back[9]
    for _ in range(12):
        back = back[9]
    assert back == [0] * 10
    assert multipy._sharing.plain([(), (), "ab", "ab", 0, 0]) is not None  # nothing to share


def test_obj_arguments_stay_inside(sessions):
    s = sessions[0]
    data = s.global_("builtins", "list")(range(5))
    assert s.global_("builtins", "sum")(data).deref() == 10
    assert s.global_("builtins", "isinstance")(data, s.global_("builtins", "list")).deref()
    assert s.is_owner(data) and not sessions[1].is_owner(data)
    assert data.interpreter is s.interpreter


def test_wrong_interpreter(sessions):
    first, second = sessions
    inside_first = first.global_("builtins", "object")()
    with pytest.raises(multipy.WrongInterpreterError) as info:
        second.global_("builtins", "id")(inside_first)
    message = str(info.value)
    assert "Interpreter 0" in message and "Interpreter 1" in message
    assert second.global_("builtins", "abs")(-3).deref() == 3  # nothing broken


def test_builtin_exception_is_recreated_with_remote_traceback(sessions):
    s = sessions[0]
    with pytest.raises(ValueError, match="invalid literal") as info:
        s.global_("builtins", "int")("not a number")
    cause = info.value.__cause__
    assert isinstance(cause, multipy.RemoteTraceback)
    assert "ValueError: invalid literal" in cause.traceback_text
    assert "multipy" not in cause.traceback_text  # no frame of multipy's own
    assert s.global_("builtins", "int")("7").deref() == 7


def test_importable_exception_type_is_recreated(sessions):
    with pytest.raises(__import__("json").JSONDecodeError) as info:
        sessions[0].global_("json", "loads")("{")
    assert "json/decoder.py" in info.value.__cause__.traceback_text


def test_exception_the_host_cannot_recreate(manager, sessions):
    manager.register_module_source("only_inside_errors", (
        "class Custom(Exception):\n"
        "    pass\n"
        "def fail(message):\n"
        "    raise Custom(message)\n"))
    with pytest.raises(multipy.InterpreterError) as info:
        sessions[1].global_("only_inside_errors", "fail")("deep trouble")
    error = info.value
    assert error.type_name == "only_inside_errors.Custom"
    assert error.message == "deep trouble"
    assert "in fail" in error.remote_traceback
    assert isinstance(error.__cause__, multipy.RemoteTraceback)


@pytest.mark.parametrize("kind", ["SystemExit", "KeyboardInterrupt", "GeneratorExit"])
def test_base_exceptions_do_not_act_in_the_host(manager, sessions, kind):
    manager.register_module_source("raiser", "def throw(kind):\n    raise __builtins__[kind]('x') "
                                             "if isinstance(__builtins__, dict) else "
                                             "getattr(__import__('builtins'), kind)('x')\n")
    with pytest.raises(multipy.InterpreterError) as info:
        sessions[0].global_("raiser", "throw")(kind)
    assert info.value.type_name == f"builtins.{kind}"
    assert sessions[0].global_("builtins", "len")("abc").deref() == 3


def test_unpicklable_result(sessions):
    lock = sessions[0].global_("threading", "Lock")()
    with pytest.raises(TypeError, match="pickle"):
        lock.deref()
    assert lock.attr("locked")().deref() is False


def test_unpicklable_argument_fails_in_the_host(sessions):
    with pytest.raises(TypeError, match="pickle") as info:
        sessions[0].global_("builtins", "repr")(threading.Lock())
    assert not isinstance(info.value.__cause__, multipy.RemoteTraceback)


def test_exception_that_cannot_be_described(manager, sessions):
    manager.register_module_source("bad_errors", (
        "class Unprintable(Exception):\n"
        "    def __str__(self):\n"
        "        raise RuntimeError('no')\n"
        "def fail():\n"
        "    raise Unprintable()\n"))
    with pytest.raises(multipy.InterpreterError):
        sessions[0].global_("bad_errors", "fail")()
    assert sessions[0].global_("builtins", "abs")(-1).deref() == 1


def test_released_object_is_reported_clearly(sessions):
    s = sessions[0]
    target = s.global_("builtins", "list")()
    stale = multipy.Obj(s.interpreter, target._handle)  # a second handle to the same object
    del target
    with pytest.raises(LookupError, match="released"):
        s.global_("builtins", "len")(stale)
    stale._interpreter = None  # it owns nothing: keep its finaliser quiet


def test_objects_that_answer_lookups_oddly_can_be_called(manager, sessions):
    # What an interpreter notes for its crash report must not depend on the target's
    # class being hashable or on its __getattr__.
    manager.register_module_source("odd_objects", (
        "class Meta(type):\n"
        "    def __eq__(cls, other):\n"  # makes its classes unhashable
        "        return cls is other\n"
        "class Point(metaclass=Meta):\n"
        "    def __call__(self):\n"
        "        return 5\n"
        "class Loud:\n"
        "    def __getattr__(self, name):\n"
        "        raise RuntimeError(name)\n"
        "    def __call__(self):\n"
        "        return 6\n"))
    s = sessions[0]
    point = s.global_("odd_objects", "Point")()
    assert point.hasattr("__call__") and point().deref() == 5
    assert s.global_("odd_objects", "Loud")()().deref() == 6


def test_missing_module_and_attribute(sessions):
    with pytest.raises(ModuleNotFoundError, match="no_such_module"):
        sessions[0].global_("no_such_module", "x")
    with pytest.raises(AttributeError, match="no_such_name"):
        sessions[0].global_("os", "no_such_name")


def test_objects_are_released_when_the_host_drops_them(manager, sessions):
    manager.register_module_source("tracked", (
        "import weakref\n"
        "live = weakref.WeakSet()\n"
        "class Thing:\n"
        "    pass\n"
        "def make():\n"
        "    thing = Thing()\n"
        "    live.add(thing)\n"
        "    return thing\n"
        "def count():\n"
        "    return len(live)\n"))
    s = sessions[0]
    make, count = s.global_("tracked", "make"), s.global_("tracked", "count")
    things = [make() for _ in range(5)]
    assert count().deref() == 5
    del things
    assert count().deref() == 0


MAIN_SCRIPT = """
import multipy

class MyNet:
    def __init__(self, k):
        self.k = k

    def forward(self, x):
        return x * self.k

print("imported as", __name__)

if __name__ == "__main__":
    with multipy.InterpreterManager(1) as m:
        m.register_module_source("uses_main", "def run(net, x):\\n    return net.forward(x), net\\n")
        with m[0].acquire_session() as s:
            value, back = s.global_("uses_main", "run")(MyNet(3), 5).deref()
            print(value, type(back) is MyNet, back.k)
"""


def test_an_instance_of_a_class_of_the_hosts_main_script_crosses(python):
    # inside, the script is imported as __mp_main__: its main part does not run there
    result = python(MAIN_SCRIPT)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.splitlines() == ["imported as __main__", "imported as __mp_main__",
                                          "15 True 3"]


def test_a_class_of_a_host_without_main_script_gets_advice(python):
    result = python(f"import subprocess, sys\n"
                    f"code = {MAIN_SCRIPT!r}.replace('if __name__ == \"__main__\":', 'if True:')\n"
                    f"sys.exit(subprocess.run([sys.executable, '-c', code]).returncode)\n")
    assert result.returncode == 1
    assert "the host runs no main script" in result.stderr
    assert "register_module_source" in result.stderr


def test_classes_of_the_hosts_main_module_cross_when_it_runs_with_dash_m(python, tmp_path):
    package = tmp_path / "hostpkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "helpers.py").write_text("K = 4\n")
    (package / "app.py").write_text(MAIN_SCRIPT.replace(
        "class MyNet:", "from .helpers import K\n\nclass MyNet:\n    class Inner:\n"
        "        pass\n").replace("MyNet(3)", "MyNet(K)").replace(
        "            print(value", "            print(s.global_('builtins', 'type')(MyNet.Inner())"
        ".attr('__qualname__').deref())\n            print(value"))
    result = subprocess.run([sys.executable, "-m", "hostpkg.app"], cwd=tmp_path,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.splitlines()[-2:] == ["MyNet.Inner", "20 True 4"]


def test_an_interpreter_keeps_the_environment_it_started_with(python):
    # The host's setenv moves its array of environment strings and frees the old one;
    # C code inside that reads the environment (torch's libgomp does as it loads) must
    # not read freed memory.  The interpreter has its own copy, as a child process has.
    result = python('''
        import os, multipy
        os.environ["MULTIPY_FIRST"] = "1"  # the host's array is now on its heap
        inside = (
            "import ctypes, os\\n"
            "libc = ctypes.CDLL('libc.so.6')\\n"  # the interpreter's own libc
            "libc.getenv.restype = ctypes.c_char_p\\n"
            "def get(name):\\n"
            "    return libc.getenv(name.encode()), os.environ.get(name)\\n"
            "def put(name, value):\\n"
            "    os.environ[name] = value\\n")
        with multipy.InterpreterManager(1) as m:
            m.register_module_source("environment", inside)
            for i in range(300):  # the host's array grows, moves, and is freed
                os.environ[f"MULTIPY_LATER_{i}"] = "x"
            get = m[0].global_("environment", "get")
            print(get("MULTIPY_FIRST").deref(), get("MULTIPY_LATER_5").deref())
            m[0].global_("environment", "put")("MULTIPY_INSIDE", "2")
            print(get("MULTIPY_INSIDE").deref(), os.environ.get("MULTIPY_INSIDE"))
    ''')
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.splitlines() == ["(b'1', '1') (None, None)", "(b'2', '2') None"]
