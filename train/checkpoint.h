// Checkpoints: exact resume, crash safety, resharding, weights-only loads.
//
// Layout of one save (a directory, named step_XXXXXXXX once complete):
//   meta.json                          written last: format, step, consumed samples/tokens, Adam
//                                      step, loss scaler, data position, topology at save, the
//                                      resolved config, and per-file and per-tensor CRC-32C
//   model-tpTT-ppPP.safetensors        working weights ("weight/<name>"), one file per TP x PP
//                                      shard, written by DP rank 0
//   optim-tpTT-ppPP-dpDD.safetensors   fp32 master and Adam moments ("master/", "adam_m/",
//                                      "adam_v/<name>"), the part of the flat buffer the rank owns
// Every safetensors entry is a rectangular chunk of a logical tensor; its __metadata__["keel"]
// says which tensor, which state, the full shape and the chunk's offset in it. A loader
// assembles any region it needs (another TP/PP/DP layout) by intersecting chunks, and any
// safetensors reader can open the files.
//
// Crash safety: a save is written into checkpoints/.tmp-step_XXXXXXXX, every file fsynced,
// meta.json last, then the directory is renamed and `latest` (a one-line file) replaced by
// rename. A kill at any moment leaves the previous checkpoint loadable and never a directory
// named step_* that is incomplete.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "data/safetensors.h"
#include "kernels/backend.h"
#include "model/param_table.h"
#include "train/config.h"
#include "train/optimizer.h"

namespace keel {

class CheckpointError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

inline constexpr int kCheckpointFormatVersion = 1;

// Where the run is: everything besides tensors that shapes the next step.
struct TrainProgress {
  int64_t iteration = 0;  // optimizer steps taken (including skipped ones)
  int64_t consumed_samples = 0;
  int64_t consumed_tokens = 0;
  int64_t skipped_total = 0;
  int64_t nan_total = 0;
};

// This rank's place in the grid. The flat range of master/m/v it owns (ZeRO-1) comes from its
// ParamState; tensors it does not hold the primary copy of (TP replicas, tied copies) are
// neither saved by it nor needed from it.
struct RankPlace {
  int tp_rank = 0, pp_rank = 0, dp_rank = 0;
  int world_rank = 0;
  bool writes_weights = true;  // DP rank 0 of each TP x PP shard writes the working weights
};

// Ranks agree on an outcome: returns true when every rank passed `ok` = true (an all-reduce
// over the world). One process: returns `ok`.
using AgreeFn = std::function<bool(bool ok)>;

// A rectangle of a logical tensor: offset and shape per dimension, plus where its elements sit
// in the rank's flat buffer (rectangles from flat ranges are contiguous there).
struct TensorRegion {
  std::vector<int64_t> offset, shape;
  int64_t flat_begin = 0;
  int64_t numel() const;
};

// The rectangles of logical tensor `p` (in full-tensor coordinates) covered by the flat range
// [begin, end) of this rank's buffers: at most a partial row, full rows, a partial row.
std::vector<TensorRegion> flat_range_regions(const ParamSpec& p, int64_t begin, int64_t end);

// ---- reading ---------------------------------------------------------------------------

// What Checkpoint::verify finds. `damage`: the files are not what was saved (a checksum, a
// size, a missing file or tensor). `nonfinite`: tensors whose files are intact but hold inf or
// NaN, i.e. were saved so (by a run that went non-finite, or a fault before the save); no run or
// model can continue from them. Each line names the file or the tensor.
struct CheckpointProblems {
  std::vector<std::string> damage, nonfinite;
  bool empty() const { return damage.empty() && nonfinite.empty(); }
  // "refusing to <what> a damaged checkpoint <path>:" (or "... checkpoint <path>, which holds
  // non-finite values:") and every problem, one per line.
  std::string refusal(const std::string& what, const std::string& path) const;
};

// The CRC-32C (hex) of a meta.json's content without its own "meta_crc32c" field, over the
// compact dump (keys sorted): what a save stores in meta_crc32c and open() checks.
std::string meta_checksum(const nlohmann::json& meta);

// The layout a checkpoint was saved under, from its meta: "tp=2 pp=4 dp=1", with the layers of
// every (virtual) pipeline stage where pp > 1 and the checkpoint records them.
std::string saved_layout_text(const nlohmann::json& meta);

// For a refusal of checkpoint `except` of `checkpoints_dir`: the directory's other complete
// checkpoints, oldest save first, those whose files are missing or not of their saved sizes marked
// "(damaged: ...)", and "<flag> PATH" of the newest intact one to continue from instead (lines to
// append to the message, starting with a newline).
std::string other_checkpoints_hint(const std::string& checkpoints_dir, const std::string& except,
                                   const std::string& flag);

class Checkpoint {
 public:
  // `path` is a checkpoint directory (step_*), or a checkpoints directory holding `latest`.
  // meta.json must match its own checksum (when it has one) and hold every field a load reads,
  // of the right type and range; else a CheckpointError names the file and the field.
  static Checkpoint open(const std::string& path);
  // `path` may also be the `latest` pointer file of a checkpoints directory (it is followed).
  // Resolves a checkpoints directory's `latest`: nullopt when it holds no checkpoint. A `latest`
  // that cannot be followed (empty, unreadable, naming a missing or incomplete checkpoint or one
  // outside the directory) is a CheckpointError listing the complete checkpoints; without a
  // `latest` file the newest complete step_* is taken and *note says so.
  static std::optional<std::string> find_latest(const std::string& checkpoints_dir, std::string* note = nullptr);

