// vlmgraph-diagnose: do CUDA graphs pay off for this model, these buckets, this device? Loads the
// same YAML and model as vlmgraph-server and, by default, runs every section of
// engine/diagnose.h: baseline (eager vs graphed per region and bucket), vary-batch and
// vary-sequence sweeps, capture cost, dispatch overhead, bucket advice. Prints one table per
// section and writes the JSON report for CI.
//
//   vlmgraph-diagnose --config deploy/config.yaml --json diagnose.json
//   vlmgraph-diagnose --quick                         # built-in tiny model on CPU (what CI runs)
//   vlmgraph-diagnose --config c.yaml --skip-training --shape-log prompts.txt
//
// Only wiring lives here. Exit status: 0 on success, 2 for bad flags or config, 1 otherwise.
#include <ATen/ATen.h>

#include <cstdio>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "bench/synthetic.h"
#include "model/checkpoint.h"
#include "server/config/flags.h"
#include "server/core/engine_from_config.h"
#include "tools/diagnose/diagnose.h"

namespace {

constexpr const char* kUsage =
    "usage: vlmgraph-diagnose [--config FILE] [server flags] [diagnose flags]\n"
    "Every section runs unless skipped:\n"
    "  --skip-baseline --skip-sweeps --skip-capture --skip-dispatch --skip-advice --skip-training\n"
    "  --quick                 fewer buckets, shapes and iterations\n"
    "  --json PATH             write the report as JSON\n"
    "  --iters N               timed runs per figure (median; default 20)\n"
    "  --shape-log PATH        request shapes for bucket advice: one prompt length per line, or\n"
    "                          JSON lines with \"prompt_len\" or \"input_ids\"\n"
    "  --synthetic median=M,sigma=S,n=N   synthetic lognormal prompt lengths instead\n";

std::vector<int64_t> ReadShapeLog(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw std::runtime_error("--shape-log: cannot open '" + path + "'");
  std::vector<int64_t> out;
  std::string line;
  int n = 0;
  while (std::getline(in, line)) {
    ++n;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    try {
      if (line.find('{') != std::string::npos) {
        auto j = nlohmann::json::parse(line);
        out.push_back(j.contains("prompt_len") ? j["prompt_len"].get<int64_t>()
                                               : static_cast<int64_t>(j.at("input_ids").size()));
      } else {
        out.push_back(std::stoll(line));
      }
    } catch (const std::exception& e) {
      throw std::runtime_error("--shape-log " + path + ":" + std::to_string(n) + ": " + e.what());
    }
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace vlmgraph;
  using namespace vlmgraph::server;
  DiagnoseOptions opt;
  std::string json_path, shape_log, synthetic;
  // Boolean flags are taken out here; the rest goes to the server's flag parser.
  std::vector<const char*> rest = {argv[0]};
  const std::set<std::string> skips = {"--skip-baseline", "--skip-sweeps", "--skip-capture",
                                       "--skip-dispatch", "--skip-advice", "--skip-training"};
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--quick")
      opt.quick = true;
    else if (a == "--skip-baseline")
      opt.baseline = false;
    else if (a == "--skip-sweeps")
      opt.sweeps = false;
    else if (a == "--skip-capture")
      opt.capture = false;
    else if (a == "--skip-dispatch")
      opt.dispatch = false;
    else if (a == "--skip-advice")
      opt.advice = false;
    else if (a == "--skip-training")
      opt.training = false;
    else
      rest.push_back(argv[i]);
  }
  try {
    CommandLine cl = ParseCommandLine(static_cast<int>(rest.size()), rest.data(),
                                      {"--json", "--iters", "--shape-log", "--synthetic"});
    if (cl.help) {
      std::cout << kUsage << "\nserver flags:\n" << FlagsHelp();
      return 0;
    }
    for (const auto& [name, value] : cl.extra) {
      if (name == "--json") json_path = value;
      if (name == "--iters") opt.iters = std::max(1, std::stoi(value));
      if (name == "--shape-log") shape_log = value;
      if (name == "--synthetic") synthetic = value;
    }
    if (opt.quick && opt.iters == 20) {
      opt.iters = 5;
      opt.warmup = 1;
    }
    const ServerConfig config = LoadServerConfig(cl);
    if (!shape_log.empty()) {
      opt.prompt_lengths = ReadShapeLog(shape_log);
      opt.shapes_source = "shape log " + shape_log;
    } else if (!synthetic.empty()) {
      double median = 200, sigma = 0.6;
      int64_t n = 5000;
      std::stringstream ss(synthetic);
      std::string kv;
      while (std::getline(ss, kv, ',')) {
        const auto eq = kv.find('=');
        const std::string k = kv.substr(0, eq),
                          v = eq == std::string::npos ? "" : kv.substr(eq + 1);
        if (k == "median")
          median = std::stod(v);
        else if (k == "sigma")
          sigma = std::stod(v);
        else if (k == "n")
          n = std::stoll(v);
        else
          throw ServerConfigError("--synthetic", "unknown key '" + k + "' (median, sigma, n)");
      }
      opt.prompt_lengths =
          SyntheticPromptLengths(n, median, sigma, config.buckets.max_context() - 1);
      opt.shapes_source = "synthetic lognormal, median " +
                          std::to_string(static_cast<int64_t>(median)) + ", sigma " +
                          std::to_string(sigma).substr(0, 4);
    }
    EngineByGraphs make_engine = [&](bool graphs) {
      ServerConfig c = config;
      c.capture.enabled = graphs && config.capture.enabled;
      c.capture.lazy = false;
      auto engine = BuildEngine(c);
      return engine;
    };
    TrainerByGraphs make_trainer = [&](bool graphs) {
      // The same weights the engine serves; the Trainer keeps a float32 master copy.
      VisionLanguageModel model = BuildModel(config);
      const EngineOptions e = ToEngineOptions(config);
      vlmgraph::TrainOptions t;
      t.device = e.device;
      t.compute_dtype = t.device.is_cuda() ? e.dtype : at::kFloat;
      t.learning_rates = vlmgraph::LearningRates::All(1e-4);
      t.max_grad_norm = 1.0;
      t.buckets = e.buckets;
      t.cuda_graphs = graphs && config.capture.enabled;
      t.log_captures = false;
      return std::make_unique<Trainer>(model, t);
    };
    const nlohmann::json report = RunDiagnostics(make_engine, make_trainer, opt);
    std::cout << FormatDiagnostics(report) << std::flush;
    if (!json_path.empty()) {
      std::ofstream out(json_path);
      out << report.dump(2) << "\n";
      if (!out) throw std::runtime_error("cannot write --json " + json_path);
    }
    return 0;
  } catch (const ServerConfigError& e) {
    std::cerr << "vlmgraph-diagnose: " << e.what() << "\n" << kUsage;
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "vlmgraph-diagnose: " << e.what() << "\n";
    return 1;
  }
}
