// matmul through cuBLASLt.
//
// keel's tensors are row-major; cuBLAS is column-major. A row-major [R, C] buffer is the
// column-major [C, R] matrix with the same leading dimension, so
//     out[M,N] = op(a)[M,K] @ op(b)[K,N]       (row-major)
// is  out^T[N,M] = op(b)^T[N,K] @ op(a)^T[K,M] (column-major),
// i.e. cuBLASLt's "A" is keel's b, its "B" is keel's a, m = N, n = M, k = K:
//   b not transposed: stored [K,N] = col-major N x K (ld N) -> op N;  transposed: [N,K] = col-major K x N (ld K) -> op T
//   a not transposed: stored [M,K] = col-major K x M (ld K) -> op N;  transposed: [K,M] = col-major M x K (ld M) -> op T
//   out: col-major N x M, ld N. The bias (length N) is cuBLASLt's per-row bias of D.
// Compute type fp32 (CUBLAS_COMPUTE_32F: true fp32 for fp32 inputs, never TF32; fp32
// accumulation of bf16/fp16 products), scale type fp32, alpha 1, beta 1 when accumulating.
// With beta 1 the product is summed in fp32 and added to the old value before one rounding, as
// the contract says.
//
// GELU (matmul_gelu, matmul_gelu_backward): cuBLASLt's GELU_AUX(_BIAS) epilogue writes pre (the
// product plus bias, rounded) as its auxiliary matrix and gelu of the fp32 value as D; DGELU
// multiplies the fp32 product by gelu'(pre) read from the auxiliary matrix. cuBLASLt's GELU is
// the tanh approximation (kernels/gelu.h). The auxiliary matrix has D's layout (col-major
// N x M, ld N: cuBLASLt wants ld % 8 == 0) and D's dtype. Where the fused call cannot run
// (other dtypes, N % 8 != 0, pre unaligned, no algorithm, or KEEL_GELU_EPILOGUE=0) the ops fall
// back to matmul followed by the GELU kernel.
//
// Residual (matmul_residual): the residual is cuBLASLt's C, read with beta 1 into a separate D,
// so D = (product + residual) + bias in fp32, rounded once. C shares D's layout and dtype; the
// plan's output alignment is the smaller of the two. Where it cannot run (a residual of another
// dtype, no algorithm, or KEEL_RESIDUAL_EPILOGUE=0) the op is matmul, then add.
//
// Bias gradient (matmul_bias_grad): dW = dout^T @ in is cuBLASLt's D (col-major in x out) =
// A (in) times op(B) with B = dout transposed, so the bias gradient sum_rows dout is the sum of
// op(B) over k: the BGRADB epilogue, which stores it (in D's dtype, fp32 for the gradients) at
// the bias pointer. It never adds, so a later contribution (or a bias gradient at an address
// that is not 16-byte aligned) goes to an aligned scratch vector and is then added (or copied).
// Without an algorithm, for other dtypes or with KEEL_BGRAD_EPILOGUE=0: matmul, then
// bias_backward.
//
// Natively supported (fast path): a and b of one dtype, and
//   f32 x f32 -> f32;  bf16 x bf16 -> bf16 or f32;  f16 x f16 -> f16 or f32; bias of out's dtype.
// Anything else (mixed input dtypes, f32 inputs into a bf16 output, a bias of another dtype):
// inputs widened to fp32 scratch (exact), the product computed in fp32 into scratch, and an
// epilogue kernel forms ((old) + product) + bias in fp32 and rounds once, the CPU's order.
//
// Determinism: per (shape, transposes, dtypes, bias, beta, operand alignments) the heuristic is
// asked once and one algorithm is kept for the life of the backend, so every call of a shape
// runs the same kernel on the same workspace (cuBLAS is bitwise reproducible for a fixed
// algorithm, GPU model and single stream). For bf16 and fp16 outputs the heuristic is asked
// (REDUCTION_SCHEME_MASK) only for candidates whose split-K reduction (if they split K) is
// CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE: partial products kept in fp32 and reduced in a separate
// ordered pass, never rounded to bf16 first. For fp32 outputs (the weight gradients, K = tokens,
// where splitting K is what fills the GPU) every scheme keeps fp32 partials, so all are allowed:
// INPLACE adds them into the output in an order its counters fix (cublasLt.h), OUTPUT_TYPE in a
// separate pass, as PyTorch's unrestricted calls get; KEEL_SPLITK_ANY=0 restricts them too.
#include <cublasLt.h>

