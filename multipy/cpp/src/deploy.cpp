// multipy::runtime on multipy: the one translation unit of the C++ library.
//
// It embeds the CPython that multipy is installed for (the "host"), imports multipy
// there and drives its Python API.  The GIL: the thread that starts the host releases
// it at once (PyEval_SaveThread); each call takes it (PyGILState_Ensure) only for its
// host-side part, and multipy releases it again for the whole time a call runs inside an
// interpreter.  Each C++ thread keeps one Python thread state for its life, so that
// multipy's per-thread state (the load balancer's cursor) lasts across calls.
// Tensors cross through torch's own bindings (THPVariable_Wrap / THPVariable_Unpack):
// the same at::Tensor on both sides, never a copy.
#include <torch/csrc/autograd/python_variable.h>  // Python.h first, as CPython asks

#include <multipy/runtime/deploy.h>

#include <cstdlib>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#ifndef MULTIPY_PYTHON_EXECUTABLE
#define MULTIPY_PYTHON_EXECUTABLE ""
#endif

namespace multipy {
namespace runtime {

namespace {

// What the library uses of the host, imported once (the references are never dropped).
struct Host {
  PyObject* make_manager = nullptr;
  PyObject* describe = nullptr;
  PyObject* from_value = nullptr;
  PyObject* from_numpy = nullptr;
};
Host host;
std::once_flag host_started;

// A reference owned by the code that holds the GIL.
class Own {
 public:
  Own() = default;
  explicit Own(PyObject* stolen) : p_(stolen) {}
  Own(const Own&) = delete;
  Own& operator=(const Own&) = delete;
  Own(Own&& other) noexcept : p_(std::exchange(other.p_, nullptr)) {}
  Own& operator=(Own&& other) noexcept {
    if (this != &other) {
      Py_XDECREF(p_);
      p_ = std::exchange(other.p_, nullptr);
    }
    return *this;
  }
  ~Own() {
    Py_XDECREF(p_);
  }
  PyObject* get() const {
    return p_;
  }
  PyObject* release() {
    return std::exchange(p_, nullptr);
  }
  explicit operator bool() const {
    return p_ != nullptr;
  }

