// Server config: parse -> defaults -> validate, key paths in errors, flag overrides, the key
// table (server/config/config_schema.h) against ServerConfig, and the shipped deploy/config*.yaml
// files (deploy/config.yaml must be the documented YAML the table generates).
#include <gtest/gtest.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <filesystem>
#include <cstdlib>
#include <fstream>
#include <optional>
#include <set>
#include <sstream>

#include "server/config/config.h"
#include "server/config/config_schema.h"
#include "server/config/flags.h"
#include "server/core/engine_from_config.h"

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

std::filesystem::path DeployDir() {
  return std::filesystem::path(VLMGRAPH_FIXTURES_DIR) / ".." / ".." / "deploy";
}

std::string ReadFile(const std::filesystem::path& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

std::string Text(const std::string& v) { return v; }
std::string Text(const ListenAddress& v) { return v.ToString(); }
std::string Text(bool v) { return v ? "true" : "false"; }
std::string Text(int64_t v) { return std::to_string(v); }
std::string Text(uint64_t v) { return std::to_string(v); }
std::string Text(double v) { return std::to_string(v); }
std::string Text(OversizePolicy v) { return v == OversizePolicy::kReject ? "reject" : "eager"; }
std::string Text(const std::vector<int64_t>& v) {
  std::string out = "[";
  for (int64_t x : v) out += std::to_string(x) + ",";
  return out + "]";
}

// Every field of a ServerConfig as text, in declaration order. The structured bindings stop
// compiling when a field is added to ServerConfig or one of its parts: then extend this list and
// NonDefaultConfig below, and give the field a key in server/config/config_schema.cc.
std::vector<std::string> FieldValues(const ServerConfig& c) {
  const auto& [model, seed, dtype, device, data_parallel_size, stop_ids, tokenizer,
               parse_special_in_content, served_model_name, buckets, capture, batching, endpoints, http, auth, tls, limits,
               train, shutdown_timeout_seconds, log_level] = c;
  const auto& [batch_sizes, gpu_memory_utilization, max_decode_batch, max_prefill_batch, seq_lens,
               context_lens, tile_counts, train_batch_sizes, train_seq_lens, oversize] = buckets;
  const auto& [enabled, lazy, pdl] = capture;
  const auto& [max_queue_delay_us, max_queue_size] = batching;
  const auto& [grpc_address, metrics_address, http_address, api_key, stream_threads] = endpoints;
  const auto& [io_threads, workers, http_idle, head_timeout, body_timeout, write_timeout,
               max_connections, max_connections_per_client, max_body_bytes_in_flight] = http;
  const auto& [api_keys_file, allow_unauthenticated] = auth;
  const auto& [cert_file, key_file, client_ca_file] = tls;
  const auto& [max_image_bytes, max_image_pixels, max_images_per_request, max_new_tokens,
               default_max_new_tokens, max_logits_positions, max_train_batch_examples,
               max_train_batch_tokens, max_request_bytes] = limits;
  const auto& [checkpoint_dir, checkpoint_quota_bytes, idle_timeout_seconds,
               data_parallel_timeout_seconds, publish_gate,
               publish_gate_prompts_file, publish_gate_max_loss_increase,
               publish_gate_max_abs_weight] = train;
  return {Text(model),
          Text(seed),
          Text(dtype),
          Text(device),
          Text(data_parallel_size),
          Text(stop_ids),
          Text(tokenizer),
          Text(parse_special_in_content),
          Text(served_model_name),
          Text(batch_sizes),
          Text(gpu_memory_utilization),
          Text(max_decode_batch),
          Text(max_prefill_batch),
          Text(seq_lens),
          Text(context_lens),
          Text(tile_counts),
          Text(train_batch_sizes),
          Text(train_seq_lens),
          Text(oversize),
          Text(enabled),
          Text(lazy),
          Text(pdl),
          Text(max_queue_delay_us),
          Text(max_queue_size),
          Text(grpc_address),
          Text(metrics_address),
          Text(http_address),
          Text(api_key),
          Text(stream_threads),
          Text(io_threads),
          Text(workers),
          Text(http_idle),
          Text(head_timeout),
          Text(body_timeout),
          Text(write_timeout),
          Text(max_connections),
          Text(max_connections_per_client),
          Text(max_body_bytes_in_flight),
          Text(api_keys_file),
          Text(allow_unauthenticated),
          Text(cert_file),
          Text(key_file),
          Text(client_ca_file),
          Text(max_image_bytes),
          Text(max_image_pixels),
          Text(max_images_per_request),
          Text(max_new_tokens),
          Text(default_max_new_tokens),
          Text(max_logits_positions),
          Text(max_train_batch_examples),
          Text(max_train_batch_tokens),
          Text(max_request_bytes),
          Text(checkpoint_dir),
          Text(checkpoint_quota_bytes),
          Text(idle_timeout_seconds),
          Text(data_parallel_timeout_seconds),
          Text(publish_gate),
          Text(publish_gate_prompts_file),
          Text(publish_gate_max_loss_increase),
          Text(publish_gate_max_abs_weight),
          Text(shutdown_timeout_seconds),
          Text(log_level)};
}

// A valid configuration whose every field differs from its default.
ServerConfig NonDefaultConfig() {
  ServerConfig c;
  c.model = "nanovlm-460m";
  c.seed = 7;
  c.dtype = "bfloat16";
  c.device = "cuda:1";
  c.data_parallel_size = 2;
  c.model_stop_token_ids = {0, 2};
  c.tokenizer = "none";
  c.parse_special_in_content = true;
  c.served_model_name = "my-vlm";
  c.buckets.batch_sizes = {1, 3};
  c.buckets.gpu_memory_utilization = 0.5;
  c.buckets.max_decode_batch = 100;
  c.buckets.max_prefill_batch = 2;
  c.buckets.seq_lens = {16, 48};
  c.buckets.context_lens = {64, 96};
  c.buckets.tile_counts = {1, 5};
  c.buckets.train_batch_sizes = {2, 6};
  c.buckets.train_seq_lens = {24};
  c.buckets.oversize = OversizePolicy::kReject;
  c.capture.enabled = false;
  c.capture.lazy = true;
  c.capture.programmatic_dependent_launch = false;
  c.batching.max_queue_delay_us = 123;
  c.batching.max_queue_size = 45;
  c.server.grpc_address = ListenAddress::Parse("127.0.0.1:1");
  c.server.metrics_address = ListenAddress::Parse("[::1]:2");
  c.server.http_address = ListenAddress();
  c.server.api_key = "k";
  c.server.stream_threads = 6;
  c.http.io_threads = 3;
  c.http.workers = 5;
  c.http.idle_timeout_seconds = 7.5;
  c.http.request_head_timeout_seconds = 2.5;
  c.http.request_body_timeout_seconds = 3.5;
  c.http.write_timeout_seconds = 4.5;
  c.http.max_connections = 99;
  c.http.max_connections_per_client = 9;
  c.http.max_body_bytes_in_flight = 0;
  c.auth.api_keys_file = "/keys";
  c.auth.allow_unauthenticated = true;
  c.tls.cert_file = "/c.pem";
  c.tls.key_file = "/k.pem";
  c.tls.client_ca_file = "/ca.pem";
  c.limits.max_image_bytes = 1000;
  c.limits.max_image_pixels = 2000;
  c.limits.max_images_per_request = 3;
  c.limits.max_new_tokens = 40;
  c.limits.default_max_new_tokens = 4;
  c.limits.max_logits_positions = 5;
  c.limits.max_train_batch_examples = 6;
  c.limits.max_train_batch_tokens = 7;
  c.limits.max_request_bytes = 5000;
  c.train.checkpoint_dir = "ckpt";
  c.train.checkpoint_quota_bytes = 1 << 20;
  c.train.idle_timeout_seconds = 1.5;
  c.train.data_parallel_timeout_seconds = 45;
  c.train.publish_gate = false;
  c.train.publish_gate_prompts_file = "/held-out.txt";
  c.train.publish_gate_max_loss_increase = 2.5;
  c.train.publish_gate_max_abs_weight = 50;
  c.shutdown_timeout_seconds = 2.5;
  c.log_level = "debug";
  return c;
}

// The documented YAML of `text` with its own header, and the same after loading it back.
std::string Documented(const std::string& text) {
  return DocumentedConfigYaml(ParseConfig(LoadYaml(text, "test.yaml")), LeadingComment(text));
}

TEST(ServerConfig, EmptyFileIsTheCpuQuickStart) {
  const ServerConfig c = FromYaml("");
  EXPECT_EQ(c.model, "nanovlm-tiny");
  EXPECT_EQ(c.device, "cpu");
  EXPECT_EQ(c.dtype, "float32");
  EXPECT_EQ(c.buckets.batch_sizes, (std::vector<int64_t>{1, 2, 4, 8}));
  EXPECT_EQ(c.buckets.oversize, OversizePolicy::kEager);
  EXPECT_EQ(c.batching.max_queue_delay_us, 2000);
  EXPECT_EQ(c.server.grpc_address.ToString(), "127.0.0.1:50051");
  EXPECT_LE(c.limits.default_max_new_tokens, c.limits.max_new_tokens);
}

// Sets an environment variable for one scope, restoring it after.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    if (value) {
      ::setenv(name, value, 1);
    } else {
      ::unsetenv(name);
    }
  }
  ~ScopedEnv() {
    if (old_) {
      ::setenv(name_, old_->c_str(), 1);
    } else {
      ::unsetenv(name_);
    }
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  const char* name_;
  std::optional<std::string> old_;
};

