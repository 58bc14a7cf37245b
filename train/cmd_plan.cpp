// `keel plan`: TP/PP/DP/micro-batch layouts for a config on a GPU count, with memory per rank,
// why the others do not work, and a cost-model step time (train/plan.h).
#include <iostream>
#include <optional>
#include <vector>

#include "train/cli_checks.h"
#include "train/commands.h"
#include "train/config.h"
#include "train/plan.h"
#include "train/run.h"

namespace keel {

namespace {

struct PlanArgs {
  std::string config;
  std::vector<std::string> sets;
  int64_t gpus = 0, gpus_per_node = 8;
  std::string gpu_mem = "80GiB", cuda_context, framework = "keel", recompute = "auto";
  std::optional<int64_t> tp, pp, dp, mbs;
  int64_t max_mbs = 16;
  std::string virtual_stages;  // "", "auto" or a count
  std::vector<int> pipeline_layers;  // empty, or layer counts per stage: --pipeline-layers 3,5,5,3
  bool embedding_slot = false, sequence_parallel = false, overlap_grad_reduce = false, overlap_param_gather = false,
       selective_recompute = false, json = false, all = false, cpu = false;
  int top = 20;
  double tflops = 150, intra_gbps = 150, inter_gbps = 12.5, hbm_gbps = 1500, headroom = -1, mb_overhead_ms = 0;
  int sm_count = 108;
};

int cmd_plan(const PlanArgs& a) {
  RunConfig cfg = load_config(a.config, a.sets);
  plan::PlanOptions opt;
  opt.hw.gpus_per_node = a.gpus_per_node;
  opt.hw.gpu_mem_bytes = static_cast<double>(plan::parse_memory_size(a.gpu_mem));
  // A bare number is bytes: "--gpu-mem 80" meant 80GiB, and every layout would be out of memory.
  if (opt.hw.gpu_mem_bytes < 1024 && a.gpu_mem.find_first_not_of("0123456789. ") == std::string::npos)
    throw ConfigError("--gpu-mem " + a.gpu_mem + ": a number without a unit is bytes, and " + a.gpu_mem +
                      " bytes hold no model; did you mean " + a.gpu_mem + "GiB?");
  opt.hw.sm_count = a.sm_count;
  opt.hw.achievable_tflops = a.tflops;
  opt.hw.intra_node_gbps = a.intra_gbps;
  opt.hw.inter_node_gbps = a.inter_gbps;
  opt.hw.hbm_gbps = a.hbm_gbps;
  opt.hw.microbatch_overhead_s = a.mb_overhead_ms / 1e3;
  if (a.framework == "keel") opt.memory = plan::keel_memory_model(cfg.precision.mode);
  else opt.memory = plan::megatron_deepspeed_memory_model(a.framework == "mds-bf16");
  if (a.cpu) {  // the CPU backend's memory, as keel train checks it against the host's (run_options)
    opt.memory.cuda_context_bytes = 0;
    opt.memory.gpu_attention.reset();
  } else if (a.framework == "keel") {
    opt.memory.gpu_attention = attention_settings_from_env();  // as the job's environment will set them
  }
  if (!a.cuda_context.empty())
    opt.memory.cuda_context_bytes = static_cast<double>(plan::parse_memory_size(a.cuda_context, /*allow_zero=*/true));
  if (a.headroom >= 0) opt.memory.headroom = a.headroom;
  opt.recompute = a.recompute == "always" ? plan::Recompute::Always
                  : a.recompute == "never" ? plan::Recompute::Never
                                           : plan::Recompute::Auto;
  opt.selective = a.selective_recompute || cfg.train.selective_recompute();
  opt.embedding_own_slot = a.embedding_slot || cfg.parallel.embedding_slot;
  opt.pipeline_layers = cfg.parallel.pipeline_layers;
  if (!a.pipeline_layers.empty()) {  // the flag's split replaces the config's
    if (a.embedding_slot)
      throw ConfigError("--pipeline-layers and --embedding-slot both choose the pipeline split (keep one)");
    opt.pipeline_layers = a.pipeline_layers;
    opt.embedding_own_slot = false;
  }
  opt.virtual_stages = cfg.parallel.virtual_stages;
  opt.overlap_grad_reduce = a.overlap_grad_reduce || cfg.parallel.overlap_grad_reduce;
  opt.overlap_param_gather = a.overlap_param_gather || cfg.parallel.overlap_param_gather;
  opt.grad_bucket_size = cfg.parallel.grad_bucket_size;
  if (a.virtual_stages == "auto") {
    opt.virtual_stages = 0;
  } else if (!a.virtual_stages.empty()) {
    size_t used = 0;
    int64_t v = 0;
    try {
      v = std::stoll(a.virtual_stages, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used != a.virtual_stages.size() || v < 1)
      throw ConfigError("--virtual-stages: \"" + a.virtual_stages +
                        "\" is not allowed (allowed: a count >= 1, or auto for the fastest per layout)");
    opt.virtual_stages = v;
  }
  opt.sequence_parallel = a.sequence_parallel || cfg.parallel.sequence_parallel;
  opt.logits_chunk_rows = cfg.train.logits_chunk_rows;
  opt.tp = a.tp, opt.pp = a.pp, opt.dp = a.dp, opt.mbs = a.mbs;
  opt.max_mbs = a.max_mbs;
  opt.gpus = a.gpus;
  if (opt.gpus == 0 && a.tp && a.pp && a.dp) opt.gpus = *a.tp * *a.pp * *a.dp;
  if (opt.gpus == 0) opt.gpus = cfg.parallel.world();
  if (a.tp && a.pp && a.dp && *a.tp * *a.pp * *a.dp != opt.gpus)
    throw ConfigError("--tp * --pp * --dp = " + std::to_string(*a.tp * *a.pp * *a.dp) + " but --gpus is " +
                      std::to_string(opt.gpus));
  // Pinned sizes that cannot divide the GPUs leave nothing to search: say which, not "no layout fits".
  int64_t pinned = 1;
  std::string pins;
  for (const auto& [flag, v] : {std::pair{"--tp", a.tp}, std::pair{"--pp", a.pp}, std::pair{"--dp", a.dp}})
    if (v) {
      pinned *= *v;
      pins += std::string(pins.empty() ? "" : " x ") + flag + " " + std::to_string(*v);
    }
  if (opt.gpus % pinned != 0)
    throw ConfigError(pins + " = " + std::to_string(pinned) + " does not divide --gpus " + std::to_string(opt.gpus) +
                      " (tp x pp x dp is the GPU count)");
  if (opt.gpus > opt.hw.gpus_per_node && opt.gpus % opt.hw.gpus_per_node != 0)
    throw ConfigError("--gpus " + std::to_string(opt.gpus) + " is not a whole number of nodes of --gpus-per-node " +
                      std::to_string(opt.hw.gpus_per_node));

  plan::PlanResult r = plan::plan_all(cfg, opt);
  std::vector<plan::Alternative> alts;
  if (r.ranked.empty()) alts = plan::alternatives(cfg, opt);
  if (a.json) {
    nlohmann::json j = plan::plan_json(cfg, r, opt);
    j["alternatives"] = nlohmann::json::array();
    for (const auto& alt : alts)
      j["alternatives"].push_back({{"change", alt.change}, {"gpus", alt.gpus}, {"n_layers", alt.n_layers},
                                   {"global_batch", alt.global_batch},
                                   {"best", plan::layout_json(alt.best)}});
    std::cout << j.dump(2) << '\n';
  } else {
    std::cout << plan::plan_text(cfg, r, opt, a.top, a.all);
    if (!alts.empty()) std::cout << "\n" << plan::alternatives_text(alts);
    // A fully pinned layout that does not fit: still show its breakdown, it is what was asked.
    if (r.ranked.empty() && a.tp && a.pp && a.dp && a.mbs) {
      const plan::Layout l{*a.tp, *a.pp, *a.dp, *a.mbs};
      if (plan::layout_problem(cfg, l, opt).empty())
        std::cout << "\n" << plan::layout_text(cfg, plan::plan_layout(cfg, l, opt), opt);
    }
  }
  return r.ranked.empty() ? kExitFailure : kExitOk;
}

}  // namespace

Command add_plan_command(CLI::App& app) {
  auto args = std::make_shared<PlanArgs>();
  PlanArgs& pa = *args;
  CLI::App* c = app.add_subcommand("plan", "TP/PP/DP/micro-batch layouts, memory per GPU and a step-time estimate");
  c->add_option("-c,--config", pa.config, "JSON run config (see configs/)")->required()->check(CLI::ExistingFile);
  c->add_option("--set", pa.sets, "Override a config field, as for `keel train` (repeatable)")
      ->type_name("KEY=VALUE")
      ->take_all();
  c->add_option("--gpus", pa.gpus, "GPUs to plan for (default: the config's tp*pp*dp)")
      ->check(cli::integer<int64_t>(1));
  c->add_option("--gpus-per-node", pa.gpus_per_node, "GPUs per node; TP stays inside a node")
      ->capture_default_str()
      ->check(cli::integer<int64_t>(1));
  c->add_option("--gpu-mem", pa.gpu_mem,
                "Memory per GPU: 80GiB, 81920MiB, 40G (K/M/G/T and KiB/MiB/GiB/TiB are powers of 2), "
                "80GB (KB/MB/GB/TB are powers of 10)")
      ->capture_default_str()
      ->check(cli::memory_size());
  c->add_option("--tp", pa.tp, "Pin the tensor-parallel size")->check(cli::integer<int64_t>(1));
  c->add_option("--pp", pa.pp, "Pin the pipeline-parallel size")->check(cli::integer<int64_t>(1));
  c->add_option("--dp", pa.dp, "Pin the data-parallel size")->check(cli::integer<int64_t>(1));
  c->add_option("--mbs", pa.mbs, "Pin the micro-batch size")->check(cli::integer<int64_t>(1));
  c->add_option("--max-mbs", pa.max_mbs, "Largest micro-batch size tried")
      ->capture_default_str()
      ->check(cli::integer<int64_t>(1));
  c->add_flag("--embedding-slot", pa.embedding_slot,
              "Give the embedding and the head their own pipeline slot each (layers+2 slots over pp)");
  c->add_option("--pipeline-layers", pa.pipeline_layers,
                "Layers of every pipeline stage, in model order (parallel.pipeline_layers; replaces the config's): "
                "3,5,5,3 for 16 layers over pp=4; only layouts with that many (virtual) stages are planned")
      ->type_name("N,N,...")
      ->delimiter(',')
      ->check(cli::integer<int>(0, 1 << 20));
  c->add_option("--virtual-stages", pa.virtual_stages,
                "Model chunks per pipeline rank (interleaved 1F1B, parallel.virtual_stages; default: the config's), "
                "or auto: each pipeline layout with the count (up to 8) that makes it fastest")
      ->type_name("V|auto");
  c->add_flag("--overlap-grad-reduce", pa.overlap_grad_reduce,
              "Plan with the DP gradient reduction overlapped with the last backward (parallel.overlap_grad_reduce)");
  c->add_flag("--overlap-param-gather", pa.overlap_param_gather,
              "Plan with the DP gather of the updated weights overlapped with the next forward "
              "(parallel.overlap_param_gather)");
  c->add_flag("--sequence-parallel", pa.sequence_parallel,
              "Plan with sequence parallelism (parallel.sequence_parallel): TP-replicated activations split by rows");
  c->add_flag("--selective-recompute", pa.selective_recompute,
              "Plan with the layers not recomputed whole dropping their norm outputs and MLP activation, rebuilt "
              "in backward (train.recompute \"selective\")");
  c->add_option("--recompute", pa.recompute,
                "Full recomputation: auto (only when needed), always, never")
      ->capture_default_str()
      ->check(CLI::IsMember({"auto", "always", "never"}));
  c->add_option("--framework", pa.framework,
                "Memory model: keel (from precision.mode), mds-fp16 / mds-bf16 (Megatron-DeepSpeed as in the "
                "BLOOM 200B benchmarks, seed 001)")
      ->capture_default_str()
      ->check(CLI::IsMember({"keel", "mds-fp16", "mds-bf16"}));
  c->add_option("--cuda-context", pa.cuda_context, "CUDA context + workspace per GPU (default 1.5GiB; 0: none)")
      ->check(cli::memory_size(/*allow_zero=*/true));
  c->add_flag("--cpu", pa.cpu,
              "Plan for the CPU backend: --gpus are ranks, --gpu-mem each rank's share of host memory, and no CUDA "
              "context or GPU attention scratch is counted");
  c->add_option("--headroom", pa.headroom, "Fraction of GPU memory kept free (default 0.05)")
      ->check(cli::number(0, 0.9));
  c->add_option("--tflops", pa.tflops, "Achievable dense bf16 TFLOP/s per GPU on well-shaped matmuls")
      ->capture_default_str()
      ->check(cli::positive_number());
  c->add_option("--sm-count", pa.sm_count, "Streaming multiprocessors (wave quantization; A100: 108, H100: 132)")
      ->capture_default_str()
      ->check(cli::integer<int>(1));
  c->add_option("--intra-gbps", pa.intra_gbps, "GB/s per GPU inside a node (NVLink)")
      ->capture_default_str()
      ->check(cli::positive_number());
  c->add_option("--inter-gbps", pa.inter_gbps, "GB/s per GPU between nodes")
      ->capture_default_str()
      ->check(cli::positive_number());
  c->add_option("--hbm-gbps", pa.hbm_gbps, "Achievable GB/s of GPU memory (element-wise ops)")
      ->capture_default_str()
      ->check(cli::positive_number());
  c->add_option("--mb-overhead-ms", pa.mb_overhead_ms, "Fixed cost per micro-batch per pipeline stage (ms)")
      ->capture_default_str()
      ->check(cli::number(0));
  c->add_option("--top", pa.top, "Feasible layouts listed")->capture_default_str()->check(cli::integer<int>(1));
  c->add_flag("--all", pa.all, "List every rejected layout");
  c->add_flag("--json", pa.json, "Machine-readable output");
  c->footer(
      "Memory per GPU = parameters of the rank (exact, from the trainer's parameter table) x bytes per\n"
      "parameter (keel bf16: 2 weights + 4 grads + (4 master + 8 Adam)/dp with ZeRO-1) + activations of\n"
      "the micro-batches 1F1B keeps in flight (pp - s on stage s) + CUDA context. Step time = slowest\n"
      "pipeline stage x (m + pp - 1) micro-batches + DP reduce-scatter/all-gather, with matmuls at\n"
      "--tflops times their tile/wave efficiency and communication at the given bandwidths.\n"
      "Exit codes: 0 a layout fits, 1 none fits, 2 bad config or arguments.");
  return {c, [args] { return cmd_plan(*args); }};
}

}  // namespace keel
