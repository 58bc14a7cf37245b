// Where keel looks for a model's tokenizer and chat template (train/model_loading.h), and what
// its refusals say when there is none.
#include <catch2/catch.hpp>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "common/temp_dir.h"
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
