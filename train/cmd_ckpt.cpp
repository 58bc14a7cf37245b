// `keel ckpt inspect|diff|verify|average`: what is in a checkpoint, where two differ, whether
// one is sound, and the mean of several.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <limits>
#include <optional>

#include "kernels/dtype.h"
#include "train/checkpoint.h"
#include "train/cli_checks.h"
#include "train/commands.h"
#include "train/hf_format.h"
#include "train/model_loading.h"
#include "train/run.h"

namespace keel {

namespace {

std::string shape_text(const std::vector<int64_t>& s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

// Prints what verify() found under a heading naming `which` checkpoint; returns whether it is sound.
bool report_problems(const Checkpoint& ck, const CheckpointProblems& problems, const std::string& which) {
  if (problems.empty()) return true;
  std::printf("%s %s%s:\n", problems.damage.empty() ? "NON-FINITE:" : "DAMAGED:", which.c_str(), ck.path().c_str());
  for (const auto& p : problems.damage) std::printf("  %s\n", p.c_str());
  for (const auto& p : problems.nonfinite) std::printf("  %s\n", p.c_str());
  return false;
}

// verify = false (--no-verify): meta.json and the files' headers only (open() checks the sizes
// and headers), no tensor data, so no statistics: for a large checkpoint, whose optimizer files
// alone are several times the model.
int cmd_inspect(const std::string& path, const std::string& stats_state, bool verify) {
  Checkpoint ck = Checkpoint::open(path);
  const auto& m = ck.meta();
  const TrainProgress p = ck.progress();
  std::printf("checkpoint %s\n", ck.path().c_str());
  std::printf("  format %s v%d, keel %s, saved %s\n", m.value("format", std::string("?")).c_str(),
              m.value("format_version", 0), m.value("keel_version", std::string("?")).c_str(),
              m.value("saved_at", std::string("?")).c_str());
  std::printf("  iteration %lld, consumed samples %lld, consumed tokens %lld, Adam step %lld, skipped %lld, nan %lld\n",
              static_cast<long long>(p.iteration), static_cast<long long>(p.consumed_samples),
              static_cast<long long>(p.consumed_tokens), static_cast<long long>(ck.adam_step()),
              static_cast<long long>(p.skipped_total), static_cast<long long>(p.nan_total));
  std::printf("  precision %s (working weights %s), loss scale %g, saved under %s\n", ck.precision().c_str(),
              m.value("weight_dtype", std::string("?")).c_str(), m.at("loss_scaler").value("scale", 1.0),
              saved_layout_text(m).c_str());
  std::string states;
  for (const auto& s : ck.states()) states += (states.empty() ? "" : ", ") + s;
  std::printf("  states present: %s%s\n", states.c_str(),
              m.value("master_is_weight", false) ? " (fp32 run: the weights are the masters)" : "");
  // The blend's history of weights (validated with the rest of meta.json when it was opened).
  if (const nlohmann::json d = m.value("data", nlohmann::json::object()); d.contains("blend")) {
    std::string segments;
    for (const nlohmann::json& seg : d["blend"])
      segments += (segments.empty() ? "" : ", ") + seg["weights"].dump() + " from sample " + seg["from_sample"].dump();
    std::printf("  blend of %zu sources, data.train_weights %s\n", d["blend"].front()["weights"].size(), segments.c_str());
  }
  for (const auto& [name, info] : m.at("files").items())
    std::printf("  file %-40s %12lld bytes  crc32c %s  %zu chunks\n", name.c_str(),
                static_cast<long long>(info.value("bytes", int64_t{0})), info.value("crc32c", std::string()).c_str(),
                info.value("tensors", nlohmann::json::object()).size());

  const auto tensors = ck.tensors(stats_state);
  if (tensors.empty())
    std::printf("  (no %s state to summarise)\n", stats_state.c_str());
  else
    std::printf("\n  %-34s %-16s %-6s %-3s %-3s %-3s%s\n", "tensor", "shape", stats_state.c_str(), "mst", "m", "v",
                verify ? "          norm          min          max" : "");
  int64_t total = 0;
  for (const auto& [name, shape] : tensors) {
    auto mark = [&](const char* s) { return ck.has(s, name) ? "yes" : "-"; };
    std::printf("  %-34s %-16s %-6s %-3s %-3s %-3s", name.c_str(), shape_text(shape).c_str(),
                std::string(dtype_name(ck.stored_dtype(stats_state, name))).c_str(), mark("master"), mark("adam_m"),
                mark("adam_v"));
    int64_t numel = 1;
    for (int64_t d : shape) numel *= d;
    total += numel;
    if (!verify) {
      std::printf("\n");
      continue;
    }
    const std::vector<float> v = ck.read_full(stats_state, name);
    double sq = 0;
    float lo = std::numeric_limits<float>::infinity(), hi = -lo;
    for (float x : v) sq += static_cast<double>(x) * x, lo = std::min(lo, x), hi = std::max(hi, x);
    std::printf("  %12.5g %12.5g %12.5g\n", std::sqrt(sq), lo, hi);
  }
  if (!tensors.empty()) std::printf("  %zu tensors, %lld parameters\n", tensors.size(), static_cast<long long>(total));
  if (!verify) {
    std::printf("  data not verified (--no-verify): only meta.json and the files' sizes and headers were read; no "
                "checksum, value or statistic (keel ckpt verify reads them)\n");
    return kExitOk;
  }
  // The numbers above mean little if the files are not what was saved: say so.
  if (!report_problems(ck, ck.verify(), "")) return kExitCheckpointError;
  std::printf("  every checksum matches and every value is finite\n");
  return kExitOk;
}

// verify = false (--no-verify): meta.json and the files' headers only, as for inspect: which
// tensors each side holds, their shapes and stored dtypes, and the progress; no data is read.
int cmd_diff(const std::string& a_path, const std::string& b_path, int max_report, bool verify) {
  Checkpoint a = Checkpoint::open(a_path), b = Checkpoint::open(b_path);
  std::printf("diff %s\n     %s\n", a.path().c_str(), b.path().c_str());
  // A side whose files are not what was saved (or hold inf/NaN) is said first: its differences
  // are damage, not training.
  const bool sound = !verify || (report_problems(a, a.verify(), "the first checkpoint, ") &
                                 report_problems(b, b.verify(), "the second checkpoint, "));
  int64_t compared = 0, differing = 0;
  std::vector<std::string> notes, reshaped;
  // tok_embed and lm_head of two paddings of one vocabulary (another parallel.tp or
  // model.pad_vocab_to_multiple_of): their real rows are compared, and the padding rows must
  // be zero, as keel's init and a re-padding load leave them.
  const int64_t vocab_a = a.meta().at("config").at("model").value("vocab_size", int64_t{-1});
  const int64_t vocab_b = b.meta().at("config").at("model").value("vocab_size", int64_t{-1});
  std::string repadded;  // "96 vs 72 rows", said once
  // Rows [vocab, rows) of (state, name) hold only zeros.
  auto zero_padding = [](const Checkpoint& ck, const std::string& state, const std::string& name, int64_t vocab) {
    const std::vector<float> v = read_padding_rows(ck, state, name, vocab);
    return std::all_of(v.begin(), v.end(), [](float x) { return x == 0.0f; });
  };
  for (const std::string& state : a.states()) {
    const auto ta = a.tensors(state), tb = b.tensors(state);
    if (tb.empty()) {
      notes.push_back("state " + state + " is only in the first checkpoint");
      continue;
    }
    for (const auto& [name, shape] : ta) {
      auto it = tb.find(name);
      if (it == tb.end()) {
        notes.push_back(state + "/" + name + " is only in the first checkpoint");
        continue;
      }
      const bool repad = it->second != shape && vocab_a == vocab_b && vocab_padding_only(name, shape, it->second, vocab_a);
      if (it->second != shape && !repad) {  // not compared: listed apart
        reshaped.push_back(state + "/" + name + ": " + shape_text(shape) + " vs " + shape_text(it->second));
        continue;
      }
      ++compared;
      if (repad) {
        repadded = std::to_string(shape[0]) + " vs " + std::to_string(it->second[0]) + " rows";
        if (verify && !(zero_padding(a, state, name, vocab_a) && zero_padding(b, state, name, vocab_a)) &&
            ++differing <= max_report)
          std::printf("  %-8s %-34s padding rows (past model.vocab_size %lld) hold values other than zero\n",
                      state.c_str(), name.c_str(), static_cast<long long>(vocab_a));
      }
      // Bitwise comparison in the stored dtype when both agree on it, else through fp32.
      const DType da = a.stored_dtype(state, name), db = b.stored_dtype(state, name);
      if (!verify) {  // the headers only: the stored dtypes
        if (da != db && ++differing <= max_report)
          std::printf("  %-8s %-34s stored as %s vs %s\n", state.c_str(), name.c_str(),
                      std::string(dtype_name(da)).c_str(), std::string(dtype_name(db)).c_str());
        continue;
      }
      TensorRegion r;  // the whole tensor, or its real rows when the paddings differ
      r.shape = shape;
      if (repad) r.shape[0] = vocab_a;
      r.offset.assign(shape.size(), 0);
      bool equal = false;
      if (da == db) {
        std::vector<char> ba(static_cast<size_t>(r.numel()) * dtype_size(da)), bb(ba.size());
        a.read(state, name, r, da, ba.data());
        b.read(state, name, r, db, bb.data());
        equal = std::memcmp(ba.data(), bb.data(), ba.size()) == 0;
      }
      if (equal) continue;
      std::vector<float> va(static_cast<size_t>(r.numel())), vb(va.size());
      a.read(state, name, r, DType::F32, va.data());
      b.read(state, name, r, DType::F32, vb.data());
      double max_abs = 0, max_rel = 0;
      int64_t n_diff = 0;
      for (size_t i = 0; i < va.size(); ++i) {
        if (va[i] == vb[i] || (std::isnan(va[i]) && std::isnan(vb[i]))) continue;
        ++n_diff;
        const double d = std::fabs(static_cast<double>(va[i]) - vb[i]);
        max_abs = std::max(max_abs, d);
        max_rel = std::max(max_rel, d / std::max(1e-30, std::fabs(static_cast<double>(vb[i]))));
      }
      if (++differing <= max_report)
        std::printf("  %-8s %-34s differs in %lld of %zu elements: max abs %.3e, max rel %.3e%s\n", state.c_str(),
                    name.c_str(), static_cast<long long>(n_diff), va.size(), max_abs, max_rel,
                    da != db ? " (stored dtypes differ)" : "");
    }
  }
  for (const std::string& state : b.states())
    if (a.tensors(state).empty()) notes.push_back("state " + state + " is only in the second checkpoint");
  for (const auto& n : notes) std::printf("  note: %s\n", n.c_str());
  for (const auto& r : reshaped) std::printf("  shape differs: %s\n", r.c_str());
  // Not a difference of the model: said beside the verdict.
  const std::string padding_note =
      repadded.empty() ? ""
                       : " (the vocabulary is padded to " + repadded + ": tok_embed and lm_head compared in their " +
                             std::to_string(vocab_a) + " real rows" + (verify ? ", their padding rows zero" : "") + ")";
  // The progress is state too: Adam's step sets the bias correction, the samples where the data
  // resumes. Two checkpoints that differ only there do not continue alike.
  const auto pa = a.progress(), pb = b.progress();
  const bool progress_differs =
      pa.iteration != pb.iteration || pa.consumed_samples != pb.consumed_samples || a.adam_step() != b.adam_step();
  if (progress_differs)
    std::printf("  progress differs: iteration %lld vs %lld, consumed samples %lld vs %lld, Adam step %lld vs %lld\n",
                static_cast<long long>(pa.iteration), static_cast<long long>(pb.iteration),
                static_cast<long long>(pa.consumed_samples), static_cast<long long>(pb.consumed_samples),
                static_cast<long long>(a.adam_step()), static_cast<long long>(b.adam_step()));
  const char* damaged = sound ? "" : " (and verification fails: see above)";
  const bool tensors_agree = differing == 0 && notes.empty() && reshaped.empty();
  const char* but_progress = progress_differs ? ", but the progress differs (above)" : "";
  if (!verify) {
    std::printf("%s: %lld tensors across %zu states compared by name, shape and stored dtype%s%s; data not read or "
                "verified (--no-verify): keel ckpt diff without it compares the values\n",
                tensors_agree && !progress_differs ? "headers agree" : "headers differ",
                static_cast<long long>(compared), a.states().size(), padding_note.c_str(), but_progress);
    return tensors_agree && !progress_differs ? kExitOk : kExitFailure;
  }
  if (tensors_agree) {
    std::printf("bitwise equal: %lld tensors compared across %zu states%s%s%s\n", static_cast<long long>(compared),
                a.states().size(), padding_note.c_str(), but_progress, damaged);
    return !sound ? kExitCheckpointError : progress_differs ? kExitFailure : kExitOk;
  }
  std::printf("%lld of %lld tensors compared differ%s", static_cast<long long>(differing),
              static_cast<long long>(compared), differing > max_report ? " (first ones shown)" : "");
  if (!reshaped.empty()) std::printf("; %zu more have other shapes and were not compared", reshaped.size());
  std::printf("%s%s\n", padding_note.c_str(), damaged);
  return sound ? kExitFailure : kExitCheckpointError;
}

int cmd_verify(const std::string& path) {
  // A checkpoint whose files do not open (one missing, truncated, a header that does not parse)
  // is damaged like one whose checksums fail: the same heading, for scripts that look for it. A
  // path that holds no checkpoint at all is no damage: that error stays what it is.
  std::optional<Checkpoint> opened;
  try {
    opened.emplace(Checkpoint::open(path));
  } catch (const CheckpointError& e) {
    std::error_code ec;
    if (!std::filesystem::exists(std::filesystem::path(path) / "meta.json", ec)) throw;
    std::printf("DAMAGED: %s:\n  %s\n", path.c_str(), e.what());
    return kExitCheckpointError;
  }
  const Checkpoint& ck = *opened;
  const CheckpointProblems problems = ck.verify();
  if (problems.empty()) {
    const size_t files = ck.meta().at("files").size();
    std::printf("ok: %s is complete, every checksum matches and every value is finite (%zu file%s)\n", ck.path().c_str(),
                files, files == 1 ? "" : "s");
    if (!ck.meta_checksummed())
      std::printf("note: its meta.json has no checksum of its own (saved by an older keel): the iteration, data "
                  "position and Adam step in it could not be checked\n");
    return kExitOk;
  }
  report_problems(ck, problems, "");
  return kExitCheckpointError;
}

// keel ckpt average: the element-wise mean of checkpoints of one model, a weights-only
// checkpoint. Averaging the last checkpoints of a run (Polyak averaging; Llama 3 averaged its
// annealing checkpoints) or finetunes of one base ("model soups") often scores better than any
// one of them. Each checkpoint gives its fp32 masters when it has them, else its stored weights;
// each element's mean is summed in double in the order given and rounded once to `dtype`.
// Everything is checked before anything is written: every checkpoint verified (checksums), the
// same model (a differing field is named with both values), every tensor present with its shape.
// The output is written whole or not at all, and never over one of the inputs.
int cmd_average(const std::vector<std::string>& paths, const std::string& out_path, const std::string& dtype_option,
                bool force) {
  namespace fs = std::filesystem;
  const auto t0 = std::chrono::steady_clock::now();
  if (paths.size() < 2)
    throw ConfigError("keel ckpt average needs at least two checkpoints, got " + std::to_string(paths.size()));
  const DType dtype = parse_inference_dtype(dtype_option);
  std::vector<Checkpoint> cks;
  for (const std::string& p : paths) cks.push_back(open_undamaged(p, "average"));
  const RunConfig cfg = parse_config(cks[0].meta().at("config"), cks[0].path() + "/meta.json");
  const nlohmann::json model = to_json(cfg).at("model");
  const ParamTable table(cfg.model);
  std::vector<std::string> states;
  for (const Checkpoint& ck : cks) {
    const nlohmann::json other = to_json(parse_config(ck.meta().at("config"), ck.path() + "/meta.json")).at("model");
    // Vocabulary padding is no other model: averaged over the real rows (below).
    auto diffs = model_differences(other, model, "this one", "the first");
    std::erase_if(diffs, [](const std::string& d) { return d.starts_with("model.pad_vocab_to_multiple_of:"); });
    if (!diffs.empty()) {
      std::string msg = ck.path() + " is another model than " + cks[0].path() + ":";
      for (const auto& d : diffs) msg += "\n  " + d;
      throw CheckpointError(msg);
    }
    states.push_back(master_source(ck, table).value_or("weight"));  // fp32 values when saved
    // A run resumed under another parallel.tp pads the vocabulary otherwise: its real rows are
    // averaged, the padding rows (no token's, zero) take the first checkpoint's count.
    check_tensors_match(ck, states.back(), table, /*repadding=*/true);
  }
  const fs::path out(out_path);
  std::vector<std::string> inputs;
  for (const Checkpoint& ck : cks) inputs.push_back(ck.path());
  check_new_output(out, force, inputs);

  const fs::path tmp = temp_dir_for(out);
  int64_t parameters = 0;
  try {
    std::vector<double> sum;
    const TensorFill fill = [&](const ParamSpec& p, DType dt, void* dst) {
      const int64_t n = p.logical_numel();
      sum.assign(static_cast<size_t>(n), 0.0);
      std::vector<float> part(static_cast<size_t>(n));
      TensorRegion whole;
      whole.shape = p.shape;
      whole.offset.assign(p.shape.size(), 0);
      for (size_t k = 0; k < cks.size(); ++k) {
        read_param(cks[k], states[k], p, cfg.model.vocab_size, whole, DType::F32, part.data());
        cks[k].release(states[k], p.name);
        for (int64_t i = 0; i < n; ++i) sum[static_cast<size_t>(i)] += part[static_cast<size_t>(i)];
      }
      const double inv = 1.0 / static_cast<double>(cks.size());
      for (int64_t i = 0; i < n; ++i) {
        const auto mean = static_cast<float>(sum[static_cast<size_t>(i)] * inv);
        if (dt == DType::F32) static_cast<float*>(dst)[i] = mean;
        else static_cast<uint16_t*>(dst)[i] = dt == DType::BF16 ? f32_to_bf16(mean) : f32_to_f16(mean);
      }
      parameters += n;
    };
    // The first input's lineage (its HF model and dtype, the checkpoints it started from), with
    // the inputs ahead in init_from: the average exports, samples and chats as a finetune does,
    // finding the tokenizer and chat template where its inputs would.
    nlohmann::json source = cks[0].meta().value("source", nlohmann::json::object());
    for (size_t k = cks.size(); k-- > 0;) source = source_with_init_from(source, cks[k].path());
    source["average"] = nlohmann::json::array();
    for (size_t k = 0; k < cks.size(); ++k)
      source["average"].push_back(
          {{"path", cks[k].path()}, {"iteration", cks[k].progress().iteration}, {"state", states[k]}});
    const SaveResult saved = write_weights_checkpoint(tmp.string(), cfg, dtype, fill, source);
    // The tokenizer and HF side files of the first checkpoint come along (keel sample, convert).
    copy_side_files(cks[0].path(), tmp);
    if (fs::exists(fs::path(cks[0].path()) / "hf_config.json"))
      fs::copy_file(fs::path(cks[0].path()) / "hf_config.json", tmp / "hf_config.json");
    publish(tmp, out, force);
    std::printf("keel: averaged %zu checkpoints into %s: %zu tensors, %lld parameters, %s, %.1f MB in %.2f s\n",
                cks.size(), out_path.c_str(), table.params().size(), static_cast<long long>(parameters),
                std::string(dtype_name(dtype)).c_str(), static_cast<double>(saved.bytes) / 1e6,
                std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    for (size_t k = 0; k < cks.size(); ++k)
      std::printf("  %s (iteration %lld, %s)\n", cks[k].path().c_str(), static_cast<long long>(cks[k].progress().iteration),
                  states[k] == "master" ? "fp32 masters" : "weights");
  } catch (...) {
    std::error_code ec;
    fs::remove_all(tmp, ec);
    throw;
  }
  return kExitOk;
}

struct CkptArgs {
  std::string path, other, state = "weight", out, dtype = "fp32";
  std::vector<std::string> paths;
  int max_report = 20;
  bool force = false, no_verify = false;
};

}  // namespace

Command add_ckpt_command(CLI::App& app) {
  auto args = std::make_shared<CkptArgs>();
  CLI::App* ckpt = app.add_subcommand("ckpt", "Inspect, compare, verify and average checkpoints");
  ckpt->require_subcommand(1);
  // Set before the subcommands are added: they inherit it (else they show keel's own examples).
  ckpt->footer(
      "Examples:\n"
      "  keel ckpt inspect out/run/checkpoints            # the checkpoint its latest names\n"
      "  keel ckpt inspect --no-verify out/run/checkpoints/step_00001000\n"
      "  keel ckpt verify out/run/checkpoints/step_00001000\n"
      "  keel ckpt diff A B\n"
      "  keel ckpt average A B C --out ckpt/avg --dtype bf16\n"
      "Exit codes: 0 success, 1 diff found differences, 2 bad arguments, 5 a checkpoint is damaged or holds inf/NaN.");
  CLI::App* inspect = ckpt->add_subcommand(
      "inspect", "Step, topology, states and per-tensor norm/min/max, then verification (exit 5 if it fails)");
  inspect->add_option("path", args->path, "Checkpoint (step_* directory, or a checkpoints or run directory: the one its latest names)")->required();
  inspect->add_option("--state", args->state, "State to summarise: weight, master, adam_m or adam_v");
  inspect->add_flag("--no-verify", args->no_verify,
                    "Read meta.json and the file headers only: no checksums, values or statistics (a large "
                    "checkpoint's data is not read)");
  CLI::App* diff = ckpt->add_subcommand(
      "diff", "Per-tensor differences between two checkpoints (exit 1 if any, 5 if either fails verification)");
  diff->add_option("a", args->path, "First checkpoint")->required();
  diff->add_option("b", args->other, "Second checkpoint")->required();
  diff->add_option("--max", args->max_report, "Differing tensors to list")->check(cli::integer<int>(0));
  diff->add_flag("--no-verify", args->no_verify,
                 "Compare meta.json and the file headers only (tensors, shapes, stored dtypes, progress): no data is "
                 "read, compared or verified");
  CLI::App* verify = ckpt->add_subcommand(
      "verify", "Checksums, completeness and finite values (exit 5 if damaged or holding inf/NaN)");
  verify->add_option("path", args->path, "Checkpoint")->required();
  CLI::App* average = ckpt->add_subcommand(
      "average", "Element-wise mean of checkpoints of one model (fp32 masters when saved) as a weights-only checkpoint");
  average->add_option("checkpoints", args->paths, "Checkpoints to average (step_* directories)")->required();
  average->add_option("-o,--out", args->out, "Output folder (a weights-only checkpoint)")->required();
  average->add_option("--dtype", args->dtype, "Stored weights: fp32 (default), bf16 or fp16");
  average->add_flag("--force", args->force, "Replace --out if it exists");
  return {ckpt, [args, inspect, diff, verify, average]() -> int {
            if (inspect->parsed()) return cmd_inspect(args->path, args->state, !args->no_verify);
            if (diff->parsed()) return cmd_diff(args->path, args->other, args->max_report, !args->no_verify);
            if (verify->parsed()) return cmd_verify(args->path);
            if (average->parsed()) return cmd_average(args->paths, args->out, args->dtype, args->force);
            return kExitConfigError;
          }};
}

}  // namespace keel
