// `keel eval`: multiple-choice accuracy (HellaSwag-style) of a keel checkpoint or an HF model
// (train/choice_eval.h), on the CPU or a GPU. Under mpirun/srun it is data-parallel: every rank
// loads the whole model (on its local rank's GPU) and scores items rank, rank + n, ...; the lead
// gathers the log-likelihoods, bit for bit, and reports.
#include <chrono>
#include <cstring>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <algorithm>
#include <string>

#include <unistd.h>

#include "train/checkpoint.h"
#include "train/choice_eval.h"
#include "train/cli_checks.h"
#include "train/commands.h"
#include "train/model_loading.h"
#include "train/parallel/mpi_comm.h"
#include "train/run.h"

namespace keel {

using json = nlohmann::json;

namespace {

struct EvalArgs {
  InferenceModelArgs model;
  std::string choices, scores;
  int64_t limit = 0, rows = 0, seq_len = 0;
};

// The context once, then each ending from its cached keys and values (model/generator.h).
// Scores `mine`; `items` (all of them) are checked, so every rank refuses the same bad item.
// `report`: progress lines on stderr.
std::vector<ChoiceScore> score_cached(const EvalArgs& a, const LoadedModel& lm, Backend& be,
                                      const std::vector<ChoiceItem>& items, const std::vector<ChoiceItem>& mine,
                                      bool report) {
  const ModelConfig& m = lm.table->config();
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
  std::vector<ChoiceScore> out;
  if (mine.empty()) return out;
  Generator gen(*lm.table, be, lm.weights, static_cast<int>(longest), DType::F32);
  auto last_report = std::chrono::steady_clock::now();
  int64_t done = 0, right = 0;
  for (const ChoiceItem& item : mine) {
    out.push_back(score_choice(gen, item));
    ++done;
    right += out.back().pick == item.label;
    const auto now = std::chrono::steady_clock::now();
    if (report && std::chrono::duration<double>(now - last_report).count() > 10) {
      std::fprintf(stderr, "keel: %lld/%zu items, acc %.4f so far\n", static_cast<long long>(done), mine.size(),
                   static_cast<double>(right) / static_cast<double>(done));
      last_report = now;
    }
  }
  return out;
}

// --rows: the endings packed into rows of seq_len (train/choice_eval.h), `rows` of them per
// forward of a forward-only Transformer, as keel train's choice_eval scores them. A context
// too long for the row loses tokens from its front.
std::vector<ChoiceScore> score_packed(const EvalArgs& a, const LoadedModel& lm, Backend& be,
                                      const std::vector<ChoiceItem>& items, const std::vector<ChoiceItem>& mine,
                                      bool report) {
  const ModelConfig& m = lm.table->config();
  const int64_t T = a.seq_len > 0 ? a.seq_len : std::min<int64_t>(m.max_seq_len, 1024);
  if (T > m.max_seq_len)
    throw ConfigError("--seq-len " + std::to_string(T) + " exceeds the model's " + std::to_string(m.max_seq_len) +
                      " positions");
  check_choices_fit(items, T, a.choices, "--seq-len");
  if (mine.empty()) return {};
  if (const int64_t cut = choice_contexts_cut(items, T); cut > 0 && report)
    std::fprintf(stderr, "keel: %lld contexts lose their first tokens to fit --seq-len %lld\n",
                 static_cast<long long>(cut), static_cast<long long>(T));
  const std::vector<ChoicePlace> places = place_choices(mine, T, true);
  if (report)
    std::fprintf(stderr, "keel: %zu endings packed in %lld rows of %lld, %lld rows per forward\n", places.size(),
                 static_cast<long long>(places.back().row + 1), static_cast<long long>(T),
                 static_cast<long long>(a.rows));
  return score_choices_packed(*lm.table, be, lm.weights, mine, a.rows, T);
}

// Every item's log-likelihoods on every rank, in item order; rank r scored items r, r + n, ....
// The doubles travel as their bits (int32 pairs), so the lead reports exactly what each rank
// computed.
std::vector<std::vector<double>> gather_logprobs(parallel::Comm& world, const std::vector<ChoiceItem>& items,
                                                 const std::vector<ChoiceScore>& mine) {
  const int n = world.size();
  std::vector<int64_t> count(static_cast<size_t>(n), 0);  // doubles per rank
  for (size_t i = 0; i < items.size(); ++i) count[i % n] += static_cast<int64_t>(items[i].endings.size());
  const int64_t width = std::max<int64_t>(1, *std::max_element(count.begin(), count.end()));
  std::vector<double> send(static_cast<size_t>(width), 0.0), all(static_cast<size_t>(width * n));
  size_t k = 0;
  for (const ChoiceScore& s : mine)
    for (double x : s.logprob) send[k++] = x;
  world.all_gather(Tensor(all.data(), DType::I32, {2 * width * n}), Tensor(send.data(), DType::I32, {2 * width}));
  std::vector<std::vector<double>> out(items.size());
  std::vector<int64_t> at(static_cast<size_t>(n), 0);
  for (size_t i = 0; i < items.size(); ++i) {
    const size_t r = i % n;
    const double* from = all.data() + r * width + at[r];
    out[i].assign(from, from + items[i].endings.size());
    at[r] += static_cast<int64_t>(items[i].endings.size());
  }
  return out;
}

int cmd_eval(const EvalArgs& a) {
  const InferenceModel im(a.model);
  const LoadedModel& lm = im.model;
  const ModelConfig& m = lm.table->config();
  std::optional<data::Tokenizer> tok = find_tokenizer(lm, a.model.tokenizer, /*required=*/false, "");
  std::vector<ChoiceItem> items = read_choice_items(a.choices, tok ? &*tok : nullptr, m.vocab_size);
  if (a.limit > 0 && static_cast<int64_t>(items.size()) > a.limit) items.resize(static_cast<size_t>(a.limit));

  // Data parallel under a launcher: this rank's share of the items.
  const parallel::MpiRuntime* rt = process_runtime();
  const int world_size = rt && rt->active() ? rt->world_size() : 1, rank = world_size > 1 ? rt->world_rank() : 0;
  const bool lead = rank == 0;
  std::vector<ChoiceItem> mine;
  for (size_t i = rank; i < items.size(); i += world_size) mine.push_back(items[i]);

  // The scores go to a file beside --scores, renamed over it once every item is scored: an eval
  // that fails (an item too long, non-finite logits) leaves an earlier scores file as it was.
  // Not a regular file (/dev/stdout, a pipe): written in place.
  std::ofstream scores;
  std::error_code kind_ec;
  const bool in_place = std::filesystem::exists(a.scores, kind_ec) && !std::filesystem::is_regular_file(a.scores, kind_ec);
  const std::string scores_tmp = in_place ? a.scores : a.scores + ".tmp-" + std::to_string(::getpid());
  struct RemoveUnlessKept {
    std::string path;
    ~RemoveUnlessKept() {
      std::error_code ec;
      if (!path.empty()) std::filesystem::remove(path, ec);
    }
  } unfinished;
  if (lead && !a.scores.empty()) {
    scores.open(scores_tmp);
    if (!scores) throw ConfigError("--scores " + a.scores + " cannot be written" + (in_place ? "" : " (creating " + scores_tmp + ")"));
    if (!in_place) unfinished.path = scores_tmp;
  }
  const auto t0 = std::chrono::steady_clock::now();
  const std::vector<ChoiceScore> my_scores =
      a.rows > 0 ? score_packed(a, lm, *im.backend, items, mine, lead) : score_cached(a, lm, *im.backend, items, mine, lead);
  std::vector<ChoiceScore> all_scores;
  if (world_size == 1) {
    all_scores = my_scores;
  } else {
    const parallel::Grid grid(world_size, rank, 1, 1, world_size);
    const parallel::CommGroups comms = parallel::make_host_comms(grid, *rt);
    const std::vector<std::vector<double>> logprobs = gather_logprobs(*comms.world, items, my_scores);
    for (size_t i = 0; i < items.size(); ++i) all_scores.push_back(choice_score(items[i], logprobs[i]));
  }
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (!lead) return kExitOk;
  // A NaN log-likelihood loses every comparison: the picks, and so the accuracy, would be noise.
  for (size_t i = 0; i < items.size(); ++i)
    for (size_t e = 0; e < all_scores[i].logprob.size(); ++e)
      if (!std::isfinite(all_scores[i].logprob[e]))
        throw CheckpointError(non_finite_logits_message(
            "non-finite log-likelihood for " + a.choices + ":" + std::to_string(items[i].line) + " ending " +
                std::to_string(e) + " (the logits hold inf/NaN)",
            lm, a.model.dtype));
  ChoiceTotals t;
  for (size_t i = 0; i < items.size(); ++i) {
    t.add(items[i], all_scores[i]);
    if (scores.is_open()) scores << choice_score_record(items[i], all_scores[i]).dump() << '\n';
  }
  // A full disk shows only here: the stream keeps what it could not write in its buffer.
  if (scores.is_open() && !scores.flush())
    throw ConfigError("--scores " + a.scores + " could not be written: " + std::strerror(errno));
  if (scores.is_open() && !in_place) {
    scores.close();
    std::error_code ec;
    std::filesystem::rename(scores_tmp, a.scores, ec);
    if (ec) throw ConfigError("--scores " + a.scores + " could not be written (renaming " + scores_tmp + "): " + ec.message());
    unfinished.path.clear();
  }
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
  const std::string ranks = world_size > 1 ? std::string(" on ") + std::to_string(world_size) + " ranks" : "";
  std::fprintf(stderr, "keel: scored %lld items in %.2f s%s\n", static_cast<long long>(t.items), secs, ranks.c_str());
  return kExitOk;
}

}  // namespace

Command add_eval_command(CLI::App& app) {
  auto args = std::make_shared<EvalArgs>();
  EvalArgs& s = *args;
  CLI::App* c = app.add_subcommand("eval", "Multiple-choice accuracy (HellaSwag-style) of a checkpoint or HF model");
  add_inference_model_options(c, s.model, "tokenizer.json (or its directory) for text items; default: the model's");
  c->add_option("--choices", s.choices,
                "JSONL items: {\"context\", \"endings\": [...], \"label\"} or {\"context_ids\", \"ending_ids\", \"label\"}")
      ->required();
  c->add_option("--limit", s.limit, "Score only the first N items")->check(cli::integer<int64_t>(1));
  c->add_option("--scores", s.scores, "Write each item's ending log-likelihoods and picks to this JSONL file");
  CLI::Option* rows = c->add_option("--rows", s.rows,
                "Pack the endings into rows of --seq-len tokens and score this many rows per forward, as keel "
                "train's choice_eval does (default: one item at a time, the context once, with a KV cache)")
      ->check(cli::integer<int64_t>(1));
  c->add_option("--seq-len", s.seq_len, "Row length for --rows (default: the model's positions, at most 1024)")
      ->check(cli::integer<int64_t>(1))
      ->needs(rows);  // the cached scoring has no rows: alone it would be ignored
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
