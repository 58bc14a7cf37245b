#include "train/run.h"

#include <fcntl.h>
#include <omp.h>
#include <sys/file.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <fstream>
#include <iostream>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <utility>

#include <cerrno>
#include <csignal>
#include <cstring>
#include <ctime>

#include "data/checksum.h"
#include "data/file_io.h"
#include "data/loss_mask.h"
#include "data/sampler.h"
#include "kernels/document_positions.h"
#include "kernels/device.h"
#include "kernels/guarded_backend.h"
#include "kernels/profile_range.h"
#include "train/parallel/nccl_comm.h"
#ifdef KEEL_HAVE_CUDA
#include <cuda_runtime_api.h>

#include "kernels/cuda/cuda_backend.h"
#endif
#include "train/checkpoint.h"
#include "train/choice_eval.h"
#include "train/format.h"
#include "train/health.h"
#include "train/host_memory.h"
#include "train/parallel/host_values.h"
#include "train/hf_format.h"
#include "train/memory_watch.h"
#include "train/metrics.h"
#include "train/model_loading.h"
#include "train/parallel/mpi_comm.h"
#include "train/plan.h"
#include "train/schedule.h"
#include "train/trainer.h"
#include "train/training_sample.h"

namespace keel {

namespace fs = std::filesystem;

namespace {

// Windows of a validation set that one evaluation reads: the first eval_batches micro-batches'
// worth, or all of a smaller set (once each).
int64_t validation_windows(const data::Sampler& val, const RunConfig& cfg) {
  return std::min(val.num_windows(), cfg.train.eval_batches * cfg.train.micro_batch);
}

// Every rank must run the same config: a node launched with another file or other --set values
// would otherwise train its share with other settings, which nothing downstream notices (under
// pure DP the weights are all-gathered, so even the replica check agrees). Compared first thing
// (collective over the world), and the differences named by rank 0.
void check_ranks_agree(const RunConfig& cfg, const RunOptions& opts) {
  if (!opts.mpi || opts.mpi->world_size() <= 1) return;
  nlohmann::json mine = to_json(cfg);
  // An option left out is named so ("not given"), not by its internal default (0, ""), which the
  // message would otherwise show as if it had been passed.
  const auto given = [](const auto& v, bool is_given) { return is_given ? nlohmann::json(v) : nlohmann::json("not given"); };
  mine["command line"] = {{"--resume", given(opts.resume, !opts.resume.empty())},
                          {"--init-from", given(opts.init_from, !opts.init_from.empty())},
                          {"--stop-at", given(opts.stop_at, opts.stop_at > 0)},
                          {"--time-limit", given(opts.time_limit_s, opts.time_limit_s > 0)},
                          {"--eval-only", opts.eval_only}};
  std::string theirs;
  const int r = opts.mpi->first_rank_differing(mine.dump(), &theirs);
  if (r < 0) return;
  if (opts.mpi->world_rank() != 0)
    throw ConfigError("world rank " + std::to_string(r) + " runs another config than world rank 0 (rank 0 names it)");
  std::vector<std::string> lines;
  for (const FieldChange& c : field_changes(mine, nlohmann::json::parse(theirs)))
    lines.push_back(c.field + ": " + c.a + " on world rank 0, " + c.b + " on world rank " + std::to_string(r));
  std::string msg = "world rank " + std::to_string(r) +
                    " runs another config than world rank 0 (was it launched with another config file or other "
                    "--set values?):";
  for (size_t i = 0; i < lines.size() && i < 10; ++i) msg += "\n  " + lines[i];
  if (lines.size() > 10) msg += "\n  ... and " + std::to_string(lines.size() - 10) + " more";
  throw ConfigError(msg);
}

// device "cuda", or "auto" with a GPU visible: one process per GPU, the local rank's.
std::unique_ptr<Backend> select_backend(const RunConfig& cfg, const parallel::LaunchInfo& launch) {
  const bool cuda = cfg.device == "cuda" || (cfg.device == "auto" && cuda_device_count() > 0);
  if (!cuda) {
    if (!guard_backend_memory_requested()) return make_cpu_backend();
    // KEEL_GUARD_BACKEND_MEMORY: host access to backend memory outside ops faults (a GPU rehearsal).
    if (launch.world_size > 1)
      throw ConfigError("KEEL_GUARD_BACKEND_MEMORY works for one process only (CPU communicators read host memory)");
    return make_guarded_backend(make_cpu_backend());
  }
  if (!cuda_built())
    throw ConfigError("device: \"cuda\" requested but this keel was built without the CUDA backend "
                      "(rebuild with -DKEEL_CUDA=ON where nvcc is available), or use \"cpu\"");
  const int gpus = cuda_device_count();
  if (gpus == 0)
    throw ConfigError("device: \"cuda\" requested but no GPU is visible to this process (check "
                      "CUDA_VISIBLE_DEVICES / nvidia-smi), or use \"cpu\"");
  // A launcher that binds one GPU per task (srun --gpus-per-task=1, --gpu-bind, a wrapper
  // setting CUDA_VISIBLE_DEVICES per rank) leaves each process exactly one visible GPU, its own:
  // device 0. Two ranks on the same GPU are then refused by NCCL ("Duplicate GPU detected").
  if (launch.world_size > 1 && gpus > 1 && launch.local_size > gpus)
    throw ConfigError(std::to_string(launch.local_size) + " processes on host " + launch.host + " share " +
                      std::to_string(gpus) + " visible GPU(s): keel runs one process per GPU");
#ifdef KEEL_HAVE_CUDA
  const int device = launch.local_rank % gpus;
  if (cudaError_t e = cudaSetDevice(device); e != cudaSuccess)
    throw std::runtime_error("cudaSetDevice(" + std::to_string(device) + "): " + cudaGetErrorString(e));
  return make_cuda_backend(device);
#else
  return make_cpu_backend();  // not reached: cuda_built() is false
#endif
}

// "; loss masks on 3 of 3 files: 41.2% of their targets in the loss", or "" without sidecars
// (data/loss_mask.h): shows at start-up that instruction data will train on responses only.
static std::string loss_mask_note(const data::TokenDataset& d) {
  if (d.num_masked_files() == 0) return "";
  int64_t in_loss = 0, targets = 0;
  for (size_t f = 0; f < d.num_files(); ++f)
    if (const data::LossMask* m = d.loss_mask(f)) in_loss += m->count_in_loss(), targets += m->size();
  char buf[160];
  std::snprintf(buf, sizeof buf, "; loss masks on %zu of %zu files: %.1f%% of their targets in the loss",
                d.num_masked_files(), d.num_files(), targets ? 100.0 * static_cast<double>(in_loss) / static_cast<double>(targets) : 0.0);
  return buf;
}

// Windows never cross a file (data/sampler.h): a file shorter than seq_len + 1 tokens gives
// none, and each file loses its last partial window. keel tokenize warns about its own small
// shards; this catches data from other tools, once per source, when the windows leave more
// than a tenth of its tokens unread. "" when they do not.
static std::string short_files_warning(const data::TokenDataset& d, const std::string& what) {
  const int64_t T = d.seq_len(), unused = d.num_tokens() - d.num_windows() * T;
  if (unused * 10 <= d.num_tokens()) return "";
  size_t shorter = 0;
  for (size_t f = 0; f < d.num_files(); ++f) shorter += d.file(f).num_tokens() < T + 1;
  char share[32];
  std::snprintf(share, sizeof share, "%.1f%%", 100.0 * static_cast<double>(unused) / static_cast<double>(d.num_tokens()));
  return "WARNING " + what + ": " + share + " of its " + std::to_string(d.num_tokens()) +
         " tokens are in no training window. Windows of train.seq_len + 1 = " + std::to_string(T + 1) +
         " tokens never cross a file: " + std::to_string(shorter) + " of its " + std::to_string(d.num_files()) +
         " files are shorter than one window and give none, and each file loses its last partial window. "
         "Write fewer, larger shards (keel tokenize --shard-tokens), or use a shorter train.seq_len.";
}

// A file that several entries of data.train match (two globs, one path listed twice) is read
// once, at its first place; a user who listed it again may have meant to up-weight it. With
// data.train_weights each entry is a source of its own and is expanded alone: nothing is dropped.
static std::string repeated_files_warning(const RunConfig& cfg) {
  if (!cfg.data.train_weights.empty()) return "";
  std::vector<data::RepeatedMatch> repeats;
  data::expand_paths(cfg.data.train, "data.train", &repeats);
  if (repeats.empty()) return "";
  std::string w = "WARNING data.train: " + std::to_string(repeats.size()) + " file(s) matched by more than one entry:";
  const size_t shown = std::min<size_t>(repeats.size(), 3);
  for (size_t k = 0; k < shown; ++k) {
    w += (k ? "; " : " ") + repeats[k].file + " (by";
    for (size_t e = 0; e < repeats[k].entries.size(); ++e) w += (e ? ", " : " ") + std::string("'") + repeats[k].entries[e] + "'";
    w += ")";
  }
  if (repeats.size() > shown) w += "; ... and " + std::to_string(repeats.size() - shown) + " more";
  return w + ". Each file is read once, so listing it again does not up-weight it. To weight data, make each part an "
             "entry of its own and give data.train_weights (a weighted blend)";
}

// The training data: all of data.train as one source, or with data.train_weights each entry (a
// file or a glob) a source of its own, blended in those proportions.
data::Sampler open_train_data(const RunConfig& cfg) {
  const auto vocab = static_cast<uint32_t>(cfg.model.vocab_size);
  const int T = static_cast<int>(cfg.train.seq_len);
  const bool blend = !cfg.data.train_weights.empty();
  std::vector<data::TokenDataset> sources;
  for (size_t k = 0; k < (blend ? cfg.data.train.size() : 1); ++k) {
    const std::string what = blend ? "data.train[" + std::to_string(k) + "] (" + cfg.data.train[k] + ")" : "data.train";
    const auto patterns = blend ? std::vector<std::string>{cfg.data.train[k]} : cfg.data.train;
    sources.push_back(data::TokenDataset::open(data::expand_paths(patterns, what), T, vocab, data::DataUse::training, what));
  }
  // One source with weight 1 reads what the plain sampler reads (data/sampler.h).
  return data::Sampler(std::move(sources), blend ? cfg.data.train_weights : std::vector<double>{1.0}, cfg.train.seed,
                       cfg.data.shuffle);
}

// The files each training source resolved to, with their token counts and, with `fingerprints`,
// content fingerprints (data/checksum.h): with the seed and seq_len, what the sample order is a
// function of. Saved in every checkpoint (data.files). The fingerprints read a few blocks of each
// file, on many threads: the wait is one file's latency per thread, not thousands in a row.
nlohmann::json training_files(const data::Sampler& train, bool fingerprints) {
  std::vector<const data::TokenFile*> all;
  for (size_t k = 0; k < train.num_sources(); ++k)
    for (size_t f = 0; f < train.source(k).num_files(); ++f) all.push_back(&train.source(k).file(f));
  std::vector<std::string> prints(fingerprints ? all.size() : 0);
  std::string error;
#pragma omp parallel for schedule(dynamic) num_threads(16) if (prints.size() > 1)
  for (size_t i = 0; i < prints.size(); ++i) {
    try {
      prints[i] = data::content_fingerprint(all[i]->path());
    } catch (const std::exception& e) {
#pragma omp critical
      error = e.what();
    }
  }
  if (!error.empty()) throw data::DataError(error);
  nlohmann::json sources = nlohmann::json::array();
  for (size_t k = 0, i = 0; k < train.num_sources(); ++k) {
    nlohmann::json files = nlohmann::json::array();
    for (size_t f = 0; f < train.source(k).num_files(); ++f, ++i) {
      const data::TokenFile& file = *all[i];
      files.push_back({{"file", fs::absolute(file.path()).lexically_normal().string()}, {"tokens", file.num_tokens()}});
      if (fingerprints) files.back()["fingerprint"] = prints[i];
    }
    sources.push_back(std::move(files));
  }
  return sources;
}

// How the training files changed between a checkpoint's data.files and this run's: one line per
// file added, removed, resized or rewritten with the same length (another content fingerprint;
// a checkpoint from before fingerprints has none, and no rewrite is called). Empty: the same
// files; also for a checkpoint that has no list.
// The same patterns can resolve to other files (a shard added to the folder, a dataset rewritten
// in place), which the config comparison cannot see, yet the sampler's permutation follows the
// window counts: the order from the resumed sample on is not the saved run's.
std::vector<std::string> training_file_changes(const nlohmann::json& saved, const nlohmann::json& now) {
  std::vector<std::string> changes;
  if (!saved.is_array()) return changes;
  if (saved.size() != now.size()) {
    changes.push_back(std::to_string(saved.size()) + " source(s) at the checkpoint, " + std::to_string(now.size()) + " now");
    return changes;
  }
  for (size_t k = 0; k < now.size(); ++k) {
    const std::string where = now.size() > 1 ? "source " + std::to_string(k) + ": " : "";
    std::map<std::string, int64_t> was, is;
    std::map<std::string, std::string> was_print, is_print;
    for (const auto& f : saved[k]) {
      was[f.value("file", "")] = f.value("tokens", int64_t{-1});
      was_print[f.value("file", "")] = f.value("fingerprint", "");
    }
    for (const auto& f : now[k]) {
      is[f.at("file").get<std::string>()] = f.at("tokens").get<int64_t>();
      is_print[f.at("file").get<std::string>()] = f.value("fingerprint", "");
    }
    for (const auto& [file, tokens] : is) {
      const auto it = was.find(file);
      const std::string &before = was_print[file], &after = is_print[file];
      if (it == was.end()) changes.push_back(where + file + " is new (" + std::to_string(tokens) + " tokens)");
      else if (it->second != tokens)
        changes.push_back(where + file + " had " + std::to_string(it->second) + " tokens, now " + std::to_string(tokens));
      else if (!before.empty() && !after.empty() && before != after)
        changes.push_back(where + file + " was rewritten: the same " + std::to_string(tokens) +
                          " tokens, other content (fingerprint " + before + ", now " + after + ")");
    }
    for (const auto& [file, tokens] : was)
      if (!is.contains(file)) changes.push_back(where + file + " is gone (it had " + std::to_string(tokens) + " tokens)");
  }
  return changes;
}

// Whether the files only moved: at other paths, the same files in the same order with the same
// token counts and content fingerprints (data staged to another filesystem). The sample order is
// then exactly the saved run's. A checkpoint without fingerprints cannot tell: false.
bool training_files_moved(const nlohmann::json& saved, const nlohmann::json& now) {
  if (!saved.is_array() || saved.size() != now.size()) return false;
  for (size_t k = 0; k < now.size(); ++k) {
    if (!saved[k].is_array() || saved[k].size() != now[k].size()) return false;
    for (size_t i = 0; i < now[k].size(); ++i) {
      const auto &a = saved[k][i], &b = now[k][i];
      const std::string pa = a.value("fingerprint", ""), pb = b.value("fingerprint", "");
      if (pa.empty() || pa != pb || a.value("tokens", int64_t{-1}) != b.value("tokens", int64_t{-2})) return false;
    }
  }
  return true;
}

// ---- a blend's history across resumes ----------------------------------------------------

// meta.json's data.blend: [{"from_sample": 0, "weights": [0.7, 0.3]}, {"from_sample": 160, ...}].
nlohmann::json blend_history_json(const std::vector<data::BlendSegment>& history) {
  nlohmann::json j = nlohmann::json::array();
  for (const data::BlendSegment& seg : history) j.push_back({{"from_sample", seg.from_sample}, {"weights", seg.weights}});
  return j;
}

// Its inverse; the field's types were checked when the checkpoint was opened (validate_meta).
std::vector<data::BlendSegment> blend_history_from(const nlohmann::json& j) {
  std::vector<data::BlendSegment> history;
  for (const nlohmann::json& seg : j)
    history.push_back({seg.at("from_sample").get<int64_t>(), seg.at("weights").get<std::vector<double>>()});
  return history;
}

// "70.0% / 30.0%": a blend's normalized shares.
std::string shares_text(const std::vector<double>& weights) {
  const data::Blend blend(weights);
  std::string out;
  char buf[32];
  for (size_t d = 0; d < blend.num_sources(); ++d) {
    std::snprintf(buf, sizeof buf, "%s%.1f%%", d ? " / " : "", 100 * blend.weight(d));
    out += buf;
  }
  return out;
}

// "data.train[0] (a/*.bin) at its sample 112, data.train[1] (b/*.bin) at its sample 48": where
// each source stands, its next local index (the first few sources of a large blend).
std::string source_positions_text(const RunConfig& cfg, const std::vector<int64_t>& next) {
  constexpr size_t kShown = 4;
  std::string out;
  for (size_t d = 0; d < next.size() && d < kShown; ++d)
    out += std::string(d ? (d + 1 == next.size() ? " and " : ", ") : "") + "data.train[" + std::to_string(d) + "] (" +
           cfg.data.train[d] + ") at its sample " + std::to_string(next[d]);
  if (next.size() > kShown) out += ", ... (" + std::to_string(next.size() - kShown) + " more)";
  return out;
}

// Why a checkpoint's blend history cannot go on over this run's sources; empty when it can. A
// source is the same when it is the same data.train entry (its files may have changed: the
// files' own warning says so), or when it resolves to the same files: by name and token count,
// or by content fingerprint and token count (data staged to another folder, renamed). Only world
// rank 0 has the fingerprints, so its answer is the one every rank follows (resume_blend).
std::string blend_sources_change(const nlohmann::json& meta, size_t saved_sources, const RunConfig& cfg,
                                 const nlohmann::json& train_files) {
  const size_t now_sources = train_files.size();
  if (saved_sources != now_sources) {
    if (saved_sources == 1)
      return "the checkpoint read data.train as one source, this run blends " + std::to_string(now_sources) +
             " (data.train_weights)";
    if (now_sources == 1)
      return "the checkpoint blended " + std::to_string(saved_sources) +
             " sources, this run reads data.train as one source (no data.train_weights)";
    return "the checkpoint blended " + std::to_string(saved_sources) + " sources, data.train now has " +
           std::to_string(now_sources) + " entries";
  }
  const nlohmann::json saved_train =
      meta.value("config", nlohmann::json::object()).value("data", nlohmann::json::object()).value("train", nlohmann::json());
  const nlohmann::json saved_files = meta.value("data", nlohmann::json::object()).value("files", nlohmann::json());
  // A source's files as (file name, tokens), in order.
  auto names = [](const nlohmann::json& files) {
    std::vector<std::pair<std::string, int64_t>> out;
    if (files.is_array())
      for (const nlohmann::json& f : files)
        out.emplace_back(fs::path(f.value("file", "")).filename().string(), f.value("tokens", int64_t{-1}));
    return out;
  };
  // The same content, in the same order (a checkpoint from before fingerprints cannot tell).
  auto same_content = [](const nlohmann::json& a, const nlohmann::json& b) {
    if (!a.is_array() || !b.is_array() || a.size() != b.size()) return false;
    for (size_t i = 0; i < a.size(); ++i) {
      const std::string pa = a[i].value("fingerprint", ""), pb = b[i].value("fingerprint", "");
      if (pa.empty() || pa != pb || a[i].value("tokens", int64_t{-1}) != b[i].value("tokens", int64_t{-2})) return false;
    }
    return true;
  };
  for (size_t k = 0; k < now_sources; ++k) {
    const std::string was = saved_train.is_array() && k < saved_train.size() && saved_train[k].is_string()
                                ? saved_train[k].get<std::string>()
                                : "";
    if (was == cfg.data.train[k]) continue;
    if (saved_files.is_array() && saved_files.size() == now_sources &&
        (names(saved_files[k]) == names(train_files[k]) || same_content(saved_files[k], train_files[k])))
      continue;
    return "data.train[" + std::to_string(k) + "] was '" + was + "' at the checkpoint and is '" + cfg.data.train[k] +
           "' now, with other files";
  }
  return "";
}

// On a resume: gives `train` the blend history it continues, from the checkpoint's meta.json
// (data.blend; a checkpoint from before it read its config's weights from sample 0 on), and
// returns what to say about it (empty: nothing changed). New weights append a segment at the
// resumed sample, so each source goes on from where it stopped (data::BlendSchedule). When the
// sources themselves changed the history has nothing to apply to: the blend then restarts its
// schedule, as if the run had used this run's weights from sample 0 (`train` as it was opened).
// `from_rank0` gives every rank world rank 0's text (a broadcast; nothing on one process).
std::string resume_blend(data::Sampler& train, const nlohmann::json& meta, const RunConfig& cfg,
                         const nlohmann::json& train_files, int64_t consumed, bool lead,
                         const std::function<void(std::string*)>& from_rank0) {
  const nlohmann::json saved_weights = meta.value("config", nlohmann::json::object())
                                           .value("data", nlohmann::json::object())
                                           .value("train_weights", nlohmann::json::array());
  std::vector<data::BlendSegment> saved;
  if (const nlohmann::json d = meta.value("data", nlohmann::json::object()); d.contains("blend"))
    saved = blend_history_from(d["blend"]);
  else if (saved_weights.is_array() && saved_weights.size() > 1)
    saved = {{0, saved_weights.get<std::vector<double>>()}};
  const size_t saved_sources = saved.empty() ? 1 : saved.front().weights.size();
  if (saved_sources == 1 && train.num_sources() == 1) return "";

  const std::string C = std::to_string(consumed);
  // Every rank must map the samples alike: rank 0, which read the fingerprints, decides.
  std::string why = lead ? blend_sources_change(meta, saved_sources, cfg, train_files) : "";
  from_rank0(&why);
  if (!why.empty()) {
    std::string text = "WARNING the blend restarts its schedule: " + why +
                       ". The checkpoint's record of how many samples each source has given (meta.json data.blend) "
                       "does not apply to these sources, so from sample " + C + " on ";
    if (train.num_sources() == 1)
      text += "data.train is read from position " + C + " of its own order";
    else
      text += "each source is read from where these data.train_weights would have put it, had the run used them "
              "from sample 0 (" + source_positions_text(cfg, train.samples_per_source(consumed)) + ")";
    // (The settings list leaves out weights changed for as many sources: this says them.)
    if (saved.size() && saved.front().weights.size() == train.num_sources() && saved.back().weights != cfg.data.train_weights)
      text += ", with data.train_weights " + nlohmann::json(cfg.data.train_weights).dump() + " (at the checkpoint " +
              nlohmann::json(saved.back().weights).dump() + ")";
    return text + ", not from where the saved run stopped: some windows are read again and others skipped. Resume "
                  "with the checkpoint's data.train to continue every source exactly";
  }

  const std::vector<double>& now = cfg.data.train_weights;
  train.set_blend_history(data::BlendSchedule::continued(saved, consumed, now));
  const std::vector<double>& was = saved.back().weights;
  if (was == now) return "";
  const std::string change = "data.train_weights changed since the checkpoint, " + nlohmann::json(was).dump() +
                             " -> " + nlohmann::json(now).dump();
  if (data::Blend(was).weights() == data::Blend(now).weights())
    return change + ": the same shares (" + shares_text(now) + "), so the blend goes on unchanged";
  return change + ": each source continues where it left off, " +
         source_positions_text(cfg, train.samples_per_source(consumed)) +
         ", so the change makes no source read a window twice or skip one. From sample " + C + " on the sources get " +
         shares_text(now) + " of the samples (" + shares_text(was) +
         " before); the checkpoints record the change (meta.json data.blend)";
}

// After a rewind (--resume of an earlier step), the later checkpoints belong to the abandoned
// run. They are moved, whole, into one folder beside the others (CheckpointManager::set_aside):
// this run's saves of the same steps would otherwise replace them, and rotation must not
// remove them. Said once, with the first few names and the command that removes them.
static std::string set_aside_abandoned(CheckpointManager& checkpoints, const std::string& dir, int64_t step,
                                       const std::vector<std::string>& above, const std::string& resumed_path) {
  constexpr size_t kNamed = 5;
  std::string names;
  for (size_t k = 0; k < above.size() && (above.size() <= kNamed || k < kNamed - 2); ++k) names += " " + above[k];
  if (above.size() > kNamed)
    names += " ... and " + std::to_string(above.size() - (kNamed - 2)) + " more up to " + above.back();
  // From outside the directory (another run's checkpoint, or one a rewind set aside), none of
  // the directory's checkpoints is known to be the resumed one's past.
  const fs::path from = fs::absolute(resumed_path).lexically_normal();
  std::error_code ec;
  const bool outside = !fs::equivalent(from.parent_path(), dir, ec);
  const std::string count = above.size() > 1 ? std::to_string(above.size()) + " " : "";
  const std::string what =
      "resuming at step " + std::to_string(step) +
      (outside ? " from " + from.string() + ", which is not one of " + dir + "'s checkpoints, abandons " +
                     (above.size() > 1 ? "the " + count + "checkpoints" : "the checkpoint") + names +
                     " there (nothing says which of them are its past)"
               : " abandons the " + count + (above.size() > 1 ? "later checkpoints" : "later checkpoint") + names +
                     " in " + dir);
  try {
    const std::string folder = checkpoints.set_aside(above, resumed_path);
    return what + ": moved, whole, to " + folder + " (this run's saves would replace them where they were). " +
           "Remove it when they are no longer wanted: rm -r " + folder;
  } catch (const std::exception& e) {
    return "WARNING " + what + ". They stay where they are (" + e.what() + "): keep_last does not remove them, " +
           "but this run's save of the same step replaces one";
  }
}

// The "eot_id" a data folder's meta.json names, if it names one.
std::optional<int64_t> meta_eot_id(const nlohmann::json& meta) {
  if (meta.is_object() && meta.contains("eot_id") && meta["eot_id"].is_number_integer()) return meta["eot_id"].get<int64_t>();
  return std::nullopt;
}

// The meta.json (prepare_data.py's, keel tokenize's) of each folder that data.train, data.val
// and data.val_sets read from, by its path; not an object where the folder has none.
std::map<std::string, nlohmann::json> data_folder_metas(const RunConfig& cfg) {
  std::vector<std::string> files = data::expand_paths(cfg.data.train, "data.train");
  if (!cfg.data.val.empty())
    for (const std::string& f : data::expand_paths(cfg.data.val, "data.val")) files.push_back(f);
  for (const auto& [name, patterns] : cfg.data.val_sets)
    for (const std::string& f : data::expand_paths(patterns, "data.val_sets." + name)) files.push_back(f);
  std::map<std::string, nlohmann::json> metas;
  for (const std::string& f : files) {
    const std::string dir = fs::path(f).parent_path().string();
    const std::string meta = (fs::path(dir.empty() ? "." : dir) / "meta.json").string();
    if (metas.contains(meta)) continue;
    std::ifstream in(meta);
    metas[meta] = in ? nlohmann::json::parse(in, nullptr, false) : nlohmann::json();
  }
  return metas;
}

// Data packed by keel tokenize --pack T holds whole documents only in windows of T tokens: read
// under another train.seq_len, the windows would cut documents apart again. Returns the meta.json
// files of packed data (empty: none is packed).
std::vector<std::string> check_packed_data(const RunConfig& cfg) {
  std::vector<std::string> packed;
  for (const auto& [meta, j] : data_folder_metas(cfg)) {
    if (!j.is_object() || !j.contains("pack") || !j["pack"].is_object() || !j["pack"].contains("seq_len")) continue;
    const int64_t T = j["pack"]["seq_len"].is_number_integer() ? j["pack"]["seq_len"].get<int64_t>() : -1;
    if (T != cfg.train.seq_len)
      throw ConfigError("train.seq_len " + std::to_string(cfg.train.seq_len) + " does not match the data's packing: " + meta +
                        " says its windows of " + std::to_string(T) + " tokens hold whole documents (keel tokenize --pack " +
                        std::to_string(T) + "), and windows of another length would cut them apart. Set train.seq_len to " +
                        std::to_string(T) + ", or tokenize again with --pack " + std::to_string(cfg.train.seq_len) + ".");
    packed.push_back(meta);
  }
  return packed;
}

// The meta.json of chat data whose conversations hold the end-of-document token before their end
// (keel tokenize --chat with Llama 2's template: </s> after every turn), and how many; empty if none.
std::pair<std::string, int64_t> conversations_with_eod_inside(const RunConfig& cfg, int64_t eod) {
  for (const auto& [meta, j] : data_folder_metas(cfg)) {
    if (!j.is_object() || !j.contains("eot_inside_conversations") || meta_eot_id(j) != eod) continue;
    int64_t n = 0;
    for (const char* split : {"train", "val"})
      if (j["eot_inside_conversations"].value(split, nlohmann::json(0)).is_number_integer())
        n += j["eot_inside_conversations"][split].get<int64_t>();
    if (n > 0) return {meta, n};
  }
  return {};
}

// Document masking cuts at every end-of-document token: in such conversations, each turn would
// be trained without the turns before it, and nothing would say so.
void check_document_ends(const RunConfig& cfg) {
  if (!cfg.data.document_masking) return;
  const auto [meta, n] = conversations_with_eod_inside(cfg, cfg.data.eod_token);
  if (meta.empty()) return;
  throw ConfigError("data.document_masking: " + meta + " says " + std::to_string(n) +
                    " of its conversations hold the end-of-text token (id " + std::to_string(cfg.data.eod_token) +
                    ") before their end: the chat template writes it inside a conversation (Llama 2's and Zephyr's "
                    "after every turn), and document masking would cut the conversation at each one, training every "
                    "turn without the turns before it. Set data.document_masking=false (the conversations packed in a "
                    "window then attend to the ones before them), or tokenize again with an --eot-token the template "
                    "does not write");
}

// data.eod_token when document masking or eod_mask_loss is on and it is not set: the "eot_id"
// prepare_data.py writes to meta.json beside the shards, which every data.train and data.val
// folder must agree on.
RunConfig with_eod_token(RunConfig cfg) {
  if (!cfg.data.needs_eod() || cfg.data.eod_token >= 0) return cfg;
  const std::string option = cfg.data.document_masking ? "data.document_masking" : "data.eod_mask_loss";
  std::map<int64_t, std::string> found;  // eot_id -> a meta.json that says so
  std::set<std::string> without;          // folders with no usable meta.json
  for (const auto& [meta, j] : data_folder_metas(cfg)) {
    if (const auto id = meta_eot_id(j)) found.emplace(*id, meta);
    else without.insert(meta);
  }
  const std::string hint = " Set data.eod_token to the token id that ends each document in the data.";
  if (found.empty())
    throw ConfigError(option + " needs the token that ends a document, and data.eod_token is not set; "
                      "no meta.json beside the data files names one (\"eot_id\", written by prepare_data.py): " +
                      *without.begin() + "." + hint);
  if (found.size() > 1)
    throw ConfigError(option + ": the data's meta.json files disagree on the end-of-document token: " +
                      std::to_string(found.begin()->first) + " in " + found.begin()->second + ", " +
                      std::to_string(found.rbegin()->first) + " in " + found.rbegin()->second + "." + hint);
  if (!without.empty())
    throw ConfigError(option + ": " + found.begin()->second + " names end-of-document token " +
                      std::to_string(found.begin()->first) + ", but " + *without.begin() + " names none." + hint);
  cfg.data.eod_token = found.begin()->first;
  if (cfg.data.eod_token >= cfg.model.vocab_size)
    throw ConfigError(option + ": the end-of-document token " + std::to_string(cfg.data.eod_token) +
                      " of " + found.begin()->second + " is outside model.vocab_size " +
                      std::to_string(cfg.model.vocab_size));
  return cfg;
}

// Micro-batches of DP rank `dp_rank` for the global batch that starts at consumed sample
// `first`: rank r reads samples first + r*G/dp + m*micro_batch + b. data.document_masking:
// each gets its document positions; data.eod_mask_loss: the targets at end-of-document inputs
// leave the loss.
std::vector<MicroBatch> load_batches(const data::Sampler& sampler, int64_t first, int64_t global_batch,
                                     int64_t micro_batch, int64_t dp, int64_t dp_rank, const DataConfig& data) {
  const int64_t eod = data.masking_eod(), loss_eod = data.loss_mask_eod();
  const int64_t per_rank = global_batch / dp;
  const int T = sampler.seq_len();
  std::vector<MicroBatch> out(static_cast<size_t>(per_rank / micro_batch));
  for (size_t m = 0; m < out.size(); ++m) {
    out[m].inputs.resize(static_cast<size_t>(micro_batch * T));
    out[m].targets.resize(out[m].inputs.size());
    sampler.fill(first + dp_rank * per_rank + static_cast<int64_t>(m) * micro_batch, static_cast<int>(micro_batch),
                 out[m].inputs.data(), out[m].targets.data());
    if (loss_eod >= 0)
      data::mask_targets_after_eod(out[m].inputs.data(), out[m].targets.data(),
                                   static_cast<int64_t>(out[m].inputs.size()), static_cast<int32_t>(loss_eod));
    if (eod >= 0)
      out[m].positions = document_positions(out[m].inputs.data(), static_cast<int64_t>(out[m].inputs.size()), T,
                                            static_cast<int32_t>(eod));
  }
  return out;
}

// A validation set: data.val (name empty) or one of data.val_sets.
struct ValidationSet {
  std::string name;
  data::Sampler sampler;
  std::string field;  // data.val or data.val_sets.<name>
  // Targets in the loss over one evaluation: 0, it has no loss; -1, it reads no window
  // (train.eval_batches 0).
  int64_t loss_targets = -1;
};

// Every rank must read the same files. A node with a stale, half-copied or extra shard (its own
// copy of the data, a mount that lags) trains its share on other windows, which nothing else
// notices: the losses stay plausible and the checkpoint records world rank 0's files. Compared
// by path and token count (the content fingerprints are rank 0's alone) for data.train and every
// validation set; collective over the world, the difference named by rank 0.
void check_ranks_read_same_files(const data::Sampler& train, const std::vector<ValidationSet>& vals,
                                 const RunOptions& opts) {
  if (!opts.mpi || opts.mpi->world_size() <= 1) return;
  // training_files without fingerprints: [[{"file", "tokens"}, ...] per source]
  nlohmann::json mine = {{"data.train", training_files(train, false)}};
  for (const ValidationSet& v : vals) mine[v.field] = training_files(v.sampler, false);
  std::string theirs;
  const int r = opts.mpi->first_rank_differing(mine.dump(), &theirs);
  if (r < 0) return;
  if (opts.mpi->world_rank() != 0)
    throw data::DataError("world rank " + std::to_string(r) + " reads other data files than world rank 0 (rank 0 names them)");
  const nlohmann::json other = nlohmann::json::parse(theirs);
  std::vector<std::string> lines;
  const std::string at_r = " on world rank " + std::to_string(r);
  for (const auto& [field, sources] : mine.items()) {
    const nlohmann::json& o = other.value(field, nlohmann::json::array());
    auto by_file = [](const nlohmann::json& files) {  // {path: tokens}
      nlohmann::json m = nlohmann::json::object();
      for (const nlohmann::json& f : files) m[f.at("file").get<std::string>()] = f.at("tokens");
      return m;
    };
    for (size_t k = 0; k < sources.size() || k < o.size(); ++k) {
      const std::string where = sources.size() > 1 || o.size() > 1 ? field + "[" + std::to_string(k) + "]" : field;
      const nlohmann::json a = k < sources.size() ? by_file(sources[k]) : nlohmann::json::object();
      const nlohmann::json b = k < o.size() ? by_file(o[k]) : nlohmann::json::object();
      for (const auto& [file, tokens] : a.items()) {
        if (!b.contains(file)) lines.push_back(where + ": " + file + " (" + tokens.dump() + " tokens) is not there" + at_r);
        else if (b[file] != tokens)
          lines.push_back(where + ": " + file + " holds " + tokens.dump() + " tokens on world rank 0, " + b[file].dump() + at_r);
      }
      for (const auto& [file, tokens] : b.items())
        if (!a.contains(file)) lines.push_back(where + ": " + file + " (" + tokens.dump() + " tokens) is there only" + at_r);
    }
  }
  std::string msg = "world rank " + std::to_string(r) +
                    " reads other data files than world rank 0 (a stale, partial or extra copy of the data on its "
                    "node?); every rank must read the same files, or it trains on other windows unseen:";
  for (size_t i = 0; i < lines.size() && i < 10; ++i) msg += "\n  " + lines[i];
  if (lines.size() > 10) msg += "\n  ... and " + std::to_string(lines.size() - 10) + " more";
  throw data::DataError(msg);
}

// Micro-batch b of an evaluation of `val`: its first eval_batches micro-batches, unshuffled. A
// set of fewer windows is read once: the rows past its end (which would wrap around to its first
// windows) have no targets.
MicroBatch validation_batch(const data::Sampler& val, const RunConfig& cfg, int64_t b) {
  const int64_t mbs = cfg.train.micro_batch, seq = cfg.train.seq_len;
  const int64_t windows = validation_windows(val, cfg);
  auto one = load_batches(val, b * mbs, mbs, mbs, 1, 0, cfg.data);
  for (int64_t row = windows - b * mbs; row < mbs; ++row) std::fill_n(one[0].targets.begin() + row * seq, seq, -1);
  return std::move(one[0]);
}

// The targets in the loss over one evaluation of `val` (all DP ranks' micro-batches): 0 when its
// loss masks (or data.eod_mask_loss) leave out every one, so that it has no loss.
int64_t validation_loss_targets(const data::Sampler& val, const RunConfig& cfg) {
  int64_t n = 0;
  for (int64_t b = 0; b * cfg.train.micro_batch < validation_windows(val, cfg); ++b) {
    const MicroBatch mb = validation_batch(val, cfg, b);
    n += std::count_if(mb.targets.begin(), mb.targets.end(), [](int32_t t) { return t >= 0; });
  }
  return n;
}

// Said at start-up, and not again at the first evaluation (which may be hours later).
void warn_no_validation_loss(const ValidationSet& v) {
  std::printf("keel: WARNING %s: no target in the windows it evaluates counts in the loss (its loss masks, or "
              "data.eod_mask_loss, leave every one out): its validation loss will be reported as nan. Check its .mask "
              "files, or evaluate more windows (train.eval_batches)\n",
              v.field.c_str());
}

std::vector<ValidationSet> open_validation_data(const RunConfig& cfg, int64_t vocab_scan_limit) {
  const auto vocab = static_cast<uint32_t>(cfg.model.vocab_size);
  const int T = static_cast<int>(cfg.train.seq_len);
  std::vector<ValidationSet> sets;
  auto open = [&](const std::string& name, const std::vector<std::string>& patterns, const std::string& field) {
    data::Sampler s(data::TokenDataset::open(data::expand_paths(patterns, field), T, vocab, data::DataUse::validation, field),
                    cfg.train.seed, false);
    s.dataset().check_vocab(vocab_scan_limit);
    sets.push_back({name, std::move(s), field});
    if (validation_windows(sets.back().sampler, cfg) > 0)
      sets.back().loss_targets = validation_loss_targets(sets.back().sampler, cfg);
  };
  if (!cfg.data.val.empty()) open("", cfg.data.val, "data.val");
  for (const auto& [name, patterns] : cfg.data.val_sets) open(name, patterns, "data.val_sets." + name);
  return sets;
}

// Masked (instruction) data read in windows that cut examples apart: of the in-loss targets of the
// first windows, the share that belongs to an example which began in an earlier window, so its
// prompt is out of view (a reply trained without the question). `eod` ends an example. Scans up
// to 64 windows in file order; 0 when the data has no masks.
double cut_example_share(const data::TokenDataset& d, int64_t eod) {
  if (d.num_masked_files() == 0 || eod < 0) return 0;
  const int T = d.seq_len();
  std::vector<int32_t> in(static_cast<size_t>(T)), tgt(in.size());
  int64_t in_loss = 0, cut = 0;
  for (int64_t w = 0; w < std::min<int64_t>(64, d.num_windows()); ++w) {
    d.read_window(w, in.data(), tgt.data());
    const auto at = d.locate(w);
    // The window starts an example when it starts the file or follows an end of example.
    const bool starts = at.start == 0 || d.file(at.file).token(at.start - 1) == static_cast<uint32_t>(eod);
    const auto first_end = std::find(in.begin(), in.end(), static_cast<int32_t>(eod)) - in.begin();
    for (int k = 0; k < T; ++k) {
      if (tgt[static_cast<size_t>(k)] < 0) continue;
      ++in_loss;
      cut += !starts && k < first_end;  // predicted inside the example the window cut into
    }
  }
  return in_loss ? static_cast<double>(cut) / static_cast<double>(in_loss) : 0;
}

// The end-of-document token for the start-up checks: data.eod_token, else the data's meta.json.
int64_t data_eot_id(const RunConfig& cfg) {
  if (cfg.data.eod_token >= 0) return cfg.data.eod_token;
  for (const auto& [meta, j] : data_folder_metas(cfg))
    if (const auto id = meta_eot_id(j)) return *id;
  return -1;
}

// schedule.rampup_batch_size (Megatron's --rampup-batch-size) on the batch line, whose global
// batch is where it ends: where it starts, and the step from which the batch is whole.
std::string rampup_note(const RunConfig& cfg) {
  if (!cfg.schedule.rampup) return "";
  const RampupConfig& r = *cfg.schedule.rampup;
  int64_t consumed = 0, step = 0;
  while (step < cfg.train.steps && global_batch_size(cfg, consumed) < cfg.train.global_batch)
    consumed += global_batch_size(cfg, consumed), ++step;
  std::string note = "; after a ramp-up (schedule.rampup_batch_size) from " + std::to_string(r.start) + " samples by " +
                     std::to_string(r.increment) + " over " + std::to_string(r.samples) + " samples";
  if (step < cfg.train.steps) return note + ": whole from step " + std::to_string(step + 1);
  return note + ", which train.steps ends before the batch is whole";
}

// Start-up summary: the model, the precision policy and the optimizer's weight-decay groups,
// so a norm or bias filed in the wrong group is visible on day one.
void print_summary(const RunConfig& cfg, const data::Sampler& train,
                   const std::vector<ValidationSet>& vals, const std::vector<std::string>& packed, const Backend& be) {
  const ModelConfig& m = cfg.model;
  // The whole model, padded as tp pads it: a pipeline rank's own table holds only its stage (the
  // count and the weight-decay groups below were stage 0's under pp > 1).
  ModelShard whole;
  whole.tp_size = static_cast<int>(cfg.parallel.tp);
  const ParamTable t(m, whole);
  std::printf("keel: %s model, %s parameters (%d layers, d_model %d, %d heads / %d kv heads, ffn %d, vocab %lld%s%s)\n",
              family_name(m.family).c_str(), human_count(static_cast<double>(t.logical_numel())).c_str(), m.n_layers,
              m.d_model, m.n_heads, m.n_kv_heads, m.ffn_hidden, static_cast<long long>(m.vocab_size),
              m.tied_embeddings ? ", tied head" : "", option_names(m).c_str());
  std::printf("keel: backend %s, precision %s: working weights %s, activations %s, grads f32, %s\n",
              be.name().c_str(), precision_name(cfg.precision.mode).c_str(),
              std::string(dtype_name(working_dtype(cfg.precision.mode))).c_str(),
              std::string(dtype_name(activation_dtype(cfg.precision.mode))).c_str(),
              cfg.precision.mode == PrecisionMode::BF16UnsafeNoMaster ? "NO fp32 master weights"
                                                                      : "fp32 master weights and Adam moments");
  if (cfg.precision.mode == PrecisionMode::BF16UnsafeNoMaster) {
    std::printf(
        "keel: WARNING *** precision.mode = bf16-unsafe-no-master: parameters are stored ONLY in bf16. ***\n"
        "keel: WARNING *** bf16's spacing at 1.0 is 2^-7 = 0.0078, so AdamW updates of 1e-5..1e-4 to weights ***\n"
        "keel: WARNING *** near 1.0 (norm gains) round away and those weights never train. Use \"bf16\". ***\n");
  }
  std::printf("keel: optimizer AdamW lr %.3g (min %.3g), betas (%.3g, %.3g), eps %.1e, grad clip %.3g\n",
              cfg.optimizer.lr, cfg.optimizer.min_lr, cfg.optimizer.beta1, cfg.optimizer.beta2, cfg.optimizer.eps,
              cfg.optimizer.grad_clip);
  std::printf("%s", param_group_table(t, cfg.optimizer.weight_decay).c_str());
  // How often the run reads its data (the whole batch each step; a ramp-up reads somewhat less):
  // a corpus smaller than the run repeats, and a blend's upweighted small source many times.
  const double run_samples = static_cast<double>(cfg.train.steps) * static_cast<double>(cfg.train.global_batch);
  if (train.num_sources() == 1) {
    std::printf("keel: data: %lld training windows of %d+1 tokens from %zu file(s), %s tokens; about %.2f epochs in "
                "%lld steps%s\n",
                static_cast<long long>(train.num_windows()), train.seq_len(), train.dataset().num_files(),
                human_count(static_cast<double>(train.dataset().num_tokens())).c_str(),
                run_samples / static_cast<double>(std::max<int64_t>(1, train.num_windows())),
                static_cast<long long>(cfg.train.steps), loss_mask_note(train.dataset()).c_str());
  } else {
    std::printf("keel: data: a blend of %zu sources, windows of %d+1 tokens:\n", train.num_sources(), train.seq_len());
    // Each source's samples in the whole run, under the blend's history (earlier weights first).
    const std::vector<int64_t> run_counts = train.samples_per_source(static_cast<int64_t>(run_samples));
    for (size_t k = 0; k < train.num_sources(); ++k) {
      const data::TokenDataset& d = train.source(k);
      std::printf("keel:   %5.1f%%  %s: %lld windows from %zu file(s), %s tokens; about %.2f epochs in %lld steps%s\n",
                  100 * train.weight(k), cfg.data.train[k].c_str(), static_cast<long long>(d.num_windows()),
                  d.num_files(), human_count(static_cast<double>(d.num_tokens())).c_str(),
                  static_cast<double>(run_counts[k]) / static_cast<double>(d.num_windows()),
                  static_cast<long long>(cfg.train.steps), loss_mask_note(d).c_str());
    }
    // The shares above hold from the last change of data.train_weights on; the earlier ones too.
    if (const auto& history = train.blend_history(); history.size() > 1) {
      std::string changes;
      for (const data::BlendSegment& seg : history)
        changes += (changes.empty() ? "" : ", ") + shares_text(seg.weights) + " from sample " +
                   std::to_string(seg.from_sample);
      std::printf("keel:   the shares changed during the run (each source continuing where it was): %s\n",
                  changes.c_str());
    }
  }
  for (const ValidationSet& v : vals) {
    const int64_t used = validation_windows(v.sampler, cfg);
    // Micro-batches, not Megatron's global batches (eval_iters): say how the count comes about.
    const std::string how = used < v.sampler.num_windows()
                                ? " (train.eval_batches " + std::to_string(cfg.train.eval_batches) +
                                      " x train.micro_batch " + std::to_string(cfg.train.micro_batch) + ")"
                                : "";
    std::printf("keel: data: validation%s%s: %lld windows, %lld of them per evaluation%s\n", v.name.empty() ? "" : " set ",
                v.name.c_str(), static_cast<long long>(v.sampler.num_windows()), static_cast<long long>(used),
                how.c_str());
    if (v.loss_targets == 0) warn_no_validation_loss(v);
  }
  if (const std::string w = repeated_files_warning(cfg); !w.empty()) std::printf("keel: %s\n", w.c_str());
  // A batch that takes more samples of a source than it has windows reads some of them twice or
  // more in one step: their gradient counts several times (a tiny or mis-globbed corpus).
  for (size_t k = 0; k < train.num_sources(); ++k) {
    const double per_step = static_cast<double>(cfg.train.global_batch) * train.weight(k);
    const int64_t windows = train.source(k).num_windows();
    if (windows > 0 && per_step > static_cast<double>(windows))
      std::printf("keel: WARNING %s: each step takes %.0f samples of its %lld windows, so a batch holds some windows "
                  "more than once (up to %lld times), and their gradients count that often. Give it more data or "
                  "a smaller train.global_batch\n",
                  train.num_sources() > 1 ? ("data.train[" + std::to_string(k) + "] (" + cfg.data.train[k] + ")").c_str()
                                          : "data.train",
                  per_step, static_cast<long long>(windows),
                  static_cast<long long>(std::ceil(per_step / static_cast<double>(windows))));
  }
  for (size_t k = 0; k < train.num_sources(); ++k)
    if (const std::string w = short_files_warning(train.source(k), train.num_sources() > 1 ? cfg.data.train[k] : "data.train");
        !w.empty())
      std::printf("keel: %s\n", w.c_str());
  if (packed.empty()) {
    const int64_t eod = data_eot_id(cfg);
    for (size_t k = 0; k < train.num_sources(); ++k)
      if (const double share = cut_example_share(train.source(k), eod); share > 0)
        std::printf("keel: WARNING %s: %.1f%% of the in-loss targets in its first windows belong to examples that began "
                    "in an earlier window, so their beginning (the prompt, earlier turns) is out of view. "
                    "Tokenize with keel tokenize --pack %lld to keep every example whole in a window.\n",
                    train.num_sources() > 1 ? cfg.data.train[k].c_str() : "data.train", 100 * share,
                    static_cast<long long>(cfg.train.seq_len));
  } else {
    std::printf("keel: data: packed (keel tokenize --pack %lld): whole documents in each window, then padding out of "
                "the loss (%s%s)\n",
                static_cast<long long>(cfg.train.seq_len), packed.front().c_str(), packed.size() > 1 ? ", ..." : "");
    if (!cfg.data.document_masking && conversations_with_eod_inside(cfg, data_eot_id(cfg)).first.empty())
      std::printf("keel: WARNING the data is packed, several documents to a window, and data.document_masking is off: "
                  "each document attends to the documents before it in its window. Set data.document_masking=true to "
                  "train each one as if it were alone.\n");
  }
  if (cfg.data.needs_eod()) {
    // How often the end-of-document token occurs in the first windows: a wrong data.eod_token
    // would make the masking a silent no-op.
    const int n = static_cast<int>(std::min<int64_t>(64, train.num_windows()));
    std::vector<int32_t> in(static_cast<size_t>(n) * train.seq_len()), tgt(in.size());
    train.fill(0, n, in.data(), tgt.data());
    const auto eod = static_cast<int32_t>(cfg.data.eod_token);
    const auto ends = std::count(in.begin(), in.end(), eod);
    // Documents: the stretches of other tokens that start a sequence or follow an end. A run of
    // ends (a document's and the padding of packed data after it) closes one document.
    int64_t documents = 0;
    for (size_t k = 0; k < in.size(); ++k)
      documents += in[k] != eod && (k % static_cast<size_t>(train.seq_len()) == 0 || in[k - 1] == eod);
    if (cfg.data.document_masking)
      std::printf("keel: data: document masking: documents end at token %lld; attention stays within a document and "
                  "positions restart after each end (%.1f documents per sequence in the first %d)\n",
                  static_cast<long long>(cfg.data.eod_token), static_cast<double>(documents) / n, n);
    if (cfg.data.eod_mask_loss)
      std::printf("keel: data: eod_mask_loss: the prediction after each end-of-document token %lld is left out of the "
                  "loss (%.2f%% of the targets in the first %d sequences)\n",
                  static_cast<long long>(cfg.data.eod_token), 100.0 * static_cast<double>(ends) / in.size(), n);
    if (ends == 0)
      std::printf("keel: WARNING token %lld does not occur in the first %d training sequences: %s changes nothing "
                  "there. Is data.eod_token the token that ends the documents of this data?\n",
                  static_cast<long long>(cfg.data.eod_token), n,
                  cfg.data.document_masking ? "document masking" : "eod_mask_loss");
  }
  std::printf("keel: batch: global %lld samples = micro-batch %lld x %lld accumulation steps x dp %lld; seq_len %lld%s\n",
              static_cast<long long>(cfg.train.global_batch), static_cast<long long>(cfg.train.micro_batch),
              static_cast<long long>(cfg.grad_accum_steps(cfg.train.global_batch)),
              static_cast<long long>(cfg.parallel.dp), static_cast<long long>(cfg.train.seq_len),
              rampup_note(cfg).c_str());
  std::fflush(stdout);
}

// Which keel build this is: the CRC-32C of the running binary. Only a checkpoint saved by this
// very build must reproduce its probe loss bit for bit on a resume; a newer or older keel may
// round differently (a kernel rewritten, another compiler), which is not a broken restore.
constexpr const char* kUnknownBuild = "unknown";
const std::string& build_id() {
  static const std::string id = [] {
    std::ifstream in("/proc/self/exe", std::ios::binary);
    if (!in) return std::string(kUnknownBuild);
    std::vector<char> buf(size_t{1} << 20);
    uint32_t crc = 0;
    while (in) {
      in.read(buf.data(), static_cast<std::streamsize>(buf.size()));
      crc = data::crc32c(crc, buf.data(), static_cast<size_t>(in.gcount()));
    }
    return "crc32c " + data::crc32c_hex(crc);
  }();
  return id;
}

// choice_eval: the items, read and checked (ids in the vocabulary, endings within seq_len)
// before the run directory is touched. Text items are encoded with choice_eval.tokenizer, else
// the tokenizer.json beside the training data.
struct ChoiceEvalSet {
  std::vector<ChoiceItem> items;
  std::string tokenizer;  // the file used, if any
  int64_t contexts_cut = 0;
  int64_t endings = 0, rows = 0;  // packed into rows of seq_len
  // Steps between evaluations: choice_eval.interval, else train.eval_interval (0: at the end only).
  static int64_t every(const RunConfig& cfg) {
    return cfg.choice_eval.interval > 0 ? cfg.choice_eval.interval : cfg.train.eval_interval;
  }
  bool due(int64_t step, const RunConfig& cfg) const {
    return !items.empty() && due_every(step, every(cfg), cfg.train.steps);
  }
  std::string describe(const RunConfig& cfg) const {
    const int64_t every = ChoiceEvalSet::every(cfg);
    std::string s = "choice eval: " + std::to_string(items.size()) + " items from " + cfg.choice_eval.file;
    s += " (" + std::to_string(endings) + " endings packed in " + std::to_string(rows) + " rows of " +
         std::to_string(cfg.train.seq_len) + ")";
    if (!tokenizer.empty()) s += ", tokenizer " + tokenizer;
    s += every > 0 ? ", every " + std::to_string(every) + " steps and at the end" : ", at the end";
    if (cfg.train.eval_at_start) s += ", and before the first step";
    if (contexts_cut > 0)
      s += "; " + std::to_string(contexts_cut) + " contexts lose their first tokens to fit train.seq_len " +
           std::to_string(cfg.train.seq_len);
    return s;
  }
};

ChoiceEvalSet open_choice_eval(const RunConfig& cfg) {
  ChoiceEvalSet set;
  const ChoiceEvalConfig& c = cfg.choice_eval;
  if (c.file.empty()) return set;
  set.tokenizer = locate_tokenizer(data_tokenizer_dirs(cfg), c.tokenizer);
  std::optional<data::Tokenizer> tok;
  if (!set.tokenizer.empty()) tok = data::Tokenizer::from_file(set.tokenizer);
  set.items = read_choice_items(c.file, tok ? &*tok : nullptr, cfg.model.vocab_size,
                                "set choice_eval.tokenizer, or keep tokenizer.json beside the data.train files");
  if (c.items > 0 && static_cast<int64_t>(set.items.size()) > c.items) set.items.resize(static_cast<size_t>(c.items));
  check_choices_fit(set.items, cfg.train.seq_len, c.file);
  set.contexts_cut = choice_contexts_cut(set.items, cfg.train.seq_len);
  const std::vector<ChoicePlace> places = place_choices(set.items, cfg.train.seq_len, cfg.takes_document_positions());
  set.endings = static_cast<int64_t>(places.size());
  set.rows = places.back().row + 1;
  return set;
}

// On the lead rank: the log line, the metrics record and (choice_eval.write_scores) the scores file.
// (metrics null: --eval-only, which writes nothing.)
void report_choice_eval(const RunConfig& cfg, const ChoiceEvalSet& set, const std::vector<ChoiceScore>& scores,
                        int64_t it, double secs, bool quiet, MetricsWriter* metrics) {
  ChoiceTotals t;
  for (size_t i = 0; i < scores.size(); ++i) t.add(set.items[i], scores[i]);
  const double n = static_cast<double>(t.items);
  nlohmann::json rec = {{"step", it},
                        {"choice_acc", static_cast<double>(t.correct) / n},
                        {"choice_acc_per_token", static_cast<double>(t.correct_per_token) / n},
                        {"choice_items", t.items}};
  if (t.byte_items > 0) rec["choice_acc_per_byte"] = static_cast<double>(t.correct_per_byte) / t.byte_items;
  if (cfg.choice_eval.write_scores && metrics) {
    const fs::path dir = fs::path(cfg.out) / "choice_scores";
    fs::create_directories(dir);
    const fs::path file = dir / ("step_" + std::to_string(it) + ".jsonl");
    std::ofstream out(file);
    for (size_t i = 0; i < scores.size(); ++i) out << choice_score_record(set.items[i], scores[i]).dump() << '\n';
    out.close();
    if (!out) throw std::runtime_error("cannot write choice scores to " + file.string());
    rec["choice_scores"] = file.string();
  }
  if (metrics) metrics->write(rec);
  if (quiet) return;
  std::printf(" choice eval at iteration %lld | acc %.4f | acc_per_token %.4f |", static_cast<long long>(it),
              rec["choice_acc"].get<double>(), rec["choice_acc_per_token"].get<double>());
  if (t.byte_items > 0) std::printf(" acc_per_byte %.4f |", rec["choice_acc_per_byte"].get<double>());
  std::printf(" chance %.4f | %lld items in %.1f s |\n", t.chance / n, static_cast<long long>(t.items), secs);
  std::fflush(stdout);
}

// Validation: the first eval_batches micro-batches of the (unshuffled) validation set, always
// the same ones; DP rank r evaluates batches r, r + dp, ... and the losses are summed. A set of
// fewer windows is read once: the rows of the last micro-batch past its end (which would wrap
// around to its first windows) have no targets. `loss_tokens` counts the targets in the loss
// (0 when masks leave out every one: there is no loss then, and the 0 returned means nothing).
double validate(Trainer& tr, const data::Sampler& val, const RunConfig& cfg, const parallel::Grid& grid,
                int64_t& loss_tokens) {
  std::vector<MicroBatch> batches;
  for (int64_t b = grid.dp_rank(); b * cfg.train.micro_batch < validation_windows(val, cfg); b += grid.dp_size())
    batches.push_back(validation_batch(val, cfg, b));
  return tr.evaluate(batches, &loss_tokens);
}

// SLURM sends SIGUSR1 (with --signal) or SIGTERM before the time limit; Ctrl-C is SIGINT.
// The handler records the signal and says so at once (write(2) is async-signal-safe): the loop
// saves at the next step boundary and exits, which may be a long step away. A second Ctrl-C
// ends the process at once, without the save; SIGTERM and SIGUSR1 again change nothing (SLURM
// or a script may send them twice, and the save is what they ask for).
volatile std::sig_atomic_t g_stop_signal = 0;
volatile std::sig_atomic_t g_announce_signal = 1;  // world rank 0 only: mpirun signals every rank
// The announcement's second line: where a resume would start if this process is killed before
// its save. mpirun tears a job down the same way when one rank fails (SIGTERM to every rank, then
// SIGKILL), and a rank cannot tell that SIGTERM from a scheduler's. Written by the main thread
// between steps into the buffer the handler is not reading, then published by the index.
char g_fallback_line[2][768];
volatile std::sig_atomic_t g_fallback_index = 0;
void set_fallback_checkpoint(const std::string& path) {
  const int next = 1 - g_fallback_index;
  const std::string line =
      path.empty() ? "keel: if keel is killed before the save (as mpirun kills every rank when one fails), this run "
                     "leaves no checkpoint to resume from\n"
                   : "keel: if keel is killed before the save (as mpirun kills every rank when one fails), a resume "
                     "starts from " + path + ", the newest checkpoint\n";
  std::snprintf(g_fallback_line[next], sizeof g_fallback_line[next], "%s", line.c_str());
  g_fallback_index = next;
}
extern "C" void on_stop_signal(int sig) {
  const bool first = g_stop_signal == 0;
  g_stop_signal = sig;
  if (sig == SIGINT) std::signal(sig, SIG_DFL);
  if (!first || !g_announce_signal) return;
  const char* text = sig == SIGINT    ? "keel: SIGINT received: saving a checkpoint at the end of this step, then "
                                        "stopping (Ctrl-C again stops at once, without saving)\n"
                     : sig == SIGTERM ? "keel: SIGTERM received: saving a checkpoint at the end of this step, then stopping\n"
                                      : "keel: SIGUSR1 received: saving a checkpoint at the end of this step, then stopping\n";
  [[maybe_unused]] ssize_t n = ::write(STDOUT_FILENO, text, std::strlen(text));
  const char* fallback = g_fallback_line[g_fallback_index];
  n = ::write(STDOUT_FILENO, fallback, std::strlen(fallback));
}

const char* signal_name(int sig) {
  switch (sig) {
    case SIGTERM: return "SIGTERM";
    case SIGUSR1: return "SIGUSR1";
    case SIGINT: return "SIGINT";
  }
  return "a signal";
}

void print_save(const SaveResult& r) {
  if (r.background)
    std::printf("keel: saved checkpoint %s (%.1f MB written in the background in %.2f s, published %.2f s after the "
                "save began; training waited %.3f s)\n",
                r.path.c_str(), r.bytes / 1e6, r.write_seconds, r.seconds, r.held_seconds);
  else
    std::printf("keel: saved checkpoint %s (%.1f MB in %.2f s, %.0f MB/s)\n", r.path.c_str(), r.bytes / 1e6, r.seconds,
                r.seconds > 0 ? r.bytes / 1e6 / r.seconds : 0.0);
  std::fflush(stdout);
}

// The spike check's statistics from a checkpoint's health record (none in those saved before
// keel kept them: the check then starts afresh and arms after health.spike_warmup steps).
void restore_spike_detector(Trainer& tr, const nlohmann::json& health, bool keep_streak) {
  if (health.is_object() && health.contains("spike_detector")) try {
      tr.spikes().restore(health["spike_detector"], keep_streak);
    } catch (const nlohmann::json::exception& e) {
      throw CheckpointError(std::string("the checkpoint's health.spike_detector record is malformed (") + e.what() + ")");
    }
}

// Reports the backend's peak against the plan after step 1 and as it grows (train/memory_watch.h).
// `planned`: plan::planned_backend_bytes for this rank's stage.
void report_memory(MemoryWatch& watch, double planned, const Backend& be, const parallel::Grid& grid, bool lead,
                   bool quiet, int64_t step, MetricsWriter* metrics) {
  const double peak = static_cast<double>(be.peak_bytes());
  const bool gpu = be.device() == Device::CUDA;
  const MemoryWatch::News news = watch.observe(peak, planned, step);
  if (!news.report) return;
  if (lead && !quiet) {
    if (news.first)
      std::printf("keel: memory after step %lld: the backend held at most %s (keel plan: %s on this stage%s)\n",
                  static_cast<long long>(step), plan::format_bytes(peak).c_str(), plan::format_bytes(planned).c_str(),
                  gpu ? ", both without the CUDA context" : "");
    else
      std::printf("keel: memory grew by step %lld: the backend held at most %s, %s after step %lld (keel plan: %s)\n",
                  static_cast<long long>(step), plan::format_bytes(peak).c_str(),
                  plan::format_bytes(news.previous_bytes).c_str(), static_cast<long long>(news.previous_step),
                  plan::format_bytes(planned).c_str());
  }
  if (lead && metrics)
    metrics->write({{"event", "memory"}, {"step", step}, {"peak_bytes", peak}, {"planned_bytes", planned}});
  if (news.warn)
    std::printf("keel: WARNING memory: rank %d (pipeline stage %d) held %s at its peak (by step %lld), %.0f%% more than "
                "keel plan's %s for it: layouts planned with keel plan may not fit; please report this with the config\n",
                grid.rank(), grid.pp_rank(), plan::format_bytes(peak).c_str(), static_cast<long long>(step),
                100 * (peak / planned - 1), plan::format_bytes(planned).c_str());
  std::fflush(stdout);
}

// parallel.overlap_grad_reduce: how much of the first step's DP reduction started while the
// backward still ran (rank 0's; every DP rank of a stage forms the same buckets).
void report_grad_overlap(const Trainer& tr, bool lead, bool quiet, int64_t step, MetricsWriter* metrics) {
  const parallel::GradBuckets* b = tr.grad_buckets();
  if (!b || !lead) return;
  const double share = b->elements() > 0 ? 100.0 * static_cast<double>(b->early_elements()) / b->elements() : 0;
  if (!quiet)
    std::printf("keel: DP gradient reduction at step %lld: %.1f%% of this rank's %lld gradient elements reduced during "
                "the backward, in %lld reductions (buckets of %lld elements)\n",
                static_cast<long long>(step), share, static_cast<long long>(b->elements()),
                static_cast<long long>(b->reductions()), static_cast<long long>(b->bucket()));
  if (metrics)
    metrics->write({{"event", "grad_overlap"}, {"step", step}, {"early_elements", b->early_elements()},
                    {"elements", b->elements()}, {"reductions", b->reductions()}, {"bucket", b->bucket()}});
  std::fflush(stdout);
}

// parallel.overlap_param_gather: how much of the DP weight gather that completed during this
// step's forward (the last update's) moved ahead of its need, while the forward computed an
// earlier group (rank 0's; every DP rank of a stage starts the same buckets).
void report_param_gather(const Trainer& tr, bool lead, bool quiet, int64_t step, MetricsWriter* metrics) {
  const parallel::ParamGather* g = tr.param_gather();
  if (!g || !lead) return;
  const int64_t n = g->elements(), ahead = g->overlapped_elements();
  const auto buckets = static_cast<int64_t>(g->bucket_ends().size());
  if (!quiet)
    std::printf("keel: DP weight gather for step %lld: %.1f%% of this rank's %lld weight elements moved while the "
                "forward computed, in %lld bucket%s (of %lld elements at least) and %lld broadcasts\n",
                static_cast<long long>(step), n > 0 ? 100.0 * static_cast<double>(ahead) / n : 0.0,
                static_cast<long long>(n), static_cast<long long>(buckets), buckets == 1 ? "" : "s",
                static_cast<long long>(g->bucket()), static_cast<long long>(g->broadcasts()));
  if (metrics)
    metrics->write({{"event", "param_gather"}, {"step", step}, {"overlapped_elements", ahead}, {"elements", n},
                    {"buckets", buckets}, {"broadcasts", g->broadcasts()}, {"bucket", g->bucket()}});
  std::fflush(stdout);
}

// Everything ranks must agree on (stop at this step boundary, a save succeeded, time the next
// step, a background save still being written) goes through the world communicator: int flags
// reduced with Max, so any rank's "yes" wins. The flags' device buffer is allocated once: the
// stop check runs every step.
class AnyRank {
 public:
  static constexpr size_t kFlags = 3;
  AnyRank(parallel::Comm& world, Backend& be) : world_(world), be_(be) {
    flag_ = Tensor(be.allocate(kFlags * sizeof(int32_t)), DType::I32, {int64_t{kFlags}}, be.device());
  }
  ~AnyRank() { be_.release(flag_.data); }
  AnyRank(const AnyRank&) = delete;
  AnyRank& operator=(const AnyRank&) = delete;
  bool operator()(bool mine) { return (*this)({mine, false, false})[0]; }
  // Several questions in one all-reduce: is each true on any rank?
  std::array<bool, kFlags> operator()(std::array<bool, kFlags> mine) {
    std::array<int32_t, kFlags> v{};
    for (size_t i = 0; i < kFlags; ++i) v[i] = mine[i] ? 1 : 0;
    v = max(v);
    std::array<bool, kFlags> any{};
    for (size_t i = 0; i < kFlags; ++i) any[i] = v[i] != 0;
    return any;
  }
  // The largest of each value over the ranks.
  std::array<int32_t, kFlags> max(std::array<int32_t, kFlags> v) {
    if (world_.size() == 1) return v;
    be_.copy_from_host(flag_, v.data());
    world_.all_reduce(flag_, parallel::ReduceOp::Max);
    be_.copy_to_host(v.data(), flag_);
    return v;
  }

