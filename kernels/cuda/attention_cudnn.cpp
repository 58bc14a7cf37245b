// Causal attention through cuDNN's SDPA graphs (attention_cudnn.h says what is given to cuDNN
// and what is not). Built with the cuDNN frontend's headers when CMake finds them
// (KEEL_WITH_CUDNN); without them, and in the CUDA emulator's build, only the refusal rules and
// a create_cudnn_attention that says why there is no cuDNN.
#include "kernels/cuda/attention_cudnn.h"

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "kernels/cuda/cuda_backend.h"

#if KEEL_WITH_CUDNN
#include <dlfcn.h>

#include <algorithm>
#include <initializer_list>
#include <map>
#include <memory>
#include <set>
#include <tuple>
#include <unordered_map>

#include <cudnn_frontend.h>

#include "kernels/cuda/cuda_check.h"

// The frontend's dynamic loading reads libcudnn's symbols through this handle (set below).
namespace cudnn_frontend {
void* cudnn_dlhandle = nullptr;
}
#endif

namespace keel::cuda {

std::string cudnn_attention_refusal(const AttnShape& s, DType qkv, DType out) {
  if (qkv != DType::BF16 && qkv != DType::F16) return "fp32 storage (cuDNN's flash attention takes bf16 and fp16)";
  if (out != qkv) return "operands of different dtypes";
  if (!s.positions.empty()) return "document masking (not given to cuDNN)";
  if (!s.alibi_slopes.empty()) return "ALiBi (cuDNN computes its own slopes, not a tensor-parallel rank's slice)";
  if (s.head_dim % 8 != 0 || s.head_dim > 256)
    return "head_dim " + std::to_string(s.head_dim) + " (cuDNN takes multiples of 8 up to 256)";
  return "";
}

#if !KEEL_WITH_CUDNN

static const char* not_built() {
#ifdef KEEL_CUDA_EMULATOR
  return "the CUDA emulator has no cuDNN";
#else
  return "keel was built without the cuDNN frontend headers (scripts/fetch_cudnn_frontend.py, then configure again)";
#endif
}

CudnnAttention* create_cudnn_attention(CudaBackend&, int64_t, std::string* why_not) {
  *why_not = not_built();
  return nullptr;
}
void destroy_cudnn_attention(CudnnAttention*) noexcept {}
bool cudnn_attention_forward(CudnnAttention&, const Tensor&, const Tensor&, const Tensor&, const AttnShape&) {
  return false;
}
bool cudnn_attention_backward(CudnnAttention&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                              const Tensor&, const AttnShape&) {
  return false;
}
int64_t cudnn_attention_calls(const CudnnAttention*) { return 0; }
std::string cudnn_attention_describe(const CudnnAttention*) { return "cudnn (not built)"; }
std::string cudnn_attention_check_graphs(const AttnShape&, DType, int) { return std::string("no cuDNN: ") + not_built(); }

#else

namespace fe = cudnn_frontend;

namespace {

// Tensor uids of the variant packs.
enum Uid : int64_t { kQ = 1, kK, kV, kO, kStats, kDO, kDQ, kDK, kDV };

// What decides a call's graphs, or why cuDNN is not given it: B, T, n_heads, n_kv_heads,
// head_dim, window, the qkv and out dtypes, documents, ALiBi.
using GraphKey = std::tuple<int, int, int, int, int, int, DType, DType, bool, bool>;

// Both graphs of one shape, or why cuDNN did not take it.
struct ShapeGraphs {
  std::shared_ptr<fe::graph::Graph> forward, backward;
  int64_t workspace = 0;  // bytes, the larger of the two
  std::string refused;    // non-empty: keel's kernels run this shape
};

std::string shape_text(const AttnShape& s, DType dt) {
  return std::string(dtype_name(dt)) + " " + attn_str(s);
}

struct GraphPair {
  std::shared_ptr<fe::graph::Graph> forward, backward;
};

// The forward and backward graphs of shape s, described but not yet validated or built. sm > 0:
// for a GPU of that compute capability (the nodes copy it when they are added), else the device's.
GraphPair describe_graphs(const AttnShape& s, DType dt, bool deterministic, int sm = 0) {
  const fe::DataType_t io = dt == DType::BF16 ? fe::DataType_t::BFLOAT16 : fe::DataType_t::HALF;
  const int64_t B = s.B, T = s.T, nh = s.n_heads, nkv = s.n_kv_heads, hd = s.head_dim;
  const int64_t C = s.qkv_cols(), OC = nh * hd;
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(hd)));  // as keel's kernels
  // Row n = b T + t of a packed matrix with `cols` columns holds head h at column h hd.
  auto rows_of = [&](const char* name, int64_t uid, int64_t heads, int64_t cols) {
    return fe::graph::Tensor_attributes().set_name(name).set_uid(uid).set_dim({B, heads, T, hd}).set_stride(
        {T * cols, hd, cols, 1});
  };
  auto new_graph = [&] {
    auto g = std::make_shared<fe::graph::Graph>();
    if (sm > 0) g->set_sm_version(sm);
    g->set_io_data_type(io).set_intermediate_data_type(fe::DataType_t::FLOAT).set_compute_data_type(
        fe::DataType_t::FLOAT);
    return g;
  };
  GraphPair p{new_graph(), new_graph()};
  {
    fe::graph::Graph& g = *p.forward;
    auto q = g.tensor(rows_of("q", kQ, nh, C)), k = g.tensor(rows_of("k", kK, nkv, C)),
         v = g.tensor(rows_of("v", kV, nkv, C));
    auto attrs = fe::graph::SDPA_attributes().set_name("attention").set_generate_stats(true).set_causal_mask(true)
                     .set_attn_scale(scale);
    if (s.window > 0) attrs.set_sliding_window_length(s.window);
    auto [o, stats] = g.sdpa(q, k, v, attrs);
    o->set_output(true).set_uid(kO).set_dim({B, nh, T, hd}).set_stride({T * OC, hd, OC, 1});
    stats->set_output(true).set_uid(kStats).set_dim({B, nh, T, 1}).set_stride({nh * T, T, 1, 1}).set_data_type(
        fe::DataType_t::FLOAT);
  }
  {
    fe::graph::Graph& g = *p.backward;
    auto q = g.tensor(rows_of("q", kQ, nh, C)), k = g.tensor(rows_of("k", kK, nkv, C)),
         v = g.tensor(rows_of("v", kV, nkv, C));
    auto o = g.tensor(rows_of("o", kO, nh, OC)), dout = g.tensor(rows_of("dout", kDO, nh, OC));
    auto stats = g.tensor(fe::graph::Tensor_attributes()
                              .set_name("stats")
                              .set_uid(kStats)
                              .set_dim({B, nh, T, 1})
                              .set_stride({nh * T, T, 1, 1})
                              .set_data_type(fe::DataType_t::FLOAT));
    auto attrs = fe::graph::SDPA_backward_attributes()
                     .set_name("attention_backward")
                     .set_causal_mask(true)
                     .set_attn_scale(scale)
                     .set_deterministic_algorithm(deterministic);
    if (s.window > 0) attrs.set_sliding_window_length(s.window);
    auto [dq, dk, dv] = g.sdpa_backward(q, k, v, o, dout, stats, attrs);
    dq->set_output(true).set_uid(kDQ).set_dim({B, nh, T, hd}).set_stride({T * C, hd, C, 1});
    dk->set_output(true).set_uid(kDK).set_dim({B, nkv, T, hd}).set_stride({T * C, hd, C, 1});
    dv->set_output(true).set_uid(kDV).set_dim({B, nkv, T, hd}).set_stride({T * C, hd, C, 1});
  }
  return p;
}

}  // namespace