#include <algorithm>
#include <functional>
#include <map>
#include <tuple>

#include "kernels/cuda/cuda_common.cuh"

namespace keel {

namespace cuda {

namespace {

constexpr size_t kWorkspaceBytes = size_t{32} << 20;  // NVIDIA's recommendation for Hopper

// `shapes` is a callable giving the shapes text, formed only when there is an error to report.
using ShapesFn = std::function<std::string()>;

// A failed cuBLASLt `call`, named with the op that made it (matmul, matmul_gelu, ...) and its shapes.
void check_lt(cublasStatus_t st, const char* call, const char* op, const ShapesFn& shapes) {
  if (st == CUBLAS_STATUS_SUCCESS) return;
  throw std::runtime_error(std::string("CudaBackend::") + op + ": " + call + " failed: " + cublasLtGetStatusName(st) +
                           " (" + cublasLtGetStatusString(st) + ") [" + (shapes ? shapes() : std::string()) + "]");
}

cudaDataType_t cuda_type(DType t) {
  switch (t) {
    case DType::BF16: return CUDA_R_16BF;
    case DType::F16: return CUDA_R_16F;
    default: return CUDA_R_32F;
  }
}

// What the epilogue does besides the optional bias.
enum class Epilogue : int {
  kNone = 0,
  kGeluAux = 1,  // D = gelu(x), aux = x  (x = product + bias)
  kDGelu = 2,    // D = product * gelu'(aux)
  kBGradB = 3,   // bias (an output) = the sums of op(B) over k; D = product
};

// (M, N, K, trans_a, trans_b, ab dtype, out dtype, bias, beta, align a, b, out, bias, epilogue, align aux)
using PlanKey = std::tuple<int64_t, int64_t, int64_t, bool, bool, int, int, bool, bool, unsigned, unsigned, unsigned,
                           unsigned, int, unsigned>;

struct Plan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t la = nullptr, lb = nullptr, lc = nullptr;
  cublasLtMatmulAlgo_t algo{};
  bool found = false;
};

// out = ((accumulate ? out : 0) + product) + bias, rounded once: the generic path's epilogue.
// product may be null (K = 0).
template <class T>
__global__ void matmul_epilogue_kernel(T* out, const float* __restrict__ product, const void* bias, DType bias_dtype,
                                       int64_t M, int64_t N, bool accumulate) {
  const int64_t total = M * N;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float v = product ? product[i] : 0.0f;
    if (accumulate) v = to_f32(out[i]) + v;
    if (bias) v = v + load_any(bias, bias_dtype, i % N);
    out[i] = from_f32<T>(v);
  }
}

}  // namespace

struct MatmulCache {
  CudaBackend& be;
  cublasLtHandle_t lt = nullptr;
  void* workspace = nullptr;
  std::map<PlanKey, Plan> plans;

  explicit MatmulCache(CudaBackend& b) : be(b) {}
  ~MatmulCache() {
    for (auto& [key, p] : plans) destroy(p);
    if (workspace) be.release(workspace);
    if (lt) cublasLtDestroy(lt);
  }

  static void destroy(Plan& p) noexcept {
    if (p.la) cublasLtMatrixLayoutDestroy(p.la);
    if (p.lb) cublasLtMatrixLayoutDestroy(p.lb);
    if (p.lc) cublasLtMatrixLayoutDestroy(p.lc);
    if (p.desc) cublasLtMatmulDescDestroy(p.desc);
    p.la = p.lb = p.lc = nullptr;
    p.desc = nullptr;
  }

