// `keel eval`: multiple-choice accuracy (HellaSwag-style) of a keel checkpoint or an HF model
// (train/choice_eval.h), on the CPU or a GPU.
#include <omp.h>

#include <chrono>
#include <cstdio>
#include <fstream>

#include "train/choice_eval.h"
#include "train/commands.h"
#include "train/model_loading.h"
#include "train/run.h"

namespace keel {

using json = nlohmann::json;

namespace {

struct EvalArgs {
  std::string checkpoint, choices, tokenizer, scores, dtype = "fp32", device = "cpu";
  int64_t limit = 0;
  int threads = 0;
};

int cmd_eval(const EvalArgs& a) {
  if (a.threads > 0) omp_set_num_threads(a.threads);
  const DType dtype = parse_inference_dtype(a.dtype);
  std::unique_ptr<Backend> be = inference_backend(a.device);
  LoadedModel lm = load_model(a.checkpoint, dtype, *be);
  std::fprintf(stderr, "keel: loaded %s\n", lm.summary().c_str());
  const ModelConfig& m = lm.table->config();
  std::optional<data::Tokenizer> tok = find_tokenizer(lm, a.tokenizer, /*required=*/false, "");
  std::vector<ChoiceItem> items = read_choice_items(a.choices, tok ? &*tok : nullptr, m.vocab_size);
  if (a.limit > 0 && static_cast<int64_t>(items.size()) > a.limit) items.resize(static_cast<size_t>(a.limit));

  size_t longest = 0;
  for (const ChoiceItem& it : items) {
    size_t end = 0;
    for (const auto& e : it.endings) end = std::max(end, e.size());
    const size_t need = it.context.size() + end - 1;
    if (need > static_cast<size_t>(m.max_seq_len))
      throw ConfigError(a.choices + ":" + std::to_string(it.line) + ": the context and its longest ending are " +
                        std::to_string(need + 1) + " tokens, beyond the model's " + std::to_string(m.max_seq_len) +
                        " positions");
    longest = std::max(longest, need);
  }
  Generator gen(*lm.table, *be, lm.weights, static_cast<int>(longest), DType::F32);

  std::ofstream scores;
  if (!a.scores.empty()) {
    scores.open(a.scores);
    if (!scores) throw ConfigError("--scores " + a.scores + " cannot be written");
  }
  ChoiceTotals t;
  const auto t0 = std::chrono::steady_clock::now();
  auto last_report = t0;
  for (const ChoiceItem& item : items) {
    const ChoiceScore s = score_choice(gen, item);
    t.add(item, s);
    if (scores.is_open()) scores << choice_score_record(item, s).dump() << '\n';
    const auto now = std::chrono::steady_clock::now();
    if (std::chrono::duration<double>(now - last_report).count() > 10) {
      std::fprintf(stderr, "keel: %lld/%zu items, acc %.4f so far\n", static_cast<long long>(t.items), items.size(),
                   static_cast<double>(t.correct) / t.items);
      last_report = now;
    }
  }
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  auto line = [&](const char* name, int64_t right, int64_t of, const char* note) {
    std::printf("  %-14s %.4f  (%lld/%lld)%s\n", name, of ? static_cast<double>(right) / of : 0.0,
                static_cast<long long>(right), static_cast<long long>(of), note);
  };
  std::printf("keel eval %s: %lld items\n", a.choices.c_str(), static_cast<long long>(t.items));
  line("acc", t.correct, t.items, "");
  line("acc_per_token", t.correct_per_token, t.items, "  llm.c's acc_norm");
  if (t.byte_items > 0) line("acc_per_byte", t.correct_per_byte, t.byte_items, "  lm-evaluation-harness's acc_norm");
  std::printf("  %-14s %.4f\n", "chance", t.chance / t.items);
  std::fflush(stdout);
  std::fprintf(stderr, "keel: scored %lld items in %.2f s\n", static_cast<long long>(t.items), secs);
  be->release(lm.weights.data);
  return kExitOk;
}

}  // namespace

Command add_eval_command(CLI::App& app) {
  auto args = std::make_shared<EvalArgs>();
  EvalArgs& s = *args;
  CLI::App* c = app.add_subcommand("eval", "Multiple-choice accuracy (HellaSwag-style) of a checkpoint or HF model");
  c->add_option("-c,--checkpoint", s.checkpoint, "keel checkpoint (step_* or checkpoints directory) or hf:DIR")->required();
  c->add_option("--choices", s.choices,
                "JSONL items: {\"context\", \"endings\": [...], \"label\"} or {\"context_ids\", \"ending_ids\", \"label\"}")
      ->required();
  c->add_option("--limit", s.limit, "Score only the first N items")->check(CLI::PositiveNumber);
  c->add_option("--scores", s.scores, "Write each item's ending log-likelihoods and picks to this JSONL file");
  c->add_option("--tokenizer", s.tokenizer, "tokenizer.json (or its directory) for text items; default: the model's");
  c->add_option("--dtype", s.dtype, "Weights in memory: fp32 (default), bf16, fp16");
  c->add_option("--device", s.device, "cpu (default) or cuda");
  c->add_option("--threads", s.threads, "CPU threads")->check(CLI::PositiveNumber);
  c->footer(
      "Examples:\n"
      "  keel eval --checkpoint out/gpt2-124m/checkpoints --choices data/hellaswag_val.jsonl\n"
      "  keel eval --checkpoint hf:/models/gpt2 --choices data/hellaswag_val.jsonl --limit 1000 --scores s.jsonl\n"
      "Each ending is scored by its log-likelihood after the context (the context computed once, the endings\n"
      "from its cached keys and values). acc picks the highest total, acc_per_token the highest mean per token,\n"
      "acc_per_byte (text items) the highest total per byte of the ending. scripts/make_choice_file.py turns\n"
      "HellaSwag's own JSONL into this format.");
  return {c, [args] { return cmd_eval(*args); }};
}

}  // namespace keel