TEST(ServerConfig, CheckpointsDefaultToTheUsersDataDirectory) {
  {
    ScopedEnv xdg("XDG_DATA_HOME", "/srv/data");
    EXPECT_EQ(FromYaml("").train.checkpoint_dir, "/srv/data/vlmgraph/checkpoints");
  }
  {
    ScopedEnv xdg("XDG_DATA_HOME", nullptr);
    ScopedEnv home("HOME", "/home/ada/");
    EXPECT_EQ(FromYaml("").train.checkpoint_dir, "/home/ada/.local/share/vlmgraph/checkpoints");
    // A relative XDG_DATA_HOME is ignored, as the XDG specification says.
    ScopedEnv relative("XDG_DATA_HOME", "data");
    EXPECT_EQ(FromYaml("").train.checkpoint_dir, "/home/ada/.local/share/vlmgraph/checkpoints");
  }
  // The key still wins, and ~ is the default.
  EXPECT_EQ(FromYaml("train: {checkpoint_dir: runs}\n").train.checkpoint_dir, "runs");
  ScopedEnv xdg("XDG_DATA_HOME", "/srv/data");
  EXPECT_EQ(FromYaml("train: {checkpoint_dir: ~}\n").train.checkpoint_dir,
            "/srv/data/vlmgraph/checkpoints");
}

