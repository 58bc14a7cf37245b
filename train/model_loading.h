// A whole model loaded for inference (keel sample, keel eval): from a keel checkpoint (its fp32
// masters when saved, else its weights) or an HF directory, on the CPU or a GPU, with the
// tokenizer that belongs to it.
#pragma once

#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "data/chat_template.h"
#include "data/tokenizer.h"
#include "kernels/backend.h"
#include "model/param_table.h"
#include "train/checkpoint.h"
#include "train/config.h"

namespace keel {

struct LoadedModel {
  std::unique_ptr<ParamTable> table;
  Tensor weights;  // flat, laid out by table, on the backend
  std::string description;
  std::string source;  // the spec it was loaded from
  nlohmann::json hf_config;  // the HF config.json, when known (eos ids)
  int64_t eod_token = -1;    // a keel run's data.eod_token (meta.json's config), where it set one
  std::vector<std::filesystem::path> tokenizer_dirs;  // where to look for tokenizer.json, best first
  // Where to look for the chat template, best first: folders (chat_template.jinja,
  // tokenizer_config.json) and the template files the training data was rendered with.
  std::vector<std::filesystem::path> chat_templates;
  // "hf:/m (bf16): llama model, 1100048384 parameters"
  std::string summary() const;
};

// spec: a keel checkpoint (step_* or a checkpoints directory) or hf:DIR. Weights in `dtype`.
LoadedModel load_model(const std::string& spec, DType dtype, Backend& be);

// The error for logits that hold inf/NaN (`what` says where): the weights hold them, or
// --dtype fp16 overflowed, and how to find the tensor.
std::string non_finite_logits_message(const std::string& what, const LoadedModel& lm, const std::string& dtype);

// --dtype fp32|bf16|fp16 for the weights in memory; anything else is a ConfigError.
DType parse_inference_dtype(const std::string& name);

// --device cpu|cuda, checked: a CUDA request without a CUDA build or a visible GPU is a
// ConfigError saying which.
std::unique_ptr<Backend> inference_backend(const std::string& device);

// The options keel sample and keel eval share: the model, its tokenizer, and where and how it
// runs (-c/--checkpoint, --tokenizer, --dtype, --device, --threads).
struct InferenceModelArgs {
  std::string checkpoint, tokenizer, dtype = "fp32", device = "cpu";
  int threads = 0;
};
void add_inference_model_options(CLI::App* c, InferenceModelArgs& a, const std::string& tokenizer_help,
                                 const std::string& dtype_help = "Weights in memory: fp32 (default), bf16, fp16");

// The model those options name, loaded on its backend (logged with the time it took); the
// weights are released with it.
struct InferenceModel {
  std::unique_ptr<Backend> backend;
  LoadedModel model;
  explicit InferenceModel(const InferenceModelArgs& a);
  ~InferenceModel();
  InferenceModel(const InferenceModel&) = delete;
  InferenceModel& operator=(const InferenceModel&) = delete;
};

// Where a keel checkpoint's tokenizer.json and chat template are found, best first: its own
// folders (the step, checkpoints and run directories), the checkpoints and HF model it came
// from (meta.json source), and its training data's folders and the template the data was
// rendered with (which comes before the source model's for chat: it is the one the run learnt).
struct AssetTrail {
  std::vector<std::filesystem::path> tokenizer_dirs, chat_templates;
};
AssetTrail checkpoint_assets(const Checkpoint& ck);

// The first chat template found along `where` (folders, tokenizer_config.json or .jinja files);
// none: a ConfigError for `model` listing where it looked (and which recorded places are gone)
// and suggesting --chat-template.
data::ChatTemplate first_chat_template(const std::vector<std::filesystem::path>& where, const std::string& model);

// Where prepare_data.py puts tokenizer.json: the folders of the data.train files.
std::vector<std::filesystem::path> data_tokenizer_dirs(const RunConfig& cfg);

// The chat templates the data.train folders were rendered with (keel tokenize --chat records
// each in its meta.json, source.chat_template, relative to the folder). A relative path that is
// not in the folder but is in the current directory (what older keel tokenize runs recorded) is
// taken from there with a note; one that is in neither is noted and returned as in the folder,
// so that the search lists it as gone.
std::vector<std::filesystem::path> data_chat_templates(const RunConfig& cfg);

// The ids of the tokenizer's well-known end-of-text tokens (</s>, <|end_of_text|>, <|eot_id|>,
// <|endoftext|>) that it has: where generation stops when nothing else says.
std::vector<int32_t> end_of_text_ids(const data::Tokenizer& tok);

// `explicit_path` (a tokenizer.json or its directory) when given, else the first tokenizer.json
// in `dirs`; empty when there is none.
std::string locate_tokenizer(const std::vector<std::filesystem::path>& dirs, const std::string& explicit_path);

// Where locate_tokenizer looked in `dirs`, for a refusal that found nothing: "looked at:" and
// each folder's tokenizer.json on a line of its own (once each, a folder that is gone marked so).
std::string tokenizer_places(const std::vector<std::filesystem::path>& dirs);

// `explicit_path` (a tokenizer.json or its directory) when given, else the first tokenizer.json
// among the model's tokenizer_dirs; logs which. None found: nullopt, or when `required` a
// ConfigError listing where it looked, followed by `hint`.
std::optional<data::Tokenizer> find_tokenizer(const LoadedModel& lm, const std::string& explicit_path, bool required,
                                              const std::string& hint);

// A fresh run from a model's weights whose data.train was tokenized with another tokenizer:
// the warning naming both tokenizer.json files and their vocabularies (a finetune would learn
// another model's ids: the loss starts far above the model's own and nothing else fails when the
// ids fit the vocabulary). Empty when they agree (the same vocabulary, merges and added tokens,
// whatever the formatting) or when either has no tokenizer.json to compare.
std::string tokenizer_mismatch_warning(const std::vector<std::filesystem::path>& model_dirs, const RunConfig& cfg);

// Refuses (ConfigError) a prompt with a token id the model has no embedding row for, before
// anything is generated: "<what>: token 5000 is outside the model's vocabulary (2048 ids)<why>".
// `why` says where such ids come from (another model's tokenizer).
void check_prompt_ids(const std::vector<int32_t>& ids, int64_t vocab_size, const std::string& what,
                      const std::string& why);

}  // namespace keel
