#include "tools/train/train_config.h"

#include <yaml-cpp/yaml.h>

#include <cmath>
#include <fstream>
#include <functional>
#include <optional>
#include <set>
#include <sstream>
#include <type_traits>

#include "server/config/config_schema.h"

namespace vlmgraph::train {
namespace {

using server::ServerConfigError;
using server::YamlLine;
using IntList = std::vector<int64_t>;

// One key of the table: its name ("train.steps"), documentation, and typed access.
struct Key {
  std::string name;
  std::string doc;
  std::function<void(const YAML::Node&, TrainRunConfig&)> parse;
  std::function<void(const TrainRunConfig&)> check;
  std::function<std::string(const TrainRunConfig&)> text;  // the value as YAML
};

template <typename T>
T Scalar(const YAML::Node& n, const std::string& path, const char* what) {
  if (!n.IsScalar()) throw ServerConfigError(path, std::string("must be ") + what + YamlLine(n));
  try {
    return n.as<T>();
  } catch (const YAML::BadConversion&) {
    throw ServerConfigError(
        path, std::string("must be ") + what + ", got '" + n.Scalar() + "'" + YamlLine(n));
  }
}

template <typename T>
std::string Text(const T& v) {
  if constexpr (std::is_same_v<T, std::string>) {
    YAML::Emitter e;
    e << YAML::DoubleQuoted << v;
    return e.c_str();
  } else if constexpr (std::is_same_v<T, bool>) {
    return v ? "true" : "false";
  } else if constexpr (std::is_same_v<T, IntList>) {
    std::string s = "[";
    for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
    return s + "]";
  } else if constexpr (std::is_floating_point_v<T>) {
    return server::ConfigNumber(v);
  } else {
    return std::to_string(v);
  }
}

// A key for field `f` of type T; numbers are checked against [min, max] (either may be absent);
// strings against `allowed` when it is not empty.
template <typename T>
Key MakeKey(std::string name, T TrainRunConfig::*f, std::string doc,
            std::optional<double> min = std::nullopt, std::optional<double> max = std::nullopt,
            std::vector<std::string> allowed = {}) {
  Key k;
  k.name = name;
  k.doc = std::move(doc);
  k.parse = [name, f](const YAML::Node& n, TrainRunConfig& c) {
    if constexpr (std::is_same_v<T, std::string>) {
      c.*f = Scalar<std::string>(n, name, "a string");
    } else if constexpr (std::is_same_v<T, bool>) {
      c.*f = Scalar<bool>(n, name, "true or false");
    } else if constexpr (std::is_same_v<T, IntList>) {
      if (!n.IsSequence())
        throw ServerConfigError(name, "must be a list of integers, like [1, 2, 4]" + YamlLine(n));
      IntList out;
      for (size_t i = 0; i < n.size(); ++i)
        out.push_back(Scalar<int64_t>(n[i], name + "[" + std::to_string(i) + "]", "an integer"));
      c.*f = out;
    } else if constexpr (std::is_floating_point_v<T>) {
      c.*f = Scalar<double>(n, name, "a number");
    } else if constexpr (std::is_unsigned_v<T>) {
      if (n.IsScalar() && !n.Scalar().empty() && n.Scalar()[0] == '-')
        throw ServerConfigError(name, "must be >= 0, got " + n.Scalar() + YamlLine(n));
      c.*f = Scalar<T>(n, name, "an integer >= 0");
    } else {
      c.*f = Scalar<T>(n, name, "an integer");
    }
  };
  k.check = [name, f, min, max, allowed](const TrainRunConfig& c) {
    auto in_range = [&](double v) {
      return !std::isnan(v) && (!min || v >= *min) && (!max || v <= *max);
    };
    auto range_text = [&] {
      if (min && max)
        return "must lie in [" + server::ConfigNumber(*min) + ", " + server::ConfigNumber(*max) +
               "]";
      if (min) return "must be >= " + server::ConfigNumber(*min);
      return "must be <= " + server::ConfigNumber(*max);
    };
    if constexpr (std::is_same_v<T, std::string>) {
      if (!allowed.empty() && std::find(allowed.begin(), allowed.end(), c.*f) == allowed.end()) {
        std::string names;
        for (const std::string& a : allowed) names += (names.empty() ? "'" : ", '") + a + "'";
        throw ServerConfigError(name, "must be one of " + names + "; got '" + c.*f + "'");
      }
    } else if constexpr (std::is_same_v<T, IntList>) {
      if ((c.*f).empty()) throw ServerConfigError(name, "must not be empty");
      for (size_t i = 0; i < (c.*f).size(); ++i) {
        if (!in_range(static_cast<double>((c.*f)[i])))
          throw ServerConfigError(name + "[" + std::to_string(i) + "]",
                                  range_text() + ", got " + std::to_string((c.*f)[i]));
      }
    } else if constexpr (!std::is_same_v<T, bool>) {
      if ((min || max) && !in_range(static_cast<double>(c.*f)))
        throw ServerConfigError(name, range_text() + ", got " + Text(c.*f));
    }
  };
  k.text = [f](const TrainRunConfig& c) { return Text(c.*f); };
  return k;
}

// train.<group>_learning_rate: one group's rate. Its range is checked with the others' by
// LearningRates::Check (LoadTrainRunConfig).
Key RateKey(std::string name, double LearningRates::*rate, std::string doc) {
  Key k;
  k.name = name;
  k.doc = std::move(doc);
  k.parse = [name, rate](const YAML::Node& n, TrainRunConfig& c) {
    c.learning_rates.*rate = Scalar<double>(n, name, "a number");
  };
  k.check = [](const TrainRunConfig&) {};
  k.text = [rate](const TrainRunConfig& c) { return server::ConfigNumber(c.learning_rates.*rate); };
  return k;
}

const std::vector<Key>& Keys() {
  using C = TrainRunConfig;
  static const std::vector<Key> keys = {
      MakeKey("model", &C::model,
              "The model to train: a nanoVLM checkpoint directory (config.json + "
              "model.safetensors, as upstream's save_pretrained and vlmgraph-train write), a "
              "Hugging Face transformers Llama / SmolLM2 checkpoint directory (its language "
              "model, with a random vision encoder) or a preset (nanovlm-tiny, nanovlm-460m; "
              "random weights from seed). Required."),
      MakeKey("tokenizer", &C::tokenizer,
              "Hugging Face tokenizer.json; \"\" = <model>/tokenizer.json. The chat template "
              "comes from chat_template.jinja or tokenizer_config.json beside it, else the "
              "model's lm_chat_template (ChatML), as vlmgraph-server reads them."),
      MakeKey("parse_special_in_content", &C::parse_special_in_content,
              "Special-token text in message content becomes special tokens (Hugging Face's "
              "apply_chat_template) instead of plain text."),
      MakeKey("seed", &C::seed,
              "Random-init seed of preset models, and the seed of the data order (shuffle)."),
      MakeKey("dtype", &C::dtype,
              "Compute dtype: float32, or bfloat16 (bf16 working weights + float32 masters, on "
              "CUDA; the CPU trains in float32).",
              std::nullopt, std::nullopt, {"float32", "bfloat16"}),
      MakeKey("device", &C::device,
              "\"\" = cuda:LOCAL_RANK when CUDA is available, else cpu; or cpu, cuda, cuda:N "
              "(one device per rank)."),
      MakeKey("capture.enabled", &C::cuda_graphs,
              "Replay each train bucket's step from a CUDA graph (ignored on CPU)."),
      MakeKey("buckets.train_batch_sizes", &C::train_batch_sizes,
              "Micro-batch sizes of the train buckets (per rank); a rank's shard of a global "
              "batch is split into micro-batches of at most the largest.",
              1.0),
      MakeKey("buckets.train_seq_lens", &C::train_seq_lens,
              "Sequence lengths of the train buckets, tokens; an example is padded to the "
              "smallest that holds it.",
              1.0),
      MakeKey("buckets.oversize", &C::oversize,
              "An example longer than every train_seq_lens: reject (stop with the dataset line "
              "and its length) or eager (run it at its own shape).",
              std::nullopt, std::nullopt, {"reject", "eager"}),
      MakeKey("train.dataset", &C::dataset,
              "JSONL file, one {\"messages\": [...]} per line (OpenAI chat format; image paths "
              "relative to the file). Required."),
      MakeKey("train.global_batch_size", &C::global_batch_size,
              "Examples per optimizer step over all ranks; each rank trains its shard "
              "(a multiple of the world size).",
              1.0),
      MakeKey("train.steps", &C::steps,
              "Optimizer steps; 0 = epochs x (dataset lines / global_batch_size), rounded down.",
              0.0),
      MakeKey("train.epochs", &C::epochs, "Passes over the dataset when steps is 0.", 0.0),
      MakeKey("train.shuffle", &C::shuffle,
              "Shuffle the examples each epoch (seeded by seed and the epoch: every rank draws "
              "the same order)."),
      RateKey("train.language_learning_rate", &LearningRates::language,
              "AdamW learning rate of the language model (decoder), in [0, 1]; 0 freezes it. "
              "docs/training.md, \"Learning rates\"."),
      RateKey("train.vision_learning_rate", &LearningRates::vision,
              "Learning rate of the vision encoder, in [0, 1]; 0 freezes it."),
      RateKey("train.projector_learning_rate", &LearningRates::projector,
              "Learning rate of the modality projector (MP), in [0, 1]; 0 freezes it."),
      MakeKey("train.lr_schedule", &C::lr_schedule,
              "constant, or cosine: upstream nanoVLM's get_lr (linear warm-up over 3% of the "
              "steps, cosine decay to 10% of each rate).",
              std::nullopt, std::nullopt, {"constant", "cosine"}),
      MakeKey("train.weight_decay", &C::weight_decay, "AdamW decoupled weight decay.", 0.0, 1.0),
      MakeKey("train.beta1", &C::beta1, "AdamW beta1, in [0, 1).", 0.0, 0.999999999),
      MakeKey("train.beta2", &C::beta2, "AdamW beta2, in [0, 1).", 0.0, 0.999999999),
      MakeKey("train.eps", &C::eps, "AdamW epsilon.", 1e-12, 1.0),
      MakeKey("train.max_grad_norm", &C::max_grad_norm,
              "Clip the global gradient L2 norm to this; 0 = no clipping.", 0.0, 1e6),
      MakeKey("train.grad_accum_steps", &C::grad_accum_steps,
              "Micro-batches per optimizer step on each rank, at least (more when a shard does "
              "not fit the largest train batch bucket in this many).",
              1.0),
      MakeKey("train.max_tiles_per_example", &C::max_tiles_per_example,
              "Image tiles one example may carry (sizes the step's tile buffer).", 1.0),
      MakeKey("train.recompute_vision", &C::recompute_vision,
              "Recompute the vision encoder's blocks in the backward pass (less memory)."),
      MakeKey("train.recompute_language", &C::recompute_language,
              "Recompute the decoder's blocks in the backward pass (less memory)."),
      MakeKey("train.save_dir", &C::save_dir,
              "Checkpoint directory (rank 0 writes it): config.json + model.safetensors "
              "(nanoVLM format), optimizer.safetensors and trainer_state.json; \"\" = none."),
      MakeKey("train.save_every_steps", &C::save_every_steps,
              "Save every this many steps (0 = only at the end).", 0.0),
      MakeKey("train.resume", &C::resume,
              "Resume from a checkpoint directory written by vlmgraph-train: its weights, AdamW "
              "state, step and data position."),
      MakeKey("train.log_every", &C::log_every,
              "Rank 0 prints a progress line, and writes a line of the metrics file, every this "
              "many steps.",
              1.0),
      MakeKey("train.val_fraction", &C::val_fraction,
              "Fraction of the dataset's examples held out as the validation set (at least one; "
              "drawn by seed, the same on every rank and resume); 0 = none. Flag "
              "--val-fraction.",
              0.0, 0.5),
      MakeKey("train.val_dataset", &C::val_dataset,
              "A JSONL file of validation examples, in the dataset's format (instead of "
              "val_fraction); \"\" = none. Flag --val-file."),
      MakeKey("train.eval_every_steps", &C::eval_every_steps,
              "Evaluate the validation set's loss (forward only) every this many steps; with a "
              "validation set, also before a fresh job's first step and after the last. 0 = only "
              "then. Flag --eval-every.",
              0.0),
      MakeKey("train.metrics_file", &C::metrics_file,
              "Rank 0's metrics, one JSON object per logged or evaluated step (step, loss, "
              "eval_loss, learning_rate per part, grad_norm, tokens_per_second, mfu, ...; "
              "docs/training.md, \"Metrics file\"); \"\" = <train.save_dir>/metrics.jsonl "
              "(none without save_dir); none = no file. Flag --metrics-file."),
      MakeKey("train.peak_tflops", &C::peak_tflops,
              "The device's dense bf16 peak, TFLOP/s, for MFU in the metrics; 0 = from the "
              "device's name (H100, H200, A100). No MFU on the CPU. Flag --peak-tflops.",
              0.0, 1e6),
      MakeKey("distributed.backend", &C::backend, "\"\" = nccl on CUDA, gloo on CPU.", std::nullopt,
              std::nullopt, {"", "gloo", "nccl"}),
      MakeKey("distributed.timeout_seconds", &C::timeout_seconds,
              "Rendezvous and every collective, seconds: a rank that dies or hangs ends the job "
              "on the others with UNAVAILABLE after this long.",
              0.001, 86400.0),
      MakeKey("distributed.bucket_bytes", &C::bucket_bytes,
              "Gradient all-reduce bucket, bytes (DDP's bucket_cap_mb).", 1.0),
      MakeKey("distributed.reduce_dtype", &C::reduce_dtype,
              "The dtype gradients are all-reduced in (FSDP's reduce_dtype): \"\" = the compute "
              "dtype; bfloat16 halves the bytes and, with one micro-batch per step, runs AdamW "
              "on the averaged bf16 gradients inside the step's graph; float32 averages the "
              "float32 accumulators.",
              std::nullopt, std::nullopt, {"", "float32", "bfloat16"}),
      MakeKey("distributed.shard_optimizer", &C::shard_optimizer,
              "ZeRO stage 1 (DeepSpeed's zero_optimization.stage 1, PyTorch's "
              "ZeroRedundancyOptimizer): each rank runs AdamW on its own share of the "
              "parameters and broadcasts them; the gradients are reduced to their owners. "
              "Checkpoints are unchanged (they resume at any world size)."),
  };
  return keys;
}

const Key* FindKey(const std::string& name) {
  for (const Key& k : Keys()) {
    if (k.name == name) return &k;
  }
  return nullptr;
}

std::string KnownKeys(const std::string& section) {
  std::string out;
  std::set<std::string> seen;
  for (const Key& k : Keys()) {
    const size_t dot = k.name.find('.');
    const std::string sec = dot == std::string::npos ? "" : k.name.substr(0, dot);
    std::string leaf = section.empty() ? (dot == std::string::npos ? k.name : sec)
                                       : (sec == section ? k.name.substr(dot + 1) : "");
    if (leaf.empty() || !seen.insert(leaf).second) continue;
    out += (out.empty() ? "" : ", ") + leaf;
  }
  return out;
}

void ApplyNode(const YAML::Node& root, TrainRunConfig& c) {
  if (!root.IsDefined() || root.IsNull()) return;
  if (!root.IsMap())
    throw ServerConfigError("(file)", "must be a mapping of keys" + YamlLine(root));
  for (const auto& item : root) {
    const std::string name = item.first.as<std::string>();
    if (const Key* k = FindKey(name)) {
      if (!item.second.IsNull()) k->parse(item.second, c);
      continue;
    }
    if (item.second.IsMap() && !KnownKeys(name).empty()) {
      for (const auto& sub : item.second) {
        const std::string full = name + "." + sub.first.as<std::string>();
        const Key* sk = FindKey(full);
        if (!sk) {
          throw ServerConfigError(
              full, "unknown key" + YamlLine(sub.first) + "; known keys here: " + KnownKeys(name));
        }
        if (!sub.second.IsNull()) sk->parse(sub.second, c);
      }
      continue;
    }
    throw ServerConfigError(
        name, "unknown key" + YamlLine(item.first) + "; known keys here: " + KnownKeys(""));
  }
}

std::string Resolve(const std::string& base, const std::string& p) {
  if (p.empty() || p.front() == '/' || base.empty()) return p;
  return base + "/" + p;
}

}  // namespace

TrainRunConfig LoadTrainRunConfig(
    const std::string& path, const std::vector<std::pair<std::string, std::string>>& overrides) {
  TrainRunConfig c;
  if (!path.empty()) {
    std::ifstream in(path);
    if (!in) throw ServerConfigError("--config", "cannot read " + path);
    std::stringstream text;
    text << in.rdbuf();
    YAML::Node root;
    try {
      root = YAML::Load(text.str());
    } catch (const YAML::Exception& e) {
      throw ServerConfigError(path, std::string("not valid YAML: ") + e.what());
    }
    ApplyNode(root, c);
    // Paths in the file are relative to the file.
    const size_t slash = path.rfind('/');
    const std::string base = slash == std::string::npos ? "" : path.substr(0, slash);
    if (!server::IsPresetModel(c.model)) c.model = Resolve(base, c.model);
    if (c.tokenizer != "none") c.tokenizer = Resolve(base, c.tokenizer);
    c.dataset = Resolve(base, c.dataset);
    c.save_dir = Resolve(base, c.save_dir);
    c.resume = Resolve(base, c.resume);
    c.val_dataset = Resolve(base, c.val_dataset);
    if (c.metrics_file != "none") c.metrics_file = Resolve(base, c.metrics_file);
  }
  for (const auto& [key, value] : overrides) {
    const Key* k = FindKey(key);
    if (!k) throw ServerConfigError(key, "--set: unknown key; known keys: " + KnownKeys(""));
    YAML::Node n;
    try {
      n = value.empty() ? YAML::Node(std::string()) : YAML::Load(value);
    } catch (const YAML::Exception& e) {
      throw ServerConfigError(key, "--set: not a YAML value: " + value);
    }
    if (!n.IsNull()) k->parse(n, c);
  }
  for (const Key& k : Keys()) k.check(c);
  if (c.model.empty())
    throw ServerConfigError("model", "required: a checkpoint directory or preset");
  if (c.dataset.empty()) throw ServerConfigError("train.dataset", "required: a JSONL file");
  if (c.save_every_steps > 0 && c.save_dir.empty())
    throw ServerConfigError("train.save_dir", "required when train.save_every_steps is set");
  if (c.val_fraction > 0 && !c.val_dataset.empty()) {
    throw ServerConfigError("train.val_dataset",
                            "set either train.val_fraction or train.val_dataset, not both");
  }
  if (c.eval_every_steps > 0 && c.val_fraction == 0 && c.val_dataset.empty()) {
    throw ServerConfigError("train.eval_every_steps",
                            "needs a validation set: set train.val_fraction (--val-fraction) or "
                            "train.val_dataset (--val-file)");
  }
  if (auto problem = c.learning_rates.Check())
    throw ServerConfigError("train." + problem->field, problem->message);
  if (!c.learning_rates.AnyTrained()) {
    throw ServerConfigError("train.language_learning_rate",
                            "every learning rate is 0: nothing to train; set at least one of "
                            "train.language_learning_rate, vision_learning_rate, "
                            "projector_learning_rate above 0");
  }
  return c;
}

std::string TrainRunConfigYaml(const TrainRunConfig& c) {
  std::string out, section;
  for (const Key& k : Keys()) {
    const size_t dot = k.name.find('.');
    const std::string sec = dot == std::string::npos ? "" : k.name.substr(0, dot);
    if (sec != section && !sec.empty()) out += sec + ":\n";
    section = sec;
    out += (sec.empty() ? "" : "  ") + (sec.empty() ? k.name : k.name.substr(dot + 1)) + ": " +
           k.text(c) + "\n";
  }
  return out;
}

std::string TrainRunConfigDocumented() {
  const TrainRunConfig defaults;
  std::string out;
  for (const Key& k : Keys()) {
    out += "# " + k.name + " (default " + k.text(defaults) + "): " + k.doc + "\n";
  }
  return out;
}

}  // namespace vlmgraph::train
