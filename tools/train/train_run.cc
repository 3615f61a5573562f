#include "tools/train/train_run.h"

#include <ATen/ATen.h>
#include <sys/stat.h>
#include <torch/cuda.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <deque>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <future>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <numeric>
#include <optional>
#include <sstream>

#include "base/atomic_file.h"
#include "engine/data_parallel.h"
#include "engine/device.h"
#include "engine/evaluator.h"
#include "engine/trainer.h"
#include "model/checkpoint.h"
#include "model/flops.h"
#include "server/core/engine_from_config.h"
#include "server/core/text_prompt.h"
#include "server/core/tokenizer_files.h"
#include "tools/train/dataset.h"
#include "tools/train/metrics_log.h"
#include "tools/train/train_progress.h"

namespace vlmgraph::train {
namespace {

using nlohmann::json;
using server::ServerConfigError;

// A bad setting found while starting (exit kExitBadConfig).
class SetupError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Note [Data order]: the examples are read as one stream over the epochs; stream position p is
// example order(p / N)[p % N] of the N training examples (the dataset's lines less the
// validation split, tools/train/dataset.h SplitForValidation), where order(e) is the identity or, with
// train.shuffle, a Fisher-Yates permutation drawn from splitmix64 seeded by (seed, e). Step k
// takes positions [k * G, (k + 1) * G) (G = global_batch_size, a batch may straddle two epochs),
// and each rank its ShardForRank of them, so every rank agrees on the batch without talking, and
// a resumed job continues at trainer_state.json's position.
class DataOrder {
 public:
  DataOrder(int64_t n, uint64_t seed, bool shuffle) : n_(n), seed_(seed), shuffle_(shuffle) {}
  int64_t At(int64_t position) {
    const int64_t epoch = position / n_;
    if (epoch != epoch_) {
      order_.resize(n_);
      std::iota(order_.begin(), order_.end(), 0);
      if (shuffle_) {
        uint64_t state = seed_ * 0x100000001B3ull + static_cast<uint64_t>(epoch);
        for (int64_t i = n_ - 1; i > 0; --i) {
          const int64_t j = static_cast<int64_t>(SplitMix64(state) % static_cast<uint64_t>(i + 1));
          std::swap(order_[i], order_[j]);
        }
      }
      epoch_ = epoch;
    }
    return order_[position % n_];
  }

