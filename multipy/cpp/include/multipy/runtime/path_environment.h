// multipy::runtime::PathEnvironment: directories (a site-packages holding a package's
// extern modules, say) put at the front of sys.path in every interpreter of a manager.
#pragma once

#include <multipy/runtime/deploy.h>

#include <string>
#include <utility>
#include <vector>

namespace multipy {
namespace runtime {

class PathEnvironment : public Environment {
 public:
  explicit PathEnvironment(std::string path) : paths_{std::move(path)} {}
  // The original's example passes std::getenv(...): a null path adds nothing.
  explicit PathEnvironment(const char* path) {
    if (path != nullptr && *path != '\0') {
      paths_.emplace_back(path);
    }
  }
  explicit PathEnvironment(std::vector<std::string> paths) : paths_(std::move(paths)) {}
  std::vector<std::string> pythonPaths() const override {
    return paths_;
  }

 private:
  std::vector<std::string> paths_;
};

}  // namespace runtime
}  // namespace multipy
