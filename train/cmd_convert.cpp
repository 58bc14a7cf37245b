// `keel convert`: Hugging Face Llama, GPT-2 and BLOOM checkpoints to keel weights-only checkpoints and back
// (train/hf_format.h), and the run config that finetunes an HF model.
#include <cstdio>
#include <filesystem>
#include <iostream>

#include "train/cli_checks.h"
#include "train/commands.h"
#include "train/hf_format.h"
#include "train/plan.h"
#include "train/run.h"

namespace keel {

namespace fs = std::filesystem;

namespace {

struct ConvertArgs {
  std::string src, dst, dtype = "auto", max_shard = "5GiB", like;
  bool force = false, print_config = false;
};

std::optional<DType> parse_dtype(const std::string& s, bool allow_auto) {
  if (s == "bf16" || s == "bfloat16") return DType::BF16;
  if (s == "fp16" || s == "f16" || s == "float16") return DType::F16;
  if (s == "fp32" || s == "f32" || s == "float32") return DType::F32;
  if (allow_auto && s == "auto") return std::nullopt;
  throw ConfigError("--dtype " + s + ": expected bf16, fp16 or fp32" + std::string(allow_auto ? " (or auto)" : ""));
}

void print_stats(const ConvertStats& st, const std::string& what) {
  std::printf("keel: %s: %lld tensors, %lld parameters, %s, %.1f MB in %.2f s\n", what.c_str(),
              static_cast<long long>(st.tensors), static_cast<long long>(st.parameters),
              std::string(dtype_name(st.dtype)).c_str(), st.bytes / 1e6, st.seconds);
  for (const auto& n : st.notes) std::printf("keel: note: %s\n", n.c_str());
  if (!st.copied.empty()) {
    std::string files;
    for (const auto& f : st.copied) files += (files.empty() ? "" : ", ") + f;
    std::printf("keel: copied %s\n", files.c_str());
  }
}

int cmd_convert(const ConvertArgs& a) {
  if (a.print_config) {
    const auto dir = hf_path(a.src);
    if (!dir) throw ConfigError("--print-config needs an hf:DIR source, got " + a.src);
    const HfCheckpoint hf = HfCheckpoint::open(*dir);
    const std::string out = a.dst.empty() ? "out/" + std::filesystem::path(*dir).filename().string() : a.dst;
    std::cout << finetune_config_json(hf, out, "hf:" + fs::absolute(hf.dir()).lexically_normal().string()).dump(2)
              << '\n';
    return kExitOk;
  }
  if (a.dst.empty()) throw ConfigError("keel convert needs a source and a destination (see --help)");
  const auto src_hf = hf_path(a.src), dst_hf = hf_path(a.dst);
  if (src_hf && dst_hf) throw ConfigError("keel convert: both " + a.src + " and " + a.dst + " are hf: paths; one side must be keel");
  if (!src_hf && !dst_hf)
    throw ConfigError("keel convert: mark the Hugging Face side with hf: (hf:DIR OUT imports, CKPT hf:OUT exports)");
  if (src_hf) {
    std::printf("keel: converting hf:%s -> %s\n", src_hf->c_str(), a.dst.c_str());
    std::fflush(stdout);
    const ConvertStats st = convert_hf_to_keel(*src_hf, a.dst, parse_dtype(a.dtype, true), a.force);
    print_stats(st, "wrote weights-only checkpoint " + st.out);
    std::printf("keel: run config %s/config.json (data.train reads data/finetune: keel tokenize --jsonl FILE --tokenizer %s "
                "--out data/finetune, then: keel train --config %s/config.json, whose train.init_from names these "
                "weights)\n",
                st.out.c_str(), st.out.c_str(), st.out.c_str());
    return kExitOk;
  }
  ExportOptions opts;
  opts.dtype = parse_dtype(a.dtype, true);
  opts.max_shard_bytes = plan::parse_memory_size(a.max_shard);
  opts.like = a.like;
  opts.force = a.force;
  std::printf("keel: exporting %s -> hf:%s\n", a.src.c_str(), dst_hf->c_str());
  std::fflush(stdout);
  const ConvertStats st = export_keel_to_hf(a.src, *dst_hf, opts);
  print_stats(st, "wrote Hugging Face model " + st.out);
  return kExitOk;
}

}  // namespace

Command add_convert_command(CLI::App& app) {
  auto args = std::make_shared<ConvertArgs>();
  CLI::App* c = app.add_subcommand("convert", "Convert Hugging Face Llama, Mistral, Qwen2/Qwen3, GPT-2 and BLOOM checkpoints to keel and back");
  c->add_option("source", args->src, "hf:DIR (a Hugging Face model directory) or a keel checkpoint")->required();
  c->add_option("destination", args->dst, "keel checkpoint directory, or hf:DIR to export");
  c->add_option("--dtype", args->dtype,
                "Weight dtype: auto (import: keep the HF dtype bit for bit; export: the dtype of the HF model the "
                "checkpoint came from, else bf16), bf16, fp16, fp32");
  c->add_option("--max-shard-size", args->max_shard, "Export: largest safetensors file before sharding (default 5GiB)")
      ->check(cli::memory_size());
  c->add_option("--like", args->like,
                "Export: take config.json fields and tokenizer files from this HF directory or keel convert "
                "output (default: the checkpoint's own, or the one it was converted from)");
  c->add_flag("--force", args->force, "Replace the destination if it exists");
  c->add_flag("--print-config", args->print_config,
              "Print the finetuning run config for hf:DIR (model section from its config.json) and exit");
  c->footer(
      "Examples:\n"
      "  keel convert hf:/models/Llama-2-7b-hf ckpt/llama2-7b            # import: weights-only checkpoint + config.json\n"
      "  keel convert --print-config hf:/models/Llama-2-7b-hf            # the run config, model section filled in\n"
      "  keel convert out/ft/checkpoints hf:/models/llama2-7b-ft --like ckpt/llama2-7b   # export the latest save\n"
      "Import writes meta.json + model-tp00-pp00.safetensors (a keel checkpoint holding only weights),\n"
      "config.json (a run config for finetuning), hf_config.json and the tokenizer files.");
  return {c, [args] { return cmd_convert(*args); }};
}

}  // namespace keel