  // The plan for out[M,N] (dtype dt_out) = op(a) @ op(b) with a, b of dtype dt_ab; aux is the
  // GELU epilogues' auxiliary matrix (null for kNone); c the addend read with beta 1 when it is
  // not out itself (null: out).
  Plan& plan(int64_t M, int64_t N, int64_t K, bool trans_a, bool trans_b, DType dt_ab, DType dt_out, const void* a,
             const void* b, const void* out, const void* bias, bool beta_one, const char* op, const ShapesFn& shapes,
             Epilogue epilogue = Epilogue::kNone, const void* aux = nullptr, const void* c = nullptr) {
    const PlanKey key{M,
                      N,
                      K,
                      trans_a,
                      trans_b,
                      static_cast<int>(dt_ab),
                      static_cast<int>(dt_out),
                      bias != nullptr,
                      beta_one,
                      alignment_of(a),
                      alignment_of(b),
                      c ? std::min(alignment_of(out), alignment_of(c)) : alignment_of(out),
                      bias ? alignment_of(bias) : 256u,
                      static_cast<int>(epilogue),
                      aux ? alignment_of(aux) : 256u};
    auto it = plans.find(key);
    if (it != plans.end()) return it->second;
    Plan p;
    try {
      build(p, key, bias, aux, op, shapes);
    } catch (...) {
      destroy(p);  // a failed cuBLASLt call must not leak the descriptors made before it
      throw;
    }
    return plans.emplace(key, p).first->second;
  }

