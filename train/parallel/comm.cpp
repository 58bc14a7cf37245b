#include "train/parallel/comm.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#ifdef KEEL_HAVE_CUDA
#include <cuda_runtime.h>
#endif

namespace keel::parallel {

std::string_view reduce_op_name(ReduceOp op) { return op == ReduceOp::Sum ? "sum" : "max"; }

namespace {
bool g_comm_timed_out = false;
}
void mark_comm_timed_out() { g_comm_timed_out = true; }
bool comm_timed_out() { return g_comm_timed_out; }

// ---- argument checks -----------------------------------------------------------------------

namespace check {
namespace {

std::string where(const Comm& c, std::string_view op) {
  return std::string(op) + " on " + std::string(c.name()) + " (size " + std::to_string(c.size()) + ")";
}

void on_device(const Comm& c, std::string_view op, const Tensor& t, std::string_view what) {
  if (t.numel() > 0 && t.data == nullptr)
    throw std::invalid_argument(where(c, op) + ": " + std::string(what) + " " + t.shape_str() + " has no data");
  if (t.device != c.device())
    throw std::invalid_argument(where(c, op) + ": " + std::string(what) + " " + t.shape_str() + " is in " +
                                (t.device == Device::CUDA ? "device" : "host") + " memory, this communicator moves " +
                                (c.device() == Device::CUDA ? "device" : "host") + " memory");
}

void same_dtype(const Comm& c, std::string_view op, const Tensor& out, const Tensor& in) {
  if (out.dtype != in.dtype)
    throw std::invalid_argument(where(c, op) + ": out " + out.shape_str() + " and in " + in.shape_str() +
                                " differ in dtype");
}

// The per-rank block of a reduce_scatter or all_gather may be exactly this rank's block of the
// whole (in place, as NCCL defines it); any other overlap is undefined in NCCL.
void block_overlap(const Comm& c, const char* op, const Tensor& whole, const char* whole_name, const Tensor& block,
                   const char* block_name) {
  const char* w = static_cast<const char*>(whole.data);
  const char* b = static_cast<const char*>(block.data);
  const char* own = w + static_cast<size_t>(c.rank()) * block.bytes();
  if (block.numel() > 0 && b != own && b < w + whole.bytes() && w < b + block.bytes())
    throw std::invalid_argument(where(c, op) + ": " + block_name + " overlaps " + whole_name +
                                " but is not this rank's block " + std::to_string(c.rank()) + " of it");
}

}  // namespace

void reduction(const Comm& c, std::string_view op, const Tensor& t) {
  on_device(c, op, t, "tensor");
  // All four dtypes reduce; kept as a named check so a future dtype (fp8) fails loudly here.
  if (t.dtype != DType::F32 && t.dtype != DType::BF16 && t.dtype != DType::F16 && t.dtype != DType::I32)
    throw std::invalid_argument(where(c, op) + ": cannot reduce " + t.shape_str());
}

void reduce_scatter(const Comm& c, const Tensor& out, const Tensor& in) {
  reduction(c, "reduce_scatter", in);
  on_device(c, "reduce_scatter", out, "out");
  same_dtype(c, "reduce_scatter", out, in);
  if (in.numel() != out.numel() * c.size())
    throw std::invalid_argument(where(c, "reduce_scatter") + ": in " + in.shape_str() + " must hold " +
                                std::to_string(c.size()) + " x out " + out.shape_str() + " = " +
                                std::to_string(out.numel() * c.size()) + " elements");
  block_overlap(c, "reduce_scatter", in, "in", out, "out");
}

void reduce(const Comm& c, const Tensor& t, int root) {
  reduction(c, "reduce", t);
  if (root < 0 || root >= c.size())
    throw std::invalid_argument(where(c, "reduce") + ": root " + std::to_string(root) + " is not a rank of the group");
}

void all_gather(const Comm& c, const Tensor& out, const Tensor& in) {
  on_device(c, "all_gather", in, "in");
  on_device(c, "all_gather", out, "out");
  same_dtype(c, "all_gather", out, in);
  if (out.numel() != in.numel() * c.size())
    throw std::invalid_argument(where(c, "all_gather") + ": out " + out.shape_str() + " must hold " +
                                std::to_string(c.size()) + " x in " + in.shape_str() + " = " +
                                std::to_string(in.numel() * c.size()) + " elements");
  block_overlap(c, "all_gather", out, "out", in, "in");
}

void broadcast(const Comm& c, const Tensor& t, int root) {
  on_device(c, "broadcast", t, "tensor");
  if (root < 0 || root >= c.size())
    throw std::invalid_argument(where(c, "broadcast") + ": root " + std::to_string(root) + " is not a rank of the group");
}

void point_to_point(const Comm& c, std::string_view op, const Tensor& t, int peer) {
  on_device(c, op, t, "tensor");
  if (peer < 0 || peer >= c.size())
    throw std::invalid_argument(where(c, op) + ": peer " + std::to_string(peer) + " is not a rank of the group");
  if (peer == c.rank())
    throw std::invalid_argument(where(c, op) + ": rank " + std::to_string(peer) + " cannot " + std::string(op) +
                                " to itself");
}

}  // namespace check

// ---- LocalComm -------------------------------------------------------------------------------

void LocalComm::copy(const char* op, const Tensor& out, const Tensor& in) {
  if (out.data == in.data || in.bytes() == 0) return;
  if (device_ == Device::CPU) {
    std::memmove(out.data, in.data, in.bytes());
    return;
  }
#ifdef KEEL_HAVE_CUDA
  cudaError_t e = cudaMemcpyAsync(out.data, in.data, in.bytes(), cudaMemcpyDeviceToDevice, stream_);
  if (e != cudaSuccess)
    throw std::runtime_error(std::string(op) + " on " + name_ + " (LocalComm): cudaMemcpyAsync of " + in.shape_str() +
                             " failed: " + cudaGetErrorString(e));
#else
  throw std::runtime_error("LocalComm " + name_ + ": device tensors need a keel built with CUDA");
#endif
}

void LocalComm::all_reduce(const Tensor& t, ReduceOp) { check::reduction(*this, "all_reduce", t); }

void LocalComm::reduce_scatter(const Tensor& out, const Tensor& in) {
  check::reduce_scatter(*this, out, in);
  copy("reduce_scatter", out, in);
}

void LocalComm::all_gather(const Tensor& out, const Tensor& in) {
  check::all_gather(*this, out, in);
  copy("all_gather", out, in);
}

void LocalComm::reduce(const Tensor& t, int root) { check::reduce(*this, t, root); }
void LocalComm::broadcast(const Tensor& t, int root) { check::broadcast(*this, t, root); }

void LocalComm::send(const Tensor& t, int peer) { check::point_to_point(*this, "send", t, peer); }
void LocalComm::recv(const Tensor& t, int peer) { check::point_to_point(*this, "recv", t, peer); }
void LocalComm::sendrecv(const Tensor& send_t, int send_peer, const Tensor& recv_t, int recv_peer) {
  check::point_to_point(*this, "send", send_t, send_peer);
  check::point_to_point(*this, "recv", recv_t, recv_peer);
}

// ---- groups ----------------------------------------------------------------------------------

Comm& CommGroups::operator[](GroupKind kind) const {
  const std::unique_ptr<Comm>* p = nullptr;
  switch (kind) {
    case GroupKind::World: p = &world; break;
    case GroupKind::TP: p = &tp; break;
    case GroupKind::PP: p = &pp; break;
    case GroupKind::DP: p = &dp; break;
    case GroupKind::Embedding: p = &embedding; break;
  }
  if (!p || !*p) throw std::logic_error("CommGroups: no communicator for group " + std::string(group_name(kind)));
  return **p;
}

CommGroups make_local_comms(Device device, CUstream_st* stream) {
  CommGroups g;
  g.world = std::make_unique<LocalComm>("world", device, stream);
  g.tp = std::make_unique<LocalComm>("tp", device, stream);
  g.pp = std::make_unique<LocalComm>("pp", device, stream);
  g.dp = std::make_unique<LocalComm>("dp", device, stream);
  g.embedding = std::make_unique<LocalComm>("embedding", device, stream);
  return g;
}

// ---- host reduction ----------------------------------------------------------------------------

namespace {

template <class Load>
void reduce_f32(float* acc, const void* const* src, int nsrc, int64_t n, ReduceOp op, Load load) {
  for (int64_t i = 0; i < n; ++i) acc[i] = load(src[0], i);
  for (int k = 1; k < nsrc; ++k) {
    const void* s = src[k];
    if (op == ReduceOp::Sum) {
      for (int64_t i = 0; i < n; ++i) acc[i] += load(s, i);
    } else {
      for (int64_t i = 0; i < n; ++i) {
        const float v = load(s, i);
        if (v > acc[i] || std::isnan(v)) acc[i] = v;  // once NaN, acc stays NaN (NaN > x is false)
      }
    }
  }
}

}  // namespace

void reduce_host(void* dst, const void* const* src, int nsrc, DType dt, int64_t n, ReduceOp op, float* scratch) {
  if (nsrc < 1 || n <= 0) return;
  switch (dt) {
    case DType::F32: {
      // Accumulate straight into dst; src[0] is read before dst is written, element by element.
      auto load = [](const void* p, int64_t i) { return static_cast<const float*>(p)[i]; };
      reduce_f32(static_cast<float*>(dst), src, nsrc, n, op, load);
      break;
    }
    case DType::BF16:
    case DType::F16: {
      auto out = static_cast<uint16_t*>(dst);
      if (dt == DType::BF16) {
        auto load = [](const void* p, int64_t i) { return bf16_to_f32(static_cast<const uint16_t*>(p)[i]); };
        reduce_f32(scratch, src, nsrc, n, op, load);
        for (int64_t i = 0; i < n; ++i) out[i] = f32_to_bf16(scratch[i]);
      } else {
        auto load = [](const void* p, int64_t i) { return f16_to_f32(static_cast<const uint16_t*>(p)[i]); };
        reduce_f32(scratch, src, nsrc, n, op, load);
        for (int64_t i = 0; i < n; ++i) out[i] = f32_to_f16(scratch[i]);
      }
      break;
    }
    case DType::I32: {
      // Unsigned arithmetic: wrap-around instead of signed-overflow UB.
      auto out = static_cast<int32_t*>(dst);
      const auto* s0 = static_cast<const int32_t*>(src[0]);
      if (out != s0) std::memcpy(out, s0, static_cast<size_t>(n) * 4);
      for (int k = 1; k < nsrc; ++k) {
        const auto* s = static_cast<const int32_t*>(src[k]);
        for (int64_t i = 0; i < n; ++i)
          out[i] = op == ReduceOp::Sum
                       ? static_cast<int32_t>(static_cast<uint32_t>(out[i]) + static_cast<uint32_t>(s[i]))
                       : std::max(out[i], s[i]);
      }
      break;
    }
  }
}

}  // namespace keel::parallel
