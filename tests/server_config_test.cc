// Server config: parse -> defaults -> validate, key paths in errors, flag overrides, and the
// shipped deploy/config*.yaml files.
#include <gtest/gtest.h>
#include <yaml-cpp/yaml.h>

#include <filesystem>
#include <fstream>

#include "server/config.h"
#include "server/engine_from_config.h"
#include "server/flags.h"

namespace vlmgraph::server {
namespace {

ServerConfig FromYaml(const std::string& text) {
  ServerConfig c = FillDefaults(ParseConfig(LoadYaml(text, "test.yaml")));
  ValidateConfig(c);
  return c;
}

// The key path of the error `text` produces ("" when it loads).
std::string ErrorPath(const std::string& text) {
  try {
    FromYaml(text);
  } catch (const ServerConfigError& e) {
    return e.key_path();
  }
  return "";
}

std::string ErrorMessage(const std::string& text) {
  try {
    FromYaml(text);
  } catch (const ServerConfigError& e) {
    return e.what();
  }
  return "";
}

ServerConfig FromArgs(std::vector<const char*> args) {
  args.insert(args.begin(), "vlmgraph-server");
  return LoadServerConfig(ParseCommandLine(static_cast<int>(args.size()), args.data()));
}

TEST(ServerConfig, EmptyFileIsTheCpuQuickStart) {
  const ServerConfig c = FromYaml("");
  EXPECT_EQ(c.model, "nanovlm-tiny");
  EXPECT_EQ(c.device, "cpu");
  EXPECT_EQ(c.dtype, "float32");
  EXPECT_EQ(c.buckets.batch_sizes, (std::vector<int64_t>{1, 2, 4, 8}));
  EXPECT_EQ(c.buckets.oversize, OversizePolicy::kEager);
  EXPECT_EQ(c.batching.max_queue_delay_us, 2000);
  EXPECT_EQ(c.server.grpc_address, "127.0.0.1:50051");
  EXPECT_LE(c.limits.default_max_new_tokens, c.limits.max_new_tokens);
}

TEST(ServerConfig, CudaDefaultsAreTheEngines) {
  const ServerConfig c = FromYaml("device: cuda\n");
  EXPECT_EQ(c.buckets.batch_sizes, BucketSpec{}.batch_sizes);
  EXPECT_EQ(c.buckets.context_lens, BucketSpec{}.context_lens);
}

TEST(ServerConfig, KeysOverrideDefaults) {
  const ServerConfig c = FromYaml(
      "buckets:\n  batch_sizes: [1, 3]\n  oversize: reject\nbatching:\n  max_queue_delay_us: 0\n"
      "capture: {enabled: false}\nlimits: {max_new_tokens: 10, default_max_new_tokens: 5}\n");
  EXPECT_EQ(c.buckets.batch_sizes, (std::vector<int64_t>{1, 3}));
  EXPECT_EQ(c.buckets.oversize, OversizePolicy::kReject);
  EXPECT_EQ(c.batching.max_queue_delay_us, 0);
  EXPECT_FALSE(c.capture.enabled);
  EXPECT_EQ(c.limits.max_new_tokens, 10);
}

TEST(ServerConfig, ProgrammaticDependentLaunchIsAConfigKey) {
  EXPECT_TRUE(FromYaml("").capture.programmatic_dependent_launch);
  EXPECT_TRUE(ToEngineOptions(FromYaml("")).programmatic_dependent_launch);
  const ServerConfig off = FromYaml("capture: {programmatic_dependent_launch: false}\n");
  EXPECT_FALSE(off.capture.programmatic_dependent_launch);
  EXPECT_FALSE(ToEngineOptions(off).programmatic_dependent_launch);
  EXPECT_EQ(ErrorPath("capture: {programmatic_dependent_launch: maybe}\n"),
            "capture.programmatic_dependent_launch");
}

TEST(ServerConfig, ErrorsNameTheKeyPath) {
  EXPECT_EQ(ErrorPath("buckets:\n  batch_sizes: [1, 2, 0]\n"), "buckets.batch_sizes[2]");
  EXPECT_EQ(ErrorPath("buckets:\n  seq_lens: [1, x]\n"), "buckets.seq_lens[1]");
  EXPECT_EQ(ErrorPath("buckets:\n  tile_counts: 4\n"), "buckets.tile_counts");
  EXPECT_EQ(ErrorPath("buckets:\n  oversize: maybe\n"), "buckets.oversize");
  EXPECT_EQ(ErrorPath("batching:\n  max_queue_delay_us: 1.5\n"), "batching.max_queue_delay_us");
  EXPECT_EQ(ErrorPath("batching:\n  max_queue_size: 0\n"), "batching.max_queue_size");
  EXPECT_EQ(ErrorPath("batchng:\n  max_queue_size: 3\n"), "batchng");
  EXPECT_EQ(ErrorPath("limits:\n  max_image_byte: 3\n"), "limits.max_image_byte");
  EXPECT_EQ(ErrorPath("server:\n  grpc_address: localhost\n"), "server.grpc_address");
  EXPECT_EQ(ErrorPath("server:\n  metrics_address: 'h:99999'\n"), "server.metrics_address");
  EXPECT_EQ(ErrorPath("device: tpu\n"), "device");
  EXPECT_EQ(ErrorPath("dtype: float16\n"), "dtype");
  EXPECT_EQ(ErrorPath("model: /nonexistent/ckpt\n"), "model");
  EXPECT_EQ(ErrorPath("capture:\n  enabled: sometimes\n"), "capture.enabled");
  EXPECT_EQ(ErrorPath("log_level: loud\n"), "log_level");
  EXPECT_EQ(ErrorPath("limits: {max_new_tokens: 4, default_max_new_tokens: 5}\n"),
            "limits.default_max_new_tokens");
  EXPECT_EQ(ErrorPath("shutdown_timeout_seconds: -1\n"), "shutdown_timeout_seconds");
  EXPECT_EQ(ErrorPath("buckets: {seq_lens: [1024], context_lens: [512]}\n"), "buckets.seq_lens");
}

TEST(ServerConfig, MessagesSayWhatIsWrongAndWhere) {
  EXPECT_EQ(ErrorMessage("buckets:\n  batch_sizes: [1, 2, 0]\n"),
            "buckets.batch_sizes[2]: must be >= 1, got 0");
  const std::string typed = ErrorMessage("batching:\n  max_queue_delay_us: soon\n");
  EXPECT_NE(typed.find("must be an integer"), std::string::npos) << typed;
  EXPECT_NE(typed.find("line 2"), std::string::npos) << typed;
  const std::string unknown = ErrorMessage("modle: x\n");
  EXPECT_NE(unknown.find("known keys here"), std::string::npos) << unknown;
}

TEST(ServerConfig, MalformedYamlNamesTheFileAndLine) {
  try {
    LoadYaml("a: [\n", "my.yaml");
    FAIL() << "no error";
  } catch (const ServerConfigError& e) {
    EXPECT_EQ(e.key_path(), "my.yaml");
    EXPECT_NE(std::string(e.what()).find("line"), std::string::npos);
  }
}

TEST(ServerConfig, FlagsOverrideTheFile) {
  const auto path = std::filesystem::temp_directory_path() / "vlmgraph_flags_test.yaml";
  std::ofstream(path) << "batching:\n  max_queue_size: 7\n  max_queue_delay_us: 100\ndevice: cpu\n";
  const ServerConfig c =
      FromArgs({"--config", path.c_str(), "--max-queue-size", "9", "--no-graphs",
                "--grpc-address=127.0.0.1:0", "--set", "buckets.seq_lens=[16,32]"});
  EXPECT_EQ(c.batching.max_queue_size, 9);        // flag wins
  EXPECT_EQ(c.batching.max_queue_delay_us, 100);  // file kept
  EXPECT_FALSE(c.capture.enabled);
  EXPECT_EQ(c.server.grpc_address, "127.0.0.1:0");
  EXPECT_EQ(c.buckets.seq_lens, (std::vector<int64_t>{16, 32}));
  std::filesystem::remove(path);
}

TEST(ServerConfig, BadFlagsAreErrors) {
  EXPECT_THROW(FromArgs({"--no-such-flag"}), ServerConfigError);
  EXPECT_THROW(FromArgs({"--model"}), ServerConfigError);  // needs a value
  EXPECT_THROW(FromArgs({"--set", "novalue"}), ServerConfigError);
  EXPECT_THROW(FromArgs({"--max-queue-size", "many"}), ServerConfigError);  // typed like the file
  EXPECT_THROW(FromArgs({"--config", "/nonexistent.yaml"}), ServerConfigError);
}

// A directory opens and reads as an empty file: it must not start the server on the defaults.
TEST(ServerConfig, ConfigPathMustBeAReadableFile) {
  const std::string dir = ::testing::TempDir();
  for (const std::string& path : {dir, dir + "/no_such_config.yaml"}) {
    try {
      FromArgs({"--config", path.c_str()});
      FAIL() << path << ": loaded";
    } catch (const ServerConfigError& e) {
      EXPECT_EQ(e.key_path(), path);
      EXPECT_NE(std::string(e.what()).find(path == dir ? "is a directory" : "No such file"),
                std::string::npos)
          << e.what();
    }
  }
}

TEST(ServerConfig, PrintedConfigLoadsBackUnchanged) {
  const ServerConfig a = FromYaml("buckets: {batch_sizes: [2, 4], oversize: reject}\nseed: 3\n");
  const ServerConfig b = FromYaml(ConfigToYaml(a));
  EXPECT_EQ(ConfigToYaml(a), ConfigToYaml(b));
  EXPECT_EQ(b.seed, 3u);
  EXPECT_EQ(b.buckets.oversize, OversizePolicy::kReject);
}

TEST(ServerConfig, ShippedDeployConfigsLoad) {
  const std::filesystem::path deploy =
      std::filesystem::path(VLMGRAPH_FIXTURES_DIR) / ".." / ".." / "deploy";
  int found = 0;
  for (const auto& entry : std::filesystem::directory_iterator(deploy)) {
    const std::string name = entry.path().filename().string();
    if (name.rfind("config", 0) != 0 || entry.path().extension() != ".yaml") continue;
    ++found;
    std::vector<const char*> args = {"--config", entry.path().c_str()};
    EXPECT_NO_THROW(FromArgs(args)) << name;
  }
  EXPECT_GE(found, 1);
}

}  // namespace
}  // namespace vlmgraph::server
