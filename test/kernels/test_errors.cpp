// Shape and dtype mistakes throw std::invalid_argument naming the op and the shapes.
#include "kernel_test_util.h"

using namespace keel;
using namespace keel::test;
using Catch::Contains;

TEST_CASE("ops reject wrong shapes and dtypes with a message naming op and shapes", "[errors]") {
  auto be = make_cpu_backend();
  HostTensor a(DType::F32, {4, 8}), b(DType::F32, {7, 5}), out(DType::F32, {4, 5});
  CHECK_THROWS_AS(be->matmul(out.t, a.t, b.t, false, false), std::invalid_argument);
  CHECK_THROWS_WITH(be->matmul(out.t, a.t, b.t, false, false),
                    Contains("matmul") && Contains("[4, 8] f32") && Contains("[7, 5] f32"));
  HostTensor bias(DType::F32, {6}), b2(DType::F32, {8, 5});
  CHECK_THROWS_WITH(be->matmul(out.t, a.t, b2.t, false, false, false, &bias.t), Contains("bias") && Contains("[6] f32"));
  HostTensor out_bad(DType::F32, {5, 4});
  CHECK_THROWS_WITH(be->matmul(out_bad.t, a.t, b2.t, false, false), Contains("out must be [4, 5]"));
  HostTensor ints(DType::I32, {4, 8});
  CHECK_THROWS_WITH(be->gelu_forward(out.t, ints.t), Contains("gelu_forward"));
  CHECK_THROWS_WITH(be->gelu_forward(out.t, a.t), Contains("gelu_forward") && Contains("[4, 5] f32"));

  HostTensor mean(DType::F32, {4}), rstd(DType::F32, {3}), w(DType::F32, {8});
  CHECK_THROWS_WITH(be->layernorm_forward(a.t, mean.t, rstd.t, a.t, w.t, Tensor(), 1e-5f),
                    Contains("layernorm_forward") && Contains("rstd=[3] f32"));
  HostTensor rstd16(DType::BF16, {4});
  CHECK_THROWS_WITH(be->rmsnorm_forward(a.t, rstd16.t, a.t, w.t, 1e-5f), Contains("rmsnorm_forward") && Contains("f32"));

  const AttnShape s{1, 4, 4, 3, 8};  // 4 heads cannot share 3 kv heads
  HostTensor qkv(DType::F32, {4, 80}), o(DType::F32, {4, 32}), lse(DType::F32, {1, 4, 4});
  CHECK_THROWS_WITH(be->attention_forward(o.t, lse.t, qkv.t, s), Contains("attention_forward") && Contains("n_kv_heads=3"));
  const AttnShape s2{1, 4, 4, 2, 8};
  CHECK_THROWS_WITH(be->rope_forward(qkv.t, s2, 10000.0f), Contains("rope_forward") && Contains("[4, 80] f32"));

  HostTensor logits(DType::F32, {4, 10}), ftargets(DType::F32, {4}), stat(DType::F32, {4});
  CHECK_THROWS_WITH(be->xent_stats(stat.t, stat.t, stat.t, logits.t, ftargets.t, 0),
                    Contains("xent_stats") && Contains("targets") && Contains("i32"));
  HostTensor tokens(DType::I32, {4}), table(DType::F32, {10, 6}), emb(DType::F32, {4, 7});
  CHECK_THROWS_WITH(be->embedding_forward(emb.t, tokens.t, table.t, Tensor(), 4, 0, Tensor()),
                    Contains("embedding_forward") && Contains("[4, 7] f32"));
  HostTensor c1(DType::F32, {3}), c2(DType::BF16, {4});
  CHECK_THROWS_WITH(be->convert(c1.t, c2.t), Contains("convert") && Contains("[3] f32") && Contains("[4] bf16"));
}
