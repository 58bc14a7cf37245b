// The finetuning workflow with the real binary, on the fixture model of
// scripts/make_hf_fixtures.py (a tiny Llama trained on fortunes, Llama 2 style tokenizer):
//   keel convert hf:DIR OUT  ->  keel sample (prompt through keel's C++ tokenizer, greedy = HF's)
//   keel train --init-from OUT (bf16, fp32 masters): the loss continues from HF's, no jump
//   keel convert CKPT hf:EXPORT --like OUT  ->  an HF directory that opens as the same model
#include <catch2/catch.hpp>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <regex>

#include "common/fixture.h"
#include "common/process.h"
#include "common/temp_dir.h"
#include "common/workspace.h"
#include "data/loss_mask.h"
#include "data/token_file.h"
#include "data/tokenizer.h"

using namespace keel;
namespace fs = std::filesystem;
using json = nlohmann::json;
using test::run_keel;

namespace {

const std::string kHf = test::hf_fixture_dir();

json expected(const std::string& name) { return test::hf_expected(name).meta; }

// The ids after "label: [" in keel sample --show-ids output.
std::vector<int32_t> ids_after(const std::string& out, const std::string& label) {
  std::smatch m;
  if (!std::regex_search(out, m, std::regex(label + ": \\[([0-9, ]*)\\]"))) return {};
  std::vector<int32_t> ids;
  std::stringstream ss(m[1].str());
  std::string item;
  while (std::getline(ss, item, ',')) ids.push_back(std::stoi(item));
  return ids;
}

// init "": no --init-from (the config's train.init_from, if any).
std::string train_args(const std::string& config, const std::string& init, const std::string& out, int steps) {
  return "train --config " + config + (init.empty() ? "" : " --init-from " + init) + " --out " + out + " -q --steps " +
         std::to_string(steps) +
         " --set data.train=" + kHf + "data/fortunes_sp.bin --set 'data.val=[]' --set train.seq_len=64"
         " --set train.global_batch=8 --set train.micro_batch=4 --set schedule.warmup_steps=0"
         " --set schedule.decay=constant --set optimizer.lr=3e-4 --set optimizer.min_lr=3e-4 --set train.seed=3";
}

// Step losses of a finished run; checks there is no jump above the pretrained loss.
void check_no_jump(const std::string& out, double hf_loss) {
  const auto losses = test::losses_by_step(test::read_metrics(out + "/metrics.jsonl"));
  REQUIRE(!losses.empty());
  for (const auto& [step, loss] : losses) {
    INFO("step " << step << " loss " << loss << " (HF model on this data: " << hf_loss << ", random: 6.24)");
    CHECK(loss < hf_loss + 0.35);
    CHECK(loss > hf_loss - 0.5);
  }
}

// An Instruct model: the fixture llama_trained with a chat template (Mistral's [INST] style) in
// its tokenizer_config.json, as HF Instruct models have one.
const char* const kChatTemplate =
    "{{ bos_token }}{% for m in messages %}{% if m.role == 'user' %}[INST] {{ m.content | trim }} [/INST]"
    "{% elif m.role == 'assistant' %} {{ m.content | trim }} {{ eos_token }}{% endif %}{% endfor %}";
void make_chat_model(const fs::path& model) {
  fs::create_directories(model);
  for (const char* f : {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json"})
    fs::copy_file(fs::path(kHf) / "llama_trained" / f, model / f);
  std::ofstream(model / "tokenizer_config.json")
      << json{{"chat_template", kChatTemplate}, {"bos_token", "<s>"}, {"eos_token", "</s>"}}.dump();
}

// 40 two-turn conversations.
void write_chats(const std::string& path) {
  std::ofstream chats(path);
  const char* subjects[] = {"the sea", "a cat", "old books", "the moon", "rain", "bread"};
  for (int k = 0; k < 40; ++k)
    chats << json{{"messages",
                   {{{"role", "user"}, {"content", std::string("tell me about ") + subjects[k % 6]}},
                    {{"role", "assistant"}, {"content", std::string("It is said that ") + subjects[(k * 5) % 6] + " keeps quiet."}},
                    {{"role", "user"}, {"content", "and then? (" + std::to_string(k) + ")"}},
                    {{"role", "assistant"}, {"content", "Then it rains."}}}}}
                 .dump()
          << "\n";
}

}  // namespace

TEST_CASE("keel convert + keel sample: the converted model greedy-decodes HF's continuation", "[hf][cli]") {
  test::TempDir tmp("hfcli");
  const json e = expected("llama_trained");
  const std::string out = tmp / "llama";
  auto r = run_keel("convert hf:" + kHf + "llama_trained " + out);
  INFO(r.output);
  REQUIRE(r.code == 0);
  CHECK_THAT(r.output, Catch::Contains("wrote weights-only checkpoint") && Catch::Contains("copied tokenizer.json"));
  CHECK(run_keel("ckpt verify " + out).code == 0);

  const std::string prompt = e["text"]["prompt"].get<std::string>();
  for (const std::string& source : {out, "hf:" + kHf + "llama_trained"}) {
    r = run_keel("sample --checkpoint " + source + " --prompt '" + prompt + "' -t 0 -n 16 --show-ids");
    INFO(source << "\n" << r.output);
    REQUIRE(r.code == 0);
    CHECK(ids_after(r.output, "prompt ids") == e["text"]["prompt_ids"].get<std::vector<int32_t>>());
    CHECK(ids_after(r.output, "generated ids") == e["text"]["new_ids"].get<std::vector<int32_t>>());
    CHECK_THAT(r.output, Catch::Contains(e["text"]["completion"].get<std::string>()));
  }
  // Sampling is reproducible per seed.
  auto a = run_keel("sample --checkpoint " + out + " --prompt 'Hello' -n 12 --seed 5 --show-ids");
  auto b = run_keel("sample --checkpoint " + out + " --prompt 'Hello' -n 12 --seed 5 --show-ids");
  CHECK(a.code == 0);
  CHECK(ids_after(a.output, "generated ids") == ids_after(b.output, "generated ids"));

  // --print-config: a valid run config whose model section is the HF model.
  r = run_keel("convert --print-config hf:" + kHf + "llama_trained");
  REQUIRE(r.code == 0);
  const json cfg = json::parse(r.output);
  CHECK(cfg["model"]["d_model"] == 48);
  CHECK(cfg["model"]["n_kv_heads"] == 2);
  CHECK(cfg["model"]["tied_embeddings"] == false);

  // Errors: an unknown architecture, a keel side on both ends.
  fs::copy(kHf + "llama_tied", tmp / "gemma", fs::copy_options::recursive);
  {
    std::ifstream in(tmp / "gemma/config.json");
    json c = json::parse(in);
    c["architectures"] = {"GemmaForCausalLM"};
    c["model_type"] = "gemma";
    std::ofstream(tmp / "gemma/config.json") << c.dump();
  }
  r = run_keel("convert hf:" + tmp / "gemma" + " " + tmp / "g");
  CHECK(r.code == 5);
  CHECK_THAT(r.output, Catch::Contains("GemmaForCausalLM") && Catch::Contains("not supported"));
  r = run_keel("convert " + out + " " + tmp / "x");
  CHECK(r.code == 2);
  CHECK_THAT(r.output, Catch::Contains("hf:"));
}

TEST_CASE("keel convert exports in the dtype of the HF model the checkpoint came from (fp16 stays fp16)", "[hf][cli]") {
  test::TempDir tmp("hfdtype");
  REQUIRE(run_keel("convert hf:" + kHf + "llama_sharded " + tmp / "keel").code == 0);  // fp16
  auto torch_dtype = [&](const std::string& dir) {
    std::ifstream in(fs::path(dir) / "config.json");
    return json::parse(in)["torch_dtype"].get<std::string>();
  };
  auto r = run_keel("convert " + tmp / "keel" + " hf:" + tmp / "auto");
  INFO(r.output);
  REQUIRE(r.code == 0);
  CHECK_THAT(r.output, Catch::Contains(" parameters, f16,"));
  CHECK(torch_dtype(tmp / "auto") == "float16");
  r = run_keel("convert " + tmp / "keel" + " hf:" + tmp / "bf16 --dtype bf16");
  REQUIRE(r.code == 0);
  CHECK(torch_dtype(tmp / "bf16") == "bfloat16");
}

TEST_CASE("keel train --init-from a converted model: bf16 finetune continues from the pretrained loss, export back",
          "[hf][cli][seed000]") {
  test::TempDir tmp("hfft");
  const json e = expected("llama_trained");
  const double hf_loss = e["train_loss"]["loss"].get<double>();
  const std::string conv = tmp / "llama";
  REQUIRE(run_keel("convert hf:" + kHf + "llama_trained " + conv).code == 0);

  auto r = run_keel(train_args(conv + "/config.json", conv, tmp / "run", 6));
  INFO(r.output);
  REQUIRE(r.code == 0);
  CHECK_THAT(r.output, Catch::Contains("fp32 masters = their exact values"));
  check_no_jump(tmp / "run", hf_loss);

  // The finetuned checkpoint back to HF, config and tokenizer from the converted directory.
  r = run_keel("convert " + tmp / "run/checkpoints hf:" + tmp / "export" + " --dtype bf16 --like " + conv);
  INFO(r.output);
  REQUIRE(r.code == 0);
  for (const char* f : {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json"})
    CHECK(fs::exists(fs::path(tmp / "export") / f));
  std::ifstream in(tmp / "export/config.json");
  const json c = json::parse(in);
  CHECK(c["torch_dtype"] == "bfloat16");
  CHECK(c["eos_token_id"] == 2);
  CHECK(c["num_key_value_heads"] == 2);
  r = run_keel("sample --checkpoint hf:" + tmp / "export" + " --prompt 'The' -t 0 -n 8");
  CHECK(r.code == 0);

  // Without --like: the run's checkpoints record the HF model the converted weights came from,
  // so the export still gets its tokenizer and token ids.
  r = run_keel("convert " + tmp / "run/checkpoints hf:" + tmp / "export2");
  INFO(r.output);
  REQUIRE(r.code == 0);
  CHECK_THAT(r.output, Catch::Contains("copied tokenizer.json") && !Catch::Contains("not written"));
  std::ifstream in2(tmp / "export2/config.json");
  CHECK(json::parse(in2)["eos_token_id"] == 2);
}

// The config keel convert writes is for its checkpoint alone, so it names it (train.init_from
// "."): a forgotten --init-from no longer trains the fixture from a random init (6.26 nats
// after two steps, where the converted model starts at 3.14), also once the folder moved.
TEST_CASE("the finetune config of keel convert starts from its weights without --init-from, wherever the folder moves",
          "[hf][cli][finetune][seed000]") {
  test::TempDir tmp("hfinit");
  const double hf_loss = expected("llama_trained")["train_loss"]["loss"].get<double>();
  const std::string conv = tmp / "llama";
  REQUIRE(run_keel("convert hf:" + kHf + "llama_trained " + conv).code == 0);
  std::ifstream in(conv + "/config.json");
  const json written = json::parse(in);
  CHECK(written["train"]["init_from"] == ".");
  CHECK_THAT(written["description"].get<std::string>(), !Catch::Contains("--init-from"));

  // Moved: "." is read from the config's folder.
  const std::string moved = tmp / "moved";
  fs::rename(conv, moved);
  auto r = run_keel(train_args(moved + "/config.json", "", tmp / "run", 4));
  INFO(r.output);
  REQUIRE(r.code == 0);
  CHECK_THAT(r.output, Catch::Contains("initialised from " + moved + ": ") &&
                           Catch::Contains("fp32 masters = their exact values") &&
                           Catch::Contains("restart verification passed"));
  check_no_jump(tmp / "run", hf_loss);
  // A resume ignores it, as it ignores --init-from, and says so.
  r = run_keel(train_args(moved + "/config.json", "", tmp / "run", 6));
  INFO(r.output);
  REQUIRE(r.code == 0);
  CHECK_THAT(r.output, Catch::Contains("resuming from ") &&
                           Catch::Contains("train.init_from " + moved +
                                           " is ignored: it only initialises a fresh run, and this run resumes"));
  // --init-from overrides it.
  r = run_keel(train_args(moved + "/config.json", "hf:" + kHf + "llama_trained", tmp / "flag", 2));
  INFO(r.output);
  REQUIRE(r.code == 0);
  CHECK_THAT(r.output, Catch::Contains("initialised from hf:" + kHf + "llama_trained") &&
                           !Catch::Contains("initialised from " + moved));
  // A path that is not there is a config error naming the field, before anything is written.
  r = run_keel(train_args(moved + "/config.json", "", tmp / "missing", 2) + " --set train.init_from=" + tmp / "nope");
  INFO(r.output);
  CHECK(r.code == 2);
  CHECK_THAT(r.output, Catch::Contains("train.init_from: " + tmp / "nope" + " does not exist"));
  CHECK_FALSE(fs::exists(tmp / "missing"));
  // The converted config.json copied elsewhere: its "." is the copy's folder, which exists and
  // holds no checkpoint; named as the field's mistake (was: a bare "no checkpoint at").
  fs::create_directories(tmp / "mine");
  fs::copy_file(moved + "/config.json", tmp / "mine/my_ft.json");
  r = run_keel(train_args(tmp / "mine/my_ft.json", "", tmp / "copied", 2));
  INFO(r.output);
  CHECK(r.code == 2);
  CHECK_THAT(r.output, Catch::Contains("train.init_from: " + fs::path(tmp / "mine").string()) &&
                           Catch::Contains("holds no keel checkpoint") && Catch::Contains("keel convert writes \".\""));
  CHECK_FALSE(fs::exists(tmp / "copied"));

  // --print-config names the HF model itself.
  auto printed = run_keel("convert --print-config hf:" + kHf + "llama_trained");
  REQUIRE(printed.code == 0);
  CHECK_THAT(printed.output,
             Catch::Contains("\"init_from\": \"hf:" + fs::absolute(kHf + "llama_trained").lexically_normal().string()));
}

// A run's --out or checkpoint.dir that is itself a checkpoint would replace its config.json and
// put step_* beside its meta.json: keel sample --checkpoint on it would then load the run's
// weights. Refused at start-up (exit 2), the folder left as it was.
TEST_CASE("keel train refuses an --out or checkpoint.dir that is a keel checkpoint", "[hf][cli][finetune]") {
  test::TempDir tmp("hfout");
  const std::string conv = tmp / "llama";
  REQUIRE(run_keel("convert hf:" + kHf + "llama_trained " + conv).code == 0);
  const std::string config_before = test::read_file(conv + "/config.json");
  auto r = run_keel(train_args(conv + "/config.json", "", conv, 2));
  INFO(r.output);
  CHECK(r.code == 2);
  CHECK_THAT(r.output, Catch::Contains("out (--out): " + conv + " is a keel checkpoint") &&
                           Catch::Contains("Nothing was written") && Catch::Contains("--out " + conv + "-run"));
  r = run_keel(train_args(conv + "/config.json", "", tmp / "run", 2) + " --set checkpoint.dir=" + conv);
  INFO(r.output);
  CHECK(r.code == 2);
  CHECK_THAT(r.output, Catch::Contains("checkpoint.dir: " + conv + " is a keel checkpoint"));
  CHECK(test::read_file(conv + "/config.json") == config_before);
  CHECK_FALSE(fs::exists(conv + "/checkpoints"));
  CHECK_FALSE(fs::exists(conv + "/metrics.jsonl"));
  CHECK_FALSE(fs::exists(tmp / "run"));
  CHECK(run_keel("ckpt verify " + conv).code == 0);
  // A run's own step_* is a checkpoint too.
  REQUIRE(run_keel(train_args(conv + "/config.json", "", tmp / "ok", 2)).code == 0);
  r = run_keel(train_args(conv + "/config.json", "", tmp / "ok/checkpoints/step_00000002", 2));
  INFO(r.output);
  CHECK(r.code == 2);
  CHECK_THAT(r.output, Catch::Contains("is a keel checkpoint"));

  // --resume hf:DIR: the HF model has weights only; say so and point at --init-from, as for a
  // keel weights-only checkpoint.
  r = run_keel(train_args(conv + "/config.json", "", tmp / "resume", 2) + " --resume hf:" + kHf + "llama_trained");
  INFO(r.output);
  CHECK(r.code == 5);
  CHECK_THAT(r.output, Catch::Contains("a Hugging Face model cannot be resumed: it holds weights only, no optimizer state") &&
                           Catch::Contains("use --init-from hf:" + kHf + "llama_trained") &&
                           !Catch::Contains("no such file"));
  CHECK_FALSE(fs::exists(tmp / "resume"));
}

TEST_CASE("keel train --init-from hf:DIR finetunes the HF weights directly", "[hf][cli][seed000]") {
  test::TempDir tmp("hfdirect");
  const json e = expected("llama_trained");
  auto cfg = run_keel("convert --print-config hf:" + kHf + "llama_trained");
  REQUIRE(cfg.code == 0);
  std::ofstream(tmp / "ft.json") << cfg.output;
  auto r = run_keel(train_args(tmp / "ft.json", "hf:" + kHf + "llama_trained", tmp / "run", 4));
  INFO(r.output);
  REQUIRE(r.code == 0);
  CHECK_THAT(r.output, Catch::Contains("initialised from hf:"));
  check_no_jump(tmp / "run", e["train_loss"]["loss"].get<double>());
  // The checkpoints record the HF model, so export without --like finds its tokenizer and ids.
  r = run_keel("convert " + tmp / "run/checkpoints hf:" + tmp / "export");
  INFO(r.output);
  REQUIRE(r.code == 0);
  CHECK_THAT(r.output, Catch::Contains("copied tokenizer.json") && !Catch::Contains("not written"));
  std::ifstream in(tmp / "export/config.json");
  CHECK(json::parse(in)["eos_token_id"] == 2);
}

TEST_CASE("GPT-2 and BLOOM through the binary: convert, greedy-decode HF's tokens, finetune, export", "[hf][cli]") {
  for (const std::string name : {"gpt2_tied", "bloom_bf16"}) {
    SECTION(name) {
      test::TempDir tmp("hfcli2");
      const json e = expected(name);
      const std::string conv = tmp / "conv";
      auto r = run_keel("convert hf:" + kHf + name + " " + conv);
      INFO(r.output);
      REQUIRE(r.code == 0);

      std::string prompt;
      for (int id : e["greedy"]["prompt_ids"]) {
        if (!prompt.empty()) prompt += ',';
        prompt += std::to_string(id);
      }
      for (const std::string& source : {conv, "hf:" + kHf + name}) {
        r = run_keel("sample --checkpoint " + source + " --prompt-ids " + prompt + " -t 0 -n 16 --ignore-eos --show-ids");
        INFO(source << "\n" << r.output);
        REQUIRE(r.code == 0);
        CHECK(ids_after(r.output, "generated ids") == e["greedy"]["new_ids"].get<std::vector<int32_t>>());
      }

      // A few bf16 steps from the converted weights (token ids below 64 fit the vocab of 300).
      data::write_llmc_shard(tmp / "train.bin", test::synthetic_tokens(4000, 1), false);
      r = run_keel("train --config " + conv + "/config.json --init-from " + conv + " --out " + tmp / "run" +
                   " -q --steps 3 --set data.train=" + tmp / "train.bin" +
                   " --set 'data.val=[]' --set train.seq_len=32 --set train.global_batch=4 --set train.micro_batch=2"
                   " --set schedule.warmup_steps=1");
      INFO(r.output);
      REQUIRE(r.code == 0);
      CHECK_THAT(r.output, Catch::Contains("fp32 masters = their exact values"));

      r = run_keel("convert " + tmp / "run/checkpoints hf:" + tmp / "export" + " --like " + conv);
      INFO(r.output);
      REQUIRE(r.code == 0);
      std::ifstream in(tmp / "export/config.json");
      const json c = json::parse(in);
      CHECK(c["architectures"][0] == (name == "gpt2_tied" ? "GPT2LMHeadModel" : "BloomForCausalLM"));
      CHECK(c["vocab_size"] == 300);
      CHECK(run_keel("sample --checkpoint hf:" + tmp / "export" + " --prompt-ids " + prompt + " -t 0 -n 4").code == 0);
    }
  }
}

TEST_CASE("keel eval: multiple-choice accuracy of an HF model from a JSONL file", "[hf][cli][eval]") {
  test::TempDir tmp("hfeval");
  const json e = expected("choices_llama_trained");
  const std::string choices = kHf + e["file"].get<std::string>();
  auto r = run_keel("eval --checkpoint hf:" + kHf + "llama_trained --choices " + choices);
  INFO(r.output);
  REQUIRE(r.code == 0);
  std::vector<int> labels;
  {
    std::ifstream in(choices);
    for (std::string line; std::getline(in, line);) labels.push_back(json::parse(line)["label"].get<int>());
  }
  REQUIRE(labels.size() == e["items"].size());
  int correct = 0, per_token = 0, per_byte = 0;  // HF's picks, counted
  for (size_t i = 0; i < labels.size(); ++i) {
    const json& x = e["items"][i];
    correct += x["pick"] == labels[i];
    per_token += x["pick_per_token"] == labels[i];
    per_byte += x["pick_per_byte"] == labels[i];
  }
  auto acc_line = [&](const char* name, int right) {  // as keel prints it
    char buf[128];
    std::snprintf(buf, sizeof buf, "  %-14s %.4f  (%d/%zu)", name, static_cast<double>(right) / labels.size(), right,
                  labels.size());
    return std::string(buf);
  };
  CHECK_THAT(r.output, Catch::Contains(acc_line("acc", correct)) && Catch::Contains(acc_line("acc_per_token", per_token)) &&
                           Catch::Contains(acc_line("acc_per_byte", per_byte)) &&
                           Catch::Contains("chance         0.2500"));

  r = run_keel("eval --checkpoint hf:" + kHf + "llama_trained --choices " + choices + " --limit 5 --scores " +
               tmp / "s.jsonl");
  REQUIRE(r.code == 0);
  CHECK_THAT(r.output, Catch::Contains(": 5 items"));
  std::ifstream in(tmp / "s.jsonl");
  std::string line;
  int lines = 0;
  while (std::getline(in, line)) {
    const json rec = json::parse(line);
    CHECK(rec["logprob"].size() == 4);
    CHECK(std::abs(rec["logprob"][0].get<double>() - e["items"][lines]["logprob"][0].get<double>()) < 1e-4);
    ++lines;
  }
  CHECK(lines == 5);

  // Token-id items need no tokenizer; a text item without one is refused by line.
  r = run_keel("eval --checkpoint hf:" + kHf + "gpt2_tied --choices " + kHf + "choices/gpt2_ids.jsonl");
  CHECK(r.code == 0);
  CHECK_THAT(r.output, !Catch::Contains("acc_per_byte"));
}

TEST_CASE("keel eval --rows: endings packed into rows score as the KV-cache path and HF do", "[hf][cli][eval]") {
  // Every ending's log-likelihood within 1e-4 of HF float64 (as above), with the same picks and
  // accuracy lines. The rows are the models' positions (128 and 64 tokens), which cut no
  // context and pack some rows with several endings.
  test::TempDir tmp("hfevalrows");
  for (const std::string model : {"llama_trained", "gpt2_tied"}) {
    const json e = expected("choices_" + model);
    const std::string choices = kHf + e["file"].get<std::string>();
    const std::string base = "eval --checkpoint hf:" + kHf + model + " --choices " + choices;
    const auto cached = run_keel(base + " --scores " + tmp / "cached.jsonl");
    const auto packed = run_keel(base + " --rows 3 --scores " + tmp / "packed.jsonl");
    INFO(model << "\n" << packed.output);
    REQUIRE(cached.code == 0);
    REQUIRE(packed.code == 0);
    CHECK_THAT(packed.output, Catch::Contains("endings packed in") && Catch::Contains("3 rows per forward") &&
                                  !Catch::Contains("lose their first tokens"));
    auto tail = [](const std::string& out) { return out.substr(out.find("keel eval ")); };  // the result lines
    CHECK(tail(packed.output).substr(0, tail(packed.output).find("keel: scored")) ==
          tail(cached.output).substr(0, tail(cached.output).find("keel: scored")));
    std::ifstream in(tmp / "packed.jsonl");
    std::string line;
    size_t i = 0;
    double worst = 0;
    for (; std::getline(in, line); ++i) {
      const json rec = json::parse(line);
      const json& x = e["items"][i];
      REQUIRE(rec["logprob"].size() == x["logprob"].size());
      for (size_t k = 0; k < rec["logprob"].size(); ++k)
        worst = std::max(worst, std::abs(rec["logprob"][k].get<double>() - x["logprob"][k].get<double>()));
      CHECK(rec["pick"] == x["pick"]);
    }
    CHECK(i == e["items"].size());
    CHECK(worst <= 1e-4);
    WARN(model << " keel eval --rows: worst log-likelihood difference from HF float64 " << worst);
  }
  const auto too_long = run_keel("eval --checkpoint hf:" + kHf + "gpt2_tied --choices " + kHf +
                                 "choices/gpt2_ids.jsonl --rows 2 --seq-len 4");
  CHECK(too_long.code == 2);
  CHECK_THAT(too_long.output, Catch::Contains("gpt2_ids.jsonl:1 ending 2 has 5 tokens, more than --seq-len (4)"));
}

TEST_CASE("keel tokenize + keel train: instruction data with the model's own tokenizer, no Python", "[hf][cli][tokenize]") {
  test::TempDir tmp("hftok");
  {
    std::ofstream sft(tmp / "sft.jsonl");
    const char* subjects[] = {"the sea", "a cat", "old books", "the moon", "rain", "bread"};
    for (int k = 0; k < 60; ++k)
      sft << json{{"prompt", std::string("Q: tell me about ") + subjects[k % 6] + " (" + std::to_string(k) + ")\nA:"},
                  {"response", std::string(" It is said that ") + subjects[(k * 5) % 6] + " keeps its own counsel."}}
                 .dump()
          << "\n";
  }
  const std::string kHfModel = kHf + "llama_trained";
  auto r = run_keel("tokenize --jsonl " + tmp / "sft.jsonl" + " --loss-mask prompt --add-special-tokens --tokenizer hf:" +
                    kHfModel + " --out " + tmp / "sft" + " --val-fraction 0.1 -j 2");
  INFO(r.output);
  REQUIRE(r.code == 0);
  CHECK_THAT(r.output, Catch::Contains("train: 54 documents") && Catch::Contains("val: 6 documents") &&
                           Catch::Contains("in the loss") && Catch::Contains("eot </s> = 2"));
  for (const char* f : {"train_000.bin", "train_000.mask", "val_000.bin", "val_000.mask", "meta.json", "tokenizer.json"})
    CHECK(fs::exists(fs::path(tmp / "sft") / f));
  {
    // Each example is its joined text's tokens, prompt out of the loss and response in. This
    // SentencePiece-style tokenizer (Prepend "▁") gave a response encoded apart a second "▁"
    // after "A:", which a finetune then learned to emit.
    const data::Tokenizer tok = data::Tokenizer::from_file(kHfModel + "/tokenizer.json");
    std::map<std::vector<int32_t>, size_t> prompt_tokens;  // joined encoding -> the prompt's own tokens
    std::ifstream in(tmp / "sft.jsonl");
    for (std::string line; std::getline(in, line);) {
      const json rec = json::parse(line);
      const std::string prompt = rec["prompt"], response = rec["response"];
      prompt_tokens[tok.encode(prompt + response, true)] = tok.encode(prompt, true).size();
    }
    size_t examples = 0;
    for (const char* split : {"train_000.bin", "val_000.bin"}) {
      const data::TokenFile f = data::TokenFile::open(fs::path(tmp / "sft") / split);
      const auto mask = data::LossMask::open_for(f);
      REQUIRE(mask);
      std::vector<int32_t> doc;
      std::vector<bool> in_loss;
      for (int64_t i = 0; i < f.num_tokens(); ++i) {
        if (f.token(i) != 2) {
          doc.push_back(static_cast<int32_t>(f.token(i)));
          in_loss.push_back(mask->in_loss(i));
          continue;
        }
        ++examples;
        const auto it = prompt_tokens.find(doc);
        REQUIRE(it != prompt_tokens.end());
        for (size_t k = 0; k < doc.size(); ++k) CHECK(in_loss[k] == (k >= it->second));
        CHECK(mask->in_loss(i));  // the end of text
        doc.clear(), in_loss.clear();
      }
    }
    CHECK(examples == 60);
  }

  // Finetune on it: document masking finds the end of text in meta.json, the masks are picked up.
  auto cfg = run_keel("convert --print-config hf:" + kHfModel);
  REQUIRE(cfg.code == 0);
  std::ofstream(tmp / "ft.json") << cfg.output;
  r = run_keel("train --config " + tmp / "ft.json" + " --init-from hf:" + kHfModel + " --out " + tmp / "run" +
               " --steps 2 --set 'data.train=" + tmp / "sft/train_*.bin' --set 'data.val=" + tmp / "sft/val_*.bin'" +
               " --set data.document_masking=true --set train.seq_len=64 --set train.global_batch=4"
               " --set train.micro_batch=2 --set schedule.warmup_steps=0");
  INFO(r.output);
  REQUIRE(r.code == 0);
  CHECK_THAT(r.output, Catch::Contains("loss masks on 1 of 1 files") && Catch::Contains("documents end at token 2"));
  CHECK_THAT(r.output, Catch::Contains("belong to examples that began in an earlier window") &&
                           Catch::Contains("keel tokenize --pack 64"));  // unpacked: cut examples, reported

  // Packed (--pack 64): whole examples per window, read under train.seq_len 64 only.
  r = run_keel("tokenize --jsonl " + tmp / "sft.jsonl" + " --loss-mask prompt --add-special-tokens --tokenizer hf:" +
               kHfModel + " --out " + tmp / "packed" + " --val-fraction 0.1 --pack 64");
  INFO(r.output);
  REQUIRE(r.code == 0);
  CHECK_THAT(r.output, Catch::Contains("train: 54 documents") && Catch::Contains("windows of 64 tokens"));
  std::smatch windows_match;
  REQUIRE(std::regex_search(r.output, windows_match, std::regex(R"(packed into (\d+) windows of 64 tokens)")));
  const int train_windows = std::stoi(windows_match[1]);  // the first line is train's
  REQUIRE(train_windows <= 64);  // then the start-up line below reads every window once
  const std::string packed_data = " --set 'data.train=" + tmp / "packed/train_*.bin' --set 'data.val=" + tmp / "packed/val_*.bin'" +
                                  " --set train.global_batch=4 --set train.micro_batch=2 --set schedule.warmup_steps=0";
  r = run_keel("train --config " + tmp / "ft.json" + " --init-from hf:" + kHfModel + " --out " + tmp / "run_packed" +
               " --steps 2 --set data.document_masking=true --set train.seq_len=64" + packed_data);
  INFO(r.output);
  REQUIRE(r.code == 0);
  CHECK_THAT(r.output, Catch::Contains("packed (keel tokenize --pack 64)") && !Catch::Contains("WARNING the data is packed") &&
                           !Catch::Contains("began in an earlier window"));
  // The 54 examples over the windows: the padding (end-of-text tokens after an example's own)
  // does not count as documents.
  char per_sequence[96];
  std::snprintf(per_sequence, sizeof per_sequence, "(%.1f documents per sequence in the first %d)",
                54.0 / train_windows, train_windows);
  CHECK_THAT(r.output, Catch::Contains(per_sequence));
  r = run_keel("train --config " + tmp / "ft.json" + " --init-from hf:" + kHfModel + " --out " + tmp / "run_packed2" +
               " --steps 1 --set train.seq_len=64" + packed_data);
  CHECK(r.code == 0);
  CHECK_THAT(r.output, Catch::Contains("WARNING the data is packed") && Catch::Contains("data.document_masking=true"));
  r = run_keel("train --config " + tmp / "ft.json" + " --init-from hf:" + kHfModel + " --out " + tmp / "run_packed3" +
               " --steps 1 --set train.seq_len=32" + packed_data);
  CHECK(r.code == 2);
  CHECK_THAT(r.output, Catch::Contains("train.seq_len 32 does not match the data's packing") &&
                           Catch::Contains("--pack 64") && Catch::Contains("packed/meta.json"));
  CHECK(!fs::exists(tmp / "run_packed3"));

  // Bad options exit 2 and name the option; the output folder is left alone.
  r = run_keel("tokenize --jsonl " + tmp / "sft.jsonl" + " --tokenizer hf:" + kHfModel + " --out " + tmp / "sft" +
               " --val-fraction 1");
  CHECK(r.code == 2);
  CHECK_THAT(r.output, Catch::Contains("--val-fraction"));
  r = run_keel("tokenize --jsonl " + tmp / "sft.jsonl" + " --tokenizer " + tmp / "nowhere.json" + " --out " + tmp / "sft");
  CHECK(r.code == 3);
  CHECK_THAT(r.output, Catch::Contains("nowhere.json"));
  r = run_keel("tokenize --jsonl " + tmp / "sft.jsonl" + " --tokenizer hf:" + kHfModel + " --out " + tmp / "sft" +
               " --eot-token ''");
  CHECK(r.code == 2);
  CHECK_THAT(r.output, Catch::Contains("--eot-token: an empty token name"));
  r = run_keel("tokenize --jsonl " + tmp / "sft.jsonl" + " --tokenizer hf:" + kHfModel + " --out " + tmp / "sft/meta.json/x");
  CHECK(r.code == 2);
  CHECK_THAT(r.output, Catch::Contains("meta.json' is a file, not a folder"));
  CHECK(fs::exists(fs::path(tmp / "sft") / "train_000.mask"));
}

// Chat finetuning through the binary: the model folder gets a chat template (as an Instruct
// model's tokenizer_config.json has one); keel tokenize --chat renders the conversations with
// it and masks everything but the replies; keel sample --chat prompts through the same template,
// which must equal prompting with the rendered text and no added special tokens.
// Data tokenized for another model trains without an error when its ids fit the vocabulary, the
// loss only starting far above the model's own: the start-up compares the data's tokenizer.json
// with the model's and warns, naming both.
TEST_CASE("keel train from a model's weights warns when data.train was tokenized with another tokenizer",
          "[hf][cli][tokenize]") {
  test::TempDir tmp("hftok-other");
  {
    std::ofstream plain(tmp / "plain.jsonl");
    for (int k = 0; k < 40; ++k)
      plain << json{{"text", "The old lighthouse keeper counted " + std::to_string(k) + " ships before the storm."}}.dump()
            << "\n";
  }
  const std::string model = kHf + "llama_trained", other = kHf + "gpt2_tied";
  for (const auto& [name, tokenizer] : {std::pair{"own", model}, std::pair{"other", other}}) {
    auto t = run_keel("tokenize --jsonl " + tmp / "plain.jsonl" + " --tokenizer hf:" + tokenizer + " --out " +
                      tmp / name + " --val-fraction 0");
    INFO(t.output);
    REQUIRE(t.code == 0);
  }
  auto cfg = run_keel("convert --print-config hf:" + model);
  REQUIRE(cfg.code == 0);
  std::ofstream(tmp / "ft.json") << cfg.output;
  for (const std::string name : {"own", "other"}) {
    auto r = run_keel("train --config " + tmp / "ft.json" + " --out " + tmp / ("run_" + name) + " --steps 1 -q" +
                      " --set 'data.train=" + tmp / name + "/train_*.bin' --set train.seq_len=32" +
                      " --set train.global_batch=2 --set train.micro_batch=1 --set schedule.warmup_steps=0" +
                      " --set train.eval_batches=0 --set 'data.val=[]'");
    INFO(name << "\n" << r.output);
    REQUIRE(r.code == 0);
    if (name == "own") {
      CHECK_THAT(r.output, !Catch::Contains("tokenized with another tokenizer"));
    } else {
      CHECK_THAT(r.output, Catch::Contains("WARNING data.train was tokenized with another tokenizer than the model's: " +
                                           tmp / "other/tokenizer.json") &&
                               Catch::Contains("is not " + model + "/tokenizer.json") &&
                               Catch::Contains("keel tokenize --tokenizer " + model));
    }
  }
}

TEST_CASE("keel tokenize --chat + keel sample --chat: conversations through the model's chat template", "[hf][cli][chat]") {
  test::TempDir tmp("hfchat");
  const fs::path model = fs::path(tmp / "model");
  make_chat_model(model);
  write_chats(tmp / "chats.jsonl");
  auto r = run_keel("tokenize --jsonl " + tmp / "chats.jsonl" + " --chat --tokenizer hf:" + model.string() + " --out " +
                    tmp / "chat" + " --val-fraction 0.1 -j 2");
  INFO(r.output);
  REQUIRE(r.code == 0);
  CHECK_THAT(r.output, Catch::Contains("chat template of") && Catch::Contains("train: 36 documents") &&
                           Catch::Contains("in the loss"));
  std::ifstream meta_in(tmp / "chat/meta.json");
  const json meta = json::parse(meta_in);
  const int64_t in_loss = meta["loss_mask"]["train_in_loss"], tokens = meta["train_tokens"];
  CHECK(in_loss > tokens / 5);  // the replies: about a third of every conversation
  CHECK(in_loss < tokens / 2);
  // The template it was rendered with stays with the data, recorded relative to the folder.
  CHECK(meta["source"]["chat_template"] == "tokenizer_config.json");
  CHECK(meta["source"]["chat_template_origin"] == (model / "tokenizer_config.json").string());
  CHECK(test::read_file(tmp / "chat/tokenizer_config.json") == test::read_file(model / "tokenizer_config.json"));

  // This Llama 2 template writes </s>, the end of text, after every reply: inside every
  // two-turn conversation, said, and recorded for keel train.
  CHECK_THAT(r.output, Catch::Contains("NOTE 36 of the conversations hold the end of text </s> (id 2) before their end"));
  CHECK(meta["eot_inside_conversations"] == json{{"train", 36}, {"val", 4}});

  // Finetune on it: the masks are picked up. Document masking, which would cut every
  // conversation at its first reply's </s> (and train the second turn without the first), is
  // refused (was: trained so without a word).
  auto cfg = run_keel("convert --print-config hf:" + model.string());
  REQUIRE(cfg.code == 0);
  std::ofstream(tmp / "ft.json") << cfg.output;
  const std::string finetune = "train --config " + tmp / "ft.json" + " --init-from hf:" + model.string() + " --out " +
                               tmp / "run" + " --steps 2 --set 'data.train=" + tmp / "chat/train_*.bin' --set 'data.val=" +
                               tmp / "chat/val_*.bin' --set train.seq_len=64 --set train.global_batch=4"
                               " --set train.micro_batch=2 --set schedule.warmup_steps=0";
  r = run_keel(finetune + " --set data.document_masking=true");
  INFO(r.output);
  CHECK(r.code == 2);
  CHECK_THAT(r.output, Catch::Contains("data.document_masking: " + tmp / "chat/meta.json" +
                                       " says 40 of its conversations hold the end-of-text token (id 2) before their end") &&
                           Catch::Contains("Set data.document_masking=false"));
  CHECK_FALSE(fs::exists(tmp / "run"));
  r = run_keel(finetune + " --set data.document_masking=false");
  INFO(r.output);
  REQUIRE(r.code == 0);
  CHECK_THAT(r.output, Catch::Contains("loss masks on 1 of 1 files"));

  // keel sample --chat: the template's rendering, encoded without added special tokens.
  const auto chat = run_keel("sample --checkpoint hf:" + model.string() + " --chat \"tell me about rain\" -t 0 -n 8 --show-ids");
  INFO(chat.output);
  REQUIRE(chat.code == 0);
  CHECK_THAT(chat.output, Catch::Contains("chat template of"));
  const auto plain = run_keel("sample --checkpoint hf:" + model.string() +
                              " --prompt \"<s>[INST] tell me about rain [/INST]\" --no-special-tokens -t 0 -n 8 --show-ids");
  REQUIRE(plain.code == 0);
  CHECK(ids_after(chat.output, "prompt ids") == ids_after(plain.output, "prompt ids"));
  CHECK(!ids_after(chat.output, "generated ids").empty());
  CHECK(ids_after(chat.output, "generated ids") == ids_after(plain.output, "generated ids"));

  // keel convert carries the template along (tokenizer_config.json, chat_template.jinja): the
  // converted checkpoint chats the same.
  REQUIRE(run_keel("convert hf:" + model.string() + " " + tmp / "ckpt").code == 0);
  const auto converted = run_keel("sample --checkpoint " + tmp / "ckpt" + " --chat \"tell me about rain\" -t 0 -n 8 --show-ids");
  REQUIRE(converted.code == 0);
  CHECK(ids_after(converted.output, "prompt ids") == ids_after(chat.output, "prompt ids"));

  // A base model has no template: the error says where it looked and what to pass.
  const auto none = run_keel("sample --checkpoint hf:" + kHf + "llama_trained --chat hi");
  CHECK(none.code == 2);
  CHECK_THAT(none.output, Catch::Contains("no chat template") && Catch::Contains("--chat-template"));
  // --add-special-tokens would put a second BOS in front of the template's.
  r = run_keel("tokenize --jsonl " + tmp / "chats.jsonl" + " --chat --add-special-tokens --tokenizer hf:" + model.string() +
               " --out " + tmp / "chat2");
  CHECK(r.code == 2);
  CHECK_THAT(r.output, Catch::Contains("BOS would come twice"));

  // --split-special-tokens: a user or a reply that writes "</s>" or "<s>" neither ends nor opens
  // anything; the template's own <s> (one per conversation) and </s> (one per reply, in the
  // loss) stay special. Without it the text becomes the tokens, and the summary says so.
  {
    std::ofstream f(tmp / "tricky.jsonl");
    for (int k = 0; k < 10; ++k)
      f << json{{"messages",
                 {{{"role", "user"}, {"content", "is </s> the end? <s> " + std::to_string(k)}},
                  {{"role", "assistant"}, {"content", "</s> ends a reply."}}}}}
               .dump()
        << "\n";
  }
  for (const bool split : {true, false}) {
    const std::string out = tmp / (split ? "split" : "nosplit");
    r = run_keel("tokenize --jsonl " + tmp / "tricky.jsonl" + " --chat --tokenizer hf:" + model.string() + " --out " + out +
                 " --val-fraction 0" + (split ? " --split-special-tokens" : ""));
    INFO(r.output);
    REQUIRE(r.code == 0);
    const data::TokenFile f = data::TokenFile::open(out + "/train_000.bin");
    const auto mask = data::LossMask::open_for(f);
    REQUIRE(mask);
    int64_t bos = 0, eos = 0, eos_in_loss = 0;
    for (int64_t i = 0; i < f.num_tokens(); ++i) {
      bos += f.token(i) == 1;
      eos += f.token(i) == 2;
      eos_in_loss += f.token(i) == 2 && mask->in_loss(i);
    }
    CHECK(bos == (split ? 10 : 20));
    CHECK(eos == (split ? 10 : 30));
    CHECK(eos_in_loss == (split ? 10 : 20));
    std::ifstream meta_in(out + "/meta.json");
    CHECK(json::parse(meta_in)["split_special_tokens"] == split);
    if (split) CHECK(r.output.find("hold the text of a special token") == std::string::npos);
    else CHECK_THAT(r.output, Catch::Contains("NOTE 10 conversations hold the text of a special token (</s>)"));
  }
}

// README's "Finetuning a released model" with an Instruct model: convert, tokenize conversations
// with the converted tokenizer, finetune, keel sample --chat the run, export. The HF download is
// deleted after the conversion, so the run's checkpoints must lead back to the converted
// checkpoint (meta.json source.init_from) or to the template the data was rendered with.
TEST_CASE("keel sample --chat on a finetune finds the chat template it was trained with, HF download gone", "[hf][cli][chat]") {
  test::TempDir tmp("hfchatft");
  const std::string model = tmp / "model", ck = tmp / "ckpt";
  make_chat_model(model);
  write_chats(tmp / "chats.jsonl");
  REQUIRE(run_keel("convert hf:" + model + " " + ck).code == 0);
  fs::remove_all(model);
  // Two steps from `init` on the token files in `data` (none: a plain-text shard).
  auto train = [&](const std::string& init, const std::string& data, const std::string& out) {
    const std::string sets = data.empty() ? " --set data.train=" + kHf + "data/fortunes_sp.bin --set 'data.val=[]'"
                                          : " --set 'data.train=" + data + "/train_*.bin' --set 'data.val=" + data +
                                                "/val_*.bin'";  // its </s> after each reply: no document masking
    const auto r = run_keel("train --config " + ck + "/config.json --init-from " + init + " --out " + out + " -q --steps 2" +
                            sets + " --set train.seq_len=64 --set train.global_batch=2 --set schedule.warmup_steps=0");
    INFO(r.output);
    REQUIRE(r.code == 0);
  };
  // keel sample --chat's output, which must succeed.
  auto chat = [&](const std::string& checkpoint) {
    const auto r = run_keel("sample --checkpoint " + checkpoint + " --chat \"tell me about rain\" -t 0 -n 4 --show-ids");
    INFO(r.output);
    REQUIRE(r.code == 0);
    return r.output;
  };
  const std::vector<int32_t> prompt_ids = ids_after(chat(ck), "prompt ids");
  REQUIRE(prompt_ids.size() > 5);
  // A finetune's checkpoints chat through the converted checkpoint's template: its own file, or
  // the copy beside the chat data the run was trained on.
  auto chats_as_converted = [&](const std::string& checkpoint, const std::string& template_file) {
    const std::string out = chat(checkpoint);
    INFO(out);
    CHECK_THAT(out, Catch::Contains("chat template of " + template_file + ";"));
    CHECK(test::read_file(template_file) == test::read_file(ck + "/tokenizer_config.json"));
    CHECK(ids_after(out, "prompt ids") == prompt_ids);
  };

  // The README's steps: the data is rendered with the converted checkpoint's template.
  auto r = run_keel("tokenize --jsonl " + tmp / "chats.jsonl" + " --chat --tokenizer " + ck + " --out " + tmp / "chat" +
                    " --val-fraction 0.1");
  INFO(r.output);
  REQUIRE(r.code == 0);
  train(ck, tmp / "chat", tmp / "run");
  chats_as_converted(tmp / "run/checkpoints", tmp / "chat/tokenizer_config.json");
  // Data for a next stage, tokenized for the finetune (its run directory): the tokenizer and
  // template it was trained with, so the same token files.
  r = run_keel("tokenize --jsonl " + tmp / "chats.jsonl" + " --chat --tokenizer " + tmp / "run" + " --out " + tmp / "chat2" +
               " --val-fraction 0.1");
  INFO(r.output);
  REQUIRE(r.code == 0);
  CHECK_THAT(r.output, Catch::Contains("is a keel checkpoint: its tokenizer is " + ck + "/tokenizer.json"));
  for (const char* f : {"train_000.bin", "train_000.mask", "val_000.bin"}) {
    INFO(f);
    REQUIRE(fs::exists(tmp / "chat/" + f));
    CHECK(test::read_file(tmp / "chat2/" + f) == test::read_file(tmp / "chat/" + f));
  }
  // Export without --like takes the tokenizer files from the converted checkpoint.
  r = run_keel("convert " + tmp / "run/checkpoints hf:" + tmp / "export");
  INFO(r.output);
  REQUIRE(r.code == 0);
  CHECK_THAT(r.output, Catch::Contains("copied tokenizer.json, tokenizer_config.json") && !Catch::Contains("not written"));

  // Data without a template (plain text): the template of the checkpoint the run started from.
  train(ck, "", tmp / "run_text");
  chats_as_converted(tmp / "run_text/checkpoints", ck + "/tokenizer_config.json");

  // A soup of the two finetunes carries their lineage: it chats, and exports complete in the
  // source's dtype, as each of them does.
  r = run_keel("ckpt average " + tmp / "run/checkpoints " + tmp / "run_text/checkpoints --out " + tmp / "soup");
  INFO(r.output);
  REQUIRE(r.code == 0);
  chats_as_converted(tmp / "soup", tmp / "chat/tokenizer_config.json");  // the first input's
  r = run_keel("convert " + tmp / "soup hf:" + tmp / "soup_export");
  INFO(r.output);
  REQUIRE(r.code == 0);
  CHECK_THAT(r.output, Catch::Contains("copied tokenizer.json, tokenizer_config.json") && !Catch::Contains("not written"));

  // A base model made a chat model with a template of one's own (tokenize --chat-template):
  // the run learnt that template, so sample --chat uses it.
  std::ofstream(tmp / "mine.jinja") << "{% for m in messages %}<{{ m.role }}> {{ m.content }}\n{% endfor %}"
                                       "{% if add_generation_prompt %}<assistant>{% endif %}";
  r = run_keel("tokenize --jsonl " + tmp / "chats.jsonl" + " --chat --chat-template " + tmp / "mine.jinja" +
               " --tokenizer hf:" + kHf + "llama_trained --out " + tmp / "mine" + " --val-fraction 0.1");
  INFO(r.output);
  REQUIRE(r.code == 0);
  train("hf:" + kHf + "llama_trained", tmp / "mine", tmp / "run_mine");
  // The data keeps a copy of the template, so the original may go.
  std::ifstream mine_meta_in(tmp / "mine/meta.json");
  json mine_meta = json::parse(mine_meta_in);
  CHECK(mine_meta["source"]["chat_template"] == "chat_template.jinja");
  CHECK(mine_meta["source"]["chat_template_origin"] == tmp / "mine.jinja");
  CHECK(test::read_file(tmp / "mine/chat_template.jinja") == test::read_file(tmp / "mine.jinja"));
  fs::remove(tmp / "mine.jinja");
  const std::string mine = chat(tmp / "run_mine/checkpoints");
  CHECK_THAT(mine, Catch::Contains("chat template of " + tmp / "mine/chat_template.jinja"));
  const auto plain = run_keel("sample --checkpoint " + tmp / "run_mine/checkpoints" +
                              " --prompt \"<user> tell me about rain\n<assistant>\" --no-special-tokens -t 0 -n 4 --show-ids");
  REQUIRE(plain.code == 0);
  CHECK(ids_after(mine, "prompt ids") == ids_after(plain.output, "prompt ids"));
  // Data from an older keel tokenize, run in tmp: no copy, and the template recorded relative to
  // tmp. Run from there, keel finds it, with a note; from elsewhere, the note and the refusal
  // name meta.json and the path.
  fs::rename(tmp / "mine/chat_template.jinja", tmp / "mine.jinja");
  mine_meta["source"]["chat_template"] = "mine.jinja";
  std::ofstream(tmp / "mine/meta.json") << mine_meta.dump(2);
  const std::string sample_mine = std::string(KEEL_BINARY) + " sample --checkpoint " + tmp / "run_mine/checkpoints" +
                                  " --chat \"tell me about rain\" -t 0 -n 4 --show-ids";
  const auto old_data = test::run_shell("cd " + tmp.path.string() + " && " + sample_mine);
  INFO(old_data.output);
  CHECK(old_data.code == 0);
  CHECK_THAT(old_data.output, Catch::Contains("keel: NOTE " + tmp / "mine/meta.json" + " records source.chat_template "
                                              "\"mine.jinja\", which is not in " + tmp / "mine" + "; taking " +
                                              tmp / "mine.jinja" + " from the current directory"));
  CHECK(ids_after(old_data.output, "prompt ids") == ids_after(mine, "prompt ids"));
  const auto elsewhere = test::run_shell("cd " + tmp / "run_mine" + " && " + sample_mine);
  INFO(elsewhere.output);
  CHECK(elsewhere.code == 2);
  CHECK_THAT(elsewhere.output, Catch::Contains("keel: NOTE " + tmp / "mine/meta.json" +
                                               " records source.chat_template \"mine.jinja\", the template the data was "
                                               "rendered with, but neither " + tmp / "mine/mine.jinja" + " nor " +
                                               tmp / "run_mine/mine.jinja" + " exists"));
  CHECK_THAT(elsewhere.output, Catch::Contains("no chat template") && Catch::Contains(tmp / "mine/mine.jinja (does not exist)"));

  // Nothing left to find: the error names the places that have gone and what to pass.
  fs::rename(ck, tmp / "ckpt_moved");
  r = run_keel("sample --checkpoint " + tmp / "run_text/checkpoints" + " --tokenizer " + kHf + "llama_trained --chat hi");
  CHECK(r.code == 2);
  CHECK_THAT(r.output, Catch::Contains("no chat template") && Catch::Contains(ck + " (does not exist)") &&
                           Catch::Contains("pass --chat-template"));
}

// Weights that overflow the forward (finite, but far too large: a model that diverged) give
// non-finite logits: argmax would decode token 0 forever and the choice picks would be noise, so
// sample and eval stop, naming the problem. (A nan in the weights is refused at load.)
TEST_CASE("keel sample and keel eval stop on non-finite logits instead of decoding them", "[hf][cli][eval]") {
  test::TempDir tmp("hfnan");
  const fs::path d = fs::path(tmp / "nan");
  fs::copy(kHf + "llama_trained", d, fs::copy_options::recursive);
  {
    auto r = data::SafetensorsReader::open((d / "model.safetensors").string());
    std::vector<std::vector<char>> keep;
    std::vector<data::SafetensorsTensorToWrite> ts;
    for (const auto& t : r.tensors()) {
      auto b = r.bytes(t);
      keep.emplace_back(reinterpret_cast<const char*>(b.data()), reinterpret_cast<const char*>(b.data()) + b.size());
      if (t.name == "model.layers.0.self_attn.q_proj.weight") {
        REQUIRE(t.dtype == data::SafetensorsDtype::F32);
        const float huge = 3e38f;  // finite; every q then overflows to inf (or inf - inf)
        for (size_t at = 0; at + sizeof huge <= keep.back().size(); at += sizeof huge)
          std::memcpy(keep.back().data() + at, &huge, sizeof huge);
      }
      ts.push_back({t.name, t.dtype, t.shape, keep.back().data()});
    }
    data::write_safetensors((d / "new.safetensors").string(), ts, {{"format", "pt"}});
  }
  fs::rename(d / "new.safetensors", d / "model.safetensors");

  auto r = run_keel("sample --checkpoint hf:" + d.string() + " --prompt-ids 1,5,6 -t 0 -n 4 --ignore-eos --show-ids");
  INFO(r.output);
  CHECK(r.code == 5);
  CHECK_THAT(r.output, Catch::Contains("non-finite logits at position 3") && Catch::Contains("hold inf/NaN") &&
                           !Catch::Contains("generated ids"));
  const json e = expected("choices_llama_trained");
  r = run_keel("eval --checkpoint hf:" + d.string() + " --choices " + kHf + e["file"].get<std::string>() + " --limit 3");
  INFO(r.output);
  CHECK(r.code == 5);
  CHECK_THAT(r.output, Catch::Contains("non-finite log-likelihood") && Catch::Contains("hold inf/NaN") &&
                           !Catch::Contains("acc "));
}

TEST_CASE("keel sample refuses prompt ids beyond the model's vocabulary before printing anything", "[hf][cli]") {
  // llama_trained has 512 ids; gpt2.json's tokenizer 802, and encodes "zebra" past 511.
  const std::string model = " --checkpoint hf:" + kHf + "llama_trained -n 3";
  auto r = run_keel("sample" + model + " --prompt-ids 1,5000");
  INFO(r.output);
  CHECK(r.code == 2);
  CHECK_THAT(r.output, Catch::Contains("--prompt-ids: token 5000 is outside the model's vocabulary (512 ids, 0 .. 511)") &&
                           !Catch::Contains("Generator"));
  r = run_keel("sample" + model + " --prompt-ids=-1");
  CHECK(r.code == 2);
  CHECK_THAT(r.output, Catch::Contains("--prompt-ids: token -1 is outside the model's vocabulary"));
  r = run_keel("sample" + model + " --tokenizer " + std::string(KEEL_FIXTURE_DIR) +
               "/tokenizers/gpt2.json --prompt 'the quick brown fox jumps over the lazy dog zebra'");
  INFO(r.output);
  CHECK(r.code == 2);
  CHECK_THAT(r.output, Catch::Contains("--prompt: token 532 is outside the model's vocabulary (512 ids, 0 .. 511), from "
                                       "the tokenizer: is it the model's own? (--tokenizer)") &&
                           !Catch::Contains("the quick"));  // nothing printed before the refusal
}

TEST_CASE("keel sample draws only ids the tokenizer has when the model vocabulary is larger", "[hf][cli]") {
  // llama_trained has 512 ids, whitespace.json 300: at temperature 1.5 over all 512 most draws
  // landed past 299 (ids with no text) before the tokenizer's size bounded them.
  const auto r = run_keel("sample --checkpoint hf:" + kHf + "llama_trained --tokenizer " +
                          std::string(KEEL_FIXTURE_DIR) +
                          "/tokenizers/whitespace.json --prompt 'the cat' -t 1.5 --top-p 1 -n 30 --show-ids "
                          "--seed 3 --ignore-eos");
  INFO(r.output);
  REQUIRE(r.code == 0);
  CHECK_THAT(r.output, Catch::Contains("the model has 512 ids, the tokenizer 300: ids from 300 on have no text"));
  const std::vector<int32_t> ids = ids_after(r.output, "generated ids");
  REQUIRE(ids.size() == 30);
  for (int32_t id : ids) CHECK(id < 300);
}

TEST_CASE("keel eval --seq-len without --rows is refused: it would be ignored", "[hf][cli][eval]") {
  const auto r =
      run_keel("eval --checkpoint hf:" + kHf + "gpt2_tied --choices " + kHf + "choices/gpt2_ids.jsonl --seq-len 16");
  INFO(r.output);
  CHECK(r.code == 2);
  CHECK_THAT(r.output, Catch::Contains("--seq-len requires --rows"));
}

TEST_CASE("keel sample --top-p 0 keeps only the most likely token, as greedy decoding", "[hf][cli]") {
  const json e = expected("llama_trained");
  const std::string prompt = e["text"]["prompt"].get<std::string>();
  for (const char* seed : {"1", "7"}) {
    const auto r = run_keel("sample --checkpoint hf:" + kHf + "llama_trained --prompt '" + prompt +
                            "' -t 1 --top-p 0 -n 16 --show-ids --seed " + seed);
    INFO(r.output);
    REQUIRE(r.code == 0);
    CHECK(ids_after(r.output, "generated ids") == e["text"]["new_ids"].get<std::vector<int32_t>>());
  }
}
