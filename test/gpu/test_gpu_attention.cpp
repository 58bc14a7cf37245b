// CUDA RoPE and causal GQA attention against the CPU reference.
//
// Tolerances (||gpu - cpu|| / ||cpu||):
//   rope                       bit-identical (same host-made cos/sin table, same unfused fp32 ops)
//   plain kernels, f32         out, dqkv 1e-5; lse 1e-6 (fp32, other summation order)
//   plain kernels, bf16/f16    4e-3 / 1e-3 (storage rounding flips)
//   fused kernels (bf16/f16, head_dim up to 160): out 1e-2, lse 1e-5, dq/dk/dv 2e-2: the
//       probabilities (forward) and dS (backward) are rounded to the storage type before
//       their second matrix product, as in FlashAttention; the observed errors should sit near
//       3e-3 (out) and 6e-3 (gradients) - the bounds leave room for the worst shapes.
//   a backward part whose CPU reference is zero up to rounding (dq, dk where every row attends
//       to itself alone: T = 1, one-row documents): ||gpu|| against the worst-case rounding of
//       the cancellation dS = dO.v - D (zero_ref_bound).
//   ALiBi (AttnShape::alibi_slopes): the same bounds as without it. The plain kernels add the
//       bias with the CPU's two roundings; the fused ones add it in log2 units by an fma, whose
//       rounding differences (|bias| ulps, on probabilities near the row maximum where |bias|
//       is small) are far below the bounds.
#include <algorithm>

#include "gpu_test_util.h"
#include "kernels/alibi.h"
#include "kernels/cuda/attention_cudnn.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/wgmma_check.h"

using namespace keel;
using namespace keel::test;

namespace {

HostTensor rand_tensor(DType dt, std::initializer_list<int64_t> shape, uint32_t seed, float scale = 1.0f) {
  HostTensor h(dt, shape);
  h.set(randn(h.numel(), seed, scale));
  return h;
}

std::string shape_name(const AttnShape& s) {
  return "B=" + std::to_string(s.B) + " T=" + std::to_string(s.T) + " nh=" + std::to_string(s.n_heads) +
         " nkv=" + std::to_string(s.n_kv_heads) + " hd=" + std::to_string(s.head_dim);
}

// Relative error of the q, k or v block of columns of a [B*T, qkv_cols] tensor; the absolute
// norm of the difference where the reference block is zero up to rounding, ||ref|| < 1e-4
// (*ref_zero set).
double part_err(const HostTensor& got, const HostTensor& ref, const AttnShape& s, int part, bool* ref_zero = nullptr) {
  const int64_t cols = s.qkv_cols(), hd = s.head_dim;
  const int64_t begin = part == 0 ? 0 : part == 1 ? s.n_heads * hd : (s.n_heads + s.n_kv_heads) * hd;
  const int64_t width = part == 0 ? s.n_heads * hd : s.n_kv_heads * hd;
  double num = 0, den = 0;
  for (int64_t r = 0; r < static_cast<int64_t>(s.B) * s.T; ++r)
    for (int64_t c = begin; c < begin + width; ++c) {
      const double a = got.at(r * cols + c), b = ref.at(r * cols + c);
      if (!std::isfinite(a)) return INFINITY;
      num += (a - b) * (a - b);
      den += b * b;
    }
  const bool zero = std::sqrt(den) < 1e-4;
  if (ref_zero) *ref_zero = zero;
  return zero ? std::sqrt(num) : std::sqrt(num / den);
}

// The absolute bound for dq (part 0) or dk (part 1) where the CPU reference is zero up to
// rounding, which happens where every row attends to itself alone (T = 1, one-row documents):
// P_ii = 1 and o_i = v_i, so dS_ii = dO_i.v_i - D_i cancels, exactly on the CPU (one summation
// order for both) but not on the GPU, whose D (dO_i . o_i, attention_delta) and dO_i.v_i sum in
// other orders. Each sum of hd products errs by at most hd u sum_d |dO_id v_id| (u = 2^-23: one
// ulp per add, allowing for tensor cores that truncate), so |dS_ii| <= 2 hd u a_i; then
// dq_i = scale dS_ii k_i and dk_j = scale sum_{h in group} dS_hjj q_hj. The bound is the norm of
// those worst cases: deterministic, and some 1e4 below the error of a dS that does not cancel.
double zero_ref_bound(const HostTensor& qkv, const HostTensor& dy, const AttnShape& s, int part) {
  const int64_t cols = s.qkv_cols(), hd = s.head_dim, nh = s.n_heads, nkv = s.n_kv_heads, group = nh / nkv;
  const double u = std::ldexp(1.0, -23), scale = 1.0 / std::sqrt(static_cast<double>(hd));
  double sum = 0;
  for (int64_t r = 0; r < static_cast<int64_t>(s.B) * s.T; ++r)
    for (int64_t kvh = 0; kvh < nkv; ++kvh) {
      const int64_t k0 = (nh + kvh) * hd, v0 = (nh + nkv + kvh) * hd;
      double dk_row = 0;  // the bound on |dk_j| (part 1)
      for (int64_t h = kvh * group; h < (kvh + 1) * group; ++h) {
        double a = 0, q2 = 0, k2 = 0;
        for (int64_t d = 0; d < hd; ++d) {
          a += std::fabs(dy.at(r * nh * hd + h * hd + d) * qkv.at(r * cols + v0 + d));
          q2 += qkv.at(r * cols + h * hd + d) * qkv.at(r * cols + h * hd + d);
          k2 += qkv.at(r * cols + k0 + d) * qkv.at(r * cols + k0 + d);
        }
        const double ds = 2.0 * hd * u * a;
        if (part == 0) sum += scale * ds * scale * ds * k2;
        else dk_row += scale * ds * std::sqrt(q2);
      }
      sum += dk_row * dk_row;
    }
  return std::sqrt(sum);
}

// The bound for a backward part: `tol` (relative), or zero_ref_bound (absolute) where the CPU
// reference is zero up to rounding.
double part_tol(double tol, bool ref_zero, const HostTensor& qkv, const HostTensor& dy, const AttnShape& s,
                int part) {
  return ref_zero ? zero_ref_bound(qkv, dy, s, part) : tol;
}

// The fused kernels take head_dim 64, 128 and 160, and the others up to 160 padded to the next
// of them.
bool fused_applies(const AttnShape& s, DType dt) {
  return (dt == DType::BF16 || dt == DType::F16) && s.head_dim >= 1 && s.head_dim <= 160;
}

// attention_forward and attention_backward of `be` on qkv (after RoPE, if any) against the CPU.
// s: the call with host tensors (positions, slopes), sd: the same with device tensors. Bounds:
// fused out 1e-2, lse 1e-5, dq/dk/dv 2e-2; plain storage_tol(dt, 1e-5), 1e-6, storage_tol(dt,
// 1e-5) (zero_ref_bound where a reference part is zero). The backward gets the CPU's forward results.
// repeat: each call a second time gives the same bits. Returns the CPU's dqkv.
HostTensor check_attention_vs_cpu(Backend& be, const HostTensor& qkv, const HostTensor& dy, const AttnShape& s,
                            const AttnShape& sd, bool fused, const std::string& what, bool repeat) {
  const DType dt = qkv.t.dtype;
  const int64_t N = static_cast<int64_t>(s.B) * s.T, ocols = s.n_heads * s.head_dim;
  HostTensor out(dt, {N, ocols}), lse(DType::F32, {s.B, s.n_heads, s.T}), dqkv(dt, {N, s.qkv_cols()});
  cpu().attention_forward(out.t, lse.t, qkv.t, s);
  cpu().attention_backward(dqkv.t, dy.t, qkv.t, out.t, lse.t, s);

  DeviceTensor dq = DeviceTensor::of(be, qkv);
  DeviceTensor dout = DeviceTensor::of(be, filled(dt, {N, ocols}, NAN));
  DeviceTensor dlse = DeviceTensor::of(be, filled(DType::F32, {s.B, s.n_heads, s.T}, NAN));
  be.attention_forward(dout.t, dlse.t, dq.t, sd);
  const HostTensor got_out = dout.host(), got_lse = dlse.host();
  KEEL_CHECK_ERR("attention_forward out", what, rel_err(got_out, out), fused ? 1e-2 : storage_tol(dt, 1e-5));
  KEEL_CHECK_ERR("attention_forward lse", what, rel_err(got_lse, lse), fused ? 1e-5 : 1e-6);
  if (repeat) {
    be.attention_forward(dout.t, dlse.t, dq.t, sd);
    CHECK(bits_differ(dout.host(), got_out) == 0);
    CHECK(bits_differ(dlse.host(), got_lse) == 0);
  }

  dout.upload(out);
  dlse.upload(lse);
  DeviceTensor ddy = DeviceTensor::of(be, dy), ddq = DeviceTensor::of(be, filled(dt, {N, s.qkv_cols()}, NAN));
  be.attention_backward(ddq.t, ddy.t, dq.t, dout.t, dlse.t, sd);
  const HostTensor got = ddq.host();
  const double tol = fused ? 2e-2 : storage_tol(dt, 1e-5);
  for (int part = 0; part < 3; ++part) {
    bool zero = false;
    const double e = part_err(got, dqkv, s, part, &zero);
    KEEL_CHECK_ERR(std::string("attention_backward d") + "qkv"[part], what + (zero ? " (abs, zero ref)" : ""), e,
                   part_tol(tol, zero, qkv, dy, s, part));
  }
  if (repeat) {
    ddq.upload(filled(dt, {N, s.qkv_cols()}, NAN));
    be.attention_backward(ddq.t, ddy.t, dq.t, dout.t, dlse.t, sd);
    CHECK(bits_differ(ddq.host(), got) == 0);
  }
  return dqkv;
}

const AttnShape kShapes[] = {
    {2, 37, 4, 2, 8},     // tiny heads: the 64 kernels on zero-padded copies
    {2, 100, 4, 2, 64},   // GQA, T not a multiple of the tiles
    {1, 257, 8, 2, 128},  // group of 4, ragged last tile
    {2, 64, 2, 2, 64},    // exactly one tile, MHA
    {1, 1, 2, 1, 64},     // a single position
    {3, 33, 4, 1, 128},   // multi-query
    {2, 50, 4, 2, 32},    // the tiny configs' head_dim: padded to 64
    {2, 70, 4, 2, 80},    // head_dim 80: the 128 kernels on zero-padded copies
    {1, 130, 3, 3, 145},  // BLOOM-104B's head_dim: the 160 kernels on padded copies
    {2, 65, 2, 1, 160},   // the 160 kernels on the operands themselves
};

// What a setting of such a backend reads (get(CudaBackend&)) with env's variable set to value.
template <class Get>
auto setting_with(const ScopedEnv& env, const char* value, Get get) {
  const std::unique_ptr<Backend> be = backend_with(env, value);
  return get(dynamic_cast<CudaBackend&>(*be));
}

// ALiBi slopes of heads [offset, offset + n) of a model with `total` heads: a tensor-parallel
// rank's contiguous slice of keel::alibi_slopes(total), as an F32 host tensor [n].
HostTensor alibi_host(int total, int offset, int n) {
  const std::vector<float> all = alibi_slopes(total);
  REQUIRE(offset + n <= total);
  HostTensor h(DType::F32, {n});
  h.set(std::vector<float>(all.begin() + offset, all.begin() + offset + n));
  return h;
}

// Llama 3.1's scaled RoPE with a short original context, so that positions up to 300 reach
// all three frequency bands.
Rope llama3_rope() {
  RopeScaling s;
  s.kind = RopeScaling::Kind::Llama3;
  s.original_max_position = 128;
  return Rope(500000.0f, s);
}

// An attention call with documents (lengths; empty: none), the window of its shape and ALiBi
// (or not) on random inputs (seeds `seed` and seed + 1), and the CPU's forward and backward
// of it.
struct MaskedCall {
  AttnShape s0;  // the shape alone
  AttnShape s;   // with the host positions and slopes
  HostTensor positions, slopes, qkv, dy, out, lse, dqkv;

