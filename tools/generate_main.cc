// vlmgraph-generate: runs one Generate request through Engine::Generate directly (no gRPC, no
// scheduler) and prints the new token ids as JSON. The end-to-end tests compare the server's
// streamed tokens with this output; it is also a quick way to try a config.
//
//   vlmgraph-generate [server config flags] --ids 1000,1000,1000,1000,5,6 --image cat.png \
//       --max-new-tokens 8 [--sample 1 --temperature 0.8 --top-k 50 --top-p 0.9 --seed 7]
//       [--stop-ids 2]
//   {"image_tiles": 1, "prompt_tokens": 6, "tokens": [417, 9, ...]}
//
// The config flags (--config, --model, --set ...) build the same engine as vlmgraph-server would.
// Exit status: 0 ok, 2 bad flags or config, 1 the request or engine failed (message on stderr).
#include <ATen/ATen.h>

#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "base/safetensors.h"
#include "image/image_processor.h"
#include "server/config/flags.h"
#include "server/core/engine_from_config.h"

namespace {

using vlmgraph::server::ServerConfigError;

std::vector<int64_t> ParseIds(const std::string& flag, const std::string& text) {
  std::vector<int64_t> out;
  std::stringstream ss(text);
  for (std::string item; std::getline(ss, item, ',');) {
    if (item.empty()) continue;
    try {
      size_t used = 0;
      out.push_back(std::stoll(item, &used));
      if (used != item.size()) throw std::invalid_argument(item);
    } catch (const std::exception&) {
      throw ServerConfigError(flag, "must be comma-separated integers, got '" + item + "'");
    }
  }
  return out;
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw ServerConfigError("--image", "cannot read " + path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

}  // namespace

int main(int argc, char** argv) {
  using namespace vlmgraph;
  using namespace vlmgraph::server;
  const std::vector<std::string> request_flags = {
      "--ids",   "--image", "--max-new-tokens", "--sample",   "--temperature",
      "--top-k", "--top-p", "--seed-sampling",  "--stop-ids", "--dump-tiles"};
  ServerConfig config;
  GenerateRequest request;
  std::vector<std::string> images;
  std::string dump_tiles;
  try {
    const CommandLine cl = ParseCommandLine(argc, argv, request_flags);
    if (cl.help) {
      std::cout << "usage: vlmgraph-generate [config flags] --ids IDS [--image FILE]... "
                   "[--max-new-tokens N]\n"
                   "  [--sample 0|1] [--temperature T] [--top-k K] [--top-p P] [--seed-sampling S] "
                   "[--stop-ids IDS]\n"
                   "       vlmgraph-generate [config flags] --image FILE... --dump-tiles "
                   "OUT.safetensors\n\n"
                   "config flags (as vlmgraph-server):\n"
                << FlagsHelp();
      return 0;
    }
    config = LoadServerConfig(cl);
    request.sampling.max_new_tokens = config.limits.default_max_new_tokens;
    for (const auto& [flag, value] : cl.extra) {
      if (flag == "--ids") request.input_ids = ParseIds(flag, value);
      if (flag == "--image") images.push_back(value);
      if (flag == "--max-new-tokens") request.sampling.max_new_tokens = std::stoll(value);
      if (flag == "--sample") request.sampling.greedy = value == "0" || value == "false";
      if (flag == "--temperature") request.sampling.temperature = std::stod(value);
      if (flag == "--top-k") request.sampling.top_k = std::stoll(value);
      if (flag == "--top-p") request.sampling.top_p = std::stod(value);
      if (flag == "--seed-sampling") request.sampling.seed = std::stoull(value);
      if (flag == "--stop-ids") request.sampling.stop_token_ids = ParseIds(flag, value);
      if (flag == "--dump-tiles") dump_tiles = value;
    }
  } catch (const ServerConfigError& e) {
    std::cerr << "vlmgraph-generate: " << e.what() << "\n";
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "vlmgraph-generate: bad flag value: " << e.what() << "\n";
    return 2;
  }
  try {
    std::unique_ptr<Engine> engine = BuildEngine(config);
    const ImageLimits limits{config.limits.max_image_bytes, config.limits.max_image_pixels};
    std::vector<at::Tensor> tiles;
    for (const auto& path : images)
      tiles.push_back(PreprocessEncodedImage(ReadFile(path), engine->model_config(), limits).tiles);
    if (!tiles.empty()) request.tiles = at::cat(tiles, 0);
    if (!dump_tiles.empty()) {
      WriteSafetensors(dump_tiles,
                       {{"tiles", request.tiles.defined() ? request.tiles : at::zeros({0})}}, {});
      return 0;
    }
    const int64_t n_tiles = request.tiles.defined() ? request.tiles.size(0) : 0;
    const int64_t prompt_tokens = static_cast<int64_t>(request.input_ids.size());
    engine->Warmup();
    const std::vector<std::vector<int64_t>> out = engine->Generate({request});
    nlohmann::json j;
    j["image_tiles"] = n_tiles;
    j["prompt_tokens"] = prompt_tokens;
    j["tokens"] = out.at(0);
    std::cout << j.dump() << std::endl;
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "vlmgraph-generate: " << e.what() << "\n";
    return 1;
  }
}