 private:
  parallel::Comm& world_;
  Backend& be_;
  Tensor flag_;
};

}  // namespace

std::vector<std::string> config_notes(const RunConfig& cfg) {
  std::vector<std::string> notes;
  const auto& p = cfg.parallel;
  if (cfg.precision.mode != PrecisionMode::FP16 && !(cfg.precision.loss_scale == LossScaleConfig{}))
    notes.push_back("precision.loss_scale is set, but loss scaling is for precision.mode fp16 only: this " +
                    precision_name(cfg.precision.mode) + " run ignores it");
  if (p.sequence_parallel && p.tp == 1)
    notes.push_back("parallel.sequence_parallel is set, but it splits activations over tensor-parallel ranks and "
                    "parallel.tp is 1: it changes nothing here");
  if (p.embedding_slot && p.pp == 1)
    notes.push_back("parallel.embedding_slot is set, but it places the embedding and head among pipeline stages and "
                    "parallel.pp is 1: it changes nothing here");
  if (cfg.train.recompute == "full" && cfg.train.recompute_layers > 0) {
    const int64_t per_stage = (cfg.model.n_layers + p.pp * p.virtual_stages - 1) / (p.pp * p.virtual_stages);
    if (cfg.train.recompute_layers > per_stage)
      notes.push_back("train.recompute_layers is " + std::to_string(cfg.train.recompute_layers) +
                      ", more than the at most " + std::to_string(per_stage) +
                      " layers a pipeline stage holds: every layer is recomputed (as train.recompute_layers 0)");
  }
  const ScheduleConfig& sc = cfg.schedule;
  const int64_t steps = cfg.train.steps;
  char lr[32], peak[32];
  std::snprintf(lr, sizeof lr, "%.6g", learning_rate(cfg, steps));
  std::snprintf(peak, sizeof peak, "%.6g", cfg.optimizer.lr);
  if (sc.warmup_steps > steps)
    notes.push_back("schedule.warmup_steps " + std::to_string(sc.warmup_steps) + " is more than train.steps " +
                    std::to_string(steps) + ": the run ends inside the warmup, at learning rate " + lr +
                    " of optimizer.lr's " + peak);
  else if (sc.decay != DecayStyle::Constant && sc.decay_steps > 0 && sc.warmup_steps + sc.decay_steps > steps)
    notes.push_back("schedule.decay_steps " + std::to_string(sc.decay_steps) + " reach past train.steps " +
                    std::to_string(steps) + " (after the warmup of " + std::to_string(sc.warmup_steps) +
                    "): the run ends before the decay does, at learning rate " + lr);
  if (sc.decay == DecayStyle::WSD && sc.wsd_decay_steps > 0) {
    const int64_t window = sc.decay_steps > 0 ? sc.decay_steps : std::max<int64_t>(1, steps - sc.warmup_steps);
    if (sc.wsd_decay_steps > window)
      notes.push_back("schedule.wsd_decay_steps " + std::to_string(sc.wsd_decay_steps) +
                      " is longer than the decay window of " + std::to_string(window) +
                      " steps: the cooldown takes the whole window (no stable phase)");
  }
  return notes;
}


namespace {
const parallel::MpiRuntime* g_runtime = nullptr;

// An exclusive lock on <out>/.lock, held by rank 0 until the process ends (the kernel drops it
// then, even after kill -9): two runs in one directory would overwrite each other's checkpoints
// and interleave their metrics. The file records the holder's host and pid for the refusal.
struct RunDirLock {
  int fd = -1;
  RunDirLock() = default;
  RunDirLock(const RunDirLock&) = delete;
  RunDirLock& operator=(const RunDirLock&) = delete;
  ~RunDirLock() {
    if (fd >= 0) ::close(fd);
  }
};

// Takes the lock on <dir>/.lock or throws ConfigError naming the holder; returns a note when
// the filesystem cannot lock (the run goes on unguarded). `what` names the directory in
// messages ("the run directory X"), `option` the setting that picks another one ("--out").
// With `existing_only` (before the checkpoint is read, when nothing may be written yet) it
// creates nothing and only refuses a held lock: any other failure is left to the call that
// creates the file. A lock already taken is kept.
std::string lock_directory(const std::string& dir, const std::string& what, const std::string& option,
                           RunDirLock& lock, bool existing_only = false) {
  if (lock.fd >= 0) return {};
  const std::string path = (fs::path(dir) / ".lock").string();
  const int fd = ::open(path.c_str(), O_RDWR | O_CLOEXEC | (existing_only ? 0 : O_CREAT), 0644);
  if (fd < 0 && existing_only) return {};
  if (fd < 0) throw ConfigError("cannot create " + path + ": " + std::strerror(errno) + " (" + what + " must be writable)");
  if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    if (err == EWOULDBLOCK) {
      std::string text(512, '\0');
      const ssize_t n = ::pread(fd, text.data(), text.size(), 0);
      text.resize(n > 0 ? static_cast<size_t>(n) : 0);
      ::close(fd);
      std::string holder = "another process (" + path + " does not say which)";
      try {
        const nlohmann::json j = nlohmann::json::parse(text);
        holder = "keel pid " + std::to_string(j.at("pid").get<int64_t>()) + " on " + j.at("host").get<std::string>() +
                 (j.contains("started") ? " (started " + j["started"].get<std::string>() + ")" : "");
      } catch (const std::exception&) {
      }
      throw ConfigError("another run is using " + what + ": " + holder + " holds " + path +
                        ". Two runs in one directory would overwrite each other's checkpoints and metrics: wait for "
                        "it to end (or stop it), or give this run another " + option);
    }
    ::close(fd);
    if (existing_only) return {};
    if (err == ENOLCK || err == EOPNOTSUPP || err == ENOSYS)
      return "the filesystem of " + dir + " does not support file locks (" + std::strerror(err) +
             "): nothing stops a second run from using " + what + " at the same time";
    throw ConfigError("cannot lock " + path + ": " + std::strerror(err));
  }
  std::time_t t = std::time(nullptr);
  char started[32];
  std::strftime(started, sizeof started, "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&t));
  const std::string record =
      nlohmann::json{{"host", data::detail::this_host()}, {"pid", static_cast<int64_t>(::getpid())}, {"started", started}}
          .dump() + "\n";
  // Best effort: the lock itself is what guards the directory.
  if (::ftruncate(fd, 0) == 0) {
    [[maybe_unused]] const ssize_t written = ::pwrite(fd, record.data(), record.size(), 0);
  }
  lock.fd = fd;
  return {};
}
}  // namespace

// --time-limit counts from here (static initialisation, before main): start-up (data checks, a
// checkpoint load and its verification) spends the job's time too.
const auto g_process_start = std::chrono::steady_clock::now();

bool time_limit_near(double elapsed_s, double step_s, double save_s, double limit_s) {
  return elapsed_s + step_s + std::max(step_s, save_s) >= limit_s;
}

std::string low_space_warning(const std::string& dir, int64_t save_bytes, int64_t free_bytes, AfterSave after) {
  if (free_bytes >= save_bytes || after == AfterSave::End) return {};
  const bool resumed = after == AfterSave::Stop;
  char buf[160];
  if (after == AfterSave::Resumed) {
    std::snprintf(buf, sizeof buf, "%.1f MB free, and a save needs about %.1f MB", free_bytes / 1e6, save_bytes / 1e6);
    return "WARNING this run's first checkpoint save will not fit: " + dir + " has " + buf +
           " (the size of the checkpoint resumed from; keep_last removes old checkpoints only once a new one is "
           "complete). Free some space there, or the steps up to the first save are trained for nothing";
  }
  std::snprintf(buf, sizeof buf, "%.1f MB free, and the next save needs about %.1f MB", free_bytes / 1e6,
                save_bytes / 1e6);
  return std::string("WARNING ") + (resumed ? "a resumed run's first" : "the next") + " checkpoint save will not fit: " +
         dir + " has " + buf + " (keep_last removes old checkpoints only once a new one is complete). Free some " +
         "space there before " + (resumed ? "resuming" : "it") +
         ", or the steps since the last save are trained for nothing";
}

void set_process_runtime(const parallel::MpiRuntime* runtime) { g_runtime = runtime; }
const parallel::MpiRuntime* process_runtime() { return g_runtime; }

namespace {
bool g_handlers_installed = false;
}  // namespace

void install_stop_handlers() {
  // The launcher's rank before MPI says it: Open MPI, MPICH / Intel MPI (PMI), SLURM.
  for (const char* var : {"OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID"})
    if (const char* r = std::getenv(var)) {
      g_announce_signal = std::string(r) == "0";
      break;
    }
  g_fallback_line[g_fallback_index][0] = '\0';  // no second line until the run knows its checkpoint
  std::signal(SIGTERM, on_stop_signal);
  std::signal(SIGUSR1, on_stop_signal);
  std::signal(SIGINT, on_stop_signal);
  g_handlers_installed = true;
}

int run_training(const RunConfig& config, const RunOptions& opts) {
  // From the start: a signal during start-up (a checkpoint load takes minutes on a large model)
  // stops the run at its first step boundary with a save and exit 4, so a requeue script sees
  // the usual stop instead of a process killed by SIGTERM or SIGUSR1. keel's main installs the
  // handlers before MPI starts (install_stop_handlers), and a signal since then is kept.
  // Installed again all the same: MPI's start-up may have put handlers of its own in their place.
  if (!g_handlers_installed) g_stop_signal = 0;
  install_stop_handlers();
  g_announce_signal = !opts.mpi || opts.mpi->world_rank() == 0;
  RunConfig cfg = with_eod_token(config);  // changed once below: --init-from is recorded as train.init_from
  const std::vector<std::string> packed = check_packed_data(cfg);
  check_document_ends(cfg);
  // ---- the grid: world size and rank from the launcher (mpirun/srun), or a world of one ----
  const int world_size = opts.mpi ? opts.mpi->world_size() : 1;
  const int world_rank = opts.mpi ? opts.mpi->world_rank() : 0;
  check_ranks_agree(cfg, opts);
  if (cfg.parallel.world() != world_size) {
    const int64_t tp_pp = cfg.parallel.tp * cfg.parallel.pp;
    // The dp these ranks would take, if the batch divides over it (global_batch a multiple of
    // micro_batch x dp); else what it would need as well.
    std::string other;
    if (world_size % tp_pp != 0) {
      other = "launch a multiple of tp*pp = " + std::to_string(tp_pp) + " processes";
    } else {
      const int64_t dp = world_size / tp_pp;
      other = "change parallel.dp to " + std::to_string(dp);
      if (cfg.train.global_batch % (cfg.train.micro_batch * dp) != 0)
        other += " with a train.global_batch that is a multiple of train.micro_batch x dp = " +
                 std::to_string(cfg.train.micro_batch * dp) + " (it is " + std::to_string(cfg.train.global_batch) + ")";
    }
    throw ConfigError("parallel: tp*pp*dp = " + std::to_string(cfg.parallel.tp) + "*" + std::to_string(cfg.parallel.pp) +
                      "*" + std::to_string(cfg.parallel.dp) + " = " + std::to_string(cfg.parallel.world()) +
                      " ranks, but " + std::to_string(world_size) + (world_size == 1 ? " process was" : " processes were") +
                      " launched: start it with `mpirun -np " + std::to_string(cfg.parallel.world()) +
                      " keel train ...` (or srun -n), or " + other);
  }
  const parallel::Grid grid(world_size, world_rank, static_cast<int>(cfg.parallel.tp), static_cast<int>(cfg.parallel.pp),
                            static_cast<int>(cfg.parallel.dp));
  // Where every rank's communication record goes if a collective hangs (keel doctor hang).
  parallel::set_hang_dump_directory((fs::path(cfg.out) / "hang").string());
  const parallel::LaunchInfo launch = opts.mpi ? opts.mpi->launch() : parallel::LaunchInfo{};
  auto backend = select_backend(cfg, launch);
  // Host communicators (MPI, or LocalComms for one process) carry CPU runs and bootstrap NCCL.
  parallel::CommGroups host_comms =
      opts.mpi ? parallel::make_host_comms(grid, *opts.mpi) : parallel::make_local_comms();
  parallel::CommGroups comms;
  // Waits on the GPU keep answering the hang watchdog while NCCL operations are in flight.
  struct WaitHookScope {
    bool set = false;
    ~WaitHookScope() {
      if (set) set_device_wait_hook(nullptr);
    }
  } wait_hook;
  if (backend->device() == Device::CUDA) {
#ifdef KEEL_HAVE_CUDA
    CUstream_st* stream = cuda_stream_of(*backend);  // NCCL ordered with the kernels
    if (world_size > 1) {
      if (!parallel::nccl_built())
        throw ConfigError("a multi-GPU run needs NCCL: rebuild with NCCL (NCCL_HOME), or use device \"cpu\"");
      comms = parallel::make_nccl_comms(host_comms, stream);
      // Also aborts the NCCL communicators at once on a timeout or an NCCL error.
      set_device_wait_hook(&parallel::poll_nccl_async_ops);
      wait_hook.set = true;
    } else {
      comms = parallel::make_local_comms(Device::CUDA, stream);
    }
#endif
  } else {
    comms = std::move(host_comms);
  }
  const bool lead = world_rank == 0;  // the rank that prints and writes metrics
  const bool quiet = opts.quiet || !lead;
  // What fixes the bits of this run's numbers (checkpoints record it; restart verification
  // demands equal bits only when it and the layout match): the backend's, and NCCL's version when
  // NCCL does the reductions.
  std::string arithmetic = backend->arithmetic();
  if (backend->device() == Device::CUDA && world_size > 1) arithmetic += " nccl " + parallel::nccl_version();
  // GPT-2 under selective recomputation runs its GELU after the matmul, not in cuBLASLt's
  // epilogue (model/transformer.h): other bits than a run that keeps the activation.
  if (backend->device() == Device::CUDA && cfg.model.is_gpt2() && cfg.train.selective_recompute())
    arithmetic += " (gelu unfused: selective recompute)";

  // ---- everything that can fail on user input is checked before the run directory is touched ----
  // A run directory or checkpoint.dir that is a checkpoint (keel convert's output, a step_*): the
  // run would replace its config.json and save step_* beside its meta.json, after which that
  // folder names the wrong weights. (--eval-only writes nothing.)
  if (!opts.eval_only)
    for (const auto& [field, dir] : {std::pair<std::string, std::string>{"out (--out)", cfg.out},
                                     {"checkpoint.dir", cfg.checkpoint.dir}})
      if (is_keel_checkpoint(dir)) {
        const std::string name = fs::path(dir).filename().empty() ? fs::path(dir).parent_path().string() : dir;
        throw ConfigError(field + ": " + name + " is a keel checkpoint (it holds a keel meta.json): a run there would "
                          "replace its files and save its own checkpoints beside its weights, after which keel sample, "
                          "eval and --init-from on that folder would load the wrong weights. Nothing was written; " +
                          (field == "checkpoint.dir" ? "give checkpoint.dir a folder of its own, or leave it out (" +
                                                           cfg.out + "/checkpoints)"
                                                     : "give the run a folder of its own, e.g. --out " + name + "-run"));
      }
  const int T = static_cast<int>(cfg.train.seq_len);
  data::Sampler train = open_train_data(cfg);  // a resume below may restore its blend's history
  // What the sample order follows: compared with a resumed checkpoint's, recorded in every save.
  // Only world rank 0 writes meta.json and compares, so only it reads the fingerprints.
  const nlohmann::json train_files = training_files(train, lead);
  // Token ids beyond the vocabulary (data tokenized for another model) fail here for datasets
  // up to 4G tokens (a scan at memory speed); bigger ones are checked batch by batch.
  constexpr int64_t kVocabScanLimit = int64_t{1} << 32;
  for (size_t k = 0; k < train.num_sources(); ++k) train.source(k).check_vocab(kVocabScanLimit);
  const std::vector<ValidationSet> vals = open_validation_data(cfg, kVocabScanLimit);
  check_ranks_read_same_files(train, vals, opts);
  const ChoiceEvalSet choices = open_choice_eval(cfg);
  const TrainingSampler sampler(cfg);
  if (opts.eval_only && (vals.empty() || cfg.train.eval_batches == 0) && choices.items.empty() && !sampler.on())
    throw ConfigError("--eval-only: nothing to evaluate: set data.val or data.val_sets (with train.eval_batches > 0), "
                      "choice_eval.file or sample.interval");
  if (backend->device() == Device::CPU && !opts.eval_only) {
    const HostMemory mem = host_memory();
    const std::string host = data::detail::this_host();
    // Ranks on one host under one limit (its MemAvailable, a job's cgroup) share it; a Slurm
    // per-task cgroup is each rank's own. Which is which: the ranks' hosts and cgroup paths.
    std::vector<int> sharing;
    if (world_size > 1)
      sharing = ranks_sharing(mem, host, parallel::gather_text(*comms.world, *backend, memory_limit_ids(mem, host)));
    std::string verdict;  // this rank's refusal or warning
    bool refused = false;
    try {
      verdict = check_host_memory(cfg, mem, sharing);
    } catch (const ConfigError& e) {
      verdict = e.what();
      refused = true;
    }
    // The ranks agree: all refuse when one does, and rank 0 prints the first refusing (else
    // warning) rank's message, once.
    if (world_size > 1) {
      const std::vector<std::string> kinds =
          parallel::gather_text(*comms.world, *backend, refused ? "refused" : verdict.empty() ? "" : "warned");
      auto first_of = [&](const char* kind) { return int(std::find(kinds.begin(), kinds.end(), kind) - kinds.begin()); };
      const int first = first_of("refused") < world_size ? first_of("refused") : first_of("warned");
      if (first < world_size) {
        if (world_rank == first && first != 0) verdict = "world rank " + std::to_string(first) + " on " + host + ": " + verdict;
        std::string theirs;  // rank 0 receives the first rank's text when it is not its own
        opts.mpi->first_rank_differing(world_rank == first ? verdict : "", &theirs);
        if (lead && first != 0) verdict = theirs;
        refused = kinds[first] == "refused";
        if (refused && !lead && world_rank != first)
          verdict = "world rank " + std::to_string(first) + " refuses to start for lack of host memory (rank 0 says why)";
      }
    }
    if (refused) throw ConfigError(verdict);
    if (lead && !verdict.empty()) {
      std::printf("keel: WARNING host memory: %s\n", verdict.c_str());
      std::fflush(stdout);  // before the OOM killer can end the process without a word
    }
  }
  Trainer tr(cfg, *backend, &grid, &comms, /*forward_only=*/opts.eval_only);
  RankPlace place;
  place.tp_rank = grid.tp_rank();
  place.pp_rank = grid.pp_rank();
  place.dp_rank = grid.dp_rank();
  place.world_rank = world_rank;
  place.writes_weights = grid.dp_rank() == 0;
  parallel::Comm& world = *comms.world;
  AnyRank any_rank(world, *backend);
  const AgreeFn all_ok = [&](bool ok) { return !any_rank(!ok); };

  // Weight decay follows the role; audit it anyway (a misfiled norm was a BLOOM restart spike).
  if (auto problems = audit_param_groups(ParamTable(cfg.model).params()); !problems.empty()) {
    std::string msg = "parameter-group audit failed:";
    for (const auto& p : problems) msg += "\n  " + p;
    if (cfg.health.param_group_audit == "error") throw ConfigError(msg);
    if (lead) std::printf("keel: WARNING %s\n", msg.c_str());
  }
  // A run going on in these directories holds their locks (taken below, once the run directory
  // may be written): a second one is refused now, before it reads the checkpoints the first is
  // publishing and rotating, which would fail it as damaged ("... is missing") or resume it from
  // a save about to be removed.
  RunDirLock run_lock, checkpoints_lock;  // held until the run ends
  if (lead && !opts.eval_only) {
    lock_directory(cfg.out, "the run directory " + cfg.out, "--out", run_lock, /*existing_only=*/true);
    lock_directory(cfg.checkpoint.dir, "the checkpoint directory " + cfg.checkpoint.dir + " (checkpoint.dir)",
                   "checkpoint.dir", checkpoints_lock, /*existing_only=*/true);
  }

  // Resume if a checkpoint exists (explicit --resume, or the latest in the checkpoint
  // directory); else --init-from weights; else a fresh init. All reads, no writes yet.
  TrainProgress progress;
  std::vector<std::string> notes;
  for (std::string& n : config_notes(cfg)) notes.push_back(std::move(n));
  // A Hugging Face model is weights only: say what to do instead of "no checkpoint at hf:...".
  if (hf_path(opts.resume))
    throw CheckpointError("--resume " + opts.resume + ": a Hugging Face model cannot be resumed: it holds weights only, "
                          "no optimizer state.\nA resume needs the fp32 master weights and both Adam moments of every "
                          "tensor. To start a new run from\nthis model's weights (fresh optimizer, step 0), use "
                          "--init-from " + opts.resume);
  std::string resume_path = opts.resume;
  if (resume_path.empty()) {
    std::string note;
    if (auto latest = Checkpoint::find_latest(cfg.checkpoint.dir, &note)) resume_path = *latest;
    if (!note.empty()) notes.push_back(note);
  }
  set_fallback_checkpoint(resume_path);
  // Where to turn instead of a refused checkpoint: the run's other checkpoints, when it is among them.
  auto in_run_dir = [&](const std::string& path) {
    std::error_code ec;
    return fs::equivalent(fs::path(path).parent_path(), cfg.checkpoint.dir, ec);
  };
  // Every rank loads the save rank 0 opened: a pointer into a run that is still saving (its
  // checkpoints given to --init-from or --resume) could lead a rank that follows it later to a
  // newer save, and the ranks would assemble a model from two.
  auto open_as_rank0 = [&](const std::string& path) {
    if (world_size == 1) return Checkpoint::open(path);
    std::optional<Checkpoint> ck;
    std::string opened, error;
    if (lead) {
      try {
        ck = Checkpoint::open(path);
        opened = ck->path();
      } catch (const CheckpointError& e) {
        error = e.what();
      }
    }
    opts.mpi->broadcast_text(&opened);
    if (lead && !error.empty()) throw CheckpointError(error);
    if (lead) return std::move(*ck);
    if (opened.empty()) throw CheckpointError("no checkpoint could be opened at " + path + " (world rank 0 says why)");
    return Checkpoint::open(opened);
  };
  auto open_verified = [&](const std::string& path, const std::string& what, const std::string& flag) {
    std::optional<Checkpoint> opened;
    std::string open_error;  // a file missing or truncated, a damaged meta.json
    try {
      opened = open_as_rank0(path);
    } catch (const CheckpointError& e) {
      open_error = e.what();
    }
    // Agreed, so that every rank leaves here the same way (a rewind goes on after a refusal).
    if (!all_ok(open_error.empty())) {
      if (open_error.empty()) open_error = "checkpoint " + path + " could not be opened on another rank (it says why)";
      if (!in_run_dir(path)) throw CheckpointError(open_error);
      throw CheckpointError(open_error + other_checkpoints_hint(cfg.checkpoint.dir, fs::path(path).filename(), flag));
    }
    Checkpoint& ck = *opened;
    // One rank reads every checksum; the others wait for its verdict.
    CheckpointProblems problems;
    if (lead) problems = ck.verify();
    if (!all_ok(problems.empty())) {
      std::string msg = problems.empty() ? "refusing to " + what + " checkpoint " + ck.path() +
                                               ", which fails verification (see rank 0's message)"
                                         : problems.refusal(what, ck.path());
      if (in_run_dir(ck.path()))
        msg += other_checkpoints_hint(cfg.checkpoint.dir, fs::path(ck.path()).filename(), flag);
      else
        msg += "\nNothing was changed; pass another checkpoint with " + flag + ".";
      throw CheckpointError(msg);
    }
    return std::move(*opened);
  };
  // A load under another vocabulary padding (parallel.tp, model.pad_vocab_to_multiple_of): said,
  // and the saved per-tensor norms the restart verification compares lose the padding rows the
  // load dropped (zero since keel initialises padding rows to zero; not in older checkpoints).
  auto note_repadding = [&](const Checkpoint& ck, nlohmann::json& health) {
    const auto repadded = repadded_tensors(ck, tr.table());
    if (repadded.empty()) return;
    const DroppedPadding& any = repadded.begin()->second;
    std::string names, dropped;
    for (const auto& [name, d] : repadded) {
      names += (names.empty() ? "" : " and ") + name;
      if (d.weight_sumsq > 0 || d.master_sumsq > 0) dropped += (dropped.empty() ? "" : ", ") + name;
      if (health.is_object() && health.contains("tensor_sumsq") && health["tensor_sumsq"].contains(name)) {
        nlohmann::json& t = health["tensor_sumsq"][name];
        if (t[0].is_number()) t[0] = t[0].get<double>() - d.weight_sumsq;  // null: not finite when saved
        if (t[1].is_number()) t[1] = t[1].get<double>() - d.master_sumsq;
      }
    }
    std::string text = "the checkpoint pads the vocabulary to " + std::to_string(any.rows_saved) + " rows, this run to " +
                       std::to_string(any.rows_now) + " (model.vocab_size " + std::to_string(cfg.model.vocab_size) +
                       ", model.pad_vocab_to_multiple_of " + std::to_string(cfg.model.pad_vocab_multiple) +
                       " x parallel.tp " + std::to_string(cfg.parallel.tp) + "): " + names + (repadded.size() == 1 ? " loaded with its " : " loaded with their ") +
                       std::to_string(cfg.model.vocab_size) + " real rows in every state, the padding rows zero";
    if (!dropped.empty())
      text += "; the checkpoint's padding rows of " + dropped +
              " were not zero (saved by a keel from before padding rows started at zero): dropped, which "
              "changes no loss or gradient";
    notes.push_back(text);
  };
  // The weights a fresh run starts from: --init-from, else the config's train.init_from. A path
  // that is not there is the config's mistake (a relative one is read from the config's folder).
  const std::string init_from = !opts.init_from.empty() ? opts.init_from : cfg.train.init_from;
  const std::string init_flag = !opts.init_from.empty() ? "--init-from" : "train.init_from";
  if (resume_path.empty() && init_flag == "train.init_from" && !init_from.empty() &&
      !fs::exists(hf_path(init_from).value_or(init_from)))
    throw ConfigError("train.init_from: " + init_from + " does not exist (a relative train.init_from is read from the "
                      "folder of the config file that names it). Point it at the checkpoint or hf:DIR to start from, "
                      "or remove the field to start from a random initialisation");
  // A fresh run's --init-from is recorded as train.init_from (absolute) in config.json and every
  // save's config: `keel train --config <out>/config.json` run again before the first save (a
  // preemption) starts from the same weights, not from a random initialisation.
  if (resume_path.empty() && !opts.init_from.empty()) {
    const auto hf_dir = hf_path(opts.init_from);
    const std::string path = fs::absolute(hf_dir.value_or(opts.init_from)).lexically_normal().string();
    cfg.train.init_from = hf_dir ? "hf:" + path : path;
  }
  nlohmann::json loaded_health, loaded_topology;
  nlohmann::json loaded_source;  // the HF model and checkpoints the weights came from, carried into every save
  std::string loaded_from, loaded_precision;
  int64_t resumed_bytes = 0;  // the resumed checkpoint's files: about what this run's saves take
  // What a save takes before this process has timed one (--time-limit): the resumed checkpoint's
  // own save, else how long loading it took; 0 (unknown) on a fresh run.
  double resumed_save_seconds = 0;
  std::string save_estimate = "none timed yet";
  std::string function_changes;  // the model fields of a weights-only load that change what the weights compute
  bool loaded_stochastic = false;  // were the loaded working weights written by stochastic rounding?
  if (!resume_path.empty()) {
    const auto load_start = std::chrono::steady_clock::now();
    Checkpoint ck = open_verified(resume_path, "resume from", "--resume");
    progress = restore_for_resume(ck, cfg, tr.table(), tr.state(), *backend, tr.scaler(), place, &notes);
    if (const auto saved = ck.meta().find("save_seconds"); saved != ck.meta().end() && saved->is_number()) {
      resumed_save_seconds = saved->get<double>();
      save_estimate = "the resumed checkpoint's save";
    } else {
      resumed_save_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - load_start).count();
      save_estimate = "as long as loading the resumed checkpoint took";
    }
    loaded_health = ck.meta().value("health", nlohmann::json());
    note_repadding(ck, loaded_health);
    restore_spike_detector(tr, loaded_health, false);
    loaded_topology = ck.meta().value("topology", nlohmann::json());
    loaded_from = ck.path();
    for (const auto& [_, info] : ck.meta().at("files").items())
      resumed_bytes += info.value("bytes", int64_t{0});
    loaded_source = ck.meta().value("source", nlohmann::json());
    loaded_precision = ck.precision();
    loaded_stochastic = ck.meta().at("config").at("precision").value("stochastic_rounding", false);
    const nlohmann::json saved_files =
        ck.meta().value("data", nlohmann::json::object()).value("files", nlohmann::json());
    // Every rank restores the same history: from the checkpoint, the config and rank 0's word on
    // whether the sources are the checkpoint's.
    const auto from_rank0 = [&](std::string* text) {
      if (world_size > 1) opts.mpi->broadcast_text(text);
    };
    if (std::string note = resume_blend(train, ck.meta(), cfg, train_files, progress.consumed_samples, lead, from_rank0);
        !note.empty() && !opts.eval_only)
      notes.push_back(note);
    if (const auto changes = training_file_changes(saved_files, train_files);
        !changes.empty() && !opts.eval_only && training_files_moved(saved_files, train_files)) {
      size_t n = 0;
      for (const auto& source : train_files) n += source.size();
      notes.push_back("data.train's files moved since the checkpoint: the same " + std::to_string(n) +
                      " file(s) at other paths, with the same tokens and content fingerprints in the same order, so "
                      "the sample order continues exactly");
    } else if (!changes.empty() && !opts.eval_only) {
      // Under the same patterns the files changed beneath them; with new ones (listed with the
      // settings changed above) the files are what the new data.train resolves to.
      const nlohmann::json saved_train =
          ck.meta().value("config", nlohmann::json::object()).value("data", nlohmann::json::object()).value("train", nlohmann::json());
      std::string text = saved_train == nlohmann::json(cfg.data.train)
                             ? "WARNING the training data changed since the checkpoint, under the same data.train:"
                             : "WARNING the training data changed since the checkpoint: data.train is not the "
                               "checkpoint's (above), and the files it resolves to differ:";
      for (size_t k = 0; k < changes.size() && k < 10; ++k) text += "\n    " + changes[k];
      if (changes.size() > 10) text += "\n    ... and " + std::to_string(changes.size() - 10) + " more";
      text += "\n  The sample order follows the windows of these files: from sample " +
              std::to_string(progress.consumed_samples) +
              " on, this run reads another order than the saved run would have, so samples of the current epoch may "
              "repeat or be skipped. Resume with the checkpoint's files to continue its order exactly.";
      notes.push_back(text);
    }
    notes.insert(notes.begin(), (opts.eval_only ? "loaded " : "resuming from ") + ck.path() + " at iteration " +
                                    std::to_string(progress.iteration) +
                                    ", " + std::to_string(progress.consumed_samples) + " samples consumed, Adam step " +
                                    std::to_string(tr.state().adam_step) + " (saved under " +
                                    saved_layout_text(ck.meta()) + ")");
    // The config's train.init_from is expected here (every requeue of a finetune resumes); the
    // flag given by hand over an earlier run's checkpoints more likely meant a new finetune.
    if (!init_from.empty() && init_flag == "--init-from" && opts.resume.empty())
      notes.push_back("WARNING --init-from " + init_from + " is ignored: " + cfg.checkpoint.dir +
                      " already holds a run's checkpoints, and this run resumes it. To start a new run from " +
                      init_from + ", give it another --out");
    else if (!init_from.empty())
      notes.push_back(init_flag + " " + init_from + " is ignored: it only initialises a fresh run, and this run resumes");
    // Found in checkpoint.dir, saved by a run with another --out: a shared checkpoint folder
    // (one --out per job) is fine, a copied config whose checkpoint.dir names another run's is
    // not; either way this run now saves and rotates there, so say whose checkpoints they were.
    const std::string saved_out = ck.meta().at("config").value("out", std::string());
    std::error_code same_ec;
    if (opts.resume.empty() && !saved_out.empty() && !would_replace(cfg.out, cfg.checkpoint.dir) &&
        !fs::equivalent(saved_out, cfg.out, same_ec))
      notes.push_back("checkpoint.dir " + cfg.checkpoint.dir + " holds the checkpoints of the run with --out " +
                      saved_out + " (this run's is " + cfg.out + "): this run continues them, and its saves and " +
                      "rotation (checkpoint.keep_last " + std::to_string(cfg.checkpoint.keep_last) +
                      ") go there too. To start a run of its own, give it another checkpoint.dir");
  } else if (auto hf_dir = hf_path(init_from)) {
    // A Hugging Face model directory (hf:DIR), converted on the fly.
    notes.push_back(init_weights_from_hf(*hf_dir, tr.table(), tr.state(), &loaded_source));
    if (std::string w = tokenizer_mismatch_warning({fs::path(*hf_dir)}, cfg); !w.empty()) notes.push_back(w);
    loaded_from = init_from;
  } else if (!init_from.empty()) {
    // A config's train.init_from that exists but holds no checkpoint: "." in a config copied
    // away from the converted weights it sat beside (keel convert writes "."), read from its folder.
    if (init_flag == "train.init_from" && fs::is_directory(init_from) && !fs::exists(fs::path(init_from) / "meta.json") &&
        !fs::exists(fs::path(init_from) / "latest") && !fs::exists(fs::path(init_from) / "checkpoints") &&
        std::none_of(fs::directory_iterator(init_from), fs::directory_iterator(),
                     [](const fs::directory_entry& e) { return e.path().filename().string().starts_with("step_"); }))
      throw ConfigError("train.init_from: " + init_from + " holds no keel checkpoint (a relative train.init_from is "
                        "read from the folder of the config file that names it: keel convert writes \".\", the "
                        "weights beside it, so a copy of that config.json elsewhere points at the copy's folder). "
                        "Point it at the converted checkpoint or hf:DIR to start from (--set train.init_from=PATH, "
                        "or --init-from PATH), or remove the field to start from a random initialisation");
    Checkpoint ck = open_verified(init_from, "initialise from", init_flag);
    std::vector<std::string> model_changes;  // after the line that says what was loaded
    notes.push_back(init_weights_from(ck, tr.table(), tr.state(), *backend, place, &model_changes));
    notes.insert(notes.end(), model_changes.begin(), model_changes.end());
    for (const FieldChange& c : model_function_changes(ck, cfg.model))
      function_changes += (function_changes.empty() ? "" : ", ") + c.field;
    loaded_health = ck.meta().value("health", nlohmann::json());
    note_repadding(ck, loaded_health);
    loaded_topology = ck.meta().value("topology", nlohmann::json());
    loaded_from = ck.path();
    // The checkpoint itself joins the record: a converted one holds the tokenizer, chat template
    // and HF config that sample and export look for, also once the HF model has moved.
    loaded_source = source_with_init_from(ck.meta().value("source", nlohmann::json()), ck.path());
    loaded_precision = ck.precision();
    if (std::string w = tokenizer_mismatch_warning(checkpoint_assets(ck).tokenizer_dirs, cfg); !w.empty())
      notes.push_back(w);
  } else {
    tr.init_weights();
  }
  // The probe batch for restart verification: the first training samples, the same on every rank
  // (without document masking, so that its loss depends on the weights alone). Read once a
  // resume has restored the blend's history, whose first segment sample 0 belongs to: new
  // weights then measure the same probe.
  const MicroBatch probe = load_batches(train, 0, cfg.train.micro_batch, cfg.train.micro_batch, 1, 0, DataConfig{})[0];
  // Restart verification (seeds 000 and 001): the masters must round to the loaded weights,
  // and the probe batch's loss and the per-tensor norms must be what was saved.
  bool probe_compared = false;
  if (!loaded_from.empty() && cfg.health.verify_restart) {
    std::vector<std::string> problems = tr.check_master_consistency(loaded_stochastic);
    if (!problems.empty())
      problems.insert(problems.begin(),
                      "the fp32 master weights did not come from the loaded weights; the first update would replace "
                      "the loaded model with the masters' values (a loss jump the run never recovers from):");
    if (!loaded_health.is_null()) {
      const bool same_topology = loaded_topology.value("tp", 0) == cfg.parallel.tp &&
                                 loaded_topology.value("pp", 0) == cfg.parallel.pp &&
                                 loaded_topology.value("dp", 0) == cfg.parallel.dp;
      const bool resumed = !resume_path.empty();  // else a weights-only load: masters rebuilt, not restored
      // Checkpoints from before the field existed were made on the CPU (no GPU had run keel).
      const std::string saved_arithmetic = loaded_health.value("arithmetic", std::string("cpu"));
      // Checkpoints from before the build was recorded: another build.
      const std::string saved_build = loaded_health.value("build", std::string("unrecorded"));
      const bool same_build = saved_build == build_id() && build_id() != kUnknownBuild;
      const bool same_precision = loaded_precision.empty() || loaded_precision == precision_name(cfg.precision.mode);
      const bool bitwise = same_topology && resumed && saved_arithmetic == arithmetic && same_build && same_precision;
      if (!same_precision)
        notes.push_back("the checkpoint was trained in " + loaded_precision + ", this run in " +
                        precision_name(cfg.precision.mode) +
                        ": its probe loss must agree within rounding, and the weights are compared in the copy "
                        "this run continues from");
      else if (same_topology && resumed && saved_arithmetic != arithmetic)
        notes.push_back("the checkpoint was computed by " + saved_arithmetic + ", this run by " + arithmetic +
                        ": its probe loss must agree within rounding, not bit for bit");
      else if (same_topology && resumed && !same_build)
        notes.push_back("the checkpoint was saved by another keel build (" + saved_build + ", this one " + build_id() +
                        "), whose kernels may round differently: its probe loss must agree within rounding, not bit "
                        "for bit");
      const HealthSnapshot now = tr.snapshot(probe);
      const bool same_probe = now.same_probe(loaded_health);
      probe_compared = same_probe && function_changes.empty();
      auto diffs = tr.compare_snapshot(loaded_health, now, bitwise, resumed, loaded_precision, probe_compared);
      problems.insert(problems.end(), diffs.begin(), diffs.end());
      if (const double was = HealthSnapshot::saved_probe_loss(loaded_health); probe_compared && !std::isfinite(was)) {
        char buf[160];
        std::snprintf(buf, sizeof buf, "%g when the checkpoint was saved, %.9g now", was, now.probe_loss);
        notes.push_back(std::string("the probe batch's loss was not finite when saved (its forward overflowed: these "
                                    "weights overflow in ") + loaded_precision + "): " + buf);
      }
      if (!same_probe)
        notes.push_back("the probe batch is not the one the checkpoint measured (other data, seq_len or micro_batch): "
                        "its loss is not compared, the per-tensor norms and the masters are");
      else if (!probe_compared)
        notes.push_back("this run's model computes another function of the weights than the checkpoint's (" +
                        function_changes + "): the probe batch's loss is not compared, the per-tensor norms and the "
                        "masters are");
    }
    if (!problems.empty()) {
      std::string msg = "restart verification failed for " + loaded_from + ":";
      for (size_t i = 0; i < problems.size() && i < 12; ++i) msg += "\n  " + problems[i];
      if (problems.size() > 12) msg += "\n  ... and " + std::to_string(problems.size() - 12) + " more";
      throw CheckpointError(msg + "\nNothing was trained; the checkpoint is untouched.");
    }
    notes.push_back("restart verification passed: masters consistent with the weights" +
                    std::string(loaded_health.is_null() ? ""
                                : probe_compared     ? ", probe loss and per-tensor norms as saved"
                                                     : ", per-tensor norms as saved"));
  }
  if (progress.iteration >= cfg.train.steps && !opts.eval_only) {
    if (lead) {
      for (const auto& n : notes) std::printf("keel: %s\n", n.c_str());  // what was loaded, what was ignored
      std::printf("keel: the checkpoint is at iteration %lld and train.steps is %lld: nothing to do\n",
                  static_cast<long long>(progress.iteration), static_cast<long long>(cfg.train.steps));
    }
    return kExitOk;
  }

