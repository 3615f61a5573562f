// vlmgraph-train: trains a nanoVLM model on a JSONL file of chat conversations, on one or more
// ranks (one process per GPU, or CPU processes with gloo). docs/training.md is the manual.
//
//   vlmgraph-train --config train.yaml [--set train.steps=100]...          # one rank, or a rank
//                                                                           # of torchrun / srun
//   torchrun --nproc_per_node=8 --no-python vlmgraph-train --config train.yaml
//   vlmgraph-train --nproc-per-node 8 --config train.yaml                  # the same, no torchrun
//   vlmgraph-train --config train.yaml --val-fraction 0.05 --eval-every 100
//   vlmgraph-train --config train.yaml --print-config | --help-config | --dump-examples
//
// Exit statuses: 0 done; 1 failed; 2 bad flags, settings or data; 3 UNAVAILABLE (a peer rank died
// or hung: distributed.timeout_seconds); with --nproc-per-node, the first failing rank's status
// (128 + N for a rank killed by signal N).
#include <iostream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "launch/launch.h"
#include "tools/train/train_config.h"
#include "tools/train/train_run.h"

namespace {

const char* kUsage =
    "usage: vlmgraph-train --config FILE [--set KEY=VALUE]... [--nproc-per-node N]\n"
    "                      [--val-fraction F | --val-file PATH] [--eval-every N]\n"
    "                      [--metrics-file PATH] [--peak-tflops X]\n"
    "                      [--print-config | --help-config | --dump-examples]\n"
    "\n"
    "  --config FILE         YAML settings (docs/training.md; --help-config lists every key)\n"
    "  --set KEY=VALUE       override one key, e.g. --set train.steps=100 (VALUE is YAML)\n"
    "  --nproc-per-node N    start N local ranks (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,\n"
    "                        MASTER_PORT set as torchrun sets them); if one fails the others are\n"
    "                        stopped and its status is returned\n"
    "  --print-config        print the effective settings and exit\n"
    "  --help-config         print every key with its default and documentation\n"
    "  --dump-examples       print each dataset example as tokenized for training (JSON lines)\n"
    "\n"
    "Validation and metrics (each the same as --set of the key named):\n"
    "  --val-fraction F      hold out the fraction F of the dataset (seeded by `seed`) as the\n"
    "                        validation set (train.val_fraction)\n"
    "  --val-file PATH       a JSONL file of validation examples instead (train.val_dataset)\n"
    "  --eval-every N        validation loss every N steps, and before the first step and after\n"
    "                        the last (train.eval_every_steps; 0 = before and after only)\n"
    "  --metrics-file PATH   rank 0's metrics, one JSON object per logged step (train.metrics_file;\n"
    "                        default <train.save_dir>/metrics.jsonl; 'none' = none). Plot it with\n"
    "                        scripts/train_plot.py METRICS -o loss.png [--tensorboard DIR]\n"
    "  --peak-tflops X       the device's dense bf16 peak for MFU (train.peak_tflops; default from\n"
    "                        the device's name; no MFU on the CPU)\n"
    "\n"
    "Ranks come from torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,\n"
    "MASTER_PORT; Slurm's SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID too); none set: one rank.\n"
    "Exit status: 0 done, 1 failed, 2 bad flags/settings/data, 3 UNAVAILABLE (a peer rank died or\n"
    "hung past distributed.timeout_seconds).\n";

}  // namespace

