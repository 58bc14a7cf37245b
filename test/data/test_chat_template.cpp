// Chat templates (data/jinja.h, data/chat_template.h) against jinja2 and transformers: the
// fixtures in test/fixtures/chat are what HF's Jinja environment renders for ~400 small
// templates, and what apply_chat_template renders and tokenizes for chat templates in the style
// of Llama 3 / 3.1, ChatML, Qwen 2.5 / 3, Mistral, Llama 2, Gemma and Phi-3
// (scripts/make_chat_fixtures.py). Rendered text must match character for character and token
// ids exactly; a template that raises must raise here too, with its message.
#include <catch2/catch.hpp>

#include <filesystem>
#include <fstream>
#include <map>
#include <set>

#include <nlohmann/json.hpp>

#include "data/chat_template.h"
#include "data/corpus.h"
#include "data/jinja.h"
#include "data/loss_mask.h"
#include "data/python_random.h"
#include "data/token_file.h"
#include "data/tokenize_corpus.h"
#include "data/tokenizer.h"
#include "data_test_util.h"

namespace keel::data {
namespace {

namespace fs = std::filesystem;
using ojson = nlohmann::ordered_json;
using test::TempDir;

const std::string kDir = std::string(KEEL_FIXTURE_DIR) + "/chat/";

ojson load(const std::string& name) {
  std::ifstream in(kDir + name);
  REQUIRE(in);
  return ojson::parse(in);
}

std::string show(const std::string& s) { return ojson(s).dump(); }  // quoted, escapes visible

const Tokenizer& fixture_tokenizer() {
  static const Tokenizer tok = Tokenizer::from_file(kDir + "tokenizer.json");
  return tok;
}

// The template variables of a fixture conversation: tools and extra, as the script passed them.
ojson variables_of(const ojson& conv) {
  ojson v = ojson::object();
  if (conv.contains("tools")) v["tools"] = conv["tools"];
  if (conv.contains("extra"))
    for (const auto& [k, x] : conv["extra"].items()) v[k] = x;
  return v;
}

TEST_CASE("jinja: the fixture cases render as jinja2 renders them", "[chat][jinja]") {
  const ojson cases = load("jinja_cases.json")["cases"];
  REQUIRE(cases.size() > 300);
  std::vector<std::string> failures;
  int errors = 0;
  for (const ojson& c : cases) {
    const std::string name = c["name"];
    std::string got, error;
    try {
      got = jinja::Template::parse(c["template"].get<std::string>(), name).render(c["context"]);
    } catch (const jinja::TemplateError& e) {
      error = e.what();
    }
    if (c.contains("output")) {
      if (!error.empty()) failures.push_back(name + ": threw " + error);
      else if (got != c["output"]) failures.push_back(name + ": got " + show(got) + ", jinja2 " + c["output"].dump());
      continue;
    }
    ++errors;
    // jinja2 raised: so must keel; a template's own message (raise_exception) must come through.
    if (error.empty()) failures.push_back(name + ": rendered " + show(got) + ", jinja2 raised " + c["error"].dump());
    else if (c["error_type"] == "TemplateError" && error.find(c["error"].get<std::string>()) == std::string::npos)
      failures.push_back(name + ": message " + show(error) + " lacks " + c["error"].dump());
  }
  for (const std::string& f : failures) UNSCOPED_INFO(f);
  CHECK(failures.empty());
  CHECK(errors > 20);
}

TEST_CASE("jinja: errors name the template and the line", "[chat][jinja]") {
  try {
    jinja::Template::parse("line one\n{% if x %}\n{{ x.y.z }}\n{% endif %}", "my template").render(ojson{{"x", {{"a", 1}}}});
    FAIL("no error");
  } catch (const jinja::TemplateError& e) {
    CHECK_THAT(e.what(), Catch::Contains("my template, line 3") && Catch::Contains("'y'"));
  }
  try {
    jinja::Template::parse("a\nb {% for x in y %}", "t");
    FAIL("no error");
  } catch (const jinja::TemplateError& e) {
    CHECK_THAT(e.what(), Catch::Contains("'for'") && Catch::Contains("endfor"));
  }
  CHECK_THROWS_WITH(jinja::Template::parse("{% call foo() %}{% endcall %}", "t"), Catch::Contains("not supported"));
  CHECK_THROWS_WITH(jinja::Template::parse("{{ 'abc }}", "t"), Catch::Contains("unterminated string"));
  // strftime_now reads the injected clock (reproducible data); 2024-07-26 12:00 UTC.
  const std::string day = jinja::Template::parse("{{ strftime_now('%Y-%m') }}").render(ojson::object(), [] { return std::time_t{1721995200}; });
  CHECK(day == "2024-07");
}

TEST_CASE("chat templates render and tokenize as apply_chat_template", "[chat]") {
  const ojson fx = load("templates.json");
  const Tokenizer& tok = fixture_tokenizer();
  int conversations = 0, raised = 0;
  for (const auto& [name, t] : fx["templates"].items()) {
    const ChatTemplate chat = ChatTemplate::from_source(t["template"], t["special_tokens"], name);
    for (const ojson& conv : t["conversations"]) {
      INFO(name << " / " << conv["name"].get<std::string>());
      const ojson vars = variables_of(conv);
      if (conv.contains("error")) {
        ++raised;
        CHECK_THROWS_WITH(chat.render(conv["messages"], conv["add_generation_prompt"], vars),
                          Catch::Contains(conv["error"].get<std::string>()));
        continue;
      }
      ++conversations;
      const std::string text = chat.render(conv["messages"], conv["add_generation_prompt"], vars);
      CHECK(text == conv["text"].get<std::string>());
      CHECK(tok.encode(text, false) == conv["ids"].get<std::vector<int32_t>>());
    }
  }
  CHECK(conversations >= 40);
  CHECK(raised >= 10);
}

// The replies: every answered conversation's assistant messages are found, their text is the
// message's content as the template writes it, and the rest of the rendering is out.
TEST_CASE("chat templates: the assistant replies of a rendering", "[chat]") {
  const ojson fx = load("templates.json");
  const Tokenizer& tok = fixture_tokenizer();
  int checked = 0;
  for (const auto& [name, t] : fx["templates"].items()) {
    const ChatTemplate chat = ChatTemplate::from_source(t["template"], t["special_tokens"], name);
    for (const ojson& conv : t["conversations"]) {
      if (conv.contains("error") || conv["add_generation_prompt"].get<bool>()) continue;
      INFO(name << " / " << conv["name"].get<std::string>());
      const ojson vars = variables_of(conv);
      const ojson& messages = conv["messages"];
      const ChatRendering r = chat.render_with_replies(messages, vars);
      CHECK(r.text == conv["text"].get<std::string>());
      std::vector<std::string> contents;
      for (const ojson& m : messages)
        if (m["role"] == "assistant") contents.push_back(m.contains("content") && m["content"].is_string() ? m["content"].get<std::string>() : "");
      // Qwen 3 rewrites earlier replies (their reasoning is dropped): those are not placed.
      const bool rewrites = name == "qwen3_think";
      if (!rewrites) CHECK(r.unplaced_replies == 0);
      CHECK(r.replies.size() + static_cast<size_t>(r.unplaced_replies) == contents.size());
      for (size_t k = 0; k < r.replies.size(); ++k) {
        const auto [b, e] = r.replies[k];
        const std::string reply = r.text.substr(b, e - b);
        const std::string& content = contents[contents.size() - r.replies.size() + k];
        // The content, stripped of the whitespace templates trim, lies inside the reply.
        const std::string core(python_strip(content));
        CHECK_THAT(reply, Catch::Contains(core));
      }
      // Tokens: the reply tokens decode to exactly the reply texts.
      const ChatTokens ct = chat.tokenize(tok, messages, vars);
      CHECK(ct.ids == conv["ids"].get<std::vector<int32_t>>());
      // Decoded run by run: a character's bytes may span tokens.
      std::string in_loss, expected;
      std::vector<int32_t> run;
      for (size_t i = 0; i <= ct.ids.size(); ++i) {
        if (i < ct.ids.size() && ct.reply[i]) {
          run.push_back(ct.ids[i]);
        } else if (!run.empty()) {
          in_loss += tok.decode(run);
          run.clear();
        }
      }
      for (const auto& [b, e] : r.replies) expected += r.text.substr(b, e - b);
      CHECK(in_loss == expected);
      ++checked;
    }
  }
  CHECK(checked >= 12);
}

TEST_CASE("chat templates load from tokenizer_config.json and chat_template.jinja", "[chat]") {
  const ojson fx = load("config_cases.json");
  TempDir dir;
  fs::copy_file(kDir + "tokenizer_config.json", dir / "tokenizer_config.json");
  // A string template, bos_token as a string and eos_token as an AddedToken object.
  const ChatTemplate plain = ChatTemplate::from_path(dir.str());
  CHECK(plain.special_token("bos_token") == "<|begin_of_text|>");
  CHECK(plain.special_token("eos_token") == "<|eot_id|>");
  CHECK(plain.special_token("unk_token").empty());
  for (const ojson& c : fx["cases"]) {
    const ChatTemplate chat = ChatTemplate::from_path(kDir + c["file"].get<std::string>());
    for (const ojson& r : c["renders"]) {
      INFO(c["file"].get<std::string>() << " / " << r["name"].get<std::string>());
      CHECK(chat.render(r["messages"], r["add_generation_prompt"], variables_of(r)) == r["text"].get<std::string>());
    }
  }
  // chat_template.jinja wins over tokenizer_config.json, which still gives the special tokens.
  {
    std::ofstream(dir / "chat_template.jinja") << "{{ bos_token }}{% for m in messages %}[{{ m.role }}]{% endfor %}\n";
  }
  const ChatTemplate jinja_file = ChatTemplate::from_path(dir.str());
  CHECK(jinja_file.render(ojson::parse(R"([{"role":"user","content":"x"}])"), false) == "<|begin_of_text|>[user]");
  // A .jinja of one's own, elsewhere: its bos_token / eos_token are the tokenizer's, from the
  // tokenizer folder it renders for (was: undefined, and the template's error).
  TempDir mine;
  std::ofstream(mine / "mine.jinja") << "{{ bos_token }}{% for m in messages %}{{ m.content }}{{ eos_token }}{% endfor %}";
  const ojson hi = ojson::parse(R"([{"role":"user","content":"hi"}])");
  CHECK(ChatTemplate::from_path(mine / "mine.jinja", dir.str()).render(hi, false) == "<|begin_of_text|>hi<|eot_id|>");
  CHECK(ChatTemplate::from_path(mine / "mine.jinja").special_token("eos_token").empty());
  // No template: the error names the folder and what was looked for.
  TempDir empty;
  CHECK_THROWS_WITH(ChatTemplate::from_path(empty.str()), Catch::Contains("no chat template") && Catch::Contains("chat_template.jinja"));
}

// The text of a token file's in-loss spans, decoded span by span and concatenated.
std::string decoded_in_loss(const std::string& bin, const Tokenizer& tok) {
  const TokenFile f = TokenFile::open(bin);
  std::vector<int32_t> ids(static_cast<size_t>(f.num_tokens()));
  f.read(0, f.num_tokens(), ids.data());
  const auto mask = LossMask::open_for(f);
  REQUIRE(mask);
  std::string text;
  std::vector<int32_t> span;
  for (int64_t i = 0; i <= f.num_tokens(); ++i) {
    if (i < f.num_tokens() && mask->in_loss(i)) {
      span.push_back(ids[static_cast<size_t>(i)]);
    } else if (!span.empty()) {
      text += tok.decode(span);
      span.clear();
    }
  }
  return text;
}

// keel tokenize --chat over chat.jsonl: the token stream is the conversations in the shuffled
// order, each as apply_chat_template(tokenize=True) gives it plus the end of text; the mask
// keeps exactly the assistant replies as the template writes them.
struct ChatRun {
  std::string template_name;  // in templates.json / chat_rendered.json
  std::string reply_end;      // what the template writes after a reply's content
  bool jinja_file;            // --chat-template FILE.jinja, else the tokenizer folder's config
};

TEST_CASE("keel tokenize --chat: apply_chat_template's tokens, the assistant replies in the loss", "[chat][tokenize]") {
  const ojson rendered = load("chat_rendered.json")["templates"];
  std::vector<ojson> records;
  {
    std::ifstream in(kDir + "chat.jsonl");
    for (std::string line; std::getline(in, line);) records.push_back(ojson::parse(line));
  }
  const Tokenizer& tok = fixture_tokenizer();
  const int32_t eot = *tok.token_to_id("<|endoftext|>");
  for (const ChatRun& run : {ChatRun{"llama3", "<|eot_id|>", false}, ChatRun{"chatml_qwen25", "<|im_end|>\n", true}}) {
    INFO(run.template_name);
    TempDir dir;
    TokenizeOptions o;
    o.jsonl = {kDir + "chat.jsonl"};
    o.chat = true;
    o.tokenizer = kDir;  // tokenizer.json and tokenizer_config.json (the llama3 template)
    if (run.jinja_file) {
      std::ofstream(dir / "t.jinja") << load("templates.json")["templates"][run.template_name]["template"].get<std::string>();
      o.chat_template = dir / "t.jinja";
    }
    o.val_fraction = 0;
    o.threads = 2;
    o.out = dir / "out";
    const TokenizeResult r = tokenize_corpus(o, [](const std::string&) {});
    REQUIRE(r.train.documents == static_cast<int64_t>(records.size()));
    CHECK(r.train.unplaced_replies == 0);
    CHECK(r.train.without_replies == 0);

    std::vector<uint64_t> order(records.size());
    for (size_t k = 0; k < order.size(); ++k) order[k] = k;
    PythonRandom(o.seed).shuffle(order);
    std::vector<int32_t> want_ids;
    std::string want_in_loss;
    for (uint64_t k : order) {
      const ojson& oracle = rendered[run.template_name][k];
      for (int32_t id : oracle["ids"].get<std::vector<int32_t>>()) want_ids.push_back(id);
      want_ids.push_back(eot);
      for (const ojson& m : records[k]["messages"])
        if (m["role"] == "assistant")
          want_in_loss += std::string(run.template_name == "llama3" ? python_strip(m["content"].get<std::string>())
                                                                    : m["content"].get<std::string>()) + run.reply_end;
    }
    const TokenFile f = TokenFile::open(dir / "out/train_000.bin");
    std::vector<int32_t> got(static_cast<size_t>(f.num_tokens()));
    f.read(0, f.num_tokens(), got.data());
    CHECK(got == want_ids);
    CHECK(decoded_in_loss(dir / "out/train_000.bin", tok) == want_in_loss);
    CHECK(r.train.in_loss == LossMask::open_for(f)->count_in_loss());
    std::ifstream meta_in(dir / "out/meta.json");
    const auto meta = nlohmann::json::parse(meta_in);
    CHECK(meta["source"]["kind"] == "jsonl conversations");
    CHECK_THAT(meta["loss_mask"]["kind"].get<std::string>(), Catch::StartsWith("assistant"));
  }
}

// ShareGPT records ({"conversations": [{"from", "value"}]}) are the same conversations; an
// assistant message with "weight": 0 is context, out of the loss.
TEST_CASE("keel tokenize --chat: ShareGPT records and per-turn weights", "[chat][tokenize]") {
  std::vector<ojson> records;
  {
    std::ifstream in(kDir + "chat.jsonl");
    for (std::string line; std::getline(in, line);) records.push_back(ojson::parse(line));
  }
  TempDir dir;
  const std::map<std::string, std::string> from_of{{"user", "human"}, {"assistant", "gpt"}, {"system", "system"}, {"tool", "tool"}};
  int64_t weighted = 0;
  std::string want_in_loss;  // the replies that keep weight 1, in the shuffled order (llama3: stripped, then <|eot_id|>)
  {
    std::ofstream sharegpt(dir / "sharegpt.jsonl"), weights(dir / "weights.jsonl");
    for (const ojson& r : records) {
      ojson conv = ojson::array(), msgs = ojson::array();
      bool first_reply = true;
      for (ojson m : r["messages"]) {
        ojson sg = ojson::object();
        sg["from"] = from_of.at(m["role"].get<std::string>());
        sg["value"] = m["content"];
        for (const auto& [k, v] : m.items())
          if (k != "role" && k != "content") sg[k] = v;
        conv.push_back(sg);
        if (m["role"] == "assistant" && first_reply && r["messages"].size() > 3) {  // the first of several replies
          m["weight"] = weighted % 2 ? ojson(false) : ojson(0);
          ++weighted;
        } else if (m["role"] == "assistant") {
          m["weight"] = 1;
        }
        if (m["role"] == "assistant") first_reply = false;
        msgs.push_back(m);
      }
      ojson rec = r;
      rec.erase("messages");
      rec["conversations"] = conv;
      sharegpt << rec.dump() << "\n";
      rec.erase("conversations");
      rec["messages"] = msgs;
      weights << rec.dump() << "\n";
    }
  }
  REQUIRE(weighted > 2);
  TokenizeOptions o;
  o.chat = true;
  o.tokenizer = kDir;
  o.val_fraction = 0;
  o.jsonl = {kDir + "chat.jsonl"};
  o.out = dir / "messages";
  const TokenizeResult plain = tokenize_corpus(o, [](const std::string&) {});
  o.jsonl = {dir / "sharegpt.jsonl"};
  o.out = dir / "sharegpt";
  const TokenizeResult sharegpt = tokenize_corpus(o, [](const std::string&) {});
  CHECK(sharegpt.train.documents == plain.train.documents);
  for (const char* f : {"/train_000.bin", "/train_000.mask"})
    CHECK(test::read_bytes(dir / "sharegpt" + f) == test::read_bytes(dir / "messages" + f));

  o.jsonl = {dir / "weights.jsonl"};
  o.out = dir / "weights";
  const TokenizeResult w = tokenize_corpus(o, [](const std::string&) {});
  CHECK(w.train.weight0_replies == weighted);
  CHECK(test::read_bytes(dir / "weights/train_000.bin") == test::read_bytes(dir / "messages/train_000.bin"));
  std::vector<uint64_t> order(records.size());
  for (size_t k = 0; k < order.size(); ++k) order[k] = k;
  PythonRandom(o.seed).shuffle(order);
  std::ifstream in(dir / "weights.jsonl");
  std::vector<ojson> weighted_records;
  for (std::string line; std::getline(in, line);) weighted_records.push_back(ojson::parse(line));
  for (uint64_t k : order)
    for (const ojson& m : weighted_records[k]["messages"])
      if (m["role"] == "assistant" && m.value("weight", ojson(1)) != ojson(0) && m.value("weight", ojson(1)) != ojson(false))
        want_in_loss += std::string(python_strip(m["content"].get<std::string>())) + "<|eot_id|>";
  CHECK(decoded_in_loss(dir / "weights/train_000.bin", fixture_tokenizer()) == want_in_loss);
  CHECK(w.train.in_loss < plain.train.in_loss);

  // What is refused, with the file and line: a ShareGPT role keel does not know, a weight that
  // is neither 0 nor 1, and a weight of 1 on a message that is not a reply.
  auto refused = [&](const std::string& record) {
    std::ofstream(dir / "bad.jsonl") << R"({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]})"
                                     << "\n" << record << "\n";
    o.jsonl = {dir / "bad.jsonl"};
    o.out = dir / "bad";
    std::string msg;
    try {
      tokenize_corpus(o, [](const std::string&) {});
    } catch (const std::exception& e) {
      msg = e.what();
    }
    CHECK(!fs::exists(dir / "bad/train_000.bin"));
    return msg;
  };
  CHECK_THAT(refused(R"({"conversations": [{"from": "narrator", "value": "a"}]})"),
             Catch::Contains("bad.jsonl:2") && Catch::Contains("'narrator'") && Catch::Contains("human"));
  CHECK_THAT(refused(R"({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b", "weight": 0.5}]})"),
             Catch::Contains("bad.jsonl:2") && Catch::Contains("\"weight\" 0.5 must be 0"));
  CHECK_THAT(refused(R"({"messages": [{"role": "user", "content": "a", "weight": 1}, {"role": "assistant", "content": "b"}]})"),
             Catch::Contains("bad.jsonl:2") && Catch::Contains("only assistant replies"));
}

