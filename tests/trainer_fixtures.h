// tests/trainer_fixtures.h: the tiny checkpoint's training fixtures shared by the trainer tests
// (tests/fixtures/nanovlm-tiny: its reference batch and upstream nanoVLM's AdamW settings),
// comparisons of two trainers' weights, and the store port handed between in-process ranks.
#pragma once

#include <ATen/ATen.h>

#include <chrono>
#include <fstream>
#include <future>
#include <map>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>
#include <vector>

#include "engine/trainer.h"
#include "tests/test_util.h"

namespace vlmgraph {
namespace trainer_fixtures {

using testing::TinyReference;

inline std::vector<int64_t> Row(const at::Tensor& t, int64_t r) {
  at::Tensor row = t[r].contiguous();
  return std::vector<int64_t>(row.data_ptr<int64_t>(), row.data_ptr<int64_t>() + row.numel());
}

inline std::vector<TrainExample> FixtureBatch() {
  const auto& ref = TinyReference().tensors;
  std::vector<TrainExample> out;
  for (int64_t r = 0; r < 2; ++r) {
    out.push_back(
        {Row(ref.at("input_ids"), r), Row(ref.at("targets"), r), ref.at("images").narrow(0, r, 1)});
  }
  return out;
}

inline nlohmann::json AdamwReference() {
  std::ifstream in(testing::TinyCheckpointDir() + "/reference.json");
  return nlohmann::json::parse(in)["adamw"];
}

inline TrainOptions FixtureOptions(at::Device device, bool graphs) {
  const auto j = AdamwReference();
  TrainOptions o;
  o.device = device;
  o.cuda_graphs = graphs;
  o.learning_rates = LearningRates::All(j["lr"].get<double>());
  o.beta1 = j["betas"][0].get<double>();
  o.beta2 = j["betas"][1].get<double>();
  o.eps = j["eps"].get<double>();
  o.weight_decay = j["weight_decay"].get<double>();
  o.buckets.train_batch_sizes = {2, 4};
  o.buckets.train_seq_lens = {16, 32};
  o.log_captures = false;
  return o;
}

inline std::map<std::string, at::Tensor> Params(Trainer& t) {
  std::map<std::string, at::Tensor> out;
  for (const auto& p : t.model()->named_parameters())
    out[p.key()] = p.value().detach().to(at::kCPU).clone();
  return out;
}

// The largest element-wise difference between two trainers' parameters, and the parameter it is in.
struct ParamDiff {
  double max_abs = 0;
  std::string name;
};
inline ParamDiff MaxParamDiff(Trainer& a, Trainer& b) {
  const auto pa = Params(a), pb = Params(b);
  ParamDiff worst;
  for (const auto& [name, w] : pa) {
    const double d = testing::MaxAbsDiff(w, pb.at(name));
    if (d > worst.max_abs) worst = {d, name};
  }
  return worst;
}

inline std::map<std::string, at::Tensor> Masters(Trainer& t) {
  std::map<std::string, at::Tensor> out;
  for (const auto& [name, w] : t.master_weights()) out[name] = w.detach().to(at::kCPU).clone();
  return out;
}

// The fixture row `r` without its image: image tokens (and their targets) dropped, no tiles.
inline TrainExample TextOnly(const VlmConfig& cfg, int64_t r) {
  const TrainExample e = FixtureBatch().at(r);
  TrainExample out;
  for (size_t i = 0; i < e.input_ids.size(); ++i) {
    if (e.input_ids[i] == cfg.image_token_id) continue;
    out.input_ids.push_back(e.input_ids[i]);
    out.targets.push_back(e.targets[i]);
  }
  return out;
}

// The fixture row `r` with every text token id (and its target) mapped to another text id: the
// same image, the same number of counted targets, a different gradient.
inline TrainExample Variant(const VlmConfig& cfg, int64_t r) {
  TrainExample e = FixtureBatch().at(r);
  auto remap = [&](int64_t id) {
    return id >= 0 && id < cfg.lm_base_vocab_size ? (id * 7 + 3) % cfg.lm_base_vocab_size : id;
  };
  for (auto& id : e.input_ids) id = remap(id);
  for (auto& id : e.targets) id = remap(id);
  return e;
}

// The test's TCPStore on a port the system picks, handed from rank 0 to the other ranks: rank 0
// serves it on port 0 and publishes the port it got (DataParallelOptions::on_store_serving); the
// others wait for it. No port is probed ahead and left free for another process to take.
class StoreRendezvous {
 public:
  // DataParallelOptions::store_port and on_store_serving of `rank`, the rest as `o` has them.
  DataParallelOptions For(int64_t rank, DataParallelOptions o) {
    if (rank == 0) {
      o.store_port = 0;
      o.on_store_serving = [this](int64_t port) { port_.set_value(port); };
    } else {
      if (known_.wait_for(std::chrono::seconds(120)) != std::future_status::ready)
        throw std::runtime_error("rank 0 did not serve the test's store within 120 s");
      o.store_port = known_.get();
    }
    return o;
  }

 private:
  std::promise<int64_t> port_;
  std::shared_future<int64_t> known_ = port_.get_future().share();
};

}  // namespace trainer_fixtures
}  // namespace vlmgraph