int main(int argc, char** argv) {
  using namespace vlmgraph::train;
  std::string config_path;
  std::vector<std::pair<std::string, std::string>> sets;
  int64_t nproc = 0;
  bool print_config = false, help_config = false, dump = false;
  std::vector<std::string> child_args = {argv[0]};
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&](const std::string& flag) -> std::string {
      const std::string prefix = flag + "=";
      if (a.rfind(prefix, 0) == 0) return a.substr(prefix.size());
      if (i + 1 >= argc) {
        std::cerr << "vlmgraph-train: " << flag << " needs a value\n" << kUsage;
        std::exit(kExitBadConfig);
      }
      return argv[++i];
    };
    auto is = [&](const std::string& flag) { return a == flag || a.rfind(flag + "=", 0) == 0; };
    if (a == "-h" || a == "--help") {
      std::cout << kUsage;
      return 0;
    } else if (is("--config")) {
      config_path = value("--config");
      child_args.push_back("--config=" + config_path);
    } else if (is("--set")) {
      const std::string kv = value("--set");
      const size_t eq = kv.find('=');
      if (eq == std::string::npos || eq == 0) {
        std::cerr << "vlmgraph-train: --set " << kv << ": must be KEY=VALUE\n";
        return kExitBadConfig;
      }
      sets.emplace_back(kv.substr(0, eq), kv.substr(eq + 1));
      child_args.push_back("--set=" + kv);
    } else if (is("--val-fraction") || is("--val-file") || is("--eval-every") ||
               is("--metrics-file") || is("--peak-tflops")) {
      // Shorthands of --set: the value as a YAML scalar (a path quoted, so that any name works).
      const std::string flag = a.substr(0, a.find('='));
      const std::string v = value(flag);
      const bool path = flag == "--val-file" || flag == "--metrics-file";
      const std::string key = flag == "--val-fraction"   ? "train.val_fraction"
                              : flag == "--val-file"     ? "train.val_dataset"
                              : flag == "--eval-every"   ? "train.eval_every_steps"
                              : flag == "--metrics-file" ? "train.metrics_file"
                                                         : "train.peak_tflops";
      const std::string yaml = path ? nlohmann::json(v).dump() : v;
      sets.emplace_back(key, yaml);
      child_args.push_back("--set=" + key + "=" + yaml);
    } else if (is("--nproc-per-node") || is("--nproc_per_node")) {
      const std::string v =
          value(a.rfind("--nproc_per_node", 0) == 0 ? "--nproc_per_node" : "--nproc-per-node");
      try {
        nproc = std::stoll(v);
      } catch (const std::exception&) {
        nproc = 0;
      }
      if (nproc < 1) {
        std::cerr << "vlmgraph-train: --nproc-per-node: must be an integer >= 1, got " << v << "\n";
        return kExitBadConfig;
      }
    } else if (a == "--print-config") {
      print_config = true;
    } else if (a == "--help-config") {
      help_config = true;
    } else if (a == "--dump-examples") {
      dump = true;
    } else {
      std::cerr << "vlmgraph-train: unknown argument '" << a << "'\n" << kUsage;
      return kExitBadConfig;
    }
  }
  if (help_config) {
    std::cout << TrainRunConfigDocumented();
    return 0;
  }
  TrainRunConfig config;
  try {
    if (config_path.empty() && sets.empty()) {
      std::cerr << "vlmgraph-train: --config is required\n" << kUsage;
      return kExitBadConfig;
    }
    config = LoadTrainRunConfig(config_path, sets);
  } catch (const std::exception& e) {
    std::cerr << "vlmgraph-train: " << e.what() << std::endl;
    return kExitBadConfig;
  }
  if (print_config) {
    std::cout << TrainRunConfigYaml(config);
    return 0;
  }
  if (dump) return DumpExamples(config, std::cout);
  if (nproc > 0) {
    try {
      return vlmgraph::launch::LaunchLocalRanks(child_args, nproc);
    } catch (const std::exception& e) {
      std::cerr << "vlmgraph-train: " << e.what() << std::endl;
      return kExitBadConfig;
    }
  }
  vlmgraph::launch::RankEnv env;
  try {
    env = vlmgraph::launch::RankEnvFromEnvironment();
  } catch (const std::exception& e) {
    std::cerr << "vlmgraph-train: " << e.what() << std::endl;
    return kExitBadConfig;
  }
  return RunTrainingRank(config, env);
}
