// What the network is. One struct describes both families:
//   gpt2:  learned positions, LayerNorm (with bias), GELU MLP, biases everywhere, tied head.
//   llama: RoPE, RMSNorm, SwiGLU MLP, no biases, grouped-query attention, head tied or not.
// Two BLOOM options on top of either family (Megatron-DeepSpeed's --position-embedding-type
// alibi and --embed-layernorm):
//   alibi:          ALiBi attention biases (kernels/alibi.h) replace the family's positions (no
//                   pos_embed for gpt2, no RoPE for llama);
//   embedding_norm: the family's norm applied to the embedding output (embed_norm.weight/.bias),
//                   which the BigScience 104B runs added against loss spikes. A norm: never
//                   weight-decayed (model/param_table.h).
// Three llama options (Megatron's --add-qkv-bias, --qk-layernorm, --kv-channels):
//   qkv_bias:       biases on the q, k and v projections (attn.bq/bk/bv), as in Qwen2 / Qwen2.5;
//                   gpt2 always has them.
//   qk_norm:        each head of q and of k goes through an RMSNorm over head_dim (weights
//                   attn.q_norm.weight / attn.k_norm.weight [head_dim], shared by the heads)
//                   before RoPE, as in Qwen3. Norms: never weight-decayed.
//   head_dim:       the head size when it is not d_model / n_heads (Qwen3: 128 for any width);
//                   q is then n_heads * head_dim wide and wo maps it back to d_model.
// And for either family (Mistral's sliding_window, Megatron's --window-size):
//   sliding_window: each token attends only the sliding_window tokens ending at itself (keys
//                   j > i - W; kernels/attention_window.h), in every layer. 0: no limit.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kernels/rope_frequencies.h"

namespace keel {

enum class Family { GPT2, Llama };

struct ModelConfig {
  Family family = Family::Llama;
  int64_t vocab_size = 0;        // tokenizer vocabulary: every token id is below this
  int64_t pad_vocab_multiple = 1; // pad embedding rows to a multiple of this * tp (Megatron's
                                   // make-vocab-size-divisible-by); padding rows are never targets
  int64_t padded_vocab_size = 0;  // resulting rows of the embedding and head; 0 = vocab_size
  int d_model = 0;
  int n_layers = 0;
  int n_heads = 0;
  int n_kv_heads = 0;   // == n_heads for plain multi-head attention
  int ffn_hidden = 0;   // MLP inner width (per projection for SwiGLU)
  float norm_eps = 1e-5f;
  float rope_theta = 10000.0f;
  RopeScaling rope_scaling;  // Llama 3.1/3.2's frequency scaling, or none
  int max_seq_len = 0;
  bool tied_embeddings = false;
  bool alibi = false;
  bool embedding_norm = false;
  bool qkv_bias = false;  // llama only; see has_qkv_bias()
  bool qk_norm = false;   // llama only
  int explicit_head_dim = 0;  // model.head_dim; 0: d_model / n_heads
  int sliding_window = 0;     // model.sliding_window; 0: none
  float init_std = 0.02f;

  bool is_gpt2() const { return family == Family::GPT2; }
  bool is_llama() const { return family == Family::Llama; }
  int64_t embed_rows() const { return padded_vocab_size > 0 ? padded_vocab_size : vocab_size; }
  int head_dim() const { return explicit_head_dim > 0 ? explicit_head_dim : d_model / n_heads; }
  int q_dim() const { return n_heads * head_dim(); }
  int kv_dim() const { return n_kv_heads * head_dim(); }
  // The keys the FLOP count gives each query of a sequence of `seq` (keel counts them all, without
  // the causal halving: the PaLM / llm.c convention), at most the window.
  int64_t attended_keys(int64_t seq) const {
    return sliding_window > 0 && sliding_window < seq ? sliding_window : seq;
  }
  // The positions' rotation: Llama's RoPE, none for GPT-2 (learned positions) or ALiBi.
  Rope rope() const { return is_llama() && !alibi ? Rope(rope_theta, rope_scaling) : Rope(); }
  bool has_qkv_bias() const { return is_gpt2() || qkv_bias; }
  bool learned_positions() const { return is_gpt2() && !alibi; }  // a pos_embed table
  // "learned", "rope" or "alibi" (the config's model.position_embedding)
  std::string position_embedding() const { return alibi ? "alibi" : is_gpt2() ? "learned" : "rope"; }
};

std::string family_name(Family f);
// The options beyond the family's defaults, each as ", name" (e.g. ", ALiBi, q/k/v biases"), for
// the one-line model descriptions of keel train, plan, sample and eval.
std::string option_names(const ModelConfig& m);
// Training FLOPs per token (forward + backward) at sequence length `seq`, the PaLM / llm.c
// convention of MFU: 6 x (parameters that enter a matmul, the head included; not the embedding
// lookups) + 12 x n_layers x attended_keys(seq) x (n_heads x head_dim) (QK^T and PV, without the
// causal halving). Used by keel train's TFLOPs and keel plan alike.
double flops_per_token(const ModelConfig& m, int64_t seq);

// How the layers are cut into pipeline stages (parallel.embedding_slot, parallel.pipeline_layers).
struct PipelineSplit {
  // The embedding and the head count as one layer each (the BLOOM team's balancing of a large
  // vocabulary): n_layers + 2 units are spread over the stages, so the first and last stage get
  // fewer transformer layers.
  bool embedding_slots = false;
  // The layers of every (virtual) stage in model order, as the user chose them (Megatron's
  // uneven first and last stages, in general); they sum to n_layers, and only the first stage
  // (the embedding) and the last (the head) may hold none. Empty: spread evenly.
  std::vector<int> layers;
};

}  // namespace keel