TEST_CASE("keel tokenize --chat: bad records and mismatched templates are named", "[chat][tokenize]") {
  TempDir dir;
  TokenizeOptions o;
  o.chat = true;
  o.tokenizer = kDir;
  o.val_fraction = 0;
  o.out = dir / "out";
  // A record whose messages is not a list: the file and line.
  o.jsonl = {kDir + "chat_bad.jsonl"};
  CHECK_THROWS_WITH(tokenize_corpus(o, [](const std::string&) {}),
                    Catch::Contains("chat_bad.jsonl:2") && Catch::Contains("'messages' must be a list"));
  CHECK(!fs::exists(dir / "out/train_000.bin"));
  // A conversation the template refuses: its raise_exception message, with the file and line.
  {
    std::ofstream(dir / "gemma.jinja") << load("templates.json")["templates"]["gemma"]["template"].get<std::string>();
    std::ofstream(dir / "sys.jsonl") << R"({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]})" << "\n"
                                     << R"({"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "a"}]})" << "\n";
  }
  o.jsonl = {dir / "sys.jsonl"};
  o.chat_template = dir / "gemma.jinja";
  CHECK_THROWS_WITH(tokenize_corpus(o, [](const std::string&) {}), Catch::Contains("sys.jsonl:2") && Catch::Contains("ystem role"));
  // A template whose special tokens the tokenizer lacks: another model's template.
  o.jsonl = {kDir + "chat.jsonl"};
  o.chat_template = kDir + "tokenizer_config.json";
  o.tokenizer = std::string(KEEL_FIXTURE_DIR) + "/tokenizers/gpt2.json";
  CHECK_THROWS_WITH(tokenize_corpus(o, [](const std::string&) {}),
                    Catch::Contains("<|begin_of_text|>") && Catch::Contains("different models"));
  // A second BOS would come from --add-special-tokens.
  o.tokenizer = kDir;
  o.add_special_tokens = true;
  CHECK_THROWS_WITH(tokenize_corpus(o, [](const std::string&) {}), Catch::Contains("BOS would come twice"));
  // A template without --chat would be ignored: refused instead.
  o.add_special_tokens = false;
  o.chat = false;
  CHECK_THROWS_WITH(tokenize_corpus(o, [](const std::string&) {}), Catch::Contains("--chat-template applies to --chat only"));
  CHECK(!fs::exists(dir / "out/train_000.bin"));
}