  // A --stop-at the run has already passed would train one step and stop again, every time.
  if (opts.stop_at > 0 && opts.stop_at <= progress.iteration && !opts.eval_only)
    throw ConfigError("--stop-at " + std::to_string(opts.stop_at) + " is not after the checkpoint's iteration " +
                      std::to_string(progress.iteration) + " (" + loaded_from + "): there is nothing to train before "
                      "it. Pass a --stop-at above " + std::to_string(progress.iteration) +
                      ", or --resume an earlier checkpoint");

  // ---- run directory (rank 0 writes it; every rank writes its checkpoint files) ----
  std::optional<MetricsWriter> metrics;
  CheckpointManager checkpoints(cfg.checkpoint.dir, cfg.checkpoint);
  checkpoints.set_source(loaded_source);
  checkpoints.set_data_files(train_files);
  if (train.num_sources() > 1) checkpoints.set_blend_history(blend_history_json(train.blend_history()));
  // A rewind: the higher steps belong to the run it abandoned (set aside below, under the lock).
  std::vector<std::string> abandoned;
  if (!resume_path.empty() && !opts.eval_only) abandoned = checkpoints.set_resumed_from(progress.iteration, loaded_from);
  double gpu_memory = 0;  // the lead rank's device memory (0 on the CPU), for the memory plan
  if (lead && opts.eval_only) {  // the same start-up lines, without the run directory
    print_summary(cfg, train, vals, packed, *backend);
    std::printf("keel: %s\n", grid.layout().c_str());
    for (const auto& n : notes) std::printf("keel: %s\n", n.c_str());
    std::fflush(stdout);
  } else if (lead) {
    std::error_code ec;
    fs::create_directories(cfg.out, ec);
    if (ec)
      throw ConfigError("cannot create the run directory " + cfg.out + " (--out): " + ec.message() +
                        "; nothing was trained");
    if (std::string note = lock_directory(cfg.out, "the run directory " + cfg.out, "--out", run_lock); !note.empty())
      notes.push_back(note);
    // An unwritable checkpoint.dir would otherwise surface at the first save, after the training it was to keep.
    {
      const fs::path probe = fs::path(cfg.checkpoint.dir) / (".tmp-write-probe-" + std::to_string(::getpid()));
      fs::create_directories(cfg.checkpoint.dir, ec);
      if (!ec) fs::create_directory(probe, ec);
      if (ec)
        throw CheckpointError("checkpoint.dir " + cfg.checkpoint.dir + " is not writable (creating a directory in it: " +
                              ec.message() + "): no checkpoint could be saved. Fix it, or set checkpoint.dir; "
                              "nothing was trained");
      fs::remove(probe, ec);
    }
    // metrics.jsonl is appended to: a fresh start over an earlier run's records says so (below).
    std::error_code size_ec;
    const bool earlier_records = fs::file_size(fs::path(cfg.out) / "metrics.jsonl", size_ec) > 0 && !size_ec;
    // The checkpoint directory has a lock of its own, also the default one inside --out: two runs
    // with their own --out and one checkpoint.dir (set in one of them, or in both) would resume
    // from, replace and prune each other's checkpoints.
    if (std::string note = lock_directory(cfg.checkpoint.dir, "the checkpoint directory " + cfg.checkpoint.dir +
                                                                  " (checkpoint.dir)",
                                          "checkpoint.dir", checkpoints_lock);
        !note.empty() && !would_replace(cfg.out, cfg.checkpoint.dir))  // inside --out: the same note was given
      notes.push_back(note);
    // The run directory's files: one that cannot be written is the --out's fault (exit 2), with the OS's reason.
    try {
      // Written aside and renamed, so that a full disk leaves the earlier run's config.json whole.
      const fs::path config_path = fs::path(cfg.out) / "config.json", config_tmp = fs::path(cfg.out) / ".config.json.tmp";
      data::detail::write_text_file(config_tmp.string(), to_json(cfg).dump(2) + "\n");
      fs::rename(config_tmp, config_path);
      metrics.emplace((fs::path(cfg.out) / "metrics.jsonl").string(),
                      cfg.log.tensorboard ? (fs::path(cfg.out) / "tensorboard").string() : "");
    } catch (const std::runtime_error& e) {
      throw ConfigError(std::string(e.what()) + " (the run directory --out " + cfg.out +
                        " must be writable); nothing was trained");
    }
    print_summary(cfg, train, vals, packed, *backend);
    if (!choices.items.empty()) std::printf("keel: %s\n", choices.describe(cfg).c_str());
    if (sampler.on()) std::printf("keel: %s\n", sampler.describe().c_str());
    std::printf("keel: %s\n", grid.layout().c_str());
    if (grid.pp_size() > 1)  // the step's pipeline: ticks, idle ticks (the bubble)
      std::printf("keel: pipeline %s\n",
                  tr.schedule(static_cast<int>(cfg.grad_accum_steps(cfg.train.global_batch)), true).describe().c_str());
    gpu_memory = backend->device() == Device::CUDA ? double(cuda_current_device_memory()) : 0.0;
    std::printf("%s", plan::memory_breakdown_text(cfg, gpu_memory).c_str());
    std::printf("keel: run directory %s (metrics: %s, checkpoints: %s)\n", cfg.out.c_str(), metrics->path().c_str(),
                cfg.checkpoint.dir.c_str());
    if (const TensorBoardWriter* tb = metrics->tensorboard())
      std::printf("keel: TensorBoard events: %s (tensorboard --logdir %s)\n", tb->path().c_str(), cfg.out.c_str());
    for (const auto& n : notes) std::printf("keel: %s\n", n.c_str());
    if (const std::vector<std::string> left = checkpoints.clean_incomplete(); !left.empty()) {
      std::string names;
      for (size_t k = 0; k < left.size() && k < 5; ++k) names += (k ? ", " : "") + left[k];
      if (left.size() > 5) names += ", ... and " + std::to_string(left.size() - 5) + " more";
      std::printf("keel: removed what an interrupted run left in %s: %s (.tmp-: a save never published; .old-: a "
                  "replaced or rotated checkpoint half removed)\n",
                  cfg.checkpoint.dir.c_str(), names.c_str());
    }
    if (!abandoned.empty())
      std::printf("keel: %s\n", set_aside_abandoned(checkpoints, cfg.checkpoint.dir, progress.iteration, abandoned,
                                                    loaded_from).c_str());
    // A requeued job may find the disk filled while it waited: said now, not after the steps up
    // to its first save (which then fails) are trained.
    if (resumed_bytes > 0 && progress.iteration < cfg.train.steps) {  // a stop saves even without interval saves
      std::error_code space_ec;
      const fs::space_info space = fs::space(cfg.checkpoint.dir, space_ec);
      if (!space_ec)
        if (std::string w = low_space_warning(cfg.checkpoint.dir, resumed_bytes,
                                              static_cast<int64_t>(space.available), AfterSave::Resumed);
            !w.empty())
          std::printf("keel: %s\n", w.c_str());
    }
    if (progress.iteration > 0) {
      metrics->write({{"event", "resume"}, {"step", progress.iteration}, {"checkpoint", resume_path}});
    } else if (earlier_records) {
      // A new run from step 0 in a directory whose metrics.jsonl holds another run's steps (its
      // checkpoints removed, another checkpoint.dir, an --init-from): the records before this
      // event are not this run's (keel doctor metrics, plot_metrics.py and TensorBoard drop them).
      metrics->write({{"event", "start"}, {"step", 0}});
      std::printf("keel: %s holds records of an earlier run; this run starts at step 0, and an {\"event\": \"start\"} "
                  "record marks where its own begin\n",
                  metrics->path().c_str());
    }
    std::fflush(stdout);
  }
  world.barrier();
  // The replicas must agree from the start (after a load as after an init).
  if (int n = tr.check_replicas(); n > 0 && lead)
    std::printf("keel: replica check: %d replicated tensor(s) identical across their ranks\n", n);