 private:
  PyObject* p_ = nullptr;
};

std::string currentErrorText();

[[noreturn]] void throwPythonError() {
  throw c10::Error(currentErrorText(), nullptr);
}

PyObject* check(PyObject* result) {
  if (result == nullptr) {
    throwPythonError();
  }
  return result;
}

// The Python error set now, as text (exception, remote and host tracebacks); clears it.
std::string currentErrorText() {
  PyObject *type = nullptr, *value = nullptr, *traceback = nullptr;
  PyErr_Fetch(&type, &value, &traceback);
  if (type == nullptr) {
    return "multipy: an error without a Python exception";
  }
  PyErr_NormalizeException(&type, &value, &traceback);
  if (traceback != nullptr && value != nullptr) {
    PyException_SetTraceback(value, traceback);
  }
  Own owned_type(type), owned_value(value), owned_traceback(traceback);
  Own text;
  if (host.describe != nullptr && value != nullptr) {
    text = Own(PyObject_CallOneArg(host.describe, value));
  }
  if (!text && value != nullptr) {
    PyErr_Clear();
    text = Own(PyObject_Str(value));
  }
  const char* utf8 = text ? PyUnicode_AsUTF8(text.get()) : nullptr;
  std::string message = utf8 != nullptr ? utf8 : "multipy: a Python error that has no text";
  PyErr_Clear();
  return message;
}

// At exit, the host's atexit hooks, as Py_Finalize would run them (the library never
// finalises the host): multipy's stops its interpreters (docs/design.md, "exit").
void runPythonExitHooks() {
  if (!Py_IsInitialized()) {
    return;
  }
  PyGILState_STATE state = PyGILState_Ensure();
  Own module(PyImport_ImportModule("multipy._cpp"));
  Own done(module ? PyObject_CallMethod(module.get(), "at_exit", nullptr) : nullptr);
  PyErr_Clear();
  PyGILState_Release(state);
}

void startHostOnce() {
  bool started_here = false;
  PyGILState_STATE state{};
  if (!Py_IsInitialized()) {
    PyConfig config;
    PyConfig_InitPythonConfig(&config);
    config.install_signal_handlers = 0;  // signals stay the C++ program's
    config.parse_argv = 0;
    const char* python = std::getenv("MULTIPY_PYTHON");
    if (python == nullptr || *python == '\0') {
      python = MULTIPY_PYTHON_EXECUTABLE;
    }
    PyStatus status = PyStatus_Ok();
    if (*python != '\0') {
      // As if that python ran: its prefix, its venv (pyvenv.cfg), its site-packages.
      status = PyConfig_SetBytesString(&config, &config.program_name, python);
    }
    if (!PyStatus_Exception(status)) {
      status = Py_InitializeFromConfig(&config);
    }
    PyConfig_Clear(&config);
    if (PyStatus_Exception(status)) {
      throw c10::Error(std::string("multipy: could not start the host CPython (") + python +
                           "): " + (status.err_msg ? status.err_msg : "unknown error"),
                       nullptr);
    }
    started_here = true;
  } else {
    state = PyGILState_Ensure();  // embedded in a program that already runs CPython
  }
  std::string error;
  Own torch(PyImport_ImportModule("torch"));
  Own cpp(torch ? PyImport_ImportModule("multipy._cpp") : nullptr);
  if (cpp) {
    host.make_manager = PyObject_GetAttrString(cpp.get(), "make_manager");
    host.describe = PyObject_GetAttrString(cpp.get(), "describe");
    host.from_value = PyObject_GetAttrString(cpp.get(), "from_value");
    host.from_numpy = PyObject_GetAttrString(torch.get(), "from_numpy");
  }
  if (!host.make_manager || !host.describe || !host.from_value || !host.from_numpy) {
    error = currentErrorText();
    PyObject* sys_path = PySys_GetObject("path");  // borrowed
    Own shown(sys_path ? PyObject_Repr(sys_path) : nullptr);
    const char* path = shown ? PyUnicode_AsUTF8(shown.get()) : nullptr;
    error = "multipy: the host CPython could not import torch and multipy (set "
            "MULTIPY_PYTHON to the python they are installed for; sys.path is " +
            std::string(path ? path : "?") + "):\n" + error;
    PyErr_Clear();
  }
  if (started_here) {
    std::atexit(runPythonExitHooks);
    PyEval_SaveThread();  // the GIL is taken per call from now on
  } else {
    PyGILState_Release(state);
  }
  if (!error.empty()) {
    throw c10::Error(error, nullptr);
  }
}

// One Python thread state per C++ thread that calls in, kept until the thread exits.
struct ThreadState {
  bool held = false;
  PyGILState_STATE outer{};
  PyThreadState* saved = nullptr;
  ~ThreadState() {
    if (held && Py_IsInitialized()) {
      PyEval_RestoreThread(saved);
      PyGILState_Release(outer);
    }
  }
};
thread_local ThreadState thread_state;

// The host's GIL, for the host-side part of a call.
class Gil {
 public:
  Gil() {
    std::call_once(host_started, startHostOnce);
    if (!thread_state.held && PyGILState_GetThisThreadState() == nullptr) {
      thread_state.outer = PyGILState_Ensure();
      thread_state.saved = PyEval_SaveThread();
      thread_state.held = true;
    }
    state_ = PyGILState_Ensure();
  }
  Gil(const Gil&) = delete;
  Gil& operator=(const Gil&) = delete;
  ~Gil() {
    PyGILState_Release(state_);
  }

