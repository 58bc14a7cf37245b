// The CUDA emulator's cuBLASLt: the calls kernels/cuda/matmul.cu makes, with cuBLASLt's
// column-major semantics computed on the host:
//   D (m x n) = alpha op(A) op(B) + beta C (+ bias, one value per row of D), rounded once to D's type,
// op(A) m x k, products summed in fp32 in k order. The GELU epilogues (tanh GELU, kernels/gelu.h)
// on that fp32 value x: GELU_AUX(_BIAS) stores x rounded into the auxiliary matrix and gelu(x) in
// D; DGELU stores x * gelu'(aux) in D. BGRADB stores the sums of op(B) over k (one per column of
// D, in k order, fp32) rounded to D's type at the bias pointer, and D as without an epilogue.
// The auxiliary matrix has D's type and the layout (D's rows, cols, EPILOGUE_AUX_LD). Layouts
// are (type, rows, cols, ld), element (r, c) at r + c ld. What a real cuBLASLt would refuse is
// refused the same way (CUBLAS_STATUS_INVALID_VALUE): shapes that do not chain, ld < rows, a C
// layout unlike D's, operand pointers less aligned than the preference's minimum alignments the
// algorithm was chosen for (the real one may fault or read wrong data there), a GELU epilogue
// without its auxiliary pointer or with an AUX_LD that is not a multiple of 8 at least D's rows,
// and an auxiliary pointer less aligned at the call than when the algorithm was chosen.
#include <cublasLt.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <vector>

#include "kernels/cuda/cuda_check.h"  // alignment_of
#include "kernels/cuda/emulator/emu_device.h"
#include "kernels/dtype.h"
#include "kernels/gelu.h"

namespace {

struct Layout {
  cudaDataType type;
  uint64_t rows, cols;
  int64_t ld;
};
struct Desc {
  cublasOperation_t trans_a = CUBLAS_OP_N, trans_b = CUBLAS_OP_N;
  cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_DEFAULT;
  const void* bias = nullptr;
  const void* aux = nullptr;
  int64_t aux_ld = 0;
};
struct Preference {
  uint32_t align[4] = {256, 256, 256, 256};  // A, B, C, D minimum alignments (bytes)
};
// What the emulated algorithm was chosen for, kept in cublasLtMatmulAlgo_t's opaque words.
struct AlgoInfo {
  uint32_t magic;
  uint32_t align[4];
  uint32_t aux_align;
};
constexpr uint32_t kMagic = 0x6b65656cu;

std::atomic<bool> matmul_fails{false};  // keel_emu::set_cublaslt_matmul_failure

Layout* layout(cublasLtMatrixLayout_t l) { return reinterpret_cast<Layout*>(l); }
Desc* desc(cublasLtMatmulDesc_t d) { return reinterpret_cast<Desc*>(d); }
Preference* pref(cublasLtMatmulPreference_t p) { return reinterpret_cast<Preference*>(p); }

bool supported(cudaDataType t) { return t == CUDA_R_32F || t == CUDA_R_16BF || t == CUDA_R_16F; }

// Widening is exact; narrowing rounds to nearest even (kernels/dtype.h, as the CPU reference).
float load(const void* p, cudaDataType t, int64_t i) {
  switch (t) {
    case CUDA_R_16BF: return keel::bf16_to_f32(static_cast<const uint16_t*>(p)[i]);
    case CUDA_R_16F: return keel::f16_to_f32(static_cast<const uint16_t*>(p)[i]);
    default: return static_cast<const float*>(p)[i];
  }
}
void store(void* p, cudaDataType t, int64_t i, float v) {
  switch (t) {
    case CUDA_R_16BF: static_cast<uint16_t*>(p)[i] = keel::f32_to_bf16(v); break;
    case CUDA_R_16F: static_cast<uint16_t*>(p)[i] = keel::f32_to_f16(v); break;
    default: static_cast<float*>(p)[i] = v; break;
  }
}

uint32_t alignment(const void* p) { return p ? keel::cuda::alignment_of(p) : 256u; }

bool is_gelu_aux(cublasLtEpilogue_t e) { return e == CUBLASLT_EPILOGUE_GELU_AUX || e == CUBLASLT_EPILOGUE_GELU_AUX_BIAS; }
bool has_bias(cublasLtEpilogue_t e) { return e == CUBLASLT_EPILOGUE_BIAS || e == CUBLASLT_EPILOGUE_GELU_AUX_BIAS; }
bool needs_aux(cublasLtEpilogue_t e) { return is_gelu_aux(e) || e == CUBLASLT_EPILOGUE_DGELU; }
bool known(cublasLtEpilogue_t e) {
  return e == CUBLASLT_EPILOGUE_DEFAULT || has_bias(e) || needs_aux(e) || e == CUBLASLT_EPILOGUE_BGRADB;
}

}  // namespace