TEST(ServerConfig, CudaDefaultsAreTheEngines) {
  const ServerConfig c = FromYaml("device: cuda\n");
  EXPECT_TRUE(c.buckets.batch_sizes.empty());  // derived from device memory by the engine
  EXPECT_EQ(c.buckets.gpu_memory_utilization, 0.9);
  EXPECT_EQ(c.buckets.max_decode_batch, 256);
  EXPECT_EQ(c.buckets.max_prefill_batch, 32);
  EXPECT_EQ(c.buckets.context_lens, BucketSpec{}.context_lens);
  // The engine gets the bounds of the derivation (ToEngineOptions needs a CUDA device for cuda).
  const EngineOptions o =
      ToEngineOptions(FromYaml("buckets: {gpu_memory_utilization: 0.5, max_decode_batch: 64}\n"));
  EXPECT_EQ(o.buckets.gpu_memory_utilization, 0.5);
  EXPECT_EQ(o.buckets.max_decode_batch, 64);
  EXPECT_EQ(o.buckets.max_prefill_batch, 8);
}

// --print-config prints ConfigToYaml of the loaded config: on CUDA the derived default of
// batch_sizes ([] = from device memory) with the keys that bound it; on CPU the small list.
// --print-config on a config made for another machine (deploy/config.yaml names the image's model
// directory): every key is still checked, the model's directory only when the server starts.
TEST(ServerConfig, PrintConfigDoesNotNeedTheServingMachinesModel) {
  const char* argv[] = {"vlmgraph-server", "--model", "/nonexistent/model", "--print-config"};
  const CommandLine cl = ParseCommandLine(4, argv);
  EXPECT_EQ(LoadServerConfig(cl, /*check_files=*/false).model, "/nonexistent/model");
  EXPECT_THROW(LoadServerConfig(cl), ServerConfigError);  // a start checks it
  const char* bad[] = {"vlmgraph-server", "--model", "/nonexistent/model", "--device", "gpu",
                       "--print-config"};
  EXPECT_THROW(LoadServerConfig(ParseCommandLine(6, bad), /*check_files=*/false),
               ServerConfigError);  // other keys are still checked
}