  MaskedCall(const AttnShape& shape, DType dt, const std::vector<int>& lengths, bool alibi, uint32_t seed)
      : s0(shape),
        s(shape),
        positions(DType::I32, {rows(shape)}),
        slopes(alibi_host(shape.n_heads, 0, shape.n_heads)),
        qkv(rand_tensor(dt, {rows(shape), shape.qkv_cols()}, seed, 1.5f)),
        dy(rand_tensor(dt, {rows(shape), shape.n_heads * shape.head_dim}, seed + 1)),
        out(dt, {rows(shape), shape.n_heads * shape.head_dim}),
        lse(DType::F32, {shape.B, shape.n_heads, shape.T}),
        dqkv(dt, {rows(shape), shape.qkv_cols()}) {
    if (!lengths.empty()) {
      positions.set_i32(document_positions_of(shape.B, shape.T, lengths));
      s.positions = positions.t;
    }
    if (alibi) s.alibi_slopes = slopes.t;
    cpu().attention_forward(out.t, lse.t, qkv.t, s);
    cpu().attention_backward(dqkv.t, dy.t, qkv.t, out.t, lse.t, s);
  }
  static int64_t rows(const AttnShape& shape) { return static_cast<int64_t>(shape.B) * shape.T; }
  // The call on a device: s0 with the device copies of whichever of positions and slopes it uses.
  AttnShape on_device(const DeviceTensor& dpositions, const DeviceTensor& dslopes) const {
    AttnShape sd = s0;
    if (!s.positions.empty()) sd.positions = dpositions.t;
    if (!s.alibi_slopes.empty()) sd.alibi_slopes = dslopes.t;
    return sd;
  }
};

}  // namespace

TEST_CASE("gpu: rope forward and backward are bit-identical to the CPU", "[gpu][rope]") {
  KEEL_GPU_OR_SKIP();
  Backend& be = gpu();
  for (DType dt : {DType::F32, DType::BF16, DType::F16})
    for (const Rope& theta : {Rope(10000.0f), Rope(500000.0f), llama3_rope()}) {
      const AttnShape s{2, 300, 4, 2, 64};
      INFO(dname(dt) << " rope " << theta.str());
      HostTensor qkv = rand_tensor(dt, {s.B * s.T, s.qkv_cols()}, 1);
      HostTensor ref = clone(qkv);
      cpu().rope_forward(ref.t, s, theta);
      DeviceTensor d = DeviceTensor::of(be, qkv);
      be.rope_forward(d.t, s, theta);
      KEEL_CHECK_BITS("rope_forward", dname(dt), d.host(), ref);
      cpu().rope_backward(ref.t, s, theta);
      be.rope_backward(d.t, s, theta);
      KEEL_CHECK_BITS("rope_backward", dname(dt), d.host(), ref);
    }
}

TEST_CASE("gpu: attention forward matches the CPU (plain and fused kernels)", "[gpu][attention]") {
  KEEL_GPU_OR_SKIP();
  REQUIRE(dynamic_cast<CudaBackend&>(gpu_simple_attention()).simple_attention());  // KEEL_ATTENTION=simple took
  REQUIRE_FALSE(dynamic_cast<CudaBackend&>(gpu()).simple_attention());
  for (DType dt : {DType::F32, DType::BF16, DType::F16})
    for (const AttnShape& s : kShapes)
      for (int simple = 0; simple < 2; ++simple) {
        Backend& be = simple ? gpu_simple_attention() : gpu();
        const bool fused = !simple && fused_applies(s, dt);
        INFO(dname(dt) << " " << shape_name(s) << (fused ? " fused" : " plain"));
        const int64_t N = static_cast<int64_t>(s.B) * s.T;
        HostTensor qkv = rand_tensor(dt, {N, s.qkv_cols()}, 7, 1.5f);
        HostTensor out = filled(dt, {N, s.n_heads * s.head_dim}, NAN), lse = filled(DType::F32, {s.B, s.n_heads, s.T}, NAN);
        cpu().attention_forward(out.t, lse.t, qkv.t, s);
        DeviceTensor dq = DeviceTensor::of(be, qkv);
        DeviceTensor dout = DeviceTensor::of(be, filled(dt, {N, s.n_heads * s.head_dim}, NAN));
        DeviceTensor dlse = DeviceTensor::of(be, filled(DType::F32, {s.B, s.n_heads, s.T}, NAN));
        be.attention_forward(dout.t, dlse.t, dq.t, s);
        const HostTensor got = dout.host(), got_lse = dlse.host();
        const std::string what = std::string(dname(dt)) + (fused ? " fused" : " plain");
        KEEL_CHECK_ERR("attention_forward out", what, rel_err(got, out), fused ? 1e-2 : storage_tol(dt, 1e-5));
        KEEL_CHECK_ERR("attention_forward lse", what, rel_err(got_lse, lse), fused ? 1e-5 : 1e-6);
        // the same call again: the same bits
        be.attention_forward(dout.t, dlse.t, dq.t, s);
        CHECK(bits_differ(dout.host(), got) == 0);
        CHECK(bits_differ(dlse.host(), got_lse) == 0);
      }
}

TEST_CASE("gpu: attention backward matches the CPU (plain and fused kernels)", "[gpu][attention]") {
  KEEL_GPU_OR_SKIP();
  for (DType dt : {DType::F32, DType::BF16, DType::F16})
    for (const AttnShape& s : kShapes)
      for (int simple = 0; simple < 2; ++simple) {
        Backend& be = simple ? gpu_simple_attention() : gpu();
        const bool fused = !simple && fused_applies(s, dt);
        INFO(dname(dt) << " " << shape_name(s) << (fused ? " fused" : " plain"));
        const int64_t N = static_cast<int64_t>(s.B) * s.T, ocols = s.n_heads * s.head_dim;
        HostTensor qkv = rand_tensor(dt, {N, s.qkv_cols()}, 11, 1.5f), dy = rand_tensor(dt, {N, ocols}, 12);
        HostTensor out(dt, {N, ocols}), lse(DType::F32, {s.B, s.n_heads, s.T});
        cpu().attention_forward(out.t, lse.t, qkv.t, s);
        HostTensor dqkv = filled(dt, {N, s.qkv_cols()}, NAN);
        cpu().attention_backward(dqkv.t, dy.t, qkv.t, out.t, lse.t, s);
        // the GPU gets the CPU's forward results, so that only the backward is compared
        DeviceTensor dq = DeviceTensor::of(be, qkv), ddy = DeviceTensor::of(be, dy), dout = DeviceTensor::of(be, out);
        DeviceTensor dlse = DeviceTensor::of(be, lse), ddq = DeviceTensor::of(be, filled(dt, {N, s.qkv_cols()}, NAN));
        be.attention_backward(ddq.t, ddy.t, dq.t, dout.t, dlse.t, s);
        const HostTensor got = ddq.host();
        const double tol = fused ? 2e-2 : storage_tol(dt, 1e-5);
        bool zq = false, zk = false, zv = false;
        const double eq = part_err(got, dqkv, s, 0, &zq), ek = part_err(got, dqkv, s, 1, &zk),
                     ev = part_err(got, dqkv, s, 2, &zv);
        const std::string what = std::string(dname(dt)) + (fused ? " fused" : " plain");
        KEEL_CHECK_ERR("attention_backward dq", what + (zq ? " (abs, zero ref)" : ""), eq,
                       part_tol(tol, zq, qkv, dy, s, 0));
        KEEL_CHECK_ERR("attention_backward dk", what + (zk ? " (abs, zero ref)" : ""), ek,
                       part_tol(tol, zk, qkv, dy, s, 1));
        KEEL_CHECK_ERR("attention_backward dv", what + (zv ? " (abs, zero ref)" : ""), ev,
                       part_tol(tol, zv, qkv, dy, s, 2));
        ddq.upload(filled(dt, {N, s.qkv_cols()}, NAN));
        be.attention_backward(ddq.t, ddy.t, dq.t, dout.t, dlse.t, s);
        CHECK(bits_differ(ddq.host(), got) == 0);
      }
}

