#include "train/plan.h"

#include "model/transformer.h"
#include "train/format.h"
#include "train/parallel/grad_buckets.h"
#include "train/pipeline_schedule.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <limits>
#include <map>
#include <regex>
#include <sstream>

namespace keel::plan {

namespace {

std::string fmt(const char* f, double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, f, v);
  return buf;
}

// 1234567 -> "1,234,567"
std::string grouped(int64_t n) {
  std::string s = std::to_string(n < 0 ? -n : n), out;
  for (size_t i = 0; i < s.size(); ++i) {
    if (i > 0 && (s.size() - i) % 3 == 0) out += ',';
    out += s[i];
  }
  return n < 0 ? "-" + out : out;
}


std::string gb_dec(double bytes) { return fmt("%.2f GB", bytes / 1e9); }

// Right-aligned text table; the first column is left-aligned.
class Table {
 public:
  void row(std::vector<std::string> cells) { rows_.push_back(std::move(cells)); }
  std::string str(const std::string& indent = "  ") const {
    std::vector<size_t> w;
    for (const auto& r : rows_)
      for (size_t i = 0; i < r.size(); ++i) {
        if (w.size() <= i) w.push_back(0);
        w[i] = std::max(w[i], r[i].size());
      }
    std::string out;
    for (const auto& r : rows_) {
      std::string line = indent;
      for (size_t i = 0; i < r.size(); ++i) {
        const std::string pad(w[i] - r[i].size(), ' ');
        line += i == 0 ? r[i] + pad : "  " + pad + r[i];
      }
      while (!line.empty() && line.back() == ' ') line.pop_back();
      out += line + "\n";
    }
    return out;
  }

 private:
  std::vector<std::vector<std::string>> rows_;
};

std::vector<int64_t> divisors(int64_t n) {
  std::vector<int64_t> d;
  for (int64_t i = 1; i <= n; ++i)
    if (n % i == 0) d.push_back(i);
  return d;
}

// Fraction of the GPU a [rows x cols] GEMM output keeps busy: tiles of tile_rows x tile_cols
// are scheduled in waves of sm_count; partly empty tiles (tile quantization) and a partly empty
// last wave (wave quantization) are paid for in full.
double wave_efficiency(double rows, double cols, const Hardware& hw) {
  const double tiles = std::ceil(rows / hw.tile_rows) * std::ceil(cols / hw.tile_cols);
  const double waves = std::ceil(tiles / hw.sm_count);
  return rows * cols / (waves * hw.sm_count * hw.tile_rows * hw.tile_cols);
}

// Ring all-reduce: each rank sends 2 (n-1)/n of the buffer; reduce-scatter or all-gather: (n-1)/n.
double ring_allreduce_sent(double bytes, int64_t n) { return n > 1 ? 2.0 * (n - 1) / n * bytes : 0; }
double ring_half_sent(double bytes, int64_t n) { return n > 1 ? double(n - 1) / n * bytes : 0; }

}  // namespace

// ---------------------------------------------------------------------------------------------
// sizes

int64_t parse_memory_size(const std::string& text, bool allow_zero) {
  static const std::regex re(R"(^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$)");
  std::smatch mt;
  if (!std::regex_match(text, mt, re))
    throw ConfigError("memory size '" + text + "' is not a number with an optional unit (e.g. 80GiB, 80GB, 40G, 81920MiB)");
  std::string unit = mt[2].str();
  std::transform(unit.begin(), unit.end(), unit.begin(), [](unsigned char c) { return std::tolower(c); });
  // Binary (powers of 2) unless the unit is spelled as a decimal one (KB MB GB TB).
  static const std::map<std::string, double> units = {
      {"", 1},          {"b", 1},
      {"k", 0x1p10},    {"kib", 0x1p10}, {"kb", 1e3},
      {"m", 0x1p20},    {"mib", 0x1p20}, {"mb", 1e6},
      {"g", 0x1p30},    {"gib", 0x1p30}, {"gb", 1e9},
      {"t", 0x1p40},    {"tib", 0x1p40}, {"tb", 1e12},
  };
  auto it = units.find(unit);
  if (it == units.end())
    throw ConfigError("memory size '" + text + "': unknown unit '" + mt[2].str() +
                      "' (allowed: KiB MiB GiB TiB or K M G T = powers of 2; KB MB GB TB = powers of 10)");
  const double bytes = std::strtod(mt[1].str().c_str(), nullptr) * it->second;  // inf beyond a double
  if (allow_zero && bytes == 0) return 0;
  if (!(bytes >= 1))
    throw ConfigError("memory size '" + text + "' must be at least one byte" + (allow_zero ? " (or 0)" : ""));
  // 2^63 bytes and more do not fit an int64_t (the conversion would be undefined).
  if (bytes >= 0x1p63)
    throw ConfigError("memory size '" + text + "' is too large (allowed: less than 8388608TiB, 2^63 bytes)");
  return static_cast<int64_t>(std::llround(bytes));
}

std::string format_bytes(double bytes) {
  if (bytes >= kGiB) return fmt("%.2f GiB", bytes / kGiB);
  if (bytes >= 1 << 20) return fmt("%.1f MiB", bytes / (1 << 20));
  return fmt("%.1f KiB", bytes / 1024);
}

std::string Layout::str() const {
  return "tp=" + std::to_string(tp) + " pp=" + std::to_string(pp) + " dp=" + std::to_string(dp) +
         " mbs=" + std::to_string(mbs);
}

// ---------------------------------------------------------------------------------------------
// memory models

MemoryModel keel_memory_model(PrecisionMode mode) {
  MemoryModel m;
  m.chunked_logits = true;
  m.fused_gelu_backward = true;
  m.fused_residual_projection = true;
  m.gpu_attention = AttentionSettings{};  // the CUDA backend's defaults
  StateBytes& s = m.state;
  switch (mode) {
    case PrecisionMode::FP32:
      m.name = "keel fp32";
      s.weights = 4;  // the working copy is the master: nothing extra to shard
      s.master = 0;
      m.act_bytes = 4;
      s.dp_weight_comm = 4;
      break;
    case PrecisionMode::BF16UnsafeNoMaster:
      m.name = "keel bf16-unsafe-no-master";
      s.master = 0;
      break;
    case PrecisionMode::FP16: m.name = "keel fp16"; break;
    case PrecisionMode::BF16: m.name = "keel bf16"; break;
  }
  return m;
}

MemoryModel megatron_deepspeed_memory_model(bool fp32_grad_accum) {
  MemoryModel m;
  m.name = fp32_grad_accum ? "Megatron-DeepSpeed 2022, bf16 optimizer (fp32 grad accumulation)"
                           : "Megatron-DeepSpeed 2022, fp16";
  StateBytes& s = m.state;
  s.weights = 2;
  s.grads = fp32_grad_accum ? 2 + 4 : 2;  // half-precision param.grad (+ fp32 accumulation buffer)
  s.master = 4;
  s.moments = 8;
  s.grad_shard = 4;  // ZeRO's fp32 copy of its gradient partition, made at the optimizer step
  s.dp_grad_comm = 2;
  s.dp_weight_comm = 2;
  m.attn_score_bytes = 5;      // QK^T (2) + softmax probabilities (2) + dropout mask (1)
  m.logit_extra_bytes = 4;     // vocab-parallel cross entropy works on an fp32 copy
  m.comm_buffer_bytes = 2 * 5e8 * 2;  // reduce_bucket_size + allgather_bucket_size, fp16
  m.keeps_stage_output = true;
  return m;
}

// ---------------------------------------------------------------------------------------------
// the model

ModelConfig model_for_tp(const ModelConfig& m_in, int64_t tp) {
  ModelConfig m = m_in;
  if (m.pad_vocab_multiple > 1) {
    const int64_t unit = m.pad_vocab_multiple * tp;
    m.padded_vocab_size = (m.vocab_size + unit - 1) / unit * unit;
  } else {
    if (m.vocab_size % tp != 0)
      throw ConfigError("vocab " + std::to_string(m.vocab_size) + " not divisible by tp=" + std::to_string(tp) +
                        " (no pad_vocab_to_multiple_of)");
    m.padded_vocab_size = 0;
  }
  return m;
}

namespace seed_formula {
double layer_params(double h) { return 12 * h * h + 13 * h; }
double model_params(double l, double h, double s, double v) { return l * layer_params(h) + v * h + s * h + 2 * h; }
}  // namespace seed_formula

ModelCount count_model(const RunConfig& cfg) {
  const ModelConfig& m = cfg.model;
  ParamTable table(m);
  ModelCount c;
  c.exact = table.logical_numel();
  c.padded_vocab = m.embed_rows();
  for (const ParamSpec& p : table.params()) {
    if (p.layer >= 0) c.layers += p.logical_numel();
    else if (embedding_tensor(p)) c.embedding += p.logical_numel();
    else c.head += p.logical_numel();
  }
  c.per_layer = m.n_layers > 0 ? c.layers / m.n_layers : 0;
  if (m.is_gpt2() && m.ffn_hidden == 4 * m.d_model)
    c.gpt_formula = seed_formula::model_params(m.n_layers, m.d_model, m.max_seq_len, static_cast<double>(m.vocab_size));
  return c;
}

SeedAccounting seed_accounting(const ModelConfig& m, const Layout& l) {
  SeedAccounting s;
  s.layers_per_stage = (m.n_layers + l.pp - 1) / l.pp;
  s.embedding_per_gpu = static_cast<double>(m.vocab_size) * m.d_model / l.tp;
  s.layer_per_gpu = seed_formula::layer_params(m.d_model) / l.tp;
  s.without_embedding = s.layers_per_stage * s.layer_per_gpu;
  s.with_embedding = s.without_embedding + s.embedding_per_gpu;
  return s;
}

// ---------------------------------------------------------------------------------------------
// one layout

std::vector<StageSpan> stage_spans(int n_layers, int64_t stages, const PipelineSplit& split) {
  if (stages < 1) return {};
  if (!split.layers.empty() && static_cast<int64_t>(split.layers.size()) != stages) return {};
  if (split.layers.empty() && stages > n_layers + (split.embedding_slots ? 2 : 0))
    return {};  // the config refuses it (parallel.pp)
  ModelConfig m;  // the trainer's split (model/param_table.h) reads the layer count only
  m.n_layers = n_layers;
  std::vector<StageSpan> out;
  for (int s = 0; s < stages; ++s) {
    try {
      const ModelShard sh = pipeline_stage(m, static_cast<int>(stages), s, split);
      out.push_back(StageSpan{sh.first_layer, sh.end_layer, sh.has_embedding, sh.has_head});
    } catch (const std::invalid_argument&) {
      return {};  // a stage would hold nothing, or the counts do not add up
    }
  }
  return out;
}

