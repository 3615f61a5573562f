// tools/train/train_config.h: vlmgraph-train's YAML settings (docs/training.md lists every key).
//
//   TrainRunConfig c = LoadTrainRunConfig("train.yaml", {{"train.steps", "20"}});  // --set
//   std::cout << TrainRunConfigYaml(c);                                             //
//   --print-config
//
// Keys: the model, tokenizer, dtype, seed and buckets keys are named as vlmgraph-server's
// (server/config/config_schema.cc); the optimizer keys as the Train RPC's TrainConfig fields
// (proto/vlmgraph/v1/train.proto) with their defaults and ranges; the rest (dataset, batch size,
// steps, checkpoints, the group's timeout) are the entry point's own. Every key is described once,
// in the table of train_config.cc (name, default, range, documentation).
//
// Errors: ServerConfigError "<key path>: <what is wrong>" for unknown keys, wrong types and values
// outside their ranges; a YAML syntax error names the line. Thread rules: values and pure
// functions.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "engine/learning_rates.h"
#include "server/config/config.h"

namespace vlmgraph::train {

struct TrainRunConfig {
  // The model: a checkpoint directory (config.json + model.safetensors) or a preset.
  std::string model;
  std::string tokenizer;  // "" = <model>/tokenizer.json
  bool parse_special_in_content = false;
  uint64_t seed = 0;              // preset initialisation and the data order
  std::string dtype = "float32";  // compute dtype: float32 or bfloat16 (CUDA)
  std::string device;             // "" = cuda:LOCAL_RANK when CUDA is available, else cpu
  bool cuda_graphs = true;        // capture.enabled
  std::vector<int64_t> train_batch_sizes = {1, 2, 4, 8};
  std::vector<int64_t> train_seq_lens = {64, 128, 256, 512};
  std::string oversize = "reject";  // an example longer than every train_seq_lens: eager | reject

  // train.*
  std::string dataset;            // JSONL of {"messages": [...]}
  int64_t global_batch_size = 8;  // examples per optimizer step over all ranks
  int64_t steps = 0;              // 0 = epochs x (dataset lines / global_batch_size)
  double epochs = 1;
  bool shuffle = true;
  // train.<group>_learning_rate (Note [Learning rates] in engine/learning_rates.h).
  LearningRates learning_rates;
  std::string lr_schedule = "constant";  // constant | cosine (upstream nanoVLM's get_lr)
  double weight_decay = 0.01, beta1 = 0.9, beta2 = 0.999, eps = 1e-8;
  double max_grad_norm = 1.0;
  int64_t grad_accum_steps = 1;
  int64_t max_tiles_per_example = 1;
  bool recompute_vision = false, recompute_language = false;
  std::string save_dir;  // "" = no checkpoints
  int64_t save_every_steps = 0;
  std::string resume;  // a checkpoint directory written by vlmgraph-train
  int64_t log_every = 1;
  // The validation set: val_fraction of the dataset's lines held out (seeded by seed), or the
  // lines of val_dataset; none when both are unset. Evaluated every eval_every_steps steps and at
  // the end (tools/train/train_run.h).
  double val_fraction = 0;
  std::string val_dataset;
  int64_t eval_every_steps = 0;
  // Rank 0's metrics file (JSON lines, tools/train/metrics_log.h): "" = <save_dir>/metrics.jsonl,
  // or none without save_dir; "none" = none.
  std::string metrics_file;
  double peak_tflops = 0;  // the device's bf16 peak for MFU; 0 = from its name (CUDA only)

  // distributed.*
  std::string backend;  // "" = nccl on CUDA, gloo on CPU
  double timeout_seconds = 300;
  int64_t bucket_bytes = 25 * 1024 * 1024;
  std::string reduce_dtype;  // "", "float32" or "bfloat16" ("" = dtype)
  bool shard_optimizer = true;  // ZeRO stage 1 (DataParallelOptions::shard_optimizer)
};

// Defaults, then the file (unless `path` is empty), then each override (key path, YAML value) in
// order; then the ranges. Relative paths in the file (model, tokenizer, dataset, save_dir, resume)
// are taken relative to the file's directory.
TrainRunConfig LoadTrainRunConfig(
    const std::string& path, const std::vector<std::pair<std::string, std::string>>& overrides);

// The effective settings as YAML (--print-config).
std::string TrainRunConfigYaml(const TrainRunConfig& config);

// Every key with its default and documentation, as YAML comments (--help-config).
std::string TrainRunConfigDocumented();

}  // namespace vlmgraph::train