// More sequences than a grid's y or z extent (65535): the fused kernels put the sequences there
// (attention_flash.cu, grid_of), so such a call must take the plain kernels, whose grids are
// one-dimensional, and match the CPU as any plain call. (A launch beyond the limits fails on
// the CUDA emulator as on a GPU.)
TEST_CASE("gpu: attention over more sequences than a grid's y or z extent matches the CPU", "[gpu][attention]") {
  KEEL_GPU_OR_SKIP();
  const AttnShape s{65536, 1, 1, 1, 8};
  const DType dt = DType::BF16;
  const int64_t N = static_cast<int64_t>(s.B) * s.T;
  HostTensor qkv = rand_tensor(dt, {N, s.qkv_cols()}, 31, 1.5f), dy = rand_tensor(dt, {N, s.n_heads * s.head_dim}, 32);
  check_attention_vs_cpu(gpu(), qkv, dy, s, s, false, "bf16 B=65536", false);
}

// The fused backward's two ways to dq (kernels/cuda/attention_flash.cu): staged (the dk-dv kernel
// stores its rounded dS tiles to scratch, and a dq kernel multiplies them by K; launched in
// chunks of kv heads x sequences that fit CudaBackend::attention_ds_budget) and recompute (the
// dq kernel computes S, P and dS again; budget 0, or below one kv head's tiles). What is checked:
//   - every budget: dq, dk, dv against the CPU within the fused bound 2e-2, all of dqkv written
//     (it starts as NaN);
//   - chunks change only which blocks a launch holds: the same bits as one launch, for chunks
//     of one kv head and one sequence, of ragged kv-head groups, and of ragged sequence groups;
//   - dk and dv come from the same kernel either way (the staged one runs its query loop on to
//     whole 64-row tiles, which adds exact zeros): the same bits;
//   - dq: the two kernels round the same fp32 dS, computed as K Q^T there and Q K^T here, to the
//     storage type: within the storage tolerance of each other (bf16 4e-3, f16 1e-3);
//   - the two block orders (heads or tiles fastest, chosen by the L2 size) change only when
//     each block runs: the same bits, forward and backward.
// One kv head's staged tiles, the unit of a chunk: ceil(T/64) (ceil(T/64) + 1) / 2 tiles of
// 64 x 64 two-byte elements per query head, times the group.
TEST_CASE("gpu: fused attention backward: staged dS in chunks and the recomputing dq kernel agree",
          "[gpu][attention][documents][window][alibi]") {
  KEEL_GPU_OR_SKIP();
  struct Case {
    AttnShape s;
    int window;
    DType dt;
    std::vector<int> lengths;  // documents; empty: none
    bool alibi;
  };
  const std::vector<Case> cases = {
      {{3, 130, 6, 3, 64}, 0, DType::BF16, {}, false},                  // 3 kv heads, 3 sequences, ragged T
      {{2, 200, 4, 2, 128}, 50, DType::F16, {1, 63, 64, 65, 7}, true},  // window, documents, ALiBi
      {{1, 257, 8, 2, 64}, 0, DType::BF16, {100, 1, 1, 40, 200}, false},  // group of 4, documents
  };
  for (const Case& c : cases) {
    AttnShape s0 = c.s;
    s0.window = c.window;
    const DType dt = c.dt;
    INFO(shape_name(s0) << " window " << s0.window << " " << dname(dt) << (c.lengths.empty() ? "" : " documents")
                        << (c.alibi ? " alibi" : ""));
    const int64_t N = static_cast<int64_t>(s0.B) * s0.T, ocols = s0.n_heads * s0.head_dim;
    const size_t n_qt = static_cast<size_t>((s0.T + 63) / 64);
    const size_t per_kv = n_qt * (n_qt + 1) / 2 * 64 * 64 * 2 * static_cast<size_t>(s0.n_heads / s0.n_kv_heads);
    const size_t one_launch = per_kv * s0.n_kv_heads * s0.B;
    struct Budget {
      size_t bytes;
      const char* what;
      bool staged;
    };
    const std::vector<Budget> budgets = {
        {one_launch, "staged, one launch", true},
        {per_kv, "staged, chunks of one kv head and one sequence", true},
        {2 * per_kv, "staged, chunks of two kv heads (ragged when nkv is odd)", true},
        {2 * per_kv * s0.n_kv_heads, "staged, chunks of two sequences (ragged when B is odd)", true},
        {per_kv - 1, "recompute (budget below one kv head)", false},
        {0, "recompute (budget 0)", false},
    };

    const MaskedCall call(s0, dt, c.lengths, c.alibi, 81);
    const AttnShape& s = call.s;
    const HostTensor &qkv = call.qkv, &dy = call.dy, &out = call.out, &lse = call.lse, &dqkv = call.dqkv;

    std::unique_ptr<HostTensor> first;  // the one-launch staged result
    for (const Budget& budget : budgets) {
      INFO(budget.what << " (" << budget.bytes << " bytes)");
      std::unique_ptr<Backend> owned = make_cuda_backend(0);
      dynamic_cast<CudaBackend&>(*owned).set_attention_ds_budget(budget.bytes);
      Backend& be = *owned;
      DeviceTensor dpositions = DeviceTensor::of(be, call.positions), dslopes = DeviceTensor::of(be, call.slopes);
      const AttnShape sd = call.on_device(dpositions, dslopes);
      DeviceTensor dq = DeviceTensor::of(be, qkv), ddy = DeviceTensor::of(be, dy), dout = DeviceTensor::of(be, out);
      DeviceTensor dlse = DeviceTensor::of(be, lse), ddq = DeviceTensor::of(be, filled(dt, {N, s.qkv_cols()}, NAN));
      auto& cuda_be = dynamic_cast<CudaBackend&>(be);
      const size_t l2 = cuda_be.l2_bytes();
      cuda_be.set_l2_bytes(size_t{1} << 40);  // heads fastest
      be.attention_backward(ddq.t, ddy.t, dq.t, dout.t, dlse.t, sd);
      const HostTensor got = ddq.host();
      cuda_be.set_l2_bytes(0);  // tiles fastest
      ddq.upload(filled(dt, {N, s.qkv_cols()}, NAN));
      be.attention_backward(ddq.t, ddy.t, dq.t, dout.t, dlse.t, sd);
      CHECK(bits_differ(ddq.host(), got) == 0);
      if (!first) {  // the forward, once per case: both orders
        DeviceTensor o1 = DeviceTensor::of(be, filled(dt, {N, ocols}, NAN));
        DeviceTensor o2 = DeviceTensor::of(be, filled(dt, {N, ocols}, NAN));
        DeviceTensor l1 = DeviceTensor::of(be, filled(DType::F32, {s.B, s.n_heads, s.T}, NAN));
        DeviceTensor l2t = DeviceTensor::of(be, filled(DType::F32, {s.B, s.n_heads, s.T}, NAN));
        be.attention_forward(o1.t, l1.t, dq.t, sd);
        cuda_be.set_l2_bytes(size_t{1} << 40);
        be.attention_forward(o2.t, l2t.t, dq.t, sd);
        CHECK(bits_differ(o1.host(), o2.host()) == 0);
        CHECK(bits_differ(l1.host(), l2t.host()) == 0);
        KEEL_CHECK_ERR("attention_forward", std::string(dname(dt)) + " both block orders", rel_err(o1.host(), out),
                       2e-2);
      }
      cuda_be.set_l2_bytes(l2);
      const std::string what = std::string(dname(dt)) + " " + budget.what;
      for (int part = 0; part < 3; ++part)
        KEEL_CHECK_ERR(std::string("attention_backward d") + "qkv"[part], what, part_err(got, dqkv, s, part), 2e-2);
      if (!first) {
        first = std::make_unique<HostTensor>(clone(got));
        continue;
      }
      if (budget.staged) {
        CHECK(bits_differ(got, *first) == 0);
      } else {
        for (int part = 1; part < 3; ++part) CHECK(part_err(got, *first, s, part) == 0.0);
        KEEL_CHECK_ERR("attention_backward dq, recompute vs staged", what, part_err(got, *first, s, 0),
                       storage_tol(dt, 1e-5));
      }
    }
  }
}