 private:
  PyGILState_STATE state_;
};

detail::PyPtr share(PyObject* stolen) {
  return detail::PyPtr(stolen, [](PyObject* object) {
    if (object != nullptr && Py_IsInitialized()) {
      PyGILState_STATE state = PyGILState_Ensure();
      Py_DECREF(object);
      PyGILState_Release(state);
    }
  });
}

// -- values: IValue <-> Python (under the GIL) --

PyObject* toPython(const at::IValue& value);

PyObject* stringToPython(const std::string& text) {
  return check(PyUnicode_FromStringAndSize(text.data(), static_cast<Py_ssize_t>(text.size())));
}

PyObject* toPython(const at::IValue& value) {
  if (value.isTensor()) {
    return check(THPVariable_Wrap(value.toTensor()));  // the same tensor, not a copy
  }
  if (value.isNone()) {
    Py_RETURN_NONE;
  }
  if (value.isBool()) {
    return check(PyBool_FromLong(value.toBool()));
  }
  if (value.isInt()) {
    return check(PyLong_FromLongLong(value.toInt()));
  }
  if (value.isDouble()) {
    return check(PyFloat_FromDouble(value.toDouble()));
  }
  if (value.isString()) {
    return stringToPython(value.toStringRef());
  }
  if (value.isTuple()) {
    const auto& elements = value.toTupleRef().elements();
    Own tuple(check(PyTuple_New(static_cast<Py_ssize_t>(elements.size()))));
    for (size_t i = 0; i < elements.size(); i++) {
      PyTuple_SET_ITEM(tuple.get(), static_cast<Py_ssize_t>(i), toPython(elements[i]));
    }
    return tuple.release();
  }
  if (value.isList()) {
    auto list = value.toList();
    Own result(check(PyList_New(static_cast<Py_ssize_t>(list.size()))));
    for (size_t i = 0; i < list.size(); i++) {
      PyList_SET_ITEM(result.get(), static_cast<Py_ssize_t>(i), toPython(list.get(i)));
    }
    return result.release();
  }
  if (value.isGenericDict()) {
    Own dict(check(PyDict_New()));
    for (const auto& item : value.toGenericDict()) {
      Own key(toPython(item.key()));
      Own element(toPython(item.value()));
      if (PyDict_SetItem(dict.get(), key.get(), element.get()) < 0) {
        throwPythonError();
      }
    }
    return dict.release();
  }
  throw c10::Error("multipy: an IValue of kind " + std::string(value.tagKind()) +
                       " cannot be passed to Python (tensors, None, bool, int, float, "
                       "str, and tuples, lists and dicts of them can)",
                   nullptr);
}

// A tuple of args, each converted.
Own tupleOf(at::ArrayRef<at::IValue> args) {
  Own tuple(check(PyTuple_New(static_cast<Py_ssize_t>(args.size()))));
  for (size_t i = 0; i < args.size(); i++) {
    PyTuple_SET_ITEM(tuple.get(), static_cast<Py_ssize_t>(i), toPython(args[i]));
  }
  return tuple;
}

Own dictOf(const std::unordered_map<std::string, c10::IValue>& kwargs) {
  Own dict(check(PyDict_New()));
  for (const auto& [name, value] : kwargs) {
    Own element(toPython(value));
    if (PyDict_SetItemString(dict.get(), name.c_str(), element.get()) < 0) {
      throwPythonError();
    }
  }
  return dict;
}

std::string typeName(PyObject* object) {
  return Py_TYPE(object)->tp_name;
}

at::IValue fromPython(PyObject* object) {
  if (object == Py_None) {
    return at::IValue();
  }
  bool is_tensor = false;
  try {
    is_tensor = THPVariable_Check(object);
  } catch (const std::exception&) {
    throwPythonError();
  }
  if (is_tensor) {
    return THPVariable_Unpack(object);  // the same tensor, not a copy
  }
  if (PyBool_Check(object)) {
    return at::IValue(object == Py_True);
  }
  if (PyLong_Check(object)) {
    long long number = PyLong_AsLongLong(object);
    if (number == -1 && PyErr_Occurred()) {
      throwPythonError();
    }
    return at::IValue(static_cast<int64_t>(number));
  }
  if (PyFloat_Check(object)) {
    return at::IValue(PyFloat_AS_DOUBLE(object));
  }
  if (PyUnicode_Check(object)) {
    Py_ssize_t size = 0;
    const char* text = PyUnicode_AsUTF8AndSize(object, &size);
    if (text == nullptr) {
      throwPythonError();
    }
    return at::IValue(std::string(text, static_cast<size_t>(size)));
  }
  if (PyBytes_Check(object)) {
    return at::IValue(std::string(PyBytes_AS_STRING(object),
                                  static_cast<size_t>(PyBytes_GET_SIZE(object))));
  }
  if (PyTuple_Check(object)) {
    std::vector<at::IValue> elements;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(object); i++) {
      elements.push_back(fromPython(PyTuple_GET_ITEM(object, i)));
    }
    return c10::ivalue::Tuple::create(std::move(elements));
  }
  if (PyList_Check(object)) {
    std::vector<at::IValue> elements;
    bool tensors = true, ints = true, doubles = true;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(object); i++) {
      elements.push_back(fromPython(PyList_GET_ITEM(object, i)));
      tensors = tensors && elements.back().isTensor();
      ints = ints && elements.back().isInt();
      doubles = doubles && elements.back().isDouble();
    }
    if (!elements.empty() && tensors) {
      c10::List<at::Tensor> list;
      for (auto& element : elements) {
        list.push_back(element.toTensor());
      }
      return list;
    }
    if (!elements.empty() && ints) {
      c10::List<int64_t> list;
      for (auto& element : elements) {
        list.push_back(element.toInt());
      }
      return list;
    }
    if (!elements.empty() && doubles) {
      c10::List<double> list;
      for (auto& element : elements) {
        list.push_back(element.toDouble());
      }
      return list;
    }
    c10::impl::GenericList list(c10::AnyType::get());
    for (auto& element : elements) {
      list.push_back(std::move(element));
    }
    return list;
  }
  if (PyDict_Check(object)) {
    std::vector<std::pair<at::IValue, at::IValue>> items;
    bool strings = true, ints = true, tensors = true;
    PyObject *key = nullptr, *element = nullptr;
    Py_ssize_t position = 0;
    while (PyDict_Next(object, &position, &key, &element)) {
      items.emplace_back(fromPython(key), fromPython(element));
      strings = strings && items.back().first.isString();
      ints = ints && items.back().first.isInt();
      tensors = tensors && items.back().second.isTensor();
    }
    if (!items.empty() && !strings && !ints) {
      throw c10::Error("multipy: a dict whose keys are not all str or all int cannot "
                       "become an IValue",
                       nullptr);
    }
    c10::TypePtr key_type = ints && !items.empty() ? c10::TypePtr(c10::IntType::get())
                                                   : c10::TypePtr(c10::StringType::get());
    c10::TypePtr value_type = tensors && !items.empty() ? c10::TypePtr(c10::TensorType::get())
                                                        : c10::TypePtr(c10::AnyType::get());
    c10::impl::GenericDict dict(key_type, value_type);
    for (auto& [k, v] : items) {
      dict.insert(std::move(k), std::move(v));
    }
    return dict;
  }
  if (std::string(Py_TYPE(object)->tp_name) == "numpy.ndarray") {
    Own tensor(check(PyObject_CallOneArg(host.from_numpy, object)));  // shares its memory
    return fromPython(tensor.get());
  }
  throw c10::Error("multipy: a Python " + typeName(object) +
                       " cannot become an IValue (tensors, arrays, None, bool, int, float, "
                       "str, bytes, and tuples, lists and dicts of them can)",
                   nullptr);
}

// object.method(*args), a new reference; throws on a Python error.
Own callMethod(PyObject* object, const char* method, Own args = Own(), Own kwargs = Own()) {
  Own function(check(PyObject_GetAttrString(object, method)));
  if (!args) {
    args = Own(check(PyTuple_New(0)));
  }
  return Own(check(PyObject_Call(function.get(), args.get(), kwargs.get())));
}

Own tupleOfObjects(std::initializer_list<PyObject*> objects) {
  Own tuple(check(PyTuple_New(static_cast<Py_ssize_t>(objects.size()))));
  Py_ssize_t i = 0;
  for (PyObject* object : objects) {
    Py_INCREF(object);
    PyTuple_SET_ITEM(tuple.get(), i++, object);
  }
  return tuple;
}

Own text(const char* value) {
  return Own(check(PyUnicode_FromString(value)));
}

Own text(const std::string& value) {
  return Own(stringToPython(value));
}

bool truth(PyObject* object) {
  int result = PyObject_IsTrue(object);
  if (result < 0) {
    throwPythonError();
  }
  return result != 0;
}

void requireObject(const detail::PyPtr& object, const char* what) {
  if (!object) {
    throw c10::Error(std::string("multipy: use of an empty ") + what, nullptr);
  }
}

}  // namespace

