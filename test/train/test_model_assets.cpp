// Where keel looks for a model's tokenizer and chat template (train/model_loading.h), and what
// its refusals say when there is none.
#include <catch2/catch.hpp>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "common/run_config.h"
#include "common/temp_dir.h"
#include "data/chat_template.h"
#include "train/model_loading.h"

using namespace keel;
namespace fs = std::filesystem;

TEST_CASE("tokenizer_places lists each folder locate_tokenizer searched once, and says which are gone",
          "[tokenizer][errors]") {
  test::TempDir dir("places");
  const fs::path run = dir.path / "run", data = dir.path / "data", gone = dir.path / "moved-away";
  fs::create_directories(run);
  fs::create_directories(data);
  // The empty folder is what data.train=shard.bin gives: locate_tokenizer does not search it.
  const std::string text = tokenizer_places({run, "", data, run, gone});
  CHECK(text == "looked at:\n  " + (run / "tokenizer.json").string() + "\n  " + (data / "tokenizer.json").string() +
                    "\n  " + (gone / "tokenizer.json").string() + " (its folder does not exist)");
  CHECK(locate_tokenizer({run, "", data, gone}, "").empty());
}

namespace {

// The current directory changed for a scope (data recorded relative to where keel ran).
struct InDirectory {
  fs::path before = fs::current_path();
  explicit InDirectory(const fs::path& dir) { fs::current_path(dir); }
  ~InDirectory() { fs::current_path(before); }
};

// A data folder as keel tokenize --chat leaves it: meta.json recording `chat_template`.
void write_data_meta(const fs::path& folder, const std::string& chat_template) {
  fs::create_directories(folder);
  std::ofstream(folder / "meta.json") << nlohmann::json{{"source", {{"kind", "jsonl conversations"},
                                                                    {"chat_template", chat_template}}}}
                                             .dump();
}

std::vector<fs::path> templates_of(const fs::path& folder) {
  nlohmann::json j = test::tiny_run_json();
  j["data"]["train"] = (folder / "train_*.bin").string();
  return data_chat_templates(test::make_config(j));
}

}  // namespace

TEST_CASE("data_chat_templates: a recorded template relative to the data folder, or where an older tokenize ran",
          "[chat]") {
  test::TempDir dir("data-chat");
  const fs::path data = dir.path / "work/data";
  fs::create_directories(dir.path / "work/tpl");
  std::ofstream(dir.path / "work/tpl/mine.jinja") << "{{ messages[0].content }}";

  // Today's data: the copy beside it, wherever the folder has moved to.
  write_data_meta(data, "chat_template.jinja");
  std::ofstream(data / "chat_template.jinja") << "{{ messages[0].content }}";
  CHECK(templates_of(data) == std::vector<fs::path>{data / "chat_template.jinja"});
  fs::rename(data, dir.path / "moved");
  CHECK(templates_of(dir.path / "moved") == std::vector<fs::path>{dir.path / "moved/chat_template.jinja"});
  CHECK(data::ChatTemplate::from_path((dir.path / "moved/chat_template.jinja").string()).render(
            nlohmann::ordered_json::parse(R"([{"role": "user", "content": "hi"}])"), false) == "hi");

  // An older keel tokenize, run in work/, recorded tpl/mine.jinja: found from there only, and
  // the folder's own copy wins when there is one.
  write_data_meta(data, "tpl/mine.jinja");
  {
    InDirectory in(dir.path / "work");
    CHECK(templates_of(data) == std::vector<fs::path>{"tpl/mine.jinja"});
    fs::create_directories(data / "tpl");
    std::ofstream(data / "tpl/mine.jinja") << "{{ messages[0].content }}";
    CHECK(templates_of(data) == std::vector<fs::path>{data / "tpl/mine.jinja"});
    fs::remove_all(data / "tpl");
  }
  // Elsewhere it is in neither place: listed as in the folder, where the search says it is gone.
  {
    InDirectory in(dir.path);
    CHECK(templates_of(data) == std::vector<fs::path>{data / "tpl/mine.jinja"});
  }
  // An absolute path (keel tokenize's between the two) is taken as it is.
  write_data_meta(data, (dir.path / "work/tpl/mine.jinja").string());
  CHECK(templates_of(data) == std::vector<fs::path>{dir.path / "work/tpl/mine.jinja"});
}