// KEEL_ATTN_DS_MB, read when a backend is made: whole MiB, 0 turning the staging off; anything
// else is refused naming the variable and the value (before the backend takes anything).
TEST_CASE("gpu: KEEL_ATTN_DS_MB sets the attention backward's dS budget, a bad value is refused naming it",
          "[gpu][attention]") {
  KEEL_GPU_OR_SKIP();
  const ScopedEnv env("KEEL_ATTN_DS_MB");
  const auto budget_with = [&](const char* value) {
    return setting_with(env, value, [](CudaBackend& be) { return be.attention_ds_budget(); });
  };
  CHECK(budget_with(nullptr) == kDefaultAttentionDsBudget);
  CHECK(budget_with("") == kDefaultAttentionDsBudget);
  CHECK(budget_with("0") == 0);
  CHECK(budget_with("64") == size_t{64} << 20);
  for (const char* bad : {"abc", "-1", "12MB", " 8", "99999999999999999999", "16777217"}) {
    INFO("KEEL_ATTN_DS_MB=" << bad);
    CHECK_THROWS_WITH(backend_with(env, bad), Catch::Matchers::Contains("KEEL_ATTN_DS_MB must be a whole number of MiB") &&
                                          Catch::Matchers::Contains(std::string("got '") + bad + "'"));
  }
}

// KEEL_ATTN_WGMMA, read when a backend is made: unset, empty or 0 off, 1 on (where the device
// runs sm_90a code), anything else refused naming the variable and the value.
TEST_CASE("gpu: KEEL_ATTN_WGMMA turns the wgmma attention kernels on, a bad value is refused naming it",
          "[gpu][attention][wgmma]") {
  KEEL_GPU_OR_SKIP();
  const ScopedEnv env("KEEL_ATTN_WGMMA");
  const auto on_with = [&](const char* value) {
    return setting_with(env, value, [](CudaBackend& be) { return be.attention_wgmma(); });
  };
  CHECK_FALSE(on_with(nullptr));
  CHECK_FALSE(on_with(""));
  CHECK_FALSE(on_with("0"));
  CHECK(on_with("1") == cuda::wgmma_available(0));
  for (const char* bad : {"yes", "true", "2", " 1"}) {
    INFO("KEEL_ATTN_WGMMA=" << bad);
    CHECK_THROWS_WITH(backend_with(env, bad), Catch::Matchers::Contains("KEEL_ATTN_WGMMA must be 0 or 1") &&
                                          Catch::Matchers::Contains(std::string("got '") + bad + "'"));
  }
}

// Document masking: the fused kernels skip the key tiles before a query tile's first document
// and the query tiles after a key tile's last one, and mask inside tiles that a boundary
// crosses; the plain kernels start and stop their loops at the boundaries. Documents of 1 row,
// documents that end on a tile edge (64) or one row either side of it, and long ones spanning
// several tiles; every row its own document; one document per sequence (= causal). Same
// tolerances as without masking; rope bit for bit.
TEST_CASE("gpu: document-masked rope and attention match the CPU (plain and fused kernels)",
          "[gpu][attention][documents]") {
  KEEL_GPU_OR_SKIP();
  struct Case {
    AttnShape s;
    std::vector<int> lengths;
  };
  const std::vector<Case> cases = {
      {{2, 300, 4, 2, 64}, {1, 63, 64, 65, 3, 130, 7}},
      {{1, 257, 8, 2, 128}, {100, 1, 1, 40, 200}},
      {{2, 37, 4, 2, 8}, {5, 1, 20}},
      {{2, 130, 4, 1, 64}, {1}},      // every row a document of its own
      {{2, 130, 2, 2, 128}, {1000}},  // one document per sequence
  };
  for (DType dt : {DType::F32, DType::BF16, DType::F16})
    for (const Case& c : cases)
      for (int simple = 0; simple < 2; ++simple) {
        Backend& be = simple ? gpu_simple_attention() : gpu();
        const AttnShape& s0 = c.s;
        const bool fused = !simple && fused_applies(s0, dt);
        INFO(dname(dt) << " " << shape_name(s0) << " documents of " << c.lengths[0] << ", ..."
                       << (fused ? " fused" : " plain"));
        const int64_t N = static_cast<int64_t>(s0.B) * s0.T, ocols = s0.n_heads * s0.head_dim;
        HostTensor positions(DType::I32, {N});
        positions.set_i32(document_positions_of(s0.B, s0.T, c.lengths));
        DeviceTensor dpositions = DeviceTensor::of(be, positions);
        AttnShape s = s0, sd = s0;
        s.positions = positions.t;
        sd.positions = dpositions.t;
        const std::string what = std::string(dname(dt)) + (fused ? " fused" : " plain") + " documents";

        HostTensor qkv = rand_tensor(dt, {N, s.qkv_cols()}, 41, 1.5f), dy = rand_tensor(dt, {N, ocols}, 42);
        HostTensor roped = clone(qkv);
        cpu().rope_forward(roped.t, s, llama3_rope());
        DeviceTensor dq = DeviceTensor::of(be, qkv);
        be.rope_forward(dq.t, sd, llama3_rope());
        KEEL_CHECK_BITS("rope_forward", what, dq.host(), roped);

        // (the GPU's roped q and k are the CPU's bits, checked above)
        const HostTensor dqkv = check_attention_vs_cpu(be, roped, dy, s, sd, fused, what, false);
        HostTensor back = clone(dqkv);
        cpu().rope_backward(back.t, s, llama3_rope());
        DeviceTensor dback = DeviceTensor::of(be, dqkv);
        be.rope_backward(dback.t, sd, llama3_rope());
        KEEL_CHECK_BITS("rope_backward", what, dback.host(), back);
      }
}

TEST_CASE("gpu: fused attention at training lengths (T = 1024, 2048)", "[gpu][attention][long]") {
  KEEL_GPU_OR_SKIP();
  for (const AttnShape& s : {AttnShape{1, 1024, 2, 1, 128}, AttnShape{1, 2048, 2, 2, 64}}) {
    INFO(shape_name(s));
    const DType dt = DType::BF16;
    const int64_t N = static_cast<int64_t>(s.B) * s.T, ocols = s.n_heads * s.head_dim;
    HostTensor qkv = rand_tensor(dt, {N, s.qkv_cols()}, 21, 2.0f), dy = rand_tensor(dt, {N, ocols}, 22);
    check_attention_vs_cpu(gpu(), qkv, dy, s, s, true, "bf16 fused T=" + std::to_string(s.T), false);
  }
}

// With a sliding window of 7 too: the prefill of 20 and the later rows cross it.
TEST_CASE("gpu: attention_decode matches the CPU call for call, caches bit for bit", "[gpu][attention][decode][window]") {
  KEEL_GPU_OR_SKIP();
  Backend& be = gpu();
  for (int window : {0, 7})
  for (DType dt : {DType::F32, DType::BF16})
    for (const Rope& theta : {Rope(10000.0f), Rope(0.0f), llama3_rope()}) {
      INFO(dname(dt) << " rope " << theta.str() << " window " << window);
      const int nh = 4, nkv = 2, hd = 64;
      const int64_t max_len = 40, kv_cols = nkv * hd;
      HostTensor kc(dt, {max_len, kv_cols}), vc(dt, {max_len, kv_cols});
      DeviceTensor dkc(be, kc.t), dvc(be, vc.t);
      int64_t pos = 0;
      uint32_t seed = 30;
      for (int n : {20, 1, 1, 5, 13}) {
        INFO("pos " << pos << " n " << n);
        const AttnShape s{1, n, nh, nkv, hd, {}, {}, window};
        HostTensor qkv = rand_tensor(dt, {n, s.qkv_cols()}, ++seed);
        HostTensor out = filled(dt, {n, nh * hd}, NAN);
        DeviceTensor dq = DeviceTensor::of(be, qkv), dout = DeviceTensor::of(be, out);
        cpu().attention_decode(out.t, qkv.t, kc.t, vc.t, s, pos, theta);
        be.attention_decode(dout.t, dq.t, dkc.t, dvc.t, s, pos, theta);
        KEEL_CHECK_ERR("attention_decode out", dname(dt), rel_err(dout.host(), out), storage_tol(dt, 1e-5));
        KEEL_CHECK_BITS("attention_decode qkv (RoPE in place)", dname(dt), dq.host(), qkv);
        KEEL_CHECK_BITS("attention_decode k cache", dname(dt), dkc.host(), kc);
        KEEL_CHECK_BITS("attention_decode v cache", dname(dt), dvc.host(), vc);
        pos += n;
      }
    }
}