namespace detail {
// Builds the API's objects from host objects, and reads theirs.
struct Access {
  static Obj obj(Own object) {
    return Obj(share(object.release()));
  }
  static PyObject* of(const Obj& object) {
    requireObject(object.obj_, "multipy::runtime::Obj");
    return object.obj_.get();
  }
  static InterpreterSession session(Own session) {
    return InterpreterSession(share(session.release()));
  }
  static PyObject* of(const InterpreterSession& session) {
    requireObject(session.session_, "(moved-from) multipy::runtime::InterpreterSession");
    return session.session_.get();
  }
  static ReplicatedObj replicated(Own object) {
    return ReplicatedObj(share(object.release()));
  }
  static PyObject* of(const ReplicatedObj& object) {
    requireObject(object.obj_, "multipy::runtime::ReplicatedObj");
    return object.obj_.get();
  }
  static Package package(Own package) {
    return Package(share(package.release()));
  }
  static Interpreter interpreter(Own interpreter, size_t index) {
    return Interpreter(share(interpreter.release()), index);
  }
  static PyObject* of(const Interpreter& interpreter) {
    return interpreter.interpreter_.get();
  }
};
}  // namespace detail

using detail::Access;

// -- Obj --

at::IValue Obj::toIValue() const {
  Gil gil;
  Own value = callMethod(Access::of(*this), "deref");
  return fromPython(value.get());
}