TEST(ServerConfig, DerivedBatchSizesAppearInPrintConfig) {
  const std::string cuda = ConfigToYaml(FromArgs({"--device", "cuda"}));
  EXPECT_NE(cuda.find("  batch_sizes: []\n  gpu_memory_utilization: 0.9\n  max_decode_batch: "
                      "256\n  max_prefill_batch: 32\n"),
            std::string::npos)
      << cuda;
  const std::string cpu = ConfigToYaml(FromArgs({}));
  EXPECT_NE(cpu.find("  batch_sizes: [1, 2, 4, 8]\n"), std::string::npos) << cpu;
  EXPECT_NE(cpu.find("  max_prefill_batch: 8\n"), std::string::npos) << cpu;
  // A list given keeps today's meaning: every entry is a prefill bucket too.
  const std::string given = ConfigToYaml(
      FromArgs({"--device", "cuda", "--set", "buckets.batch_sizes=[1,2,4,8,16,32,64]"}));
  EXPECT_NE(given.find("  batch_sizes: [1, 2, 4, 8, 16, 32, 64]\n"), std::string::npos);
  EXPECT_NE(given.find("  max_prefill_batch: 64\n"), std::string::npos);
  // What is printed loads back to the same config (the derivation stays live).
  EXPECT_EQ(ConfigToYaml(FromYaml(cuda)), cuda);
}

TEST(ServerConfig, DerivedBatchSizesNeedCudaAndTheirBoundsAreChecked) {
  EXPECT_EQ(ErrorMessage("buckets: {batch_sizes: []}\n"),
            "buckets.batch_sizes: must not be empty on CPU ([] = derived from device memory, "
            "CUDA only)");
  EXPECT_EQ(ErrorPath("device: cuda\nbuckets: {batch_sizes: []}\n"), "");
  EXPECT_EQ(ErrorMessage("buckets: {gpu_memory_utilization: 1.5}\n"),
            "buckets.gpu_memory_utilization: must lie in [0.01, 1], got 1.5");
  EXPECT_NE(ErrorMessage("buckets: {gpu_memory_utilization: most}\n")
                .find("buckets.gpu_memory_utilization: must be a number, got 'most'"),
            std::string::npos);
  EXPECT_EQ(ErrorPath("buckets: {max_decode_batch: 0}\n"), "buckets.max_decode_batch");
  EXPECT_EQ(ErrorPath("buckets: {batch_sizes: [4, 8], max_prefill_batch: 2}\n"),
            "buckets.max_prefill_batch");
  const ServerConfig capped = FromYaml("buckets: {batch_sizes: [1, 8], max_prefill_batch: 2}\n");
  EXPECT_EQ(capped.buckets.max_prefill_batch, 2);
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
  EXPECT_EQ(ErrorPath("data_parallel_size: -1\n"), "data_parallel_size");
  EXPECT_EQ(ErrorPath("data_parallel_size: 0\n"), "data_parallel_size");  // every GPU, on cpu
  EXPECT_EQ(ErrorPath("device: cuda\ndata_parallel_size: 0\n"), "");
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
  EXPECT_EQ(c.server.grpc_address.ToString(), "127.0.0.1:0");
  EXPECT_EQ(c.buckets.seq_lens, (std::vector<int64_t>{16, 32}));
  std::filesystem::remove(path);
}

