// The numeric options of every subcommand: strict parsing (no NaN, no silent clamping, no
// octal) and messages that say what is allowed (train/cli_checks.h).
#include <catch2/catch.hpp>

#include <string>
#include <vector>

#include "common/process.h"
#include "common/workspace.h"
#include "train/cli_checks.h"
#include "train/commands.h"

using namespace keel;
using test::run_keel;

namespace {

// The validator's message for `arg` ("" when accepted), and the argument as it passes on.
std::pair<std::string, std::string> check(const CLI::Validator& v, std::string arg) {
  std::string msg = v(arg);
  return {msg, arg};
}

// Every option of `app` and its subcommands, with the subcommand path ("plan --gpus").
void each_option(const CLI::App& app, const std::string& path,
                 const std::function<void(const std::string&, const CLI::Option&)>& fn) {
  for (const CLI::Option* o : app.get_options()) fn(path, *o);
  for (const CLI::App* sub : app.get_subcommands([](const CLI::App*) { return true; }))
    each_option(*sub, path + " " + sub->get_name(), fn);
}

}  // namespace

TEST_CASE("cli::integer: whole decimal numbers of the option's type, with what is allowed", "[cli_checks]") {
  const CLI::Validator positive = cli::integer<int64_t>(1);
  CHECK(check(positive, "12") == std::pair<std::string, std::string>{"", "12"});
  CHECK(check(positive, "010").second == "10");  // not octal 8, as CLI11's strtoll(base 0) would read it
  CHECK(check(positive, "+7").second == "7");
  CHECK(check(positive, "0").first == "0 must be a positive integer");
  CHECK(check(positive, "-3").first == "-3 must be a positive integer");
  CHECK(check(positive, "abc").first == "'abc' is not an integer");
  CHECK(check(positive, "1.5").first == "'1.5' is not an integer");
  CHECK(check(positive, "1e3").first == "'1e3' is not an integer");
  CHECK(check(positive, "0x10").first == "'0x10' is not an integer");
  CHECK(check(positive, "").first == "'' is not an integer");
  CHECK(check(positive, "-").first == "'-' is not an integer");
  CHECK(check(positive, "99999999999999999999").first ==
        "99999999999999999999 is too large (allowed: a positive integer, at most 9223372036854775807)");
  CHECK(check(cli::integer<int64_t>(0), "-1").first == "-1 must be a non-negative integer");
  CHECK(check(cli::integer<int>(1), "3000000000").first ==
        "3000000000 is too large (allowed: a positive integer, at most 2147483647)");
  CHECK(check(cli::integer<int>(0, 16), "17").first == "17 must be an integer in [0, 16]");
  // Unsigned: the seed 2^64 is not 2^64 - 1, and -3 is not 2^64 - 3.
  const CLI::Validator seed = cli::integer<uint64_t>(0);
  CHECK(check(seed, "18446744073709551615").first.empty());
  CHECK(check(seed, "18446744073709551616").first ==
        "18446744073709551616 is too large (allowed: a non-negative integer, at most 18446744073709551615)");
  CHECK(check(seed, "-3").first == "-3 must be a non-negative integer");
}

TEST_CASE("cli::number: finite numbers in a range, never NaN", "[cli_checks]") {
  const CLI::Validator unit = cli::number(0, 1);
  CHECK(check(unit, "0.5").first.empty());
  CHECK(check(unit, "1").first.empty());
  CHECK(check(unit, "0").first.empty());
  CHECK(check(unit, "nan").first == "'nan' is not a finite number");
  CHECK(check(unit, "-nan").first == "'-nan' is not a finite number");
  CHECK(check(unit, "inf").first == "'inf' is not a finite number");
  CHECK(check(unit, "abc").first == "'abc' is not a number");
  CHECK(check(unit, "0.5x").first == "'0.5x' is not a number");
  CHECK(check(unit, "1.5").first == "1.5 must be a number in [0, 1]");
  CHECK(check(unit, "1e400").first == "1e400 must be a number in [0, 1]");
  CHECK(check(cli::positive_number(), "0").first == "0 must be a number > 0");
  CHECK(check(cli::positive_number(), "-5").first == "-5 must be a number > 0");
  CHECK(check(cli::number(0), "-1").first == "-1 must be a number >= 0");
  CHECK(check(cli::number(0, 1, false, true), "1").first == "1 must be a number in [0, 1)");
  CHECK(check(cli::memory_size(), "80GiB").first.empty());
  CHECK_THAT(check(cli::memory_size(), "8388608TiB").first, Catch::Contains("is too large"));
}

