// Loss-mask sidecars (data/loss_mask.h): picked up beside a token file, masked targets become
// -1 in every window, a missing sidecar masks nothing, and a sidecar that does not fit its
// token file is an error naming both files.
#include <catch2/catch.hpp>

#include "data/loss_mask.h"
#include "data/sampler.h"
#include "data_test_util.h"

using namespace keel::data;
using keel::data::test::TempDir;

namespace {

std::vector<uint32_t> iota_tokens(size_t n) {
  std::vector<uint32_t> t(n);
  for (size_t i = 0; i < n; ++i) t[i] = static_cast<uint32_t>(i % 50);
  return t;
}

}  // namespace

TEST_CASE("loss mask: sidecar path next to the token file", "[data][loss_mask]") {
  CHECK(LossMask::sidecar_path("data/train_000.bin") == "data/train_000.mask");
  CHECK(LossMask::sidecar_path("data/shard") == "data/shard.mask");
}

TEST_CASE("loss mask: masked targets become -1, inputs stay, unmasked files are untouched", "[data][loss_mask]") {
  TempDir dir;
  const size_t n = 101;
  write_llmc_shard(dir / "a.bin", iota_tokens(n), false);
  write_llmc_shard(dir / "b.bin", iota_tokens(n), true);  // uint32 shard, no sidecar
  // Prompt/response pattern: tokens [10k, 10k+4) are prompt (0), the rest response (1).
  std::vector<uint8_t> mask(n);
  for (size_t i = 0; i < n; ++i) mask[i] = (i % 10) < 4 ? 0 : 1;
  write_loss_mask(dir / "a.mask", mask);

  const int T = 20;
  TokenDataset ds = TokenDataset::open({dir / "a.bin", dir / "b.bin"}, T, 64);
  REQUIRE(ds.loss_mask(0) != nullptr);
  CHECK(ds.loss_mask(1) == nullptr);
  CHECK(ds.num_masked_files() == 1);
  CHECK(ds.loss_mask(0)->count_in_loss() == 60);

  std::vector<int32_t> in(T), tg(T);
  for (int64_t w = 0; w < ds.num_windows(); ++w) {
    const auto loc = ds.locate(w);
    ds.read_window(w, in.data(), tg.data());
    for (int k = 0; k < T; ++k) {
      const int64_t pos = loc.start + 1 + k;  // the target's position in the file
      INFO("window " << w << " target " << k << " (token " << pos << " of file " << loc.file << ")");
      CHECK(in[k] == static_cast<int32_t>((loc.start + k) % 50));
      if (loc.file == 0 && mask[static_cast<size_t>(pos)] == 0) CHECK(tg[k] == -1);
      else CHECK(tg[k] == static_cast<int32_t>(pos % 50));
    }
  }
}

TEST_CASE("loss mask: a sidecar of the wrong length or kind names both files", "[data][loss_mask][errors]") {
  TempDir dir;
  write_llmc_shard(dir / "t.bin", iota_tokens(64), false);
  write_loss_mask(dir / "t.mask", std::vector<uint8_t>(63, 1));
  std::string msg = test::data_error_of([&] { TokenDataset::open({dir / "t.bin"}, 8, 64); });
  CHECK_THAT(msg, Catch::Contains(dir / "t.mask") && Catch::Contains(dir / "t.bin") && Catch::Contains("63") &&
                      Catch::Contains("64"));

  write_loss_mask(dir / "t.mask", std::vector<uint8_t>(64, 1));
  test::patch<int32_t>(dir / "t.mask", 0, 12345);
  msg = test::data_error_of([&] { TokenDataset::open({dir / "t.bin"}, 8, 64); });
  CHECK_THAT(msg, Catch::Contains("bad magic 12345") && Catch::Contains(dir / "t.bin"));

  test::write_bytes(dir / "t.mask", {1, 2, 3});
  msg = test::data_error_of([&] { TokenDataset::open({dir / "t.bin"}, 8, 64); });
  CHECK_THAT(msg, Catch::Contains("truncated"));

  // A body cut short says so, with the header's count and the bytes there are, not a mismatch.
  write_loss_mask(dir / "t.mask", std::vector<uint8_t>(64, 1));
  std::vector<unsigned char> bytes = test::read_bytes(dir / "t.mask");
  bytes.resize(1024 + 40);
  test::write_bytes(dir / "t.mask", bytes);
  msg = test::data_error_of([&] { TokenDataset::open({dir / "t.bin"}, 8, 64); });
  CHECK_THAT(msg, Catch::Contains(dir / "t.mask") && Catch::Contains("is truncated: its header says 64 tokens") &&
                      Catch::Contains("holds 40 mask bytes") && !Catch::Contains("does not match"));
  bytes.resize(1024 + 70, 1);
  test::write_bytes(dir / "t.mask", bytes);
  msg = test::data_error_of([&] { TokenDataset::open({dir / "t.bin"}, 8, 64); });
  CHECK_THAT(msg, Catch::Contains("6 bytes after the 64 mask bytes"));

  // A byte that is neither 0 nor 1, named with its position; the data's field opens the message.
  std::vector<uint8_t> mask(64, 1);
  mask[0] = 0;
  mask[37] = 7;
  write_loss_mask(dir / "t.mask", mask);
  msg = test::data_error_of([&] { TokenDataset::open({dir / "t.bin"}, 8, 64, DataUse::training, "data.train"); });
  CHECK_THAT(msg, Catch::StartsWith("data.train: loss mask '" + (dir / "t.mask")) &&
                      Catch::Contains("byte 7 at token 37") && Catch::Contains("file offset 1061") &&
                      Catch::Contains("neither 0") && Catch::Contains(dir / "t.bin"));
  mask[37] = 1;
  write_loss_mask(dir / "t.mask", mask);
  CHECK(TokenDataset::open({dir / "t.bin"}, 8, 64).loss_mask(0)->count_in_loss() == 63);
}

TEST_CASE("loss mask: Megatron datasets use prefix.mask", "[data][loss_mask]") {
  TempDir dir;
  write_megatron_dataset(dir / "ds", {iota_tokens(30), iota_tokens(20)}, MegatronDtype::uint16);
  std::vector<uint8_t> mask(50, 1);
  mask[5] = 0;
  write_loss_mask(dir / "ds.mask", mask);
  TokenDataset ds = TokenDataset::open({dir / "ds.bin"}, 10, 64);
  REQUIRE(ds.loss_mask(0) != nullptr);
  std::vector<int32_t> in(10), tg(10);
  ds.read_window(0, in.data(), tg.data());
  CHECK(tg[4] == -1);  // target 4 is token 5
  CHECK(tg[3] == 4);
}

TEST_CASE("eod_mask_loss: the target after each end-of-document input becomes -1, nothing else changes",
          "[data][loss_mask]") {
  //                    input:  3   7   9   7   7   2
  const std::vector<int32_t> in = {3, 7, 9, 7, 7, 2};
  std::vector<int32_t> tgt = {7, 9, -1, 7, 2, 4};
  CHECK(mask_targets_after_eod(in.data(), tgt.data(), 6, 7) == 3);
  CHECK(tgt == std::vector<int32_t>{7, -1, -1, -1, -1, 4});  // index 2 was masked already
  CHECK(mask_targets_after_eod(in.data(), tgt.data(), 6, 11) == 0);
  CHECK(tgt == std::vector<int32_t>{7, -1, -1, -1, -1, 4});
}