struct CudnnAttention {
  CudaBackend& be;
  cudnnHandle_t handle = nullptr;
  bool deterministic = true;
  int64_t workspace_cap = 0;  // bytes, KEEL_CUDNN_WORKSPACE_MB
  int64_t calls = 0;  // calls cuDNN ran (tests check that it was cuDNN)
  std::map<GraphKey, ShapeGraphs> graphs;
  std::set<std::string> told;  // reasons already written to stderr

  explicit CudnnAttention(CudaBackend& b) : be(b) {}
  ~CudnnAttention() {
    graphs.clear();
    if (handle) fe::detail::destroy_handle(handle);
  }

  void tell_once(const std::string& what) {
    if (told.insert(what).second) std::fprintf(stderr, "keel: KEEL_ATTENTION=cudnn: %s\n", what.c_str());
  }

  // The graphs of a call (built on its shape's first call; a refusal, keel's or cuDNN's, is kept
  // and told once), so that later calls of the shape cost one lookup.
  const ShapeGraphs& graphs_for(const AttnShape& s, DType dt, DType out) {
    const GraphKey key{s.B, s.T, s.n_heads, s.n_kv_heads, s.head_dim, s.window, dt, out,
                       !s.positions.empty(), !s.alibi_slopes.empty()};
    auto it = graphs.find(key);
    if (it != graphs.end()) return it->second;
    ShapeGraphs g;
    g.refused = cudnn_attention_refusal(s, dt, out);
    if (g.refused.empty()) {
      try {
        if (std::string r = build(s, dt, g); !r.empty()) g.refused = "cuDNN refused it: " + r;
      } catch (const std::exception& e) {  // the frontend throws where a symbol or library is missing
        g.refused = std::string("cuDNN refused it: ") + e.what();
      }
    }
    if (!g.refused.empty()) {
      g.forward.reset();
      g.backward.reset();
      tell_once("keel's kernels run " + shape_text(s, dt) + ": " + g.refused);
    }
    return graphs.emplace(key, std::move(g)).first->second;
  }

