#include "data/chat_template.h"

#include <algorithm>
#include <filesystem>
#include <stdexcept>
#include <type_traits>

#include "data/file_io.h"
#include "data/token_file.h"
#include "data/tokenizer.h"
#include "data/unicode.h"

namespace keel::data {

namespace fs = std::filesystem;
using ojson = nlohmann::ordered_json;
using detail::quoted;

namespace {

ojson read_json(const fs::path& p) {
  try {
    return ojson::parse(detail::read_file(p.string(), "tokenizer config"));
  } catch (const nlohmann::json::exception& e) {
    throw DataError(quoted(p.string()) + " is not valid JSON (" + e.what() + ")");
  }
}

// The number of leading entries a and b share.
size_t common_prefix(const std::vector<int32_t>& a, const std::vector<int32_t>& b) {
  const size_t n = std::min(a.size(), b.size());
  size_t k = 0;
  while (k < n && a[k] == b[k]) ++k;
  return k;
}

ojson first_messages(const ojson& messages, size_t n) {
  ojson out = ojson::array();
  for (size_t k = 0; k < n; ++k) out.push_back(messages[k]);
  return out;
}

// An assistant message's "weight" (axolotl's per-turn flag): whether the reply is in the loss.
// Only 0 and 1 (or false and true) mean something; a weight on another role can only be 0, since
// only assistant replies are located.
bool in_loss_by_weight(const ojson& m, size_t k) {
  const auto it = m.find("weight");
  if (it == m.end() || it->is_null()) return true;
  const bool one = (it->is_number() && it->get<double>() == 1.0) || (it->is_boolean() && it->get<bool>());
  const bool zero = (it->is_number() && it->get<double>() == 0.0) || (it->is_boolean() && !it->get<bool>());
  if (!one && !zero)
    throw std::invalid_argument("message " + std::to_string(k) + ": \"weight\" " + it->dump() +
                                " must be 0 (out of the loss) or 1 (in the loss)");
  if (one && m.value("role", "") != "assistant")
    throw std::invalid_argument("message " + std::to_string(k) + " (role " + quoted(m.value("role", "")) +
                                ") has \"weight\": 1, but only assistant replies can be in the loss");
  return one;
}

}  // namespace

const ojson* conversation_messages(const ojson& record, const std::vector<std::string>& keys) {
  if (!record.is_object()) return nullptr;
  for (const std::string& k : keys)
    if (auto it = record.find(k); it != record.end()) return &*it;
  return nullptr;
}

ojson chat_messages(const ojson& messages) {
  if (!messages.is_array()) return messages;  // the template's context says what is wrong
  static const std::vector<std::pair<std::string, std::vector<std::string>>> kRoles = {
      {"user", {"human", "user"}},
      {"assistant", {"gpt", "assistant", "model", "chatgpt", "bard", "bing"}},
      {"system", {"system"}},
      {"tool", {"tool", "function", "observation", "ipython"}}};
  ojson out = ojson::array();
  for (size_t k = 0; k < messages.size(); ++k) {
    const ojson& m = messages[k];
    if (!m.is_object() || m.contains("role") || !m.contains("from")) {
      out.push_back(m);
      continue;
    }
    const std::string from = m["from"].is_string() ? m["from"].get<std::string>() : m["from"].dump();
    std::string role, known;
    for (const auto& [r, names] : kRoles)
      for (const std::string& n : names) {
        if (n == from) role = r;
        known += (known.empty() ? "" : ", ") + n;
      }
    if (role.empty())
      throw std::invalid_argument("message " + std::to_string(k) + ": ShareGPT \"from\" " + quoted(from) +
                                  " is not a role keel knows (" + known + ")");
    ojson mapped = ojson::object();
    mapped["role"] = role;
    for (const auto& [key, v] : m.items())
      if (key == "value") mapped["content"] = v;
      else if (key != "from") mapped[key] = v;
    out.push_back(std::move(mapped));
  }
  return out;
}

ChatTemplate ChatTemplate::from_source(const std::string& source, const ojson& config, const std::string& origin) {
  ChatTemplate t;
  t.origin_ = origin;
  t.templates_.emplace_back("default", jinja::Template::parse(source, "chat template (" + origin + ")"));
  if (config.is_object()) {
    for (const auto& [key, v] : config.items()) {
      if (key.size() > 6 && key.ends_with("_token")) {
        if (v.is_string()) t.special_tokens_[key] = v;
        else if (v.is_object() && v.contains("content") && v["content"].is_string()) t.special_tokens_[key] = v["content"];
      } else if (key == "additional_special_tokens" && v.is_array()) {
        ojson list = ojson::array();
        for (const ojson& x : v) {
          if (x.is_string()) list.push_back(x);
          else if (x.is_object() && x.contains("content") && x["content"].is_string()) list.push_back(x["content"]);
        }
        t.special_tokens_[key] = list;
      }
    }
  }
  return t;
}

ChatTemplate ChatTemplate::from_path(const std::string& path, const std::string& tokenizer_dir) {
  const fs::path p(path);
  fs::path config_path, jinja_path;
  if (fs::is_directory(p)) {
    if (fs::exists(p / "chat_template.jinja")) jinja_path = p / "chat_template.jinja";
    if (fs::exists(p / "tokenizer_config.json")) config_path = p / "tokenizer_config.json";
  } else if (!fs::exists(p)) {
    throw DataError("chat template " + quoted(path) + " does not exist");
  } else if (p.extension() == ".json") {
    config_path = p;
  } else {
    jinja_path = p;
    // The template's bos_token / eos_token: beside it, else with the tokenizer it renders for.
    if (fs::exists(p.parent_path() / "tokenizer_config.json")) config_path = p.parent_path() / "tokenizer_config.json";
    else if (!tokenizer_dir.empty() && fs::exists(fs::path(tokenizer_dir) / "tokenizer_config.json"))
      config_path = fs::path(tokenizer_dir) / "tokenizer_config.json";
  }
  const ojson config = config_path.empty() ? ojson() : read_json(config_path);
  if (!jinja_path.empty()) return from_source(detail::read_file(jinja_path.string(), "chat template"), config, jinja_path.string());

  const ojson* tpl = config.is_object() && config.contains("chat_template") ? &config["chat_template"] : nullptr;
  if (!tpl || tpl->is_null())
    throw DataError("no chat template in " + quoted(path) +
                    (fs::is_directory(p) ? ": looked for chat_template.jinja and tokenizer_config.json's \"chat_template\""
                                         : ": it has no \"chat_template\"") +
                    " (a base model has none; pass --chat-template FILE.jinja)");
  const std::string origin = config_path.string();
  if (tpl->is_string()) return from_source(tpl->get<std::string>(), config, origin);
  if (!tpl->is_array())
    throw DataError(quoted(origin) + ": \"chat_template\" must be a string or a list of {\"name\", \"template\"}");
  // A list of named templates: "default" first, the others (e.g. "tool_use") after it.
  std::vector<std::pair<std::string, std::string>> named;
  for (const ojson& e : *tpl) {
    if (!e.is_object() || !e.contains("name") || !e["name"].is_string() || !e.contains("template") || !e["template"].is_string())
      throw DataError(quoted(origin) + ": each entry of \"chat_template\" needs a string \"name\" and \"template\"");
    named.emplace_back(e["name"].get<std::string>(), e["template"].get<std::string>());
  }
  std::stable_partition(named.begin(), named.end(), [](const auto& n) { return n.first == "default"; });
  if (named.empty() || named[0].first != "default")
    throw DataError(quoted(origin) + ": \"chat_template\" lists several templates and none is named \"default\"");
  ChatTemplate t = from_source(named[0].second, config, origin);
  for (size_t k = 1; k < named.size(); ++k)
    t.templates_.emplace_back(named[k].first,
                              jinja::Template::parse(named[k].second, "chat template '" + named[k].first + "' (" + origin + ")"));
  return t;
}

std::string ChatTemplate::special_token(const std::string& name) const {
  auto it = special_tokens_.find(name);
  return it != special_tokens_.end() && it->is_string() ? it->get<std::string>() : std::string();
}

// As transformers: the "tool_use" template when tools are given and there is one.
const jinja::Template& ChatTemplate::pick(const ojson& variables) const {
  const bool tools = variables.contains("tools") && !variables["tools"].is_null();
  if (tools)
    for (const auto& [name, t] : templates_)
      if (name == "tool_use") return t;
  return templates_.front().second;
}

ojson ChatTemplate::context(const ojson& messages, bool add_generation_prompt, const ojson& variables) const {
  if (!messages.is_array()) throw std::invalid_argument("messages must be a list, not " + std::string(messages.type_name()));
  for (size_t k = 0; k < messages.size(); ++k)  // roles are the template's business, as in transformers
    if (!messages[k].is_object()) throw std::invalid_argument("message " + std::to_string(k) + " must be an object");
  // As apply_chat_template: message fields that are null are dropped, and reasoning given as
  // reasoning_content, thinking or reasoning is offered under the first two names as well.
  ojson msgs = ojson::array();
  for (const ojson& m : messages) {
    ojson kept = ojson::object();
    const ojson* reasoning = nullptr;
    for (const char* key : {"reasoning_content", "thinking", "reasoning"})
      if (!reasoning && m.contains(key) && !m[key].is_null()) reasoning = &m[key];
    if (reasoning) kept["thinking"] = *reasoning;
    for (const auto& [k, v] : m.items())
      if (!v.is_null()) kept[k] = v;
    if (reasoning) kept["reasoning_content"] = *reasoning;
    msgs.push_back(std::move(kept));
  }
  ojson ctx = special_tokens_;
  ctx["messages"] = std::move(msgs);
  ctx["tools"] = nullptr;
  ctx["documents"] = nullptr;
  ctx["add_generation_prompt"] = add_generation_prompt;
  for (const auto& [k, v] : variables.items()) ctx[k] = v;
  return ctx;
}

std::string ChatTemplate::render(const ojson& messages, bool add_generation_prompt, const ojson& variables) const {
  return pick(variables).render(context(messages, add_generation_prompt, variables));
}

ChatRendering ChatTemplate::render_with_replies(const ojson& messages, const ojson& variables) const {
  ChatRendering r;
  r.text = render(messages, false, variables);
  for (size_t i = 0; i < messages.size(); ++i) {
    if (!messages[i].is_object()) continue;
    if (!in_loss_by_weight(messages[i], i)) {
      r.weight0_replies += messages[i].value("role", "") == "assistant";
      continue;
    }
    if (messages[i].value("role", "") != "assistant") continue;
    const std::string before = render(first_messages(messages, i), true, variables);
    std::string through = render(first_messages(messages, i + 1), false, variables);
    // A template may close a conversation with the eos_token (Phi-3): not part of a reply that
    // more messages follow.
    const std::string eos = special_token("eos_token");
    if (!r.text.starts_with(through) && !eos.empty() && through.ends_with(eos))
      through.resize(through.size() - eos.size());
    if (through.size() > before.size() && through.starts_with(before) && r.text.starts_with(through))
      r.replies.emplace_back(before.size(), through.size());
    else
      ++r.unplaced_replies;
  }
  return r;
}

namespace {

// Calls f on every string value inside j (object keys are names, not text the template prints).
template <class J, class F>
void for_each_string(J& j, const F& f) {
  if (j.is_string()) f(j.template get_ref<std::conditional_t<std::is_const_v<J>, const std::string&, std::string&>>());
  else if (j.is_array() || j.is_object())
    for (auto& v : j) for_each_string(v, f);
}

// A rendering of placeholders put back: the text, the byte ranges the special-token text landed
// on, and where each placeholder was, to carry offsets of the placeholders' rendering over.
struct Restored {
  std::string text;
  Tokenizer::Spans spans;
  struct Move {
    size_t from_begin, from_end, to_begin, to_end;  // a placeholder in the rendering, its text in `text`
  };
  std::vector<Move> moves;