// The activation list mirrors model/transformer.cpp: LayerActs (per layer), the final norm, logits
// and loss rows (head), tokens/targets, and the backward scratch shared by all layers. Tensors
// over heads or the MLP width are split by TP (Megatron column/row parallel); the residual
// stream and the norms' outputs are whole on every TP rank, or split by rows under sequence
// parallelism.
Activations activation_bytes(const ModelConfig& m, const MemoryModel& mem, int64_t tp, int64_t mbs, int64_t seq,
                             bool sequence_parallel, int64_t logits_chunk_rows) {
  const double N = static_cast<double>(mbs) * seq;  // token rows
  const double a = mem.act_bytes, t = static_cast<double>(tp);
  const double rows = sequence_parallel && tp > 1 ? N / t : N;  // rows of the residual stream held
  const double d = m.d_model, q = m.q_dim(), F = m.ffn_hidden, nh = m.n_heads;
  const double qkv = static_cast<double>(m.n_heads + 2 * m.n_kv_heads) * m.head_dim();
  const double fc = m.is_llama() ? 2 * F : F;  // gate|up for SwiGLU
  const double stats = m.is_gpt2() ? 2 : 1;    // LayerNorm keeps mean and rstd, RMSNorm rstd
  const double V = static_cast<double>(m.embed_rows());
  Activations r;
  // res_in, norm1, res_mid, norm2 [rows, d]; mean/rstd x2 [rows] f32; qkv, attn, fc, act [N, split];
  // lse [B, nh/tp, T] f32
  r.per_layer_full = rows * (a * 4 * d + 4 * 2 * stats) + N * (a * (qkv + q + fc + F) / t + 4 * nh / t);
  // qk_norm keeps the q and k heads before it and their 1/rms: [N (nh + nkv) / tp] rows of hd.
  const double qk_heads = static_cast<double>(m.n_heads + m.n_kv_heads);
  if (m.qk_norm) r.per_layer_full += N * qk_heads / t * (a * m.head_dim() + 4);
  r.per_layer_input = rows * a * d;
  r.per_layer_rebuilt = a * (2 * rows * d + N * F / t);
  r.rebuild_scratch = a * (rows * d + N * F / t);
  r.rebuild_moved = a * (4 * rows * d + (m.is_gpt2() ? 3 : 1) * N * F / t);
  r.attn_scores = mem.attn_score_bytes * mbs * (nh / t) * double(seq) * double(seq);
  // normf [rows, d], meanf/rstdf [rows], logits [N, V/tp] (+ fp32 copy), row_max/sumexp/target_logit/lse/row_loss [N]
  // (+ local_max under TP). A chunked head keeps the final-norm output gradient [N, d] instead
  // of the logits, and one shared chunk of logits.
  r.head = rows * (a * d + 4 * stats) + N * (5 + (tp > 1 ? 1 : 0)) * 4;
  // The Transformer's choice of chunk (model/transformer.h); frameworks without one: never.
  const int64_t rows_i = mbs * seq, vocab_local = m.embed_rows() / tp;
  r.logits_chunk_rows = !mem.chunked_logits      ? rows_i
                        : logits_chunk_rows > 0 ? std::min(rows_i, logits_chunk_rows)
                                                : Transformer::auto_logits_chunk_rows(rows_i, vocab_local, mem.act_bytes);
  if (r.logits_chunk_rows < rows_i) {
    r.head += N * a * d;
    r.head_shared = static_cast<double>(r.logits_chunk_rows) * a * static_cast<double>(vocab_local);
  } else {
    r.head += N * (a + mem.logit_extra_bytes) * V / t;
  }
  r.stage_output = rows * a * d;
  r.token_ids = N * 4;
  r.embed_norm = m.embedding_norm ? rows * (a * d + 4 * stats) : 0;  // embed [rows, d], mean/rstd [rows]
  // dres [rows, d], dnorm and proj_out [N, d] (no proj_out where the projections add into the
  // residual stream); dqkv, dattn, dfc, dact split (no dact where the GELU backward is fused);
  // with SP also the gathered rows [N, d] and the scattered sums [rows, d]
  const double dact = m.is_gpt2() && mem.fused_gelu_backward ? 0 : F;
  const double proj_out = tp == 1 && mem.fused_residual_projection ? 0 : N * d;
  r.backward_scratch = a * (rows * d + N * d) + (rows < N ? a * (N + rows) * d : 0);
  r.layer_backward_scratch = a * (proj_out + N * (qkv + q + fc + dact) / t);
  if (m.qk_norm) r.layer_backward_scratch += 2 * N * qk_heads / t * a * m.head_dim();  // the two qk_norm scratch sets
  // The embedding's rows summed over TP before the scatter reuse proj_out where it exists.
  r.embedding_sums = rows < N ? a * N * d : 0;
  return r;
}

// The attention backward's scratch on the GPU (delta, staged dS tiles, padded copies or cuDNN's
// workspace), transient within a layer's backward, for the rank's heads of one micro-batch; 0 on
// the CPU.
double attention_scratch_bytes(const ModelConfig& m, const MemoryModel& mem, int64_t tp, int64_t mbs, int64_t seq) {
  if (!mem.gpu_attention) return 0;
  return static_cast<double>(attention_backward_scratch_bytes(*mem.gpu_attention, mbs, seq, m.n_heads / tp,
                                                              m.n_kv_heads / tp, m.head_dim(),
                                                              static_cast<size_t>(mem.act_bytes)));
}

std::string layout_problem(const RunConfig& cfg, const Layout& l, const PlanOptions& opt) {
  const ModelConfig& m = cfg.model;
  const auto need = [](int64_t what, int64_t by, const std::string& what_name, const std::string& by_name) {
    return what % by == 0 ? std::string()
                          : what_name + " " + std::to_string(what) + " not divisible by " + by_name + "=" +
                                std::to_string(by);
  };
  if (l.tp < 1 || l.pp < 1 || l.dp < 1 || l.mbs < 1) return "sizes must be positive";
  // The model's own rules first: a TP size that also breaks one is named for both.
  std::string model_rule;
  for (std::string p : {need(m.n_heads, l.tp, "heads", "tp"), need(m.n_kv_heads, l.tp, "kv heads", "tp"),
                        need(m.ffn_hidden, l.tp, "ffn", "tp")})
    if (model_rule.empty()) model_rule = p;
  if (model_rule.empty() && m.pad_vocab_multiple <= 1 && m.vocab_size % l.tp != 0)
    model_rule = need(m.vocab_size, l.tp, "vocab", "tp") + " (no vocab padding configured)";
  if (l.tp > opt.hw.gpus_per_node || opt.hw.gpus_per_node % l.tp != 0)
    return "tp=" + std::to_string(l.tp) + " does not divide the " + std::to_string(opt.hw.gpus_per_node) +
           " GPUs of a node (a TP group stays inside a node)" + (model_rule.empty() ? "" : "; and " + model_rule);
  if (!model_rule.empty()) return model_rule;
  // The trainer spreads layers unevenly when they do not divide (the first stages take one
  // more); a stage with nothing to hold is the only pipeline that cannot be built.
  const int64_t v = std::max<int64_t>(1, opt.virtual_stages);
  const std::string stages_text =
      v > 1 ? "pp*virtual_stages=" + std::to_string(l.pp * v) : "pp=" + std::to_string(l.pp);
  if (!opt.pipeline_layers.empty() && static_cast<int64_t>(opt.pipeline_layers.size()) != l.pp * v)
    return "parallel.pipeline_layers gives " + std::to_string(opt.pipeline_layers.size()) + " stages their layers, not " +
           stages_text;
  if (!opt.pipeline_layers.empty() && stage_spans(m.n_layers, l.pp * v, opt.pipeline_split()).empty())
    return "parallel.pipeline_layers " + nlohmann::json(opt.pipeline_layers).dump() + " does not split the " +
           std::to_string(m.n_layers) +
           " layers (the counts add up to them, with one or more on every stage but the first and last)";
  if (l.pp > 1 && stage_spans(m.n_layers, l.pp * v, opt.pipeline_split()).empty())
    return stages_text + " stages for " +
           std::to_string(m.n_layers) + " layers" +
           (opt.embedding_own_slot ? " + embedding and head slots" : "") + " (each needs at least one)";
  const int64_t unit = l.mbs * l.dp;
  if (cfg.train.global_batch % unit != 0)
    return "global batch " + std::to_string(cfg.train.global_batch) + " not divisible by mbs*dp=" +
           std::to_string(unit);
  if (const auto& r = cfg.schedule.rampup; r && (r->start % unit != 0 || r->increment % unit != 0))
    return "batch rampup " + std::to_string(r->start) + "+" + std::to_string(r->increment) +
           " not divisible by mbs*dp=" + std::to_string(unit);
  return {};
}

namespace {

struct StageParams {
  int64_t total = 0, tied_copy = 0, embedding = 0, layers = 0, head = 0;
};

// Exact parameters of TP rank 0 of a stage: the trainer's ParamTable for that shard (every TP
// rank holds the same count: split tensors divide evenly, replicated ones are whole), which
// includes the copy of a tied embedding the last stage keeps for its head.
StageParams stage_params(const ModelConfig& m, int64_t tp, const StageSpan& sp) {
  ModelShard sh;
  sh.tp_rank = 0;
  sh.tp_size = static_cast<int>(tp);
  sh.first_layer = sp.first_layer;
  sh.end_layer = sp.end_layer;
  sh.has_embedding = sp.has_embedding;
  sh.has_head = sp.has_head;
  ParamTable table(m, sh);
  StageParams r;
  for (const ParamSpec& p : table.params()) {
    if (p.tied_copy) r.tied_copy += p.numel, r.head += p.numel;
    else if (p.layer >= 0) r.layers += p.numel;
    else if (embedding_tensor(p)) r.embedding += p.numel;
    else r.head += p.numel;
  }
  r.total = table.local_numel();
  return r;
}

// The linear layers of one block on one TP rank, as (output features, input features).
std::vector<std::pair<double, double>> layer_linears(const ModelConfig& m, int64_t tp) {
  const double t = static_cast<double>(tp), d = m.d_model, q = m.q_dim(), F = m.ffn_hidden;
  const double qkv = static_cast<double>(m.n_heads + 2 * m.n_kv_heads) * m.head_dim();
  const double fc = m.is_llama() ? 2 * F : F;
  return {{qkv / t, d}, {d, q / t}, {fc / t, d}, {d, F / t}};
}

struct Cost {
  double seconds = 0, flops = 0;
};

// Forward, data-gradient and weight-gradient GEMMs of a linear layer over M tokens, each at
// achievable_tflops times its tile/wave efficiency. (A width that is not a multiple of 8 gets a
// warning, not a time penalty: cuBLAS 11+ keeps such GEMMs on the tensor cores, less efficiently,
// by an amount the seed does not measure.)
Cost linear_cost(double M, double out, double in, const Hardware& hw, bool forward, bool backward) {
  const double rate = hw.achievable_tflops * 1e12, f = 2 * M * out * in;
  Cost c;
  if (forward) c.seconds += f / (rate * wave_efficiency(M, out, hw)), c.flops += f;
  if (backward) {
    c.seconds += f / (rate * wave_efficiency(M, in, hw)) + f / (rate * wave_efficiency(out, in, hw));
    c.flops += 2 * f;
  }
  return c;
}

}  // namespace

