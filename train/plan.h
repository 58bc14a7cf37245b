// The topology and memory planner behind `keel plan` (issue 6): what the BLOOM team worked out
// by hand for weeks (../shared/seeds/001), in one call.
//
//   * exact parameter counts from the same ParamTable the trainer builds, per rank and stage;
//   * bytes per rank for weights, gradients, fp32 masters and Adam moments (ZeRO-1 over DP);
//   * activation bytes per micro-batch with and without full recomputation, from the tensors
//     model/transformer.cpp keeps (LayerActs and the head/loss buffers), TP-split where the
//     tensor is; 1F1B keeps pp - s micro-batches in flight on stage s;
//   * every (tp, pp, dp, mbs) that fits a GPU count, with why the others do not, a pipeline
//     bubble, communication volumes and a step time from a small documented cost model.
//
// Nothing here allocates device memory or knows about ranks: it is arithmetic over a RunConfig,
// so the trainer prints its own layout's breakdown with the same code (memory_breakdown_text).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "kernels/attention_settings.h"
#include "model/param_table.h"
#include "train/config.h"

namespace keel::plan {

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

// "80GiB", "80GB", "40G", "81920MiB", "1.5 GiB", "85899345920" -> bytes.
// Powers of 2: KiB MiB GiB TiB and the bare K M G T (as nvidia-smi, Slurm and PyTorch use
// them). Powers of 10: KB MB GB TB. A bare number is bytes. Case-insensitive; throws ConfigError.
// At least one byte, or zero where `allow_zero` (an overhead that may be none).
int64_t parse_memory_size(const std::string& text, bool allow_zero = false);
std::string format_bytes(double bytes);  // "17.16 GiB", "42.0 MiB", "3.5 KiB"

// One parallel layout: tensor, pipeline and data parallel sizes, micro-batch size.
struct Layout {
  int64_t tp = 1, pp = 1, dp = 1, mbs = 1;
  int64_t gpus() const { return tp * pp * dp; }
  std::string str() const;  // "tp=8 pp=10 dp=4 mbs=1"
};

// Bytes each rank keeps per local parameter, and which part ZeRO-1 shards over DP.
struct StateBytes {
  double weights = 2;       // working copy the forward/backward read (bf16)
  double grads = 4;         // gradient accumulation buffers, whole on every DP rank (fp32)
  double master = 4;        // fp32 master weights    } divided by dp under ZeRO-1
  double moments = 8;       // Adam m and v, fp32     }
  double grad_shard = 0;    // fp32 gradient partition some ZeRO implementations add (DeepSpeed) }
  bool zero1 = true;
  double dp_grad_comm = 4;    // element size of the DP gradient reduce-scatter
  double dp_weight_comm = 2;  // element size of the DP working-weight all-gather
  double unsharded() const { return weights + grads; }
  double shardable() const { return master + moments + grad_shard; }
  double per_param(int64_t dp) const { return unsharded() + shardable() / (zero1 ? static_cast<double>(dp) : 1.0); }
};

// What a training framework keeps in memory besides the parameters' state.
struct MemoryModel {
  std::string name;
  StateBytes state;
  int act_bytes = 2;              // activation storage (bf16)
  double attn_score_bytes = 0;    // bytes per element of [b, heads/tp, s, s] a non-fused attention
                                  // keeps for one layer (keel's fused attention keeps only lse: 0)
  double logit_extra_bytes = 0;   // bytes per [tokens, vocab/tp] logit element beyond act_bytes
                                  // (an fp32 copy for the loss: 4)
  bool chunked_logits = false;    // logits beyond a chunk are computed a chunk of rows at a time
                                  // (keel's chunked head, model/transformer.h)
  bool fused_gelu_backward = false;  // GELU's input gradient comes straight out of the output
                                     // projection's matmul: no [tokens, ffn/tp] scratch for it
  bool fused_residual_projection = false;  // without TP the blocks' output projections add
                                          // straight into the residual stream: no [tokens, d]
                                          // projection buffer
  bool keeps_stage_output = false;  // the pipeline keeps each in-flight micro-batch's stage output
                                    // until its backward (DeepSpeed's pipe_buffers['outputs'])
  double cuda_context_bytes = 1.5 * kGiB;  // context, cuBLAS workspace, kernels (seed: 1271-1573 MiB)
  // The CUDA backend's attention settings, whose backward scratch (staged dS tiles or cuDNN's
  // workspace, attention_backward_scratch_bytes) is transient within a layer's backward; none
  // on the CPU backend and for the other frameworks. keel: the defaults, or the environment's
  // (KEEL_ATTENTION, KEEL_ATTN_DS_MB, KEEL_CUDNN_WORKSPACE_MB) for keel plan and the run itself.
  std::optional<AttentionSettings> gpu_attention;
  double comm_buffer_bytes = 0;   // persistent communication buckets
  double headroom = 0.05;         // fraction of the GPU kept free (fragmentation, transient peaks)
};

// keel's own state for a precision mode: bf16/fp16 = 2 + 4 + (4 + 8)/dp (18 B/param unsharded),
// fp32 = 4 + 4 + 8/dp (the working copy is the master, so only moments shard),
// bf16-unsafe-no-master = 2 + 4 + 8/dp.
MemoryModel keel_memory_model(PrecisionMode mode);
// Megatron-DeepSpeed as run for the 200B benchmarks in seed 001 (Feb 2022), for comparisons:
// fp16 working weights and fp16 gradients (2 + 2), ZeRO-1 shards fp32 master, m, v and the fp32
// gradient partition (16/dp), unfused softmax attention (scores, probabilities, dropout mask:
// 5 B/element), fp32 logits in the loss, reduce + all-gather buckets of 5e8 fp16 elements each.
// fp32_grad_accum: the BF16 optimizer of 02-28 ("accumulates gradients in fp32 ... The additional
// memory usage is 4bytes x params and it's not sharded across gpus"): 4 more unsharded bytes.
MemoryModel megatron_deepspeed_memory_model(bool fp32_grad_accum);

// The GPU and network the cost model assumes (defaults: A100 80GB nodes as in seed 001).
struct Hardware {
  int64_t gpus_per_node = 8;
  double gpu_mem_bytes = 80 * kGiB;
  int sm_count = 108;             // A100
  int tile_rows = 256, tile_cols = 128;  // GEMM thread-block tile for tile/wave quantization
  double achievable_tflops = 150; // what a well-shaped bf16 GEMM reaches (A100: 312 peak, ~50%)
  double intra_node_gbps = 150;   // GB/s per GPU inside a node (NVLink): TP, and DP/PP within a node
  double inter_node_gbps = 12.5;  // GB/s per GPU between nodes (e.g. 4x HDR200 IB per 8 GPUs)
  double hbm_gbps = 1500;         // achievable HBM bandwidth for the memory-bound element-wise ops
  double no_tensor_core_ratio = 1.0 / 16;  // attention with head_dim not a multiple of 8 misses the
                                           // tensor cores (A100: 19.5 fp32 vs 312 bf16 TFLOP/s)
  double microbatch_overhead_s = 0;  // fixed cost per micro-batch per stage (launches, schedule)
};

enum class Recompute { Auto, Always, Never };  // Auto: without recompute when it fits

inline constexpr int64_t kMaxAutoVirtualStages = 8;

struct PlanOptions {
  int64_t gpus = 0;  // 0: the config's tp*pp*dp
  Hardware hw;
  MemoryModel memory;  // empty name: keel_memory_model(cfg.precision.mode)
  Recompute recompute = Recompute::Auto;
  int64_t recompute_layers = 0;     // when recomputing: layers per stage, from its first (0: all)
  // train.recompute "selective": the layers not recomputed whole drop their norm outputs and MLP
  // activation and rebuild them in backward (model/transformer.h). The policy without full
  // recomputation (act_full, "no recompute" in the figures) is then selective recomputation.
  bool selective = false;
  bool sequence_parallel = false;   // the residual stream and norms split by rows over TP
  int64_t logits_chunk_rows = 0;    // train.logits_chunk_rows (0: automatic), with chunked_logits
  bool embedding_own_slot = false;  // embedding and head each take a pipeline slot like a block
  // parallel.pipeline_layers: the layers of every (virtual) stage, in model order; a layout whose
  // pp * virtual_stages differs from their count is rejected. Empty: the trainer's even split.
  std::vector<int> pipeline_layers;
  PipelineSplit pipeline_split() const { return {embedding_own_slot, pipeline_layers}; }
  // parallel.virtual_stages: model chunks per pipeline rank (interleaved 1F1B). The layers are
  // cut into pp * virtual_stages spans; activations follow train/pipeline_schedule.h.
  // 0 (plan_all only): each pipeline layout with the count, 1 to kMaxAutoVirtualStages, that
  // makes it fastest among those that fit.
  int64_t virtual_stages = 1;
  // parallel.overlap_grad_reduce: the DP gradient reduction runs during the last micro-batch's
  // backward, so only what outlasts it (and at least the last group's share) adds to the step.
  bool overlap_grad_reduce = false;
  // parallel.overlap_param_gather: the DP gather of the updated weights runs, bucket by bucket,
  // during the next step's forward; what outlasts one micro-batch's forward on the slowest
  // stage adds to the step, and at least the first bucket (waited for at once).
  bool overlap_param_gather = false;
  int64_t grad_bucket_size = 0;  // parallel.grad_bucket_size (0: Megatron's max(40M, 1M * dp))
  std::optional<int64_t> tp, pp, dp, mbs;  // pinned sizes
  int64_t max_mbs = 16;                    // micro-batch sizes tried: divisors of gbs/dp up to this, and train.micro_batch
};

// ---- the model ----

// The model as a layout with this tp builds it: vocab padded to pad_vocab_to_multiple_of * tp.
// Throws ConfigError when tp does not divide the unpadded vocab and no padding is configured.
ModelConfig model_for_tp(const ModelConfig& m, int64_t tp);

// The seed's closed forms for GPT-style blocks (12h^2 + 13h per layer: qkv, proj, 4h MLP,
// two LayerNorms, biases; v*h embedding; s*h positions; 2h final norm).
namespace seed_formula {
double layer_params(double h);
double model_params(double layers, double h, double seq, double vocab);
}  // namespace seed_formula

struct ModelCount {
  int64_t exact = 0;  // ParamTable::logical_numel() for the config's own tp padding
  int64_t embedding = 0, layers = 0, head = 0, per_layer = 0;
  int64_t padded_vocab = 0;
  std::optional<double> gpt_formula;  // seed closed form, gpt2 family with ffn == 4 d_model
};
ModelCount count_model(const RunConfig& cfg);

// The seed's per-GPU accounting: (12h^2+13h)/tp per layer, v*h/tp for the embedding (unpadded,
// no positions, norms or tied copies), ceil(layers/pp) layers per stage. For 104B at TP=4, PP=32:
// 953,180,700 with the embedding and 807,435,400 without.
struct SeedAccounting {
  int64_t layers_per_stage = 0;
  double embedding_per_gpu = 0, layer_per_gpu = 0;
  double with_embedding = 0, without_embedding = 0;
};
SeedAccounting seed_accounting(const ModelConfig& m, const Layout& l);

// ---- one layout ----

// Which layers, and whether embedding / head, pipeline stage s holds.
struct StageSpan {
  int first_layer = 0, end_layer = 0;
  bool has_embedding = false, has_head = false;
  int layers() const { return end_layer - first_layer; }
};
// The trainer's split (model/param_table.h pipeline_stage) into `stages`: layers spread evenly,
// the first n_layers % stages taking one more; with embedding slots, layers + 2 slots, the first
// stage giving one slot to the embedding, the last one to the head; or the split's own counts.
// Empty when a stage would hold nothing, or the counts are not one per stage.
std::vector<StageSpan> stage_spans(int n_layers, int64_t stages, const PipelineSplit& split);

// Activation bytes of one micro-batch on one stage (tokens = mbs * seq_len).
struct Activations {
  double per_layer_full = 0;      // every tensor a layer keeps for backward (LayerActs)
  double per_layer_input = 0;     // what full recomputation keeps: the layer's input
  // Selective recomputation: what a layer drops (its two norm outputs and the MLP activation),
  // the scratch that rebuilds them (one norm output and one activation), and the bytes the
  // rebuild moves per layer (each norm reads its input and writes its output; SwiGLU's output is
  // written by its gradient's kernel, which reads the input anyway; GPT-2's GELU, run apart from
  // its matmul so that it can be repeated, reads its input once more in forward and in backward).
  double per_layer_rebuilt = 0, rebuild_scratch = 0, rebuild_moved = 0;
  double attn_scores = 0;         // of one layer, for non-fused attention
  double head = 0;                // final norm, logits, loss rows (last stage), per micro-batch
  double head_shared = 0;         // a chunked head's logits chunk, one for all micro-batches
  int64_t logits_chunk_rows = 0;  // token rows of logits computed at once (mbs * seq: not chunked)
  double stage_output = 0;        // the stage's output buffer (the last stage: final-norm input)
  double token_ids = 0;           // one int32 array: token ids (first stage), targets (last stage)
  double embed_norm = 0;          // model.embedding_norm: the norm's input and stats (first stage)
  // Gradient buffers reused by every layer: what every stage holds (the residual stream's and a
  // norm's gradient; under SP the gathered and scattered rows), and what only a stage with layers
  // holds (the projections' outputs under TP, the qkv, attention and MLP gradients).
  double backward_scratch = 0, layer_backward_scratch = 0;
  double embedding_sums = 0;      // under SP, the embedding's partial sums before their scatter
};
// sequence_parallel (with tp > 1): the [tokens, d] tensors TP would replicate are split over tp,
// at the price of two [tokens, d] scratch buffers (gathered rows, and the scattered sums).
// logits_chunk_rows: as train.logits_chunk_rows, when mem.chunked_logits.
Activations activation_bytes(const ModelConfig& m, const MemoryModel& mem, int64_t tp, int64_t mbs, int64_t seq,
                             bool sequence_parallel = false, int64_t logits_chunk_rows = 0);

struct StageMemory {
  int stage = 0;
  StageSpan span;                 // one chunk: its span; several: first layer, layer count, flags
  std::vector<StageSpan> chunks;  // the rank's chunks (interleaved pipeline), in order
  std::vector<int64_t> chunk_in_flight;  // micro-batches each chunk holds (interleaved pipeline)
  int64_t params = 0;          // this rank's parameters (exact), tied head copy included
  int64_t tied_copy = 0;       // of which: the tied embedding copy the last stage holds
  int64_t embedding_params = 0, layer_params = 0, head_params = 0;
  double weights = 0, grads = 0, master = 0, moments = 0, grad_shard = 0;
  int64_t in_flight = 0;       // micro-batches whose activations stage s holds (1F1B: pp - s)
  double recomputed_layers = 0;  // layers recomputed whole when full recomputation is on
  double act_recompute = 0;    // activations with full recomputation (of recompute_layers, or all)
  double act_full = 0;         // activations without full recomputation (selective with opt.selective)
  // Parts of act_recompute: per micro-batch in flight, the recomputed layers' inputs and the
  // other layers' activations; once, one layer's intermediates rebuilt, the head, the scratch.
  double act_stored_recompute = 0, act_working_recompute = 0;
  double overhead = 0;         // CUDA context + communication buffers + attention backward's dS
  double state() const { return weights + grads + master + moments + grad_shard; }
  // What a background save (checkpoint.async) copies to host memory to write from.
  double save_copy() const { return weights + master + moments; }
  double total(bool recompute) const { return state() + (recompute ? act_recompute : act_full) + overhead; }
};

struct CommVolume {  // bytes one rank sends per optimizer step
  double tp = 0, pp = 0, dp = 0;
};

struct TimeEstimate {
  double step_s = 0;
  double compute_s = 0;     // matmuls, attention and element-wise ops, slowest-stage pipeline
  double tp_comm_s = 0, pp_comm_s = 0, dp_comm_s = 0;
  double gemm_efficiency = 1;  // tile/wave quantization of the layer matmuls (flops-weighted)
  double model_tflops = 0;     // per GPU, keel's TFLOPs convention (no recompute counted)
};

struct LayoutPlan {
  Layout layout;
  bool embedding_own_slot = false;
  std::vector<int> pipeline_layers;  // the user's layers per (virtual) stage; empty: the even split
  int64_t virtual_stages = 1;  // model chunks per pipeline rank (interleaved 1F1B)
  int64_t micro_batches = 0;  // per DP rank per step (m)
  bool recompute = false;     // the policy the verdict and the time assume
  std::vector<StageMemory> stages;
  int peak_stage = 0;
  double peak_bytes = 0;      // max over stages under `recompute`
  double usable_bytes = 0;    // gpu memory * (1 - headroom)
  bool fits = false;
  double bubble = 0;          // (pp - 1) / (v m + pp - 1), v = virtual stages
  CommVolume comm;
  TimeEstimate time;
  // A micro-batch's time on each stage (compute, TP and PP messages): the slowest sets the pace.
  std::vector<double> stage_seconds;
  double layer_seconds = 0;  // what one more layer adds to a stage (its TP messages, recomputation)
  // A split of the layers (parallel.pipeline_layers) that evens the stages' times, where the cost
  // model finds it faster and it fits (balance_pipeline; plan_all fills it for ranked layouts).
  struct Balance {
    std::vector<int> layers;
    double step_s = 0, peak_bytes = 0;
    bool recompute = false;  // whether the layout needs full recomputation under that split
  };
  std::optional<Balance> balance;
  std::vector<std::string> warnings;
};

// Divisibility and placement rules; empty when the layout can be built (memory not checked).
std::string layout_problem(const RunConfig& cfg, const Layout& l, const PlanOptions& opt);
// Memory, bubble, communication and time of one layout (call layout_problem first).
LayoutPlan plan_layout(const RunConfig& cfg, const Layout& l, const PlanOptions& opt);

// Hidden sizes that quantize badly: tile (h % 128), the seed's wave rule (h % SMs), per-rank
// width alignment, heads per TP rank, head_dim.
std::vector<std::string> quantization_warnings(const ModelConfig& m, const Layout& l, const Hardware& hw,
                                               int64_t seq);

// ---- every layout ----

struct Rejection {
  Layout layout;
  std::string reason;
  double peak_bytes = 0;  // > 0 for out-of-memory rejections
  // Out of memory under its split, but a split of its own fits it (balance_pipeline).
  std::optional<LayoutPlan::Balance> fitting;
};

struct PlanResult {
  ModelCount count;
  MemoryModel memory;
  int64_t gpus = 0;
  std::vector<LayoutPlan> ranked;  // feasible, fastest first
  std::vector<Rejection> rejected;
};
PlanResult plan_all(const RunConfig& cfg, const PlanOptions& opt);

// The most layers each 1F1B stage (no interleaving) of layout l holds within the usable memory,
// with full recomputation or without: a stage's memory grows with each layer by its state and
// its activations times the micro-batches the stage keeps in flight (pp - s under 1F1B, so the
// first stages hold the fewest). -1 for a stage whose embedding or head alone does not fit.
std::vector<int> pipeline_layer_caps(const RunConfig& cfg, const Layout& l, const PlanOptions& opt, bool recompute);

// A split of the layers (parallel.pipeline_layers) that evens the pipeline ranks' times by the
// cost model (balanced_pipeline_layers, model/param_table.h): under plain 1F1B within what each
// stage's memory holds (pipeline_layer_caps), tried without full recomputation first where the
// policy allows it; interleaved, a rank's layers spread over its chunks, and the plan of the
// split decides whether it fits. For a layout that fits: a split that makes the estimated step at
// least 1% faster. For one that does not: a split that fits it. Empty when there is none, or it
// is p's own.
std::optional<LayoutPlan::Balance> balance_pipeline(const RunConfig& cfg, const LayoutPlan& p, const PlanOptions& opt);

// When nothing fits: the best layout on fewer GPUs (whole nodes, down to half), and on the same
// GPUs with a global batch that divides over another dp, or with a few layers more or less (the
// seed's move: 200B on 48 nodes became 72/78/84 layers).
struct Alternative {
  std::string change;  // "320 GPUs", "train.global_batch 9", "n_layers 72 (181.2B)"
  int64_t gpus = 0;
  int n_layers = 0;
  int64_t global_batch = 0;
  LayoutPlan best;
};
std::vector<Alternative> alternatives(const RunConfig& cfg, const PlanOptions& opt, int max_count = 5);

// ---- output ----
// with_cost: also the bubble, communication, step time and quantization warnings.
std::string layout_text(const RunConfig& cfg, const LayoutPlan& p, const PlanOptions& opt, bool with_cost = true);
std::string plan_text(const RunConfig& cfg, const PlanResult& r, const PlanOptions& opt, int top = 20,
                      bool all_rejections = false);
std::string alternatives_text(const std::vector<Alternative>& alts);
nlohmann::json layout_json(const LayoutPlan& p);
nlohmann::json plan_json(const RunConfig& cfg, const PlanResult& r, const PlanOptions& opt);

// The memory breakdown the trainer prints at start-up for its own layout (cfg.parallel,
// micro_batch), without the cost model. gpu_mem_bytes <= 0: no GPU (CPU run): no CUDA context and
// no verdict. The policy is the config's (train.recompute, train.recompute_layers); the figures of
// the other policy are printed alongside.
std::string memory_breakdown_text(const RunConfig& cfg, double gpu_mem_bytes = 0);

// The most memory the plan expects this run's backend to hold at once on pipeline stage `stage`
// (what Backend::peak_bytes counts): state, activations and, on a GPU, the attention backward's
// dS; not the CUDA context, which the backend does not count. 0 where the layout has a problem.
double planned_backend_bytes(const RunConfig& cfg, int stage, bool gpu);

// The most layers each pipeline stage of the run's own layout holds in gpu_mem_bytes, under its
// policies (pipeline_layer_caps), for the measured balance advice. Empty without a GPU
// (gpu_mem_bytes <= 0), for an interleaved run, or where the layout has a problem.
std::vector<int> run_pipeline_layer_caps(const RunConfig& cfg, double gpu_mem_bytes);

// The host memory a background save (checkpoint.async) copies stage `stage`'s state into while
// its files are written: weights, fp32 masters and Adam moments. 0 without checkpoint.async or
// where the layout has a problem.
double async_save_host_bytes(const RunConfig& cfg, int stage);

}  // namespace keel::plan