void keel_emu::set_cublaslt_matmul_failure(bool on) { matmul_fails = on; }

extern "C" {

const char* cublasLtGetStatusName(cublasStatus_t s) {
  switch (s) {
    case CUBLAS_STATUS_SUCCESS: return "CUBLAS_STATUS_SUCCESS";
    case CUBLAS_STATUS_INVALID_VALUE: return "CUBLAS_STATUS_INVALID_VALUE";
    case CUBLAS_STATUS_NOT_SUPPORTED: return "CUBLAS_STATUS_NOT_SUPPORTED";
    case CUBLAS_STATUS_EXECUTION_FAILED: return "CUBLAS_STATUS_EXECUTION_FAILED";
    default: return "CUBLAS_STATUS (emulator)";
  }
}
const char* cublasLtGetStatusString(cublasStatus_t s) {
  return s == CUBLAS_STATUS_SUCCESS ? "success" : "refused by the keel CUDA emulator's cuBLASLt";
}
size_t cublasLtGetVersion(void) { return 130000; }

cublasStatus_t cublasLtCreate(cublasLtHandle_t* h) {
  *h = reinterpret_cast<cublasLtHandle_t>(new int(0));
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtDestroy(cublasLtHandle_t h) {
  delete reinterpret_cast<int*>(h);
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulDescCreate(cublasLtMatmulDesc_t* d, cublasComputeType_t compute, cudaDataType_t scale) {
  if (compute != CUBLAS_COMPUTE_32F || scale != CUDA_R_32F) return CUBLAS_STATUS_NOT_SUPPORTED;
  *d = reinterpret_cast<cublasLtMatmulDesc_t>(new Desc);
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulDescDestroy(cublasLtMatmulDesc_t d) {
  delete desc(d);
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulDescSetAttribute(cublasLtMatmulDesc_t d, cublasLtMatmulDescAttributes_t attr,
                                              const void* buf, size_t bytes) {
  Desc* p = desc(d);
  switch (attr) {
    case CUBLASLT_MATMUL_DESC_TRANSA:
      if (bytes != sizeof(cublasOperation_t)) return CUBLAS_STATUS_INVALID_VALUE;
      std::memcpy(&p->trans_a, buf, bytes);
      return CUBLAS_STATUS_SUCCESS;
    case CUBLASLT_MATMUL_DESC_TRANSB:
      if (bytes != sizeof(cublasOperation_t)) return CUBLAS_STATUS_INVALID_VALUE;
      std::memcpy(&p->trans_b, buf, bytes);
      return CUBLAS_STATUS_SUCCESS;
    case CUBLASLT_MATMUL_DESC_EPILOGUE:
      if (bytes != sizeof(cublasLtEpilogue_t)) return CUBLAS_STATUS_INVALID_VALUE;
      std::memcpy(&p->epilogue, buf, bytes);
      if (!known(p->epilogue)) return CUBLAS_STATUS_NOT_SUPPORTED;
      return CUBLAS_STATUS_SUCCESS;
    case CUBLASLT_MATMUL_DESC_BIAS_POINTER:
      if (bytes != sizeof(void*)) return CUBLAS_STATUS_INVALID_VALUE;
      std::memcpy(&p->bias, buf, bytes);
      return CUBLAS_STATUS_SUCCESS;
    case CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER:
      if (bytes != sizeof(void*)) return CUBLAS_STATUS_INVALID_VALUE;
      std::memcpy(&p->aux, buf, bytes);
      return CUBLAS_STATUS_SUCCESS;
    case CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD:
      if (bytes != sizeof(int64_t)) return CUBLAS_STATUS_INVALID_VALUE;
      std::memcpy(&p->aux_ld, buf, bytes);
      return CUBLAS_STATUS_SUCCESS;
    default: return CUBLAS_STATUS_NOT_SUPPORTED;
  }
}

cublasStatus_t cublasLtMatrixLayoutCreate(cublasLtMatrixLayout_t* l, cudaDataType type, uint64_t rows, uint64_t cols,
                                          int64_t ld) {
  if (!supported(type) || ld < static_cast<int64_t>(rows) || ld < 1) return CUBLAS_STATUS_INVALID_VALUE;
  *l = reinterpret_cast<cublasLtMatrixLayout_t>(new Layout{type, rows, cols, ld});
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatrixLayoutDestroy(cublasLtMatrixLayout_t l) {
  delete layout(l);
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulPreferenceCreate(cublasLtMatmulPreference_t* p) {
  *p = reinterpret_cast<cublasLtMatmulPreference_t>(new Preference);
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulPreferenceDestroy(cublasLtMatmulPreference_t p) {
  delete pref(p);
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulPreferenceSetAttribute(cublasLtMatmulPreference_t p,
                                                    cublasLtMatmulPreferenceAttributes_t attr, const void* buf,
                                                    size_t bytes) {
  int slot = -1;
  switch (attr) {
    case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES: slot = 0; break;
    case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES: slot = 1; break;
    case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES: slot = 2; break;
    case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES: slot = 3; break;
    case CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES: return bytes == 8 ? CUBLAS_STATUS_SUCCESS : CUBLAS_STATUS_INVALID_VALUE;
    case CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK:
      return bytes == 4 ? CUBLAS_STATUS_SUCCESS : CUBLAS_STATUS_INVALID_VALUE;
    default: return CUBLAS_STATUS_NOT_SUPPORTED;
  }
  if (bytes != 4) return CUBLAS_STATUS_INVALID_VALUE;
  std::memcpy(&pref(p)->align[slot], buf, 4);
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulAlgoGetHeuristic(cublasLtHandle_t, cublasLtMatmulDesc_t d, cublasLtMatrixLayout_t a,
                                              cublasLtMatrixLayout_t b, cublasLtMatrixLayout_t c,
                                              cublasLtMatrixLayout_t dl, cublasLtMatmulPreference_t p, int requested,
                                              cublasLtMatmulHeuristicResult_t results[], int* count) {
  *count = 0;
  if (requested < 1) return CUBLAS_STATUS_INVALID_VALUE;
  const Layout &A = *layout(a), &B = *layout(b), &C = *layout(c), &D = *layout(dl);
  const Desc& ds = *desc(d);
  // Types: A and B alike; D fp32 or A's type; C like D.
  if (A.type != B.type || C.type != D.type || (D.type != CUDA_R_32F && D.type != A.type))
    return CUBLAS_STATUS_NOT_SUPPORTED;
  const uint64_t m = ds.trans_a == CUBLAS_OP_N ? A.rows : A.cols, k = ds.trans_a == CUBLAS_OP_N ? A.cols : A.rows;
  const uint64_t kb = ds.trans_b == CUBLAS_OP_N ? B.rows : B.cols, n = ds.trans_b == CUBLAS_OP_N ? B.cols : B.rows;
  if (k != kb || D.rows != m || D.cols != n || C.rows != D.rows || C.cols != D.cols) return CUBLAS_STATUS_INVALID_VALUE;
  if (needs_aux(ds.epilogue) &&
      (!ds.aux || ds.aux_ld % 8 != 0 || ds.aux_ld < static_cast<int64_t>(D.rows)))
    return CUBLAS_STATUS_INVALID_VALUE;
  results[0] = cublasLtMatmulHeuristicResult_t{};
  AlgoInfo info{kMagic,
                {pref(p)->align[0], pref(p)->align[1], pref(p)->align[2], pref(p)->align[3]},
                needs_aux(ds.epilogue) ? alignment(ds.aux) : 0u};
  static_assert(sizeof(AlgoInfo) <= sizeof(cublasLtMatmulAlgo_t));
  std::memcpy(&results[0].algo, &info, sizeof info);
  results[0].state = CUBLAS_STATUS_SUCCESS;
  results[0].wavesCount = 1.0f;
  *count = 1;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulAlgoConfigGetAttribute(const cublasLtMatmulAlgo_t*, cublasLtMatmulAlgoConfigAttributes_t attr,
                                                    void* buf, size_t bytes, size_t* written) {
  switch (attr) {
    case CUBLASLT_ALGO_CONFIG_SPLITK_NUM: {
      const int32_t one = 1;
      if (bytes != 4) return CUBLAS_STATUS_INVALID_VALUE;
      std::memcpy(buf, &one, 4);
      break;
    }
    case CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME: {
      const uint32_t none = CUBLASLT_REDUCTION_SCHEME_NONE;
      if (bytes != 4) return CUBLAS_STATUS_INVALID_VALUE;
      std::memcpy(buf, &none, 4);
      break;
    }
    default: return CUBLAS_STATUS_NOT_SUPPORTED;
  }
  if (written) *written = bytes;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmul(cublasLtHandle_t, cublasLtMatmulDesc_t d, const void* alpha_p, const void* a_p,
                              cublasLtMatrixLayout_t a, const void* b_p, cublasLtMatrixLayout_t b, const void* beta_p,
                              const void* c_p, cublasLtMatrixLayout_t c, void* d_p, cublasLtMatrixLayout_t dl,
                              const cublasLtMatmulAlgo_t* algo, void*, size_t, cudaStream_t) {
  if (matmul_fails) return CUBLAS_STATUS_EXECUTION_FAILED;
  const Layout &A = *layout(a), &B = *layout(b), &C = *layout(c), &D = *layout(dl);
  const Desc& ds = *desc(d);
  AlgoInfo info;
  std::memcpy(&info, algo, sizeof info);
  if (info.magic != kMagic) return CUBLAS_STATUS_INVALID_VALUE;
  if (alignment(a_p) < info.align[0] || alignment(b_p) < info.align[1] || alignment(c_p) < info.align[2] ||
      alignment(d_p) < info.align[3])
    return CUBLAS_STATUS_INVALID_VALUE;
  const bool gelu_aux = is_gelu_aux(ds.epilogue), dgelu = ds.epilogue == CUBLASLT_EPILOGUE_DGELU;
  if ((gelu_aux || dgelu) && (!ds.aux || alignment(ds.aux) < info.aux_align)) return CUBLAS_STATUS_INVALID_VALUE;
  const bool ta = ds.trans_a != CUBLAS_OP_N, tb = ds.trans_b != CUBLAS_OP_N;
  const int64_t m = static_cast<int64_t>(ta ? A.cols : A.rows), k = static_cast<int64_t>(ta ? A.rows : A.cols);
  const int64_t n = static_cast<int64_t>(tb ? B.rows : B.cols);
  if (static_cast<int64_t>(tb ? B.cols : B.rows) != k || static_cast<int64_t>(D.rows) != m ||
      static_cast<int64_t>(D.cols) != n)
    return CUBLAS_STATUS_INVALID_VALUE;
  float alpha, beta;
  std::memcpy(&alpha, alpha_p, 4);
  std::memcpy(&beta, beta_p, 4);
  const bool bias = has_bias(ds.epilogue), bgrad = ds.epilogue == CUBLASLT_EPILOGUE_BGRADB;
  if ((bias || bgrad) && !ds.bias) return CUBLAS_STATUS_INVALID_VALUE;
  // op(A) as m rows of k and op(B) as n rows of k, widened once, so each output is one
  // contiguous dot product.
  std::vector<float> opa(static_cast<size_t>(m * k)), opb(static_cast<size_t>(n * k));
  for (int64_t i = 0; i < m; ++i)
    for (int64_t l = 0; l < k; ++l) opa[static_cast<size_t>(i * k + l)] = load(a_p, A.type, ta ? l + i * A.ld : i + l * A.ld);
  for (int64_t j = 0; j < n; ++j)
    for (int64_t l = 0; l < k; ++l) opb[static_cast<size_t>(j * k + l)] = load(b_p, B.type, tb ? j + l * B.ld : l + j * B.ld);
  std::vector<float> out(static_cast<size_t>(m * n));
  for (int64_t j = 0; j < n; ++j)
    for (int64_t i = 0; i < m; ++i) {
      const float* x = &opa[static_cast<size_t>(i * k)];
      const float* y = &opb[static_cast<size_t>(j * k)];
      float sum = 0.0f;
      for (int64_t l = 0; l < k; ++l) sum += x[l] * y[l];
      float v = alpha * sum;
      if (beta != 0.0f) v += beta * load(c_p, C.type, i + j * C.ld);
      if (bias) v += load(ds.bias, D.type, i);
      if (gelu_aux) {
        store(const_cast<void*>(ds.aux), D.type, i + j * ds.aux_ld, v);
        v = keel::gelu(v);
      } else if (dgelu) {
        v *= keel::gelu_grad(load(ds.aux, D.type, i + j * ds.aux_ld));
      }
      out[static_cast<size_t>(i + j * m)] = v;
    }
  for (int64_t j = 0; j < n; ++j)
    for (int64_t i = 0; i < m; ++i) store(d_p, D.type, i + j * D.ld, out[static_cast<size_t>(i + j * m)]);
  if (bgrad)
    for (int64_t j = 0; j < n; ++j) {
      float sum = 0.0f;
      for (int64_t l = 0; l < k; ++l) sum += opb[static_cast<size_t>(j * k + l)];
      store(const_cast<void*>(ds.bias), D.type, j, sum);
    }
  return CUBLAS_STATUS_SUCCESS;
}

}  // extern "C"