std::vector<std::string> quantization_warnings(const ModelConfig& m, const Layout& l, const Hardware& hw, int64_t seq) {
  std::vector<std::string> w;
  const int64_t d = m.d_model;
  if (d % 128 != 0)
    w.push_back("d_model " + std::to_string(d) + " is not a multiple of 128: matmul tiles run partly empty (tile "
                "quantization); nearest multiples " + std::to_string(d / 128 * 128) + " / " +
                std::to_string((d / 128 + 1) * 128));
  if (d % l.tp != 0 || (d / l.tp) % 8 != 0)
    w.push_back("d_model/tp = " + fmt("%g", double(d) / l.tp) + " is not a multiple of 8 (16-byte rows for bf16 "
                "tensor cores)");
  for (auto [what, width] : {std::pair<const char*, int64_t>{"heads*head_dim/tp", m.q_dim() / l.tp},
                             {"ffn/tp", m.ffn_hidden / l.tp}})
    if (width % 128 != 0)
      w.push_back(std::string(what) + " = " + std::to_string(width) + " per rank is not a multiple of 128 (tile "
                  "quantization of the split matmuls)");
  if (m.head_dim() % 8 != 0)
    w.push_back("head_dim " + std::to_string(m.head_dim()) + " is not a multiple of 8: attention matmuls miss the "
                "tensor cores (the seed's 13824/128 = 108 ran 34% slower than 13824/64)");
  if ((m.n_heads / l.tp) * l.mbs % 4 != 0)
    w.push_back("(heads/tp)*mbs = " + std::to_string(m.n_heads / l.tp * l.mbs) + " is not a multiple of 4: "
                "Megatron's fused softmax would fall back (seed); not a keel constraint");
  // Wave quantization measured on the block's matmuls for this layout (flops-weighted).
  const double M = static_cast<double>(l.mbs) * seq;
  double ideal = 0, actual = 0;
  for (auto [out, in] : layer_linears(m, l.tp)) {
    const Cost c = linear_cost(M, out, in, hw, true, true);
    ideal += c.flops / (hw.achievable_tflops * 1e12);
    actual += c.seconds;
  }
  const double eff = actual > 0 ? ideal / actual : 1;
  if (eff < 0.9)
    w.push_back("block matmuls fill " + fmt("%.0f%%", 100 * eff) + " of their " + std::to_string(hw.tile_rows) + "x" +
                std::to_string(hw.tile_cols) + " tiles x " + std::to_string(hw.sm_count) +
                "-SM waves at this tp/mbs (wave quantization; the seed's rule of thumb: d_model a multiple of "
                "SMs*tp = " + std::to_string(hw.sm_count * l.tp) + ")");
  return w;
}

namespace {

// A pipeline rank's memory from the chunks (spans) it holds: plan_layout's per-stage figures, and
// those the split searches (layer_caps) ask of layer counts that no split has yet.
class StageMemoryModel {
 public:
  // v: model chunks per pipeline rank; mb: micro-batches per DP rank per step.
  StageMemoryModel(const RunConfig& cfg, const Layout& l, const PlanOptions& opt, int64_t v, int64_t mb)
      : cfg_(cfg), l_(l), opt_(opt), m_(model_for_tp(cfg.model, l.tp)),
        mem_(opt.memory.name.empty() ? keel_memory_model(cfg.precision.mode) : opt.memory),
        act_(activation_bytes(m_, mem_, l.tp, l.mbs, cfg.train.seq_len, opt.sequence_parallel, opt.logits_chunk_rows)),
        mb_(mb) {
    // Interleaved: what each chunk holds comes from the schedules themselves (of each step size,
    // as the trainer allocates it).
    if (v > 1)
      sched_ = pipeline_slots(static_cast<int>(l.pp), static_cast<int>(v), cfg.step_micro_batch_counts(l.mbs, l.dp));
    // Every layer has the same tensors, so a span's parameters are its embedding and head's
    // (a span of no layers with its flags) plus its layer count times one layer's.
    one_layer_ = stage_params(m_, l.tp, StageSpan{0, 1, false, false});
  }

  // Stage s holding `chunks` (one per virtual stage it runs, in order).
  StageMemory stage(int64_t s, const std::vector<StageSpan>& chunks) const {
    const MemoryModel& mem = mem_;
    const Activations& act = act_;
    const double shard = mem.state.zero1 ? static_cast<double>(l_.dp) : 1.0;
    StageMemory st;
    st.stage = static_cast<int>(s);
    st.chunks = chunks;
    StageParams sprm;
    for (const StageSpan& cs : chunks) {
      const StageParams cp = params(cs);
      sprm.total += cp.total, sprm.tied_copy += cp.tied_copy, sprm.embedding += cp.embedding;
      sprm.layers += cp.layers, sprm.head += cp.head;
    }
    StageSpan sp = st.chunks.front();
    for (size_t c = 1; c < st.chunks.size(); ++c) {
      sp.end_layer += st.chunks[c].layers();  // a layer count: the chunks are not contiguous
      sp.has_embedding = sp.has_embedding || st.chunks[c].has_embedding;
      sp.has_head = sp.has_head || st.chunks[c].has_head;
    }
    st.span = sp;
    st.params = sprm.total;
    st.tied_copy = sprm.tied_copy;
    st.embedding_params = sprm.embedding;
    st.layer_params = sprm.layers;
    st.head_params = sprm.head;
    const double P = static_cast<double>(st.params);
    st.weights = P * mem.state.weights;
    st.grads = P * mem.state.grads;
    st.master = P * mem.state.master / shard;
    st.moments = P * mem.state.moments / shard;
    st.grad_shard = P * mem.state.grad_shard / shard;
    // 1F1B: stage s runs pp - s forwards before its first backward, so it holds that many
    // micro-batches' activations (never more than the step has).
    st.in_flight = std::min<int64_t>(l_.pp - s, mb_);
    if (sched_) {
      for (size_t c = 0; c < chunks.size(); ++c)
        st.chunk_in_flight.push_back(sched_->activation[static_cast<size_t>(s)][c]);
      st.in_flight = *std::max_element(st.chunk_in_flight.begin(), st.chunk_in_flight.end());
    }
    // Recomputed layers (model/transformer.h): the first Lr of the stage (over its chunks in
    // order) keep only their input; their intermediates are rebuilt one layer at a time in a
    // scratch set shared by them all. With selective recomputation the other layers keep
    // kept_other, and rebuild the rest in a scratch pair (that set, when there is one).
    const double kept_layer = act.per_layer_full + act.attn_scores;
    const double kept_other = kept_layer - (opt_.selective ? act.per_layer_rebuilt : 0);
    double recompute_left = opt_.recompute_layers > 0 ? double(opt_.recompute_layers) : sp.layers();
    double Lr = 0;
    // A stage without layers (an embedding or head slot) holds no layer's backward buffers.
    const bool has_layers = sp.layers() > 0;
    double once = act.backward_scratch + (has_layers ? act.layer_backward_scratch : 0) +
                  (sp.has_head ? act.head_shared : 0) +
                  (!has_layers && sp.has_embedding ? act.embedding_sums : 0);
    for (size_t c = 0; c < st.chunks.size(); ++c) {
      const StageSpan& cs = st.chunks[c];
      const double L = cs.layers();
      const double n = static_cast<double>(sched_ ? st.chunk_in_flight[c] : st.in_flight);
      const double Lr_c = std::min(L, recompute_left);
      recompute_left -= Lr_c;
      Lr += Lr_c;
      // token ids (embedding), targets (head), document positions (every stage, with masking)
      const double ids = (cs.has_embedding ? act.token_ids : 0) + (cs.has_head ? act.token_ids : 0) +
                         (cfg_.takes_document_positions() ? act.token_ids : 0);
      const double head = cs.has_head ? act.head : 0;
      const double embed_norm = cs.has_embedding ? act.embed_norm : 0;
      // keel's Transformer keeps a stage output, the token ids / targets and the head's buffers
      // per micro-batch in flight (a pipeline slot). The Megatron-DeepSpeed model (compared with
      // seed 001) counts them once, its pipe buffers being the keeps_stage_output term below.
      const double per_slot = mem.keeps_stage_output ? 0 : act.stage_output + ids + head + embed_norm;
      if (mem.keeps_stage_output) once += act.stage_output + ids + head + embed_norm;
      st.act_full += n * (L * kept_other + per_slot);
      st.act_stored_recompute += n * (Lr_c * act.per_layer_input + (L - Lr_c) * kept_other + per_slot);
      if (mem.keeps_stage_output && l_.pp > 1) {
        st.act_full += n * act.per_layer_input;
        st.act_stored_recompute += n * act.per_layer_input;
      }
      // Interleaved: received output gradients wait in buffers of their own until their backward.
      if (sched_) once += sched_->gradient[static_cast<size_t>(s)][c] * act.stage_output;
    }
    st.recomputed_layers = Lr;
    const double rebuild = opt_.selective && sp.layers() > 0 ? act.rebuild_scratch : 0;
    st.act_full += once + rebuild;
    st.act_working_recompute = (Lr > 0 ? kept_layer - act.per_layer_input : rebuild) + once;
    st.act_recompute = st.act_stored_recompute + st.act_working_recompute;
    st.overhead = mem.cuda_context_bytes + mem.comm_buffer_bytes +
                  (has_layers ? attention_scratch_bytes(m_, mem, l_.tp, l_.mbs, cfg_.train.seq_len) : 0);
    return st;
  }

 private:
  StageParams params(const StageSpan& sp) const {
    auto key = std::make_pair(sp.has_embedding, sp.has_head);
    auto it = ends_.find(key);
    if (it == ends_.end()) it = ends_.emplace(key, stage_params(m_, l_.tp, StageSpan{0, 0, key.first, key.second})).first;
    StageParams r = it->second;
    const int64_t L = sp.layers();
    r.total += L * one_layer_.total;
    r.layers += L * one_layer_.layers;
    return r;
  }

  const RunConfig& cfg_;
  const Layout l_;
  const PlanOptions& opt_;
  const ModelConfig m_;
  const MemoryModel mem_;
  const Activations act_;
  const int64_t mb_;
  std::optional<PipeSlots> sched_;  // interleaved only
  StageParams one_layer_;
  mutable std::map<std::pair<bool, bool>, StageParams> ends_;  // a span's embedding and head
};

}  // namespace