  void build(Plan& p, const PlanKey& key, const void* bias, const void* aux, const char* op, const ShapesFn& shapes) {
    const int64_t M = std::get<0>(key), N = std::get<1>(key), K = std::get<2>(key);
    const bool trans_a = std::get<3>(key), trans_b = std::get<4>(key);
    const DType dt_ab = static_cast<DType>(std::get<5>(key)), dt_out = static_cast<DType>(std::get<6>(key));
    const cudaDataType_t tab = cuda_type(dt_ab), tout = cuda_type(dt_out);
    check_lt(cublasLtMatmulDescCreate(&p.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F), "cublasLtMatmulDescCreate", op, shapes);
    const cublasOperation_t op_lt_a = trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;  // cuBLASLt's A is keel's b
    const cublasOperation_t op_lt_b = trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;  // cuBLASLt's B is keel's a
    check_lt(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSA, &op_lt_a, sizeof op_lt_a),
             "cublasLtMatmulDescSetAttribute(TRANSA)", op, shapes);
    check_lt(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSB, &op_lt_b, sizeof op_lt_b),
             "cublasLtMatmulDescSetAttribute(TRANSB)", op, shapes);
    cublasLtEpilogue_t epi = bias ? CUBLASLT_EPILOGUE_BIAS : CUBLASLT_EPILOGUE_DEFAULT;
    switch (static_cast<Epilogue>(std::get<13>(key))) {
      case Epilogue::kNone: break;
      case Epilogue::kGeluAux: epi = bias ? CUBLASLT_EPILOGUE_GELU_AUX_BIAS : CUBLASLT_EPILOGUE_GELU_AUX; break;
      case Epilogue::kDGelu: epi = CUBLASLT_EPILOGUE_DGELU; break;
      case Epilogue::kBGradB: epi = CUBLASLT_EPILOGUE_BGRADB; break;
    }
    if (epi != CUBLASLT_EPILOGUE_DEFAULT)
      check_lt(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof epi),
               "cublasLtMatmulDescSetAttribute(EPILOGUE)", op, shapes);
    // The heuristic reads the pointers' alignment from here (it never dereferences them).
    if (bias)
      check_lt(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof bias),
               "cublasLtMatmulDescSetAttribute(BIAS_POINTER)", op, shapes);
    if (aux) {
      const int64_t aux_ld = N;  // D's layout
      check_lt(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &aux, sizeof aux),
               "cublasLtMatmulDescSetAttribute(EPILOGUE_AUX_POINTER)", op, shapes);
      check_lt(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &aux_ld, sizeof aux_ld),
               "cublasLtMatmulDescSetAttribute(EPILOGUE_AUX_LD)", op, shapes);
    }
    // cuBLASLt A = b: stored col-major (trans_b ? K x N : N x K)
    const uint64_t a_rows = trans_b ? K : N, a_cols = trans_b ? N : K;
    // cuBLASLt B = a: stored col-major (trans_a ? M x K : K x M)
    const uint64_t b_rows = trans_a ? M : K, b_cols = trans_a ? K : M;
    check_lt(cublasLtMatrixLayoutCreate(&p.la, tab, a_rows, a_cols, static_cast<int64_t>(a_rows)),
             "cublasLtMatrixLayoutCreate(A)", op, shapes);
    check_lt(cublasLtMatrixLayoutCreate(&p.lb, tab, b_rows, b_cols, static_cast<int64_t>(b_rows)),
             "cublasLtMatrixLayoutCreate(B)", op, shapes);
    check_lt(cublasLtMatrixLayoutCreate(&p.lc, tout, N, M, N), "cublasLtMatrixLayoutCreate(C/D)", op, shapes);

    cublasLtMatmulPreference_t pref = nullptr;
    check_lt(cublasLtMatmulPreferenceCreate(&pref), "cublasLtMatmulPreferenceCreate", op, shapes);
    const uint64_t ws = kWorkspaceBytes;
    const uint32_t al_a = std::get<10>(key), al_b = std::get<9>(key), al_d = std::get<11>(key);  // lt A = b, lt B = a
    // Only split-K schemes that keep the partial sums in fp32 (the mask admits
    // REDUCTION_SCHEME_NONE always): for a bf16 or fp16 output, those that reduce them in a
    // separate pass. Without this filter the heuristic's top candidates for a large-K shape
    // (weight gradients: K = tokens) may all be INPLACE / OUTPUT_TYPE ones and be rejected below,
    // leaving no algorithm at all.
    const uint32_t reduction_mask = dt_out == DType::F32 && be.splitk_any() ? CUBLASLT_REDUCTION_SCHEME_MASK
                                                                             : CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE;
    cublasStatus_t st = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws);
    if (st == CUBLAS_STATUS_SUCCESS)
      st = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, &reduction_mask,
                                                sizeof reduction_mask);
    if (st == CUBLAS_STATUS_SUCCESS)
      st = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &al_a, sizeof al_a);
    if (st == CUBLAS_STATUS_SUCCESS)
      st = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &al_b, sizeof al_b);
    if (st == CUBLAS_STATUS_SUCCESS)
      st = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &al_d, sizeof al_d);
    if (st == CUBLAS_STATUS_SUCCESS)
      st = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &al_d, sizeof al_d);
    if (st != CUBLAS_STATUS_SUCCESS) {
      cublasLtMatmulPreferenceDestroy(pref);
      check_lt(st, "cublasLtMatmulPreferenceSetAttribute", op, shapes);
    }
    constexpr int kCandidates = 8;
    cublasLtMatmulHeuristicResult_t results[kCandidates] = {};
    int count = 0;
    st = cublasLtMatmulAlgoGetHeuristic(lt, p.desc, p.la, p.lb, p.lc, p.lc, pref, kCandidates, results, &count);
    cublasLtMatmulPreferenceDestroy(pref);
    // NOT_SUPPORTED (or no result) means no algorithm for this combination: the caller falls back.
    // An epilogue other than a plain bias is an optional fusion: whatever the heuristic says
    // against it, the caller falls back to the unfused ops (the profile then shows those ops).
    const bool optional = static_cast<Epilogue>(std::get<13>(key)) != Epilogue::kNone;
    if (st != CUBLAS_STATUS_SUCCESS && st != CUBLAS_STATUS_NOT_SUPPORTED && !optional)
      check_lt(st, "cublasLtMatmulAlgoGetHeuristic", op, shapes);
    // The best-ranked candidate whose split-K scheme (if it splits) the mask admits: for a bf16
    // or fp16 output not INPLACE or OUTPUT_TYPE, which add partials in the output dtype - less
    // accurate than the CPU's single rounding. (The mask above already asks for this; checked
    // again here.)
    for (int i = 0; st == CUBLAS_STATUS_SUCCESS && i < count && !p.found; ++i) {
      if (results[i].state != CUBLAS_STATUS_SUCCESS) continue;
      int32_t splits = 1;
      uint32_t scheme = CUBLASLT_REDUCTION_SCHEME_NONE;
      size_t written = 0;
      check_lt(cublasLtMatmulAlgoConfigGetAttribute(&results[i].algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &splits,
                                                    sizeof splits, &written),
               "cublasLtMatmulAlgoConfigGetAttribute(SPLITK_NUM)", op, shapes);
      check_lt(cublasLtMatmulAlgoConfigGetAttribute(&results[i].algo, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, &scheme,
                                                    sizeof scheme, &written),
               "cublasLtMatmulAlgoConfigGetAttribute(REDUCTION_SCHEME)", op, shapes);
      if (splits > 1 && scheme != CUBLASLT_REDUCTION_SCHEME_NONE && (scheme & reduction_mask) != scheme) continue;
      p.algo = results[i].algo;
      p.found = true;
    }
  }

  // Runs a plan: out = op(a) @ op(b) (+ bias) (+ c when beta_one; c null: out), through its
  // epilogue.
  void run(Plan& p, const void* a, const void* b, void* out, const void* bias, bool beta_one, const char* op,
           const ShapesFn& shapes, const void* aux = nullptr, const void* c = nullptr) {
    if (bias)
      check_lt(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof bias),
               "cublasLtMatmulDescSetAttribute(BIAS_POINTER)", op, shapes);
    if (aux)
      check_lt(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &aux, sizeof aux),
               "cublasLtMatmulDescSetAttribute(EPILOGUE_AUX_POINTER)", op, shapes);
    const float alpha = 1.0f, beta = beta_one ? 1.0f : 0.0f;
    check_lt(cublasLtMatmul(lt, p.desc, &alpha, b, p.la, a, p.lb, &beta, c ? c : out, p.lc, out, p.lc, &p.algo, workspace,
                            kWorkspaceBytes, be.stream()),
             "cublasLtMatmul", op, shapes);
  }
};

