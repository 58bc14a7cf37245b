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
#include <functional>
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
// (the context encoded with the tokenizer's special tokens, e.g. BOS; each ending's tokens are
// those of context + ending encoded as one text past the context's, so an ending that continues
// a sentence carries its leading space, as HellaSwag's " " + ending does), or token ids
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
// Each ending is one sequence: inputs are (context ++ ending) without its last token, targets
// the next token where that is an ending token and -1 where it is not (the context's own
// predictions), so the sequence's summed loss is minus the ending's log-likelihood. A context
// too long for seq_len loses tokens from its front (those nearest the ending stay, as
// lm-evaluation-harness truncates).
//
// An ending longer than seq_len cannot be scored: ConfigError naming `path`, the line and the
// setting that gives seq_len.
void check_choices_fit(const std::vector<ChoiceItem>& items, int64_t seq_len, const std::string& path,
                       const std::string& seq_len_name = "train.seq_len");
// Items with an ending whose sequence cuts context tokens.
int64_t choice_contexts_cut(const std::vector<ChoiceItem>& items, int64_t seq_len);
// The sequence of ending e: its length L <= seq_len, and (when given) its L inputs and targets.
int64_t choice_sequence(const ChoiceItem& item, size_t e, int64_t seq_len, int32_t* inputs = nullptr,
                        int32_t* targets = nullptr);

// Where each ending's sequence goes, item by item and ending by ending: packed into rows of
// seq_len in order, as many as fit (pack), or one per row.
struct ChoicePlace {
  size_t item, ending;
  int64_t length, row, offset;
};
std::vector<ChoicePlace> place_choices(const std::vector<ChoiceItem>& items, int64_t seq_len, bool pack);

// Every ending's log-likelihood (item by item, ending by ending) from the packing above:
// micro_batch rows of seq_len make a micro-batch (positions on each packed sequence when pack);
// micro-batches first, first + stride, ... are built `group` at a time and handed to
// token_losses, which returns each token's loss (micro-batch, row, position order). The endings
// of other micro-batches stay 0.
using TokenLossFn = std::function<std::vector<double>(const std::vector<MicroBatch>&)>;
std::vector<double> choice_logprobs(const std::vector<ChoiceItem>& items, int64_t micro_batch, int64_t seq_len,
                                    bool pack, int64_t first, int64_t stride, int64_t group,
                                    const TokenLossFn& token_losses);
// The items' scores from all their endings' log-likelihoods, in choice_logprobs's order.
std::vector<ChoiceScore> choice_scores(const std::vector<ChoiceItem>& items, const std::vector<double>& logprobs);

// keel eval --rows: every item's score from a forward-only Transformer over `weights` (laid out
// by `table`, a single rank), the endings packed into rows of seq_len, `rows` rows per forward.
// Activations in the weights' dtype.
std::vector<ChoiceScore> score_choices_packed(const ParamTable& table, Backend& be, const Tensor& weights,
                                              const std::vector<ChoiceItem>& items, int64_t rows, int64_t seq_len);

// Every item's score, on every rank (collective over the world): packed when the model takes
// document positions (RunConfig::takes_document_positions), else one ending per row; the DP
// ranks take micro-batches in turn, Trainer::token_losses scores them, and the log-likelihoods
// are then shared over DP.
std::vector<ChoiceScore> score_choices(Trainer& tr, const std::vector<ChoiceItem>& items);

struct ChoiceTotals {
  int64_t items = 0, correct = 0, correct_per_token = 0, correct_per_byte = 0, byte_items = 0;
  double chance = 0;  // sum over items of 1 / endings
  void add(const ChoiceItem& item, const ChoiceScore& s);
};

}  // namespace keel