TEST(ServerConfig, AnEmptyFlagValueIsTheEmptyString) {
  // "" turns the HTTP API off, as documented; an empty value must not fall back to the default.
  EXPECT_EQ(FromArgs({}).server.http_address.ToString(), "127.0.0.1:8000");
  EXPECT_TRUE(FromArgs({"--set", "server.http_address="}).server.http_address.empty());
  EXPECT_TRUE(FromArgs({"--http-address="}).server.http_address.empty());
  EXPECT_TRUE(FromArgs({"--http-address", ""}).server.http_address.empty());
  EXPECT_EQ(FromArgs({"--set", "server.http_address=~"}).server.http_address.ToString(),
            "127.0.0.1:8000");
  // A key that is not a string says so instead of taking its default.
  EXPECT_THROW(FromArgs({"--set", "batching.max_queue_size="}), ServerConfigError);
}

TEST(ServerConfig, AddressesTakeEveryFormFromYamlAndFlags) {
  const ServerConfig c = FromYaml(
      "server:\n  grpc_address: '[::1]:0'\n  metrics_address: \"[::]:9464\"\n"
      "  http_address: localhost:8000\n");
  EXPECT_EQ(c.server.grpc_address, ListenAddress::Parse("[::1]:0"));
  EXPECT_EQ(c.server.metrics_address.host(), "::");
  EXPECT_EQ(c.server.http_address.host(), "localhost");
  // Printed and read back unchanged (an IPv6 address is quoted in the YAML).
  EXPECT_EQ(FromYaml(ConfigToYaml(c)).server.grpc_address, c.server.grpc_address);
  // Flags take the text as is: YAML would read [::1]:0 as a list.
  const ServerConfig f = FromArgs({"--grpc-address", "[::1]:0", "--metrics-address=[::1]:0",
                                   "--set", "server.http_address=[::1]:0"});
  EXPECT_EQ(f.server.grpc_address.ToString(), "[::1]:0");
  EXPECT_EQ(f.server.metrics_address.ToString(), "[::1]:0");
  EXPECT_EQ(f.server.http_address.ToString(), "[::1]:0");
  EXPECT_EQ(FromArgs({"--set", "server.grpc_address=~"}).server.grpc_address.ToString(),
            "127.0.0.1:50051");
}

TEST(ServerConfig, AddressErrorsNameTheKeyAndTheLine) {
  const std::string bad = ErrorMessage("server:\n  http_address: '::1:8000'\n");
  EXPECT_EQ(bad.rfind("server.http_address: '::1:8000' has an IPv6 address without brackets", 0),
            0u)
      << bad;
  EXPECT_NE(bad.find("line 2"), std::string::npos) << bad;
  // Unquoted brackets are a YAML list: the message says to quote the address.
  const std::string unquoted = ErrorMessage("server:\n  grpc_address: [::1]\n");
  EXPECT_NE(unquoted.find("server.grpc_address: "), std::string::npos) << unquoted;
  EXPECT_NE(unquoted.find("\"[::1]:8000\""), std::string::npos) << unquoted;
  EXPECT_NE(ErrorMessage("server: {metrics_address: ':9464'}\n").find("server.metrics_address"),
            std::string::npos);
  EXPECT_NE(
      ErrorMessage("server: {grpc_address: ''}\n").find("server.grpc_address: must not be empty"),
      std::string::npos);
  EXPECT_THROW(FromArgs({"--http-address", "[::1]"}), ServerConfigError);
  EXPECT_TRUE(FromYaml("server: {http_address: ''}\n").server.http_address.empty());
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
  const std::filesystem::path deploy = DeployDir();
  int found = 0;
  for (const auto& entry : std::filesystem::directory_iterator(deploy)) {
    const std::string name = entry.path().filename().string();
    if (name.rfind("config", 0) != 0 || entry.path().extension() != ".yaml") continue;
    ++found;
    std::vector<const char*> args = {"--config", entry.path().c_str()};
    // A model converted into the container image (Dockerfile) is not here: a preset stands in.
    if (ReadFile(entry.path()).find("\nmodel: /opt/vlmgraph/models/") != std::string::npos &&
        !std::filesystem::exists("/opt/vlmgraph/models")) {
      args.insert(args.end(), {"--set", "model=nanovlm-tiny"});
    }
    EXPECT_NO_THROW(FromArgs(args)) << name;
  }
  EXPECT_GE(found, 1);
}