// ALiBi: S_ij += m_h (j - i) before the softmax, on the plain kernels (f32, head sizes above 160,
// KEEL_ATTENTION=simple) and the fused ones (bf16/f16, head_dim up to 160): the forward (out and
// lse, which includes the bias) and the backward (the recomputed P includes the bias; the GPU
// gets the CPU's forward results). Slopes of a power-of-two head count, and
// 6 heads sliced from a 12-head model at offset 6 (a tensor-parallel rank: slopes 2^-7, 2^-8,
// then the interleaved 2^-0.5 .. 2^-3.5), with GQA, MQA and document masking. Same tolerances as
// without ALiBi; each call again gives the same bits.
TEST_CASE("gpu: ALiBi attention forward and backward match the CPU (plain and fused kernels)",
          "[gpu][attention][alibi]") {
  KEEL_GPU_OR_SKIP();
  struct Case {
    AttnShape s;
    int total_heads, head_offset;  // slopes: alibi_slopes(total_heads)[head_offset, + n_heads)
    std::vector<int> lengths;      // document lengths; empty: one sequence, plain causal
  };
  const std::vector<Case> cases = {
      {{2, 37, 4, 2, 8}, 4, 0, {}},                              // tiny heads, padded to 64
      {{2, 100, 4, 2, 64}, 4, 0, {}},                            // GQA, T not a multiple of the tiles
      {{1, 257, 8, 2, 128}, 8, 0, {}},                           // group of 4, ragged last tile
      {{3, 33, 4, 1, 128}, 4, 0, {}},                            // multi-query
      {{1, 1, 2, 1, 64}, 2, 0, {}},                              // a single position (bias 0)
      {{2, 130, 6, 2, 64}, 12, 6, {}},                           // 6 heads of 12 (TP rank 1 of 2), group 3
      {{2, 50, 6, 3, 32}, 6, 0, {}},                             // 6 heads (non-power-of-two), hd 32 padded
      {{2, 300, 4, 2, 64}, 4, 0, {1, 63, 64, 65, 3, 130, 7}},    // documents on and beside tile edges
      {{1, 257, 6, 2, 128}, 12, 6, {100, 1, 1, 40, 200}},        // documents, TP slice, group 3
      {{2, 130, 4, 1, 64}, 4, 0, {1}},                           // every row a document of its own
      {{1, 150, 4, 4, 145}, 80, 8, {60, 90}},                    // BLOOM-104B's heads (TP slice), padded to 160
  };
  for (DType dt : {DType::F32, DType::BF16, DType::F16})
    for (const Case& c : cases)
      for (int simple = 0; simple < 2; ++simple) {
        Backend& be = simple ? gpu_simple_attention() : gpu();
        const AttnShape& s0 = c.s;
        const bool fused = !simple && fused_applies(s0, dt);
        INFO(dname(dt) << " " << shape_name(s0) << " alibi_slopes(" << c.total_heads << ")[" << c.head_offset
                       << ", ...)" << (c.lengths.empty() ? "" : " documents") << (fused ? " fused" : " plain"));
        const int64_t N = static_cast<int64_t>(s0.B) * s0.T, ocols = s0.n_heads * s0.head_dim;
        const HostTensor slopes = alibi_host(c.total_heads, c.head_offset, s0.n_heads);
        DeviceTensor dslopes = DeviceTensor::of(be, slopes);
        HostTensor positions(DType::I32, {N});
        if (!c.lengths.empty()) positions.set_i32(document_positions_of(s0.B, s0.T, c.lengths));
        DeviceTensor dpositions = DeviceTensor::of(be, positions);
        AttnShape s = s0, sd = s0;  // host and device views of the same call
        s.alibi_slopes = slopes.t;
        sd.alibi_slopes = dslopes.t;
        if (!c.lengths.empty()) {
          s.positions = positions.t;
          sd.positions = dpositions.t;
        }
        const std::string what = std::string(dname(dt)) + (fused ? " fused" : " plain") + " alibi" +
                                 (c.lengths.empty() ? "" : " documents");

        HostTensor qkv = rand_tensor(dt, {N, s.qkv_cols()}, 51, 1.5f), dy = rand_tensor(dt, {N, ocols}, 52);
        check_attention_vs_cpu(be, qkv, dy, s, sd, fused, what, true);
      }
}

// Sliding windows (AttnShape::window, Mistral): within one tile, exactly one tile, across tile
// edges, of one key, longer than T (= causal), with documents and with ALiBi; plain and fused
// kernels, and a training length. Same tolerances as plain causal attention; each call again
// gives the same bits. (Decoding with a window: the attention_decode test.)
TEST_CASE("gpu: sliding-window attention matches the CPU (plain and fused kernels)", "[gpu][attention][window]") {
  KEEL_GPU_OR_SKIP();
  struct Case {
    AttnShape s;
    int window;
    std::vector<int> lengths;  // documents; empty: none
    bool alibi;
  };
  const std::vector<Case> cases = {
      {{2, 200, 4, 2, 64}, 16, {}, false},  {{2, 200, 2, 1, 64}, 64, {}, false},
      {{1, 257, 8, 2, 128}, 100, {}, false}, {{2, 70, 2, 1, 64}, 1, {}, false},
      {{2, 37, 4, 2, 8}, 5, {}, false},      {{2, 100, 4, 2, 64}, 1000, {}, false},
      {{2, 300, 4, 2, 64}, 40, {1, 63, 64, 65, 3, 130, 7}, false},
      {{2, 130, 4, 2, 64}, 50, {}, true},    {{1, 2048, 2, 1, 128}, 512, {}, false},
  };
  for (DType dt : {DType::F32, DType::BF16})
    for (const Case& c : cases)
      for (int simple = 0; simple < 2; ++simple) {
        Backend& be = simple ? gpu_simple_attention() : gpu();
        AttnShape s0 = c.s;
        s0.window = c.window;
        if (s0.T > 1000 && (simple || dt == DType::F32)) continue;  // the long case on the fused kernels only
        const bool fused = !simple && fused_applies(s0, dt);
        const std::string what = std::string(dname(dt)) + (fused ? " fused" : " plain") + " window " +
                                 std::to_string(c.window) + (c.lengths.empty() ? "" : " documents") +
                                 (c.alibi ? " alibi" : "");
        INFO(shape_name(s0) << " " << what);
        const int64_t N = static_cast<int64_t>(s0.B) * s0.T, ocols = s0.n_heads * s0.head_dim;
        HostTensor positions(DType::I32, {N});
        if (!c.lengths.empty()) positions.set_i32(document_positions_of(s0.B, s0.T, c.lengths));
        const HostTensor slopes = alibi_host(s0.n_heads, 0, s0.n_heads);
        DeviceTensor dpositions = DeviceTensor::of(be, positions), dslopes = DeviceTensor::of(be, slopes);
        AttnShape s = s0, sd = s0;
        if (!c.lengths.empty()) {
          s.positions = positions.t;
          sd.positions = dpositions.t;
        }
        if (c.alibi) {
          s.alibi_slopes = slopes.t;
          sd.alibi_slopes = dslopes.t;
        }
        HostTensor qkv = rand_tensor(dt, {N, s.qkv_cols()}, 71, 1.5f), dy = rand_tensor(dt, {N, ocols}, 72);
        check_attention_vs_cpu(be, qkv, dy, s, sd, fused, what, s0.T < 1000);
      }

}

// ALiBi at a training length: the bias reaches -m_h (T - 1) ~ -512 on the steepest head (slope
// 1/4), where most of a row's keys underflow to P = 0, while the weakest (1/256) still sees all.
TEST_CASE("gpu: fused ALiBi attention at a training length (T = 2048)", "[gpu][attention][alibi][long]") {
  KEEL_GPU_OR_SKIP();
  Backend& be = gpu();
  AttnShape s{1, 2048, 4, 2, 64};
  const DType dt = DType::BF16;
  const int64_t N = static_cast<int64_t>(s.B) * s.T, ocols = s.n_heads * s.head_dim;
  const HostTensor slopes = alibi_host(s.n_heads, 0, s.n_heads);
  DeviceTensor dslopes = DeviceTensor::of(be, slopes);
  AttnShape sd = s;
  s.alibi_slopes = slopes.t;
  sd.alibi_slopes = dslopes.t;
  HostTensor qkv = rand_tensor(dt, {N, s.qkv_cols()}, 61, 2.0f), dy = rand_tensor(dt, {N, ocols}, 62);
  check_attention_vs_cpu(be, qkv, dy, s, sd, true, "bf16 fused alibi T=2048", false);
}

