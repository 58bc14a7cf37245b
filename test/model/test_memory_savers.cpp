// The Transformer's two memory savers (model/transformer.h) change memory, not the math.
//
// Activation recomputation, full or selective: the backend is deterministic, so the recomputed
// intermediates are the same bits and every loss, parameter gradient and input gradient must
// equal a run without recomputation bit for bit.
// Chunked head: every row's logits, loss, logits gradient and final-norm gradient are those of
// the unchunked head bit for bit; only the head weight's gradient is summed in per-chunk fp32
// terms (a re-association of the same products: within 1e-6 relative, see below).
//
// Checked on the oracle fixtures' tiny GPT-2 (tied head, biases) and Llama (GQA, RoPE) with
// fp32 and bf16 activations, two pipeline slots in flight (the 1F1B pattern: two forwards, then
// two backwards, so the shared scratch and logits chunk are overwritten between a slot's
// forward and its backward), full recomputation of none, one (of two) and all layers, selective
// recomputation alone and beside full recomputation of the first layer, and chunks
// that divide the rows, leave a remainder, and hold a single row.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "common/fixture.h"
#include "model/transformer.h"

using namespace keel;

namespace {

struct Pass {
  std::vector<double> loss_sums;
  std::vector<float> grads;         // fp32 parameter gradients
  std::vector<uint8_t> grad_input;  // d(loss)/d(embedding output) of the last backward
  std::vector<std::string> probes;  // every probed op with its output's bytes, but the head's two:
  std::vector<uint8_t> logits, dlogits;  // the head's logits and their gradients, in probe order
  int recompute_layers = 0;
  bool selective = false;
  int64_t chunk_rows = 0;
  double allocated = 0;  // the model's activation bytes
};

const char* const kLogitsOp = "logits (head)";
const char* const kDlogitsOp = "d logits (loss gradient x loss scale)";

std::vector<uint8_t> bytes_of(const Tensor& t) {
  const auto* p = static_cast<const uint8_t*>(t.data);
  return {p, p + t.bytes()};
}

Pass run(const test::Fixture& fx, DType act, RecomputePolicy recompute, int64_t logits_chunk_rows = 0) {
  const ParamTable table(fx.model);
  auto be = make_cpu_backend();
  test::Weights w(fx.flat(table, "param"));
  const Tensor weights = w.view(act);
  const int64_t n = table.local_numel();
  std::vector<float> grads(static_cast<size_t>(n), 0.0f);
  Transformer model(table, *be, act, fx.B, fx.T, /*slots=*/2, nullptr, recompute, false, logits_chunk_rows);
  model.bind(weights, Tensor(grads.data(), DType::F32, {n}));

  Pass p;
  p.recompute_layers = model.recompute_layers();
  p.selective = model.selective_recompute();
  p.allocated = static_cast<double>(be->used_bytes());
  p.chunk_rows = model.logits_chunk_rows();
  model.set_probe([&](const Transformer::OpProbe& op) {
    const std::vector<uint8_t> b = bytes_of(op.out);
    for (auto [name, sink] : {std::pair{kLogitsOp, &p.logits}, std::pair{kDlogitsOp, &p.dlogits}})
      if (std::strcmp(op.op, name) == 0) {
        sink->insert(sink->end(), b.begin(), b.end());
        return;
      }
    uint64_t h = 1469598103934665603ull;  // FNV-1a of the output bytes
    for (uint8_t c : b) h = (h ^ c) * 1099511628211ull;
    p.probes.push_back(std::string(op.backward ? "bwd " : "fwd ") + std::to_string(op.layer) + " " + op.op + " " +
                       std::to_string(h));
  });
  // Two micro-batches: the fixture's, and the same tokens with the targets rolled by one.
  const std::vector<int32_t> inputs = fx.inputs();
  const std::vector<int32_t> targets0 = fx.targets();
  std::vector<int32_t> targets1(targets0.size());
  for (size_t i = 0; i < targets0.size(); ++i) targets1[i] = targets0[(i + 1) % targets0.size()];
  const auto valid = [](const std::vector<int32_t>& t) { return std::count_if(t.begin(), t.end(), [](int32_t x) { return x >= 0; }); };
  const float dloss = 1.0f / static_cast<float>(valid(targets0) + valid(targets1));
  const auto r0 = model.forward(0, inputs.data(), targets0.data(), dloss);
  const auto r1 = model.forward(1, inputs.data(), targets1.data(), dloss);
  p.loss_sums = {r0.loss_sum, r1.loss_sum};
  model.backward(0, dloss);
  model.backward(1, dloss);
  p.grads = grads;
  p.grad_input = bytes_of(model.grad_input());
  return p;
}

void check_same(const Pass& ref, const Pass& got) {
  INFO("recompute_layers " << got.recompute_layers << (got.selective ? ", selective" : ""));
  CHECK(got.loss_sums == ref.loss_sums);
  CHECK(std::memcmp(got.grads.data(), ref.grads.data(), ref.grads.size() * sizeof(float)) == 0);
  CHECK(got.grad_input == ref.grad_input);
  // The recomputed forward probes nothing: a health probe sees each op once, with the same bits.
  CHECK(got.probes == ref.probes);
  CHECK(got.logits == ref.logits);
  CHECK(got.dlogits == ref.dlogits);
}

}  // namespace

