#include "kernels/guarded_backend.h"

#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>

namespace keel {

namespace {

// Live guarded allocations of every GuardedBackend (start -> mapped bytes), for the handler.
std::mutex g_mu;
std::map<char*, size_t>* g_live = nullptr;
struct sigaction g_previous {};

void on_fault(int sig, siginfo_t* info, void* ctx) {
  char* addr = static_cast<char*>(info->si_addr);
  if (g_live) {
    auto it = g_live->upper_bound(addr);
    if (it != g_live->begin()) {
      --it;
      if (addr >= it->first && addr < it->first + it->second) {
        char msg[320];
        const int n = std::snprintf(msg, sizeof msg,
                                    "keel: host code touched backend memory outside a backend op (byte %lld of a "
                                    "%lld-byte allocation at %p). On a GPU this is a device pointer: move the data "
                                    "with copy_to_host / copy_from_host or do the work in a backend op.\n",
                                    static_cast<long long>(addr - it->first), static_cast<long long>(it->second),
                                    static_cast<void*>(it->first));
        if (n > 0) (void)!write(2, msg, static_cast<size_t>(n));
      }
    }
  }
  // Let the previous handler (or the default action) report it.
  sigaction(sig, &g_previous, nullptr);
  raise(sig);
  (void)ctx;
}

class GuardedBackend final : public Backend {
 public:
  explicit GuardedBackend(std::unique_ptr<Backend> inner) : inner_(std::move(inner)) {
    if (inner_->device() != Device::CPU) throw std::invalid_argument("make_guarded_backend: needs a CPU backend");
    std::lock_guard<std::mutex> lock(g_mu);
    if (!g_live) {
      g_live = new std::map<char*, size_t>();
      struct sigaction sa {};
      sa.sa_sigaction = on_fault;
      sa.sa_flags = SA_SIGINFO;
      sigemptyset(&sa.sa_mask);
      sigaction(SIGSEGV, &sa, &g_previous);
    }
  }
  ~GuardedBackend() override {
    std::lock_guard<std::mutex> lock(g_mu);
    for (auto& [p, n] : mine_) {
      g_live->erase(p);
      munmap(p, n);
    }
  }

  Device device() const override { return Device::CPU; }
  std::string name() const override { return inner_->name() + ", memory guarded between ops"; }
  std::string arithmetic() const override { return inner_->arithmetic(); }

  void* allocate(size_t bytes) override {
    const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    const size_t n = (std::max<size_t>(bytes, 1) + page - 1) / page * page;
    void* p = mmap(nullptr, n, open_ > 0 ? PROT_READ | PROT_WRITE : PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) throw std::runtime_error("GuardedBackend::allocate: mmap of " + std::to_string(n) + " bytes failed");
    std::lock_guard<std::mutex> lock(g_mu);
    mine_[static_cast<char*>(p)] = n;
    (*g_live)[static_cast<char*>(p)] = n;
    used_ += n;
    peak_ = std::max(peak_, used_);
    return p;  // anonymous mappings are zero-filled and page aligned
  }
  void release(void* p) override {
    if (!p) return;
    std::lock_guard<std::mutex> lock(g_mu);
    auto it = mine_.find(static_cast<char*>(p));
    if (it == mine_.end()) throw std::invalid_argument("GuardedBackend::release: not an allocation of this backend");
    g_live->erase(it->first);
    munmap(it->first, it->second);
    used_ -= it->second;
    mine_.erase(it);
  }
  size_t used_bytes() const override { return used_; }  // whole pages, as mapped
  size_t peak_bytes() const override { return peak_; }

