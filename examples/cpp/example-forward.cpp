// The torch::deploy tutorial's second step on multipy: load a model from a torch.package
// and execute its forward from C++ ("Executing forward in C++"), then from many C++
// threads at once.  The input is the package's own example input ("model",
// "example.pkl", as examples/generate_examples.py writes it); the tutorial's
// torch::ones({1, 3, 224, 224}) is the same call with another tensor.
//
//   example-forward PACKAGE [--interpreters N] [--threads N] [--calls N] [--bench SECONDS]
//
// Prints the output's shape and every value (full precision), the tutorial's slice, and:
//   --threads N   N C++ threads call the one ReplicatedObj --calls times each with their
//                 own input and check every answer against a serial call: "threads ok".
//   --bench S     C++ threads calling the model: 1 thread, then 2 threads (on 2
//                 interpreters: --interpreters 2), in 5 alternating rounds of S / 5
//                 seconds each; prints the best round of each, the cores the process
//                 kept busy in it (CPU time over elapsed time), and their ratio.
// Exit status 1 if a thread got a wrong answer, 2 if loading or a call raised c10::Error.
// Run it with room for the interpreters (docs/cpp.md):
//   GLIBC_TUNABLES=glibc.rtld.nns=16:glibc.rtld.optional_static_tls=16384 ./example-forward ...
#include <multipy/runtime/deploy.h>
#include <torch/script.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <string>
#include <thread>

#include <sys/resource.h>
#include <vector>

namespace {

// CPU seconds (user + system) this process has used so far.
double cpuSeconds() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return usage.ru_utime.tv_sec + usage.ru_stime.tv_sec +
         (usage.ru_utime.tv_usec + usage.ru_stime.tv_usec) / 1e6;
}

// Calls per second of `threads` C++ threads calling model(inputs) for `seconds`; sets
// *cores to the cores the process kept busy meanwhile (CPU time over elapsed time).
double callsPerSecond(const multipy::runtime::ReplicatedObj& model,
                      const std::vector<torch::jit::IValue>& inputs, int threads,
                      double seconds, double* cores = nullptr) {
  std::atomic<bool> go{false};
  std::atomic<long> calls{0};
  auto until = std::chrono::steady_clock::now();  // set before go
  std::vector<std::thread> workers;
  for (int t = 0; t < threads; t++) {
    workers.emplace_back([&] {
      while (!go.load()) {
        std::this_thread::yield();
      }
      long mine = 0;
      while (std::chrono::steady_clock::now() < until) {
        model(inputs);
        mine++;
      }
      calls += mine;
    });
  }
  double cpu_start = cpuSeconds();
  auto start = std::chrono::steady_clock::now();
  until = start + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                      std::chrono::duration<double>(seconds));
  go = true;
  for (auto& worker : workers) {
    worker.join();
  }
  double elapsed =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (cores != nullptr) {
    *cores = (cpuSeconds() - cpu_start) / elapsed;
  }
  return calls.load() / elapsed;
}

}  // namespace

int main(int argc, const char* argv[]) {
  if (argc < 2) {
    std::cerr << "usage: example-forward PACKAGE [--interpreters N] [--threads N] "
                 "[--calls N] [--bench SECONDS]\n";
    return -1;
  }
  size_t interpreters = 4;
  int threads = 0, calls = 20;
  double bench = 0;
  for (int i = 2; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--interpreters")) {
      interpreters = std::strtoul(argv[i + 1], nullptr, 10);
    } else if (!std::strcmp(argv[i], "--threads")) {
      threads = std::atoi(argv[i + 1]);
    } else if (!std::strcmp(argv[i], "--calls")) {
      calls = std::atoi(argv[i + 1]);
    } else if (!std::strcmp(argv[i], "--bench")) {
      bench = std::atof(argv[i + 1]);
    } else {
      std::cerr << "unknown option " << argv[i] << "\n";
      return -1;
    }
  }

  multipy::runtime::InterpreterManager manager(interpreters);
  try {
    multipy::runtime::Package package = manager.loadPackage(argv[1]);
    multipy::runtime::ReplicatedObj model = package.loadPickle("model", "model.pkl");

    // The package's example input: a tuple of tensors, read in one interpreter.
    std::vector<torch::jit::IValue> inputs;
    {
      auto I = package.loadPickle("model", "example.pkl").acquireSession();
      at::IValue example = I.self.toIValue();
      for (const auto& element : example.toTupleRef().elements()) {
        inputs.push_back(element);
      }
    }

    // Execute the model and turn its output into a tensor.
    at::Tensor output = model(inputs).toTensor();
    std::cout << "shape:";
    for (auto size : output.sizes()) {
      std::cout << ' ' << size;
    }
    std::cout << "\nvalues:";
    at::Tensor flat = output.contiguous().to(at::kDouble).flatten();
    for (int64_t i = 0; i < flat.numel(); i++) {
      char number[32];
      std::snprintf(number, sizeof number, " %.9g", flat[i].item<double>());
      std::cout << number;
    }
    std::cout << '\n' << output.slice(/*dim=*/1, /*start=*/0, /*end=*/5) << '\n';

    if (threads > 0) {
      // Each thread has its own input (the example times t + 1) and its own answer.
      std::vector<std::vector<torch::jit::IValue>> own(threads);
      std::vector<at::Tensor> expected(threads);
      for (int t = 0; t < threads; t++) {
        own[t] = {inputs[0].toTensor() * (t + 1)};
        expected[t] = model(own[t]).toTensor();
      }
      std::atomic<int> wrong{0}, failed{0};
      std::vector<std::thread> workers;
      for (int t = 0; t < threads; t++) {
        workers.emplace_back([&, t] {
          for (int c = 0; c < calls; c++) {
            try {
              at::Tensor answer = model(own[t]).toTensor();
              if (!at::allclose(answer, expected[t], 1e-5, 1e-6)) {
                wrong++;
              }
            } catch (const c10::Error& e) {
              std::cerr << "thread " << t << ": " << e.msg() << '\n';
              failed++;
            }
          }
        });
      }
      for (auto& worker : workers) {
        worker.join();
      }
      std::cout << "threads " << threads << " calls " << threads * calls << " wrong "
                << wrong.load() << " failed " << failed.load() << '\n';
      if (wrong.load() || failed.load()) {
        return 1;
      }
      std::cout << "threads ok\n";
    }

    if (bench > 0) {
      for (int warm = 0; warm < 3; warm++) {  // every interpreter loads the model first
        callsPerSecond(model, inputs, 2, 0.2);
      }
      // Alternating rounds, so that other load on the machine falls on both alike;
      // the best round of each is reported (as timeit does).
      double one = 0, two = 0, one_cores = 0, two_cores = 0;
      for (int round = 0; round < 5; round++) {
        double cores = 0;
        double rate = callsPerSecond(model, inputs, 1, bench / 5, &cores);
        if (rate > one) {
          one = rate;
          one_cores = cores;
        }
        rate = callsPerSecond(model, inputs, 2, bench / 5, &cores);
        if (rate > two) {
          two = rate;
          two_cores = cores;
        }
      }
      char line[300];
      std::snprintf(line, sizeof line,
                    "bench: %zu interpreters, best of 5 rounds of %.1f s: 1 thread %.1f "
                    "calls/s (%.2f cores busy), 2 threads %.1f calls/s (%.2f cores busy), "
                    "ratio %.2fx\n",
                    interpreters, bench / 5, one, one_cores, two, two_cores, two / one);
      std::cout << line;
    }
  } catch (const c10::Error& e) {
    std::cerr << "error running the model\n" << e.msg() << '\n';
    return 2;
  }
  return 0;
}