LayoutPlan plan_layout(const RunConfig& cfg, const Layout& l, const PlanOptions& opt) {
  const MemoryModel mem = opt.memory.name.empty() ? keel_memory_model(cfg.precision.mode) : opt.memory;
  const Hardware& hw = opt.hw;
  const ModelConfig m = model_for_tp(cfg.model, l.tp);
  const int64_t seq = cfg.train.seq_len;
  const bool own_slot = opt.embedding_own_slot && l.pp > 1;
  const int64_t v = l.pp > 1 ? std::max<int64_t>(1, opt.virtual_stages) : 1;
  const std::vector<StageSpan> spans = stage_spans(m.n_layers, l.pp * v, {own_slot, opt.pipeline_layers});
  if (spans.empty())
    throw ConfigError("plan_layout: " + l.str() + " leaves a pipeline stage without layers" +
                      (opt.pipeline_layers.empty() ? "" : " (or parallel.pipeline_layers does not list its stages)"));

  LayoutPlan p;
  p.layout = l;
  p.embedding_own_slot = own_slot;
  p.pipeline_layers = opt.pipeline_layers;
  p.virtual_stages = v;
  p.micro_batches = cfg.train.global_batch / (l.mbs * l.dp);
  const int64_t mb = std::max<int64_t>(p.micro_batches, 1);
  const Activations act = activation_bytes(m, mem, l.tp, l.mbs, seq, opt.sequence_parallel, opt.logits_chunk_rows);

  // ---- memory of every stage ----
  const StageMemoryModel stage_memory(cfg, l, opt, v, mb);
  for (int64_t s = 0; s < l.pp; ++s) {
    std::vector<StageSpan> chunks;
    for (int64_t c = 0; c < v; ++c) chunks.push_back(spans[static_cast<size_t>(c * l.pp + s)]);
    p.stages.push_back(stage_memory.stage(s, chunks));
  }
  p.usable_bytes = hw.gpu_mem_bytes * (1 - mem.headroom);
  auto peak = [&](bool rc, int* at) {
    double best = -1;
    for (const auto& st : p.stages)
      if (st.total(rc) > best) best = st.total(rc), *at = st.stage;
    return best;
  };
  int at_full = 0, at_rc = 0;
  const double peak_full = peak(false, &at_full), peak_rc = peak(true, &at_rc);
  p.recompute = opt.recompute == Recompute::Always ||
                (opt.recompute == Recompute::Auto && peak_full > p.usable_bytes);
  p.peak_bytes = p.recompute ? peak_rc : peak_full;
  p.peak_stage = p.recompute ? at_rc : at_full;
  p.fits = p.peak_bytes <= p.usable_bytes;
  p.bubble = double(l.pp - 1) / double(v * mb + l.pp - 1);

  // ---- time of one micro-batch on each stage ----
  // compute: every block matmul forward + data grad + weight grad (+ a forward again when
  //   recomputing), attention 4*keys*q/tp flops per token forward and twice that backward (keel's
  //   count, no causal halving; keys = seq or the sliding window), element-wise ops at HBM
  //   bandwidth, the head's matmuls on the last stage;
  // TP: two all-reduces of [tokens, d] per block forward and two backward (+2 when recomputing),
  //   one for the vocab-parallel embedding and one for the head's input gradient;
  // PP: one [tokens, d] send forward and one backward per stage boundary.
  // Nothing overlaps with compute, but for the DP reduction and gather with overlap_grad_reduce and
  // overlap_param_gather.
  const double M = static_cast<double>(l.mbs) * seq;
  const double rate = hw.achievable_tflops * 1e12;
  const double bw_intra = hw.intra_node_gbps * 1e9, bw_inter = hw.inter_node_gbps * 1e9;
  const double bw_pp = l.tp * l.dp * l.pp <= hw.gpus_per_node ? bw_intra : bw_inter;
  const double bw_dp = l.tp * l.dp <= hw.gpus_per_node ? bw_intra : bw_inter;
  Cost layer_fwd, layer_bwd;
  for (auto [out, in] : layer_linears(m, l.tp)) {
    Cost f = linear_cost(M, out, in, hw, true, false), b = linear_cost(M, out, in, hw, false, true);
    layer_fwd.seconds += f.seconds, layer_fwd.flops += f.flops;
    layer_bwd.seconds += b.seconds, layer_bwd.flops += b.flops;
  }
  // QK^T and PV contract over / produce head_dim: off the tensor cores unless it is a multiple of
  // 8 (the seed: head_dim 150 and 108 ran 35-38% slower than 144 and 216, which attention at
  // 1/16 of the rate on 2-3% of the flops reproduces).
  const double attn_fwd_flops = 4 * M * static_cast<double>(m.attended_keys(seq)) * m.q_dim() / double(l.tp);
  const double attn_rate = rate * (m.head_dim() % 8 == 0 ? 1 : hw.no_tensor_core_ratio);
  const double ideal = (layer_fwd.flops + layer_bwd.flops) / rate;
  p.time.gemm_efficiency = ideal / (layer_fwd.seconds + layer_bwd.seconds);
  layer_fwd.seconds += attn_fwd_flops / attn_rate;
  layer_bwd.seconds += 2 * attn_fwd_flops / attn_rate;
  // Element-wise work (norms, activation function, residual adds, softmax, RoPE, casts) is bound
  // by memory bandwidth: forward writes every tensor the layer keeps and reads it once more;
  // backward moves about twice that.
  const double elementwise_fwd = 2 * (act.per_layer_full + act.attn_scores) / (hw.hbm_gbps * 1e9);
  layer_fwd.seconds += elementwise_fwd;
  layer_bwd.seconds += 2 * elementwise_fwd;
  // A layer recomputed whole runs its forward twice; with selective recomputation each other
  // layer rebuilds its dropped tensors in backward, at HBM bandwidth.
  const double rebuild_s = opt.selective ? act.rebuild_moved / (hw.hbm_gbps * 1e9) : 0;
  const double layer_s = layer_fwd.seconds + layer_bwd.seconds;
  auto recomputed = [&](const StageMemory& st) { return p.recompute ? st.recomputed_layers : 0.0; };
  const double head_s = linear_cost(M, static_cast<double>(m.embed_rows()) / l.tp, m.d_model, hw, true, true).seconds;
  const double act_msg = M * m.d_model * mem.act_bytes;  // one [tokens, d] activation
  const double ar_sent = ring_allreduce_sent(act_msg, l.tp);

  struct StageTime {
    double compute = 0, tp = 0, pp = 0, total = 0, tp_bytes = 0, pp_bytes = 0;
    double forward = 0;  // the layers' forward share of compute (the rest: backward, recomputation, head)
  };
  std::vector<StageTime> times;
  for (const auto& st : p.stages) {
    StageTime t;
    const double L = st.span.layers(), Lr = recomputed(st);
    t.compute = L * layer_s + Lr * layer_fwd.seconds + (L - Lr) * rebuild_s + (st.span.has_head ? head_s : 0);
    t.forward = L * layer_fwd.seconds;
    const double n_ar = L * 4 + Lr * 2 + (st.span.has_embedding ? 1 : 0) + (st.span.has_head ? 1 : 0);
    t.tp_bytes = n_ar * ar_sent;
    t.tp = t.tp_bytes / bw_intra;
    // Per micro-batch, each chunk sends its output forward and its input's gradient backward,
    // but for the first and last virtual stage.
    const double sends = 2.0 * static_cast<double>(v) - (st.stage == l.pp - 1 ? 1 : 0) - (st.stage == 0 ? 1 : 0);
    t.pp_bytes = l.pp > 1 ? sends * act_msg : 0;
    t.pp = t.pp_bytes / bw_pp;
    t.total = t.compute + t.tp + t.pp + hw.microbatch_overhead_s;
    times.push_back(t);
  }
  for (const auto& t : times) p.stage_seconds.push_back(t.total);
  {
    // One more layer: its forward and backward with their TP messages, and what recomputation adds
    // (a second forward where every layer is recomputed, the rebuild under selective).
    const bool all_recomputed = p.recompute && opt.recompute_layers == 0;
    p.layer_seconds = layer_s + (all_recomputed ? layer_fwd.seconds : rebuild_s) +
                      (4.0 + (all_recomputed ? 2.0 : 0.0)) * ar_sent / bw_intra;
  }
  // 1F1B with m micro-batches: every stage runs each micro-batch once, and the pipeline as a
  // whole advances at the pace of its slowest stage: sum_s t_s + (m - 1) max_s t_s, which is
  // (m + pp - 1) t for equal stages, i.e. a bubble of (pp - 1) / (m + pp - 1).
  size_t slow = 0;
  for (size_t s = 0; s < times.size(); ++s)
    if (times[s].total > times[slow].total) slow = s;
  double pipe = 0;
  for (const auto& t : times) {
    pipe += t.total;
    p.time.compute_s += t.compute;
    p.time.tp_comm_s += t.tp;
    p.time.pp_comm_s += t.pp;
  }
  // Interleaved (v chunks): the fill and drain pass chunks of 1/v of a stage's time, so the
  // pipeline takes sum_s t_s / v + (m - 1/v) max_s t_s.
  const double vd = static_cast<double>(v), rest = static_cast<double>(mb) - 1.0 / vd;
  pipe = pipe / vd + rest * times[slow].total;
  p.time.compute_s = p.time.compute_s / vd + rest * times[slow].compute;
  p.time.tp_comm_s = p.time.tp_comm_s / vd + rest * times[slow].tp;
  p.time.pp_comm_s = p.time.pp_comm_s / vd + rest * times[slow].pp;
  for (const auto& t : times) {
    p.comm.tp = std::max(p.comm.tp, mb * t.tp_bytes);
    p.comm.pp = std::max(p.comm.pp, mb * t.pp_bytes);
  }
  // Tied embedding: the first and last stage sum their copies' gradients once per step.
  double tied_s = 0;
  if (l.pp > 1 && m.tied_embeddings) {
    const double bytes = static_cast<double>(m.embed_rows()) / l.tp * m.d_model * mem.state.dp_grad_comm;
    p.comm.pp += bytes;
    tied_s = bytes / bw_inter;
    p.time.pp_comm_s += tied_s;
  }
  // DP (ZeRO-1): reduce-scatter the gradients after the last backward, all-gather the updated
  // working weights after the optimizer. The rank with the most parameters sets the pace. With
  // overlap_grad_reduce the gradients' reduction runs alongside the slowest stage's last
  // backward (one micro-batch's backward, recomputation included), except what outlasts it and
  // the last group's share (the layer or embedding finished last cannot hide behind anything).
  double max_params = 0, max_layers = 0;
  for (const auto& st : p.stages) {
    max_params = std::max(max_params, static_cast<double>(st.params));
    max_layers = std::max(max_layers, static_cast<double>(st.span.layers()));
  }
  const double grad_sent = ring_half_sent(max_params * mem.state.dp_grad_comm, l.dp);
  const double gather_sent = ring_half_sent(max_params * mem.state.dp_weight_comm, l.dp);
  p.comm.dp = grad_sent + gather_sent;
  double grad_s = grad_sent / bw_dp, gather_s = gather_sent / bw_dp;
  if (opt.overlap_grad_reduce && l.dp > 1) {
    grad_s = std::max(grad_s - (times[slow].compute - times[slow].forward), grad_s / (max_layers + 1));
  }
  // With overlap_param_gather each bucket moves while the forward computes the one before; the
  // first is waited for at once.
  if (opt.overlap_param_gather && l.dp > 1 && max_params > 0) {
    const double bucket = static_cast<double>(parallel::grad_bucket_elements(opt.grad_bucket_size, l.dp));
    gather_s = std::max(gather_s - times[slow].forward, gather_s * std::min(1.0, bucket / max_params));
  }
  p.time.dp_comm_s = grad_s + gather_s;
  p.time.step_s = pipe + tied_s + p.time.dp_comm_s;
  const double tokens = static_cast<double>(cfg.train.global_batch) * seq;
  p.time.model_tflops = flops_per_token(m, seq) * tokens / (double(l.gpus()) * p.time.step_s) / 1e12;

  p.warnings = quantization_warnings(m, l, hw, seq);
  if (p.micro_batches < l.pp)
    p.warnings.push_back(std::to_string(p.micro_batches) + " micro-batches per step for " + std::to_string(l.pp) +
                         " pipeline stages: the pipeline never fills");
  return p;
}

std::vector<int> pipeline_layer_caps(const RunConfig& cfg, const Layout& l, const PlanOptions& opt, bool recompute) {
  const int64_t mb = std::max<int64_t>(cfg.train.global_batch / (l.mbs * l.dp), 1);
  const StageMemoryModel stage_memory(cfg, l, opt, 1, mb);
  const MemoryModel mem = opt.memory.name.empty() ? keel_memory_model(cfg.precision.mode) : opt.memory;
  const double usable = opt.hw.gpu_mem_bytes * (1 - mem.headroom);
  const int n = cfg.model.n_layers;
  std::vector<int> caps;
  for (int64_t s = 0; s < l.pp; ++s) {
    auto fits = [&](int layers) {
      const StageSpan span{0, layers, s == 0, s == l.pp - 1};
      return stage_memory.stage(s, {span}).total(recompute) <= usable;
    };
    // A stage's memory grows with its layers: the most that fit, by bisection over [-1, n].
    int lo = -1, hi = n + 1;  // fits(lo) (or lo = -1), !fits(hi)
    while (hi - lo > 1) {
      const int mid = lo + (hi - lo) / 2;
      (fits(mid) ? lo : hi) = mid;
    }
    caps.push_back(lo);
  }
  return caps;
}

