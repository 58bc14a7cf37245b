// The parameter table: one row per logical tensor, generated from the ModelConfig (and, once
// parallelism lands, the rank's place in the grid). Everything that must treat parameters
// differently reads it from here: weight decay (derived from the role, never from a class
// check), tensor-parallel split, tied groups, init, and where the local shard lives in the
// rank's flat buffers (one buffer per dtype: working weights, fp32 grads, masters, moments).
//
// Names are Hugging-Face-like and stable (checkpoints and conversions key on them):
//   tok_embed [V, d]                      pos_embed [max_seq, d] (gpt2 without alibi)
//   embed_norm.weight/.bias (model.embedding_norm)
//   layers.{i}.attn_norm.weight/.bias      layers.{i}.attn.wq/wk/wv [heads*hd, d], .bq/.bk/.bv (gpt2, qkv_bias)
//   layers.{i}.attn.q_norm.weight/k_norm.weight [hd] (qk_norm)
//   layers.{i}.attn.wo [d, n_heads*hd]     layers.{i}.attn.bo (gpt2)
//   layers.{i}.mlp_norm.weight/.bias       llama: layers.{i}.mlp.w_gate/w_up [ffn, d], w_down [d, ffn]
//                                          gpt2:  layers.{i}.mlp.w_fc [ffn, d], b_fc, w_proj [d, ffn], b_proj
//   final_norm.weight/.bias                lm_head [V, d] (untied only)
// Linear weights are [out, in]. wq|wk|wv, bq|bk|bv and w_gate|w_up are laid out back to back
// so each group is one matmul operand (also for a TP rank's local shards).
#pragma once

#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

#include "kernels/tensor.h"
#include "model/model_config.h"

namespace keel {

enum class Role { Matrix, Embedding, Norm, Bias };
// How tensor parallelism splits a tensor: Rows = dim 0 (column-parallel outputs, vocab rows),
// Cols = dim 1 (row-parallel inputs), None = replicated on every TP rank.
enum class TpSplit { None, Rows, Cols };

std::string role_name(Role r);
std::string split_name(TpSplit s);
// Weight decay by role: matrices and embeddings decay; norms and biases never do.
constexpr bool role_decays(Role r) { return r == Role::Matrix || r == Role::Embedding; }

// Which part of the model this rank holds (all of it until tensor/pipeline parallelism).
struct ModelShard {
  int tp_rank = 0, tp_size = 1;
  int first_layer = 0, end_layer = -1;  // [first, end); -1 = n_layers
  bool has_embedding = true;            // tok_embed (+ pos_embed)
  bool has_head = true;                 // final norm + head (tok_embed copy when tied)
};

struct ParamSpec {
  std::string name;
  std::vector<int64_t> shape;   // logical (full) shape
  Role role = Role::Matrix;
  TpSplit split = TpSplit::None;
  int layer = -1;               // -1: not inside a transformer block
  bool decay = false;           // == role_decays(role)
  // The last pipeline stage's copy of a tied tok_embed: same name and values as the first
  // stage's, kept identical by summing both copies' gradients (never saved or counted twice).
  bool tied_copy = false;
  float init_std = 0;           // > 0: N(0, init_std); else constant init_value
  float init_value = 0;
  // tok_embed and lm_head of a padded vocabulary (model.pad_vocab_to_multiple_of): rows from
  // this one on are padding, no token's; they start at zero and, never getting a gradient, stay
  // there. 0: no padding rows.
  int64_t padded_from = 0;

  // This rank's shard: local_shape is shape with the split dimension divided by tp_size,
  // starting at shard_begin along that dimension; it lives at [offset, offset + numel) of the
  // rank's flat buffers.
  std::vector<int64_t> local_shape;
  int64_t shard_begin = 0;
  int64_t offset = 0;
  int64_t numel = 0;

  int64_t logical_numel() const;
};

class ParamTable {
 public:
  ParamTable() = default;
  ParamTable(const ModelConfig& cfg, const ModelShard& shard = {});
  // A rank holding several model chunks (the interleaved pipeline schedule): the chunks' tensors
  // one after another in one table and one set of flat buffers. shard() then has the union's
  // flags (embedding, head) and its layer range spans the chunks; chunk(c) is chunk c alone.
  ParamTable(const ModelConfig& cfg, const std::vector<ModelShard>& chunks);