  const std::string& path() const { return path_; }
  // Whether meta.json carries its own checksum (meta_crc32c), checked by open(); checkpoints
  // saved before keel wrote one load without it.
  bool meta_checksummed() const { return meta_.contains("meta_crc32c"); }
  const nlohmann::json& meta() const { return meta_; }
  TrainProgress progress() const;
  int64_t adam_step() const { return meta_.value("adam_step", int64_t{0}); }
  std::string precision() const { return meta_.value("precision", std::string()); }
  // State names present for at least one tensor: "weight", "master", "adam_m", "adam_v".
  std::vector<std::string> states() const;
  bool has(const std::string& state, const std::string& tensor) const;
  // Logical tensors (by name) with their full shape and the dtype of the given state.
  std::map<std::string, std::vector<int64_t>> tensors(const std::string& state) const;
  DType stored_dtype(const std::string& state, const std::string& tensor) const;
  // The full (logical) shape (state, tensor) was saved with.
  const std::vector<int64_t>& shape(const std::string& state, const std::string& tensor) const;

  // Reads one region of (state, tensor) into out (region.numel() values of dtype out_type,
  // converted with round-to-nearest-even when narrowing). Throws CheckpointError naming the
  // tensor when the chunks do not cover the region.
  void read(const std::string& state, const std::string& tensor, const TensorRegion& region, DType out_type,
            void* out) const;
  // Whole logical tensor as fp32.
  std::vector<float> read_full(const std::string& state, const std::string& tensor) const;
  // Done reading (state, tensor): its file pages leave this process's memory (they stay in the
  // page cache), so streaming a large checkpoint through read() keeps a small footprint.
  void release(const std::string& state, const std::string& tensor) const;

  // Checksums, completeness and finite values: returns the problems found (empty = sound).
  CheckpointProblems verify() const;

 private:
  // open() of a step_* directory: meta.json, its checks, every file's header.
  static Checkpoint open_directory(const std::string& path);
  struct Chunk {
    size_t file;
    const data::SafetensorsTensorInfo* info;
    std::vector<int64_t> full_shape, offset;
  };
  std::string path_;
  nlohmann::json meta_;
  std::vector<std::string> file_names_;
  std::vector<std::shared_ptr<data::SafetensorsReader>> files_;
  std::map<std::string, std::vector<Chunk>> chunks_;  // "state/tensor" -> chunks
};

// ---- writing ---------------------------------------------------------------------------

struct SaveResult {
  std::string path;
  int64_t bytes = 0;     // the whole checkpoint's files on the coordinating rank (0), this rank's elsewhere
  double seconds = 0;    // from the save's start to its publication
  bool background = false;
  double write_seconds = 0;  // until this rank's files were on disk
  double held_seconds = 0;   // how long training waited for it (all of `seconds` unless background)
};

class CheckpointManager {
 public:
  CheckpointManager(std::string checkpoints_dir, CheckpointConfig cfg);
  // A save still being written when the manager goes away (the run failed) is waited for but
  // not published: it stays a .tmp- directory, which the next run's clean_incomplete removes.
  ~CheckpointManager();
  CheckpointManager(const CheckpointManager&) = delete;
  CheckpointManager& operator=(const CheckpointManager&) = delete;