std::optional<LayoutPlan::Balance> balance_pipeline(const RunConfig& cfg, const LayoutPlan& p, const PlanOptions& opt) {
  const int64_t pp = p.layout.pp, v = p.virtual_stages;
  if (pp < 2 || static_cast<int64_t>(p.stage_seconds.size()) != pp || p.layer_seconds <= 0) return std::nullopt;
  const size_t n = static_cast<size_t>(pp);
  std::vector<double> fixed(n);  // a rank's time without its layers: embedding, head, messages
  std::vector<int> now(n * static_cast<size_t>(v));  // the layers of each virtual stage, in model order
  for (size_t s = 0; s < n; ++s) {
    fixed[s] = p.stage_seconds[s] - p.stages[s].span.layers() * p.layer_seconds;
    for (size_t c = 0; c < p.stages[s].chunks.size(); ++c) now[c * n + s] = p.stages[s].chunks[c].layers();
  }
  PlanOptions o = opt;
  o.embedding_own_slot = false;
  o.virtual_stages = v;
  std::optional<LayoutPlan::Balance> best;
  // Without full recomputation first: a split that spares it is worth more than an even one.
  // (Interleaved ranks: no caps, which are per 1F1B stage; the plan of the split decides.)
  for (bool recompute : {false, true}) {
    if ((recompute && opt.recompute == Recompute::Never) || (!recompute && opt.recompute == Recompute::Always) ||
        (recompute && v > 1 && opt.recompute == Recompute::Auto))
      continue;
    const std::vector<int> caps = v == 1 ? pipeline_layer_caps(cfg, p.layout, o, recompute) : std::vector<int>();
    const std::vector<int> layers =
        balanced_pipeline_layers(fixed, p.layer_seconds, cfg.model.n_layers, caps, static_cast<int>(v));
    if (layers.empty() || layers == now) continue;
    o.pipeline_layers = layers;
    if (!layout_problem(cfg, p.layout, o).empty()) continue;
    const LayoutPlan q = plan_layout(cfg, p.layout, o);
    if (!q.fits || (p.fits && q.time.step_s > 0.99 * p.time.step_s)) continue;
    if (!best || q.time.step_s < best->step_s) best = LayoutPlan::Balance{layers, q.time.step_s, q.peak_bytes, q.recompute};
  }
  return best;
}

// ---------------------------------------------------------------------------------------------
// every layout

PlanResult plan_all(const RunConfig& cfg, const PlanOptions& opt) {
  PlanResult r;
  r.count = count_model(cfg);
  r.memory = opt.memory.name.empty() ? keel_memory_model(cfg.precision.mode) : opt.memory;
  r.gpus = opt.gpus > 0 ? opt.gpus : cfg.parallel.world();
  PlanOptions o = opt;
  o.memory = r.memory;
  const int64_t G = r.gpus;
  for (int64_t tp : divisors(G)) {
    if (opt.tp && *opt.tp != tp) continue;
    for (int64_t pp : divisors(G / tp)) {
      if (opt.pp && *opt.pp != pp) continue;
      const int64_t dp = G / (tp * pp);
      if (opt.dp && *opt.dp != dp) continue;
      // Rules that do not depend on the micro-batch size are reported once, with mbs 0 ("any").
      Layout base{tp, pp, dp, 0};
      {
        Layout probe = base;
        probe.mbs = 1;
        PlanOptions po = o;
        // The user's split fixes the stage count: auto chunks probe with the count that matches it.
        const int64_t listed = static_cast<int64_t>(o.pipeline_layers.size());
        if (o.virtual_stages == 0 && listed > pp && listed % pp == 0) po.virtual_stages = listed / pp;
        std::string why = layout_problem(cfg, probe, po);
        if (!why.empty() && why.find("mbs*dp") == std::string::npos) {
          r.rejected.push_back({base, why, 0, std::nullopt});
          continue;
        }
      }
      std::vector<int64_t> sizes;
      if (opt.mbs) sizes = {*opt.mbs};
      else if (cfg.train.global_batch % dp != 0) {
        r.rejected.push_back({base, "global batch " + std::to_string(cfg.train.global_batch) +
                                        " not divisible by dp=" + std::to_string(dp), 0, std::nullopt});
        continue;
      } else {
        // The config's own micro-batch too, above --max-mbs: its layout gets a rank or a reason.
        for (int64_t b : divisors(cfg.train.global_batch / dp))
          if (b <= opt.max_mbs || b == cfg.train.micro_batch) sizes.push_back(b);
      }
      // Chunks per pipeline rank to try: the given count, or (auto) every count that leaves each
      // chunk a layer; a layout is rejected for what stops its first candidate.
      std::vector<int64_t> chunk_counts = {std::max<int64_t>(1, opt.virtual_stages)};
      if (opt.virtual_stages == 0 && pp > 1)
        for (int64_t v = 2; v <= kMaxAutoVirtualStages; ++v)
          if (!stage_spans(cfg.model.n_layers, pp * v, opt.pipeline_split()).empty()) chunk_counts.push_back(v);
      for (int64_t mbs : sizes) {
        const Layout l{tp, pp, dp, mbs};
        std::optional<LayoutPlan> best;
        std::optional<Rejection> first_problem;
        for (int64_t v : chunk_counts) {
          PlanOptions ov = o;
          ov.virtual_stages = v;
          if (std::string why = layout_problem(cfg, l, ov); !why.empty()) {
            if (!first_problem) first_problem = Rejection{l, why, 0, std::nullopt};
            continue;
          }
          LayoutPlan lp = plan_layout(cfg, l, ov);
          if (!lp.fits) {
            if (!first_problem) {
              first_problem = Rejection{l, "out of memory: " + format_bytes(lp.peak_bytes) + " on stage " +
                                               std::to_string(lp.peak_stage) +
                                               (lp.recompute ? " even with recomputation" : "") + " > " +
                                               format_bytes(lp.usable_bytes) + " usable",
                                        lp.peak_bytes, balance_pipeline(cfg, lp, ov)};
              if (const auto& f = first_problem->fitting)
                first_problem->reason += "; fits with parallel.pipeline_layers " + nlohmann::json(f->layers).dump() +
                                         ": peak " + format_bytes(f->peak_bytes) + ", estimated step " +
                                         fmt("%.2f s", f->step_s) + (f->recompute ? " with recomputation" : "");
            }
            continue;
          }
          if (!best || lp.time.step_s < best->time.step_s) best = std::move(lp);
        }
        if (best) {
          PlanOptions ob = o;
          ob.virtual_stages = best->virtual_stages;
          best->balance = balance_pipeline(cfg, *best, ob);
          r.ranked.push_back(std::move(*best));
        } else if (first_problem) r.rejected.push_back(*first_problem);
      }
    }
  }
  std::stable_sort(r.ranked.begin(), r.ranked.end(), [](const LayoutPlan& a, const LayoutPlan& b) {
    if (a.time.step_s != b.time.step_s) return a.time.step_s < b.time.step_s;
    return a.peak_bytes < b.peak_bytes;
  });
  return r;
}

std::vector<Alternative> alternatives(const RunConfig& cfg, const PlanOptions& opt, int max_count) {
  std::vector<Alternative> out;
  const int64_t G = opt.gpus > 0 ? opt.gpus : cfg.parallel.world();
  const int64_t node = opt.hw.gpus_per_node;
  auto gpus_text = [node](int64_t g) {
    const int64_t nodes = (g + node - 1) / node;
    return std::to_string(g) + " GPUs (" + std::to_string(nodes) + (nodes == 1 ? " node)" : " nodes)");
  };
  // A GPU count that fits: fewer whole nodes (a count whose divisors the layouts need), or, when
  // none does and layouts ran out of memory, more GPUs: the smallest count of up to 8x, first the
  // larger divisors of a node, then whole nodes.
  int found = 0;
  for (int64_t g = (G - 1) / node * node; g >= std::max<int64_t>(node, G / 2) && found < 2; g -= node) {
    PlanOptions o = opt;
    o.gpus = g;
    PlanResult r = plan_all(cfg, o);
    if (r.ranked.empty()) continue;
    out.push_back({gpus_text(g), g, cfg.model.n_layers, cfg.train.global_batch, r.ranked.front()});
    ++found;
  }
  PlanOptions here = opt;
  here.gpus = G;
  const std::vector<Rejection> rejected = plan_all(cfg, here).rejected;
  const bool out_of_memory =
      std::any_of(rejected.begin(), rejected.end(), [](const Rejection& x) { return x.peak_bytes > 0; });
  std::vector<int64_t> more;
  for (int64_t g = G + 1; g < node && out_of_memory; ++g)
    if (node % g == 0) more.push_back(g);
  for (int64_t g = std::max<int64_t>(1, G / node + 1) * node; g <= 8 * G && out_of_memory; g += node) more.push_back(g);
  for (size_t k = 0; k < more.size() && found == 0; ++k) {
    PlanOptions o = opt;
    o.gpus = more[k];
    PlanResult r = plan_all(cfg, o);
    if (r.ranked.empty()) continue;
    out.push_back({gpus_text(more[k]), more[k], cfg.model.n_layers, cfg.train.global_batch, r.ranked.front()});
    ++found;
  }
  // A global batch that divides over more DP sizes: the nearest multiples of each dp the GPU
  // count allows, closest to the configured batch first.
  const int64_t gb = cfg.train.global_batch;
  std::vector<int64_t> batches;
  for (int64_t dp : divisors(G))
    for (int64_t b : {gb / dp * dp, (gb + dp - 1) / dp * dp})
      if (b > 0 && b != gb && std::find(batches.begin(), batches.end(), b) == batches.end()) batches.push_back(b);
  std::stable_sort(batches.begin(), batches.end(),
                   [&](int64_t a, int64_t b) { return std::llabs(a - gb) < std::llabs(b - gb); });
  found = 0;
  for (size_t k = 0; k < batches.size() && k < 8 && found < 2 && int(out.size()) < max_count; ++k) {
    RunConfig c = cfg;
    c.train.global_batch = batches[k];
    PlanOptions o = opt;
    o.gpus = G;
    PlanResult r = plan_all(c, o);
    if (r.ranked.empty()) continue;
    out.push_back({"train.global_batch " + std::to_string(batches[k]), G, cfg.model.n_layers, batches[k],
                   r.ranked.front()});
    ++found;
  }
  const int L = cfg.model.n_layers;
  for (int delta = 1; delta <= std::max(8, L / 10) && int(out.size()) < max_count; ++delta)
    for (int sign : {-1, 1}) {
      const int layers = L + sign * delta;
      if (layers < 1 || int(out.size()) >= max_count) continue;
      RunConfig c = cfg;
      c.model.n_layers = layers;
      PlanOptions o = opt;
      o.gpus = G;
      PlanResult r = plan_all(c, o);
      if (r.ranked.empty()) continue;
      out.push_back({"n_layers " + std::to_string(layers) + " (" + human_count(double(ParamTable(c.model).logical_numel())) +
                         " parameters)",
                     G, layers, cfg.train.global_batch, r.ranked.front()});
    }
  return out;
}

// ---------------------------------------------------------------------------------------------
// output