MatmulCache* create_matmul_cache(CudaBackend& be) {
  auto* c = new MatmulCache(be);
  cublasStatus_t st = cublasLtCreate(&c->lt);
  if (st != CUBLAS_STATUS_SUCCESS) {
    delete c;
    check_lt(st, "cublasLtCreate", "CudaBackend", nullptr);
  }
  c->workspace = be.scratch(kWorkspaceBytes, "matmul workspace");
  return c;
}

void destroy_matmul_cache(MatmulCache* cache) noexcept { delete cache; }

namespace {

bool natively_supported(DType ab, DType out) {
  switch (ab) {
    case DType::F32: return out == DType::F32;
    case DType::BF16: return out == DType::BF16 || out == DType::F32;
    case DType::F16: return out == DType::F16 || out == DType::F32;
    default: return false;
  }
}

// out[M,N] = op(a)[M,K] @ op(b)[K,N]: checked, and the shapes text for errors.
struct MatmulShape {
  int64_t M, N, K;
  ShapesFn shapes;
};

MatmulShape check_matmul(const char* op, const Tensor& out, const Tensor& a, const Tensor& b, bool trans_a,
                         bool trans_b, bool accumulate, const Tensor* bias) {
  check_float(op, {"out", out});
  check_float(op, {"a", a});
  check_float(op, {"b", b});
  // Every tensor is seen as (rows, cols): leading dimensions fold into rows.
  const int64_t M = trans_a ? a.cols() : rows(a);
  const int64_t K = trans_a ? rows(a) : a.cols();
  const int64_t Kb = trans_b ? b.cols() : rows(b);
  const int64_t N = trans_b ? rows(b) : b.cols();
  auto flags = [trans_a, trans_b]() {
    return std::string(" (trans_a=") + (trans_a ? "1" : "0") + ", trans_b=" + (trans_b ? "1" : "0") + ")";
  };
  if (K != Kb) fail(op, "inner dimensions differ" + flags(), {{"out", out}, {"a", a}, {"b", b}});
  if (rows(out) != M || out.cols() != N)
    fail(op, "out must be [" + std::to_string(M) + ", " + std::to_string(N) + "]" + flags(),
         {{"out", out}, {"a", a}, {"b", b}});
  const bool has_bias = bias && !bias->empty();
  if (has_bias) {
    check_float(op, {"bias", *bias});
    if (bias->numel() != N) fail(op, "bias must have N elements", {{"out", out}, {"bias", *bias}});
  }
  // Formed only if an error needs it, while the caller's tensors are alive.
  ShapesFn shapes = [&out, &a, &b, flags, bias = has_bias ? bias : nullptr, accumulate]() {
    std::string s = describe({{"out", out}, {"a", a}, {"b", b}}) + flags();
    if (bias) s += ", bias=" + bias->shape_str();
    if (accumulate) s += ", accumulate";
    return s;
  };
  return {M, N, K, std::move(shapes)};
}

// A matrix the epilogue reads or writes beside out (GELU's pre, the residual): out's shape (and,
// when same_dtype, its dtype), in a separate buffer.
void check_beside_out(const char* op, const char* out_name, const Tensor& out, const char* name, const Tensor& t,
                      bool same_dtype) {
  check_float(op, {name, t});
  if (t.numel() != out.numel() || t.cols() != out.cols() || (same_dtype && t.dtype != out.dtype))
    fail(op, std::string(name) + " must have " + out_name + "'s shape" + (same_dtype ? " and dtype" : ""),
         {{out_name, out}, {name, t}});
  if (t.data == out.data && out.numel() > 0)
    fail(op, std::string(name) + " and " + out_name + " must be different buffers", {{out_name, out}, {name, t}});
}

// The native cuBLASLt call when the operands allow it: a and b of one dtype natively supported
// into out's dtype, a bias of out's dtype, K > 0, for the GELU epilogues an auxiliary matrix
// of out's dtype at a 16-byte aligned address with N % 8 == 0, and a residual (added with beta
// 1, in place of out's old value) of out's dtype. Returns false, having done nothing, when they
// do not or cuBLASLt has no algorithm: the caller takes another path.
bool native_matmul(CudaBackend& be, MatmulCache& mc, const char* op, const MatmulShape& sh, const Tensor& out,
                   const Tensor& a, const Tensor& b, bool trans_a, bool trans_b, bool accumulate, const Tensor* bias,
                   Epilogue epilogue = Epilogue::kNone, const Tensor* aux = nullptr,
                   const Tensor* residual = nullptr) {
  const bool has_bias = bias && !bias->empty();
  if (sh.K == 0 || a.dtype != b.dtype || !natively_supported(a.dtype, out.dtype) ||
      (has_bias && bias->dtype != out.dtype) || (residual && residual->dtype != out.dtype))
    return false;
  if (aux && (aux->dtype != out.dtype || sh.N % 8 != 0 || alignment_of(aux->data) < 16)) return false;
  // BGRADB writes the bias pointer: never through the aligned read copy below.
  if (epilogue == Epilogue::kBGradB && (!has_bias || alignment_of(bias->data) < 16)) return false;
  // A bias sliced out of a flat parameter buffer may sit at any element offset: the epilogue
  // reads it from an aligned copy (N elements) when it is not 16-byte aligned.
  const void* bias_ptr = has_bias ? bias->data : nullptr;
  void* bias_copy = nullptr;
  if (has_bias && alignment_of(bias_ptr) < 16) {
    bias_copy = be.scratch(bias->bytes(), op);
    check_cuda(cudaMemcpyAsync(bias_copy, bias_ptr, bias->bytes(), cudaMemcpyDeviceToDevice, be.stream()), op,
               "cudaMemcpyAsync (bias)");
  }
  const void* epilogue_bias = bias_copy ? bias_copy : bias_ptr;
  const void* aux_ptr = aux ? aux->data : nullptr;
  const void* c_ptr = residual ? residual->data : nullptr;
  const bool beta_one = accumulate || residual;
  Plan& p = mc.plan(sh.M, sh.N, sh.K, trans_a, trans_b, a.dtype, out.dtype, a.data, b.data, out.data, epilogue_bias,
                    beta_one, op, sh.shapes, epilogue, aux_ptr, c_ptr);
  if (p.found) mc.run(p, a.data, b.data, out.data, epilogue_bias, beta_one, op, sh.shapes, aux_ptr, c_ptr);
  if (bias_copy) be.release(bias_copy);
  return p.found;
}

}  // namespace
}  // namespace cuda