TEST_CASE("activation recomputation gives the same losses and gradients bit for bit", "[model][recompute]") {
  for (const char* name : {"gpt2_tiny", "llama_tiny"}) {
    const test::Fixture fx(name);
    REQUIRE(fx.model.n_layers == 2);
    for (DType act : {DType::F32, DType::BF16}) {
      INFO(name << " activations " << dtype_name(act));
      const Pass none = run(fx, act, {});
      REQUIRE(none.recompute_layers == 0);
      REQUIRE(none.grads.size() > 0);
      // Not a vacuous comparison: the two micro-batches and the gradients are non-trivial.
      CHECK(none.loss_sums[0] != none.loss_sums[1]);
      CHECK(none.probes.size() > 20);
      const Pass first = run(fx, act, {1});
      CHECK(first.recompute_layers == 1);
      check_same(none, first);
      const Pass all = run(fx, act, {99});  // more than the stage has: all of them
      CHECK(all.recompute_layers == 2);
      check_same(none, all);
      const Pass selective = run(fx, act, {0, true});
      CHECK(selective.selective);
      check_same(none, selective);
      // Two slots of two layers each drop three tensors; one shared pair replaces them.
      CHECK(selective.allocated < none.allocated);
      const Pass both = run(fx, act, {1, true});  // layer 0 recomputed whole, layer 1 rebuilt
      CHECK(both.recompute_layers == 1);
      CHECK(both.selective);
      check_same(none, both);
      CHECK(both.allocated < first.allocated);  // the rebuilt tensors reuse the recompute scratch
      CHECK(!run(fx, act, {99, true}).selective);  // every layer recomputed whole: nothing to rebuild
    }
  }
}

TEST_CASE("model chunks of a rank share selective recomputation's rebuild buffers", "[model][recompute]") {
  // Chunks of an interleaved pipeline never run at once, so a chunk built with scratch_from
  // takes the rebuild pair (a norm output [N, d] and an activation [N, ffn]) from it, as it does
  // the backward scratch; and where the rank recomputes whole layers, the pair is that scratch's.
  const test::Fixture fx("llama_tiny");
  const ParamTable table(fx.model);
  const int64_t N = int64_t{fx.B} * fx.T;
  const double pair = double(N * (fx.model.d_model + fx.model.ffn_hidden)) * 2;  // bf16
  // The bytes a second model adds, built beside a first (recompute policy `first`).
  auto second_adds = [&](RecomputePolicy first, RecomputePolicy second, bool shared) {
    auto be = make_cpu_backend();
    const Transformer a(table, *be, DType::BF16, fx.B, fx.T, 1, nullptr, first);
    const double before = double(be->used_bytes());
    const Transformer b(table, *be, DType::BF16, fx.B, fx.T, 1, nullptr, second, false, 0, false, shared ? &a : nullptr);
    return double(be->used_bytes()) - before;
  };
  const RecomputePolicy none{}, selective{0, true};
  const double saved_plain = second_adds(none, none, false) - second_adds(none, none, true);
  const double saved_selective = second_adds(selective, selective, false) - second_adds(selective, selective, true);
  REQUIRE(saved_plain > 0);
  CHECK(saved_selective - saved_plain == Approx(pair).margin(128));  // allocations round to 64 bytes
  // The first chunk recomputes a layer whole: the second's pair is the first's scratch.
  CHECK(second_adds({1, true}, selective, false) - second_adds({1, true}, selective, true) ==
        Approx(saved_selective).margin(128));
}

TEST_CASE("a negative recompute_layers is refused", "[model][recompute]") {
  const test::Fixture fx("llama_tiny");
  const ParamTable table(fx.model);
  auto be = make_cpu_backend();
  CHECK_THROWS_WITH(Transformer(table, *be, DType::F32, fx.B, fx.T, 1, nullptr, {-1}),
                    Catch::Contains("recompute_layers"));
}

