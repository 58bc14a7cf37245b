// Argument-check errors shared by every backend: "<Backend>::<op>: <what> (out=[4, 8] f32, ...)".
#pragma once

#include <initializer_list>
#include <stdexcept>
#include <string>

#include "kernels/tensor.h"

namespace keel {

struct NamedTensor {
  const char* name;
  const Tensor& t;
};

// "out=[4, 8] f32, in=[4, 8] bf16"
inline std::string describe_tensors(std::initializer_list<NamedTensor> ts) {
  std::string s;
  for (const NamedTensor& n : ts) {
    if (!s.empty()) s += ", ";
    s += n.name;
    s += "=";
    s += n.t.empty() && n.t.numel() == 0 ? "(empty)" : n.t.shape_str();
  }
  return s;
}

// Throws std::invalid_argument naming the backend, the op, the problem and the tensors.
[[noreturn]] inline void fail_op(const char* backend, const char* op, const std::string& what,
                                 std::initializer_list<NamedTensor> ts) {
  std::string msg = std::string(backend) + "::" + op + ": " + what;
  if (ts.size()) msg += " (" + describe_tensors(ts) + ")";
  throw std::invalid_argument(msg);
}

}  // namespace keel
