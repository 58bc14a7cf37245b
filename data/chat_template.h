// A model's chat template: how a conversation (a list of {"role", "content", ...} messages)
// becomes the text the model was trained on, as transformers' apply_chat_template renders it
// (data/jinja.h), and which parts of that text are the assistant's replies (the loss mask of
// chat finetuning).
//
// Where the template comes from, as transformers reads a model folder:
//   chat_template.jinja                  (newer transformers), else
//   tokenizer_config.json "chat_template": a string, or a list of {"name", "template"}: the one
//                                        named "default", or "tool_use" when tools are given
// The variables a template sees are HF's: messages, tools (null without), documents (null),
// add_generation_prompt, the special tokens of tokenizer_config.json (bos_token, eos_token, ...;
// strings or {"content": ...} entries), and any extra variables (e.g. enable_thinking).
//
// The assistant's parts are found the way a template defines them, by rendering prefixes:
// reply i spans from the end of render(messages[:i], add_generation_prompt=true) to the end of
// render(messages[:i+1]) (less a closing eos_token that later messages replace, as Phi-3's).
// That holds for any template that renders a conversation as the concatenation of its turns. A template may instead rewrite earlier replies once later
// messages follow (Qwen3 drops the reasoning of earlier turns): such replies are not located,
// stay out of the loss, and are counted (ChatRendering::unplaced_replies). An assistant message
// with "weight": 0 (axolotl's per-turn flag) stays out of the loss too: context, not a target.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "data/jinja.h"

namespace keel::data {

class Tokenizer;

struct ChatRendering {
  std::string text;                                   // render(messages), no generation prompt
  std::vector<std::pair<size_t, size_t>> replies;     // byte ranges of text that are assistant replies
  int64_t unplaced_replies = 0;                       // assistant messages whose text could not be located
  int64_t weight0_replies = 0;                        // assistant messages with "weight": 0, left out
};

struct ChatTokens {
  std::vector<int32_t> ids;    // encode(text) without added special tokens, as apply_chat_template(tokenize=True)
  std::vector<uint8_t> reply;  // per token: 1 where it belongs to an assistant reply
  int64_t unplaced_replies = 0, weight0_replies = 0;
  int32_t special_in_text = -1;  // a special token whose text a message (or a tool) holds (-1: none)
};

// The messages of a conversation record: the first of `keys` the record holds (nullptr: none).
const nlohmann::ordered_json* conversation_messages(const nlohmann::ordered_json& record, const std::vector<std::string>& keys);

// Messages as chat templates take them, {"role", "content", ...}. ShareGPT's messages,
// {"from", "value", ...}, are mapped: human and user to user; gpt, assistant, model, chatgpt,
// bard and bing to assistant; system; tool, function, observation and ipython to tool. Other
// fields are kept. Throws std::invalid_argument naming the message for a "from" not in that list.
nlohmann::ordered_json chat_messages(const nlohmann::ordered_json& messages);

class ChatTemplate {
 public:
  // `path`: a model folder, a tokenizer_config.json, or a .jinja file (special tokens then come
  // from a tokenizer_config.json beside it, else from the one in `tokenizer_dir`, the folder of
  // the tokenizer it is used with). Throws DataError naming the file when there is no template,
  // and jinja::TemplateError when it does not parse.
  static ChatTemplate from_path(const std::string& path, const std::string& tokenizer_dir = "");
  // From the template text and tokenizer_config.json's contents (null: no special tokens).
  static ChatTemplate from_source(const std::string& source, const nlohmann::ordered_json& tokenizer_config,
                                  const std::string& origin);

  // The text of `messages` (a JSON array); `variables` adds to or overrides the template's
  // variables (tools, enable_thinking, ...). Throws jinja::TemplateError (a template's
  // raise_exception included) and std::invalid_argument for messages that are not a list of
  // objects.
  std::string render(const nlohmann::ordered_json& messages, bool add_generation_prompt,
                     const nlohmann::ordered_json& variables = nlohmann::ordered_json::object()) const;
  ChatRendering render_with_replies(const nlohmann::ordered_json& messages,
                                    const nlohmann::ordered_json& variables = nlohmann::ordered_json::object()) const;
  // render_with_replies, encoded: a token is a reply's when it starts inside the reply's text
  // (exact wherever the token boundaries of the whole text fall on the reply's ends, which they
  // do in the chat templates of Llama 3, Qwen, Gemma, Phi-3 and Mistral: a reply starts after
  // a header and ends with a special token).
  //
  // With split_special_tokens, the text of special tokens in the strings of the messages and of
  // variables["tools"] (a user who writes "<|im_end|>", a system prompt that quotes one) is
  // encoded as ordinary text, while the special tokens the template writes stay special: the ids
  // are those of HF's pipeline on the rendered text with only the template's special tokens
  // matched (the messages' strings as with encode_special_tokens). That text is put in the
  // messages as placeholders that occur nowhere else, rendered, and put back, which tells where it
  // lands. A template that looks for or edits that text (one that cuts reasoning at a special
  // </think>) would render the placeholders differently from the text: the rendering is checked
  // to be the same, and std::invalid_argument says so otherwise. Throws std::invalid_argument too
  // for such text of a special token the tokenizer matches after normalizing
  // (Tokenizer::normalized_special_in).
  ChatTokens tokenize(const Tokenizer& tok, const nlohmann::ordered_json& messages,
                      const nlohmann::ordered_json& variables = nlohmann::ordered_json::object(),
                      bool split_special_tokens = false) const;
  // The same ids without locating the replies (reply all 0): one rendering, as
  // apply_chat_template(tokenize=True).
  ChatTokens encode(const Tokenizer& tok, const nlohmann::ordered_json& messages,
                    const nlohmann::ordered_json& variables = nlohmann::ordered_json::object(),
                    bool split_special_tokens = false) const;

  const std::string& origin() const { return origin_; }  // "tokenizer_config.json of DIR", ...
  // A special token's text (bos_token, eos_token, ...), or "" when the config has none.
  std::string special_token(const std::string& name) const;

 private:
  ChatTemplate() = default;
  const jinja::Template& pick(const nlohmann::ordered_json& variables) const;
  nlohmann::ordered_json context(const nlohmann::ordered_json& messages, bool add_generation_prompt,
                                 const nlohmann::ordered_json& variables) const;
  ChatTokens encode_rendering(const Tokenizer& tok, const nlohmann::ordered_json& messages,
                              const nlohmann::ordered_json& variables, bool replies, bool split_special_tokens) const;

  std::vector<std::pair<std::string, jinja::Template>> templates_;  // (name, template); "default" first
  nlohmann::ordered_json special_tokens_ = nlohmann::ordered_json::object();
  std::string origin_;
};

}  // namespace keel::data