// --split-special-tokens with conversations (scripts/make_chat_split_special_fixture.py): the
// special-token text in messages, system prompts and tools is ordinary text, the special tokens
// the template writes stay special, and the ids are HF's for that text, id for id, with the mask
// of the replies. The fixture's tokenizer is the chat tokenizer with the fixture's non-special
// added tokens appended, as the script appends them.
std::string split_fixture_tokenizer_json(const ojson& fx) {
  ojson doc = load("tokenizer.json");
  int32_t id = static_cast<int32_t>(doc["model"]["vocab"].size());
  for (ojson a : fx["added_tokens"]) {
    a["id"] = id++;
    doc["added_tokens"].push_back(a);
  }
  return doc.dump();
}

TEST_CASE("chat templates: --split-special-tokens keeps the messages' special-token text ordinary text",
          "[chat][split_special]") {
  const ojson fx = load("split_special_chat.json");
  const ojson templates = load("templates.json")["templates"];
  const Tokenizer tok = Tokenizer::from_json(split_fixture_tokenizer_json(fx), "chat tokenizer + added tokens");
  const int32_t tool_response = *tok.token_to_id("<tool_response>");
  REQUIRE_FALSE(tok.is_special(tool_response));
  int cases = 0, with_special_text = 0, with_tools = 0;
  std::set<std::string> template_names;
  for (const ojson& c : fx["cases"]) {
    const std::string name = c["template"];
    INFO(name << " / " << c["name"].get<std::string>());
    const ChatTemplate chat = ChatTemplate::from_source(templates[name]["template"], templates[name]["special_tokens"], name);
    const ojson vars = variables_of(c);
    const auto want = c["ids"].get<std::vector<int32_t>>();
    const auto want_mask = c["mask"].get<std::vector<uint8_t>>();
    const auto want_default = c["default_ids"].get<std::vector<int32_t>>();
    const int32_t special_in_text = c["special_in_text"].is_null() ? -1 : *tok.token_to_id(c["special_in_text"].get<std::string>());

    const ChatTokens split = chat.tokenize(tok, c["messages"], vars, true);
    CHECK(split.ids == want);
    CHECK(split.reply == want_mask);
    CHECK(split.unplaced_replies == 0);
    CHECK(split.special_in_text == special_in_text);
    CHECK(tok.decode(split.ids) == c["text"].get<std::string>());  // the ids spell the rendering
    // The template's special tokens stay special: <|im_start|> / <|start_header_id|> / [INST]
    // open every turn, and none of the conversation's special-token text became a token.
    const char* opener = name == "llama3" ? "<|start_header_id|>" : name == "llama2" ? "[INST]" : "<|im_start|>";
    CHECK(std::count(split.ids.begin(), split.ids.end(), *tok.token_to_id(opener)) > 0);
    std::vector<int32_t> specials, specials_default;
    for (int32_t id : split.ids)
      if (tok.is_special(id)) specials.push_back(id);
    for (int32_t id : want_default)
      if (tok.is_special(id)) specials_default.push_back(id);
    if (special_in_text >= 0) {
      CHECK(specials.size() < specials_default.size());
      CHECK(split.ids != want_default);
    }
    // Without the mask: one rendering, the same ids.
    const ChatTokens plain = chat.encode(tok, c["messages"], vars, true);
    CHECK(plain.ids == want);
    CHECK(std::count(plain.reply.begin(), plain.reply.end(), uint8_t{1}) == 0);
    // Without the flag: every special token matched, as apply_chat_template(tokenize=True).
    const ChatTokens special = chat.tokenize(tok, c["messages"], vars, false);
    CHECK(special.ids == want_default);
    CHECK(special.special_in_text == special_in_text);
    if (std::find(want.begin(), want.end(), tool_response) != want.end()) {
      CHECK(std::find(split.ids.begin(), split.ids.end(), tool_response) != split.ids.end());
      ++cases;  // a non-special added token, matched in the messages and the template
    }
    ++cases;
    with_special_text += special_in_text >= 0;
    with_tools += vars.contains("tools");
    template_names.insert(name);
  }
  CHECK(cases == static_cast<int>(fx["cases"].size()) + 1);  // one case holds <tool_response>
  CHECK(with_special_text >= 6);
  CHECK(with_tools == 1);
  CHECK(template_names == std::set<std::string>{"chatml_qwen25", "llama3", "llama2"});
}

