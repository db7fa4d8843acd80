// The rest of the C++ API on multipy: sessions, objects inside an interpreter, values
// both ways (tensors by reference), movable objects, module sources, package resources,
// keyword arguments and errors.  Each check prints what it saw; exit status 1 if one
// fails.  With a package from examples/generate_examples.py (the "simple" one):
//   GLIBC_TUNABLES=glibc.rtld.nns=16:glibc.rtld.optional_static_tls=16384 \
//       ./example-session /path/to/simple.pt
#include <multipy/runtime/deploy.h>
#include <torch/script.h>

#include <iostream>
#include <string>

using multipy::runtime::InterpreterManager;
using multipy::runtime::InterpreterSession;
using multipy::runtime::Obj;
using multipy::runtime::ReplicatedObj;

namespace {

int failures = 0;

void expect(bool ok, const std::string& what) {
  std::cout << (ok ? "ok   " : "FAIL ") << what << '\n';
  failures += ok ? 0 : 1;
}

const char* kSource = R"(
import torch

def scale(x, factor=2.0):
    return x * factor

def echo(value):
    return value

def address(x):
    return x.data_ptr()

class Box:
    def __init__(self, value):
        self.value = value
)";

}  // namespace

int main(int argc, const char* argv[]) {
  if (argc != 2) {
    std::cerr << "usage: example-session <path-to-simple.pt>\n";
    return -1;
  }
  InterpreterManager manager(2);
  try {
    manager.registerModuleSource("cpp_demo", kSource);
    expect(manager.countRegisteredModuleSources() == 1, "registerModuleSource");
    expect(manager.allInstances().size() == 2, "allInstances");

    InterpreterSession I = manager.acquireOne();
    // A tensor made inside the interpreter, brought to C++.
    at::Tensor ones = I.global("torch", "ones")({at::IValue(2), at::IValue(3)}).toIValue().toTensor();
    expect(ones.sizes() == at::IntArrayRef({2, 3}) && ones.sum().item<double>() == 6.0,
           "global(\"torch\", \"ones\")(2, 3)");

    // Keyword arguments.
    at::Tensor x = torch::arange(6, at::kFloat).reshape({2, 3});
    at::Tensor scaled =
        I.global("cpp_demo", "scale").callKwargs({x}, {{"factor", at::IValue(3.0)}}).toIValue().toTensor();
    expect(at::allclose(scaled, x * 3), "callKwargs(x, factor=3.0)");

    // Tensors cross by reference: the interpreter sees the C++ tensor's own memory, and
    // a tensor it returns is that memory again.
    int64_t seen = I.global("cpp_demo", "address")({x}).toIValue().toInt();
    expect(seen == reinterpret_cast<int64_t>(x.data_ptr()), "a tensor is lent, not copied, into the interpreter");
    at::Tensor back = I.global("cpp_demo", "echo")({x}).toIValue().toTensor();
    expect(back.data_ptr() == x.data_ptr(), "a tensor comes back as the same memory");

    // Values both ways.
    c10::impl::GenericDict named(c10::StringType::get(), c10::TensorType::get());
    named.insert("x", x);
    auto tuple = c10::ivalue::Tuple::create(
        {at::IValue(int64_t(7)), at::IValue(2.5), at::IValue(true), at::IValue(std::string("text")),
         at::IValue(), at::IValue(c10::List<at::Tensor>({x, x})), at::IValue(named)});
    at::IValue echoed = I.global("cpp_demo", "echo")({at::IValue(tuple)}).toIValue();
    const auto& e = echoed.toTupleRef().elements();
    expect(e.size() == 7 && e[0].toInt() == 7 && e[1].toDouble() == 2.5 && e[2].toBool() &&
               e[3].toStringRef() == "text" && e[4].isNone() && e[5].toTensorList().size() == 2 &&
               at::equal(e[6].toGenericDict().at("x").toTensor(), x),
           "int, float, bool, str, None, list of tensors and dict round trip");

    // Attributes.
    Obj box = I.global("cpp_demo", "Box")({at::IValue(int64_t(5))});
    expect(box.hasattr("value") && !box.hasattr("missing"), "hasattr");
    expect(box.attr("value").toIValue().toInt() == 5, "attr");
    expect(I.fromIValue(x).attr("shape").toIValue().toTupleRef().elements().size() == 2,
           "fromIValue");

    // An object made movable, then used on the other interpreter.
    ReplicatedObj movable = I.createMovable(box);
    {
      auto other = manager.allInstances()[1].acquireSession();
      expect(other.fromMovable(movable).attr("value").toIValue().toInt() == 5,
             "createMovable, then fromMovable on another interpreter");
    }

    // Errors raised inside are c10::Error with the Python exception.
    try {
      I.global("no_such_module_here", "x");
      expect(false, "an import error is a c10::Error");
    } catch (const c10::Error& error) {
      expect(error.msg().find("ModuleNotFoundError") != std::string::npos,
             "an import error is a c10::Error");
    }

    // A package: resources, a session on its importer, keyword arguments to a model.
    auto package = manager.loadPackage(argv[1]);
    expect(package.loadText("extra", "hello.txt") == "hello", "loadText");
    expect(package.loadBinary("extra", "hello.bin") == "hello", "loadBinary");
    ReplicatedObj model = package.loadPickle("model", "model.pkl");
    expect(model.hasattr("forward"), "ReplicatedObj::hasattr");
    at::IValue example;
    {
      auto P = package.acquireSession();
      example = P.self.attr("load_pickle")({at::IValue("model"), at::IValue("example.pkl")}).toIValue();
    }
    at::Tensor input = example.toTupleRef().elements()[0].toTensor();
    at::Tensor positional = model({input}).toTensor();
    at::Tensor keyword = model.callKwargs({}, {{"x", input}}).toTensor();
    expect(at::allclose(positional, keyword), "ReplicatedObj::callKwargs");
    {
      auto M = model.acquireSession(&manager.allInstances()[1]);
      expect(at::allclose(M.self({input}).toIValue().toTensor(), positional),
             "ReplicatedObj::acquireSession on a given interpreter");
    }
  } catch (const c10::Error& error) {
    std::cerr << "unexpected error\n" << error.msg() << '\n';
    return 2;
  }
  std::cout << (failures ? "session api FAILED\n" : "session api ok\n");
  return failures ? 1 : 0;
}
