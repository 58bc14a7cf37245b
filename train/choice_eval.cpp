#include "train/choice_eval.h"

#include <algorithm>
#include <cmath>
#include <fstream>

#include <nlohmann/json.hpp>

#include "train/config.h"

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

std::vector<ChoiceItem> read_choice_items(const std::string& path, const data::Tokenizer* tok, int64_t vocab_size) {
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
      if (!tok) throw ConfigError(where + ": a text item needs the model's tokenizer (pass --tokenizer)");
      item.context = tok->encode(j["context"].get<std::string>(), /*add_special_tokens=*/true);
      for (size_t e = 0; e < j["endings"].size(); ++e) {
        if (!j["endings"][e].is_string())
          throw ConfigError(where + " endings[" + std::to_string(e) + "] is not a string");
        const std::string ending = j["endings"][e].get<std::string>();
        item.endings.push_back(tok->encode(ending, /*add_special_tokens=*/false));
        item.ending_bytes.push_back(static_cast<int64_t>(ending.size()));
      }
    }
    if (!j.contains("label") || !j["label"].is_number_integer())
      throw ConfigError(where + ": \"label\" (the index of the right ending) is missing");
    item.label = j["label"].get<int>();
    if (item.endings.size() < 2)
      throw ConfigError(where + ": " + std::to_string(item.endings.size()) + " ending(s); an item needs at least 2");
    if (item.label < 0 || item.label >= static_cast<int>(item.endings.size()))
      throw ConfigError(where + ": label " + std::to_string(item.label) + " is not an ending index (0 .. " +
                        std::to_string(item.endings.size() - 1) + ")");
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
  ChoiceScore s;
  std::vector<double> per_token, per_byte;
  for (size_t e = 0; e < item.endings.size(); ++e) {
    const std::vector<int32_t>& end = item.endings[e];
    double lp = log_prob(last.data(), vocab, end[0]);
    if (end.size() > 1) {  // rows 0 .. k-2 predict tokens 1 .. k-1
      gen.rewind(ctx);
      const std::vector<float> rows = gen.forward(end.data(), static_cast<int>(end.size()) - 1, /*all_rows=*/true);
      for (size_t i = 1; i < end.size(); ++i) lp += log_prob(rows.data() + (i - 1) * vocab, vocab, end[i]);
    }
    s.logprob.push_back(lp);
    per_token.push_back(lp / static_cast<double>(end.size()));
    if (!item.ending_bytes.empty()) per_byte.push_back(lp / static_cast<double>(std::max<int64_t>(1, item.ending_bytes[e])));
  }
  s.pick = argmax(s.logprob);
  s.pick_per_token = argmax(per_token);
  if (!per_byte.empty()) s.pick_per_byte = argmax(per_byte);
  return s;
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