Obj Obj::operator()(at::ArrayRef<Obj> args) const {
  Gil gil;
  Own tuple(check(PyTuple_New(static_cast<Py_ssize_t>(args.size()))));
  for (size_t i = 0; i < args.size(); i++) {
    PyObject* arg = Access::of(args[i]);
    Py_INCREF(arg);
    PyTuple_SET_ITEM(tuple.get(), static_cast<Py_ssize_t>(i), arg);
  }
  return Access::obj(Own(check(PyObject_Call(Access::of(*this), tuple.get(), nullptr))));
}

Obj Obj::operator()(at::ArrayRef<at::IValue> args) const {
  Gil gil;
  Own tuple = tupleOf(args);
  return Access::obj(Own(check(PyObject_Call(Access::of(*this), tuple.get(), nullptr))));
}

Obj Obj::callKwargs(std::vector<at::IValue> args,
                    std::unordered_map<std::string, c10::IValue> kwargs) const {
  Gil gil;
  Own tuple = tupleOf(args);
  Own dict = dictOf(kwargs);
  return Access::obj(Own(check(PyObject_Call(Access::of(*this), tuple.get(), dict.get()))));
}

Obj Obj::callKwargs(std::unordered_map<std::string, c10::IValue> kwargs) const {
  return callKwargs({}, std::move(kwargs));
}

bool Obj::hasattr(const char* attr) const {
  Gil gil;
  Own result = callMethod(Access::of(*this), "hasattr", tupleOfObjects({text(attr).get()}));
  return truth(result.get());
}

Obj Obj::attr(const char* attr) const {
  Gil gil;
  return Access::obj(callMethod(Access::of(*this), "attr", tupleOfObjects({text(attr).get()})));
}

