// The message a call throws, for tests that check what an error says.
#pragma once

#include <exception>
#include <functional>
#include <string>

namespace keel::test {

// f's exception message, or "no error" when it returns.
inline std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "no error";
}

}  // namespace keel::test
