#include "train/model_loading.h"

#include <omp.h>

#include <chrono>
#include <cstdio>
#include <fstream>

#include "kernels/device.h"
#include "kernels/guarded_backend.h"
#include "train/checkpoint.h"
#include "train/cli_checks.h"
#include "train/config.h"
#include "train/hf_format.h"
#include "train/parallel/mpi_comm.h"
#include "train/run.h"

namespace keel {

namespace fs = std::filesystem;
using json = nlohmann::json;

std::string LoadedModel::summary() const {
  const ModelConfig& m = table->config();
  return description + ": " + family_name(m.family) + " model" + option_names(m) + ", " +
         std::to_string(table->logical_numel()) + " parameters";
}

LoadedModel load_model(const std::string& spec, DType dtype, Backend& be) {
  LoadedModel lm;
  lm.source = spec;
  auto alloc = [&](int64_t n) {
    Tensor t(nullptr, dtype, {n}, be.device());
    t.data = be.allocate(t.bytes());
    return t;
  };
  auto slice = [&](const ParamSpec& p) { return param_view(lm.weights, p); };
  std::vector<char> staging;
  if (auto dir = hf_path(spec)) {
    const HfCheckpoint hf = HfCheckpoint::open(*dir);
    for (const std::string& n : hf.notes()) std::fprintf(stderr, "keel: note: hf:%s: %s\n", hf.dir().c_str(), n.c_str());
    lm.table = std::make_unique<ParamTable>(hf.model());
    lm.weights = alloc(lm.table->local_numel());
    for (const ParamSpec& p : lm.table->params()) {
      staging.resize(static_cast<size_t>(p.numel) * dtype_size(dtype));
      hf.read_full(p.name, p.shape, dtype, staging.data());
      be.copy_from_host(slice(p), staging.data());
      hf.release(p.name);
    }
    lm.description = "hf:" + hf.dir() + " (" + std::string(dtype_name(hf.common_dtype())) + ")";
    lm.hf_config = hf.config_json();
    lm.tokenizer_dirs.push_back(hf.dir());
    lm.chat_templates.push_back(hf.dir());
    return lm;
  }
  // The checks train, convert and average make: a damaged tensor must not generate or score in silence.
  const Checkpoint ck = open_undamaged(spec, "load");
  const RunConfig cfg = parse_config(ck.meta().at("config"), ck.path() + "/meta.json");
  lm.table = std::make_unique<ParamTable>(cfg.model);
  lm.eod_token = cfg.data.eod_token;
  bool have_master = true;
  for (const ParamSpec& p : lm.table->params()) have_master &= ck.has("master", p.name);
  const std::string state = have_master ? "master" : "weight";
  check_tensors_match(ck, state, *lm.table);
  lm.weights = alloc(lm.table->local_numel());
  for (const ParamSpec& p : lm.table->params()) {
    TensorRegion r;
    r.shape = p.shape;
    r.offset.assign(p.shape.size(), 0);
    staging.resize(static_cast<size_t>(p.numel) * dtype_size(dtype));
    ck.read(state, p.name, r, dtype, staging.data());
    ck.release(state, p.name);
    be.copy_from_host(slice(p), staging.data());
  }
  lm.description = ck.path() + " (iteration " + std::to_string(ck.progress().iteration) + ", " +
                   (have_master ? "fp32 masters" : "weights") + ")";
  // Tokenizer and HF config: the checkpoint's own copies, the run directory above it, the
  // checkpoints and HF model it came from, and the folder of its training data (prepare_data.py
  // and keel tokenize put one there).
  const fs::path p = ck.path();
  if (fs::exists(p / "hf_config.json")) {
    std::ifstream in(p / "hf_config.json");
    lm.hf_config = json::parse(in);
  }
  const json source = ck.meta().value("source", json());
  if (source.is_object() && source.contains("hf_config") && lm.hf_config.is_null()) lm.hf_config = source["hf_config"];
  AssetTrail trail = checkpoint_assets(ck);
  lm.tokenizer_dirs = std::move(trail.tokenizer_dirs);
  lm.chat_templates = std::move(trail.chat_templates);
  return lm;
}

AssetTrail checkpoint_assets(const Checkpoint& ck) {
  const RunConfig cfg = parse_config(ck.meta().at("config"), ck.path() + "/meta.json");
  const fs::path p = ck.path();
  const std::vector<fs::path> own = {p, p.parent_path(), p.parent_path().parent_path()};
  const std::vector<fs::path> sources = source_dirs(ck.meta().value("source", json())), data_dirs = data_tokenizer_dirs(cfg);
  auto append = [](std::vector<fs::path>& to, const std::vector<fs::path>& more) { to.insert(to.end(), more.begin(), more.end()); };
  AssetTrail t;
  t.tokenizer_dirs = own;
  append(t.tokenizer_dirs, sources);
  append(t.tokenizer_dirs, data_dirs);
  // The chat template: the same trail, but the template the training data was rendered with
  // comes before the source model's, as that is the one the run learnt.
  t.chat_templates = own;
  append(t.chat_templates, data_chat_templates(cfg));
  append(t.chat_templates, sources);
  append(t.chat_templates, data_dirs);
  return t;
}

data::ChatTemplate first_chat_template(const std::vector<fs::path>& where, const std::string& model) {
  std::string looked;
  for (size_t i = 0; i < where.size(); ++i) {
    const fs::path& w = where[i];
    if (w.empty() || std::find(where.begin(), where.begin() + i, w) != where.begin() + i) continue;
    if (!fs::exists(w)) {  // a recorded source that has moved: say so, it may be why none is found
      looked += "\n  " + w.string() + " (does not exist)";
      continue;
    }
    try {
      return data::ChatTemplate::from_path(w.string());
    } catch (const data::DataError&) {
      looked += "\n  " + w.string();
    }
  }
  throw ConfigError("--chat: no chat template found for " + model + " (chat_template.jinja, or tokenizer_config.json's "
                    "\"chat_template\"); looked in:" + looked +
                    "\npass --chat-template FILE (a .jinja file, a tokenizer_config.json or a model folder; a base model has "
                    "none)");
}

std::string tokenizer_mismatch_warning(const std::vector<fs::path>& model_dirs, const RunConfig& cfg) {
  const std::string model_tok = locate_tokenizer(model_dirs, ""), data_tok = locate_tokenizer(data_tokenizer_dirs(cfg), "");
  if (model_tok.empty() || data_tok.empty()) return {};
  std::error_code ec;
  if (fs::equivalent(model_tok, data_tok, ec)) return {};
  // What decides the ids: the model's vocabulary and merges, and the added (special) tokens.
  auto ids_part = [](const std::string& path) {
    std::ifstream in(path);
    const json j = json::parse(in, nullptr, false);
    if (!j.is_object()) return json();
    return json{{"model", j.value("model", json())}, {"added_tokens", j.value("added_tokens", json())}};
  };
  const json a = ids_part(model_tok), b = ids_part(data_tok);
  if (a.is_null() || b.is_null() || a == b) return {};
  auto vocab = [](const std::string& path) {
    try {
      return std::to_string(data::Tokenizer::from_file(path).vocab_size()) + " ids";
    } catch (const std::exception&) {
      return std::string("unreadable");
    }
  };
  return "WARNING data.train was tokenized with another tokenizer than the model's: " + data_tok + " (" +
         vocab(data_tok) + ") is not " + model_tok + " (" + vocab(model_tok) +
         "). The run would learn the ids of another model's vocabulary (the loss starts far above the model's own). "
         "Tokenize the data with the model's tokenizer: keel tokenize --tokenizer " +
         fs::path(model_tok).parent_path().string();
}

std::vector<fs::path> data_tokenizer_dirs(const RunConfig& cfg) {
  std::vector<fs::path> dirs;
  for (const std::string& pattern : cfg.data.train) dirs.push_back(fs::path(pattern).parent_path());
  return dirs;
}

std::vector<fs::path> data_chat_templates(const RunConfig& cfg) {
  std::vector<fs::path> templates;
  for (const fs::path& d : data_tokenizer_dirs(cfg)) {
    const fs::path folder = d.empty() ? fs::path(".") : d, meta_path = folder / "meta.json";
    std::ifstream in(meta_path);
    const json meta = in ? json::parse(in, nullptr, false) : json();
    if (!meta.is_object() || !meta.contains("source") || !meta["source"].is_object()) continue;
    const json t = meta["source"].value("chat_template", json());
    if (!t.is_string() || t.get<std::string>().empty()) continue;
    const fs::path recorded = t.get<std::string>();
    if (recorded.is_absolute()) {
      templates.push_back(recorded);
      continue;
    }
    // keel tokenize records the template it copied beside the data, relative to the folder.
    // Older versions recorded a path relative to the directory tokenize ran in: that one is
    // taken only when the folder has none, and said, as it depends on where keel runs now.
    const fs::path beside = folder / recorded;
    if (!fs::exists(beside) && fs::exists(recorded)) {
      std::fprintf(stderr,
                   "keel: NOTE %s records source.chat_template \"%s\", which is not in %s; taking %s from the "
                   "current directory, as older keel tokenize runs meant it (tokenize again to keep the template "
                   "with the data)\n",
                   meta_path.c_str(), recorded.c_str(), folder.c_str(), fs::absolute(recorded).c_str());
      templates.push_back(recorded);
    } else {
      if (!fs::exists(beside))
        std::fprintf(stderr,
                     "keel: NOTE %s records source.chat_template \"%s\", the template the data was rendered with, "
                     "but neither %s nor %s exists\n",
                     meta_path.c_str(), recorded.c_str(), beside.c_str(), fs::absolute(recorded).c_str());
      templates.push_back(beside);
    }
  }
  return templates;
}

void add_inference_model_options(CLI::App* c, InferenceModelArgs& a, const std::string& tokenizer_help,
                                 const std::string& dtype_help) {
  c->add_option("-c,--checkpoint", a.checkpoint, "keel checkpoint (step_* or checkpoints directory, or a run directory: its latest) or hf:DIR")->required();
  c->add_option("--tokenizer", a.tokenizer, tokenizer_help);
  c->add_option("--dtype", a.dtype, dtype_help);
  c->add_option("--device", a.device, "cpu (default) or cuda");
  c->add_option("--threads", a.threads, "CPU threads")->check(cli::integer<int>(1));
}

InferenceModel::InferenceModel(const InferenceModelArgs& a) {
  if (a.threads > 0) omp_set_num_threads(a.threads);
  const DType dtype = parse_inference_dtype(a.dtype);
  backend = inference_backend(a.device);
  const auto t0 = std::chrono::steady_clock::now();
  model = load_model(a.checkpoint, dtype, *backend);
  std::fprintf(stderr, "keel: loaded %s, in %.2f s\n", model.summary().c_str(),
               std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
}

InferenceModel::~InferenceModel() {
  if (model.weights.data) backend->release(model.weights.data);
}

std::string non_finite_logits_message(const std::string& what, const LoadedModel& lm, const std::string& dtype) {
  std::string msg = what + ": the weights of " + lm.source + " hold inf/NaN";
  if (dtype == "fp16") msg += ", or the forward overflows fp16 (try --dtype fp32)";
  if (hf_path(lm.source))
    msg += " (keel convert " + lm.source + " DIR, then keel ckpt inspect DIR shows each tensor's norm, min and max)";
  else msg += " (keel ckpt inspect " + lm.source + " shows each tensor's norm, min and max)";
  return msg;
}

DType parse_inference_dtype(const std::string& name) {
  if (name == "fp32") return DType::F32;
  if (name == "bf16") return DType::BF16;
  if (name == "fp16") return DType::F16;
  throw ConfigError("--dtype " + name + ": expected fp32, bf16 or fp16");
}

std::unique_ptr<Backend> inference_backend(const std::string& device) {
  if (device != "cpu" && device != "cuda") throw ConfigError("--device " + device + ": expected cpu or cuda");
  if (device == "cuda" && !cuda_built())
    throw ConfigError("--device cuda: this keel was built without CUDA; use --device cpu");
  if (device == "cuda" && cuda_device_count() == 0)
    throw ConfigError("--device cuda: no GPU is visible to this process (check CUDA_VISIBLE_DEVICES / nvidia-smi)");
#ifdef KEEL_HAVE_CUDA
  // Under mpirun (keel eval's data parallelism) each rank takes its local rank's GPU.
  const parallel::MpiRuntime* rt = process_runtime();
  if (device == "cuda") return make_cuda_backend(rt ? rt->launch().local_rank % cuda_device_count() : 0);
#endif
  return guard_backend_memory_requested() ? make_guarded_backend(make_cpu_backend()) : make_cpu_backend();
}

std::vector<int32_t> end_of_text_ids(const data::Tokenizer& tok) {
  std::vector<int32_t> ids;
  for (const char* name : data::kEndOfTextTokens)
    if (auto id = tok.token_to_id(name)) ids.push_back(*id);
  return ids;
}

std::string locate_tokenizer(const std::vector<fs::path>& dirs, const std::string& explicit_path) {
  if (!explicit_path.empty())
    return fs::is_directory(explicit_path) ? (fs::path(explicit_path) / "tokenizer.json").string() : explicit_path;
  for (const fs::path& d : dirs)
    if (!d.empty() && fs::exists(d / "tokenizer.json")) return (d / "tokenizer.json").string();
  return "";
}

std::string tokenizer_places(const std::vector<fs::path>& dirs) {
  std::string text = "looked at:";
  for (size_t i = 0; i < dirs.size(); ++i) {
    const fs::path& d = dirs[i];
    // As locate_tokenizer: no empty folder, and each folder once.
    if (d.empty() || std::find(dirs.begin(), dirs.begin() + i, d) != dirs.begin() + i) continue;
    text += "\n  " + (d / "tokenizer.json").string() + (fs::is_directory(d) ? "" : " (its folder does not exist)");
  }
  return text;
}

void check_prompt_ids(const std::vector<int32_t>& ids, int64_t vocab_size, const std::string& what,
                      const std::string& why) {
  for (int32_t id : ids)
    if (id < 0 || id >= vocab_size)
      throw ConfigError(what + ": token " + std::to_string(id) + " is outside the model's vocabulary (" +
                        std::to_string(vocab_size) + " ids, 0 .. " + std::to_string(vocab_size - 1) + ")" + why);
}

std::optional<data::Tokenizer> find_tokenizer(const LoadedModel& lm, const std::string& explicit_path, bool required,
                                              const std::string& hint) {
  const std::string path = locate_tokenizer(lm.tokenizer_dirs, explicit_path);
  if (path.empty()) {
    if (!required) return std::nullopt;
    throw ConfigError("no tokenizer.json found for " + lm.source + "; " + tokenizer_places(lm.tokenizer_dirs) + "\n" +
                      hint);
  }
  data::Tokenizer tok = data::Tokenizer::from_file(path);
  std::fprintf(stderr, "keel: tokenizer %s: %s\n", path.c_str(), tok.describe().c_str());
  const int64_t vocab = lm.table->config().vocab_size;
  if (tok.vocab_size() > vocab)
    std::fprintf(stderr, "keel: WARNING the tokenizer has %lld ids, the model's vocabulary %lld\n",
                 static_cast<long long>(tok.vocab_size()), static_cast<long long>(vocab));
  return tok;
}

}  // namespace keel
