// LayerNorm and RMSNorm over the last dimension.
//
// Forward, per row x of C values:
//   LayerNorm: mean = sum(x)/C, var = sum((x-mean)^2)/C, rstd = 1/sqrt(var+eps),
//              y = (x-mean)*rstd*w + b
//   RMSNorm:   rstd = 1/sqrt(sum(x^2)/C + eps), y = x*rstd*w
// Backward with xhat = normalised x and g = dy*w:
//   LayerNorm: dx = rstd * (g - mean(g) - xhat*mean(g*xhat)),  dw += dy*xhat,  db += dy
//   RMSNorm:   dx = rstd * (g - xhat*mean(g*xhat)),            dw += dy*xhat
// Rows are independent (parallel); dw/db are summed per block of kRowBlock rows, then the
// blocks are added in order, so the sums do not depend on the thread count.
#include <cmath>
#include <vector>

#include "kernels/cpu/cpu_backend.h"

namespace keel {

using cpu::Named;

namespace {

// Shared checks: in/out (or din/dout) are [N, C] seen as rows; stats are F32 [N]; weight has C.
struct NormDims {
  int64_t N, C;
};

NormDims check_norm(const char* op, const Tensor& x, std::initializer_list<Named> rowwise,
                    std::initializer_list<Named> stats, std::initializer_list<Named> per_col) {
  cpu::check_float(op, {"in", x});
  const int64_t N = cpu::rows(x), C = x.cols();
  for (const Named& t : rowwise) {
    cpu::check_float(op, t);
    if (cpu::rows(t.t) != N || t.t.cols() != C) cpu::fail(op, std::string(t.name) + " must match in's shape", {t, {"in", x}});
  }
  for (const Named& t : stats) {
    cpu::check_dtype(op, t, DType::F32);
    if (t.t.numel() != N) cpu::fail(op, std::string(t.name) + " must have one value per row", {t, {"in", x}});
  }
  for (const Named& t : per_col) {
    if (t.t.empty() && t.t.numel() == 0) continue;
    if (t.t.numel() != C) cpu::fail(op, std::string(t.name) + " must have in.cols() elements", {t, {"in", x}});
  }
  return {N, C};
}

std::vector<float> load_all(const Tensor& t) {
  std::vector<float> v(static_cast<size_t>(t.numel()));
  if (!v.empty()) cpu::load_f32(t, 0, t.numel(), v.data());
  return v;
}

int64_t num_blocks(int64_t n) { return (n + cpu::kRowBlock - 1) / cpu::kRowBlock; }

}  // namespace

void CpuBackend::layernorm_forward(const Tensor& out, const Tensor& mean, const Tensor& rstd, const Tensor& in,
                                   const Tensor& weight, const Tensor& bias, float eps) {
  const char* op = "layernorm_forward";
  cpu::check_float(op, {"weight", weight});
  if (!bias.empty()) cpu::check_float(op, {"bias", bias});
  auto [N, C] = check_norm(op, in, {{"out", out}}, {{"mean", mean}, {"rstd", rstd}},
                           {{"weight", weight}, {"bias", bias}});
  if (weight.numel() != C) cpu::fail(op, "weight must have in.cols() elements", {{"weight", weight}, {"in", in}});
  const std::vector<float> w = load_all(weight), b = bias.empty() ? std::vector<float>() : load_all(bias);
#pragma omp parallel if (N * C >= cpu::kMinParallelWork)
  {
    std::vector<float> buf(static_cast<size_t>(C)), d(static_cast<size_t>(C));
#pragma omp for schedule(static)
    for (int64_t n = 0; n < N; ++n) {
      const float* x = cpu::read_f32(in, n * C, C, buf.data());
      const float mu = cpu::sum_f32(x, C) / static_cast<float>(C);
      for (int64_t c = 0; c < C; ++c) d[c] = x[c] - mu;
      const float var = cpu::dot(d.data(), d.data(), C) / static_cast<float>(C);
      const float rs = 1.0f / std::sqrt(var + eps);
      for (int64_t c = 0; c < C; ++c) buf[c] = d[c] * rs * w[c] + (b.empty() ? 0.0f : b[c]);
      cpu::store_f32(out, n * C, C, buf.data());
      mean.as<float>()[n] = mu;
      rstd.as<float>()[n] = rs;
    }
  }
}

void CpuBackend::layernorm_backward(const Tensor& din, const Tensor& dweight, const Tensor& dbias,
                                    const Tensor& dout, const Tensor& in, const Tensor& weight, const Tensor& mean,
                                    const Tensor& rstd, bool accumulate_din, bool accumulate_dparams) {
  const char* op = "layernorm_backward";
  cpu::check_float(op, {"weight", weight});
  cpu::check_dtype(op, {"dweight", dweight}, DType::F32);
  if (!dbias.empty()) cpu::check_dtype(op, {"dbias", dbias}, DType::F32);
  auto [N, C] = check_norm(op, in, {{"din", din}, {"dout", dout}}, {{"mean", mean}, {"rstd", rstd}},
                           {{"weight", weight}, {"dweight", dweight}, {"dbias", dbias}});
  if (weight.numel() != C || dweight.numel() != C)
    cpu::fail(op, "weight and dweight must have in.cols() elements", {{"weight", weight}, {"dweight", dweight}, {"in", in}});
  const std::vector<float> w = load_all(weight);
  const int64_t nblocks = num_blocks(N);
  std::vector<float> dw_part(static_cast<size_t>(nblocks * C), 0.0f), db_part(static_cast<size_t>(nblocks * C), 0.0f);
#pragma omp parallel if (N * C >= cpu::kMinParallelWork)
  {
    std::vector<float> xbuf(C), dybuf(C), xhat(C), g(C), dx(C);
#pragma omp for schedule(static)
    for (int64_t blk = 0; blk < nblocks; ++blk) {
      float* dw = dw_part.data() + blk * C;
      float* db = db_part.data() + blk * C;
      for (int64_t n = blk * cpu::kRowBlock; n < std::min(N, (blk + 1) * cpu::kRowBlock); ++n) {
        const float* x = cpu::read_f32(in, n * C, C, xbuf.data());
        const float* dy = cpu::read_f32(dout, n * C, C, dybuf.data());
        const float mu = mean.as<const float>()[n], rs = rstd.as<const float>()[n];
        for (int64_t c = 0; c < C; ++c) {
          xhat[c] = (x[c] - mu) * rs;
          g[c] = dy[c] * w[c];
          dw[c] += dy[c] * xhat[c];
          db[c] += dy[c];
        }
        const float mean_g = cpu::sum_f32(g.data(), C) / static_cast<float>(C);
        const float mean_gx = cpu::dot(g.data(), xhat.data(), C) / static_cast<float>(C);
        for (int64_t c = 0; c < C; ++c) dx[c] = rs * (g[c] - mean_g - xhat[c] * mean_gx);
        if (accumulate_din) {
          cpu::load_f32(din, n * C, C, g.data());
          for (int64_t c = 0; c < C; ++c) dx[c] += g[c];
        }
        cpu::store_f32(din, n * C, C, dx.data());
      }
    }
  }
  cpu::add_block_partials(dweight.as<float>(), dw_part.data(), nblocks, C, accumulate_dparams);
  if (!dbias.empty()) cpu::add_block_partials(dbias.as<float>(), db_part.data(), nblocks, C, accumulate_dparams);
}

void CpuBackend::rmsnorm_forward(const Tensor& out, const Tensor& rstd, const Tensor& in, const Tensor& weight,
                                 float eps) {
  const char* op = "rmsnorm_forward";
  cpu::check_float(op, {"weight", weight});
  auto [N, C] = check_norm(op, in, {{"out", out}}, {{"rstd", rstd}}, {{"weight", weight}});
  if (weight.numel() != C) cpu::fail(op, "weight must have in.cols() elements", {{"weight", weight}, {"in", in}});
  const std::vector<float> w = load_all(weight);
#pragma omp parallel if (N * C >= cpu::kMinParallelWork)
  {
    std::vector<float> buf(static_cast<size_t>(C));
#pragma omp for schedule(static)
    for (int64_t n = 0; n < N; ++n) {
      const float* x = cpu::read_f32(in, n * C, C, buf.data());
      const float rs = 1.0f / std::sqrt(cpu::dot(x, x, C) / static_cast<float>(C) + eps);
      for (int64_t c = 0; c < C; ++c) buf[c] = x[c] * rs * w[c];
      cpu::store_f32(out, n * C, C, buf.data());
      rstd.as<float>()[n] = rs;
    }
  }
}

void CpuBackend::rmsnorm_backward(const Tensor& din, const Tensor& dweight, const Tensor& dout, const Tensor& in,
                                  const Tensor& weight, const Tensor& rstd, bool accumulate_din,
                                  bool accumulate_dparams) {
  const char* op = "rmsnorm_backward";
  cpu::check_float(op, {"weight", weight});
  cpu::check_dtype(op, {"dweight", dweight}, DType::F32);
  auto [N, C] = check_norm(op, in, {{"din", din}, {"dout", dout}}, {{"rstd", rstd}},
                           {{"weight", weight}, {"dweight", dweight}});
  if (weight.numel() != C || dweight.numel() != C)
    cpu::fail(op, "weight and dweight must have in.cols() elements", {{"weight", weight}, {"dweight", dweight}, {"in", in}});
  const std::vector<float> w = load_all(weight);
  const int64_t nblocks = num_blocks(N);
  std::vector<float> dw_part(static_cast<size_t>(nblocks * C), 0.0f);
#pragma omp parallel if (N * C >= cpu::kMinParallelWork)
  {
    std::vector<float> xbuf(C), dybuf(C), xhat(C), g(C), dx(C);
#pragma omp for schedule(static)
    for (int64_t blk = 0; blk < nblocks; ++blk) {
      float* dw = dw_part.data() + blk * C;
      for (int64_t n = blk * cpu::kRowBlock; n < std::min(N, (blk + 1) * cpu::kRowBlock); ++n) {
        const float* x = cpu::read_f32(in, n * C, C, xbuf.data());
        const float* dy = cpu::read_f32(dout, n * C, C, dybuf.data());
        const float rs = rstd.as<const float>()[n];
        for (int64_t c = 0; c < C; ++c) {
          xhat[c] = x[c] * rs;
          g[c] = dy[c] * w[c];
          dw[c] += dy[c] * xhat[c];
        }
        const float mean_gx = cpu::dot(g.data(), xhat.data(), C) / static_cast<float>(C);
        for (int64_t c = 0; c < C; ++c) dx[c] = rs * (g[c] - xhat[c] * mean_gx);
        if (accumulate_din) {
          cpu::load_f32(din, n * C, C, g.data());
          for (int64_t c = 0; c < C; ++c) dx[c] += g[c];
        }
        cpu::store_f32(din, n * C, C, dx.data());
      }
    }
  }
  cpu::add_block_partials(dweight.as<float>(), dw_part.data(), nblocks, C, accumulate_dparams);
}

}  // namespace keel