  const std::vector<ParamSpec>& params() const { return params_; }
  const ParamSpec& at(const std::string& name) const;  // throws naming the missing tensor
  bool contains(const std::string& name) const { return index_.count(name) != 0; }
  int64_t local_numel() const { return local_numel_; }   // elements in this rank's flat buffers
  int64_t logical_numel() const;                          // exact model size (each tensor once)
  const ModelConfig& config() const { return cfg_; }
  const ModelShard& shard() const { return shard_; }
  int num_chunks() const { return static_cast<int>(chunks_.size()); }
  const ModelShard& chunk_shard(int c) const { return chunks_.at(static_cast<size_t>(c)); }
  // Chunk c's tensors with their offsets in this table's flat buffers (which a Transformer of
  // the chunk binds whole): local_numel() is this table's.
  ParamTable chunk(int c) const;
  // Whether this rank holds the copy of `p` that counts: replicated tensors are counted (grad
  // norm) and saved (checkpoints) by TP rank 0 only, tied copies by the first stage only.
  bool is_primary(const ParamSpec& p) const {
    return !p.tied_copy && (p.split != TpSplit::None || shard_.tp_rank == 0);
  }

 private:
  void add_chunk(const ModelShard& shard);
  void add(std::string name, std::vector<int64_t> shape, Role role, TpSplit split, int layer, float init_std,
           float init_value = 0);
  ModelConfig cfg_;
  ModelShard shard_;
  std::vector<ModelShard> chunks_;
  std::vector<int> chunk_of_;  // per param: its chunk
  std::vector<ParamSpec> params_;
  std::unordered_map<std::string, size_t> index_;
  int64_t local_numel_ = 0;
};

// Outside the layers, whether `p` belongs to the embedding (tok_embed, pos_embed, embed_norm.*);
// the rest (final_norm.*, lm_head, a tied copy of tok_embed) belong to the head.
bool embedding_tensor(const ParamSpec& p);

// The shard of `p` inside a flat buffer laid out by its table (weights, grads, ...), shaped as
// the local shard.
Tensor param_view(const Tensor& flat, const ParamSpec& p);

// Layers [first, end) of pipeline stage `stage` of `pp`, the embedding on the first and the head
// on the last. By default the layers are spread evenly (the first n_layers % pp stages get one
// more). Throws when a stage would get nothing at all, or when `split.layers` does not list pp
// stages.
ModelShard pipeline_stage(const ModelConfig& cfg, int pp, int stage, const PipelineSplit& split);
// The model chunks of pipeline rank `stage` under the interleaved schedule: the layers are cut
// into pp * chunks virtual stages as pipeline_stage cuts them into pp, and the rank holds
// virtual stages stage, stage + pp, ... (chunks == 1: the one stage).
std::vector<ModelShard> pipeline_chunks(const ModelConfig& cfg, int pp, int chunks, int stage,
                                        const PipelineSplit& split);

// The layers of each of `stages` (virtual) stages in model order, as pipeline_stage cuts them.
std::vector<int> pipeline_layer_counts(const ModelConfig& cfg, int stages, const PipelineSplit& split);

// The layers per stage (parallel.pipeline_layers) that minimise the slowest stage's time, where
// stage s takes fixed_s[s] (embedding, head, messages) plus layer_s per layer: every middle stage
// keeps one layer, and each other layer goes to the stage it slows least (ties to the later
// stage, which keeps fewer micro-batches in flight under 1F1B). With equal steps per layer this
// greedy is optimal. max_layers (empty: no bound) caps each stage's layers, e.g. at what its
// memory holds: a layer then goes to the stage it slows least among those with room. Empty when
// the middle stages outnumber the layers, or the caps cannot hold them all.
// chunks > 1 (interleaved 1F1B): fixed_s, layer_s and max_layers are per pipeline rank, which
// runs `chunks` virtual stages (c * ranks + s); each rank keeps a layer for every virtual stage
// but the model's first and last, and its layers are spread evenly over its chunks (one more on
// the later ones). The result lists the virtual stages' layers in model order.
std::vector<int> balanced_pipeline_layers(const std::vector<double>& fixed_s, double layer_s, int n_layers,
                                          const std::vector<int>& max_layers = {}, int chunks = 1);

// Deterministic initialisation of a tensor's local shard into `out` (fp32, local numel):
// element value = N(0, init_std) drawn from a counter-based generator keyed by (seed, tensor
// name, logical element index), so every TP/PP layout initialises the same model.
void init_param(const ParamSpec& p, uint64_t seed, float* out);
// A 64-bit key of (seed, p.name): the same for every shard and copy of a tensor.
uint64_t param_key(const ParamSpec& p, uint64_t seed);

}  // namespace keel
