// The CUDA backend's attention settings (kernels/attention_settings.h): what the environment
// may say, and the backward scratch each choice takes, which keel plan and the run's memory check
// count. The backend reads the same settings (test_gpu "[attention]" checks that it does).
#include <catch2/catch.hpp>

#include <string>

#include "kernels/attention_settings.h"
#include "test/common/scoped_env.h"

using namespace keel;
using keel::test::ScopedEnv;
using Catch::Matchers::Contains;

namespace {
constexpr size_t kMiB = size_t{1} << 20;
constexpr size_t kTile = 64 * 64 * 2;  // one staged bf16 dS tile
}  // namespace

TEST_CASE("attention settings: the environment's choices, each bad value refused naming its variable",
          "[attention][settings]") {
  const ScopedEnv kernels("KEEL_ATTENTION"), ds("KEEL_ATTN_DS_MB"), ws("KEEL_CUDNN_WORKSPACE_MB");
  kernels.set(nullptr), ds.set(nullptr), ws.set(nullptr);
  AttentionSettings s = attention_settings_from_env();
  CHECK(s.kernels == AttentionKernels::Fused);
  CHECK(s.ds_budget == 1024 * kMiB);
  CHECK(s.cudnn_workspace_cap == 4096 * kMiB);

  for (const char* fused : {"", "fused"}) {
    kernels.set(fused);
    CHECK(attention_settings_from_env().kernels == AttentionKernels::Fused);
  }
  kernels.set("simple");
  CHECK(attention_settings_from_env().kernels == AttentionKernels::Simple);
  kernels.set("cudnn");
  CHECK(attention_settings_from_env().kernels == AttentionKernels::Cudnn);
  for (const char* bad : {"flash", "CUDNN", "cudnn "}) {
    INFO("KEEL_ATTENTION=" << bad);
    kernels.set(bad);
    CHECK_THROWS_WITH(attention_settings_from_env(), Contains("KEEL_ATTENTION must be fused") &&
                                                         Contains("simple") && Contains("cudnn") &&
                                                         Contains(std::string("got '") + bad + "'"));
  }

  // KEEL_ATTN_DS_MB and KEEL_CUDNN_WORKSPACE_MB: whole MiB from 0 to 2^24
  kernels.set("cudnn");
  ds.set("0"), ws.set("1536");
  s = attention_settings_from_env();
  CHECK(s.ds_budget == 0);
  CHECK(s.cudnn_workspace_cap == 1536 * kMiB);
  ds.set("16777216"), ws.set("0");
  s = attention_settings_from_env();
  CHECK(s.ds_budget == (size_t{16777216} << 20));
  CHECK(s.cudnn_workspace_cap == 0);
  for (const char* var : {"KEEL_ATTN_DS_MB", "KEEL_CUDNN_WORKSPACE_MB"}) {
    const ScopedEnv env(var);
    for (const char* bad : {"-1", "2GiB", " 8", "16777217", "abc", "1.5"}) {
      INFO(var << "=" << bad);
      env.set(bad);
      CHECK_THROWS_WITH(attention_settings_from_env(), Contains(std::string(var) + " must be a whole number of MiB") &&
                                                           Contains(std::string("got '") + bad + "'"));
    }
  }
  // the cuDNN cap is read only where cuDNN runs, as the backend reads it: a stale value elsewhere
  // stops nothing
  kernels.set("fused"), ws.set("lots");
  CHECK(attention_settings_from_env().cudnn_workspace_cap == 4096 * kMiB);
}

TEST_CASE("attention settings: the staged dS splits into chunks of whole kv heads, then of sequences",
          "[attention][settings]") {
  // T = 130: n = 3 query tiles, 6 causal tiles per head; 8 heads in 2 kv groups of 4
  const size_t per_head = 6 * kTile, per_kv = 4 * per_head;
  CHECK(attention_ds_tiles_per_head(130) == 6);
  CHECK(attention_ds_tiles_per_head(128) == 3);
  CHECK(attention_ds_tiles_per_head(1) == 1);

  AttentionDsChunks c = attention_ds_chunks(3, 130, 8, 2, 2, 1024 * kMiB);  // everything fits
  CHECK(c.kv == 2);
  CHECK(c.seqs == 3);
  CHECK(c.bytes == 3 * 2 * per_kv);
  c = attention_ds_chunks(3, 130, 8, 2, 2, 2 * 2 * per_kv + per_kv);  // two of the three sequences
  CHECK(c.kv == 2);
  CHECK(c.seqs == 2);
  CHECK(c.bytes == 2 * 2 * per_kv);
  c = attention_ds_chunks(3, 130, 8, 2, 2, 2 * per_kv - 1);  // one kv head of one sequence
  CHECK(c.kv == 1);
  CHECK(c.seqs == 1);
  CHECK(c.bytes == per_kv);
  c = attention_ds_chunks(3, 130, 8, 2, 2, per_kv - 1);  // not one kv head: recompute, no scratch
  CHECK(c.kv == 0);
  CHECK(c.bytes == 0);
  CHECK(attention_ds_chunks(3, 130, 8, 2, 2, 0).bytes == 0);
}