namespace {

// The attention settings the plan counts, in the memory-model line: which kernels, and the bound
// of their backward scratch, with the variable that sets it.
std::string attention_settings_text(const AttentionSettings& a) {
  const auto mib = [](size_t bytes) { return std::to_string(bytes >> 20) + " MiB"; };
  const std::string ds = a.ds_budget > 0 ? "staged dS at most " + mib(a.ds_budget) + " (KEEL_ATTN_DS_MB)"
                                         : "no staged dS (KEEL_ATTN_DS_MB=0)";
  switch (a.kernels) {
    case AttentionKernels::Simple: return "attention: the plain kernels (KEEL_ATTENTION=simple), no scratch";
    case AttentionKernels::Cudnn:
      return "attention: cuDNN (KEEL_ATTENTION=cudnn), workspace at most " + mib(a.cudnn_workspace_cap) +
             " (KEEL_CUDNN_WORKSPACE_MB); keel's fused kernels for the calls it does not take, " + ds;
    case AttentionKernels::Fused: break;
  }
  return "attention: keel's fused kernels, " + ds;
}

nlohmann::json attention_settings_json(const std::optional<AttentionSettings>& a) {
  if (!a) return nullptr;
  return {{"kernels", attention_kernels_name(a->kernels)},
          {"ds_budget_bytes", a->ds_budget},
          {"cudnn_workspace_cap_bytes", a->kernels == AttentionKernels::Cudnn ? nlohmann::json(a->cudnn_workspace_cap)
                                                                              : nlohmann::json()}};
}

std::string state_formula(const MemoryModel& mem, int64_t dp) {
  const StateBytes& s = mem.state;
  std::string f = fmt("%g", s.weights) + " (weights) + " + fmt("%g", s.grads) + " (grads)";
  if (s.shardable() > 0) {
    std::string parts;
    if (s.master > 0) parts += fmt("%g", s.master) + " master";
    if (s.moments > 0) parts += (parts.empty() ? "" : " + ") + fmt("%g", s.moments) + " Adam m,v";
    if (s.grad_shard > 0) parts += (parts.empty() ? "" : " + ") + fmt("%g", s.grad_shard) + " fp32 grad partition";
    f += " + (" + parts + ")";
    if (s.zero1) f += "/dp";
  }
  f += " = " + fmt("%g", s.unsharded() + s.shardable()) + " B/param unsharded";
  if (s.zero1 && dp > 1) f += ", " + fmt("%.2f", s.per_param(dp)) + " at dp=" + std::to_string(dp);
  return f;
}

std::string span_text(const StageSpan& sp);
std::string span_text(const StageMemory& st) {
  if (st.chunks.size() <= 1) return span_text(st.span);
  std::string s;
  for (const StageSpan& c : st.chunks) s += (s.empty() ? "" : " | ") + span_text(c);
  return s;
}
std::string span_text(const StageSpan& sp) {
  std::string s = sp.layers() > 0 ? std::to_string(sp.first_layer) + "-" + std::to_string(sp.end_layer - 1) : "none";
  if (sp.has_embedding) s = "emb + " + s;
  if (sp.has_head) s += " + head";
  return s;
}

// The activation policy: without full recomputation (rc false) or with it, as opt configures.
std::string recompute_name(bool rc, const PlanOptions& opt) {
  if (!rc) return opt.selective ? "selective recompute" : "no recompute";
  const int64_t layers = opt.recompute_layers;
  if (layers <= 0) return "full recompute";
  return "recompute of " + std::to_string(layers) + (layers == 1 ? " layer" : " layers") + " per stage" +
         (opt.selective ? ", selective for the others" : "");
}

// What the DP time of the step estimate assumes overlapped (empty when nothing is).
std::string dp_overlap_note(const PlanOptions& opt, const Layout& l) {
  if (l.dp <= 1 || (!opt.overlap_grad_reduce && !opt.overlap_param_gather)) return "";
  std::string what = opt.overlap_grad_reduce ? "gradient reduction" : "";
  if (opt.overlap_param_gather) what += what.empty() ? "weight gather" : " and weight gather";
  return " with the " + what + " overlapped";
}

}  // namespace

std::string layout_text(const RunConfig& cfg, const LayoutPlan& p, const PlanOptions& opt, bool with_cost) {
  const MemoryModel mem = opt.memory.name.empty() ? keel_memory_model(cfg.precision.mode) : opt.memory;
  const Layout& l = p.layout;
  std::ostringstream o;
  const int64_t nodes = (l.gpus() + opt.hw.gpus_per_node - 1) / opt.hw.gpus_per_node;
  o << "layout " << l.str() << ": " << l.gpus() << (l.gpus() > 1 ? " GPUs (" : " GPU (") << nodes << " node" << (nodes > 1 ? "s" : "") << " of "
    << opt.hw.gpus_per_node << "), " << p.micro_batches << (p.micro_batches == 1 ? " micro-batch of " : " micro-batches of ") << l.mbs << " per DP rank per step"
    << (p.embedding_own_slot ? ", embedding and head in their own pipeline slots" : "")
    << (p.pipeline_layers.empty() ? "" : ", layers per stage " + nlohmann::json(p.pipeline_layers).dump() +
                                             " (parallel.pipeline_layers)")
    << "\n";
  // first, a middle and the last stage, and the peak stage wherever it is (uneven splits, e.g.
  // with embedding slots, can put it elsewhere): the verdict's figure must be in the table
  std::vector<int> shown = {0};
  if (l.pp > 2) shown.push_back(static_cast<int>(l.pp / 2));
  if (l.pp > 1) shown.push_back(static_cast<int>(l.pp - 1));
  if (std::find(shown.begin(), shown.end(), p.peak_stage) == shown.end()) {
    shown.push_back(p.peak_stage);
    std::sort(shown.begin(), shown.end());
  }
  Table t;
  std::vector<std::string> head = {"per rank"};
  for (int s : shown) head.push_back(s == 0 ? "first stage" : s == l.pp - 1 ? "last stage" : "stage " + std::to_string(s));
  if (l.pp == 1) head[1] = "the only stage";
  t.row(head);
  auto add = [&](const std::string& name, auto value) {
    std::vector<std::string> r = {name};
    for (int s : shown) r.push_back(value(p.stages[s]));
    t.row(r);
  };
  const double shard = mem.state.zero1 ? double(l.dp) : 1.0;
  add("layers", [](const StageMemory& s) { return span_text(s); });
  add("parameters (exact)", [](const StageMemory& s) { return grouped(s.params); });
  add("  of which embedding / head", [](const StageMemory& s) {
    return grouped(s.embedding_params) + " / " + grouped(s.head_params);
  });
  auto gib = [](double b) { return format_bytes(b); };  // adaptive units
  add("weights (" + fmt("%g", mem.state.weights) + " B/param)", [&](const StageMemory& s) { return gib(s.weights); });
  add("grads (" + fmt("%g", mem.state.grads) + " B/param)", [&](const StageMemory& s) { return gib(s.grads); });
  if (mem.state.master > 0)
    add("fp32 master (" + fmt("%g", mem.state.master) + "/" + fmt("%g", shard) + " B/param)",
        [&](const StageMemory& s) { return gib(s.master); });
  add("Adam m, v (" + fmt("%g", mem.state.moments) + "/" + fmt("%g", shard) + " B/param)",
      [&](const StageMemory& s) { return gib(s.moments); });
  if (mem.state.grad_shard > 0)
    add("fp32 grad partition (" + fmt("%g", mem.state.grad_shard) + "/" + fmt("%g", shard) + ")",
        [&](const StageMemory& s) { return gib(s.grad_shard); });
  add(p.virtual_stages > 1 ? "micro-batches in flight per chunk" : "micro-batches in flight (1F1B)",
      [](const StageMemory& s) {
        if (s.chunk_in_flight.empty()) return std::to_string(s.in_flight);
        std::string t;
        for (int64_t n : s.chunk_in_flight) t += (t.empty() ? "" : " | ") + std::to_string(n);
        return t;
      });
  const std::string base_name = recompute_name(false, opt), rc_name = recompute_name(true, opt);
  add("activations, " + base_name, [&](const StageMemory& s) { return gib(s.act_full); });
  add("activations, " + rc_name, [&](const StageMemory& s) { return gib(s.act_recompute); });
  add(opt.recompute_layers > 0 ? "  kept per micro-batch" : "  stored layer inputs, head",
      [&](const StageMemory& s) { return gib(s.act_stored_recompute); });
  add("  one layer rebuilt + scratch", [&](const StageMemory& s) { return gib(s.act_working_recompute); });
  if (p.stages[0].overhead > 0)
    add("CUDA context, comm buffers, attention scratch", [&](const StageMemory& s) { return gib(s.overhead); });
  add("total, " + base_name, [&](const StageMemory& s) { return gib(s.total(false)); });
  add("total, " + rc_name, [&](const StageMemory& s) { return gib(s.total(true)); });
  o << t.str();
  o << "  state: " << state_formula(mem, l.dp) << "\n";
  const Activations a =
      activation_bytes(model_for_tp(cfg.model, l.tp), mem, l.tp, l.mbs, cfg.train.seq_len, opt.sequence_parallel,
                       opt.logits_chunk_rows);
  o << "  activations per micro-batch (" << l.mbs << " x " << cfg.train.seq_len << " tokens): "
    << format_bytes(a.per_layer_full + a.attn_scores) << " per layer kept for backward, ";
  if (opt.selective)
    o << format_bytes(a.per_layer_full + a.attn_scores - a.per_layer_rebuilt)
      << " with selective recomputation (without the norm outputs and MLP activation), ";
  o << format_bytes(a.per_layer_input) << " per layer with full recomputation (its input)";
  if (mem.attn_score_bytes > 0) o << ", of which attention scores " << format_bytes(a.attn_scores);
  o << "\n";
  if (cfg.model.is_gpt2()) {
    const SeedAccounting sa = seed_accounting(cfg.model, l);
    o << "  seed accounting (12h^2+13h per layer, v*h embedding, no positions, norms or padding): "
      << grouped(std::llround(sa.with_embedding)) << " params with the embedding ("
      << gb_dec(sa.with_embedding * 18) << " at 18 B), " << grouped(std::llround(sa.without_embedding))
      << " without (" << gb_dec(sa.without_embedding * 18) << ")\n";
  }
  if (p.usable_bytes > 0) {
    o << "  verdict: " << (p.fits ? "fits" : "DOES NOT FIT") << " with " << recompute_name(p.recompute, opt) << ": peak "
      << format_bytes(p.peak_bytes) << " on stage " << p.peak_stage << " of " << format_bytes(opt.hw.gpu_mem_bytes)
      << " (" << format_bytes(p.usable_bytes) << " usable, " << fmt("%g", mem.headroom * 100) << "% headroom)\n";
  }
  if (!with_cost) return o.str();
  o << "  pipeline bubble " << fmt("%.1f%%", 100 * p.bubble) << "; per rank per step: TP " << gb_dec(p.comm.tp)
    << ", PP " << gb_dec(p.comm.pp) << ", DP " << gb_dec(p.comm.dp) << " sent\n";
  o << "  estimated step " << fmt("%.2f s", p.time.step_s) << " (compute " << fmt("%.2f", p.time.compute_s)
    << ", TP " << fmt("%.2f", p.time.tp_comm_s) << ", PP " << fmt("%.2f", p.time.pp_comm_s) << ", DP "
    << fmt("%.2f", p.time.dp_comm_s) << dp_overlap_note(opt, l) << "), block matmul efficiency "
    << fmt("%.0f%%", 100 * p.time.gemm_efficiency)
    << ", " << fmt("%.1f", p.time.model_tflops) << " model TFLOP/s per GPU\n";
  if (p.balance) {
    const auto [lo, hi] = std::minmax_element(p.stage_seconds.begin(), p.stage_seconds.end());
    o << "  pipeline balance: a micro-batch takes " << fmt("%.3f", *lo) << "-" << fmt("%.3f s", *hi)
      << " a stage, stage " << (hi - p.stage_seconds.begin()) << " the slowest; parallel.pipeline_layers "
      << nlohmann::json(p.balance->layers).dump() << " evens them: estimated step " << fmt("%.2f s", p.balance->step_s)
      << fmt(" (%.1f%% less)", 100 * (1 - p.balance->step_s / p.time.step_s)) << ", peak "
      << format_bytes(p.balance->peak_bytes) << (p.recompute && !p.balance->recompute ? " without recomputation" : "")
      << "\n";
  }
  for (const auto& w : p.warnings) o << "  warning: " << w << "\n";
  return o.str();
}

