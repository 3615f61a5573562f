// tools/train/train_run.h: one rank of a vlmgraph-train job (tools/train/train_main.cc).
//
//   int status = RunTrainingRank(LoadTrainRunConfig(path, sets), RankEnvFromEnvironment());
//
// What a rank does: loads the model (or train.resume's checkpoint), the tokenizer and the dataset;
// joins the group (engine/data_parallel.h) when WORLD_SIZE > 1, on cuda:LOCAL_RANK with NCCL or
// on the CPU with gloo; then for each step takes the next global batch of the data order (a
// seeded permutation per epoch when train.shuffle), tokenizes its shard of it (ShardForRank) and
// runs Trainer::Step. Rank 0 prints progress (a bar on a terminal, a line per train.log_every
// steps otherwise) and writes checkpoints: config.json + model.safetensors (nanoVLM format),
// optimizer.safetensors, trainer_state.json ({"step", "position", "epoch_size", "seed", ...}) and
// the tokenizer files, so the directory serves with `vlmgraph-server --model DIR` and resumes with
// train.resume.
//
// Exit statuses (kExit*): 0 done; 2 bad settings or dataset (message says what to change);
// 3 UNAVAILABLE: a peer rank died or hung past distributed.timeout_seconds, or the group could not
// form; 1 any other failure. Failures print "vlmgraph-train: rank R: CODE: message" on stderr.
// Thread rules: call from the main thread, once per process.
#pragma once

#include <iosfwd>

#include "launch/launch.h"
#include "tools/train/train_config.h"

namespace vlmgraph::train {

inline constexpr int kExitOk = 0;
inline constexpr int kExitFailed = 1;
inline constexpr int kExitBadConfig = 2;
inline constexpr int kExitUnavailable = 3;

int RunTrainingRank(const TrainRunConfig& config, const launch::RankEnv& env);

// Prints every example of the dataset as built for training, one JSON object per line
// ({"line", "input_ids", "targets", "tiles"}), for checking data (--dump-examples).
int DumpExamples(const TrainRunConfig& config, std::ostream& out);

}  // namespace vlmgraph::train