  size_t map(size_t p) const {
    ptrdiff_t shift = 0;  // text's offset less the rendering's, past the placeholders so far
    for (const Move& m : moves) {
      if (p <= m.from_begin) break;
      if (p < m.from_end) return m.to_begin;  // inside a placeholder: where its text starts
      shift = static_cast<ptrdiff_t>(m.to_end) - static_cast<ptrdiff_t>(m.from_end);
    }
    return static_cast<size_t>(static_cast<ptrdiff_t>(p) + shift);
  }
};

// Placeholder k is marker, k in decimal, marker; false where the rendering holds the marker
// otherwise (the template cut or wrote one).
bool restore(const std::string& rendered, const std::string& marker, const std::vector<std::string>& texts, Restored& r) {
  size_t pos = 0;
  for (size_t at; (at = rendered.find(marker, pos)) != std::string::npos;) {
    r.text.append(rendered, pos, at - pos);
    size_t e = at + marker.size(), k = 0;
    const size_t digits = e;
    while (e < rendered.size() && rendered[e] >= '0' && rendered[e] <= '9' && e - digits < 9) k = k * 10 + static_cast<size_t>(rendered[e++] - '0');
    if (e == digits || rendered.compare(e, marker.size(), marker) != 0 || k >= texts.size()) return false;
    e += marker.size();
    r.moves.push_back({at, e, r.text.size(), r.text.size() + texts[k].size()});
    r.spans.emplace_back(r.text.size(), r.text.size() + texts[k].size());
    r.text += texts[k];
    pos = e;
  }
  r.text.append(rendered, pos, std::string::npos);
  return true;
}

}  // namespace

ChatTokens ChatTemplate::tokenize(const Tokenizer& tok, const ojson& messages, const ojson& variables,
                                  bool split_special_tokens) const {
  return encode_rendering(tok, messages, variables, true, split_special_tokens);
}

ChatTokens ChatTemplate::encode(const Tokenizer& tok, const ojson& messages, const ojson& variables,
                                bool split_special_tokens) const {
  return encode_rendering(tok, messages, variables, false, split_special_tokens);
}

ChatTokens ChatTemplate::encode_rendering(const Tokenizer& tok, const ojson& messages, const ojson& variables,
                                          bool replies, bool split_special_tokens) const {
  ChatTokens out;
  // The special-token text the conversation's own strings hold: keel tokenize counts it, and
  // with split_special_tokens it is kept text.
  std::string first_text;
  auto scan = [&](const std::string& s) {
    const Tokenizer::Spans sp = tok.special_token_spans(s);
    if (!sp.empty() && first_text.empty()) {
      first_text = s.substr(sp[0].first, sp[0].second - sp[0].first);
      out.special_in_text = tok.token_to_id(first_text).value_or(-1);
    }
    if (!split_special_tokens) return;
    if (const int32_t n = tok.normalized_special_in(s); n >= 0)
      throw std::invalid_argument("a message holds the text of special token " + detail::quoted(tok.id_to_token(n)) +
                                  ", which this tokenizer matches only after normalizing the text (\"normalized\": true "
                                  "in tokenizer.json's added_tokens), so --split-special-tokens cannot keep it ordinary "
                                  "text apart from the template's own special tokens. Leave out --split-special-tokens, "
                                  "or take that text out of the record");
  };
  for_each_string(messages, scan);
  for_each_string(variables, scan);

  ChatRendering r;
  Restored restored;
  if (!split_special_tokens || first_text.empty()) {
    if (replies) r = render_with_replies(messages, variables);
    else r.text = render(messages, false, variables);
    restored.text = std::move(r.text);
  } else {
    // The text to reach, and a marker it does not hold (private-use code points, from U+10FFFD
    // down), so that a placeholder cannot be mistaken for anything the conversation says.
    const std::string want = render(messages, false, variables);
    std::string marker;
    for (char32_t c = 0x10FFFD; marker.empty() || want.find(marker) != std::string::npos; --c) {
      marker.clear();
      unicode::append_utf8(marker, c);
    }
    std::vector<std::string> texts;  // placeholder k stands for texts[k]
    auto protect = [&](std::string& s) {
      const Tokenizer::Spans sp = tok.special_token_spans(s);
      if (sp.empty()) return;
      std::string t;
      size_t pos = 0;
      for (auto [b, e] : sp) {
        const std::string special = s.substr(b, e - b);
        const size_t k = std::find(texts.begin(), texts.end(), special) - texts.begin();
        if (k == texts.size()) texts.push_back(special);
        t.append(s, pos, b - pos).append(marker).append(std::to_string(k)).append(marker);
        pos = e;
      }
      s = t.append(s, pos, std::string::npos);
    };
    ojson msgs = messages, vars = variables;
    for_each_string(msgs, protect);
    for_each_string(vars, protect);
    if (replies) r = render_with_replies(msgs, vars);
    else r.text = render(msgs, false, vars);
    if (!restore(r.text, marker, texts, restored) || restored.text != want)
      throw std::invalid_argument("--split-special-tokens: the chat template does not carry the special-token text of "
                                  "this conversation (" + detail::quoted(first_text) + ") into its rendering unchanged: it looks "
                                  "for or edits that text (as a template that cuts reasoning at a special </think> does), "
                                  "so keel cannot tell it apart from the template's own special tokens. Leave out "
                                  "--split-special-tokens, or take that text out of the record");
    for (auto& [b, e] : r.replies) b = restored.map(b), e = restored.map(e);
  }
  const std::string& text = restored.text;
  const Tokenizer::Spans& spans = restored.spans;
  out.unplaced_replies = r.unplaced_replies;
  out.weight0_replies = r.weight0_replies;
  // text[b:e] encoded alone, the special-token text in it kept text.
  auto encode_range = [&](size_t b, size_t e) {
    const std::string_view piece = std::string_view(text).substr(b, e - b);
    if (spans.empty()) return tok.encode(piece, false);
    Tokenizer::Spans inside;
    for (auto [sb, se] : spans)
      if (se > b && sb < e) inside.emplace_back(std::max(sb, b) - b, std::min(se, e) - b);
    return tok.encode_with_text_spans(piece, inside, false);
  };
  out.ids = encode_range(0, text.size());
  out.reply.assign(out.ids.size(), 0);
  if (r.replies.empty()) return out;

  // Token index of each reply boundary. Fast path: the pieces between boundaries, encoded
  // alone, give the whole text's tokens (boundaries fall on token boundaries). Else each
  // boundary is where encode(text[:boundary]) stops agreeing with the whole text's tokens.
  std::vector<size_t> cuts;
  for (const auto& [b, e] : r.replies) cuts.push_back(b), cuts.push_back(e);
  std::vector<size_t> at(cuts.size());
  std::vector<int32_t> joined;
  size_t prev = 0;
  for (size_t k = 0; k < cuts.size(); ++k) {
    const std::vector<int32_t> piece = encode_range(prev, cuts[k]);
    joined.insert(joined.end(), piece.begin(), piece.end());
    at[k] = joined.size();
    prev = cuts[k];
  }
  const std::vector<int32_t> rest = encode_range(prev, text.size());
  joined.insert(joined.end(), rest.begin(), rest.end());
  if (joined != out.ids)
    for (size_t k = 0; k < cuts.size(); ++k) at[k] = common_prefix(encode_range(0, cuts[k]), out.ids);
  for (size_t k = 0; k + 1 < at.size(); k += 2)
    for (size_t t = at[k]; t < at[k + 1] && t < out.reply.size(); ++t) out.reply[t] = 1;
  return out;
}

}  // namespace keel::data