  const std::string& dir() const { return dir_; }
  // meta.json's "source" in every save (the Hugging Face model and the checkpoints the run
  // started from: hf_format.h), so export and sample find its config, tokenizer and chat template.
  void set_source(nlohmann::json source) { source_ = std::move(source); }
  // meta.json's "data"."files" in every save: the files data.train resolved to, with their token
  // counts (per blend source), which the sample order depends on; a resume compares them.
  void set_data_files(nlohmann::json files) { data_files_ = std::move(files); }
  // meta.json's "data"."blend" in every save: a blend's history of weights (data::BlendSchedule's
  // segments, [{"from_sample", "weights"}, ...]), which a resume continues.
  void set_blend_history(nlohmann::json history) { blend_history_ = std::move(history); }
  // Writes a checkpoint of `state` at `progress.iteration`. With several ranks every rank calls
  // it, and they agree three times (directory made, files written, published), so a failure on
  // any rank fails the save on all of them instead of leaving some waiting. Throws
  // CheckpointError on any I/O problem, after removing the partial save; earlier checkpoints
  // are never touched. Same as begin_save(background=false) then finish_save.
  SaveResult save(const RunConfig& cfg, const ParamTable& table, ParamState& state, Backend& backend,
                  const TrainProgress& progress, const LossScaler& scaler, const RankPlace& place,
                  const AgreeFn& agree = [](bool ok) { return ok; }, const nlohmann::json& health = nullptr);

  // A save in two halves (checkpoint.async). begin_save makes the temporary directory (the
  // first agreement) and, with `background`, copies this rank's part of the state to host
  // memory and leaves the files to a thread, so training goes on while they are written; the
  // thread does file I/O only, never the device or a communicator. Without `background` the
  // files are written before it returns. finish_save waits for this rank's files, then the
  // ranks agree they are all written, the coordinator publishes (meta.json, rename, `latest`,
  // rotation) and they agree again; every rank calls it at the same step boundary. A failure
  // in either half throws CheckpointError from finish_save, with the partial save removed.
  void begin_save(const RunConfig& cfg, const ParamTable& table, ParamState& state, Backend& backend,
                  const TrainProgress& progress, const LossScaler& scaler, const RankPlace& place,
                  const AgreeFn& agree, const nlohmann::json& health, bool background);
  SaveResult finish_save(const AgreeFn& agree);
  bool save_pending() const { return pending_ != nullptr; }  // begun, not finished
  bool writing() const;  // this rank's files of the pending save are still being written

  // The run resumed from checkpoint `resumed` of `step`. Checkpoints saved before now that are
  // not its past belong to a trajectory the resume abandoned: those of a higher step or saved
  // after it (a rewind), and, when it lies outside this directory (another run's, or one set
  // aside by a rewind), all of them, as nothing says which are its past. Rotation never
  // removes them, as only the user knows whether they are still wanted (set_aside moves them
  // out of the way). Returns their names, oldest save first.
  std::vector<std::string> set_resumed_from(int64_t step, const std::string& resumed);
  // Moves those abandoned checkpoints (`names`) into one new folder of the directory,
  // abandoned-after-<step_name(resumed step)>-<UTC time>: kept whole, yet out of this run's way
  // (its saves of the same steps would otherwise replace them) and removable with one rm -r.
  // `latest`, which names one of them, is pointed at `resumed_path` when that is a checkpoint
  // of this directory, so a crash before this run's first save resumes where it did. For the
  // coordinator, under the directory's lock. Returns the folder; if a move fails, those moved
  // are put back and CheckpointError says why.
  std::string set_aside(const std::vector<std::string>& names, const std::string& resumed_path);
  // Keeps the keep_last most recently saved checkpoints of the current trajectory (by meta.json's
  // save_seq, a count of the directory's publications; checkpoints from before it by saved_at_ns
  // or their file time; never by step number, which a rewind makes go back, nor by the clock
  // alone, which can differ between the nodes of one run and the next), plus every step divisible by keep_every; never the one `latest` names, nor any of an
  // abandoned trajectory (above). So the checkpoint a run resumed from stays until keep_last
  // newer saves exist.
  void rotate();
  // Removes what killed saves and prunes left (.tmp-* saves never published, .old-* replaced or
  // rotated ones half removed, .latest.tmp); returns their names.
  std::vector<std::string> clean_incomplete();
  static std::string step_name(int64_t step);  // "step_00000100"