void CudaBackend::matmul(const Tensor& out, const Tensor& a, const Tensor& b, bool trans_a, bool trans_b,
                         bool accumulate, const Tensor* bias) {
  const char* op = "matmul";
  const cuda::MatmulShape sh = cuda::check_matmul(op, out, a, b, trans_a, trans_b, accumulate, bias);
  const int64_t M = sh.M, N = sh.N, K = sh.K;
  if (M == 0 || N == 0) return;
  const bool has_bias = bias && !bias->empty();
  cuda::MatmulCache& mc = *matmul_;
  if (cuda::native_matmul(*this, mc, op, sh, out, a, b, trans_a, trans_b, accumulate, bias)) {
    cuda::check_launch(*this, op, {{"out", out}, {"a", a}, {"b", b}});
    return;
  }

  // Generic path: fp32 product into scratch, then the epilogue rounds once into out.
  const void* bias_ptr = has_bias ? bias->data : nullptr;
  float* product = nullptr;
  void* a32 = nullptr;
  void* b32 = nullptr;
  if (K > 0) {
    const void* pa = a.data;
    const void* pb = b.data;
    // Widened to fp32 scratch, and fp32 operands at an odd address copied there too: this path
    // also runs when cuBLASLt had no algorithm for the operands' alignment, and the same
    // unaligned fp32 pointers would find none again.
    if (a.dtype != DType::F32 || cuda::alignment_of(a.data) < 16) {
      a32 = scratch(static_cast<size_t>(a.numel()) * 4, op);
      cuda::launch_convert(*this, a32, DType::F32, a.data, a.dtype, a.numel(), op);
      pa = a32;
    }
    if (b.dtype != DType::F32 || cuda::alignment_of(b.data) < 16) {
      b32 = scratch(static_cast<size_t>(b.numel()) * 4, op);
      cuda::launch_convert(*this, b32, DType::F32, b.data, b.dtype, b.numel(), op);
      pb = b32;
    }
    product = static_cast<float*>(scratch(static_cast<size_t>(M * N) * 4, op));
    cuda::Plan& p =
        mc.plan(M, N, K, trans_a, trans_b, DType::F32, DType::F32, pa, pb, product, nullptr, false, op, sh.shapes);
    if (!p.found)
      throw std::runtime_error("CudaBackend::matmul: cuBLASLt has no algorithm for this fp32 product [" + sh.shapes() +
                               "]");
    mc.run(p, pa, pb, product, nullptr, false, op, sh.shapes);
  }
  const int64_t total = M * N;
  const unsigned blocks = cuda::grid_for(total, 256, 4);
  KEEL_DISPATCH_FLOAT(out.dtype, op, T, {
    cuda::matmul_epilogue_kernel<T><<<blocks, 256, 0, stream_>>>(out.as<T>(), product, bias_ptr,
                                                                 has_bias ? bias->dtype : DType::F32, M, N, accumulate);
  });
  cuda::check_launch(*this, op, {{"out", out}, {"a", a}, {"b", b}});
  if (product) release(product);
  if (a32) release(a32);
  if (b32) release(b32);
}

