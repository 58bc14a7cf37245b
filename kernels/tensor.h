// A non-owning view of a block of memory: pointer, storage dtype, shape, device.
// Storage is owned by the run (arenas / flat parameter buffers), so views are cheap to copy.
#pragma once

#include <array>
#include <cstdint>
#include <initializer_list>
#include <stdexcept>
#include <string>

#include "kernels/dtype.h"

namespace keel {

enum class Device : uint8_t { CPU, CUDA };

struct Tensor {
  static constexpr int kMaxDims = 4;

  void* data = nullptr;
  DType dtype = DType::F32;
  Device device = Device::CPU;
  int ndim = 0;
  std::array<int64_t, kMaxDims> shape{};

  Tensor() = default;
  Tensor(void* d, DType t, std::initializer_list<int64_t> dims, Device dev = Device::CPU)
      : data(d), dtype(t), device(dev), ndim(static_cast<int>(dims.size())) {
    if (dims.size() > kMaxDims) throw std::invalid_argument("Tensor: more than 4 dimensions");
    int i = 0;
    for (int64_t s : dims) shape[i++] = s;
  }

  bool empty() const { return data == nullptr; }
  int64_t numel() const {
    int64_t n = 1;
    for (int i = 0; i < ndim; ++i) n *= shape[i];
    return n;
  }
  size_t bytes() const { return static_cast<size_t>(numel()) * dtype_size(dtype); }
  int64_t dim(int i) const { return shape[i < 0 ? ndim + i : i]; }
  // Size of the last dimension and the product of all others: how row-wise ops see a tensor.
  int64_t cols() const { return ndim == 0 ? 1 : shape[ndim - 1]; }
  int64_t rows() const {
    int64_t n = 1;
    for (int i = 0; i + 1 < ndim; ++i) n *= shape[i];
    return n;
  }

  template <class T>
  T* as() const { return static_cast<T*>(data); }

  // Same memory seen with another shape (numel must agree).
  Tensor view(std::initializer_list<int64_t> dims) const;
  // Rows [begin, end) of the tensor seen as (rows, cols).
  Tensor row_slice(int64_t begin, int64_t end) const;
  // Elements [begin, end) of the tensor seen as a flat vector: a 1-D view.
  Tensor elements(int64_t begin, int64_t end) const;

  std::string shape_str() const;  // "[4, 128, 64] bf16"
};

inline Tensor Tensor::view(std::initializer_list<int64_t> dims) const {
  Tensor t(data, dtype, dims, device);
  if (t.numel() != numel())
    throw std::invalid_argument("Tensor::view: " + shape_str() + " cannot be seen as " + t.shape_str());
  return t;
}

inline Tensor Tensor::row_slice(int64_t begin, int64_t end) const {
  int64_t c = cols();
  if (begin < 0 || end < begin || end > rows())
    throw std::out_of_range("Tensor::row_slice: rows [" + std::to_string(begin) + ", " + std::to_string(end) +
                            ") of " + shape_str());
  Tensor t = *this;
  t.data = static_cast<char*>(data) + static_cast<size_t>(begin * c) * dtype_size(dtype);
  t.ndim = 2;
  t.shape = {end - begin, c, 0, 0};
  return t;
}

inline Tensor Tensor::elements(int64_t begin, int64_t end) const {
  if (begin < 0 || end < begin || end > numel())
    throw std::out_of_range("Tensor::elements: [" + std::to_string(begin) + ", " + std::to_string(end) + ") of " +
                            shape_str());
  Tensor t = *this;
  t.data = static_cast<char*>(data) + static_cast<size_t>(begin) * dtype_size(dtype);
  t.ndim = 1;
  t.shape = {end - begin, 0, 0, 0};
  return t;
}

inline std::string Tensor::shape_str() const {
  std::string s = "[";
  for (int i = 0; i < ndim; ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  s += "] ";
  s += dtype_name(dtype);
  return s;
}

}  // namespace keel
