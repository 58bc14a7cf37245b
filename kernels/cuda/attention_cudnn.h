// Causal attention through cuDNN's fused SDPA (flash attention) graphs, the CUDA backend's
// alternative to its own fused kernels: KEEL_ATTENTION=cudnn.
//
// cuDNN is loaded at run time (dlopen of libcudnn.so.9 through the cuDNN frontend's dynamic
// loading), so keel neither links it nor needs it to start: where the library or the frontend
// headers (scripts/fetch_cudnn_frontend.py, at build time) are missing, every call falls back to
// keel's kernels and the backend says why once on stderr.
//
// What cuDNN is given. The packed qkv [B*T, (nh + 2 nkv) hd] is read in place as Q [B, nh, T, hd],
// K and V [B, nkv, T, hd] with strides (T C, hd, C, 1), C = qkv_cols(); out, dout likewise with
// C = nh hd; dq, dk, dv are written into dqkv's layout. lse [B, nh, T] is cuDNN's softmax
// statistics, the natural-log log-sum-exp of the scaled scores (the same quantity keel's kernels
// keep). Causal mask aligned top-left (row i sees keys j <= i), scale 1/sqrt(hd); with
// AttnShape::window, cuDNN's left bound keeps j + window > i, keel's j > i - window. The backward
// is asked for cuDNN's deterministic algorithm (no atomics in dq) unless KEEL_CUDNN_DETERMINISTIC=0,
// which gives up keel's bit-identical repeat runs for whatever that algorithm costs. On Hopper that
// algorithm stages dP in a bf16 workspace of B x n_heads x T x T (1 GiB for the 1B Llama benchmark,
// like keel's staged dS); a shape whose graphs need more workspace than KEEL_CUDNN_WORKSPACE_MB
// (default 4096) is left to keel's kernels, said once, rather than risk running out of memory
// (cuDNN 9.25 and later first switch to an ordered dq accumulation with workspace linear in T).
//
// What it is not given (keel's kernels run instead): fp32 storage, operands of different dtypes,
// document masking (positions), ALiBi (cuDNN computes its own slopes, not a tensor-parallel
// rank's slice), head_dim not a multiple of 8 or above 256, and any shape whose graph cuDNN
// refuses (its message is told once per shape). A shape is taken only when both its forward and
// its backward graph build, so that the statistics a forward leaves are always read by the same
// library's backward.
#pragma once

#include <cstdint>
#include <string>

#include "kernels/backend.h"

namespace keel {

class CudaBackend;

namespace cuda {

// Why an attention call with these operand dtypes cannot go to cuDNN ("" when it can, as far as
// keel's side goes; the graph build may still refuse it).
std::string cudnn_attention_refusal(const AttnShape& s, DType qkv, DType out);

struct CudnnAttention;  // library handle, cuDNN handle, built graphs per shape (attention_cudnn.cpp)

// The cuDNN attention of `be`, taking shapes whose graphs need at most workspace_cap bytes of
// workspace, or nullptr with *why_not set where cuDNN cannot be used at all: not built in (no
// frontend headers, the CUDA emulator) or the library not loadable.
CudnnAttention* create_cudnn_attention(CudaBackend& be, int64_t workspace_cap, std::string* why_not);
void destroy_cudnn_attention(CudnnAttention* a) noexcept;

// Run the call through cuDNN and return true, or return false (nothing enqueued) where cuDNN
// does not take it: cudnn_attention_refusal, or the shape's graphs did not build (told once).
// Operands as CudaBackend::attention_forward / attention_backward, already checked there.
bool cudnn_attention_forward(CudnnAttention& a, const Tensor& out, const Tensor& lse, const Tensor& qkv,
                             const AttnShape& s);
bool cudnn_attention_backward(CudnnAttention& a, const Tensor& dqkv, const Tensor& dout, const Tensor& qkv,
                              const Tensor& out, const Tensor& lse, const AttnShape& s);
// Calls cuDNN has run (0 for nullptr): the tests check that it was cuDNN that answered.
int64_t cudnn_attention_calls(const CudnnAttention* a);
// What decides the bits of its results, for CudaBackend::arithmetic(): "cudnn <version>", and
// " nondeterministic" with KEEL_CUDNN_DETERMINISTIC=0.
std::string cudnn_attention_describe(const CudnnAttention* a);

// The cuDNN frontend's checks (validate(): shapes, strides, masks, what the library version
// supports) of the two graphs of shape s for a GPU of compute capability sm (90: H100), with no
// device: "" when they pass, else the message; "no cuDNN: ..." where cuDNN cannot be loaded.
std::string cudnn_attention_check_graphs(const AttnShape& s, DType dt, int sm);

}  // namespace cuda
}  // namespace keel