  // Ops: the backend's memory is open while the inner backend runs.
#define KEEL_GUARDED(call) \
  Open open(*this);        \
  return inner_->call
  void copy_to_host(void* dst, const Tensor& src) override { KEEL_GUARDED(copy_to_host(dst, src)); }
  void copy_from_host(const Tensor& dst, const void* src) override { KEEL_GUARDED(copy_from_host(dst, src)); }
  void synchronize() override { inner_->synchronize(); }
  void convert(const Tensor& dst, const Tensor& src) override { KEEL_GUARDED(convert(dst, src)); }
  void fill(const Tensor& dst, float value) override { KEEL_GUARDED(fill(dst, value)); }
  void add(const Tensor& out, const Tensor& a, const Tensor& b) override { KEEL_GUARDED(add(out, a, b)); }
  void scale(const Tensor& x, float s) override { KEEL_GUARDED(scale(x, s)); }
  void matmul(const Tensor& out, const Tensor& a, const Tensor& b, bool trans_a, bool trans_b, bool accumulate,
              const Tensor* bias) override {
    KEEL_GUARDED(matmul(out, a, b, trans_a, trans_b, accumulate, bias));
  }
  void bias_backward(const Tensor& dbias, const Tensor& dout, bool accumulate) override {
    KEEL_GUARDED(bias_backward(dbias, dout, accumulate));
  }
  void embedding_forward(const Tensor& out, const Tensor& tokens, const Tensor& tok_embed, const Tensor& pos_embed,
                         int T, int64_t vocab_start, const Tensor& positions) override {
    KEEL_GUARDED(embedding_forward(out, tokens, tok_embed, pos_embed, T, vocab_start, positions));
  }
  void embedding_backward(const Tensor& dtok_embed, const Tensor& dpos_embed, const Tensor& dout,
                          const Tensor& tokens, int T, int64_t vocab_start, const Tensor& positions) override {
    KEEL_GUARDED(embedding_backward(dtok_embed, dpos_embed, dout, tokens, T, vocab_start, positions));
  }
  void layernorm_forward(const Tensor& out, const Tensor& mean, const Tensor& rstd, const Tensor& in,
                         const Tensor& weight, const Tensor& bias, float eps) override {
    KEEL_GUARDED(layernorm_forward(out, mean, rstd, in, weight, bias, eps));
  }
  void layernorm_backward(const Tensor& din, const Tensor& dweight, const Tensor& dbias, const Tensor& dout,
                          const Tensor& in, const Tensor& weight, const Tensor& mean, const Tensor& rstd,
                          bool accumulate_din, bool accumulate_dparams) override {
    KEEL_GUARDED(
        layernorm_backward(din, dweight, dbias, dout, in, weight, mean, rstd, accumulate_din, accumulate_dparams));
  }
  void rmsnorm_forward(const Tensor& out, const Tensor& rstd, const Tensor& in, const Tensor& weight,
                       float eps) override {
    KEEL_GUARDED(rmsnorm_forward(out, rstd, in, weight, eps));
  }
  void rmsnorm_backward(const Tensor& din, const Tensor& dweight, const Tensor& dout, const Tensor& in,
                        const Tensor& weight, const Tensor& rstd, bool accumulate_din,
                        bool accumulate_dparams) override {
    KEEL_GUARDED(rmsnorm_backward(din, dweight, dout, in, weight, rstd, accumulate_din, accumulate_dparams));
  }
  void gelu_forward(const Tensor& out, const Tensor& in) override { KEEL_GUARDED(gelu_forward(out, in)); }
  void gelu_backward(const Tensor& din, const Tensor& dout, const Tensor& in) override {
    KEEL_GUARDED(gelu_backward(din, dout, in));
  }
  void matmul_gelu(const Tensor& act, const Tensor& pre, const Tensor& a, const Tensor& b, bool trans_a, bool trans_b,
                   const Tensor* bias) override {
    KEEL_GUARDED(matmul_gelu(act, pre, a, b, trans_a, trans_b, bias));
  }
  void matmul_gelu_backward(const Tensor& din, const Tensor& a, const Tensor& b, bool trans_a, bool trans_b,
                            const Tensor& pre) override {
    KEEL_GUARDED(matmul_gelu_backward(din, a, b, trans_a, trans_b, pre));
  }
  void matmul_residual(const Tensor& out, const Tensor& residual, const Tensor& a, const Tensor& b, bool trans_a,
                       bool trans_b, const Tensor* bias) override {
    KEEL_GUARDED(matmul_residual(out, residual, a, b, trans_a, trans_b, bias));
  }
  void matmul_bias_grad(const Tensor& dweight, const Tensor& dbias, const Tensor& dout, const Tensor& in,
                        bool accumulate_w, bool accumulate_b) override {
    KEEL_GUARDED(matmul_bias_grad(dweight, dbias, dout, in, accumulate_w, accumulate_b));
  }
  void swiglu_forward(const Tensor& out, const Tensor& in) override { KEEL_GUARDED(swiglu_forward(out, in)); }
  void swiglu_backward(const Tensor& din, const Tensor& dout, const Tensor& in) override {
    KEEL_GUARDED(swiglu_backward(din, dout, in));
  }
  void swiglu_backward_rebuild(const Tensor& din, const Tensor& out, const Tensor& dout, const Tensor& in) override {
    KEEL_GUARDED(swiglu_backward_rebuild(din, out, dout, in));
  }
  void rope_forward(const Tensor& qkv, const AttnShape& s, const Rope& rope) override { KEEL_GUARDED(rope_forward(qkv, s, rope)); }
  void rope_backward(const Tensor& dqkv, const AttnShape& s, const Rope& rope) override {
    KEEL_GUARDED(rope_backward(dqkv, s, rope));
  }
  void qk_heads_copy(const Tensor& heads, const Tensor& qkv, const AttnShape& s, bool to_heads) override {
    KEEL_GUARDED(qk_heads_copy(heads, qkv, s, to_heads));
  }
  void attention_forward(const Tensor& out, const Tensor& lse, const Tensor& qkv, const AttnShape& s) override {
    KEEL_GUARDED(attention_forward(out, lse, qkv, s));
  }
  void attention_backward(const Tensor& dqkv, const Tensor& dout, const Tensor& qkv, const Tensor& out,
                          const Tensor& lse, const AttnShape& s) override {
    KEEL_GUARDED(attention_backward(dqkv, dout, qkv, out, lse, s));
  }
  void attention_decode(const Tensor& out, const Tensor& qkv, const Tensor& k_cache, const Tensor& v_cache,
                        const AttnShape& s, int64_t pos, const Rope& rope) override {
    KEEL_GUARDED(attention_decode(out, qkv, k_cache, v_cache, s, pos, rope));
  }
  void xent_stats(const Tensor& row_max, const Tensor& sumexp, const Tensor& target_logit, const Tensor& logits,
                  const Tensor& targets, int64_t vocab_start) override {
    KEEL_GUARDED(xent_stats(row_max, sumexp, target_logit, logits, targets, vocab_start));
  }
  void xent_rescale(const Tensor& sumexp, const Tensor& local_max, const Tensor& global_max) override {
    KEEL_GUARDED(xent_rescale(sumexp, local_max, global_max));
  }
  void xent_loss(const Tensor& losses, const Tensor& lse, const Tensor& row_max, const Tensor& sumexp,
                 const Tensor& target_logit, const Tensor& targets) override {
    KEEL_GUARDED(xent_loss(losses, lse, row_max, sumexp, target_logit, targets));
  }
  void xent_backward(const Tensor& logits, const Tensor& lse, const Tensor& targets, float dloss,
                     int64_t vocab_start) override {
    KEEL_GUARDED(xent_backward(logits, lse, targets, dloss, vocab_start));
  }
  void xent_loss_backward(const Tensor& losses, const Tensor& lse, const Tensor& row_max, const Tensor& sumexp,
                          const Tensor& target_logit, const Tensor& logits, const Tensor& targets,
                          float dloss) override {
    KEEL_GUARDED(xent_loss_backward(losses, lse, row_max, sumexp, target_logit, logits, targets, dloss));
  }
  void adamw(const Tensor& master, const Tensor& working, const Tensor& grad, const Tensor& m, const Tensor& v,
             const AdamWParams& p) override {
    KEEL_GUARDED(adamw(master, working, grad, m, v, p));
  }
  double sum(const Tensor& x) override { KEEL_GUARDED(sum(x)); }
  double sum_squares(const Tensor& x) override { KEEL_GUARDED(sum_squares(x)); }
  float max_abs(const Tensor& x) override { KEEL_GUARDED(max_abs(x)); }
  int64_t count_nonfinite(const Tensor& x) override { KEEL_GUARDED(count_nonfinite(x)); }
  int64_t count_zeros(const Tensor& x) override { KEEL_GUARDED(count_zeros(x)); }
  GradStats grad_stats(const Tensor& x) override { KEEL_GUARDED(grad_stats(x)); }
#undef KEEL_GUARDED

 private:
  // Opens every allocation for the duration of an op (ops do not nest, but be safe).
  struct Open {
    GuardedBackend& be;
    explicit Open(GuardedBackend& b) : be(b) {
      if (be.open_++ == 0) be.protect(PROT_READ | PROT_WRITE);
    }
    ~Open() {
      if (--be.open_ == 0) be.protect(PROT_NONE);
    }
  };
  void protect(int prot) {
    std::lock_guard<std::mutex> lock(g_mu);
    for (auto& [p, n] : mine_)
      if (mprotect(p, n, prot) != 0) std::perror("keel: GuardedBackend mprotect");
  }

  std::unique_ptr<Backend> inner_;
  std::map<char*, size_t> mine_;
  size_t used_ = 0, peak_ = 0;  // bytes of mine_
  int open_ = 0;
};

}  // namespace

std::unique_ptr<Backend> make_guarded_backend(std::unique_ptr<Backend> inner) {
  return std::make_unique<GuardedBackend>(std::move(inner));
}

bool guard_backend_memory_requested() {
  const char* v = std::getenv("KEEL_GUARD_BACKEND_MEMORY");
  return v && *v && std::strcmp(v, "0") != 0;
}

}  // namespace keel