TEST(ServerConfig, UnknownKeysListTheKeysOfTheirLevel) {
  EXPECT_EQ(ErrorMessage("tls: {cert: a.pem}\n"),
            "tls.cert: unknown key (line 1); known keys here: cert_file, key_file, client_ca_file");
  EXPECT_EQ(ErrorMessage("modle: x\n"),
            "modle: unknown key (line 1); known keys here: model, seed, dtype, device, "
            "data_parallel_size, model_stop_token_ids, tokenizer, parse_special_in_content, "
            "served_model_name, buckets, capture, batching, server, http, auth, tls, limits, train, "
            "shutdown_timeout_seconds, log_level");
  EXPECT_EQ(ErrorMessage("buckets: 3\n"), "buckets: must be a mapping of keys (line 1)");
}

TEST(ServerConfig, RangesComeFromTheTable) {
  EXPECT_EQ(ErrorMessage("batching: {max_queue_size: 0}\n"),
            "batching.max_queue_size: must lie in [1, 1000000], got 0");
  EXPECT_EQ(ErrorMessage("model_stop_token_ids: [1, -1]\n"),
            "model_stop_token_ids[1]: must be >= 0, got -1");
  EXPECT_EQ(ErrorMessage("train: {idle_timeout_seconds: 90000}\n"),
            "train.idle_timeout_seconds: must lie in [0, 86400], got 90000");
  EXPECT_EQ(ErrorMessage("buckets: {seq_lens: []}\n"), "buckets.seq_lens: must not be empty");
  EXPECT_EQ(ErrorMessage("dtype: float16\n"),
            "dtype: must be 'float32' or 'bfloat16', got 'float16' (line 1)");
  EXPECT_EQ(ErrorMessage("log_level: loud\n"),
            "log_level: must be one of error, warn, info, debug; got 'loud' (line 1)");
  EXPECT_EQ(ErrorMessage("seed: -3\n"), "seed: must be >= 0, got -3 (line 1)");
  // Also for a config built in code, without a file.
  ServerConfig c = FillDefaults(RawConfig{});
  c.log_level = "loud";
  EXPECT_THROW(ValidateConfig(c), ServerConfigError);
}

// --print-config-documented describes a file for the machine that serves it: a model directory
// or tokenizer that this machine lacks is no error there, while every other check still is.
TEST(ServerConfig, ValidationWithoutFilesLeavesOutOnlyTheModelAndTokenizerFiles) {
  ServerConfig c = FillDefaults(RawConfig{});
  c.model = "/nonexistent/vlmgraph-model";
  c.tokenizer = "/nonexistent/tokenizer.json";
  EXPECT_THROW(ValidateConfig(c), ServerConfigError);
  EXPECT_NO_THROW(ValidateConfig(c, /*check_files=*/false));
  c.tokenizer = "";
  try {
    ValidateConfig(c);
    ADD_FAILURE() << "a missing model directory passed";
  } catch (const ServerConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("model: '/nonexistent/vlmgraph-model'"), std::string::npos)
        << e.what();
  }
  c.device = "gpu";
  EXPECT_THROW(ValidateConfig(c, /*check_files=*/false), ServerConfigError);
}

