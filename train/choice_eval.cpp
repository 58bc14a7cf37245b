#include "train/choice_eval.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <limits>

#include <nlohmann/json.hpp>

#include "train/config.h"
#include "train/parallel/host_values.h"

namespace keel {

using json = nlohmann::json;

namespace {

std::vector<int32_t> id_list(const json& j, const std::string& where, int64_t vocab_size) {
  if (!j.is_array()) throw ConfigError(where + " must be a list of token ids");
  std::vector<int32_t> ids;
  for (const json& x : j) {
    if (!x.is_number_integer() || x.get<int64_t>() < 0 || x.get<int64_t>() >= vocab_size)
      throw ConfigError(where + ": " + x.dump() + " is not a token id of the model (0 .. " +
                        std::to_string(vocab_size - 1) + ")");
    ids.push_back(x.get<int32_t>());
  }
  return ids;
}

}  // namespace

std::vector<ChoiceItem> read_choice_items(const std::string& path, const data::Tokenizer* tok, int64_t vocab_size,
                                          const std::string& how_to_give_tokenizer) {
  std::ifstream in(path);
  if (!in) throw ConfigError("choice file " + path + " cannot be read");
  std::vector<ChoiceItem> items;
  std::string text;
  for (int64_t line = 1; std::getline(in, text); ++line) {
    if (text.find_first_not_of(" \t\r") == std::string::npos) continue;
    const std::string where = path + ":" + std::to_string(line);
    json j;
    try {
      j = json::parse(text);
    } catch (const json::exception& e) {
      throw ConfigError(where + " is not a JSON object: " + e.what());
    }
    if (!j.is_object()) throw ConfigError(where + " is not a JSON object");
    ChoiceItem item;
    item.line = line;
    if (j.contains("context_ids") || j.contains("ending_ids")) {
      if (!j.contains("context_ids") || !j.contains("ending_ids"))
        throw ConfigError(where + ": token-id items need both \"context_ids\" and \"ending_ids\"");
      item.context = id_list(j["context_ids"], where + " context_ids", vocab_size);
      if (!j["ending_ids"].is_array()) throw ConfigError(where + " ending_ids must be a list of lists of token ids");
      for (size_t e = 0; e < j["ending_ids"].size(); ++e)
        item.endings.push_back(id_list(j["ending_ids"][e], where + " ending_ids[" + std::to_string(e) + "]", vocab_size));
    } else {
      if (!j.contains("context") || !j["context"].is_string() || !j.contains("endings") || !j["endings"].is_array())
        throw ConfigError(where + ": an item needs \"context\" (a string) and \"endings\" (a list of strings), or "
                          "\"context_ids\" and \"ending_ids\"");
      if (!tok) throw ConfigError(where + ": a text item needs the model's tokenizer (" + how_to_give_tokenizer + ")");
      // Each ending is scored as the tokens of context + ending encoded as one text, past those
      // of the context (lm-evaluation-harness's rule): encoded on its own, a SentencePiece-style
      // tokenizer would give " ending" a second "▁". Where a token straddles the join in some
      // ending (BPE merged across it), the item's context stops before the first such token,
      // which then counts as every ending's, so context + ending stays each joined encoding.
      const std::string context = j["context"].get<std::string>();
      std::vector<std::vector<int32_t>> joined;
      size_t shared = std::numeric_limits<size_t>::max();
      for (size_t e = 0; e < j["endings"].size(); ++e) {
        if (!j["endings"][e].is_string())
          throw ConfigError(where + " endings[" + std::to_string(e) + "] is not a string");
        const std::string ending = j["endings"][e].get<std::string>();
        data::Tokenizer::Joined t = tok->encode_joined(context, ending, /*add_special_tokens=*/true);
        shared = std::min(shared, t.split);
        joined.push_back(std::move(t.ids));
        item.ending_bytes.push_back(static_cast<int64_t>(ending.size()));  // the ending's own text
      }
      if (joined.empty()) {
        item.context = tok->encode(context, /*add_special_tokens=*/true);
      } else {
        item.context.assign(joined[0].begin(), joined[0].begin() + static_cast<std::ptrdiff_t>(shared));
        for (const auto& ids : joined) item.endings.emplace_back(ids.begin() + static_cast<std::ptrdiff_t>(shared), ids.end());
        if (item.context.empty() && !tok->encode(context, true).empty())
          throw ConfigError(where + ": the context's first token merges with the start of an ending (BPE across "
                            "the join), which leaves the endings no context token to follow; end the context at a "
                            "word boundary");
      }
    }
    if (!j.contains("label"))
      throw ConfigError(where + ": \"label\" (the index of the right ending) is missing");
    if (!j["label"].is_number_integer())
      throw ConfigError(where + ": \"label\" must be an integer, the index of the right ending (0 for the first); " +
                        "got " + j["label"].dump());
    item.label = j["label"].get<int>();
    if (item.endings.size() < 2)
      throw ConfigError(where + ": " + std::to_string(item.endings.size()) + " ending(s); an item needs at least 2");
    if (item.label < 0 || item.label >= static_cast<int>(item.endings.size()))
      throw ConfigError(where + ": label " + std::to_string(item.label) + " is not an ending index (0 .. " +
                        std::to_string(item.endings.size() - 1) + ")");
    // Text encoded by a tokenizer with more ids than the model (another model's tokenizer).
    auto check_ids = [&](const std::vector<int32_t>& ids, const std::string& what) {
      for (int32_t id : ids)
        if (id >= vocab_size)
          throw ConfigError(where + ": the " + what + " encodes to token id " + std::to_string(id) +
                            ", beyond the model's vocabulary (0 .. " + std::to_string(vocab_size - 1) +
                            "): is the tokenizer the model's?");
    };
    check_ids(item.context, "context");
    for (size_t e = 0; e < item.endings.size(); ++e) check_ids(item.endings[e], "ending " + std::to_string(e));
    if (item.context.empty())
      throw ConfigError(where + ": the context has no tokens (the first ending token needs something to follow)");
    for (size_t e = 0; e < item.endings.size(); ++e)
      if (item.endings[e].empty()) throw ConfigError(where + " ending " + std::to_string(e) + " has no tokens");
    items.push_back(std::move(item));
  }
  if (items.empty()) throw ConfigError("choice file " + path + " holds no items");
  return items;
}

namespace {

// log softmax(row)[token], in double.
double log_prob(const float* row, int64_t vocab, int32_t token) {
  const double mx = *std::max_element(row, row + vocab);
  double sum = 0;
  for (int64_t v = 0; v < vocab; ++v) sum += std::exp(static_cast<double>(row[v]) - mx);
  return static_cast<double>(row[token]) - mx - std::log(sum);
}

int argmax(const std::vector<double>& v) {
  return static_cast<int>(std::max_element(v.begin(), v.end()) - v.begin());  // first of equal maxima
}

}  // namespace

ChoiceScore score_choice(Generator& gen, const ChoiceItem& item) {
  const int64_t vocab = gen.table().config().vocab_size;
  gen.reset();
  const std::vector<float> last = gen.forward(item.context.data(), static_cast<int>(item.context.size()));
  const int64_t ctx = gen.position();
  std::vector<double> logprob;
  for (const std::vector<int32_t>& end : item.endings) {
    double lp = log_prob(last.data(), vocab, end[0]);
    if (end.size() > 1) {  // rows 0 .. k-2 predict tokens 1 .. k-1
      gen.rewind(ctx);
      const std::vector<float> rows = gen.forward(end.data(), static_cast<int>(end.size()) - 1, /*all_rows=*/true);
      for (size_t i = 1; i < end.size(); ++i) lp += log_prob(rows.data() + (i - 1) * vocab, vocab, end[i]);
    }
    logprob.push_back(lp);
  }
  return choice_score(item, std::move(logprob));
}

ChoiceScore choice_score(const ChoiceItem& item, std::vector<double> logprob) {
  ChoiceScore s;
  std::vector<double> per_token, per_byte;
  for (size_t e = 0; e < item.endings.size(); ++e) {
    per_token.push_back(logprob[e] / static_cast<double>(item.endings[e].size()));
    if (!item.ending_bytes.empty())
      per_byte.push_back(logprob[e] / static_cast<double>(std::max<int64_t>(1, item.ending_bytes[e])));
  }
  s.logprob = std::move(logprob);
  s.pick = argmax(s.logprob);
  s.pick_per_token = argmax(per_token);
  if (!per_byte.empty()) s.pick_per_byte = argmax(per_byte);
  return s;
}

json choice_score_record(const ChoiceItem& item, const ChoiceScore& s) {
  json rec = {{"line", item.line}, {"label", item.label}, {"logprob", s.logprob}, {"pick", s.pick},
              {"pick_per_token", s.pick_per_token}};
  std::vector<size_t> lengths;
  for (const auto& e : item.endings) lengths.push_back(e.size());
  rec["ending_tokens"] = lengths;
  if (s.pick_per_byte >= 0) rec["pick_per_byte"] = s.pick_per_byte;
  return rec;
}

void check_choices_fit(const std::vector<ChoiceItem>& items, int64_t seq_len, const std::string& path,
                       const std::string& seq_len_name) {
  for (const ChoiceItem& item : items)
    for (size_t e = 0; e < item.endings.size(); ++e)
      if (static_cast<int64_t>(item.endings[e].size()) > seq_len)
        throw ConfigError(path + ":" + std::to_string(item.line) + " ending " + std::to_string(e) + " has " +
                          std::to_string(item.endings[e].size()) + " tokens, more than " + seq_len_name + " (" +
                          std::to_string(seq_len) + "): it cannot be scored in one row");
}

namespace {
// Context tokens that fit in a row with `ending` (at least one: the ending's first token is
// predicted from it).
size_t context_kept(const ChoiceItem& item, size_t ending_tokens, int64_t seq_len) {
  return std::min(item.context.size(), static_cast<size_t>(seq_len) + 1 - ending_tokens);
}
}  // namespace

int64_t choice_contexts_cut(const std::vector<ChoiceItem>& items, int64_t seq_len) {
  int64_t n = 0;
  for (const ChoiceItem& item : items) {
    bool cut = false;
    for (const auto& end : item.endings) cut |= context_kept(item, end.size(), seq_len) < item.context.size();
    n += cut;
  }
  return n;
}

int64_t choice_sequence(const ChoiceItem& item, size_t e, int64_t seq_len, int32_t* inputs, int32_t* targets) {
  const std::vector<int32_t>& end = item.endings[e];
  const size_t k = context_kept(item, end.size(), seq_len);
  const int64_t L = static_cast<int64_t>(k + end.size()) - 1;
  if (inputs) {
    // (kept context ++ ending)[i] is input i and the target of i - 1.
    auto token = [&](size_t i) { return i < k ? item.context[item.context.size() - k + i] : end[i - k]; };
    for (int64_t i = 0; i < L; ++i) {
      const size_t next = static_cast<size_t>(i) + 1;
      inputs[i] = token(next - 1);
      targets[i] = next >= k ? token(next) : -1;
    }
  }
  return L;
}

std::vector<ChoicePlace> place_choices(const std::vector<ChoiceItem>& items, int64_t seq_len, bool pack) {
  std::vector<ChoicePlace> places;
  int64_t rows = 0, fill = seq_len;  // as if a row were full: the first sequence opens row 0
  for (size_t i = 0; i < items.size(); ++i)
    for (size_t e = 0; e < items[i].endings.size(); ++e) {
      const int64_t L = choice_sequence(items[i], e, seq_len);
      if (!pack || fill + L > seq_len) ++rows, fill = 0;
      places.push_back({i, e, L, rows - 1, fill});
      fill += L;
    }
  return places;
}

std::vector<double> choice_logprobs(const std::vector<ChoiceItem>& items, int64_t B, int64_t T, bool pack,
                                    int64_t first, int64_t stride, int64_t group, const TokenLossFn& token_losses) {
  const std::vector<ChoicePlace> seqs = place_choices(items, T, pack);
  const int64_t rows = seqs.empty() ? 0 : seqs.back().row + 1;
  const int64_t n_mbs = (rows + B - 1) / B;
  // Where each row's sequences start in `seqs` (they are in row order).
  std::vector<size_t> row_first(static_cast<size_t>(rows) + 1, seqs.size());
  for (size_t s = seqs.size(); s-- > 0;) row_first[static_cast<size_t>(seqs[s].row)] = s;
  auto row_seqs = [&](int64_t row) {
    return std::pair<size_t, size_t>(row_first[static_cast<size_t>(row)], row_first[static_cast<size_t>(row) + 1]);
  };
  std::vector<int64_t> mine;
  for (int64_t m = first; m < n_mbs; m += stride) mine.push_back(m);
  std::vector<double> logprob(seqs.size(), 0.0);
  for (size_t g0 = 0; g0 < mine.size(); g0 += static_cast<size_t>(group)) {
    const size_t g1 = std::min(mine.size(), g0 + static_cast<size_t>(group));
    std::vector<MicroBatch> mbs(g1 - g0);
    for (size_t j = 0; j < mbs.size(); ++j) {
      MicroBatch& mb = mbs[j];
      mb.inputs.assign(static_cast<size_t>(B * T), 0);  // padding: token 0, no target, its own document
      mb.targets.assign(static_cast<size_t>(B * T), -1);
      if (pack) {
        mb.positions.resize(static_cast<size_t>(B * T));
        for (size_t n = 0; n < mb.positions.size(); ++n) mb.positions[n] = static_cast<int32_t>(n % static_cast<size_t>(T));
      }
      for (int64_t b = 0; b < B; ++b) {
        const int64_t row = mine[g0 + j] * B + b;
        if (row >= rows) break;
        const auto [s0, s1] = row_seqs(row);
        for (size_t s = s0; s < s1; ++s) {
          const ChoicePlace& p = seqs[s];
          const int64_t at = b * T + p.offset;
          choice_sequence(items[p.item], p.ending, T, mb.inputs.data() + at, mb.targets.data() + at);
          if (pack)
            for (int64_t t = 0; t < p.length; ++t) mb.positions[static_cast<size_t>(at + t)] = static_cast<int32_t>(t);
        }
        // The padding after the last sequence starts a document of its own.
        if (pack && s1 > s0)
          for (int64_t t = seqs[s1 - 1].offset + seqs[s1 - 1].length, p0 = t; t < T; ++t)
            mb.positions[static_cast<size_t>(b * T + t)] = static_cast<int32_t>(t - p0);
      }
    }
    const std::vector<double> loss = token_losses(mbs);
    for (size_t j = 0; j < mbs.size(); ++j)
      for (int64_t b = 0; b < B; ++b) {
        const int64_t row = mine[g0 + j] * B + b;
        if (row >= rows) break;
        const double* row_loss = loss.data() + (j * static_cast<size_t>(B) + static_cast<size_t>(b)) * static_cast<size_t>(T);
        const auto [s0, s1] = row_seqs(row);
        for (size_t s = s0; s < s1; ++s) {
          double sum = 0;  // the context rows' losses are 0 (no target)
          for (int64_t t = 0; t < seqs[s].length; ++t) sum += row_loss[seqs[s].offset + t];
          logprob[s] = -sum;
        }
      }
  }
  return logprob;
}

std::vector<ChoiceScore> choice_scores(const std::vector<ChoiceItem>& items, const std::vector<double>& logprobs) {
  std::vector<ChoiceScore> scores;
  size_t r = 0;
  for (const ChoiceItem& item : items) {
    std::vector<double> lp(logprobs.begin() + static_cast<std::ptrdiff_t>(r),
                           logprobs.begin() + static_cast<std::ptrdiff_t>(r + item.endings.size()));
    r += item.endings.size();
    scores.push_back(choice_score(item, std::move(lp)));
  }
  return scores;
}

std::vector<ChoiceScore> score_choices_packed(const ParamTable& table, Backend& be, const Tensor& weights,
                                              const std::vector<ChoiceItem>& items, int64_t rows, int64_t seq_len) {
  Transformer model(table, be, weights.dtype, static_cast<int>(rows), static_cast<int>(seq_len), /*slots=*/1,
                    /*tp=*/nullptr, /*recompute=*/{}, /*sequence_parallel=*/false, /*logits_chunk_rows=*/0,
                    /*document_masking=*/true);
  model.bind(weights, Tensor());  // forward only
  std::vector<float> host(static_cast<size_t>(rows * seq_len));
  auto token_losses = [&](const std::vector<MicroBatch>& mbs) {
    std::vector<double> out;
    out.reserve(mbs.size() * host.size());
    for (const MicroBatch& mb : mbs) {
      model.forward(0, mb.inputs.data(), mb.targets.data(), std::nullopt, mb.positions.data());
      be.copy_to_host(host.data(), model.row_losses(0));
      out.insert(out.end(), host.begin(), host.end());
    }
    return out;
  };
  return choice_scores(items, choice_logprobs(items, rows, seq_len, /*pack=*/true, 0, 1, 8, token_losses));
}

std::vector<ChoiceScore> score_choices(Trainer& tr, const std::vector<ChoiceItem>& items) {
  const RunConfig& cfg = tr.config();
  // A group of micro-batches at a time keeps the host batches small, and fills the pipeline.
  const int64_t group = std::max<int64_t>(8, 2 * tr.grid().pp_size());
  const std::vector<double> mine =
      choice_logprobs(items, cfg.train.micro_batch, cfg.train.seq_len, tr.model().document_masking(),
                      tr.grid().dp_rank(), tr.grid().dp_size(), group,
                      [&](const std::vector<MicroBatch>& mbs) { return tr.token_losses(mbs); });
  // Each ending is scored on one DP rank (zeros on the others): the sum is exact.
  return choice_scores(items, parallel::sum_over_ranks(*tr.comms().dp, tr.backend(), mine));
}

void ChoiceTotals::add(const ChoiceItem& item, const ChoiceScore& s) {
  ++items;
  correct += s.pick == item.label;
  correct_per_token += s.pick_per_token == item.label;
  if (s.pick_per_byte >= 0) {
    ++byte_items;
    correct_per_byte += s.pick_per_byte == item.label;
  }
  chance += 1.0 / static_cast<double>(item.endings.size());
}

}  // namespace keel