// -- InterpreterSession --

InterpreterSession::InterpreterSession(detail::PyPtr session) : session_(std::move(session)) {
  Gil gil;
  Own current(check(PyObject_GetAttrString(session_.get(), "self")));
  if (current.get() != Py_None) {
    self = Access::obj(std::move(current));
  }
}

InterpreterSession& InterpreterSession::operator=(InterpreterSession&& other) noexcept {
  if (this != &other) {
    InterpreterSession closing(std::move(*this));
    session_ = std::move(other.session_);
    self = std::move(other.self);
  }
  return *this;
}

InterpreterSession::~InterpreterSession() {
  if (!session_) {
    return;
  }
  try {
    Gil gil;
    PyObject* result = PyObject_CallMethod(session_.get(), "close", nullptr);
    if (result == nullptr) {
      PyErr_Clear();
    }
    Py_XDECREF(result);
  } catch (...) {  // a destructor does not throw
  }
}

Obj InterpreterSession::global(const char* module, const char* name) {
  Gil gil;
  return Access::obj(
      callMethod(Access::of(*this), "global_", tupleOfObjects({text(module).get(), text(name).get()})));
}

Obj InterpreterSession::fromIValue(at::IValue value) {
  Gil gil;
  Own converted(toPython(value));
  return Access::obj(Own(check(PyObject_CallFunctionObjArgs(
      host.from_value, Access::of(*this), converted.get(), nullptr))));
}

Obj InterpreterSession::fromMovable(const ReplicatedObj& obj) {
  Gil gil;
  return Access::obj(callMethod(Access::of(*this), "from_movable", tupleOfObjects({Access::of(obj)})));
}

ReplicatedObj InterpreterSession::createMovable(Obj obj) {
  Gil gil;
  Own interpreter(check(PyObject_GetAttrString(Access::of(*this), "interpreter")));
  Own manager(check(PyObject_GetAttrString(interpreter.get(), "manager")));
  return Access::replicated(callMethod(manager.get(), "create_movable",
                                       tupleOfObjects({Access::of(obj), Access::of(*this)})));
}

// -- Interpreter --

InterpreterSession Interpreter::acquireSession() const {
  Gil gil;
  return Access::session(callMethod(Access::of(*this), "acquire_session"));
}

// -- ReplicatedObj --

at::IValue ReplicatedObj::operator()(at::ArrayRef<at::IValue> args) const {
  Gil gil;
  Own tuple = tupleOf(args);
  Own result(check(PyObject_Call(Access::of(*this), tuple.get(), nullptr)));
  return fromPython(result.get());
}

at::IValue ReplicatedObj::callKwargs(std::vector<at::IValue> args,
                                     std::unordered_map<std::string, c10::IValue> kwargs) const {
  Gil gil;
  Own tuple = tupleOf(args);
  Own dict = dictOf(kwargs);
  Own result(check(PyObject_Call(Access::of(*this), tuple.get(), dict.get())));
  return fromPython(result.get());
}

at::IValue ReplicatedObj::callKwargs(std::unordered_map<std::string, c10::IValue> kwargs) const {
  return callKwargs({}, std::move(kwargs));
}

bool ReplicatedObj::hasattr(const char* attr) const {
  Gil gil;
  Own result = callMethod(Access::of(*this), "hasattr", tupleOfObjects({text(attr).get()}));
  return truth(result.get());
}

InterpreterSession ReplicatedObj::acquireSession(const Interpreter* onThisInterpreter) const {
  Gil gil;
  PyObject* interpreter = onThisInterpreter ? Access::of(*onThisInterpreter) : Py_None;
  return Access::session(
      callMethod(Access::of(*this), "acquire_session", tupleOfObjects({interpreter})));
}

void ReplicatedObj::unload(const Interpreter* onThisInterpreter) {
  Gil gil;
  PyObject* interpreter = onThisInterpreter ? Access::of(*onThisInterpreter) : Py_None;
  callMethod(Access::of(*this), "unload", tupleOfObjects({interpreter}));
}