TEST(ServerConfig, TableKeysAreUniqueDocumentedAndGroupedBySection) {
  std::set<std::string> names;
  std::vector<std::string> sections;
  for (const ConfigKey& key : ConfigKeys()) {
    EXPECT_TRUE(names.insert(key.name).second) << key.name;
    EXPECT_FALSE(key.doc.empty()) << key.name;
    EXPECT_FALSE(key.default_text.empty()) << key.name;
    if (!key.section().empty() && (sections.empty() || sections.back() != key.section())) {
      EXPECT_EQ(std::count(sections.begin(), sections.end(), key.section()), 0)
          << key.section() << "'s keys are not contiguous";
      sections.push_back(key.section());
    }
  }
  std::vector<std::string> documented;
  for (const ConfigSection& s : ConfigSections()) documented.push_back(s.name);
  EXPECT_EQ(documented, sections);
}

// Every ServerConfig field has a key: a config with every field changed prints, parses and fills
// back to itself (a field without a key would come back as its default).
TEST(ServerConfig, EveryFieldRoundTripsThroughTheTable) {
  const ServerConfig c = NonDefaultConfig();
  ValidateConfig(c);
  const std::vector<std::string> defaults = FieldValues(FillDefaults(RawConfig{}));
  const std::vector<std::string> values = FieldValues(c);
  ASSERT_EQ(values.size(), defaults.size());
  EXPECT_EQ(values.size(), ConfigKeys().size())
      << "a key without a field, or a field without a key";
  for (size_t i = 0; i < values.size(); ++i) EXPECT_NE(values[i], defaults[i]) << "field " << i;

  const std::string yaml = ConfigToYaml(c);
  const RawConfig raw = ParseConfig(LoadYaml(yaml, "printed"));
  EXPECT_EQ(raw.set_keys.size(), ConfigKeys().size());
  const ServerConfig back = FillDefaults(raw);
  ServerConfig expected = c;
  expected.server.api_key = "<set>";  // a secret prints masked
  EXPECT_EQ(FieldValues(back), FieldValues(expected));
  EXPECT_EQ(ConfigToYaml(back), yaml);
}

TEST(ServerConfig, SecretsArePrintedMaskedAndNeverDocumented) {
  EXPECT_NE(ConfigToYaml(FromYaml("")).find("api_key: \"\""), std::string::npos);
  EXPECT_NE(ConfigToYaml(FromYaml("server: {api_key: hunter2}\n")).find("api_key: <set>"),
            std::string::npos);
  EXPECT_EQ(ConfigToYaml(FromYaml("server: {api_key: hunter2}\n")).find("hunter2"),
            std::string::npos);
  try {
    Documented("server: {api_key: hunter2}\n");
    FAIL() << "documented a secret";
  } catch (const ServerConfigError& e) {
    EXPECT_EQ(e.key_path(), "server.api_key");
    EXPECT_EQ(std::string(e.what()).find("hunter2"), std::string::npos);
  }
}

TEST(ServerConfig, DocumentedYamlWritesSetValuesDefaultsAndLiveDerivations) {
  const std::string doc = Documented("device: cuda\nlimits: {max_images_per_request: 2}\n");
  EXPECT_EQ(doc.rfind(DefaultConfigHeader(), 0), 0u) << "no header of its own: the default";
  EXPECT_NE(doc.find("\ndevice: cuda\n"), std::string::npos);
  EXPECT_NE(doc.find("\n  max_images_per_request: 2\n"), std::string::npos);
  EXPECT_NE(doc.find("\n  max_queue_delay_us: 2000\n"), std::string::npos);  // a default
  EXPECT_NE(doc.find("\n  batch_sizes: ~\n"), std::string::npos);            // derived from device
  EXPECT_NE(doc.find("\n  max_request_bytes: ~\n"), std::string::npos);
  EXPECT_NE(doc.find("\nserved_model_name: ~\n"), std::string::npos);
  EXPECT_NE(doc.find("  # Range 1 .. 1000000. Default 256.\n  max_queue_size: 256\n"),
            std::string::npos);
  // Loaded back, the derivations follow the values: CUDA buckets, 2 images' bytes + 4 MiB.
  const ServerConfig c = FromYaml(doc);
  EXPECT_TRUE(c.buckets.batch_sizes.empty());
  EXPECT_EQ(c.limits.max_request_bytes, 2 * c.limits.max_image_bytes + (4 << 20));
  EXPECT_EQ(ConfigToYaml(c), ConfigToYaml(FromYaml("device: cuda\nlimits: "
                                                   "{max_images_per_request: 2}\n")));
  std::istringstream lines(doc);
  for (std::string line; std::getline(lines, line);) EXPECT_LE(line.size(), 100u) << line;
}