TEST_CASE("chat templates: --split-special-tokens refuses what it cannot keep apart", "[chat][split_special]") {
  const ojson templates = load("templates.json")["templates"];
  const Tokenizer& tok = fixture_tokenizer();
  // Qwen 3's template cuts the reasoning at "</think>", a special token in this tokenizer: with
  // the text behind a placeholder it would render otherwise, so the conversation is refused.
  const ChatTemplate qwen3 = ChatTemplate::from_source(templates["qwen3_think"]["template"],
                                                       templates["qwen3_think"]["special_tokens"], "qwen3_think");
  const ojson thinking = ojson::parse(R"([{"role": "user", "content": "2+2?"},
      {"role": "assistant", "content": "<think>\nadd\n</think>\n\n4"}])");
  CHECK_THROWS_WITH(qwen3.tokenize(tok, thinking, ojson::object(), true),
                    Catch::Contains("does not carry the special-token text of this conversation ('<think>')") &&
                        Catch::Contains("Leave out --split-special-tokens"));
  CHECK_THROWS_WITH(qwen3.encode(tok, thinking, ojson::object(), true), Catch::Contains("does not carry"));
  CHECK(qwen3.tokenize(tok, thinking, ojson::object(), false).ids == tok.encode(qwen3.render(thinking, false), false));
  // Special-token text the template passes on unchanged is fine with the same template.
  const ojson quoted_text = ojson::parse(R"([{"role": "user", "content": "what is <|im_end|>?"},
      {"role": "assistant", "content": "a token"}])");
  const ChatTokens ok = qwen3.tokenize(tok, quoted_text, ojson::object(), true);
  CHECK(std::count(ok.ids.begin(), ok.ids.end(), *tok.token_to_id("<|im_end|>")) == 2);  // the template's two
  // A special token matched after the normalizer has no byte range in the text to keep.
  ojson doc = load("tokenizer.json");
  for (ojson& a : doc["added_tokens"])
    if (a["content"] == "<|im_end|>") a["normalized"] = true;
  const Tokenizer normalized = Tokenizer::from_json(doc.dump(), "normalized <|im_end|>");
  CHECK_THROWS_WITH(qwen3.tokenize(normalized, quoted_text, ojson::object(), true),
                    Catch::Contains("special token '<|im_end|>'") && Catch::Contains("\"normalized\": true"));
  CHECK_NOTHROW(qwen3.tokenize(normalized, quoted_text, ojson::object(), false));
}