void CudaBackend::matmul_gelu(const Tensor& act, const Tensor& pre, const Tensor& a, const Tensor& b, bool trans_a,
                              bool trans_b, const Tensor* bias) {
  const char* op = "matmul_gelu";
  const cuda::MatmulShape sh = cuda::check_matmul(op, act, a, b, trans_a, trans_b, false, bias);
  cuda::check_beside_out(op, "act", act, "pre", pre, true);
  if (sh.M == 0 || sh.N == 0) return;
  if (gelu_epilogue_ && cuda::native_matmul(*this, *matmul_, op, sh, act, a, b, trans_a, trans_b, false, bias,
                                            cuda::Epilogue::kGeluAux, &pre)) {
    cuda::check_launch(*this, op, {{"act", act}, {"pre", pre}, {"a", a}, {"b", b}});
    return;
  }
  Backend::matmul_gelu(act, pre, a, b, trans_a, trans_b, bias);  // matmul, then the GELU kernel
}

void CudaBackend::matmul_gelu_backward(const Tensor& din, const Tensor& a, const Tensor& b, bool trans_a,
                                       bool trans_b, const Tensor& pre) {
  const char* op = "matmul_gelu_backward";
  const cuda::MatmulShape sh = cuda::check_matmul(op, din, a, b, trans_a, trans_b, false, nullptr);
  cuda::check_beside_out(op, "din", din, "pre", pre, true);
  if (sh.M == 0 || sh.N == 0) return;
  if (gelu_epilogue_ && cuda::native_matmul(*this, *matmul_, op, sh, din, a, b, trans_a, trans_b, false, nullptr,
                                            cuda::Epilogue::kDGelu, &pre)) {
    cuda::check_launch(*this, op, {{"din", din}, {"pre", pre}, {"a", a}, {"b", b}});
    return;
  }
  Backend::matmul_gelu_backward(din, a, b, trans_a, trans_b, pre);
}