std::string plan_text(const RunConfig& cfg, const PlanResult& r, const PlanOptions& opt, int top, bool all_rejections) {
  const ModelConfig& m = cfg.model;
  const ModelCount& c = r.count;
  std::ostringstream o;
  o << "keel plan: " << cfg.name << " (" << cfg.source << ")\n";
  o << "model: " << family_name(m.family) << ", " << m.n_layers << " layers x d_model " << m.d_model << ", "
    << m.n_heads << " heads (" << m.n_kv_heads << " kv), head_dim " << m.head_dim() << ", ffn " << m.ffn_hidden
    << ", vocab " << m.vocab_size << option_names(m);
  if (c.padded_vocab != m.vocab_size) o << " (padded to " << c.padded_vocab << " at tp=" << cfg.parallel.tp << ")";
  o << ", seq " << cfg.train.seq_len << (m.tied_embeddings ? ", tied head" : "") << "\n";
  o << "parameters (exact, the trainer's ParamTable): " << grouped(c.exact) << " (" << human_count(double(c.exact))
    << ") = embedding " << grouped(c.embedding) << " + " << m.n_layers << " x " << grouped(c.per_layer)
    << " per layer + head " << grouped(c.head) << "\n";
  if (c.gpt_formula) {
    o << "  seed formula l*(12h^2+13h) + v*h + s*h + 2h = " << grouped(std::llround(*c.gpt_formula)) << " ("
      << human_count(*c.gpt_formula) << ")";
    const double diff = double(c.exact) - *c.gpt_formula;
    if (diff != 0)
      o << "; keel has " << grouped(std::llround(diff)) << " more: " << (c.padded_vocab - m.vocab_size)
        << " padding rows x " << m.d_model;
    o << "\n";
  }
  if (m.d_model % opt.hw.sm_count != 0)
    o << "  note: d_model % " << opt.hw.sm_count << " = " << m.d_model % opt.hw.sm_count
      << " (the seed's wave-quantization rule of thumb: d_model a multiple of the SM count x tp)\n";
  o << "memory model: " << r.memory.name << ": " << state_formula(r.memory, 1) << "; ZeRO-1 over DP"
    << (r.memory.state.zero1 ? "" : " off") << "; activations " << r.memory.act_bytes << " B; CUDA context "
    << format_bytes(r.memory.cuda_context_bytes);
  if (r.memory.gpu_attention) o << "; " << attention_settings_text(*r.memory.gpu_attention);
  if (r.memory.comm_buffer_bytes > 0) o << ", comm buffers " << format_bytes(r.memory.comm_buffer_bytes);
  o << "; " << fmt("%g", r.memory.headroom * 100) << "% headroom\n";
  const Hardware& hw = opt.hw;
  o << "cluster: " << r.gpus << " GPUs, " << hw.gpus_per_node << " per node, " << format_bytes(hw.gpu_mem_bytes)
    << " each; cost model: " << fmt("%g", hw.achievable_tflops) << " TFLOP/s achievable, " << hw.tile_rows << "x"
    << hw.tile_cols << " tiles on " << hw.sm_count << " SMs, NVLink " << fmt("%g", hw.intra_node_gbps)
    << " GB/s, inter-node " << fmt("%g", hw.inter_node_gbps) << " GB/s per GPU\n";
  o << "batch: global " << cfg.train.global_batch;
  if (cfg.schedule.rampup)
    o << ", ramp-up from " << cfg.schedule.rampup->start << " by " << cfg.schedule.rampup->increment;
  o << "; activation policy: " << (opt.selective ? "selective recompute, " : "")
    << (opt.recompute == Recompute::Auto ? "full recompute only when needed"
                                         : opt.recompute == Recompute::Always ? "always full recompute"
                                                                              : "never full recompute")
    << "\n\n";

  if (!r.ranked.empty()) {
    o << "best: " << layout_text(cfg, r.ranked.front(), opt) << "\n";
    o << r.ranked.size() << " feasible layout" << (r.ranked.size() > 1 ? "s" : "") << ", fastest first";
    if (static_cast<int>(r.ranked.size()) > top) o << " (top " << top << ", --top N for more)";
    o << ":\n";
    Table t;
    // The chunks per pipeline rank get a column when they vary or are not 1.
    const bool show_v = opt.virtual_stages != 1;
    std::vector<std::string> head = {"#", "tp", "pp", "dp", "mbs", "m", "activations", "peak GiB", "@stage", "bubble",
                                     "TP GB", "PP GB", "DP GB", "step s", "TFLOP/s", "warnings"};
    if (show_v) head.insert(head.begin() + 3, "v");
    t.row(head);
    int rank = 0;
    for (const auto& p : r.ranked) {
      if (++rank > top) break;
      const Layout& l = p.layout;
      std::vector<std::string> row = {
          std::to_string(rank), std::to_string(l.tp), std::to_string(l.pp), std::to_string(l.dp),
          std::to_string(l.mbs), std::to_string(p.micro_batches), p.recompute ? "recompute" : "kept",
          fmt("%.1f", p.peak_bytes / kGiB), std::to_string(p.peak_stage), fmt("%.1f%%", 100 * p.bubble),
          fmt("%.1f", p.comm.tp / 1e9), fmt("%.2f", p.comm.pp / 1e9), fmt("%.1f", p.comm.dp / 1e9),
          fmt("%.1f", p.time.step_s), fmt("%.1f", p.time.model_tflops), std::to_string(p.warnings.size())};
      if (show_v) row.insert(row.begin() + 3, std::to_string(p.virtual_stages));
      t.row(row);
    }
    o << t.str();
    o << "  (" << (show_v ? "v: model chunks per pipeline rank (parallel.virtual_stages); " : "")
      << "m: micro-batches per DP rank per step; comm: GB one rank sends per step; step time and TFLOP/s are "
         "cost-model estimates; \"recompute\": the layout needs train.recompute \"full\")\n";
    // Where the config's own layout landed, when it is one of the candidates.
    const Layout own{cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.dp, cfg.train.micro_batch};
    if (own.gpus() == r.gpus) {
      std::string where;
      for (size_t i = 0; i < r.ranked.size() && where.empty(); ++i)
        if (const Layout& l = r.ranked[i].layout; l.tp == own.tp && l.pp == own.pp && l.dp == own.dp && l.mbs == own.mbs)
          where = "rank " + std::to_string(i + 1) + fmt(", %.1f s per step", r.ranked[i].time.step_s);
      for (const auto& x : r.rejected)
        if (where.empty() && x.layout.tp == own.tp && x.layout.pp == own.pp && x.layout.dp == own.dp &&
            (x.layout.mbs == own.mbs || x.layout.mbs == 0))
          where = "rejected: " + x.reason;
      if (where.empty()) where = "not searched (pinned sizes or --max-mbs)";
      o << "  the config's own layout " << own.str() << ": " << where << "\n";
    }
  } else {
    o << "no layout fits " << r.gpus << " GPUs.\n";
  }
  // A layout out of memory under its split that a split of its own fits, faster than any above
  // (with its own balance advice).
  const Rejection* split_fit = nullptr;
  for (const auto& x : r.rejected)
    if (x.fitting && (!split_fit || x.fitting->step_s < split_fit->fitting->step_s)) split_fit = &x;
  double fastest_ranked = std::numeric_limits<double>::infinity();
  for (const auto& p : r.ranked) fastest_ranked = std::min(fastest_ranked, p.balance ? p.balance->step_s : p.time.step_s);
  if (split_fit && split_fit->fitting->step_s < fastest_ranked) {
    const Layout& l = split_fit->layout;
    const LayoutPlan::Balance& f = *split_fit->fitting;
    std::string layers;
    for (int n : f.layers) layers += (layers.empty() ? "" : ",") + std::to_string(n);
    o << "  " << (r.ranked.empty() ? "with a split of its own: " : "faster with a split of its own: ") << l.str()
      << " runs out of memory split as configured, but fits with parallel.pipeline_layers "
      << nlohmann::json(f.layers).dump() << ": estimated step " << fmt("%.2f s", f.step_s) << ", peak "
      << format_bytes(f.peak_bytes) << (f.recompute ? " with recomputation" : "") << " (details: keel plan --tp "
      << l.tp << " --pp " << l.pp << " --dp " << l.dp << " --mbs " << l.mbs << " --pipeline-layers " << layers
      << ")\n";
  }
  if (!r.rejected.empty()) {
    o << "\n" << r.rejected.size() << " rejected:\n";
    // Group by the reason's kind so the list stays readable; --all prints each.
    std::map<std::string, std::vector<const Rejection*>> by_kind;
    for (const auto& x : r.rejected) {
      std::string kind = x.reason.substr(0, x.reason.find_first_of("0123456789"));
      by_kind[kind].push_back(&x);
    }
    for (const auto& [kind, list] : by_kind) {
      const size_t show = all_rejections ? list.size() : std::min<size_t>(list.size(), 4);
      for (size_t i = 0; i < show; ++i) {
        const Layout& l = list[i]->layout;
        o << "  tp=" << l.tp << " pp=" << l.pp << " dp=" << l.dp << " mbs=" << (l.mbs ? std::to_string(l.mbs) : "*")
          << ": " << list[i]->reason << "\n";
      }
      if (show < list.size()) o << "  ... and " << list.size() - show << " more like that (--all)\n";
    }
  }
  return o.str();
}

std::string alternatives_text(const std::vector<Alternative>& alts) {
  if (alts.empty()) return "";
  std::string s = "closest changes that fit:\n";
  Table t;
  t.row({"change", "best layout", "peak GiB", "bubble", "step s", "TFLOP/s"});
  for (const auto& a : alts)
    t.row({a.change, a.best.layout.str() + (a.best.recompute ? " (recompute)" : ""), fmt("%.1f", a.best.peak_bytes / kGiB),
           fmt("%.1f%%", 100 * a.best.bubble), fmt("%.1f", a.best.time.step_s), fmt("%.1f", a.best.time.model_tflops)});
  return s + t.str();
}

nlohmann::json layout_json(const LayoutPlan& p) {
  nlohmann::json j;
  const Layout& l = p.layout;
  j["layout"] = {{"tp", l.tp}, {"pp", l.pp}, {"dp", l.dp}, {"mbs", l.mbs}, {"gpus", l.gpus()}};
  j["embedding_own_slot"] = p.embedding_own_slot;
  j["pipeline_layers"] = p.pipeline_layers;
  j["virtual_stages"] = p.virtual_stages;
  j["micro_batches"] = p.micro_batches;
  j["recompute"] = p.recompute;
  j["fits"] = p.fits;
  j["peak_bytes"] = p.peak_bytes;
  j["peak_stage"] = p.peak_stage;
  j["usable_bytes"] = p.usable_bytes;
  j["bubble"] = p.bubble;
  j["comm_bytes_per_rank_per_step"] = {{"tp", p.comm.tp}, {"pp", p.comm.pp}, {"dp", p.comm.dp}};
  j["time"] = {{"step_s", p.time.step_s},       {"compute_s", p.time.compute_s},
               {"tp_comm_s", p.time.tp_comm_s}, {"pp_comm_s", p.time.pp_comm_s},
               {"dp_comm_s", p.time.dp_comm_s}, {"gemm_efficiency", p.time.gemm_efficiency},
               {"model_tflops_per_gpu", p.time.model_tflops}};
  nlohmann::json stages = nlohmann::json::array();
  for (const auto& s : p.stages) {
    nlohmann::json chunks = nlohmann::json::array();
    for (size_t c = 0; c < s.chunks.size() && p.virtual_stages > 1; ++c)
      chunks.push_back({{"first_layer", s.chunks[c].first_layer},
                        {"end_layer", s.chunks[c].end_layer},
                        {"embedding", s.chunks[c].has_embedding},
                        {"head", s.chunks[c].has_head},
                        {"in_flight", s.chunk_in_flight.at(c)}});
    stages.push_back({{"stage", s.stage},
                      {"chunks", chunks},
                      {"first_layer", s.span.first_layer},
                      {"end_layer", s.span.end_layer},
                      {"embedding", s.span.has_embedding},
                      {"head", s.span.has_head},
                      {"params", s.params},
                      {"embedding_params", s.embedding_params},
                      {"layer_params", s.layer_params},
                      {"head_params", s.head_params},
                      {"tied_copy_params", s.tied_copy},
                      {"bytes",
                       {{"weights", s.weights},
                        {"grads", s.grads},
                        {"master", s.master},
                        {"moments", s.moments},
                        {"grad_partition", s.grad_shard},
                        {"activations_no_recompute", s.act_full},
                        {"activations_recompute", s.act_recompute},
                        {"overhead", s.overhead},
                        {"total_no_recompute", s.total(false)},
                        {"total_recompute", s.total(true)}}},
                      {"in_flight", s.in_flight}});
  }
  j["stages"] = stages;
  j["stage_seconds"] = p.stage_seconds;
  j["pipeline_balance"] = p.balance ? nlohmann::json{{"pipeline_layers", p.balance->layers},
                                                     {"step_s", p.balance->step_s},
                                                     {"peak_bytes", p.balance->peak_bytes},
                                                     {"recompute", p.balance->recompute}}
                                    : nlohmann::json();
  j["warnings"] = p.warnings;
  return j;
}

