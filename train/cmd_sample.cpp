// `keel sample`: generate text from a keel checkpoint or an HF model directory, with a KV cache
// (model/generator.h), encoding and decoding with the model's tokenizer.json in C++.
#include <omp.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "data/tokenizer.h"
#include "kernels/device.h"
#include "kernels/guarded_backend.h"
#include "model/generator.h"
#include "train/commands.h"
#include "train/hf_format.h"
#include "train/run.h"

namespace keel {

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

struct SampleArgs {
  std::string checkpoint, prompt, prompt_ids, tokenizer, dtype = "fp32", device = "cpu";
  int max_new_tokens = 64, top_k = 0, threads = 0;
  float temperature = 0.8f, top_p = 0.95f;
  uint64_t seed = 0;
  bool no_special = false, ignore_eos = false, show_ids = false;
};

// A loaded model: its table and the flat weights on the backend.
struct LoadedModel {
  std::unique_ptr<ParamTable> table;
  Tensor weights;
  std::string description;
  json hf_config;                 // the HF config.json, when known (eos ids)
  std::vector<fs::path> tokenizer_dirs;  // where to look for tokenizer.json, best first
};

LoadedModel load_model(const std::string& spec, DType dtype, Backend& be) {
  LoadedModel lm;
  auto alloc = [&](int64_t n) {
    Tensor t(nullptr, dtype, {n}, be.device());
    t.data = be.allocate(t.bytes());
    return t;
  };
  auto slice = [&](const ParamSpec& p) { return param_view(lm.weights, p); };
  std::vector<char> staging;
  if (auto dir = hf_path(spec)) {
    const HfCheckpoint hf = HfCheckpoint::open(*dir);
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
    return lm;
  }
  const Checkpoint ck = Checkpoint::open(spec);
  const RunConfig cfg = parse_config(ck.meta().at("config"), ck.path() + "/meta.json");
  lm.table = std::make_unique<ParamTable>(cfg.model);
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
  // Tokenizer and HF config: the checkpoint's own copies, the HF model it came from, the run
  // directory above it, and the folder of its training data (prepare_data.py puts one there).
  const fs::path p = ck.path();
  lm.tokenizer_dirs = {p, p.parent_path(), p.parent_path().parent_path()};
  if (fs::exists(p / "hf_config.json")) {
    std::ifstream in(p / "hf_config.json");
    lm.hf_config = json::parse(in);
  }
  if (ck.meta().contains("source")) {
    const json& src = ck.meta()["source"];
    if (src.contains("hf_config") && lm.hf_config.is_null()) lm.hf_config = src["hf_config"];
    if (src.contains("path")) lm.tokenizer_dirs.push_back(src["path"].get<std::string>());
  }
  for (const std::string& pattern : cfg.data.train) lm.tokenizer_dirs.push_back(fs::path(pattern).parent_path());
  return lm;
}

std::vector<int32_t> parse_ids(const std::string& text) {
  std::vector<int32_t> ids;
  std::stringstream ss(text);
  std::string item;
  while (std::getline(ss, item, ',')) {
    try {
      size_t used = 0;
      ids.push_back(std::stoi(item, &used));
      if (item.find_first_not_of(" \t", used) != std::string::npos) throw std::invalid_argument(item);
    } catch (const std::exception&) {
      throw ConfigError("--prompt-ids: \"" + item + "\" is not a token id (expected e.g. 1,415,2936)");
    }
  }
  return ids;
}

std::string show_ids(const std::vector<int32_t>& ids) {
  std::string s = "[";
  for (size_t i = 0; i < ids.size(); ++i) s += (i ? ", " : "") + std::to_string(ids[i]);
  return s + "]";
}

int cmd_sample(const SampleArgs& a) {
  if (a.device != "cpu" && a.device != "cuda")
    throw ConfigError("--device " + a.device + ": expected cpu or cuda");
  if (a.device == "cuda" && !cuda_built())
    throw ConfigError("--device cuda: this keel was built without CUDA; use --device cpu");
  if (a.device == "cuda" && cuda_device_count() == 0)
    throw ConfigError("--device cuda: no GPU is visible to this process (check CUDA_VISIBLE_DEVICES / nvidia-smi)");
  if (a.threads > 0) omp_set_num_threads(a.threads);
  DType dtype = DType::F32;
  if (a.dtype == "bf16") dtype = DType::BF16;
  else if (a.dtype == "fp16") dtype = DType::F16;
  else if (a.dtype != "fp32") throw ConfigError("--dtype " + a.dtype + ": expected fp32, bf16 or fp16");
  if (!a.prompt.empty() && !a.prompt_ids.empty()) throw ConfigError("give --prompt or --prompt-ids, not both");

  std::unique_ptr<Backend> be;
#ifdef KEEL_HAVE_CUDA
  if (a.device == "cuda") be = make_cuda_backend(0);
#endif
  if (!be) be = guard_backend_memory_requested() ? make_guarded_backend(make_cpu_backend()) : make_cpu_backend();
  const auto t_load = std::chrono::steady_clock::now();
  LoadedModel lm = load_model(a.checkpoint, dtype, *be);
  const ModelConfig& m = lm.table->config();
  const std::string options = std::string(m.alibi ? ", ALiBi" : "") + (m.embedding_norm ? ", embedding norm" : "");
  std::fprintf(stderr, "keel: loaded %s: %s model%s, %lld parameters, in %.2f s\n", lm.description.c_str(),
               family_name(m.family).c_str(), options.c_str(), static_cast<long long>(lm.table->logical_numel()),
               std::chrono::duration<double>(std::chrono::steady_clock::now() - t_load).count());

  // Tokenizer: --tokenizer (a file or a directory), else the first tokenizer.json found.
  std::optional<data::Tokenizer> tok;
  std::string tok_path;
  if (!a.tokenizer.empty()) {
    tok_path = fs::is_directory(a.tokenizer) ? (fs::path(a.tokenizer) / "tokenizer.json").string() : a.tokenizer;
  } else {
    for (const fs::path& d : lm.tokenizer_dirs)
      if (!d.empty() && fs::exists(d / "tokenizer.json")) {
        tok_path = (d / "tokenizer.json").string();
        break;
      }
  }
  if (!tok_path.empty()) {
    tok = data::Tokenizer::from_file(tok_path);
    std::fprintf(stderr, "keel: tokenizer %s: %s\n", tok_path.c_str(), tok->describe().c_str());
    if (tok->vocab_size() > m.vocab_size)
      std::fprintf(stderr, "keel: WARNING the tokenizer has %lld ids, the model's vocabulary %lld\n",
                   static_cast<long long>(tok->vocab_size()), static_cast<long long>(m.vocab_size));
  } else if (a.prompt_ids.empty()) {
    std::string looked;
    for (const fs::path& d : lm.tokenizer_dirs) looked += "\n  " + (d / "tokenizer.json").string();
    throw ConfigError("no tokenizer.json found for " + a.checkpoint + "; looked at:" + looked +
                      "\npass --tokenizer PATH (or --prompt-ids to give token ids)");
  }

  std::vector<int32_t> prompt = !a.prompt_ids.empty() ? parse_ids(a.prompt_ids) : tok->encode(a.prompt, !a.no_special);
  if (prompt.empty()) throw ConfigError("the prompt has no tokens");

  GenerateOptions g;
  g.max_new_tokens = a.max_new_tokens;
  g.sampling = {a.temperature, a.top_p, a.top_k};
  g.seed = a.seed;
  if (!a.ignore_eos) {
    // End of sequence: the HF config's eos_token_id (an id or a list), else well-known names.
    if (lm.hf_config.contains("eos_token_id")) {
      const json& e = lm.hf_config["eos_token_id"];
      if (e.is_number_integer()) g.stop_ids.push_back(e.get<int32_t>());
      if (e.is_array())
        for (const json& x : e) g.stop_ids.push_back(x.get<int32_t>());
    }
    if (g.stop_ids.empty() && tok)
      for (const char* name : {"</s>", "<|end_of_text|>", "<|eot_id|>", "<|endoftext|>"})
        if (auto id = tok->token_to_id(name)) g.stop_ids.push_back(*id);
  }
  const int64_t max_len = static_cast<int64_t>(prompt.size()) + a.max_new_tokens;
  if (max_len > m.max_seq_len)
    throw ConfigError("prompt (" + std::to_string(prompt.size()) + " tokens) + --max-new-tokens " +
                      std::to_string(a.max_new_tokens) + " exceed the model's " + std::to_string(m.max_seq_len) +
                      " positions");
  Generator gen(*lm.table, *be, lm.weights, static_cast<int>(max_len), DType::F32);

  // Stream the continuation: decode prompt + new tokens and print what is new (decoding the
  // whole keeps SentencePiece spaces and multi-byte characters right).
  const std::string prompt_text = tok ? tok->decode(prompt, true) : "";
  std::printf("%s", prompt_text.c_str());
  std::fflush(stdout);
  std::vector<int32_t> all = prompt;
  size_t printed = prompt_text.size();
  const auto t0 = std::chrono::steady_clock::now();
  auto out = generate(gen, prompt, g, [&](int32_t id) {
    all.push_back(id);
    if (!tok) return;
    const std::string text = tok->decode(all, true);
    const bool partial = text.size() >= 3 && text.compare(text.size() - 3, 3, "\xEF\xBF\xBD") == 0;
    if (!partial && text.size() > printed) {
      std::printf("%s", text.substr(printed).c_str());
      std::fflush(stdout);
      printed = text.size();
    }
  });
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (tok) {
    const std::string text = tok->decode(all, true);
    if (text.size() > printed) std::printf("%s", text.substr(printed).c_str());
  }
  std::printf("\n");
  if (a.show_ids || !tok) {  // without a tokenizer the ids are the only output
    std::printf("prompt ids: %s\n", show_ids(prompt).c_str());
    std::printf("generated ids: %s\n", show_ids(out).c_str());
  }
  std::fflush(stdout);
  const bool stopped = !out.empty() && std::find(g.stop_ids.begin(), g.stop_ids.end(), out.back()) != g.stop_ids.end();
  std::fprintf(stderr, "keel: %zu new tokens in %.2f s (%.1f tokens/s)%s\n", out.size(), secs,
               secs > 0 ? out.size() / secs : 0.0, stopped ? ", stopped at end of sequence" : "");
  be->release(lm.weights.data);
  return kExitOk;
}

}  // namespace