TEST_CASE("attention settings: the backward scratch of each choice", "[attention][settings]") {
  // the 1B Llama benchmark's layer: 4 sequences of 2048, 32 heads in 8 kv groups, head_dim 64
  const int64_t B = 4, T = 2048, nh = 32, nkv = 8, hd = 64;
  const size_t all_tiles = static_cast<size_t>(B * nh * attention_ds_tiles_per_head(T)) * kTile;  // 528 MiB
  const size_t dp = static_cast<size_t>(B * nh * T * T) * 2;                                      // 1 GiB
  const size_t delta = static_cast<size_t>(B * T * nh) * 4;                                       // 1 MiB
  // a head_dim the fused kernels pad to 64: bf16 copies of qkv, dqkv (48 heads each) and dO (32)
  const size_t copies = static_cast<size_t>(B * T) * 64 * 2 * (48 + 48 + 32);                    // 128 MiB
  CHECK(all_tiles == 528 * kMiB);
  CHECK(delta == kMiB);
  CHECK(copies == 128 * kMiB);
  AttentionSettings s;  // fused, 1 GiB of dS
  CHECK(attention_backward_scratch_bytes(s, B, T, nh, nkv, hd) == all_tiles + delta);
  s.ds_budget = 200 * kMiB;  // whole kv heads of one sequence: 16.5 MiB each, 8 of them
  CHECK(attention_backward_scratch_bytes(s, B, T, nh, nkv, hd) == all_tiles / (B * nkv) * nkv + delta);
  s.ds_budget = 10 * kMiB;  // not one kv head: recomputed
  CHECK(attention_backward_scratch_bytes(s, B, T, nh, nkv, hd) == delta);
  s.ds_budget = kDefaultAttentionDsBudget;
  CHECK(attention_backward_scratch_bytes(s, B, T, nh, nkv, 160) == all_tiles + delta);          // its own width
  CHECK(attention_backward_scratch_bytes(s, B, T, nh, nkv, 32) == all_tiles + delta + copies);  // padded to 64
  CHECK(attention_backward_scratch_bytes(s, B, T, nh, nkv, 256) == delta);                      // plain kernels
  CHECK(attention_backward_scratch_bytes(s, B, T, nh, nkv, hd, 4) == delta);                    // fp32: plain

  s.kernels = AttentionKernels::Simple;
  CHECK(attention_backward_scratch_bytes(s, B, T, nh, nkv, hd) == delta);

  s.kernels = AttentionKernels::Cudnn;  // its dP workspace where it takes the shape
  CHECK(attention_backward_scratch_bytes(s, B, T, nh, nkv, hd) == dp);
  CHECK(attention_backward_scratch_bytes(s, B, T, nh, nkv, 256) == dp);
  CHECK(attention_backward_scratch_bytes(s, B, T, nh, nkv, hd, 4) == delta);  // fp32: the plain kernels
  s.cudnn_workspace_cap = dp - 1;  // too big for the cap: keel's fused kernels run it
  CHECK(attention_backward_scratch_bytes(s, B, T, nh, nkv, hd) == all_tiles + delta);
  s.cudnn_workspace_cap = kDefaultCudnnWorkspaceCap;
  CHECK(attention_backward_scratch_bytes(s, B, T, nh, nkv, 36) == all_tiles + delta + copies);  // cuDNN refuses it
  CHECK(attention_backward_scratch_bytes(s, 1, 65, 4, 4, hd) == 4 * 3 * kTile + 65 * 4 * 4);  // keel's the larger
}