nlohmann::json plan_json(const RunConfig& cfg, const PlanResult& r, const PlanOptions& opt) {
  nlohmann::json j;
  const ModelConfig& m = cfg.model;
  j["config"] = cfg.source;
  j["model"] = {{"family", family_name(m.family)}, {"layers", m.n_layers},     {"d_model", m.d_model},
                {"heads", m.n_heads},              {"kv_heads", m.n_kv_heads}, {"ffn", m.ffn_hidden},
                {"vocab", m.vocab_size},           {"padded_vocab", r.count.padded_vocab},
                {"seq_len", cfg.train.seq_len}};
  j["parameters"] = {{"exact", r.count.exact},
                     {"embedding", r.count.embedding},
                     {"layers", r.count.layers},
                     {"per_layer", r.count.per_layer},
                     {"head", r.count.head},
                     {"seed_formula", r.count.gpt_formula ? nlohmann::json(*r.count.gpt_formula) : nlohmann::json()}};
  const StateBytes& s = r.memory.state;
  j["memory_model"] = {{"name", r.memory.name},
                       {"bytes_per_param",
                        {{"weights", s.weights},
                         {"grads", s.grads},
                         {"master", s.master},
                         {"moments", s.moments},
                         {"grad_partition", s.grad_shard},
                         {"unsharded_total", s.unsharded() + s.shardable()}}},
                       {"zero1", s.zero1},
                       {"activation_bytes", r.memory.act_bytes},
                       {"attention_score_bytes", r.memory.attn_score_bytes},
                       {"cuda_context_bytes", r.memory.cuda_context_bytes},
                       {"attention", attention_settings_json(r.memory.gpu_attention)},
                       {"comm_buffer_bytes", r.memory.comm_buffer_bytes},
                       {"headroom", r.memory.headroom}};
  const Hardware& hw = opt.hw;
  j["hardware"] = {{"gpus", r.gpus},
                   {"gpus_per_node", hw.gpus_per_node},
                   {"gpu_mem_bytes", hw.gpu_mem_bytes},
                   {"sm_count", hw.sm_count},
                   {"tile", {hw.tile_rows, hw.tile_cols}},
                   {"achievable_tflops", hw.achievable_tflops},
                   {"intra_node_gbps", hw.intra_node_gbps},
                   {"inter_node_gbps", hw.inter_node_gbps},
                   {"microbatch_overhead_s", hw.microbatch_overhead_s}};
  // With it, a stage's "no_recompute" figures are those of selective recomputation (without full).
  j["selective_recompute"] = opt.selective;
  j["ranked"] = nlohmann::json::array();
  for (const auto& p : r.ranked) j["ranked"].push_back(layout_json(p));
  j["rejected"] = nlohmann::json::array();
  for (const auto& x : r.rejected)
    j["rejected"].push_back({{"tp", x.layout.tp},
                             {"pp", x.layout.pp},
                             {"dp", x.layout.dp},
                             {"mbs", x.layout.mbs ? nlohmann::json(x.layout.mbs) : nlohmann::json("any")},
                             {"reason", x.reason},
                             {"peak_bytes", x.peak_bytes > 0 ? nlohmann::json(x.peak_bytes) : nlohmann::json()},
                             {"fitting_split", x.fitting ? nlohmann::json{{"pipeline_layers", x.fitting->layers},
                                                                         {"step_s", x.fitting->step_s},
                                                                         {"peak_bytes", x.fitting->peak_bytes},
                                                                         {"recompute", x.fitting->recompute}}
                                                         : nlohmann::json()}});
  return j;
}

namespace {
// The planner's options for the run itself: its layout's policies, keel's memory model with the
// attention settings of this process's environment; a CPU run has no CUDA context and no GPU
// attention scratch.
PlanOptions run_options(const RunConfig& cfg, bool gpu) {
  PlanOptions opt;
  opt.memory = keel_memory_model(cfg.precision.mode);
  opt.recompute = cfg.train.recompute == "full" ? Recompute::Always : Recompute::Never;
  opt.recompute_layers = cfg.train.recompute_layers;
  opt.selective = cfg.train.selective_recompute();
  opt.sequence_parallel = cfg.parallel.sequence_parallel;
  opt.logits_chunk_rows = cfg.train.logits_chunk_rows;
  opt.embedding_own_slot = cfg.parallel.embedding_slot;
  opt.pipeline_layers = cfg.parallel.pipeline_layers;
  opt.virtual_stages = cfg.parallel.virtual_stages;
  opt.overlap_grad_reduce = cfg.parallel.overlap_grad_reduce;
  opt.overlap_param_gather = cfg.parallel.overlap_param_gather;
  opt.grad_bucket_size = cfg.parallel.grad_bucket_size;
  // The run's own layout is given: the node-size rule for TP is the plan's advice, not the run's.
  opt.hw.gpus_per_node = cfg.parallel.world();
  if (gpu) {
    opt.memory.gpu_attention = attention_settings_from_env();  // what the run's CudaBackend reads
  } else {
    opt.memory.cuda_context_bytes = 0;
    opt.memory.gpu_attention.reset();
  }
  return opt;
}
Layout run_layout(const RunConfig& cfg) {
  return Layout{cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.dp, cfg.train.micro_batch};
}
}  // namespace

double planned_backend_bytes(const RunConfig& cfg, int stage, bool gpu) {
  PlanOptions opt = run_options(cfg, gpu);
  opt.memory.cuda_context_bytes = 0;  // not the backend's
  const Layout l = run_layout(cfg);
  if (!layout_problem(cfg, l, opt).empty()) return 0;
  const LayoutPlan p = plan_layout(cfg, l, opt);
  return p.stages.at(static_cast<size_t>(stage)).total(p.recompute);
}

std::vector<int> run_pipeline_layer_caps(const RunConfig& cfg, double gpu_mem_bytes) {
  if (gpu_mem_bytes <= 0 || cfg.parallel.virtual_stages != 1) return {};
  PlanOptions opt = run_options(cfg, true);
  opt.hw.gpu_mem_bytes = gpu_mem_bytes;
  const Layout l = run_layout(cfg);
  if (!layout_problem(cfg, l, opt).empty()) return {};
  return pipeline_layer_caps(cfg, l, opt, opt.recompute == Recompute::Always);
}

double async_save_host_bytes(const RunConfig& cfg, int stage) {
  if (!cfg.checkpoint.async) return 0;
  const PlanOptions opt = run_options(cfg, false);
  const Layout l = run_layout(cfg);
  if (!layout_problem(cfg, l, opt).empty()) return 0;
  return plan_layout(cfg, l, opt).stages.at(static_cast<size_t>(stage)).save_copy();
}

std::string memory_breakdown_text(const RunConfig& cfg, double gpu_mem_bytes) {
  PlanOptions opt = run_options(cfg, gpu_mem_bytes > 0);
  if (gpu_mem_bytes > 0) opt.hw.gpu_mem_bytes = gpu_mem_bytes;
  const Layout l = run_layout(cfg);
  if (std::string why = layout_problem(cfg, l, opt); !why.empty()) return "memory plan: " + why + "\n";
  LayoutPlan p = plan_layout(cfg, l, opt);
  if (gpu_mem_bytes <= 0) p.usable_bytes = 0;  // nothing to compare against: no verdict line
  std::string text = layout_text(cfg, p, opt, false);
  text += "  this run: " + recompute_name(p.recompute, opt) + " (train.recompute), activations " +
          format_bytes(p.recompute ? p.stages[p.peak_stage].act_recompute : p.stages[p.peak_stage].act_full) +
          " on the largest stage\n";
  if (opt.memory.gpu_attention)
    text += "  this run: " + attention_settings_text(*opt.memory.gpu_attention) + ": " +
            format_bytes(attention_scratch_bytes(cfg.model, opt.memory, l.tp, l.mbs, cfg.train.seq_len)) +
            " of scratch in a layer's backward\n";
  const Activations a = activation_bytes(model_for_tp(cfg.model, l.tp), opt.memory, l.tp, l.mbs, cfg.train.seq_len,
                                         opt.sequence_parallel, opt.logits_chunk_rows);
  if (a.head_shared > 0)
    text += "  this run: the head's logits in chunks of " + std::to_string(a.logits_chunk_rows) + " of the " +
            std::to_string(l.mbs * cfg.train.seq_len) + " token rows (train.logits_chunk_rows), " +
            format_bytes(a.head_shared) + " each\n";
  if (cfg.checkpoint.async) {  // the host copy a background save writes from
    double largest = 0;
    for (const StageMemory& m : p.stages) largest = std::max(largest, m.save_copy());
    text += "  this run: background saves (checkpoint.async) hold a host-memory copy of up to " +
            format_bytes(largest) + " per rank while they are written\n";
  }
  // A run that will not fit: what each memory setting it does not use yet would give.
  auto hint = [&](const std::string& setting, const PlanOptions& o) {
    const LayoutPlan q = plan_layout(cfg, l, o);
    text += "  hint: with " + setting + " the peak would be " + format_bytes(q.peak_bytes) +
            (q.fits ? " (fits)" : " (still too much: a smaller micro_batch, or more tp/pp)") + "\n";
  };
  if (p.usable_bytes > 0 && !p.fits && l.pp > 1) {
    // The first stages keep the most micro-batches in flight: fewer layers there may fit.
    if (const auto f = balance_pipeline(cfg, p, opt))
      text += "  hint: with parallel.pipeline_layers " + nlohmann::json(f->layers).dump() + " the peak would be " +
              format_bytes(f->peak_bytes) + " (fits)\n";
  }
  if (p.usable_bytes > 0 && !p.fits && l.tp > 1 && !opt.sequence_parallel) {
    PlanOptions o = opt;
    o.sequence_parallel = true;
    hint("parallel.sequence_parallel true", o);
  }
  if (p.usable_bytes > 0 && !p.fits && opt.recompute == Recompute::Never && !opt.selective) {
    PlanOptions o = opt;
    o.selective = true;
    hint("train.recompute \"selective\"", o);
  }
  if (p.usable_bytes > 0 && !p.fits && opt.recompute == Recompute::Never) {
    PlanOptions o = opt;
    o.selective = false;
    o.recompute = Recompute::Always;
    o.recompute_layers = 0;
    hint("train.recompute \"full\"", o);
  }
  return text;
}

}  // namespace keel::plan