 private:
  int64_t n_;
  uint64_t seed_;
  bool shuffle_;
  int64_t epoch_ = -1;
  std::vector<int64_t> order_;
};

// Upstream nanoVLM's get_lr (train.py) as a factor of each group's rate: linear warm-up over 3%
// of the steps, then cosine decay to 10%.
double CosineScale(int64_t it, int64_t max_steps) {
  const double min_scale = 0.1;
  const double warmup = max_steps * 0.03;
  // Upstream's (it + 1) / warmup exceeds 1 when the warm-up is fractional (8.3 x the rate at the
  // first step of a 4-step job, 1.08 x at the last warm-up step of a 217-step one): the warm-up
  // here lasts at least one step and never passes the configured rate.
  if (it < warmup) return std::min(1.0, (it + 1) / std::max(warmup, 1.0));
  if (it > max_steps) return min_scale;
  const double ratio = (it - warmup) / (max_steps - warmup);
  const double coeff = 0.5 * (1.0 + std::cos(M_PI * ratio));
  return min_scale + coeff * (1 - min_scale);
}

bool IsFile(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

std::string ReadText(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

void WriteText(const std::string& path, const std::string& text) {
  AtomicFile out(path);
  out.Write(text.data(), text.size());
  out.Commit();
}

server::ServerConfig ModelServerConfig(const TrainRunConfig& c, const std::string& model) {
  server::ServerConfig s;
  s.model = model;
  s.seed = c.seed;
  s.tokenizer = c.tokenizer;
  s.parse_special_in_content = c.parse_special_in_content;
  return s;  // buckets.context_lens empty: no text-length bound before tokenizing
}

// The tokenizer.json of the job (the configured one, or the model's).
std::string TokenizerPath(const TrainRunConfig& c) {
  if (!c.tokenizer.empty()) return c.tokenizer;
  return server::IsPresetModel(c.model) ? "" : c.model + "/tokenizer.json";
}

std::unique_ptr<server::TextModel> LoadText(const TrainRunConfig& c, const VlmConfig& cfg) {
  std::unique_ptr<server::TextModel> text;
  try {
    text = server::TextModel::Load(ModelServerConfig(c, c.model), cfg);
  } catch (const ServerConfigError& e) {
    throw SetupError(e.what());
  }
  if (!text) {
    throw SetupError(
        "tokenizer: the model has no tokenizer.json; set tokenizer: to the model's "
        "tokenizer.json (chat examples are tokenized by vlmgraph-train)");
  }
  return text;
}

int64_t MaxTokens(const TrainRunConfig& c) {
  return c.oversize == "reject"
             ? *std::max_element(c.train_seq_lens.begin(), c.train_seq_lens.end())
             : 0;
}

struct JobState {
  int64_t step = 0;
  int64_t position = 0;
};

JobState ReadJobState(const std::string& dir) {
  const std::string path = dir + "/trainer_state.json";
  if (!IsFile(path)) {
    throw SetupError("train.resume: " + path +
                     " is missing; resume from a directory that vlmgraph-train saved");
  }
  try {
    const json j = json::parse(ReadText(path));
    return {j.at("step").get<int64_t>(), j.at("position").get<int64_t>()};
  } catch (const json::exception& e) {
    throw SetupError("train.resume: " + path + " is not a trainer state: " + e.what());
  }
}

// Failures end the process at once (_exit): destroying a group whose peer died can block in the
// backend's teardown, and the job is over anyway.
[[noreturn]] void Fail(const std::string& who, int status, const std::string& code,
                       const std::string& message) {
  std::cout.flush();
  std::cerr << who << code << ": " << message << std::endl;
  std::cerr.flush();
  ::_exit(status);
}

// An engine error's exit status and code: UNAVAILABLE (a peer rank died or hung) 3,
// INVALID_ARGUMENT (bad settings or data) 2, anything else 1.
[[noreturn]] void FailWith(const std::string& who, const EngineError& e) {
  if (e.code() == EngineError::Code::kUnavailable)
    Fail(who, kExitUnavailable, "UNAVAILABLE", e.what());
  if (e.code() == EngineError::Code::kInvalidArgument)
    Fail(who, kExitBadConfig, "INVALID_ARGUMENT", e.what());
  Fail(who, kExitFailed, "INTERNAL", e.what());
}

}  // namespace

int DumpExamples(const TrainRunConfig& c, std::ostream& out) {
  try {
    const VlmConfig cfg = server::BuildModelConfig(ModelServerConfig(c, c.model));
    const std::unique_ptr<server::TextModel> text = LoadText(c, cfg);
    const ChatDataset data = ChatDataset::Open(c.dataset);
    for (int64_t i = 0; i < data.size(); ++i) {
      const TrainExample e = data.Example(i, *text, cfg, MaxTokens(c), "buckets.train_seq_lens",
                                          c.max_tiles_per_example);
      json j;
      j["index"] = i;
      j["input_ids"] = e.input_ids;
      j["targets"] = e.targets;
      j["tiles"] = e.tiles.defined() ? e.tiles.size(0) : 0;
      out << j.dump() << "\n";
    }
    out.flush();
    return kExitOk;
  } catch (const std::exception& e) {
    std::cerr << "vlmgraph-train: " << e.what() << std::endl;
    return kExitBadConfig;
  }
}

int RunTrainingRank(const TrainRunConfig& c, const launch::RankEnv& env) {
  const std::string who = "vlmgraph-train: rank " + std::to_string(env.rank) + ": ";
  const bool main_rank = env.rank == 0;
  auto fail = [&who](int status, const std::string& code, const std::string& message) {
    Fail(who, status, code, message);
  };
  std::unique_ptr<Trainer> trainer;
  std::unique_ptr<server::TextModel> text;
  std::unique_ptr<ChatDataset> data;
  // The validation set: lines of val_data (train.val_dataset) or held out of data (val_fraction).
  std::unique_ptr<ChatDataset> val_data;
  ValidationSplit split;
  std::optional<MetricsLog> metrics;
  double peak_tflops = 0;  // 0: no MFU
  VlmConfig cfg;
  JobState state;
  int64_t total_steps = 0;
  std::shared_ptr<DataParallelGroup> group;
  at::Device device(at::kCPU);
  try {
    // Device: one per rank.
    std::string dev = c.device;
    if (dev.empty()) dev = torch::cuda::is_available() ? "cuda" : "cpu";
    if (dev == "cuda") dev = "cuda:" + std::to_string(env.local_rank);
    if (dev != "cpu") {
      if (!torch::cuda::is_available())
        throw SetupError("device: '" + dev + "' requested but no CUDA device is available");
      device = at::Device(dev);
      if (device.index() >= static_cast<int>(torch::cuda::device_count())) {
        throw SetupError("device: '" + dev + "' does not exist; this machine has " +
                         std::to_string(torch::cuda::device_count()) +
                         " CUDA device(s) (LOCAL_RANK picks cuda:LOCAL_RANK)");
      }
    }
    const std::string backend = !c.backend.empty() ? c.backend : device.is_cuda() ? "nccl" : "gloo";

    const std::string source = c.resume.empty() ? c.model : c.resume;
    VisionLanguageModel model = [&] {
      try {
        return server::BuildModel(ModelServerConfig(c, source));
      } catch (const ServerConfigError& e) {
        throw SetupError(c.resume.empty() ? e.what() : "train.resume: " + std::string(e.what()));
      }
    }();
    cfg = model->cfg;
    text = LoadText(c, cfg);
    try {
      data = std::make_unique<ChatDataset>(ChatDataset::Open(c.dataset));
      data->Check();  // every line before the first step, not when a step reaches it
    } catch (const DatasetError& e) {
      throw SetupError(std::string("train.dataset: ") + e.what());
    }
    try {
      if (!c.val_dataset.empty()) {
        val_data = std::make_unique<ChatDataset>(ChatDataset::Open(c.val_dataset));
        val_data->Check();
        split = SplitForValidation(data->size(), 0, c.seed);
        split.validation.resize(val_data->size());
        std::iota(split.validation.begin(), split.validation.end(), 0);
      } else {
        split = SplitForValidation(data->size(), c.val_fraction, c.seed);
      }
    } catch (const DatasetError& e) {
      throw SetupError(std::string(c.val_dataset.empty() ? "train.val_fraction: "
                                                         : "train.val_dataset: ") +
                       e.what());
    }
    if (c.global_batch_size % env.world_size != 0) {
      throw SetupError("train.global_batch_size: " + std::to_string(c.global_batch_size) +
                       " must be a multiple of the number of ranks (" +
                       std::to_string(env.world_size) + ")");
    }
    const int64_t train_examples = static_cast<int64_t>(split.train.size());
    total_steps =
        c.steps > 0
            ? c.steps
            : static_cast<int64_t>(std::floor(c.epochs * train_examples / c.global_batch_size));
    if (total_steps < 1) {
      throw SetupError("train.steps: the dataset's " + std::to_string(train_examples) +
                       " training examples make no step of train.global_batch_size " +
                       std::to_string(c.global_batch_size) + " in train.epochs " +
                       std::to_string(c.epochs) + "; set train.steps or more epochs");
    }
    if (!c.resume.empty()) state = ReadJobState(c.resume);

    if (env.world_size > 1) {
      DataParallelOptions o;
      o.rank = env.rank;
      o.world_size = env.world_size;
      o.store_host = env.master_addr;
      o.store_port = env.store_port;
      o.launcher_store = env.agent_store;
      o.timeout_seconds = c.timeout_seconds;
      o.backend = backend;
      o.device_index = device.is_cuda() ? device.index() : 0;
      o.bucket_bytes = c.bucket_bytes;
      if (c.reduce_dtype == "float32") o.reduce_dtype = at::kFloat;
      if (c.reduce_dtype == "bfloat16") o.reduce_dtype = at::kBFloat16;
      o.shard_optimizer = c.shard_optimizer;
      o.group_name = env.group_name;
      group = DataParallelGroup::Join(o);
    }

    TrainOptions t;
    t.device = device;
    t.compute_dtype = c.dtype == "bfloat16" && device.is_cuda() ? at::kBFloat16 : at::kFloat;
    t.learning_rates = c.learning_rates;
    t.beta1 = c.beta1;
    t.beta2 = c.beta2;
    t.eps = c.eps;
    t.weight_decay = c.weight_decay;
    t.max_grad_norm = c.max_grad_norm;
    t.grad_accum_steps = c.grad_accum_steps;
    t.max_tiles_per_example = c.max_tiles_per_example;
    t.cuda_graphs = c.cuda_graphs;
    t.buckets.train_batch_sizes = c.train_batch_sizes;
    t.buckets.train_seq_lens = c.train_seq_lens;
    std::sort(t.buckets.train_batch_sizes.begin(), t.buckets.train_batch_sizes.end());
    std::sort(t.buckets.train_seq_lens.begin(), t.buckets.train_seq_lens.end());
    t.buckets.oversize = c.oversize == "reject" ? OversizePolicy::kReject : OversizePolicy::kEager;
    t.recompute_vision = c.recompute_vision;
    t.recompute_language = c.recompute_language;
    t.log_captures = main_rank;
    t.data_parallel = group;
    trainer = std::make_unique<Trainer>(model, t);
    if (!c.resume.empty()) {
      try {
        trainer->LoadOptimizerState(c.resume + "/optimizer.safetensors");
      } catch (const std::exception& e) {
        throw SetupError("train.resume: cannot load " + c.resume + "/optimizer.safetensors: " +
                         e.what() + " (resume with the learning rates of the saved job)");
      }
      if (trainer->steps() != state.step) {
        throw SetupError("train.resume: trainer_state.json says step " +
                         std::to_string(state.step) + ", optimizer.safetensors " +
                         std::to_string(trainer->steps()));
      }
    }
    if (main_rank) {
      const std::string path = c.metrics_file == "none" ? ""
                               : !c.metrics_file.empty() ? c.metrics_file
                               : c.save_dir.empty()      ? ""
                                                         : c.save_dir + "/metrics.jsonl";
      try {
        if (!path.empty()) metrics = MetricsLog::Open(path, trainer->steps());
      } catch (const std::runtime_error& e) {
        throw SetupError(std::string("train.metrics_file: ") + e.what());
      }
    }
    if (device.is_cuda())
      peak_tflops = c.peak_tflops > 0 ? c.peak_tflops : PeakBf16Tflops(DeviceName(device));
  } catch (const SetupError& e) {
    fail(kExitBadConfig, "INVALID_ARGUMENT", e.what());
  } catch (const EngineError& e) {
    FailWith(who, e);
  } catch (const std::exception& e) {
    fail(kExitFailed, "INTERNAL", e.what());
  }

  const bool tty = main_rank && ::isatty(STDOUT_FILENO);
  // A line that stays (an evaluation, a save): on a terminal it replaces the bar's line, and the
  // next step draws the bar again below it.
  auto print_line = [tty](const std::string& text) {
    std::cout << (tty ? "\r\033[K" : "") << text << std::endl;
  };
  // Every rank calls it (the sharded optimizer's state is gathered from every rank first); rank 0
  // writes.
  auto save = [&](const std::string& dir, int64_t position) {
    trainer->GatherOptimizerState();
    if (!main_rank) return;
    trainer->SaveCheckpoint(dir);
    // The tokenizer beside the weights: the directory serves text with vlmgraph-server --model.
    server::CopyTokenizerFiles(TokenizerPath(c), dir);
    json s;
    s["step"] = trainer->steps();
    s["position"] = position;
    s["global_batch_size"] = c.global_batch_size;
    s["world_size"] = env.world_size;
    s["seed"] = c.seed;
    s["shuffle"] = c.shuffle;
    s["dataset"] = c.dataset;
    s["dataset_examples"] = data->size();
    s["train_examples"] = split.train.size();
    s["validation_examples"] = split.validation.size();
    if (c.val_fraction > 0) s["val_fraction"] = c.val_fraction;
    if (!c.val_dataset.empty()) s["val_dataset"] = c.val_dataset;
    WriteText(dir + "/trainer_state.json", s.dump(2) + "\n");
    print_line("vlmgraph-train: saved checkpoint to " + dir + " (step " +
               std::to_string(trainer->steps()) + ")");
  };

  const int64_t train_examples = static_cast<int64_t>(split.train.size());
  const bool has_validation = !split.validation.empty();
  const ChatDataset& val_source = val_data ? *val_data : *data;
  // This rank's shard of the validation set: every world_size-th example from its rank on.
  std::vector<int64_t> val_shard;
  for (size_t k = static_cast<size_t>(env.rank); k < split.validation.size();
       k += static_cast<size_t>(env.world_size)) {
    val_shard.push_back(split.validation[k]);
  }
  // Every rank calls it: the loss over the whole validation set (engine/evaluator.h).
  auto evaluate = [&]() {
    trainer->GatherOptimizerState();  // the sharded optimizer: every weight current everywhere
    EvalOptions o;
    o.device = device;
    o.micro_batch_size = *std::max_element(c.train_batch_sizes.begin(), c.train_batch_sizes.end());
    o.data_parallel = group;
    return EvaluateLoss(
        trainer->model(), static_cast<int64_t>(val_shard.size()),
        [&](int64_t i) {
          return val_source.Example(val_shard[static_cast<size_t>(i)], *text, cfg, MaxTokens(c),
                                    "buckets.train_seq_lens, with buckets.oversize reject",
                                    c.max_tiles_per_example);
        },
        o);
  };
  auto unix_seconds = [] {
    return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch())
        .count();
  };

  DataOrder order(train_examples, c.seed, c.shuffle);
  int64_t position = state.position;
  const auto started = std::chrono::steady_clock::now();
  const int64_t first_step = trainer->steps();
  double last_loss = 0;
  std::optional<EvalLoss> last_eval;
  if (main_rank) {
    // The start-up summary: what trains, on what, how much per step.
    int64_t trained = 0, frozen = 0;
    for (const auto& named : trainer->master_weights()) trained += named.second.numel();
    for (const auto& p : trainer->model()->parameters()) frozen += p.numel();
    frozen -= trained;
    const int64_t longest =
        *std::max_element(c.train_seq_lens.begin(), c.train_seq_lens.end());
    char line[512];
    std::snprintf(line, sizeof(line),
                  "vlmgraph-train: %lld rank(s) on %s, %s; parameters %.1fM trained, %.1fM frozen; "
                  "dataset %lld examples; %lld examples per step (%lld per rank), step %lld of "
                  "%lld; %d OpenMP thread(s) per rank",
                  static_cast<long long>(env.world_size), device.str().c_str(), c.dtype.c_str(),
                  trained / 1e6, frozen / 1e6, static_cast<long long>(data->size()),
                  static_cast<long long>(c.global_batch_size),
                  static_cast<long long>(c.global_batch_size / env.world_size),
                  static_cast<long long>(first_step), static_cast<long long>(total_steps),
                  at::get_num_threads());
    std::cout << line << std::endl;
    std::string validation = "no validation set";
    if (has_validation) {
      validation = "validation " + std::to_string(split.validation.size()) + " examples (" +
                   (val_data ? c.val_dataset : "held out of the dataset") +
                   "), evaluated " +
                   (c.eval_every_steps > 0
                        ? "every " + std::to_string(c.eval_every_steps) + " steps and "
                        : std::string()) +
                   "at the end";
    }
    std::snprintf(line, sizeof(line),
                  "vlmgraph-train: %lld training examples, %s; up to %lld tokens per step (%lld x "
                  "%lld); learning rate %s (%s); metrics %s",
                  static_cast<long long>(train_examples), validation.c_str(),
                  static_cast<long long>(c.global_batch_size * longest),
                  static_cast<long long>(c.global_batch_size), static_cast<long long>(longest),
                  LearningRateText(trainer->learning_rates(), trainer->learning_rates()).c_str(),
                  c.lr_schedule.c_str(), metrics ? metrics->path().c_str() : "not written");
    std::cout << line << std::endl;
  }
  if (main_rank && first_step >= total_steps) {
    std::cout << "vlmgraph-train: nothing to do: step " << first_step << " of " << total_steps
              << std::endl;
  }
  // This rank's examples of the global batch at `at`, their tiles staged in the compute dtype
  // (Note [Staged tiles] in engine/trainer.h). Runs on the prefetch thread: each step's examples
  // (image decoding, tokenizing, staging) are made while the step before runs on the device, as
  // a PyTorch DataLoader's workers do; the main thread only waits for them.
  const at::ScalarType compute_dtype = trainer->options().compute_dtype;
  auto load = [&, compute_dtype](int64_t at) {
    std::vector<int64_t> batch;
    for (int64_t k = 0; k < c.global_batch_size; ++k) batch.push_back(split.train[order.At(at + k)]);
    std::vector<TrainExample> examples;
    for (int64_t index : ShardForRank(batch, env.rank, env.world_size)) {
      examples.push_back(data->Example(index, *text, cfg, MaxTokens(c),
                                       "buckets.train_seq_lens, with buckets.oversize reject",
                                       c.max_tiles_per_example));
      StageTrainExample(examples.back(), device, compute_dtype);
    }
    return examples;
  };
  std::future<std::vector<TrainExample>> prefetched;
  if (trainer->steps() < total_steps) prefetched = std::async(std::launch::async, load, position);
  try {
    // A fresh job's validation loss before its first step: the curve's starting point, and a
    // validation set that cannot be used stops the job before it trains.
    if (has_validation && first_step == 0 && total_steps > 0) {
      last_eval = evaluate();
      if (main_rank) {
        print_line(EvalLine(0, total_steps, *last_eval));
        if (metrics) metrics->Write(EvalRecord(0, unix_seconds(), *last_eval));
      }
    }
    // Steps are submitted one ahead (Trainer::Submit / Wait, Note [Submitted steps] in
    // engine/trainer_step.cc): step k + 1 is queued before step k is waited for, so the device goes
    // from one step to the next without waiting for this loop; not past a step that ends in an
    // evaluation or a save, which need the trainer at rest.
    auto evaluates_after = [&](int64_t step) {
      return has_validation &&
             ((c.eval_every_steps > 0 && step % c.eval_every_steps == 0) || step == total_steps);
    };
    auto saves_after = [&](int64_t step) {  // the periodic saves; the last step's comes below
      return !c.save_dir.empty() && c.save_every_steps > 0 && step % c.save_every_steps == 0 &&
             step != total_steps;
    };
    int64_t submitted = trainer->steps();
    std::deque<int64_t> submitted_tiles;  // image tiles of each unfinished step, for its FLOPs
    auto submit_next = [&] {
      std::vector<TrainExample> examples = prefetched.get();
      if (submitted + 1 < total_steps) {
        prefetched = std::async(std::launch::async, load,
                                position + (submitted + 1 - trainer->steps()) * c.global_batch_size);
      }
      if (c.lr_schedule == "cosine")
        trainer->SetLearningRateScale(CosineScale(submitted, total_steps));
      int64_t tiles = 0;
      for (const TrainExample& e : examples) tiles += e.tiles.defined() ? e.tiles.size(0) : 0;
      submitted_tiles.push_back(tiles);
      trainer->Submit(std::move(examples));
      ++submitted;
    };
    while (trainer->steps() < total_steps) {
      if (trainer->submitted_steps() == 0) submit_next();
      const int64_t next = trainer->steps() + 1;  // the step Wait returns
      if (submitted < total_steps && !evaluates_after(next) && !saves_after(next)) submit_next();
      const TrainStepResult r = trainer->Wait();
      const int64_t tiles = submitted_tiles.front();
      submitted_tiles.pop_front();
      position += c.global_batch_size;
      last_loss = r.loss;
      const double step_seconds = r.seconds;  // its share of the wall time
      const bool evaluated = evaluates_after(r.step);
      std::optional<EvalLoss> eval;
      if (evaluated) last_eval = eval = evaluate();
      const bool logged = r.step % c.log_every == 0 || r.step == total_steps;
      if (main_rank && (logged || evaluated)) {
        const double elapsed =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
        StepReport report;
        report.step = r.step;
        report.total_steps = total_steps;
        report.loss = r.loss;
        report.grad_norm = r.grad_norm;
        report.skipped = r.skipped;
        report.learning_rates = r.learning_rates;
        report.configured_rates = trainer->learning_rates();
        report.tokens_per_second =
            static_cast<double>(r.real_tokens * env.world_size) / std::max(step_seconds, 1e-9);
        report.step_seconds = step_seconds;
        report.elapsed_seconds = elapsed;
        report.eta_seconds = elapsed / static_cast<double>(r.step - first_step) *
                             static_cast<double>(total_steps - r.step);
        report.unix_time_seconds = unix_seconds();
        report.examples_seen = position;
        report.epoch = static_cast<double>(position) / static_cast<double>(train_examples);
        if (peak_tflops > 0) {
          const double flops = StepFlops(cfg, r.buckets, tiles);
          if (flops > 0) report.mfu = flops / std::max(step_seconds, 1e-9) / (peak_tflops * 1e12);
        }
        report.eval = eval;
        if (logged) {
          if (tty) {
            std::cout << ProgressBar(report) << (r.step == total_steps ? "\n" : "") << std::flush;
          } else {
            std::cout << ProgressLine(report) << std::endl;
          }
        }
        if (eval) print_line(EvalLine(r.step, total_steps, *eval));
        if (metrics) metrics->Write(MetricsRecord(report));
      }
      if (saves_after(r.step)) save(c.save_dir, position);
    }
    if (!c.save_dir.empty()) save(c.save_dir, position);
    // Every rank ends together: no rank leaves while another still needs it.
    if (group) {
      group->Barrier();
      group->Leave();  // no rank takes the first to leave for a lost one
    }
  } catch (const DatasetError& e) {
    fail(kExitBadConfig, "INVALID_ARGUMENT", e.what());
  } catch (const EngineError& e) {
    FailWith(who, e);
  } catch (const std::exception& e) {
    fail(kExitFailed, "INTERNAL", e.what());
  }
  if (main_rank) {
    char line[512];
    if (trainer->steps() == first_step) {  // a resume with no step left: no loss to report
      std::snprintf(line, sizeof(line), "vlmgraph-train: done: step %lld, no step taken",
                    static_cast<long long>(trainer->steps()));
    } else {
      char eval_text[64] = "";
      if (last_eval) std::snprintf(eval_text, sizeof(eval_text), ", eval_loss %.9g", last_eval->loss);
      std::snprintf(line, sizeof(line), "vlmgraph-train: done: step %lld, final loss %.9g%s%s%s",
                    static_cast<long long>(trainer->steps()), last_loss, eval_text,
                    c.save_dir.empty() ? "" : ", saved to ", c.save_dir.c_str());
    }
    std::cout << line << std::endl;
  }
  return kExitOk;
}

}  // namespace vlmgraph::train
