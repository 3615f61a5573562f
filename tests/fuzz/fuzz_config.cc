// Fuzz target: the server's YAML configuration (server/config/config.h: LoadYaml, ParseConfig,
// FillDefaults, ValidateConfig, then ConfigToYaml and a second pass over its output). Input: the
// file's text. Expected error: ServerConfigError (every step's documented error). ValidateConfig
// reads the file system (is `model` a directory with config.json, is `tokenizer` a file) and
// writes nothing.
#include <yaml-cpp/yaml.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "server/config/config.h"
#include "tests/fuzz/fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace vlmgraph::server;
  const std::string text(reinterpret_cast<const char*>(data), size);
  vlmgraph::fuzz::ExpectOnly<ServerConfigError>("config", [&] {
    const ServerConfig config = FillDefaults(ParseConfig(LoadYaml(text, "fuzz.yaml")));
    ValidateConfig(config);
    // --print-config's output is a valid configuration again (api_key is shown as "<set>").
    const ServerConfig again =
        FillDefaults(ParseConfig(LoadYaml(ConfigToYaml(config), "printed config")));
    ValidateConfig(again);
  });
  return 0;
}