TEST_CASE("a chunked head gives the same rows bit for bit and the head gradient within fp32 re-association",
          "[model][chunked_head]") {
  for (const char* name : {"gpt2_tiny", "llama_tiny"}) {
    const test::Fixture fx(name);
    const ParamTable table(fx.model);
    const ParamSpec& head = table.at(fx.model.tied_embeddings ? "tok_embed" : "lm_head");
    const int64_t N = int64_t{fx.B} * fx.T;
    REQUIRE(N >= 8);
    for (DType act : {DType::F32, DType::BF16}) {
      const Pass whole = run(fx, act, {});
      REQUIRE(whole.chunk_rows == N);  // automatic: the tiny logits are far below the chunk budget
      REQUIRE(whole.logits.size() == size_t(2 * N * table.config().embed_rows() * dtype_size(act)));
      // Chunks of a remainder (N = 3 q + r), exactly half, one row; and recomputation on top.
      for (auto [rows, recompute] : {std::pair{N / 3, 0}, std::pair{N / 2, 0}, std::pair{int64_t{1}, 0},
                                     std::pair{N / 3, 99}}) {
        INFO(name << " activations " << dtype_name(act) << ", chunks of " << rows << " rows, recompute " << recompute);
        const Pass got = run(fx, act, {recompute}, rows);
        REQUIRE(got.chunk_rows == rows);
        CHECK(got.loss_sums == whole.loss_sums);
        CHECK(got.grad_input == whole.grad_input);
        CHECK(got.probes == whole.probes);
        CHECK(got.logits == whole.logits);    // every chunk's logits, in row order
        CHECK(got.dlogits == whole.dlogits);  // and their gradients
        // Every gradient but the head weight's is the same bits. The head weight's is the sum
        // over rows of dlogits^T x, here as one fp32 sum per chunk added up: the same products
        // re-associated, so within a few fp32 ulps of the largest partial sum; 1e-6 relative
        // (in norm) is ~16 ulps, and a lost or doubled chunk would be off by ~1/chunks.
        double diff = 0, ref = 0;
        for (size_t i = 0; i < whole.grads.size(); ++i) {
          const bool in_head = int64_t(i) >= head.offset && int64_t(i) < head.offset + head.numel;
          if (!in_head) {
            if (std::memcmp(&got.grads[i], &whole.grads[i], sizeof(float)) != 0) {
              FAIL_CHECK("gradient element " << i << " differs: " << got.grads[i] << " vs " << whole.grads[i]);
              break;
            }
            continue;
          }
          diff += std::pow(double(got.grads[i]) - whole.grads[i], 2);
          ref += std::pow(double(whole.grads[i]), 2);
        }
        REQUIRE(ref > 0);
        CHECK(std::sqrt(diff / ref) <= 1e-6);
      }
    }
  }
}

TEST_CASE("a chunked head needs the loss gradient in forward, and has no whole logits to show", "[model][chunked_head]") {
  const test::Fixture fx("llama_tiny");
  const ParamTable table(fx.model);
  auto be = make_cpu_backend();
  const std::vector<float> w = fx.flat(table, "param");
  const int64_t n = table.local_numel();
  std::vector<float> grads(static_cast<size_t>(n), 0.0f);
  Transformer model(table, *be, DType::F32, fx.B, fx.T, 1, nullptr, {}, false, 3);
  model.bind(Tensor(const_cast<float*>(w.data()), DType::F32, {n}), Tensor(grads.data(), DType::F32, {n}));
  REQUIRE(model.head_chunked());
  const std::vector<int32_t> inputs = fx.inputs(), targets = fx.targets();
  // Evaluation: no dloss, the loss alone (the same as the unchunked head's, bit for bit).
  const double loss = model.forward(inputs.data(), targets.data()).loss_sum;
  Transformer whole(table, *be, DType::F32, fx.B, fx.T);
  whole.bind(Tensor(const_cast<float*>(w.data()), DType::F32, {n}), Tensor(grads.data(), DType::F32, {n}));
  CHECK(whole.forward(inputs.data(), targets.data()).loss_sum == loss);
  CHECK_THROWS_WITH(model.backward(0.5f), Catch::Contains("same dloss"));
  model.forward(inputs.data(), targets.data(), 0.25f);
  CHECK_THROWS_WITH(model.backward(0.5f), Catch::Contains("same dloss"));
  CHECK_THROWS_WITH(model.logits(), Catch::Contains("chunks of 3 rows"));
  CHECK_THROWS_WITH(Transformer(table, *be, DType::F32, fx.B, fx.T, 1, nullptr, {}, false, -1),
                    Catch::Contains("logits_chunk_rows"));
}

TEST_CASE("the automatic logits chunk keeps a chunk within its byte budget", "[model][chunked_head]") {
  const int64_t budget = Transformer::kLogitsChunkBytes;
  // Small logits: one chunk, all rows.
  CHECK(Transformer::auto_logits_chunk_rows(4096, 50304, 2) == 4096);
  // Llama 3's vocab at 8 x 2048 tokens, bf16: 4 GiB of logits, chunks of 4096 rows (1 GiB - 2 MiB).
  const int64_t rows = Transformer::auto_logits_chunk_rows(16384, 128256, 2);
  CHECK(rows == 4096);
  CHECK(rows * 128256 * 2 <= budget);
  CHECK((rows + 128) * 128256 * 2 > budget);
  // A vocab so large that 128 rows exceed the budget: as many rows as fit, at least one.
  CHECK(Transformer::auto_logits_chunk_rows(1024, int64_t{1} << 23, 4) == 32);
  CHECK(Transformer::auto_logits_chunk_rows(1024, int64_t{1} << 30, 4) == 1);
}