// ALiBi in generation: new row r at absolute position pos + r gets m_h (j - (pos + r)). The GPU
// matches the CPU call for call (caches bit for bit), and the decoded rows match attention over
// the whole sequence at once (rope_forward + attention_forward): on the CPU within the storage
// bound, and on the GPU (the fused kernels for bf16) within the fused forward's bound.
TEST_CASE("gpu: ALiBi attention_decode matches the CPU and full attention row for row",
          "[gpu][attention][decode][alibi]") {
  KEEL_GPU_OR_SKIP();
  Backend& be = gpu();
  struct Heads {
    int nh, nkv, total, offset;
  };
  for (DType dt : {DType::F32, DType::BF16})
    for (const Heads& hs : {Heads{4, 2, 4, 0}, Heads{6, 2, 12, 6}})
      for (const Rope& theta : {Rope(0.0f), Rope(10000.0f)}) {
        const int nh = hs.nh, nkv = hs.nkv, hd = 64;
        const int64_t L = 40, kv_cols = nkv * hd, ocols = nh * hd;
        const std::string what = std::string(dname(dt)) + " alibi nh=" + std::to_string(nh) + " rope " + theta.str();
        INFO(what);
        const HostTensor slopes = alibi_host(hs.total, hs.offset, nh);
        DeviceTensor dslopes = DeviceTensor::of(be, slopes);
        AttnShape sf{1, static_cast<int>(L), nh, nkv, hd};  // the whole sequence
        sf.alibi_slopes = slopes.t;
        const HostTensor full = rand_tensor(dt, {L, sf.qkv_cols()}, 71);
        HostTensor kc(dt, {L, kv_cols}), vc(dt, {L, kv_cols});
        DeviceTensor dkc(be, kc.t), dvc(be, vc.t);
        HostTensor decoded = filled(dt, {L, ocols}, NAN);  // the GPU's decoded rows, in order
        int64_t pos = 0;
        for (int n : {20, 1, 1, 5, 13}) {
          INFO("pos " << pos << " n " << n);
          AttnShape s{1, n, nh, nkv, hd}, sd = s;
          s.alibi_slopes = slopes.t;
          sd.alibi_slopes = dslopes.t;
          HostTensor qkv = rows_of(full, pos, pos + n);
          HostTensor out = filled(dt, {n, ocols}, NAN);
          DeviceTensor dq = DeviceTensor::of(be, qkv), dout = DeviceTensor::of(be, out);
          cpu().attention_decode(out.t, qkv.t, kc.t, vc.t, s, pos, theta);
          be.attention_decode(dout.t, dq.t, dkc.t, dvc.t, sd, pos, theta);
          const HostTensor got = dout.host();
          KEEL_CHECK_ERR("attention_decode out", what, rel_err(got, out), storage_tol(dt, 1e-5));
          KEEL_CHECK_BITS("attention_decode qkv (RoPE in place)", what, dq.host(), qkv);
          KEEL_CHECK_BITS("attention_decode k cache", what, dkc.host(), kc);
          KEEL_CHECK_BITS("attention_decode v cache", what, dvc.host(), vc);
          for (int64_t i = 0; i < n * ocols; ++i) decoded.put(pos * ocols + i, got.at(i));
          pos += n;
        }
        // the whole sequence at once, positions 0 .. L-1
        HostTensor roped = clone(full);
        if (theta.rotates()) cpu().rope_forward(roped.t, sf, theta);
        HostTensor out(dt, {L, ocols}), lse(DType::F32, {1, nh, L});
        cpu().attention_forward(out.t, lse.t, roped.t, sf);
        KEEL_CHECK_ERR("attention_decode vs attention_forward rows (CPU)", what, rel_err(decoded, out),
                       storage_tol(dt, 1e-5));
        AttnShape sfd = sf;
        sfd.alibi_slopes = dslopes.t;
        DeviceTensor dfull = DeviceTensor::of(be, full);
        if (theta.rotates()) be.rope_forward(dfull.t, sfd, theta);
        DeviceTensor dout = DeviceTensor::of(be, filled(dt, {L, ocols}, NAN));
        DeviceTensor dlse = DeviceTensor::of(be, filled(DType::F32, {1, nh, L}, NAN));
        be.attention_forward(dout.t, dlse.t, dfull.t, sfd);
        const bool fused = fused_applies(sf, dt);
        KEEL_CHECK_ERR("attention_decode vs attention_forward rows (GPU)", what + (fused ? " fused" : " plain"),
                       rel_err(decoded, dout.host()), fused ? 1e-2 : storage_tol(dt, 1e-5));
      }
}

TEST_CASE("gpu: attention ops reject malformed ALiBi slopes naming the op and the shapes",
          "[gpu][attention][alibi][errors]") {
  KEEL_GPU_OR_SKIP();
  Backend& be = gpu();
  using Catch::Contains;
  const AttnShape s0{1, 4, 4, 2, 8};
  DeviceTensor qkv(be, HostTensor(DType::F32, {4, 64}).t), dqkv(be, HostTensor(DType::F32, {4, 64}).t);
  DeviceTensor o(be, HostTensor(DType::F32, {4, 32}).t), lse(be, HostTensor(DType::F32, {1, 4, 4}).t);
  DeviceTensor kc(be, HostTensor(DType::F32, {8, 16}).t), vc(be, HostTensor(DType::F32, {8, 16}).t);
  DeviceTensor three(be, HostTensor(DType::F32, {3}).t), half(be, HostTensor(DType::BF16, {4}).t);
  HostTensor host(DType::F32, {4});
  AttnShape s = s0;
  s.alibi_slopes = three.t;  // one slope short
  CHECK_THROWS_AS(be.attention_forward(o.t, lse.t, qkv.t, s), std::invalid_argument);
  CHECK_THROWS_WITH(be.attention_forward(o.t, lse.t, qkv.t, s),
                    Contains("CudaBackend::attention_forward") && Contains("alibi_slopes=[3] f32") &&
                        Contains("n_heads=4"));
  CHECK_THROWS_WITH(be.attention_backward(dqkv.t, o.t, qkv.t, o.t, lse.t, s),
                    Contains("CudaBackend::attention_backward") && Contains("alibi_slopes=[3] f32"));
  CHECK_THROWS_WITH(be.attention_decode(o.t, qkv.t, kc.t, vc.t, s, 0, Rope(0.0f)),
                    Contains("CudaBackend::attention_decode") && Contains("alibi_slopes=[3] f32"));
  s.alibi_slopes = half.t;  // not f32
  CHECK_THROWS_WITH(be.attention_forward(o.t, lse.t, qkv.t, s),
                    Contains("attention_forward") && Contains("alibi_slopes must be f32"));
  s.alibi_slopes = host.t;  // not on the GPU
  CHECK_THROWS_WITH(be.attention_forward(o.t, lse.t, qkv.t, s),
                    Contains("attention_forward") && Contains("alibi_slopes is not a CUDA tensor"));
}

// The warpgroup products the wgmma dk-dv kernel is built from (kernels/cuda/wgmma.cuh), one
// [64 x 64] x [64 x N] product per operand form, against a float64 product of the same 16-bit
// values: A from shared memory or registers, B K-major or N-major, N 32, 64 and 128, bf16 and
// f16. The products of two 16-bit values are exact in fp32 and each sum has 64 terms, so an
// error beyond fp32 accumulation (about 1e-7 relative here) is a wrong element: a layout or
// descriptor mistake gives errors of order 1. Bound 1e-5. Only where the device runs sm_90a
// code (an H100, or the emulator).
TEST_CASE("gpu: wgmma tile products match the CPU (shared-memory layouts, descriptors, fragments)",
          "[gpu][attention][wgmma]") {
  KEEL_GPU_OR_SKIP();
  auto& be = dynamic_cast<CudaBackend&>(gpu());
  if (!cuda::wgmma_available(be.device_index())) {
    WARN("skipped: this device does not run keel's sm_90a code (wgmma)");
    return;
  }
  for (DType dt : {DType::BF16, DType::F16})
    for (int n : {32, 64, 128})
      for (int regs = 0; regs < 2; ++regs)
        for (int n_major = 0; n_major < 2; ++n_major) {
          const std::string what = std::string(dname(dt)) + " N " + std::to_string(n) +
                                   (regs ? " A in registers" : " A in shared memory") +
                                   (n_major ? ", B N-major" : ", B K-major");
          INFO(what);
          const HostTensor a = rand_tensor(dt, {64, 64}, 91);
          const HostTensor b = n_major ? rand_tensor(dt, {64, n}, 92) : rand_tensor(dt, {n, 64}, 92);
          HostTensor ref(DType::F32, {64, n});
          for (int i = 0; i < 64; ++i)
            for (int j = 0; j < n; ++j) {
              double sum = 0;
              for (int k = 0; k < 64; ++k) sum += static_cast<double>(a.at(i * 64 + k)) * b.at(n_major ? k * n + j : j * 64 + k);
              ref.put(i * n + j, static_cast<float>(sum));
            }
          DeviceTensor da = DeviceTensor::of(be, a), db = DeviceTensor::of(be, b);
          DeviceTensor dc = DeviceTensor::of(be, filled(DType::F32, {64, n}, NAN));
          cuda::wgmma_tile_product(be, dc.t, da.t, db.t, regs != 0, n_major != 0);
          KEEL_CHECK_ERR("wgmma_tile_product", what, rel_err(dc.host(), ref), 1e-5);
        }
}