TEST_CASE("every numeric option of every subcommand goes through a keel check", "[cli_checks]") {
  CLI::App app;
  for (auto add : {add_train_command, add_plan_command, add_ckpt_command, add_convert_command, add_sample_command,
                   add_doctor_command, add_eval_command, add_tokenize_command})
    add(app);
  int numeric = 0;
  each_option(app, "keel", [&](const std::string& path, const CLI::Option& o) {
    const std::string type = o.get_type_name().substr(0, o.get_type_name().find(':'));
    if (type != "INT" && type != "UINT" && type != "FLOAT") return;
    ++numeric;
    INFO(path << " " << o.get_name() << " (" << type << ")");
    CHECK_NOTHROW(const_cast<CLI::Option&>(o).get_validator(cli::kCheckName));
  });
  CHECK(numeric >= 40);  // the walk found them (train, sample, eval, plan, ckpt, doctor, tokenize)
}

TEST_CASE("numeric options through the binary: exit code 2 and one clear line", "[cli][cli_checks]") {
  test::Workspace ws;
  const std::string cfg = " --config " + ws.config, ck = " -c " + (ws.dir / "none");
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"train" + cfg + " --steps 0", "--steps: 0 must be a positive integer"},
      {"train" + cfg + " --steps abc", "--steps: 'abc' is not an integer"},
      {"train" + cfg + " --steps 99999999999999999999", "--steps: 99999999999999999999 is too large"},
      {"train" + cfg + " --seed -3", "--seed: -3 must be a non-negative integer"},
      {"train" + cfg + " --time-limit nan", "--time-limit: 'nan' is not a finite number"},
      {"train" + cfg + " --stop-at 0", "--stop-at: 0 must be a positive integer"},
      {"sample" + ck + " --prompt-ids 1 -t nan", "--temperature: 'nan' is not a finite number"},
      {"sample" + ck + " --prompt-ids 1 --top-p nan", "--top-p: 'nan' is not a finite number"},
      {"sample" + ck + " --prompt-ids 1 --threads 0", "--threads: 0 must be a positive integer"},
      {"sample" + ck + " --prompt-ids 1 --seed -1", "--seed: -1 must be a non-negative integer"},
      {"eval" + ck + " --choices x.jsonl --limit 0", "--limit: 0 must be a positive integer"},
      {"plan" + cfg + " --headroom nan", "--headroom: 'nan' is not a finite number"},
      {"plan" + cfg + " --tflops 0", "--tflops: 0 must be a number > 0"},
      {"plan" + cfg + " --gpu-mem 8388608TiB", "--gpu-mem: memory size '8388608TiB' is too large"},
      {"plan" + cfg + " --cuda-context 1e30", "--cuda-context: memory size '1e30' is too large"},
      {"doctor frozen a b --threshold nan", "--threshold: 'nan' is not a finite number"},
      {"doctor metrics " + ws.config + " --z nan", "--z: 'nan' is not a finite number"},  // a file that exists
      {"tokenize --jsonl x --tokenizer t --out o --seed 18446744073709551616",
       "--seed: 18446744073709551616 is too large"},
      {"tokenize --jsonl x --tokenizer t --out o --val-fraction nan", "--val-fraction: 'nan' is not a finite number"},
      {"ckpt diff a b --max -1", "--max: -1 must be a non-negative integer"},
      {"convert a b --max-shard-size 1e400", "--max-shard-size: memory size '1e400' is too large"},
  };
  for (const auto& [args, message] : cases) {
    const test::ProcessResult r = run_keel(args);
    INFO("keel " << args << "\n" << r.output);
    CHECK(r.code == 2);
    CHECK_THAT(r.output, Catch::Contains(message) && !Catch::Contains("not in range"));
  }
}
