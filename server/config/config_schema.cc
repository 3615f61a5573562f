#include "server/config/config_schema.h"

#include <pwd.h>
#include <unistd.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <sstream>
#include <stdexcept>
#include <type_traits>
#include <utility>

#include "server/config/config_key_builder.h"

namespace vlmgraph::server {
namespace {

using config_detail::Derivation;
using config_detail::IntList;
using config_detail::Key;

// The last path component of a checkpoint directory ("/models/smollm2-135m/" -> "smollm2-135m"),
// or the preset name.
std::string DefaultServedModelName(const std::string& model) {
  std::filesystem::path p(model);
  // "/" is its own parent: stop there (model "/" is then refused by ValidateConfig).
  while (p.has_parent_path() && p.filename().empty() && p.parent_path() != p) p = p.parent_path();
  const std::string name = p.filename().string();
  return name.empty() ? model : name;
}

// train.checkpoint_dir's default: the user's data directory of the XDG Base Directory
// specification ($XDG_DATA_HOME when it is an absolute path, else $HOME/.local/share, else the
// password database's home) + /vlmgraph/checkpoints. Trained weights are data the user keeps, not
// a cache that can be fetched again, so not ~/.cache (where the converted default model lives).
// "" when no home directory is known (ValidateConfig then asks for the key).
std::string DefaultCheckpointDir() {
  const char* xdg = std::getenv("XDG_DATA_HOME");
  if (xdg != nullptr && xdg[0] == '/') return std::string(xdg) + "/vlmgraph/checkpoints";
  std::string home;
  if (const char* h = std::getenv("HOME"); h != nullptr && h[0] == '/') {
    home = h;
  } else if (const passwd* pw = ::getpwuid(::getuid()); pw != nullptr && pw->pw_dir != nullptr) {
    home = pw->pw_dir;
  }
  if (home.empty()) return "";
  if (home.back() == '/') home.pop_back();
  return home + "/.local/share/vlmgraph/checkpoints";
}

// CPU runs every region eagerly, so small buckets waste the least padding; on CUDA the engine's
// defaults (engine/bucket.h, sized for nanovlm-460m) apply.
const BucketSpec& CpuBuckets() {
  static const BucketSpec spec = [] {
    BucketSpec b;
    b.batch_sizes = {1, 2, 4, 8};
    b.seq_lens = {32, 64, 128, 256};
    b.context_lens = {128, 256, 512};
    b.tile_counts = {1, 2, 4, 8, 17};
    b.train_batch_sizes = {1, 2, 4, 8};
    b.train_seq_lens = {64, 128, 256};
    return b;
  }();
  return spec;
}

// buckets.batch_sizes: the CPU list, or [] on CUDA, where the engine derives the list from the
// device's memory once the weights are loaded (engine/bucket_sizing.h).
Derivation<IntList> BatchSizesDefault() {
  return {"[1, 2, 4, 8] on CPU; [] on CUDA: derived at start from the device's memory",
          [](const ServerConfig& c) {
            return c.device == "cpu" ? CpuBuckets().batch_sizes : IntList{};
          }};
}

Derivation<IntList> BucketDefault(IntList BucketSpec::*list) {
  auto text = [](const IntList& v) {
    YAML::Emitter out;
    out << YAML::Flow << v;
    return std::string(out.c_str());
  };
  static const BucketSpec kCuda;
  return {text(CpuBuckets().*list) + " on CPU, " + text(kCuda.*list) + " on CUDA",
          [list](const ServerConfig& c) {
            return c.device == "cpu" ? CpuBuckets().*list : BucketSpec{}.*list;
          }};
}

// a * b + c, saturated to [.., INT_MAX] (the inputs are validated only later).
int64_t SaturatedMulAdd(int64_t a, int64_t b, int64_t c) {
  int64_t out = 0;
  if (__builtin_mul_overflow(a, b, &out) || __builtin_add_overflow(out, c, &out)) return INT_MAX;
  return std::min<int64_t>(INT_MAX, out);
}

int64_t LargestTrainBucket(const ServerConfig& c) {
  const IntList& batch = c.buckets.train_batch_sizes;
  const IntList& seq = c.buckets.train_seq_lens;
  if (batch.empty() || seq.empty()) return 0;
  int64_t out = 0;
  if (__builtin_mul_overflow(*std::max_element(batch.begin(), batch.end()),
                             *std::max_element(seq.begin(), seq.end()), &out)) {
    return INT64_MAX;
  }
  return out;
}

constexpr double kTwoTo20 = 1 << 20;
constexpr double kTwoTo30 = 1 << 30;
constexpr double kTwoTo40 = static_cast<double>(int64_t{1} << 40);

using SC = ServerConfig;

std::vector<ConfigKey> BuildKeys() {
  return {
      Key("model", &SC::model)
          .Doc("Preset name (nanovlm-tiny: 2+2 blocks, 64 px tiles, CPU demos; nanovlm-460m: "
               "upstream nanoVLM's SigLIP2-B/16-512 + SmolLM2-360M) with random weights, or a "
               "checkpoint directory: nanoVLM's config.json + model.safetensors (what "
               "upstream's save_pretrained and the Train RPC's SaveCheckpoint write), or a "
               "Hugging Face transformers Llama / SmolLM2 checkpoint (config.json with "
               "model_type llama + model.safetensors, or its shards with "
               "model.safetensors.index.json), served as nanoVLM's language model with a random "
               "vision encoder.")
          .Default("nanovlm-tiny")
          .NonEmpty(),
      Key("seed", &SC::seed)
          .Doc("Random-init seed of preset models: the same seed gives the same weights (and "
               "outputs).")
          .Default(0)
          .AtLeast(0),
      Key("dtype", &SC::dtype)
          .Doc("Weights and activations.")
          .OneOf({"float32", "bfloat16"})
          .Default("float32"),
      Key("device", &SC::device)
          .Doc("cpu, cuda (device 0) or cuda:N. CUDA graphs need a CUDA device; on CPU every "
               "region runs eagerly.")
          .Default("cpu"),
      Key("data_parallel_size", &SC::data_parallel_size)
          .Doc("Engines serving behind the one gRPC and HTTP front (vLLM's "
               "--data-parallel-size): one per device, from `device` on (device cuda:2 with 2: "
               "cuda:2 and cuda:3), each with its own weights, KV cache, CUDA graphs and GPU "
               "thread. 0 = every CUDA device from `device` on. Each request goes to the "
               "least-loaded engine (running + waiting); an engine whose GPU fails fails only its "
               "own requests (UNAVAILABLE / 503) and the others keep serving. On cpu N engines "
               "share the CPU (tests). max_queue_size is per engine. A Train job runs on every "
               "serving engine as data-parallel ranks (each engine trains on its share of every "
               "batch and keeps serving between the pieces of a step; "
               "train.data_parallel_timeout_seconds), and a publish or rollback changes every "
               "engine.")
          .Default(1)
          .AtLeast(0),
      Key("model_stop_token_ids", &SC::model_stop_token_ids)
          .Doc("End-of-sequence token ids that GetModelInfo suggests to clients as "
               "stop_token_ids; [] = the tokenizer's (the chat format's end of turn and the "
               "checkpoint's eos tokens), none without a tokenizer. For SmolLM2 tokenizers "
               "<|endoftext|> = 0 and <|im_end|> = 2.")
          .Default({})
          .AtLeast(0),
      Key("tokenizer", &SC::tokenizer)
          .Doc("Hugging Face tokenizer.json of the model; \"\" = <model>/tokenizer.json when the "
               "checkpoint directory has one, none = no tokenizer (requests must send token "
               "ids). Text prompts, chat and the OpenAI-compatible API need one.")
          .Default(""),
      Key("parse_special_in_content", &SC::parse_special_in_content)
          .Doc("Whether special-token text typed in chat message content (\"<|im_end|>\", "
               "\"<|im_start|>system\") becomes the special tokens. false: it is tokenized as "
               "plain text, so a user cannot end their turn or write a system turn; only the "
               "chat template's own markers are special tokens (llama.cpp's parse_special). true: "
               "the whole rendered prompt is tokenized with special tokens recognised, as Hugging "
               "Face's apply_chat_template and vLLM do. Plain prompts (/v1/completions, "
               "/tokenize prompt, gRPC text) always recognise them: the client writes the whole "
               "model input there, as with token ids (docs/security.md).")
          .Default(false),
      Key("served_model_name", &SC::served_model_name)
          .Doc("Model id that GetModelInfo and the OpenAI-compatible /v1/models report, and the "
               "only `model` value the OpenAI-compatible API accepts.")
          .Derived({"the preset name, or the checkpoint directory's last path component",
                    [](const SC& c) { return DefaultServedModelName(c.model); }})
          .NonEmpty(),

      Key("buckets.batch_sizes", &SC::buckets, &BucketSpec::batch_sizes)
          .Doc("Sequences per decode step, and per prefill step up to max_prefill_batch. The "
               "largest entry is the number of KV-cache slots: how many sequences decode "
               "together (continuous batching). The KV cache is paged (docs/design/kv-cache.md): "
               "a sequence holds the pages of 16 tokens that its prompt and max_new_tokens can "
               "fill, and a request waits while they are taken. [] (on CUDA only) = derived at "
               "start, once the weights are on the device: the KV cache gets "
               "gpu_memory_utilization x the device's memory less what is in use, the graph pool "
               "estimate and the buffers (at most what the slots fill at max(context_lens)), and "
               "the list is the powers of two up to max_decode_batch, once one sequence of "
               "max(context_lens) fits (the start-up log shows the arithmetic). Given, the cache "
               "has pages for max(context_lens) tokens of every slot.")
          .Derived(BatchSizesDefault())
          .AtLeast(1),
      Key("buckets.gpu_memory_utilization", &SC::buckets, &BucketSpec::gpu_memory_utilization)
          .Doc("With batch_sizes [] (derived): the fraction of the device's memory that the "
               "weights, the KV cache and the CUDA graph pool may take together (vLLM's "
               "gpu_memory_utilization). Lower it when other processes share the GPU.")
          .Default(0.9)
          .Range(0.01, 1),
      Key("buckets.max_decode_batch", &SC::buckets, &BucketSpec::max_decode_batch)
          .Doc("With batch_sizes [] (derived): the most KV-cache slots, i.e. sequences decoding "
               "together (vLLM's max_num_seqs); KV pages, not slots, bound the tokens they hold. "
               "Each decode batch bucket is one more graph per context_lens entry to capture. "
               "Raise batching.max_queue_size with it when that many clients send at once.")
          .Default(256)
          .Range(1, 65536),
      Key("buckets.max_prefill_batch", &SC::buckets, &BucketSpec::max_prefill_batch)
          .Doc("Prefill batch buckets are the batch_sizes entries up to this; larger batches "
               "decode only. A prefill bucket's activations, and so the graph pool, grow with "
               "batch x seq, while padding a decode row costs little.")
          .Derived({"max(batch_sizes), or 32 when batch_sizes is [] (derived)",
                    [](const SC& c) {
                      const IntList& b = c.buckets.batch_sizes;
                      return b.empty() ? int64_t{32} : *std::max_element(b.begin(), b.end());
                    }})
          .Range(1, 65536),
      Key("buckets.seq_lens", &SC::buckets, &BucketSpec::seq_lens)
          .Doc("Prompt tokens per prefill row (image tokens included: 64 per tile for "
               "nanovlm-460m). The largest entry must not exceed the largest context_lens "
               "entry.")
          .Derived(BucketDefault(&BucketSpec::seq_lens))
          .AtLeast(1)
          .NonEmpty(),
      Key("buckets.context_lens", &SC::buckets, &BucketSpec::context_lens)
          .Doc("Attention window of a decode step. The largest entry is the KV cache length, so "
               "prompt + generated tokens of one sequence must fit it; it must be >= "
               "max(seq_lens) and at most the model's lm_max_position_embeddings.")
          .Derived(BucketDefault(&BucketSpec::context_lens))
          .AtLeast(1)
          .NonEmpty(),
      Key("buckets.tile_counts", &SC::buckets, &BucketSpec::tile_counts)
          .Doc("Image tiles per vision run (a 4x4-tile image plus its global tile is 17 for "
               "nanovlm-460m).")
          .Derived(BucketDefault(&BucketSpec::tile_counts))
          .AtLeast(1)
          .NonEmpty(),
      Key("buckets.train_batch_sizes", &SC::buckets, &BucketSpec::train_batch_sizes)
          .Doc("Training step buckets (Train RPC): examples per batch.")
          .Derived(BucketDefault(&BucketSpec::train_batch_sizes))
          .AtLeast(1)
          .NonEmpty(),
      Key("buckets.train_seq_lens", &SC::buckets, &BucketSpec::train_seq_lens)
          .Doc("Training step buckets (Train RPC): tokens per example.")
          .Derived(BucketDefault(&BucketSpec::train_seq_lens))
          .AtLeast(1)
          .NonEmpty(),
      Key("buckets.oversize", &SC::buckets, &BucketSpec::oversize)
          .Doc("A shape larger than every bucket: eager runs it without a graph (counted in "
               "vlmgraph_eager_fallbacks_total), reject refuses the request (INVALID_ARGUMENT).")
          .Names({{"eager", OversizePolicy::kEager}, {"reject", OversizePolicy::kReject}})
          .Default(OversizePolicy::kEager),

      Key("capture.enabled", &SC::capture, &SC::Capture::enabled)
          .Doc("Capture CUDA graphs (ignored on CPU, where every region runs eagerly).")
          .Default(true),
      Key("capture.lazy", &SC::capture, &SC::Capture::lazy)
          .Doc("true: capture each bucket on its first use instead of at start-up (faster start, "
               "a one-time stall per new shape under load).")
          .Default(false),
      Key("capture.programmatic_dependent_launch", &SC::capture,
          &SC::Capture::programmatic_dependent_launch)
          .Doc("Chain the fused decode kernels with programmatic dependent launch (Hopper and "
               "newer): each kernel starts loading weights before the previous one ends "
               "(docs/design/decode-kernels.md). The environment variable VLMGRAPH_PDL=0 turns it "
               "off whatever this says.")
          .Default(true),

      Key("batching.max_queue_delay_us", &SC::batching, &SC::Batching::max_queue_delay_us)
          .Doc("Longest time a new request waits to be grouped with others into one prefill "
               "batch, in microseconds; a full batch (the free decode slots, or max_prefill_batch "
               "requests) starts at once. Larger values batch better but delay the first token.")
          .Default(2000)
          .Range(0, 10000000),
      Key("batching.max_queue_size", &SC::batching, &SC::Batching::max_queue_size)
          .Doc("Requests (all RPCs) waiting for the GPU thread; beyond this new requests get "
               "RESOURCE_EXHAUSTED.")
          .Default(256)
          .Range(1, 1000000),

      Key("server.grpc_address", &SC::server, &SC::Endpoints::grpc_address)
          .Doc("gRPC API (vlmgraph.v1.VlmGraph, grpc.health.v1.Health, reflection), HOST:PORT or "
               "[IPV6]:PORT (quoted in YAML, like \"[::1]:50051\"). Port 0 picks a free port "
               "(printed at start). In a container use 0.0.0.0, or [::] for every address.")
          .Default(ListenAddress::Parse("127.0.0.1:50051"))
          .NonEmpty(),
      Key("server.metrics_address", &SC::server, &SC::Endpoints::metrics_address)
          .Doc("Prometheus /metrics (docs/metrics.md), HOST:PORT or [IPV6]:PORT, its own port (0 "
               "picks a free one).")
          .Default(ListenAddress::Parse("127.0.0.1:9464"))
          .NonEmpty(),
      Key("server.http_address", &SC::server, &SC::Endpoints::http_address)
          .Doc("OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions, /v1/models, "
               "/tokenize, /detokenize, /health), HOST:PORT or [IPV6]:PORT (port 0 picks a free "
               "one); \"\" turns it off.")
          .Default(ListenAddress::Parse("127.0.0.1:8000")),
      Key("server.api_key", &SC::server, &SC::Endpoints::api_key)
          .Doc("One API key with every scope, required as `authorization: Bearer KEY` by gRPC "
               "and HTTP when set; \"\" = none. Prefer auth.api_keys_file, or the "
               "VLMGRAPH_API_KEY environment variable, which overrides this and keeps the key "
               "out of files. Printed as <set>.")
          .Default("")
          .Secret(),
      Key("server.stream_threads", &SC::server, &SC::Endpoints::stream_threads)
          .Doc("Threads of each front (gRPC's Generate streams, the HTTP API's streams) that turn "
               "the engines' new tokens into stream chunks: detokenize, stop strings, the "
               "message. 0 = 2, or 1 per 2 engines (GPUs) past 4: at 4 GPUs x 256 streams 2 "
               "threads pass about 500k tokens/s at 0.7 of a core each.")
          .Default(0)
          .Range(0, 256),

      Key("http.io_threads", &SC::http, &SC::Http::io_threads)
          .Doc("Threads of the event-driven HTTP front: they read and write every connection "
               "(idle, slow and streaming clients need no thread of their own). 0 = 2 per engine "
               "(GPU).")
          .Default(0)
          .Range(0, 64),
      Key("http.workers", &SC::http, &SC::Http::workers)
          .Doc("Threads that turn HTTP request bodies into engine requests (JSON, chat template, "
               "tokenizer, image decoding). Requests beyond batching.max_queue_size waiting for "
               "one get 429.")
          .Default(4)
          .Range(1, 256),
      Key("http.idle_timeout_seconds", &SC::http, &SC::Http::idle_timeout_seconds)
          .Doc("A connection with no request in progress (before its first, between keep-alive "
               "requests) is closed after this long without a byte (nginx's keepalive_timeout).")
          .Default(60)
          .Range(0.01, 86400),
      Key("http.request_head_timeout_seconds", &SC::http, &SC::Http::request_head_timeout_seconds)
          .Doc("From the first byte of a request to the end of its head (request line and "
               "headers), whatever the pace of the bytes; then 408 and the connection is closed "
               "(slowloris; nginx's client_header_timeout).")
          .Default(10)
          .Range(0.01, 3600),
      Key("http.request_body_timeout_seconds", &SC::http, &SC::Http::request_body_timeout_seconds)
          .Doc("The whole request body must arrive within this long of its head; then 408 and "
               "the connection is closed (slow bodies).")
          .Default(60)
          .Range(0.01, 3600),
      Key("http.write_timeout_seconds", &SC::http, &SC::Http::write_timeout_seconds)
          .Doc("Each write of a response (a stream's event included) must complete within this "
               "long, else the connection is closed and its generation cancelled (a client that "
               "stops reading).")
          .Default(30)
          .Range(0.01, 3600),
      Key("http.max_connections", &SC::http, &SC::Http::max_connections)
          .Doc("Open HTTP connections in all; a connection beyond it gets 503 and is closed.")
          .Default(16384)
          .Range(1, 10000000),
      Key("http.max_connections_per_client", &SC::http, &SC::Http::max_connections_per_client)
          .Doc("Open HTTP connections per client IP address; a connection beyond it gets 503 and "
               "is closed (nginx's limit_conn). 0 = no limit: set 0 behind a proxy or load "
               "balancer, where every client has its address.")
          .Default(1024)
          .Range(0, 10000000),
      Key("http.max_body_bytes_in_flight", &SC::http, &SC::Http::max_body_bytes_in_flight)
          .Doc("Request bodies of every HTTP connection together, bytes: each request head "
               "reserves its Content-Length (a chunked body: the largest body an endpoint reads) "
               "before its body is read, until its response is done; a head that does not fit "
               "gets 503 with Retry-After: 1. 0 = no limit; else at least the largest body "
               "(limits.max_images_per_request x max_image_bytes x 4/3 + 4 MiB).")
          .Default(int64_t{1} << 30)
          .Range(0, kTwoTo40),

      Key("auth.api_keys_file", &SC::auth, &SC::Auth::api_keys_file)
          .Doc("API keys with scopes (docs/security.md); \"\" = no keys. One \"SCOPES KEY\" line "
               "per key, scopes inference, train (training and checkpoints), publish (changing "
               "the served weights: a Train job's publish, RollbackWeights) or all, "
               "comma-separated: \"inference,train 9a8b7c6d5e4f3a2b1c0d\". Clients send "
               "`authorization: Bearer KEY`. compose.yaml mounts the secret file deploy/api-keys "
               "at /run/secrets/vlmgraph_api_keys.")
          .Default(""),
      Key("auth.allow_unauthenticated", &SC::auth, &SC::Auth::allow_unauthenticated)
          .Doc("A gRPC or HTTP address that is not loopback needs keys unless this is true (an "
               "open server on purpose).")
          .Default(false),

      Key("tls.cert_file", &SC::tls, &SC::Tls::cert_file)
          .Doc("PEM certificate chain; with key_file it turns TLS on for gRPC and HTTP. Both or "
               "neither.")
          .Default(""),
      Key("tls.key_file", &SC::tls, &SC::Tls::key_file)
          .Doc("PEM private key of cert_file.")
          .Default(""),
      Key("tls.client_ca_file", &SC::tls, &SC::Tls::client_ca_file)
          .Doc("PEM CA certificates: when set, every client must present a certificate signed by "
               "one of them (mutual TLS). Needs cert_file and key_file.")
          .Default(""),

      Key("limits.max_image_bytes", &SC::limits, &SC::Limits::max_image_bytes)
          .Doc("Encoded size of one image, bytes. Larger: INVALID_ARGUMENT.")
          .Default(20 << 20)
          .Range(1, INT_MAX),
      Key("limits.max_image_pixels", &SC::limits, &SC::Limits::max_image_pixels)
          .Doc("Width x height of one image, and of the largest image its resize passes "
               "through (a thin image is widened to the tile size first), checked from the "
               "header or tensor shape before decoding or resizing.")
          .Default(40000000)
          .Range(1, kTwoTo40),
      Key("limits.max_images_per_request", &SC::limits, &SC::Limits::max_images_per_request)
          .Doc("Images per request. With max_image_bytes it sets the largest request "
               "(limits.max_request_bytes, and x 4/3 the largest HTTP body).")
          .Default(4)
          .Range(0, 1024),
      Key("limits.max_new_tokens", &SC::limits, &SC::Limits::max_new_tokens)
          .Doc("max_new_tokens of one Generate request.")
          .Default(1024)
          .Range(1, kTwoTo30),
      Key("limits.default_max_new_tokens", &SC::limits, &SC::Limits::default_max_new_tokens)
          .Doc("Used when a request leaves max_new_tokens unset; at most max_new_tokens.")
          .Derived({"min(32, max_new_tokens)",
                    [](const SC& c) { return std::min<int64_t>(32, c.limits.max_new_tokens); }})
          .Range(1, kTwoTo30),
      Key("limits.max_logits_positions", &SC::limits, &SC::Limits::max_logits_positions)
          .Doc("logits_positions of one Forward request (each row is vocab_size floats).")
          .Default(64)
          .Range(0, kTwoTo20),
      Key("limits.max_train_batch_examples", &SC::limits, &SC::Limits::max_train_batch_examples)
          .Doc("Examples in one Train batch.")
          .Default(64)
          .Range(1, kTwoTo20),
      Key("limits.max_train_batch_tokens", &SC::limits, &SC::Limits::max_train_batch_tokens)
          .Doc("Examples x longest example of one Train batch, tokens; 0 = no limit. A batch "
               "with more examples than a train bucket runs as bucket-sized micro-batches with "
               "decode steps between them; an example longer than every train bucket runs "
               "eagerly and holds the GPU thread, so every Generate waits for it.")
          .Derived({"the largest train bucket (max train_batch_sizes x max train_seq_lens)",
                    LargestTrainBucket})
          .Range(0, kTwoTo40),
      Key("limits.max_request_bytes", &SC::limits, &SC::Limits::max_request_bytes)
          .Doc("Largest gRPC request message, bytes.")
          .Derived({"max_images_per_request x max_image_bytes + 4 MiB (at most 2^31-1)",
                    [](const SC& c) {
                      return SaturatedMulAdd(c.limits.max_images_per_request,
                                             c.limits.max_image_bytes, 4 << 20);
                    }})
          .Range(1024, INT_MAX),

      Key("train.checkpoint_dir", &SC::train, &SC::Train::checkpoint_dir)
          .Doc("Root directory of the Train RPC's checkpoints (SaveCheckpoint, save_directory, "
               "resume_from: clients name a subdirectory; \"..\" and absolute paths are "
               "refused). Each checkpoint holds the weights, the optimizer state and the "
               "tokenizer files the server was started with, so `vlmgraph-server --model "
               "<checkpoint_dir>/<name>` serves it. Relative paths are relative to the working "
               "directory.")
          .Derived({"$XDG_DATA_HOME/vlmgraph/checkpoints, or ~/.local/share/vlmgraph/checkpoints "
                    "when XDG_DATA_HOME is unset",
                    [](const SC&) { return DefaultCheckpointDir(); }})
          .NonEmpty(),
      Key("train.checkpoint_quota_bytes", &SC::train, &SC::Train::checkpoint_quota_bytes)
          .Doc("Bytes that every file below checkpoint_dir may take together after a save "
               "(the save's own files counted at their size, a checkpoint it replaces "
               "subtracted); a save that would pass it is refused with RESOURCE_EXHAUSTED and "
               "writes no file. 0 = no quota.")
          .Default(int64_t{64} << 30)
          .Range(0, kTwoTo40 * 1024),
      Key("train.idle_timeout_seconds", &SC::train, &SC::Train::idle_timeout_seconds)
          .Doc("A Train stream that sends nothing for this long is cancelled by the server "
               "(counted as DEADLINE_EXCEEDED), which frees the one-job slot; 0 = never.")
          .Default(600)
          .Range(0, 86400),
      Key("train.data_parallel_timeout_seconds", &SC::train,
          &SC::Train::data_parallel_timeout_seconds)
          .Doc("A Train job on a server with several engines (data_parallel_size) runs on every "
               "serving engine as data-parallel ranks in this process (docs/deployment.md): the "
               "ranks' rendezvous, each collective (the gradient all-reduce of every step) and "
               "their heartbeats wait at most this long for the slowest engine. On the CPU (gloo) "
               "a rank that fails ends the job on every rank at once or, at the latest, after "
               "this long, and the engines keep serving; on CUDA (NCCL) a collective whose peer "
               "failed cannot be cancelled (docs/deployment.md).")
          .Default(60)
          .Range(1, 86400),
      Key("train.publish_gate", &SC::train, &SC::Train::publish_gate)
          .Doc("Score a Train job's weights on held-out prompts before they replace the served "
               "weights (a publish request or publish_on_end), and refuse them "
               "(FAILED_PRECONDITION with the measured losses, counted in "
               "vlmgraph_train_publish_refused_total) when their largest |weight| passes "
               "publish_gate_max_abs_weight, their logits or loss are NaN or infinite, every "
               "held-out answer would end at once while the served model's would not, or their "
               "held-out loss passes the served weights' by more than "
               "publish_gate_max_loss_increase. false: any finite weights are published "
               "(docs/security.md).")
          .Default(true),
      Key("train.publish_gate_prompts_file", &SC::train, &SC::Train::publish_gate_prompts_file)
          .Doc("The publish gate's held-out prompts, one per line (blank lines and lines starting "
               "with # are skipped): for a model with a tokenizer a user message, rendered with "
               "the chat template and its generation prompt; for a model without one, token ids "
               "separated by spaces or commas. The loss is the mean cross entropy of every next "
               "token of the prompts. \"\" = built-in: four short questions (\"What is the "
               "capital of France?\", ...), or four fixed 16-token sequences without a "
               "tokenizer. A line the model cannot take stops the server at start-up.")
          .Default(""),
      Key("train.publish_gate_max_loss_increase", &SC::train,
          &SC::Train::publish_gate_max_loss_increase)
          .Doc("Largest rise of the held-out loss, in nats per token, from the served weights to "
               "the published ones (not checked with the built-in token sequences of a model "
               "without a tokenizer, which belong to no task). Measured on SmolLM2-135M-Instruct "
               "with the built-in chat prompts (4.61 served): fine-tuning jobs of learning rate "
               "1e-4 and 1e-3 gave 0.98 and 1.61, destructive ones of learning rate 1e-2 and 1 "
               "gave 28.5 and 54.7.")
          .Default(1.0)
          .Range(0, 1000),
      Key("train.publish_gate_max_abs_weight", &SC::train, &SC::Train::publish_gate_max_abs_weight)
          .Doc("Largest |weight| a publish may carry; 0 = no bound. Trained models keep their "
               "weights within a few units (SmolLM2-135M's largest is 9.25); a learning rate of "
               "1e30 leaves them near 1e26.")
          .Default(1000)
          .Range(0, 1e30),

      Key("shutdown_timeout_seconds", &SC::shutdown_timeout_seconds)
          .Doc("On SIGTERM/SIGINT: health turns NOT_SERVING (gRPC health and HTTP /health answer "
               "it while the ports stay open), new calls are refused with UNAVAILABLE / 503, "
               "running calls (Train streams included) get this long to finish, then the rest are "
               "cancelled.")
          .Default(30)
          .Range(0, 3600),
      Key("log_level", &SC::log_level)
          .Doc("Log verbosity; debug also logs every refused request.")
          .OneOf({"error", "warn", "info", "debug"})
          .Default("info"),
  };
}

}  // namespace

std::string ConfigNumber(double v) {
  std::ostringstream o;
  o.precision(15);
  o << v;
  return o.str();
}

std::string YamlLine(const YAML::Node& node) {
  const YAML::Mark m = node.Mark();
  return m.line >= 0 ? " (line " + std::to_string(m.line + 1) + ")" : "";
}

std::string ConfigKey::section() const {
  const size_t dot = name.find('.');
  return dot == std::string::npos ? "" : name.substr(0, dot);
}

std::string ConfigKey::leaf() const { return name.substr(name.find('.') + 1); }

const std::vector<ConfigKey>& ConfigKeys() {
  static const std::vector<ConfigKey> keys = BuildKeys();
  return keys;
}

const std::vector<ConfigSection>& ConfigSections() {
  static const std::vector<ConfigSection> sections = {
      {"buckets",
       "Shape buckets (docs: engine/bucket.h). Every region runs at a padded shape from these "
       "lists, so each shape is captured into a CUDA graph once, at start-up. A request pads up "
       "to the smallest bucket that fits; padded positions are masked, so results equal an "
       "unpadded run. More buckets = less padding but longer start-up and more graph memory. "
       "Lists are sorted and de-duplicated. The defaults depend on the device: small buckets on "
       "CPU, where every region runs eagerly and padding is pure waste; on CUDA the engine's "
       "(sized for nanovlm-460m), with the decode batch buckets derived from the device's memory "
       "(docs/deployment.md, \"Choosing buckets\")."},
      {"capture", ""},
      {"batching", ""},
      {"server", ""},
      {"http",
       "The HTTP front of the OpenAI-compatible API (server/http/http_server.h): deadlines for "
       "slow clients, connection limits, threads. docs/security.md, \"Hostile HTTP clients\"."},
      {"auth", ""},
      {"tls", ""},
      {"limits", ""},
      {"train", ""},
  };
  return sections;
}

const std::string& DefaultConfigHeader() {
  static const std::string header =
      "# vlmgraph server configuration: every key with what it does, its range and its default.\n"
      "# Printed by `vlmgraph-server [--config FILE] --print-config-documented`. A key left out "
      "(or set\n"
      "# to ~) takes its default; `--print-config` shows the effective values.\n";
  return header;
}

}  // namespace vlmgraph::server