 private:
  // Builds both graphs of shape s into g; returns "" or cuDNN's reason for refusing.
  std::string build(const AttnShape& s, DType dt, ShapeGraphs& g) {
    GraphPair p = describe_graphs(s, dt, deterministic);
    for (auto [graph, which] : {std::pair{p.forward.get(), "forward"}, std::pair{p.backward.get(), "backward"}}) {
      auto step = [&](fe::error_t e, const char* what) -> std::string {
        return e.is_good() ? std::string() : std::string(which) + ", " + what + ": " + e.get_message();
      };
      std::string r;
      if (!(r = step(graph->validate(), "validate")).empty()) return r;
      if (!(r = step(graph->build_operation_graph(handle), "operation graph")).empty()) return r;
      if (!(r = step(graph->create_execution_plans({fe::HeurMode_t::A, fe::HeurMode_t::FALLBACK}), "plans")).empty())
        return r;
      if (!(r = step(graph->check_support(), "support")).empty()) return r;
      if (!(r = step(graph->build_plans(), "build")).empty()) return r;
      int64_t ws = 0;
      if (!(r = step(graph->get_workspace_size(ws), "workspace")).empty()) return r;
      g.workspace = std::max(g.workspace, ws);
    }
    if (g.workspace > workspace_cap)
      return "its graphs need " + std::to_string(g.workspace >> 20) + " MiB of workspace, more than KEEL_CUDNN_WORKSPACE_MB (" +
             std::to_string(workspace_cap >> 20) + ")";
    g.forward = std::move(p.forward);
    g.backward = std::move(p.backward);
    return "";
  }

 public:
  // Runs `graph` on the pointers by uid; a failure names the op and the tensors' shapes.
  void execute(const fe::graph::Graph& graph, int64_t workspace, std::initializer_list<std::pair<int64_t, void*>> ptrs,
               const char* op, std::initializer_list<Named> tensors) {
    pack.clear();  // kept between calls: no allocation once it has held a backward's
    for (const auto& [uid, p] : ptrs) pack[uid] = p;
    void* ws = workspace > 0 ? be.scratch(static_cast<size_t>(workspace), op) : nullptr;
    fe::error_t e = graph.execute(handle, pack, ws);
    if (ws) be.release(ws);
    if (!e.is_good())
      throw std::runtime_error(std::string("CudaBackend::") + op + ": cuDNN's graph failed to run: " + e.get_message() +
                               " (" + describe(tensors) + ")");
    ++calls;
  }

 private:
  std::unordered_map<int64_t, void*> pack;  // the variant pack of the last call
};

// libcudnn, opened once for the process (KEEL_CUDNN_LIB: a path or name instead of libcudnn.so.9).
static bool open_cudnn(std::string* why_not) {
  static std::string error;
  static const bool opened = [] {
    // The frontend opens libcudart itself: the 13 that keel runs on, not a 12 that may be beside it.
    setenv("CUDNN_FRONTEND_CUDART_LIB_NAME", "libcudart.so.13", 0);
    const char* name = std::getenv("KEEL_CUDNN_LIB");
    for (const char* lib : {name && *name ? name : "libcudnn.so.9", "libcudnn.so"}) {
      if (void* h = dlopen(lib, RTLD_NOW | RTLD_LOCAL)) {
        fe::cudnn_dlhandle = h;
        return true;
      }
      const char* e = dlerror();
      if (error.empty()) error = std::string("cannot load ") + lib + ": " + (e ? e : "unknown error");
      if (name && *name) break;  // the one asked for, or nothing
    }
    return false;
  }();
  if (!opened) *why_not = error + " (install cuDNN 9, or point LD_LIBRARY_PATH or KEEL_CUDNN_LIB at it)";
  return opened;
}