// The fused forward and the backward's dk-dv kernel on wgmma (CudaBackend::set_attention_wgmma,
// KEEL_ATTN_WGMMA=1) against the CPU and against the mma.sync kernels on the same backend:
//   - out and lse against the CPU within the fused bounds 1e-2 and 1e-5; dq, dk, dv within 2e-2
//     (zero_ref_bound where a reference part is zero), staged and recomputing dq alike;
//   - against the mma.sync kernels: out, dq, dk, dv within the storage tolerance (bf16 4e-3,
//     f16 1e-3), lse within 1e-5: both sum the same products in fp32, in other orders on the
//     GPU, and round P and dS to the storage type, where a last-bit difference may flip a
//     rounding (the emulator sums in one order: identical there);
//   - a second call gives the same bits.
// Shapes: the fused ones of kShapes (GQA, ragged tiles, T = 1, one tile, multi-query, head_dim
// 64 and 128) and, with documents, a sliding window and ALiBi, those of the staged-dS test.
TEST_CASE("gpu: the wgmma attention kernels match the CPU and the mma.sync kernels", "[gpu][attention][wgmma]") {
  KEEL_GPU_OR_SKIP();
  if (!cuda::wgmma_available(dynamic_cast<CudaBackend&>(gpu()).device_index())) {
    WARN("skipped: this device does not run keel's sm_90a code (wgmma)");
    return;
  }
  struct Case {
    AttnShape s;
    DType dt;
    std::vector<int> lengths;  // documents; empty: none
    bool alibi;
  };
  std::vector<Case> cases;
  for (const AttnShape& s : kShapes)
    if (s.head_dim == 64 || s.head_dim == 128) cases.push_back({s, DType::BF16, {}, false});  // wgmma's widths
  AttnShape windowed{2, 200, 4, 2, 128};
  windowed.window = 50;
  cases.push_back({{3, 130, 6, 3, 64}, DType::F16, {}, false});
  cases.push_back({windowed, DType::F16, {1, 63, 64, 65, 7}, true});
  cases.push_back({{1, 257, 8, 2, 64}, DType::BF16, {100, 1, 1, 40, 200}, false});
  for (const Case& c : cases) {
    const AttnShape& s0 = c.s;
    const DType dt = c.dt;
    INFO(shape_name(s0) << " window " << s0.window << " " << dname(dt) << (c.lengths.empty() ? "" : " documents")
                        << (c.alibi ? " alibi" : ""));
    const int64_t N = static_cast<int64_t>(s0.B) * s0.T, ocols = s0.n_heads * s0.head_dim;
    const MaskedCall call(s0, dt, c.lengths, c.alibi, 95);
    const AttnShape& s = call.s;
    const HostTensor &qkv = call.qkv, &dy = call.dy, &out = call.out, &lse = call.lse, &dqkv = call.dqkv;

    for (const bool staged : {true, false}) {
      std::unique_ptr<Backend> owned = make_cuda_backend(0);
      auto& be = dynamic_cast<CudaBackend&>(*owned);
      if (!staged) be.set_attention_ds_budget(0);
      const std::string what = std::string(dname(dt)) + (staged ? " wgmma dk-dv, staged dq" : " wgmma dk-dv, recomputed dq");
      DeviceTensor dpositions = DeviceTensor::of(be, call.positions), dslopes = DeviceTensor::of(be, call.slopes);
      const AttnShape sd = call.on_device(dpositions, dslopes);
      DeviceTensor dq = DeviceTensor::of(be, qkv), ddy = DeviceTensor::of(be, dy);
      if (staged) {  // the forward, once per case
        DeviceTensor o = DeviceTensor::of(be, filled(dt, {N, ocols}, NAN));
        DeviceTensor l = DeviceTensor::of(be, filled(DType::F32, {s.B, s.n_heads, s.T}, NAN));
        be.set_attention_wgmma(false);
        be.attention_forward(o.t, l.t, dq.t, sd);
        const HostTensor mma_out = o.host(), mma_lse = l.host();
        be.set_attention_wgmma(true);
        be.attention_forward(o.t, l.t, dq.t, sd);
        const HostTensor got_out = o.host(), got_lse = l.host();
        const std::string fwd = std::string(dname(dt)) + " wgmma";
        KEEL_CHECK_ERR("attention_forward out", fwd, rel_err(got_out, out), 1e-2);
        KEEL_CHECK_ERR("attention_forward lse", fwd, rel_err(got_lse, lse), 1e-5);
        KEEL_CHECK_ERR("attention_forward out, wgmma vs mma.sync", fwd, rel_err(got_out, mma_out), storage_tol(dt, 1e-5));
        KEEL_CHECK_ERR("attention_forward lse, wgmma vs mma.sync", fwd, rel_err(got_lse, mma_lse), 1e-5);
        be.attention_forward(o.t, l.t, dq.t, sd);
        CHECK(bits_differ(o.host(), got_out) == 0);
        CHECK(bits_differ(l.host(), got_lse) == 0);
      }
      DeviceTensor dout = DeviceTensor::of(be, out), dlse = DeviceTensor::of(be, lse);
      DeviceTensor ddq = DeviceTensor::of(be, filled(dt, {N, s.qkv_cols()}, NAN));
      be.set_attention_wgmma(false);
      be.attention_backward(ddq.t, ddy.t, dq.t, dout.t, dlse.t, sd);
      const HostTensor mma = ddq.host();
      be.set_attention_wgmma(true);
      ddq.upload(filled(dt, {N, s.qkv_cols()}, NAN));
      be.attention_backward(ddq.t, ddy.t, dq.t, dout.t, dlse.t, sd);
      const HostTensor got = ddq.host();
      for (int part = 0; part < 3; ++part) {
        bool zero = false;
        const double e = part_err(got, dqkv, s, part, &zero);
        const std::string name = std::string("attention_backward d") + "qkv"[part];
        KEEL_CHECK_ERR(name, what + (zero ? " (abs, zero ref)" : ""), e, part_tol(2e-2, zero, qkv, dy, s, part));
        bool mma_zero = false;
        const double vs_mma = part_err(got, mma, s, part, &mma_zero);
        KEEL_CHECK_ERR(name + ", wgmma vs mma.sync", what + (mma_zero ? " (abs, zero ref)" : ""), vs_mma,
                       mma_zero ? 2 * zero_ref_bound(qkv, dy, s, part) : storage_tol(dt, 1e-5));
      }
      ddq.upload(filled(dt, {N, s.qkv_cols()}, NAN));
      be.attention_backward(ddq.t, ddy.t, dq.t, dout.t, dlse.t, sd);
      CHECK(bits_differ(ddq.host(), got) == 0);
    }
  }
}

// ---- cuDNN attention (KEEL_ATTENTION=cudnn, kernels/cuda/attention_cudnn.h) ----

namespace {

// attention_forward and attention_backward of `be` and of gpu() (keel's fused kernels) on the
// same random bf16 inputs of shape s: every output bit for bit the same.
void check_runs_fused_kernels(Backend& be, const AttnShape& s, uint32_t seed) {
  const int64_t n = static_cast<int64_t>(s.B) * s.T, oc = s.n_heads * s.head_dim;
  HostTensor qkv = rand_tensor(DType::BF16, {n, s.qkv_cols()}, seed, 1.5f), dy = rand_tensor(DType::BF16, {n, oc}, seed + 1);
  std::vector<HostTensor> results;
  for (Backend* b : {&be, &gpu()}) {
    DeviceTensor dq = DeviceTensor::of(*b, qkv), ddy = DeviceTensor::of(*b, dy);
    DeviceTensor out = DeviceTensor::of(*b, filled(DType::BF16, {n, oc}, NAN));
    DeviceTensor lse = DeviceTensor::of(*b, filled(DType::F32, {s.B, s.n_heads, s.T}, NAN));
    DeviceTensor ddq = DeviceTensor::of(*b, filled(DType::BF16, {n, s.qkv_cols()}, NAN));
    b->attention_forward(out.t, lse.t, dq.t, s);
    b->attention_backward(ddq.t, ddy.t, dq.t, out.t, lse.t, s);
    results.push_back(out.host());
    results.push_back(lse.host());
    results.push_back(ddq.host());
  }
  for (int i = 0; i < 3; ++i) CHECK(bits_differ(results[i], results[i + 3]) == 0);
}

}  // namespace

// KEEL_ATTENTION, read when a backend is made: unset, empty or "fused" keel's fused kernels,
// "simple" the plain ones, "cudnn" cuDNN where it takes a call; anything else refused naming the
// variable, its values and the value given.
TEST_CASE("gpu: KEEL_ATTENTION picks the attention kernels, a bad value is refused naming the choices",
          "[gpu][attention][cudnn]") {
  KEEL_GPU_OR_SKIP();
  const ScopedEnv env("KEEL_ATTENTION");
  const auto simple_with = [&](const char* value) {
    return setting_with(env, value, [](CudaBackend& be) { return be.simple_attention(); });
  };
  const auto cudnn_with = [&](const char* value) {
    return setting_with(env, value, [](CudaBackend& be) { return be.cudnn_attention() != nullptr; });
  };
  for (const char* fused : {static_cast<const char*>(nullptr), "", "fused"}) {
    INFO("KEEL_ATTENTION=" << (fused ? fused : "(unset)"));
    CHECK_FALSE(simple_with(fused));
    CHECK_FALSE(cudnn_with(fused));
  }
  CHECK(simple_with("simple"));
  CHECK_FALSE(cudnn_with("simple"));
  CHECK_FALSE(simple_with("cudnn"));
  if (cudnn_required()) CHECK(cudnn_with("cudnn"));
  for (const char* bad : {"flash", "CUDNN", " simple", "cudnn ", "1"}) {
    INFO("KEEL_ATTENTION=" << bad);
    CHECK_THROWS_WITH(backend_with(env, bad), Catch::Matchers::Contains("KEEL_ATTENTION must be fused") &&
                                                  Catch::Matchers::Contains("simple") &&
                                                  Catch::Matchers::Contains("cudnn") &&
                                                  Catch::Matchers::Contains(std::string("got '") + bad + "'"));
  }
}

// What keel gives cuDNN (no device needed): bf16 and fp16 causal calls with GQA and windows, head
// dims that are multiples of 8 up to 256; the rest is refused with the reason.
TEST_CASE("gpu: cuDNN attention is given bf16/fp16 causal calls and refuses the rest naming why",
          "[gpu][attention][cudnn]") {
  using Catch::Matchers::Contains;
  AttnShape s{2, 100, 4, 2, 64};
  for (DType dt : {DType::BF16, DType::F16}) CHECK(cuda::cudnn_attention_refusal(s, dt, dt).empty());
  s.window = 16;
  CHECK(cuda::cudnn_attention_refusal(s, DType::BF16, DType::BF16).empty());
  for (int hd : {8, 128, 256}) {
    AttnShape h{1, 10, 2, 1, hd};
    CHECK(cuda::cudnn_attention_refusal(h, DType::BF16, DType::BF16).empty());
  }
  CHECK_THAT(cuda::cudnn_attention_refusal(s, DType::F32, DType::F32), Contains("fp32"));
  CHECK_THAT(cuda::cudnn_attention_refusal(s, DType::BF16, DType::F16), Contains("different dtypes"));
  HostTensor positions(DType::I32, {200}), slopes(DType::F32, {4});
  AttnShape docs = s, alibi = s;
  docs.positions = positions.t;
  alibi.alibi_slopes = slopes.t;
  CHECK_THAT(cuda::cudnn_attention_refusal(docs, DType::BF16, DType::BF16), Contains("document masking"));
  CHECK_THAT(cuda::cudnn_attention_refusal(alibi, DType::BF16, DType::BF16), Contains("ALiBi"));
  for (int hd : {29, 36, 145, 264}) {
    AttnShape h{1, 10, 2, 1, hd};
    CHECK_THAT(cuda::cudnn_attention_refusal(h, DType::BF16, DType::BF16),
               Contains("head_dim " + std::to_string(hd)) && Contains("multiples of 8 up to 256"));
  }
  // (KEEL_CUDNN_WORKSPACE_MB's values: test_kernels "[attention][settings]")
}

