// model/checkpoint.h: loading and saving nanoVLM checkpoints (a directory with upstream's
// `config.json` and `model.safetensors`, as `save_pretrained` writes them).
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
// Errors: `CheckpointError` naming each missing, unexpected or mis-shaped tensor;
// std::system_error (file and errno) when a save cannot write. Thread rules: call while no other
// thread uses the model.
#pragma once

#include <map>
#include <stdexcept>
#include <string>

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

// Reads `dir/config.json` and `dir/model.safetensors` into a new float32 CPU model.
VisionLanguageModel LoadModel(const std::string& dir);

// Writes `dir/config.json` and `dir/model.safetensors` (creating `dir`), in the model's dtype.
void SaveModel(VisionLanguageModel& model, const std::string& dir);

// As above, from `tensors` named as the model's named_parameters() and named_buffers() (every
// one of them; any device, each written in its own dtype), e.g. float32 master weights kept
// outside the module. Throws CheckpointError if the tied embedding is missing.
void SaveModel(const VlmConfig& cfg, std::map<std::string, at::Tensor> tensors,
               const std::string& dir);

}  // namespace vlmgraph