TEST(ServerConfig, DocumentedYamlRegeneratesItself) {
  ServerConfig every = NonDefaultConfig();
  every.server.api_key = "";
  for (const std::string& text :
       {std::string(""), std::string("# my header\n#\n\nseed: 4\nbuckets: {oversize: reject}\n"),
        ConfigToYaml(every)}) {
    const std::string once = Documented(text);
    EXPECT_EQ(Documented(once), once);
    EXPECT_EQ(ConfigToYaml(FromYaml(once)), ConfigToYaml(FromYaml(text)));
  }
  EXPECT_EQ(Documented("# my header\n\nseed: 4\n").rfind("# my header\n\n# Preset name", 0), 0u);
}

TEST(ServerConfig, LeadingCommentIsTheHeaderBeforeABlankLine) {
  EXPECT_EQ(LeadingComment("# a\n#\n# b\n\nmodel: x\n"), "# a\n#\n# b\n");
  EXPECT_EQ(LeadingComment("# only\n"), "# only\n");
  EXPECT_EQ(LeadingComment("# the model's comment\nmodel: x\n"), "");
  EXPECT_EQ(LeadingComment("model: x\n# b\n\n"), "");
  EXPECT_EQ(LeadingComment(""), "");
}

TEST(ServerConfig, ReadServerConfigKeepsTheHeaderAndTheSetKeys) {
  const auto path = std::filesystem::temp_directory_path() / "vlmgraph_read_config_test.yaml";
  std::ofstream(path) << "# header\n\nseed: 2\nbuckets: {oversize: ~}\n";
  std::vector<const char*> args = {"vlmgraph-server",           "--config", path.c_str(),
                                   "--print-config-documented", "--dtype",  "bfloat16"};
  const CommandLine cl = ParseCommandLine(static_cast<int>(args.size()), args.data());
  EXPECT_TRUE(cl.print_config_documented);
  EXPECT_FALSE(cl.print_config);
  const ConfigSource source = ReadServerConfig(cl);
  EXPECT_EQ(source.header, "# header\n");
  EXPECT_EQ(source.raw.set_keys, (std::set<std::string>{"seed", "dtype"}));  // ~ is unset
  EXPECT_EQ(source.raw.values.seed, 2u);
  std::filesystem::remove(path);
}

// deploy/config.yaml is generated from the key table: a key's doc, default or range changed in
// server/config/config_schema.cc (or a value edited by hand out of format) must be regenerated.
TEST(ServerConfig, DeployConfigYamlIsTheDocumentedSchema) {
  const std::filesystem::path path = DeployDir() / "config.yaml";
  const std::string text = ReadFile(path);
  ASSERT_FALSE(text.empty()) << path;
  const std::string generated = Documented(text);
  if (generated == text) return;
  std::istringstream want(generated), have(text);
  std::string want_line, have_line;
  int line = 0;
  while (true) {
    ++line;
    const bool more_want = static_cast<bool>(std::getline(want, want_line));
    const bool more_have = static_cast<bool>(std::getline(have, have_line));
    if (!more_want && !more_have) break;
    if (!more_want || !more_have || want_line != have_line) break;
  }
  ADD_FAILURE()
      << "deploy/config.yaml differs from the key table (server/config/config_schema.cc), "
         "first at line "
      << line << ":\n  file:      " << have_line << "\n  generated: " << want_line
      << "\nRegenerate it from the repository root:\n"
         "  build/server/vlmgraph-server --config deploy/config.yaml "
         "--print-config-documented > /tmp/config.yaml && mv /tmp/config.yaml "
         "deploy/config.yaml";
}

}  // namespace
}  // namespace vlmgraph::server
