// model/checkpoint.h: loading and saving nanoVLM checkpoints (a directory with upstream's
// `config.json` and `model.safetensors`, as `save_pretrained` writes them). LoadModel and
// LoadModelConfig also take a Hugging Face transformers checkpoint of the Llama family (SmolLM2 and
// any LlamaForCausalLM: model/hf_checkpoint.h), told apart by its config.json.
//
//   vlmgraph::VisionLanguageModel m = vlmgraph::LoadModel("path/to/ckpt");
//   vlmgraph::SaveModel(m, "out/ckpt");     // loadable by upstream's from_pretrained too
//
// Tied heads: upstream's state dict names the tied matrix twice ("decoder.token_embedding.weight"
// and "decoder.head.weight"); safetensors' save_model stores it once under "decoder.head.weight"
// and records the alias in "__metadata__". Loading accepts either name (and the alias metadata);
// saving writes it as upstream does. `decoder.rotary_embd.inv_freq` is loaded when present and
// recomputed from the config otherwise.
//
// Saving writes each file as a fresh temporary renamed into place (base/atomic_file.h): a
// symbolic link planted in the directory under a file's name (or its temporary's) is replaced,
// never written through, and a failed write leaves no temporary behind.
//
// Errors: `CheckpointError` naming each missing, unexpected or mis-shaped tensor, and for a
// directory in neither format (the message lists the accepted formats); std::system_error (file
// and errno) when a save cannot write. Thread rules: call while no other thread uses the model.
#pragma once

#include <map>
#include <stdexcept>
#include <string>
#include <vector>

#include "model/vision_language_model.h"

namespace vlmgraph {

class CheckpointError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Upstream state-dict names -> tensors (parameters and the inv_freq buffer), tied head once.
std::map<std::string, at::Tensor> StateDict(VisionLanguageModel& model);

// Copies the tensors of a safetensors file into `model` (converting dtype, keeping device).
void LoadWeights(VisionLanguageModel& model, const std::string& safetensors_path);

// The checkpoint formats LoadModel accepts, as one sentence for error messages.
extern const char* const kAcceptedCheckpointFormats;

// The message of a checkpoint whose tensors do not match its config: `header`, then each
// non-empty list with its count (at most 20 names each).
std::string TensorMismatchMessage(const std::string& header,
                                  const std::vector<std::string>& missing,
                                  const std::vector<std::string>& mismatched,
                                  const std::vector<std::string>& unexpected);

// Reads `dir/config.json` and `dir/model.safetensors` into a new float32 CPU model; a
// transformers Llama checkpoint through LoadTransformersLlama (model/hf_checkpoint.h).
VisionLanguageModel LoadModel(const std::string& dir);

// The config of the model LoadModel(dir) builds, without reading the weights (cheap).
VlmConfig LoadModelConfig(const std::string& dir);

// Writes `dir/config.json` and `dir/model.safetensors` (creating `dir`), in the model's dtype.
void SaveModel(VisionLanguageModel& model, const std::string& dir);

// As above, from `tensors` named as the model's named_parameters() and named_buffers() (every
// one of them; any device, each written in its own dtype), e.g. float32 master weights kept
// outside the module. Throws CheckpointError if the tied embedding is missing.
void SaveModel(const VlmConfig& cfg, std::map<std::string, at::Tensor> tensors,
               const std::string& dir);

}  // namespace vlmgraph