// -- Package --

ReplicatedObj Package::loadPickle(const std::string& module, const std::string& file) {
  Gil gil;
  return Access::replicated(callMethod(package_.get(), "load_pickle",
                                       tupleOfObjects({text(module).get(), text(file).get()})));
}

std::string Package::loadText(const std::string& module, const std::string& file) {
  Gil gil;
  Own result = callMethod(package_.get(), "load_text",
                          tupleOfObjects({text(module).get(), text(file).get()}));
  return fromPython(result.get()).toStringRef();
}

std::string Package::loadBinary(const std::string& module, const std::string& file) {
  Gil gil;
  Own result = callMethod(package_.get(), "load_binary",
                          tupleOfObjects({text(module).get(), text(file).get()}));
  return fromPython(result.get()).toStringRef();
}

InterpreterSession Package::acquireSession() {
  Gil gil;
  return Access::session(callMethod(package_.get(), "acquire_session"));
}

// -- InterpreterManager --

InterpreterManager::InterpreterManager(size_t nInterp, std::shared_ptr<Environment> env) {
  Gil gil;
  std::vector<std::string> paths;
  if (env) {
    paths = env->pythonPaths();
  }
  Own list(check(PyList_New(0)));
  for (const auto& path : paths) {
    if (PyList_Append(list.get(), text(path).get()) < 0) {
      throwPythonError();
    }
  }
  Own count(check(PyLong_FromSize_t(nInterp)));
  Own manager(check(PyObject_CallFunctionObjArgs(host.make_manager, count.get(), list.get(), nullptr)));
  Own all = callMethod(manager.get(), "all_instances");
  for (Py_ssize_t i = 0; i < PyList_GET_SIZE(all.get()); i++) {
    PyObject* interpreter = PyList_GET_ITEM(all.get(), i);
    Py_INCREF(interpreter);
    instances_.push_back(Access::interpreter(Own(interpreter), static_cast<size_t>(i)));
  }
  manager_ = share(manager.release());
}

InterpreterManager::~InterpreterManager() {
  if (!manager_) {
    return;
  }
  try {
    Gil gil;
    PyObject* result = PyObject_CallMethod(manager_.get(), "close", nullptr);
    if (result == nullptr) {
      PyErr_Clear();
    }
    Py_XDECREF(result);
  } catch (...) {  // a destructor does not throw
  }
}

InterpreterSession InterpreterManager::acquireOne() {
  Gil gil;
  return Access::session(callMethod(manager_.get(), "acquire_one"));
}

void InterpreterManager::debugLimitInterpreters(size_t n) {
  Gil gil;
  Own count(check(PyLong_FromSize_t(n)));
  callMethod(manager_.get(), "debug_limit_interpreters", tupleOfObjects({count.get()}));
}

Package InterpreterManager::loadPackage(const std::string& uri) {
  Gil gil;
  return Access::package(callMethod(manager_.get(), "load_package", tupleOfObjects({text(uri).get()})));
}

ReplicatedObj InterpreterManager::createMovable(Obj obj, InterpreterSession* I) {
  if (I == nullptr) {
    throw c10::Error("multipy: createMovable needs the session that obj lives in", nullptr);
  }
  Gil gil;
  return Access::replicated(callMethod(manager_.get(), "create_movable",
                                       tupleOfObjects({Access::of(obj), Access::of(*I)})));
}

void InterpreterManager::registerModuleSource(std::string name, std::string src) {
  Gil gil;
  callMethod(manager_.get(), "register_module_source",
             tupleOfObjects({text(name).get(), text(src).get()}));
}

size_t InterpreterManager::countRegisteredModuleSources() const {
  Gil gil;
  Own count = callMethod(manager_.get(), "count_registered_module_sources");
  return static_cast<size_t>(PyLong_AsSize_t(count.get()));
}

}  // namespace runtime
}  // namespace multipy