CudnnAttention* create_cudnn_attention(CudaBackend& be, int64_t workspace_cap, std::string* why_not) {
  if (!open_cudnn(why_not)) return nullptr;
  auto a = std::make_unique<CudnnAttention>(be);
  try {
    if (fe::detail::create_handle(&a->handle) != CUDNN_STATUS_SUCCESS) {
      *why_not = "cudnnCreate failed";
      return nullptr;
    }
    if (fe::detail::set_stream(a->handle, be.stream()) != CUDNN_STATUS_SUCCESS) {
      *why_not = "cudnnSetStream failed";
      return nullptr;
    }
  } catch (const std::exception& e) {
    *why_not = e.what();
    return nullptr;
  }
  const char* det = std::getenv("KEEL_CUDNN_DETERMINISTIC");
  a->deterministic = !(det && std::strcmp(det, "0") == 0);
  a->workspace_cap = workspace_cap;
  // On Hopper, cuDNN (9.25 and later) serves a deterministic backward whose T x T dP workspace
  // would pass this limit by an ordered dq accumulation instead, with workspace linear in T. The
  // variable is the process's: the first cuDNN backend's cap (or the user's own setting) holds.
  setenv("CUDNN_FRONTEND_ATTN_DP_WORKSPACE_LIMIT", std::to_string(a->workspace_cap).c_str(), 0);
  return a.release();
}

void destroy_cudnn_attention(CudnnAttention* a) noexcept { delete a; }

std::string cudnn_attention_check_graphs(const AttnShape& s, DType dt, int sm) {
  std::string why_not;
  if (!open_cudnn(&why_not)) return "no cuDNN: " + why_not;
  try {
    GraphPair p = describe_graphs(s, dt, true, sm);
    for (auto [graph, which] : {std::pair{p.forward.get(), "forward"}, std::pair{p.backward.get(), "backward"}}) {
      if (fe::error_t e = graph->validate(); !e.is_good()) return std::string(which) + ": " + e.get_message();
    }
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

int64_t cudnn_attention_calls(const CudnnAttention* a) { return a ? a->calls : 0; }

std::string cudnn_attention_describe(const CudnnAttention* a) {
  std::string d = "cudnn " + std::to_string(fe::detail::get_backend_version());
  if (a && !a->deterministic) d += " nondeterministic";
  return d;
}

// The element `cols` columns into a packed matrix's first row.
static void* at_col(const Tensor& t, int64_t cols) {
  return static_cast<char*>(t.data) + cols * static_cast<int64_t>(dtype_size(t.dtype));
}

// cuDNN reads and writes its operands in 16-byte vectors (head_dim a multiple of 8 keeps every
// head's start aligned when the matrix is).
static bool aligned(std::initializer_list<const Tensor*> ts) {
  for (const Tensor* t : ts)
    if (alignment_of(t->data) < 16) return false;
  return true;
}

bool cudnn_attention_forward(CudnnAttention& a, const Tensor& out, const Tensor& lse, const Tensor& qkv,
                             const AttnShape& s) {
  const ShapeGraphs& g = a.graphs_for(s, qkv.dtype, out.dtype);
  if (!g.refused.empty()) return false;
  if (!aligned({&qkv, &out, &lse})) {
    a.tell_once("operands not 16-byte aligned: keel's kernels run these calls");
    return false;
  }
  const int64_t k_col = s.n_heads * s.head_dim, v_col = (s.n_heads + s.n_kv_heads) * s.head_dim;
  a.execute(*g.forward, g.workspace,
            {{kQ, qkv.data}, {kK, at_col(qkv, k_col)}, {kV, at_col(qkv, v_col)}, {kO, out.data}, {kStats, lse.data}},
            "attention_forward", {{"out", out}, {"lse", lse}, {"qkv", qkv}});
  return true;
}

bool cudnn_attention_backward(CudnnAttention& a, const Tensor& dqkv, const Tensor& dout, const Tensor& qkv,
                              const Tensor& out, const Tensor& lse, const AttnShape& s) {
  const ShapeGraphs& g = a.graphs_for(s, qkv.dtype, out.dtype);
  if (!g.refused.empty()) return false;
  if (dqkv.dtype != qkv.dtype || dout.dtype != qkv.dtype) {
    a.tell_once("dqkv or dout of another dtype than qkv: keel's kernels run these calls");
    return false;
  }
  if (!aligned({&dqkv, &dout, &qkv, &out, &lse})) {
    a.tell_once("operands not 16-byte aligned: keel's kernels run these calls");
    return false;
  }
  const int64_t k_col = s.n_heads * s.head_dim, v_col = (s.n_heads + s.n_kv_heads) * s.head_dim;
  a.execute(*g.backward, g.workspace,
            {{kQ, qkv.data}, {kK, at_col(qkv, k_col)}, {kV, at_col(qkv, v_col)}, {kO, out.data}, {kDO, dout.data},
             {kStats, lse.data}, {kDQ, dqkv.data}, {kDK, at_col(dqkv, k_col)}, {kDV, at_col(dqkv, v_col)}},
            "attention_backward", {{"dqkv", dqkv}, {"dout", dout}, {"qkv", qkv}});
  return true;
}

#endif  // KEEL_WITH_CUDNN

}  // namespace keel::cuda
