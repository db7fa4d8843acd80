// multipy::runtime: the C++ API of the original torch::deploy / MultiPy, on multipy.
//
// The library starts the CPython that multipy is installed for inside the C++ program
// (the "host"), imports multipy there, and drives its Python API: each call below takes
// the host's GIL only for its short host-side part, and multipy releases it while the
// call runs inside an interpreter, so many C++ threads run on many interpreters at once.
// Tensors cross as the same at::Tensor (the program's libtorch and the host's torch are
// one library): nothing is copied.  Errors raised in Python reach C++ as c10::Error,
// whose msg() holds the Python exception and its traceback.  docs/cpp.md says more.
#pragma once

#include <ATen/core/ivalue.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/Exception.h>

#include <cstddef>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

struct _object;  // CPython's PyObject; the API never needs Python.h

namespace multipy {
namespace runtime {

namespace detail {
// A strong reference to an object of the host interpreter (dropping it takes the GIL).
using PyPtr = std::shared_ptr<_object>;
struct Access;
}  // namespace detail

class InterpreterManager;
class InterpreterSession;
class ReplicatedObj;

// Configures every interpreter of a manager: subclass it (PathEnvironment does).
class Environment {
 public:
  virtual ~Environment() = default;
  // Directories put at the front of sys.path in each interpreter.
  virtual std::vector<std::string> pythonPaths() const {
    return {};
  }
};

// An object that lives inside one interpreter (a multipy.Obj).  Calling it or taking an
// attribute runs inside that interpreter; toIValue() brings its value to C++.
class Obj {
 public:
  Obj() = default;
  // The object's value in C++: tensors (aliased, not copied), None, bool, int, float,
  // str, and tuples, lists and dicts of those.  c10::Error for anything else.
  at::IValue toIValue() const;
  Obj operator()(at::ArrayRef<Obj> args) const;
  Obj operator()(at::ArrayRef<at::IValue> args) const;
  Obj callKwargs(std::vector<at::IValue> args,
                 std::unordered_map<std::string, c10::IValue> kwargs) const;
  Obj callKwargs(std::unordered_map<std::string, c10::IValue> kwargs) const;
  bool hasattr(const char* attr) const;
  Obj attr(const char* attr) const;
  explicit operator bool() const {
    return static_cast<bool>(obj_);
  }

 private:
  friend struct detail::Access;
  explicit Obj(detail::PyPtr obj) : obj_(std::move(obj)) {}
  detail::PyPtr obj_;
};

// Exclusive use of one interpreter while it lives (the load balancer counts it busy).
class InterpreterSession {
 public:
  InterpreterSession(InterpreterSession&&) noexcept = default;
  InterpreterSession& operator=(InterpreterSession&&) noexcept;
  InterpreterSession(const InterpreterSession&) = delete;
  InterpreterSession& operator=(const InterpreterSession&) = delete;
  ~InterpreterSession();

  // `name` (dots allowed) of `module`, imported in this interpreter.
  Obj global(const char* module, const char* name);
  // value, made an object of this interpreter (tensors lent, not copied).
  Obj fromIValue(at::IValue value);
  // The replicated object's copy in this interpreter.
  Obj fromMovable(const ReplicatedObj& obj);
  // obj (of this interpreter) made usable from every interpreter of the manager.
  ReplicatedObj createMovable(Obj obj);
  // The package importer or replicated object this session is about, if any.
  Obj self;

 private:
  friend struct detail::Access;
  explicit InterpreterSession(detail::PyPtr session);
  detail::PyPtr session_;
};

// One interpreter of a manager.
class Interpreter {
 public:
  InterpreterSession acquireSession() const;
  size_t index() const {
    return index_;
  }

 private:
  friend struct detail::Access;
  Interpreter(detail::PyPtr interpreter, size_t index)
      : interpreter_(std::move(interpreter)), index_(index) {}
  detail::PyPtr interpreter_;
  size_t index_ = 0;
};

// One logical object that every interpreter of a manager can run (made on first use in
// each); calling it runs on a free interpreter and returns its result in C++.
class ReplicatedObj {
 public:
  ReplicatedObj() = default;
  at::IValue operator()(at::ArrayRef<at::IValue> args) const;
  at::IValue callKwargs(std::vector<at::IValue> args,
                        std::unordered_map<std::string, c10::IValue> kwargs) const;
  at::IValue callKwargs(std::unordered_map<std::string, c10::IValue> kwargs) const;
  bool hasattr(const char* attr) const;
  // A session whose `self` is this object, on the interpreter given or a free one.
  InterpreterSession acquireSession(const Interpreter* onThisInterpreter = nullptr) const;
  // Drops the copy in that interpreter (or in all); a later use makes it again.
  void unload(const Interpreter* onThisInterpreter = nullptr);

 private:
  friend struct detail::Access;
  explicit ReplicatedObj(detail::PyPtr obj) : obj_(std::move(obj)) {}
  detail::PyPtr obj_;
};

// A torch.package archive opened for every interpreter of a manager.
class Package {
 public:
  ReplicatedObj loadPickle(const std::string& module, const std::string& file);
  std::string loadText(const std::string& module, const std::string& file);
  std::string loadBinary(const std::string& module, const std::string& file);
  // A session whose `self` is this package's importer in a free interpreter.
  InterpreterSession acquireSession();

 private:
  friend struct detail::Access;
  explicit Package(detail::PyPtr package) : package_(std::move(package)) {}
  detail::PyPtr package_;
};

// n interpreters of this process with a load balancer (a multipy.InterpreterManager).
// The process must have room for them: start the program with
// GLIBC_TUNABLES=glibc.rtld.nns=16:glibc.rtld.optional_static_tls=16384 (docs/cpp.md).
class InterpreterManager {
 public:
  explicit InterpreterManager(size_t nInterp = 2,
                              std::shared_ptr<Environment> env = nullptr);
  InterpreterManager(const InterpreterManager&) = delete;
  InterpreterManager& operator=(const InterpreterManager&) = delete;
  // Closes the manager: its interpreters go back to the process.
  ~InterpreterManager();

  InterpreterSession acquireOne();
  at::ArrayRef<Interpreter> allInstances() const {
    return instances_;
  }
  void debugLimitInterpreters(size_t n);
  Package loadPackage(const std::string& uri);
  ReplicatedObj createMovable(Obj obj, InterpreterSession* I);
  void registerModuleSource(std::string name, std::string src);
  size_t countRegisteredModuleSources() const;

 private:
  detail::PyPtr manager_;
  std::vector<Interpreter> instances_;
};

}  // namespace runtime
}  // namespace multipy