  const double flops_per_token = tr.model().flops_per_token();
  int64_t consumed_samples = progress.consumed_samples, consumed_tokens = progress.consumed_tokens;
  int64_t skipped_total = progress.skipped_total, nan_total = progress.nan_total;
  const int64_t first_iteration = progress.iteration, skipped_before = progress.skipped_total;  // for "done"
  bool said_diverged = false;  // a loss above twice a uniform guess's: ln V per token
  const double uniform_loss = std::log(static_cast<double>(cfg.model.vocab_size));
  double last_val = std::nan("");
  // -q leaves out the per-step lines; --eval-only's evaluations are its whole result (it writes
  // nothing), so they print under -q too.
  const bool quiet_evals = opts.eval_only ? !lead : quiet;
  auto choice_eval = [&](int64_t it) {
    const ProfileRange range("choice eval");
    const auto t0 = std::chrono::steady_clock::now();
    const std::vector<ChoiceScore> scores = score_choices(tr, choices.items);
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (lead) report_choice_eval(cfg, choices, scores, it, secs, quiet_evals, metrics ? &*metrics : nullptr);
  };
  // sample: the lead rank generates from its replica; the others go on to the next step.
  auto sample_text = [&](int64_t it) {
    tr.settle_params();  // collective: the lead reads every weight below
    if (!lead) return;
    const ProfileRange range("sample");
    const auto t0 = std::chrono::steady_clock::now();
    const std::string text = sampler.sample(tr.table(), *backend, tr.state().working);
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (metrics) metrics->write({{"event", "sample"}, {"step", it}, {"text", text}});
    if (!quiet_evals) std::printf(" sample at iteration %lld (%.2f s):\n%s\n", static_cast<long long>(it), secs, text.c_str());
    std::fflush(stdout);
  };
  // One metrics record per evaluation: "val_loss" (data.val) and "val_losses" {name: loss}.
  // A set whose evaluated targets are all masked (an SFT set whose masks keep only prompts) has
  // no loss: it is reported as nan, as a skipped step's loss is, never as a perfect 0.
  std::vector<bool> said_no_loss(vals.size(), false);  // at start-up (print_summary), or at the first evaluation
  for (size_t i = 0; i < vals.size(); ++i) said_no_loss[i] = vals[i].loss_targets == 0;
  auto validation = [&](int64_t it) {
    const ProfileRange range("validation");
    nlohmann::json rec = {{"step", it}, {"consumed_tokens", consumed_tokens}};
    for (size_t i = 0; i < vals.size(); ++i) {
      const ValidationSet& v = vals[i];
      int64_t loss_tokens = 0;
      double loss = validate(tr, v.sampler, cfg, grid, loss_tokens);
      if (loss_tokens == 0) {
        loss = std::nan("");
        if (lead && !said_no_loss[i]) {
          said_no_loss[i] = true;
          warn_no_validation_loss(v);
        }
      }
      // The targets in the loss beside it: keel doctor tells a nan of no targets from an overflow.
      if (v.name.empty()) last_val = loss, rec["val_loss"] = json_number(loss), rec["val_loss_tokens"] = loss_tokens;
      else rec["val_losses"][v.name] = json_number(loss), rec["val_loss_tokens_by_set"][v.name] = loss_tokens;
      if (!quiet_evals)
        std::printf(" validation%s%s%s at iteration %lld | lm loss: %.6E | lm loss PPL: %.3f |\n",
                    v.name.empty() ? "" : " (", v.name.c_str(), v.name.empty() ? "" : ")", static_cast<long long>(it),
                    loss, std::exp(loss));
    }
    if (metrics) metrics->write(rec);
  };
  // Every evaluation the config asks for, on the current weights: train.eval_at_start, --eval-only.
  auto evaluate_all = [&](int64_t it) {
    if (!vals.empty() && cfg.train.eval_batches > 0) validation(it);
    if (!choices.items.empty()) choice_eval(it);
    if (sampler.on()) sample_text(it);
  };
  if (opts.eval_only) {
    evaluate_all(progress.iteration);
    if (lead)
      std::printf("keel: --eval-only: evaluated %s at iteration %lld under tp=%lld pp=%lld dp=%lld; nothing was written\n",
                  loaded_from.empty() ? "the initialisation" : loaded_from.c_str(), static_cast<long long>(progress.iteration),
                  static_cast<long long>(cfg.parallel.tp), static_cast<long long>(cfg.parallel.pp),
                  static_cast<long long>(cfg.parallel.dp));
    return kExitOk;
  }
  // train.eval_at_start: the loaded (or initial) model's numbers before the run's first step.
  // Not again at each resume: they would repeat what the earlier process measured (a checkpoint
  // of an evaluation step is saved after it), at a HellaSwag pass per requeue.
  if (cfg.train.eval_at_start && progress.iteration == 0) evaluate_all(0);
  // A background save (checkpoint.async) is published at the first step boundary where no
  // rank is still writing (below), and at the latest before the next save or the run's end.
  double evals_secs = 0;    // the last evaluations' time (validation, choice eval, sample at one step)
  double longest_save = resumed_save_seconds;  // seconds of the slowest save: --time-limit keeps room for one
  AfterSave after_pending = AfterSave::Training;  // what follows the pending save, for the free-space warning
  std::string unusable_rewind;  // a checkpoint a spike's rewind found damaged
  auto finish_pending_save = [&] {
    if (!checkpoints.save_pending()) return;
    const SaveResult r = checkpoints.finish_save(all_ok);
    if (r.write_seconds >= longest_save) save_estimate = "this run's longest";
    longest_save = std::max(longest_save, r.write_seconds);
    if (!lead) return;
    set_fallback_checkpoint(r.path);
    print_save(r);
    std::error_code space_ec;
    const fs::space_info space = fs::space(cfg.checkpoint.dir, space_ec);
    if (!space_ec)
      if (std::string w = low_space_warning(cfg.checkpoint.dir, r.bytes, static_cast<int64_t>(space.available),
                                            after_pending);
          !w.empty())
        std::printf("keel: %s\n", w.c_str());
  };
  auto save = [&](int64_t it, bool background, AfterSave after = AfterSave::Training) {
    const ProfileRange range("checkpoint save");
    finish_pending_save();
    after_pending = it >= cfg.train.steps ? AfterSave::End : after;
    TrainProgress p{it, consumed_samples, consumed_tokens, skipped_total, nan_total};
    nlohmann::json health = tr.snapshot_json(tr.snapshot(probe));
    health["spike_detector"] = tr.spikes().to_json();
    health["arithmetic"] = arithmetic;
    health["build"] = build_id();
    checkpoints.begin_save(cfg, tr.table(), tr.state(), *backend, p, tr.scaler(), place, all_ok, health, background);
    if (!background) finish_pending_save();
  };
  // Timed steps (train/step_timers.h): the second step of the run, then one about every
  // log.timers_interval_s; every rank times the same steps (they agree at each step's end).
  bool time_next = false;
  auto last_timed = std::chrono::steady_clock::now();
  std::map<int, int64_t> slow_streak;  // stragglers: timed steps in a row each has been slow
  bool balance_told = false, balance_seen = false;  // pipeline balance advice: given once a run
  MemoryWatch memory(backend->device() == Device::CUDA);  // the backend's peak against the plan
  const double planned_memory = plan::planned_backend_bytes(cfg, grid.pp_rank(), backend->device() == Device::CUDA);
  // Every virtual stage's layers in model order (interleaved ranks hold several).
  const int chunks = static_cast<int>(cfg.parallel.virtual_stages);
  const std::vector<int> stage_layers =
      cfg.parallel.pp >= 3 ? pipeline_layer_counts(cfg.model, static_cast<int>(cfg.parallel.pp) * chunks,
                                                   cfg.parallel.pipeline_split())
                           : std::vector<int>();
  // On a GPU the advice keeps each 1F1B stage's layers within what its memory holds.
  const std::vector<int> stage_layer_caps =
      stage_layers.empty() ? std::vector<int>() : plan::run_pipeline_layer_caps(cfg, gpu_memory);
  for (int64_t it = progress.iteration + 1; it <= cfg.train.steps; ++it) {
    tr.timers().start_step(std::exchange(time_next, false));
    const auto t0 = std::chrono::steady_clock::now();
    const int64_t gbs = global_batch_size(cfg, consumed_samples);
    std::vector<MicroBatch> batches;
    {
      const StepTimers::Scope timed = tr.timers().phase(StepTimers::Data);
      batches = load_batches(train, consumed_samples, gbs, cfg.train.micro_batch, cfg.parallel.dp, grid.dp_rank(),
                             cfg.data);
    }
    const bool collect_stats = cfg.health.stats_interval > 0 && it % cfg.health.stats_interval == 0;
    StepStats st = tr.step(batches, it, collect_stats);
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
#ifdef KEEL_HAVE_CUDA
    if (it == progress.iteration + 1 && backend->device() == Device::CUDA) cuda_profile_restart(*backend);
#endif

    consumed_samples += gbs;
    consumed_tokens += gbs * T;
    skipped_total += st.skipped;
    nan_total += st.nonfinite;
    // Throughput is the whole job's; TFLOPs are per rank (model FLOPs / world / time).
    StepReport r{st, cfg.train.steps, consumed_samples, consumed_tokens, secs * 1e3,
                 static_cast<double>(gbs * T) / secs,
                 flops_per_token * static_cast<double>(gbs * T) / secs / 1e12 / world_size, skipped_total, nan_total};
    if (metrics) {
      nlohmann::json rec = step_record(r);
      if (collect_stats) {
        rec["act_max"] = st.act_max;
        rec["grad_max"] = st.grad_max;
      }
      if (st.spike) rec["spike"] = st.spike_text;
      metrics->write(rec);
    }
    // Also the first step of each process: after a resume, where a restart spike would show.
    if (!quiet && (it % cfg.log.interval == 0 || it == progress.iteration + 1 || it == cfg.train.steps)) {
      std::printf("%s\n", format_step_line(r).c_str());
      std::fflush(stdout);
    }
    report_memory(memory, planned_memory, *backend, grid, lead, quiet, it, metrics ? &*metrics : nullptr);
    if (it == progress.iteration + 1) report_grad_overlap(tr, lead, quiet, it, metrics ? &*metrics : nullptr);
    // The first gather that ran alongside a forward: the first update's, in the second step.
    if (it == progress.iteration + 2) report_param_gather(tr, lead, quiet, it, metrics ? &*metrics : nullptr);
    if (tr.timers().timed()) {
      const std::vector<RankTimes> times = tr.gather_timers(secs * 1e3);
      last_timed = std::chrono::steady_clock::now();
      if (lead) {
        const TimersSummary sum = summarize_timers(times, it, cfg.health.straggler_ratio);
        if (!quiet) std::printf("keel: %s\n", sum.line.c_str());
        metrics->write(sum.record);
        // A rank slow at two timed steps in a row (one slow step can be a hiccup); a rank that
        // stays slow is named again every tenth timed step.
        std::map<int, int64_t> streak;
        for (const Straggler& g : sum.stragglers) {
          const int64_t n = streak[g.world_rank] = slow_streak[g.world_rank] + 1;
          if (n % 10 == 2)
            std::printf("keel: WARNING straggler: %s, slow at %lld timed steps in a row. Every step waits for the "
                        "slowest rank: look for a throttled or shared GPU or a busy node there\n",
                        g.text.c_str(), static_cast<long long>(n));
        }
        slow_streak = std::move(streak);
        // A pipeline whose stages' measured compute differs is told, once, the split that evens
        // it: when two timed steps in a row find the imbalance (one step can be a hiccup).
        if (!balance_told && !stage_layers.empty()) {
          const std::optional<PipelineBalance> b = pipeline_balance(times, stage_layers, stage_layer_caps, chunks);
          if (b && balance_seen) {
            balance_told = true;
            if (!quiet) std::printf("keel: pipeline balance at step %lld: %s\n", static_cast<long long>(it), b->text.c_str());
            metrics->write({{"event", "pipeline_balance"},
                            {"step", it},
                            {"stage_compute_ms", b->stage_ms},
                            {"pipeline_layers_now", stage_layers},
                            {"pipeline_layers", b->layers},
                            {"slowest_after_ms", b->slowest_after_ms}});
          }
          balance_seen = b.has_value();
        }
        std::fflush(stdout);
      }
    }
    if (st.valid_tokens == 0 && lead)
      std::printf("keel: WARNING step %lld: every target of the global batch is masked out of the loss (loss "
                  "masks, data.eod_mask_loss): no loss to learn from, the update is skipped\n",
                  static_cast<long long>(it));
    // Worse than a uniform guess by far (its loss is ln V): diverged, whatever the spike check,
    // which arms only after health.spike_warmup steps, says. Once per run.
    if (!said_diverged && std::isfinite(st.loss) && st.loss > 2 * uniform_loss) {
      said_diverged = true;
      if (lead)
        std::printf("keel: WARNING step %lld: loss %.4g is more than twice a uniform guess's over the vocabulary "
                    "(ln %lld = %.4g): the model predicts worse than knowing nothing, so the run has diverged "
                    "(optimizer.lr too high for this model and batch?). Resume an earlier checkpoint with a lower "
                    "learning rate\n",
                    static_cast<long long>(it), st.loss, static_cast<long long>(cfg.model.vocab_size), uniform_loss);
      if (metrics) metrics->write({{"event", "diverged"}, {"step", it}, {"loss", json_number(st.loss)}});
    }
    if (st.nonfinite && lead) {
      // fp16: the scale backs off only once the hysteresis's overflows are used up.
      std::string scale_note;
      if (tr.scaler().enabled()) {
        char buf[200];
        const double now = tr.scaler().scale();
        if (now < st.loss_scale)
          std::snprintf(buf, sizeof buf, ", fp16 loss scale backs off from %.6g to %.6g", double(st.loss_scale), now);
        else if (st.scale_exhausted || now <= cfg.precision.loss_scale.min)  // the ERROR below, or the next one's
          std::snprintf(buf, sizeof buf, ", fp16 loss scale at its minimum %.6g (precision.loss_scale.min)", now);
        else if (const int64_t left = tr.scaler().hysteresis_tracker(); left <= 1)
          std::snprintf(buf, sizeof buf, ", fp16 loss scale stays at %.6g (precision.loss_scale.hysteresis %lld): the "
                        "next overflow cuts it unless it grows first", now,
                        static_cast<long long>(cfg.precision.loss_scale.hysteresis));
        else
          std::snprintf(buf, sizeof buf, ", fp16 loss scale stays at %.6g (precision.loss_scale.hysteresis %lld): the "
                        "scale is cut after %lld more overflows unless it grows first", now,
                        static_cast<long long>(cfg.precision.loss_scale.hysteresis), static_cast<long long>(left));
        scale_note = buf;
      }
      std::printf("keel: WARNING step %lld: %s (update skipped%s)\n", static_cast<long long>(it),
                  std::isfinite(st.loss) ? "non-finite gradient" : "non-finite loss", scale_note.c_str());
      if (!st.nonfinite_report.empty()) std::printf("keel:   %s\n", st.nonfinite_report.c_str());
      // The loss scale multiplies the backward only: backing it off cannot fix a forward overflow.
      if (tr.scaler().enabled() && st.nonfinite_report.starts_with("first non-finite value at forward"))
        std::printf("keel:   the overflow is in the forward pass, which the loss scale does not touch: backing the "
                    "scale off cannot fix it. The weights or activations have outgrown fp16 (a learning rate too "
                    "high?): lower optimizer.lr and resume from an earlier checkpoint, or train in bf16\n");
    }
    if (lead && !st.frozen.empty()) {
      for (const auto& f : st.frozen) std::printf("keel: WARNING frozen parameter: %s\n", f.c_str());
      // keel doctor metrics reads them back: a run that froze is not healthy afterwards either.
      if (metrics) metrics->write({{"event", "frozen"}, {"step", it}, {"warnings", st.frozen}});
    }
    // fp16 headroom: a layer within 16x of the format's largest value is about to overflow.
    if (lead && collect_stats && cfg.precision.mode == PrecisionMode::FP16) {
      for (size_t l = 0; l < st.act_max.size(); ++l)
        if (st.act_max[l] > 65504.0f / 16 || st.grad_max[l] > 65504.0f / 16)
          std::printf("keel: WARNING fp16 headroom at layer %zu is below 16x: max |activation| %.4g, max |gradient "
                      "(scaled)| %.4g, fp16 max 65504\n",
                      l, st.act_max[l], st.grad_max[l]);
    }
    if (st.scale_exhausted) {
      // The state has not changed since the last applied update: save it, then stop with the report.
      if (lead)
        std::printf("keel: ERROR fp16 loss scale is at its minimum (%g) and step %lld still overflows: %s\n"
                    "keel: saving the last good state and stopping; resume it in bf16 (--set precision.mode=bf16) "
                    "or with a lower learning rate\n",
                    static_cast<double>(tr.scaler().scale()), static_cast<long long>(it),
                    st.nonfinite_report.empty() ? "(no localisation)" : st.nonfinite_report.c_str());
      save(it, false, AfterSave::Stop);
      return kExitDiverged;
    }
    if (st.spike) {
      if (lead) std::printf("keel: WARNING step %lld: %s%s\n", static_cast<long long>(it), st.spike_text.c_str(),
                            cfg.health.spike_action == "warn" ? "" : "; the update was skipped");
      if (cfg.health.spike_action == "rewind") {
        finish_pending_save();  // the newest good state
        // Verified as a resume's checkpoint is: a damaged one is not loaded, and it does not end
        // the run either (the spike is skipped instead, as before the first save).
        std::optional<std::string> latest;
        std::optional<Checkpoint> rewind_to;
        try {
          latest = Checkpoint::find_latest(cfg.checkpoint.dir);
          if (latest && *latest != unusable_rewind) rewind_to = open_verified(*latest, "rewind to", "--resume");
          else if (latest && lead)
            std::printf("keel: %s cannot be rewound to (said above): the update was skipped instead\n", latest->c_str());
        } catch (const CheckpointError& e) {
          unusable_rewind = latest.value_or("");  // not verified again at later spikes
          if (lead)
            std::printf("keel: WARNING step %lld: cannot rewind: %s\nkeel: the update was skipped instead and training "
                        "goes on; the checkpoint is left as it is\n",
                        static_cast<long long>(it), e.what());
          if (metrics) metrics->write({{"event", "rewind_refused"}, {"step", it}, {"checkpoint", latest.value_or("")}});
          latest = std::string();  // said: not "no checkpoint yet" below
        }
        if (rewind_to) {
          Checkpoint& ck = *rewind_to;
          TrainProgress back = restore_for_resume(ck, cfg, tr.table(), tr.state(), *backend, tr.scaler(), place);
          // Judged against the level before the spike again, the flagged steps in a row still counted.
          restore_spike_detector(tr, ck.meta().value("health", nlohmann::json()), true);
          if (lead)
            std::printf("keel: rewound to %s (iteration %lld); the samples consumed since (%lld to %lld) are skipped\n",
                        ck.path().c_str(), static_cast<long long>(back.iteration),
                        static_cast<long long>(back.consumed_samples), static_cast<long long>(consumed_samples));
          if (metrics)
            metrics->write({{"event", "rewind"}, {"step", it}, {"to", back.iteration}, {"checkpoint", ck.path()}});
          it = back.iteration;  // the data position stays where it is: the offending batches are skipped
          // The skips of the abandoned trajectory are not this one's: Adam's step (restored above)
          // is back.iteration - back.skipped_total, and so the counts must be.
          skipped_total = back.skipped_total;
          nan_total = back.nan_total;
          continue;
        }
        if (!latest && lead) std::printf("keel: no checkpoint to rewind to yet: the update was skipped instead\n");
      }
    }

    if (cfg.health.replica_check_interval > 0 && it % cfg.health.replica_check_interval == 0) tr.check_replicas();

    auto evals_due = [&](int64_t step) {
      const bool validation_due =
          !vals.empty() && cfg.train.eval_batches > 0 && due_every(step, cfg.train.eval_interval, cfg.train.steps);
      return std::array<bool, 3>{validation_due, choices.due(step, cfg), sampler.due(step, cfg.train.steps)};
    };
    auto [eval_now, choices_now, sample_now] = evals_due(it);
    // A signal is a deadline (Slurm's warning before the time limit, a preemption): the save must
    // start at once, so the evaluations due now are skipped. The ranks agree, as they evaluate together.
    if ((eval_now || choices_now || sample_now) && any_rank(g_stop_signal != 0)) {
      if (lead)
        std::printf("keel: a stop signal is pending: the evaluations due at iteration %lld are skipped, so that the "
                    "save starts at once\n", static_cast<long long>(it));
      eval_now = choices_now = sample_now = false;
    }
    const auto evals_start = std::chrono::steady_clock::now();
    if (eval_now) validation(it);
    if (choices_now) choice_eval(it);
    if (sample_now) sample_text(it);
    if (eval_now || choices_now || sample_now)
      evals_secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - evals_start).count();