// cuDNN's SDPA graphs against the CPU at the fused kernels' bounds (out 1e-2, lse 1e-5, dq/dk/dv
// 2e-2: cuDNN too rounds P and dS to the storage type before their second products), each call
// again bit for bit (the backward asks for cuDNN's deterministic algorithm). The lse check also
// pins down that cuDNN's statistics are keel's natural-log log-sum-exp. The core training shapes
// (head_dim 64 and 128, causal or windowed) must be taken by cuDNN: each takes 4 cuDNN calls
// (forward and backward, twice). Calls it is not given (fp32, ALiBi, documents) run keel's
// kernels at their own bounds with no cuDNN call. Without cuDNN (the emulator, or no library)
// every call must be keel's fused kernels' bit for bit; with KEEL_REQUIRE_CUDNN=1 that fails.
TEST_CASE("gpu: cuDNN attention matches the CPU and repeats bit for bit, what it is not given runs keel's kernels",
          "[gpu][attention][cudnn]") {
  KEEL_GPU_OR_SKIP();
  Backend& be = gpu_cudnn_attention();
  auto& cb = dynamic_cast<CudaBackend&>(be);
  if (!cb.cudnn_attention()) {
    if (cudnn_required()) FAIL("KEEL_REQUIRE_CUDNN is set but cuDNN did not load (its reason is on stderr)");
    WARN("no cuDNN here: checking that KEEL_ATTENTION=cudnn runs keel's fused kernels");
    check_runs_fused_kernels(be, AttnShape{2, 100, 4, 2, 64}, 81);
    CHECK(cb.cudnn_attention_calls() == 0);
    return;
  }
  struct Case {
    AttnShape s;
    bool must_take;  // a core training shape: cuDNN must run it
  };
  const auto windowed = [](AttnShape s, int w) {
    s.window = w;
    return s;
  };
  const std::vector<Case> cases = {
      {{2, 100, 4, 2, 64}, true},                    // GQA, T not a multiple of any tile
      {{1, 257, 8, 2, 128}, true},                   // group of 4
      {{2, 64, 2, 2, 64}, true},                     // MHA
      {{3, 33, 4, 1, 128}, true},                    // multi-query
      {{1, 1, 2, 1, 64}, false},                     // a single position
      {{2, 50, 4, 2, 32}, false},                    // the tiny configs' heads
      {{2, 70, 4, 2, 80}, false},                    // head_dim 80
      {{2, 37, 4, 2, 8}, false},                     // head_dim 8
      {{1, 130, 2, 1, 256}, false},                  // the widest cuDNN may take
      {windowed({2, 200, 4, 2, 64}, 16), true},      // sliding windows: within a tile,
      {windowed({1, 257, 8, 2, 128}, 100), true},    // across tiles,
      {windowed({2, 100, 4, 2, 64}, 1000), true},    // longer than T (= causal),
      {windowed({2, 70, 2, 1, 64}, 1), false},       // one key
      {{1, 2048, 4, 1, 128}, true},                  // a training length
      {windowed({1, 2048, 2, 1, 128}, 512), true},
  };
  for (DType dt : {DType::BF16, DType::F16})
    for (const Case& c : cases) {
      const AttnShape& s = c.s;
      if (s.T > 1000 && dt == DType::F16) continue;  // the long cases once
      const std::string what = std::string(dname(dt)) + " cudnn" + (s.window ? " window" : "");
      INFO(shape_name(s) << " window " << s.window << " " << what);
      const int64_t N = static_cast<int64_t>(s.B) * s.T, ocols = s.n_heads * s.head_dim;
      HostTensor qkv = rand_tensor(dt, {N, s.qkv_cols()}, 83, 1.5f), dy = rand_tensor(dt, {N, ocols}, 84);
      const int64_t before = cb.cudnn_attention_calls();
      check_attention_vs_cpu(be, qkv, dy, s, s, true, what, true);
      const int64_t taken = cb.cudnn_attention_calls() - before;
      if (c.must_take) CHECK(taken == 4);
      else CHECK((taken == 0 || taken == 4));  // cuDNN's graph build decides; keel's kernels otherwise
      if (!c.must_take) WARN(shape_name(s) << " window " << s.window << " " << dname(dt) << ": cuDNN "
                                           << (taken ? "took it" : "refused it (keel's kernels ran)"));
    }
  // Not given to cuDNN: fp32, ALiBi, documents.
  const AttnShape s0{2, 130, 4, 2, 64};
  const int64_t N = static_cast<int64_t>(s0.B) * s0.T, ocols = s0.n_heads * s0.head_dim;
  const HostTensor slopes = alibi_host(s0.n_heads, 0, s0.n_heads);
  HostTensor positions(DType::I32, {N});
  positions.set_i32(document_positions_of(s0.B, s0.T, {1, 63, 64, 2}));
  DeviceTensor dslopes = DeviceTensor::of(be, slopes), dpositions = DeviceTensor::of(be, positions);
  // A workspace cap of 0 (KEEL_CUDNN_WORKSPACE_MB=0): no graph fits (the deterministic backward
  // stages dP), so keel's fused kernels run every call, bit for bit as without cuDNN.
  {
    const ScopedEnv cap("KEEL_CUDNN_WORKSPACE_MB");
    cap.set("0");
    const std::unique_ptr<Backend> capped = backend_with(ScopedEnv("KEEL_ATTENTION"), "cudnn");
    auto& cc = dynamic_cast<CudaBackend&>(*capped);
    REQUIRE(cc.cudnn_attention() != nullptr);
    check_runs_fused_kernels(*capped, AttnShape{2, 100, 4, 2, 64}, 87);
    CHECK(cc.cudnn_attention_calls() == 0);
  }
  for (int which = 0; which < 3; ++which) {
    const DType dt = which == 0 ? DType::F32 : DType::BF16;
    AttnShape s = s0, sd = s0;
    if (which == 1) s.alibi_slopes = slopes.t, sd.alibi_slopes = dslopes.t;
    if (which == 2) s.positions = positions.t, sd.positions = dpositions.t;
    const std::string what = std::string(dname(dt)) + (which == 0 ? " plain" : which == 1 ? " fused alibi" : " fused documents");
    INFO(what << ", not given to cuDNN");
    HostTensor qkv = rand_tensor(dt, {N, s.qkv_cols()}, 85, 1.5f), dy = rand_tensor(dt, {N, ocols}, 86);
    const int64_t before = cb.cudnn_attention_calls();
    check_attention_vs_cpu(be, qkv, dy, s, sd, which != 0, what, false);
    CHECK(cb.cudnn_attention_calls() == before);
  }
}

// The graphs keel gives cuDNN pass the cuDNN frontend's own checks for an H100 (sm 90) and an
// A100 (sm 80), with no device (so on machines without a GPU too, wherever libcudnn.so.9 loads):
// the shapes the GPU test above requires cuDNN to take, in bf16 and fp16. Without cuDNN it says
// why; with KEEL_REQUIRE_CUDNN=1 that fails.
TEST_CASE("gpu: cuDNN's frontend accepts keel's attention graphs for sm_90 and sm_80 (no device needed)",
          "[gpu][attention][cudnn]") {
  const AttnShape probe{2, 100, 4, 2, 64};
  const std::string loaded = cuda::cudnn_attention_check_graphs(probe, DType::BF16, 90);
  if (loaded.rfind("no cuDNN", 0) == 0) {
    if (cudnn_required()) FAIL(loaded);
    WARN("skipped: " << loaded);
    return;
  }
  const auto windowed = [](AttnShape s, int w) {
    s.window = w;
    return s;
  };
  for (int sm : {90, 80})
    for (DType dt : {DType::BF16, DType::F16})
      for (const AttnShape& s : {AttnShape{2, 100, 4, 2, 64}, AttnShape{1, 257, 8, 2, 128}, AttnShape{2, 64, 2, 2, 64},
                                 AttnShape{3, 33, 4, 1, 128}, AttnShape{4, 2048, 32, 8, 64}, AttnShape{32, 1024, 12, 12, 64},
                                 windowed({2, 200, 4, 2, 64}, 16), windowed({1, 2048, 2, 1, 128}, 512)}) {
        INFO("sm " << sm << " " << dname(dt) << " " << shape_name(s) << " window " << s.window);
        CHECK(cuda::cudnn_attention_check_graphs(s, dt, sm) == "");
      }
  // and the checks do refuse: a Volta, a single position (cuDNN has no backward for it: keel's
  // kernels run it), GQA with a head count that is not a multiple
  using Catch::Matchers::Contains;
  CHECK_THAT(cuda::cudnn_attention_check_graphs(probe, DType::BF16, 70), Contains("SM80"));
  CHECK_THAT(cuda::cudnn_attention_check_graphs(AttnShape{1, 1, 2, 1, 64}, DType::BF16, 90), Contains("backward"));
  CHECK_THAT(cuda::cudnn_attention_check_graphs(AttnShape{1, 10, 3, 2, 64}, DType::BF16, 90), Contains("group-query"));
}
