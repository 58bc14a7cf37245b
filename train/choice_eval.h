// Multiple-choice evaluation (HellaSwag-style, as llm.c and lm-evaluation-harness score it):
// for each item, the log-likelihood of every ending given the context, and which ending the
// model prefers by
//   acc            the highest total log-likelihood,
//   acc_per_token  the highest mean per ending token (llm.c's "acc_norm"),
//   acc_per_byte   the highest total per UTF-8 byte of the ending's text (lm-evaluation-harness's
//                  "acc_norm"; text items only).
// Ties go to the first ending, as argmax does.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "data/tokenizer.h"
#include "model/generator.h"
#include "train/trainer.h"

namespace keel {

struct ChoiceItem {
  std::vector<int32_t> context;
  std::vector<std::vector<int32_t>> endings;
  std::vector<int64_t> ending_bytes;  // UTF-8 bytes of each ending's text; empty for id items
  int label = 0;
  int64_t line = 0;  // 1-based line of its file, for messages
};

// A JSONL file, one item per line (blank lines skipped), either text
//   {"context": "...", "endings": ["...", ...], "label": k}
// (the context encoded with the tokenizer's special tokens, e.g. BOS; each ending encoded on
// its own without them, so an ending that continues a word mid-sentence carries its leading
// space, as HellaSwag's " " + ending does), or token ids
//   {"context_ids": [...], "ending_ids": [[...], ...], "label": k}.
// Errors (ConfigError) name the file, the line and the field. Text items need `tok`; without
// one, the error ends with `how_to_give_tokenizer`.
std::vector<ChoiceItem> read_choice_items(const std::string& path, const data::Tokenizer* tok, int64_t vocab_size,
                                          const std::string& how_to_give_tokenizer = "pass --tokenizer");

struct ChoiceScore {
  std::vector<double> logprob;  // per ending: sum over its tokens of log p(token | all before it)
  int pick = 0, pick_per_token = 0, pick_per_byte = -1;  // -1: no byte counts
};

// The context once, then each ending from the context's cached keys and values (rewind). The
// generator must hold the context plus the longest ending; log-softmax in double from its fp32
// logits.
ChoiceScore score_choice(Generator& gen, const ChoiceItem& item);

// The picks from the endings' log-likelihoods (per token and per byte as above).
ChoiceScore choice_score(const ChoiceItem& item, std::vector<double> logprob);
// One JSON line of a scores file: {"line", "label", "logprob", "pick", "pick_per_token",
// ["pick_per_byte",] "ending_tokens"}.
nlohmann::json choice_score_record(const ChoiceItem& item, const ChoiceScore& s);

// ---- Scoring with the training forward: in-training evaluation under any TP/PP/DP layout ----
// Each ending is one row of seq_len tokens: inputs are (context ++ ending) without its last
// token, targets the next token where that is an ending token and -1 elsewhere (the context's
// own predictions, the padding), so the row's summed loss is minus the ending's log-likelihood.
// A context too long for the row loses tokens from its front (those nearest the ending stay,
// as lm-evaluation-harness truncates).
//
// An ending longer than seq_len cannot be scored: ConfigError naming `path` and the line.
void check_choices_fit(const std::vector<ChoiceItem>& items, int64_t seq_len, const std::string& path);
// Items with an ending whose row cuts context tokens.
int64_t choice_contexts_cut(const std::vector<ChoiceItem>& items, int64_t seq_len);
// Writes the row of ending e (seq_len inputs and targets).
void choice_row(const ChoiceItem& item, size_t e, int64_t seq_len, int32_t* inputs, int32_t* targets);

// Every item's score, on every rank (collective over the world): the endings packed one per row,
// micro_batch rows to a micro-batch, the DP ranks taking micro-batches in turn; each DP rank's
// log-likelihoods come from Trainer::sequence_losses and are then shared over DP.
std::vector<ChoiceScore> score_choices(Trainer& tr, const std::vector<ChoiceItem>& items);

struct ChoiceTotals {
  int64_t items = 0, correct = 0, correct_per_token = 0, correct_per_byte = 0, byte_items = 0;
  double chance = 0;  // sum over items of 1 / endings
  void add(const ChoiceItem& item, const ChoiceScore& s);
};

}  // namespace keel