 private:
  struct PendingSave;
  [[noreturn]] void fail_save(const PendingSave& p, const std::string& why);
  std::string dir_;
  CheckpointConfig cfg_;
  std::unique_ptr<PendingSave> pending_;
  nlohmann::json source_;
  nlohmann::json data_files_;
  nlohmann::json blend_history_;
  bool abandoned(int64_t seq, int64_t step) const;
  int64_t resumed_step_ = -1, run_start_seq_ = 0;  // set_resumed_from; -1: a fresh run
  // The resumed checkpoint's save_seq, when it is one of this directory's (else -1: none of the
  // directory's saves is known to be its past); INT64_MAX when it is but predates save_seq.
  int64_t resumed_seq_ = -1;
  int64_t next_seq_ = 0;  // the coordinator's next save_seq, at least (see finish_save)
  int64_t published_ = 0;  // saves this manager published: a failure's message tells "none before" from "gone since"
};

// ---- restoring -------------------------------------------------------------------------

// Resume: every state the next step depends on comes back bit for bit (weights, masters, Adam
// moments and step, scaler, progress). Missing or partial optimizer state is an error naming
// what is missing and pointing at --init-from. Returns the progress to continue from.
TrainProgress restore_for_resume(const Checkpoint& ck, const RunConfig& cfg, const ParamTable& table,
                                 ParamState& state, Backend& backend, LossScaler& scaler,
                                 const RankPlace& place, std::vector<std::string>* warnings = nullptr);

// Weights-only initialisation (finetuning): weights from the checkpoint (the fp32 masters when
// it has them, else the stored working weights), masters = their exact fp32 values, working
// weights = masters rounded to the working dtype, Adam moments zero, Adam step 0. Returns a
// description of what was loaded for the log. The tensors must match; every other model field
// that differs from the checkpoint's is said: attention's (position embedding, sliding window)
// as a NOTE on that line, any other (rope_theta, norm_eps, ...) as a WARNING in `warnings`.
std::string init_weights_from(const Checkpoint& ck, const ParamTable& table, ParamState& state, Backend& backend,
                              const RankPlace& place, std::vector<std::string>* warnings = nullptr);

// The model fields in which `now` differs from the checkpoint's model and which change the
// function its weights compute but no tensor's shape (rope_theta, norm_eps, sliding_window,
// position_embedding, n_heads at the same widths, ...): a weights-only load across them is
// allowed and said, but its probe loss is not the one the checkpoint measured.
std::vector<FieldChange> model_function_changes(const Checkpoint& ck, const ModelConfig& now);

// Names and shapes of the logical tensors a checkpoint must hold for a model; mismatches name
// the tensor and both shapes. With `repadding`, tok_embed and lm_head may differ in their rows
// of vocabulary padding (read_param fills them): a resume or --init-from under another
// parallel.tp or model.pad_vocab_to_multiple_of.
// Adds the NaN and inf among n stored values of dtype dt (f32, bf16, f16) at p to the counts, on
// their bits (as verify() scans a checkpoint).
void count_nonfinite_stored(const std::byte* p, int64_t n, DType dt, int64_t& nan, int64_t& inf);

void check_tensors_match(const Checkpoint& ck, const std::string& state, const ParamTable& table,
                         bool repadding = false);

// Whether shapes `a` and `b` of tensor `name` differ only by vocabulary padding: tok_embed or
// lm_head, the same width, both at least `vocab_size` rows (model.vocab_size rounded up by
// model.pad_vocab_to_multiple_of x parallel.tp, which may differ between runs).
bool vocab_padding_only(const std::string& name, const std::vector<int64_t>& a, const std::vector<int64_t>& b,
                        int64_t vocab_size);

// The padding rows of a vocabulary tensor as saved: rows [vocab_size, rows) of (state, tensor),
// as fp32 (few: at most one padding unit).
std::vector<float> read_padding_rows(const Checkpoint& ck, const std::string& state, const std::string& tensor,
                                     int64_t vocab_size);

// Reads `region` of the model's tensor p from (state, p.name). Where the checkpoint pads the
// vocabulary otherwise than the model (tok_embed, lm_head: other rows past model.vocab_size),
// the real rows come from the checkpoint and the model's padding rows are zero: the rows no
// token selects and whose logits get -inf, so the loss and every gradient are unchanged (a
// padding row never trains, so it is zero in a run that started from keel's init or an HF model).
void read_param(const Checkpoint& ck, const std::string& state, const ParamSpec& p, int64_t vocab_size,
                const TensorRegion& region, DType out_type, void* out);

// The tensors whose vocabulary padding a load from `ck` into `table` changes (tok_embed,
// lm_head): the squared sums of the checkpoint's padding rows that the load drops, of the
// weights and of the fp32 masters (master_source), as the restart verification's per-tensor
// norms (Trainer::snapshot) count them; zero for a run whose padding rows are zero, as they are
// from keel's init or an HF import on.
struct DroppedPadding {
  int64_t rows_saved = 0, rows_now = 0;
  double weight_sumsq = 0, master_sumsq = 0;
};
std::map<std::string, DroppedPadding> repadded_tensors(const Checkpoint& ck, const ParamTable& table);

// Which saved state holds fp32 values of every tensor: "master", or "weight" when the weights
// are fp32 (an fp32 run, an fp32 conversion); none otherwise.
std::optional<std::string> master_source(const Checkpoint& ck, const ParamTable& table);

// The fields in which two model sections of a run config (to_json(cfg)["model"]) differ, both
// ways (a field written only when set may be missing on one side: "-"), each as
// "model.<field>: <a_name> <a's value>, <b_name> <b's value>".
std::vector<std::string> model_differences(const nlohmann::json& a, const nlohmann::json& b, const std::string& a_name,
                                           const std::string& b_name);

// Opens the checkpoint at `path` and checks every checksum (verify() leaves none of its pages
// in this process's memory, so the caller then streams the tensors from the same reader: the
// files verified are the files read, even when `path` is a pointer a running job moves on).
// Throws CheckpointError "refusing to <what> a damaged checkpoint <path>:" and the problems.
Checkpoint open_undamaged(const std::string& path, const std::string& what);

// ---- weights-only checkpoints from another source (format conversion) ------------------

// Fills `out` with the whole logical tensor p (p.logical_numel() elements of `dtype`).
using TensorFill = std::function<void(const ParamSpec& p, DType dtype, void* out)>;

// Writes a weights-only checkpoint of the model cfg.model (one chunk per logical tensor, state
// "weight" in `dtype`) into the existing directory `dir`: model-tp00-pp00.safetensors, then
// meta.json with its checksums, progress zero and `source` (where the weights came from) — the
// same format CheckpointManager::save writes, so Checkpoint::open, verify, init_weights_from
// (--init-from) and keel ckpt read it. Tensors are produced by `fill` one at a time and
// streamed to disk, so at most one tensor is in memory. Crash safety (a temporary directory
// renamed when complete) is the caller's. Throws CheckpointError naming the file on I/O errors.
SaveResult write_weights_checkpoint(const std::string& dir, const RunConfig& cfg, DType dtype, const TensorFill& fill,
                                    const nlohmann::json& source = nlohmann::json::object());

// The output folder of a conversion (keel convert, keel ckpt average), written whole or not at
// all: check_new_output refuses an existing `out` unless forced (CheckpointError). Even when
// forced it refuses (ConfigError) an `out` that is, holds or lies inside one of the `inputs`
// (replacing it, or a later checkpoint rotation, would destroy the input or the output), and an
// existing `out` that is not an earlier output of the same `kind` (a run directory, a typo for
// a folder inside one: --force replaces an output, never a user's other files). The files go
// to temp_dir_for(out) (a fresh sibling folder), and publish renames it into place (replacing
// `out` when forced).
enum class OutputKind { KeelCheckpoint, HfModel };
void check_new_output(const std::filesystem::path& out, bool force, const std::vector<std::string>& inputs = {},
                      OutputKind kind = OutputKind::KeelCheckpoint);
// Is `dir` a keel checkpoint (a folder with a keel meta.json)? An output keel convert --force and
// ckpt average --force may replace, and never a run's --out or checkpoint.dir.
bool is_keel_checkpoint(const std::filesystem::path& dir);
// Is `in` the folder `out` or inside it (so that writing `out` would replace it)?
bool would_replace(const std::filesystem::path& out, const std::string& in);
std::filesystem::path temp_dir_for(const std::filesystem::path& out);
void publish(const std::filesystem::path& tmp, const std::filesystem::path& out, bool force);

}  // namespace keel
