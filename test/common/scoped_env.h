// An environment variable set (or unset) for a test, and put back as it was when the test ends
// (also when it ends by an exception).
#pragma once

#include <cstdlib>
#include <string>
#include <utility>

namespace keel::test {

class ScopedEnv {
 public:
  explicit ScopedEnv(std::string name) : name_(std::move(name)) {
    const char* old = std::getenv(name_.c_str());
    had_ = old != nullptr;
    if (had_) saved_ = old;
  }
  ~ScopedEnv() {
    if (had_) setenv(name_.c_str(), saved_.c_str(), 1);
    else unsetenv(name_.c_str());
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;
  // value nullptr: unset
  void set(const char* value) const {
    if (value) setenv(name_.c_str(), value, 1);
    else unsetenv(name_.c_str());
  }

 private:
  std::string name_, saved_;
  bool had_ = false;
};

}  // namespace keel::test