void CudaBackend::matmul_residual(const Tensor& out, const Tensor& residual, const Tensor& a, const Tensor& b,
                                  bool trans_a, bool trans_b, const Tensor* bias) {
  const char* op = "matmul_residual";
  const cuda::MatmulShape sh = cuda::check_matmul(op, out, a, b, trans_a, trans_b, false, bias);
  cuda::check_beside_out(op, "out", out, "residual", residual, false);  // any float dtype: else composed
  if (sh.M == 0 || sh.N == 0) return;
  if (residual_epilogue_ && cuda::native_matmul(*this, *matmul_, op, sh, out, a, b, trans_a, trans_b, false, bias,
                                                cuda::Epilogue::kNone, nullptr, &residual)) {
    cuda::check_launch(*this, op, {{"out", out}, {"residual", residual}, {"a", a}, {"b", b}});
    return;
  }
  Backend::matmul_residual(out, residual, a, b, trans_a, trans_b, bias);  // matmul, then add
}

void CudaBackend::matmul_bias_grad(const Tensor& dweight, const Tensor& dbias, const Tensor& dout, const Tensor& in,
                                   bool accumulate_w, bool accumulate_b) {
  const char* op = "matmul_bias_grad";
  const cuda::MatmulShape sh = cuda::check_matmul(op, dweight, dout, in, true, false, accumulate_w, nullptr);
  cuda::check_float(op, {"dbias", dbias});
  if (dbias.numel() != sh.M)
    cuda::fail(op, "dbias must have one element per column of dout", {{"dbias", dbias}, {"dout", dout}});
  if (bgrad_epilogue_ && sh.N > 0 && dbias.dtype == dweight.dtype) {
    // BGRADB stores the sums: straight into dbias for a first contribution at an aligned address,
    // else into aligned scratch, then added (or copied) into dbias.
    const bool direct = !accumulate_b && cuda::alignment_of(dbias.data) >= 16;
    void* staged = direct ? nullptr : scratch(dbias.bytes(), op);
    const Tensor sums(direct ? dbias.data : staged, dbias.dtype, {sh.M}, Device::CUDA);
    const bool fused = cuda::native_matmul(*this, *matmul_, op, sh, dweight, dout, in, true, false, accumulate_w,
                                           &sums, cuda::Epilogue::kBGradB);
    if (fused && staged) {
      if (accumulate_b)
        add(dbias, dbias, sums);
      else
        convert(dbias, sums);  // same dtype: a copy
    }
    if (staged) release(staged);
    if (fused) {
      cuda::check_launch(*this, op, {{"dweight", dweight}, {"dbias", dbias}, {"dout", dout}, {"in", in}});
      return;
    }
  }
  Backend::matmul_bias_grad(dweight, dbias, dout, in, accumulate_w, accumulate_b);  // matmul, then bias_backward
}

}  // namespace keel