Command add_sample_command(CLI::App& app) {
  auto args = std::make_shared<SampleArgs>();
  SampleArgs& s = *args;
  CLI::App* c = app.add_subcommand("sample", "Generate text from a checkpoint or a Hugging Face model");
  c->add_option("-c,--checkpoint", s.checkpoint, "keel checkpoint (step_* or checkpoints directory) or hf:DIR")->required();
  c->add_option("-p,--prompt", s.prompt, "Prompt text (encoded with the model's tokenizer, special tokens added)");
  c->add_option("--prompt-ids", s.prompt_ids, "Prompt as comma-separated token ids instead of text");
  c->add_option("-n,--max-new-tokens", s.max_new_tokens, "Tokens to generate (default 64)")->check(CLI::PositiveNumber);
  c->add_option("-t,--temperature", s.temperature, "Sampling temperature; 0 = greedy (default 0.8)")
      ->check(CLI::NonNegativeNumber);
  c->add_option("--top-p", s.top_p, "Nucleus sampling mass (default 0.95; 1 = off)")->check(CLI::Range(0.0, 1.0));
  c->add_option("--top-k", s.top_k, "Sample among the k most likely tokens (default 0 = off)")
      ->check(CLI::NonNegativeNumber);
  c->add_option("--seed", s.seed, "Random seed for sampling (default 0)");
  c->add_option("--tokenizer", s.tokenizer,
                "tokenizer.json (or its directory); default: the checkpoint's, its HF source's, or its training "
                "data's");
  c->add_option("--dtype", s.dtype, "Weights in memory: fp32 (default, matches HF fp32 logits), bf16, fp16");
  c->add_option("--device", s.device, "cpu (default) or cuda");
  c->add_option("--threads", s.threads, "CPU threads")->check(CLI::PositiveNumber);
  c->add_flag("--no-special-tokens", s.no_special, "Encode the prompt without the tokenizer's special tokens (BOS)");
  c->add_flag("--ignore-eos", s.ignore_eos, "Do not stop at the end-of-sequence token");
  c->add_flag("--show-ids", s.show_ids, "Also print the prompt and generated token ids (always printed without a tokenizer)");
  c->footer(
      "Examples:\n"
      "  keel sample --checkpoint hf:/models/Llama-2-7b-hf --prompt \"The capital of France is\" -t 0 -n 16\n"
      "  keel sample --checkpoint out/ft/checkpoints --prompt \"Q: why is the sky blue?\\nA:\" --top-p 0.9 --seed 3\n"
      "Generation uses a KV cache: the prompt in one forward, then one token per step.");
  return {c, [args] { return cmd_sample(*args); }};
}

}  // namespace keel