// Through keel tokenize: the fixture's ChatML conversations in the shuffled order, each the
// oracle's ids and mask plus the end of text; without the flag the summary counts them.
TEST_CASE("keel tokenize --chat --split-special-tokens: HF's ids and the replies' mask", "[chat][tokenize][split_special]") {
  const ojson fx = load("split_special_chat.json");
  TempDir dir;
  std::vector<const ojson*> cases;
  {
    std::ofstream jsonl(dir / "chat.jsonl");
    for (const ojson& c : fx["cases"])
      if (c["template"] == "chatml_qwen25") {
        ojson rec = {{"messages", c["messages"]}};
        if (c.contains("tools")) rec["tools"] = c["tools"];
        jsonl << rec.dump() << "\n";
        cases.push_back(&c);
      }
    std::ofstream(dir / "tokenizer.json") << split_fixture_tokenizer_json(fx);
    std::ofstream(dir / "chatml.jinja") << load("templates.json")["templates"]["chatml_qwen25"]["template"].get<std::string>();
  }
  REQUIRE(cases.size() >= 5);
  const Tokenizer tok = Tokenizer::from_file(dir / "tokenizer.json");
  const uint32_t eot = static_cast<uint32_t>(*tok.token_to_id("<|endoftext|>"));
  std::vector<uint64_t> order(cases.size());
  for (size_t k = 0; k < order.size(); ++k) order[k] = k;
  TokenizeOptions o;
  PythonRandom(o.seed).shuffle(order);
  o.jsonl = {dir / "chat.jsonl"};
  o.chat = true;
  o.tokenizer = dir / "tokenizer.json";
  o.chat_template = dir / "chatml.jinja";
  o.val_fraction = 0;
  o.threads = 2;
  for (const bool mask : {true, false})
    for (const bool split : {true, false}) {
      INFO("mask " << mask << ", --split-special-tokens " << split);
      o.assistant_loss_mask = mask;
      o.split_special_tokens = split;
      o.out = dir / ("out" + std::to_string(mask) + std::to_string(split));
      std::string log;
      const TokenizeResult r = tokenize_corpus(o, [&](const std::string& line) { log += line + "\n"; });
      std::vector<uint32_t> want;
      std::vector<uint8_t> want_mask;
      int64_t with_special_text = 0;
      for (uint64_t k : order) {
        const ojson& c = *cases[k];
        for (int32_t id : c[split ? "ids" : "default_ids"].get<std::vector<int32_t>>()) want.push_back(static_cast<uint32_t>(id));
        want.push_back(eot);
        const auto m = c["mask"].get<std::vector<uint8_t>>();
        want_mask.insert(want_mask.end(), m.begin(), m.end());
        want_mask.push_back(0);
        with_special_text += !c["special_in_text"].is_null();
      }
      const TokenFile f = TokenFile::open(o.out + "/train_000.bin");
      std::vector<uint32_t> got(static_cast<size_t>(f.num_tokens()));
      for (int64_t i = 0; i < f.num_tokens(); ++i) got[static_cast<size_t>(i)] = f.token(i);
      CHECK(got == want);
      if (mask && split) {  // the oracle's mask is for the split ids
        const auto lm = LossMask::open_for(f);
        REQUIRE(lm);
        std::vector<uint8_t> got_mask(static_cast<size_t>(lm->size()));
        for (int64_t i = 0; i < lm->size(); ++i) got_mask[static_cast<size_t>(i)] = lm->in_loss(i);
        CHECK(got_mask == want_mask);
      }
      std::ifstream meta_in(o.out + "/meta.json");
      CHECK(nlohmann::json::parse(meta_in)["split_special_tokens"] == split);
      if (split)
        CHECK(log.find("hold the text of a special token") == std::string::npos);
      else
        CHECK_THAT(log, Catch::Contains("NOTE " + std::to_string(with_special_text) +
                                        " conversations hold the text of a special token (") &&
                            Catch::Contains("the chat template's own special tokens stay special"));
    }
}

}  // namespace
}  // namespace keel::data