    const bool last = it == cfg.train.steps;
    const bool scheduled = cfg.checkpoint.interval > 0 && it % cfg.checkpoint.interval == 0;
    const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - g_process_start).count();
    // The next step's time: this one's, and the evaluations due after it as long as they took last.
    const auto next_evals = evals_due(it + 1);
    const double next_step = secs + (next_evals[0] || next_evals[1] || next_evals[2] ? evals_secs : 0);
    std::string stop_reason;
    // Why this rank stops, for the lead to say when it is another's: 1 --stop-at, 2 the time
    // limit, 3 + the signal; the ranks agree on the largest (a signal first), and its lowest rank.
    int32_t stop_kind = 0;
    if (g_stop_signal) {
      stop_reason = std::string(signal_name(g_stop_signal)) + " received";
      stop_kind = 3 + g_stop_signal;
    } else if (!last && opts.stop_at > 0 && it >= opts.stop_at) {
      stop_reason = "--stop-at " + std::to_string(opts.stop_at) + " reached";
      stop_kind = 1;
    } else if (!last && opts.time_limit_s > 0 && time_limit_near(elapsed, next_step, longest_save, opts.time_limit_s)) {
      stop_kind = 2;
      char buf[320];
      if (longest_save > 0)
        std::snprintf(buf, sizeof buf, "time limit of %.4g s is near (%.1f s since keel started; the next step would "
                      "take about %.3g s and a save %.3g s, %s)", opts.time_limit_s, elapsed, next_step, longest_save,
                      save_estimate.c_str());
      else
        std::snprintf(buf, sizeof buf, "time limit of %.4g s is near (%.1f s since keel started; the next step would "
                      "take about %.3g s; no save timed yet, so room for a step is kept for it)", opts.time_limit_s,
                      elapsed, next_step);
      stop_reason = buf;
    }
    // Every rank stops at the same step boundary: a signal may reach the ranks at different times.
    const bool timers_due =
        cfg.log.timers && (it == progress.iteration + 1 ||
                           std::chrono::duration<double>(std::chrono::steady_clock::now() - last_timed).count() >=
                               cfg.log.timers_interval_s);
    constexpr int32_t kRanks = 1 << 20;  // a stop's kind above the bits of its rank (kRanks - 1 - rank)
    const auto agreed = any_rank.max({stop_kind == 0 ? 0 : stop_kind * kRanks + (kRanks - 1 - world_rank),
                                      timers_due ? 1 : 0, checkpoints.writing() ? 1 : 0});
    const bool stopping = agreed[0] != 0, writing = agreed[2] != 0;
    time_next = agreed[1] != 0;
    if (checkpoints.save_pending() && !writing) finish_pending_save();
    if (stopping) {
      if (stop_reason.empty()) {
        const int32_t kind = agreed[0] / kRanks, rank = kRanks - 1 - agreed[0] % kRanks;
        stop_reason = std::string("rank ") + std::to_string(rank) + " is stopping (" +
                      (kind == 1   ? "--stop-at " + std::to_string(opts.stop_at) + " reached"
                       : kind == 2 ? "the time limit is near there"
                                   : std::string(signal_name(kind - 3)) + " received there") +
                      ")";
      }
      if (lead) std::printf("keel: %s: saving a checkpoint at iteration %lld and stopping\n", stop_reason.c_str(),
                            static_cast<long long>(it));
      save(it, false, AfterSave::Stop);
      // The same command with --resume would start from that checkpoint again, not from this one;
      // with the --stop-at just reached it is refused (not after the checkpoint's iteration).
      const bool stop_at_reached = opts.stop_at > 0 && it >= opts.stop_at;
      std::string without;
      if (!opts.resume.empty()) without = "--resume " + opts.resume;
      if (stop_at_reached)
        without += (without.empty() ? "" : " and ") + std::string("--stop-at ") + std::to_string(opts.stop_at) +
                   " (or with a later --stop-at)";
      const std::string again =
          without.empty() ? "run the same command again to resume"
                          : "to continue, run the same command without " + without +
                                (opts.resume.empty() ? std::string()
                                                     : "; it then resumes from the checkpoint just saved, the latest in " +
                                                           cfg.checkpoint.dir);
      if (lead) std::printf("keel: stopped at iteration %lld of %lld; %s (exit code %d)\n", static_cast<long long>(it),
                            static_cast<long long>(cfg.train.steps), again.c_str(), kExitStopped);
      return kExitStopped;
    }
    // The last save is written before the run ends; interval saves may go to the background.
    if (last && cfg.checkpoint.save_at_end) save(it, false);
    else if (scheduled) save(it, cfg.checkpoint.async);
  }
  finish_pending_save();
  tr.settle_params();  // a run without a final save ends with the last update's weights whole
  report_memory(memory, planned_memory, *backend, grid, lead, quiet, cfg.train.steps, metrics ? &*metrics : nullptr);  // the last evaluations'
  if (lead)
    std::printf("keel: done: %lld steps, %lld tokens%s\n", static_cast<long long>(cfg.train.steps),
                static_cast<long long>(consumed_tokens),
                std::isnan(last_val) ? "" : (", final validation loss " + std::to_string(last_val)).c_str());
  // Skipped updates were warned of one by one; a run made of them must not read as a success.
  const int64_t ran = cfg.train.steps - first_iteration, skipped = std::max<int64_t>(0, skipped_total - skipped_before);
  if (lead && ran > 0 && skipped > 0)
    std::printf("keel: WARNING %lld of this run's %lld steps skipped their update (see the warnings above: a non-finite "
                "loss or gradient, a spike, or nothing in the loss)%s\n",
                static_cast<long long>(skipped), static_cast<long long>(ran),
                skipped >= ran ? ": no update was applied, the weights are the ones the run started from" : "");
  if (metrics && metrics->dropped() > 0)
    std::printf("keel: WARNING %lld metrics record(s) could not be written to %s (see the warnings above)\n",
                static_cast<long long>(metrics->dropped()), metrics->path().c_str());
  return kExitOk;
}

}  // namespace keel
