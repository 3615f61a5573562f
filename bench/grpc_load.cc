// bench/grpc_load.cc: closed-loop load on the gRPC API (streaming Generate with chat messages),
// the gRPC counterpart of ../shared/tools/http_load.py, in C++ so that the client is not what is
// measured: one thread per stream (concurrency threads), spread over several channels (one TCP
// connection each, --streams-per-channel), each sending greedy chat requests back to back with
// max_new_tokens tokens and ignore_eos (vLLM's), for --warmup + --seconds.
//
//   vlmgraph-grpc-load --address 127.0.0.1:50051 --concurrency 256 512 [--seconds 15]
//       [--warmup 3] [--max-tokens 128] [--streams-per-channel 32] [--api-key KEY]
//
// Prints one JSON line per concurrency, with http_load.py's fields: output tokens/s (tokens of the
// requests that finished inside the measured window, over the window), TTFT p50/p99 (request sent
// -> first TokenChunk) of the requests that started in the window, ITL p50/p99 (a chunk of k
// tokens counts as k gaps of its gap / k), requests, errors (first error's status on stderr).
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "vlmgraph/v1/service.grpc.pb.h"

namespace {

using Clock = std::chrono::steady_clock;
namespace pb = vlmgraph::v1;

const char* const kQuestions[] = {
    "Tell me a story about a lighthouse keeper.", "Explain how rainbows form.",
    "Write a short poem about autumn leaves.",    "What are the rules of chess?",
    "Describe the water cycle.",                  "Give me ten ideas for a birthday party."};

struct Record {
  double start = 0, end = 0;  // seconds since the level began
  std::vector<std::pair<double, int64_t>> chunks;  // arrival, tokens
  int64_t tokens = 0;
  bool ok = false;
};

double Percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<size_t>(p / 100 * v.size()))];
}

}  // namespace

int main(int argc, char** argv) {
  std::string address = "127.0.0.1:50051", api_key;
  std::vector<int> levels;
  double seconds = 15, warmup = 3;
  int64_t max_tokens = 128;
  int per_channel = 32;
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    auto next = [&]() -> std::string { return i + 1 < argc ? argv[++i] : ""; };
    if (k == "--address") address = next();
    else if (k == "--api-key") api_key = next();
    else if (k == "--seconds") seconds = std::stod(next());
    else if (k == "--warmup") warmup = std::stod(next());
    else if (k == "--max-tokens") max_tokens = std::stoll(next());
    else if (k == "--streams-per-channel") per_channel = std::stoi(next());
    else if (k == "--concurrency") {
      while (i + 1 < argc && argv[i + 1][0] != '-') levels.push_back(std::stoi(argv[++i]));
    } else {
      std::fprintf(stderr, "unknown flag %s\n", k.c_str());
      return 2;
    }
  }
  if (levels.empty()) levels = {1, 8, 64};
  for (const int concurrency : levels) {
    std::vector<std::shared_ptr<grpc::Channel>> channels;
    for (int c = 0; c < (concurrency + per_channel - 1) / per_channel; ++c) {
      grpc::ChannelArguments args;
      args.SetInt("grpc.channel_id", c);  // distinct channels: one connection each
      channels.push_back(
          grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args));
    }
    const auto t0 = Clock::now();
    const double deadline = warmup + seconds;
    auto now = [&] { return std::chrono::duration<double>(Clock::now() - t0).count(); };
    std::mutex mu;
    std::vector<Record> records;
    std::atomic<int> errors{0};
    std::string first_error;
    std::vector<std::thread> threads;
    for (int w = 0; w < concurrency; ++w) {
      threads.emplace_back([&, w] {
        auto stub = pb::VlmGraph::NewStub(channels[w / per_channel]);
        std::vector<Record> mine;
        for (int n = w; now() < deadline; n += concurrency) {
          pb::GenerateRequest req;
          auto* m = req.add_messages();
          m->set_role("user");
          m->add_content()->set_text(kQuestions[n % 6]);
          req.mutable_sampling()->set_max_new_tokens(max_tokens);
          req.mutable_sampling()->set_ignore_eos(true);
          grpc::ClientContext ctx;
          if (!api_key.empty()) ctx.AddMetadata("authorization", "Bearer " + api_key);
          ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(300));
          Record r;
          r.start = now();
          auto reader = stub->Generate(&ctx, req);
          pb::GenerateResponse resp;
          while (reader->Read(&resp)) {
            if (resp.has_tokens() && resp.tokens().token_ids_size() > 0) {
              r.chunks.emplace_back(now(), resp.tokens().token_ids_size());
              r.tokens += resp.tokens().token_ids_size();
            }
          }
          const grpc::Status status = reader->Finish();
          r.end = now();
          r.ok = status.ok();
          if (!r.ok) {
            {
              std::lock_guard<std::mutex> lock(mu);
              if (errors++ == 0) first_error = std::to_string(status.error_code()) + " " +
                                               status.error_message();
            }
            // A server that refuses or is gone: back off instead of spinning on errors.
            std::this_thread::sleep_for(std::chrono::milliseconds(10));
          }
          mine.push_back(std::move(r));
        }
        std::lock_guard<std::mutex> lock(mu);
        for (auto& r : mine) records.push_back(std::move(r));
      });
    }
    for (auto& t : threads) t.join();
    if (!first_error.empty()) std::fprintf(stderr, "first error: %s\n", first_error.c_str());
    std::vector<double> ttft, itl;
    int64_t tokens = 0, done = 0;
    for (const auto& r : records) {
      if (!r.ok) continue;
      if (r.end >= warmup && r.end <= deadline) tokens += r.tokens;
      if (r.start < warmup || r.chunks.empty()) continue;
      ++done;
      ttft.push_back(r.chunks.front().first - r.start);
      for (size_t i = 1; i < r.chunks.size(); ++i) {
        const double gap = (r.chunks[i].first - r.chunks[i - 1].first) / r.chunks[i].second;
        for (int64_t k = 0; k < r.chunks[i].second; ++k) itl.push_back(gap);
      }
    }
    std::printf(
        "{\"api\": \"grpc\", \"concurrency\": %d, \"channels\": %zu, \"tok_per_s\": %.1f, "
        "\"requests\": %lld, \"errors\": %d, \"ttft_p50_ms\": %.3f, \"ttft_p99_ms\": %.3f, "
        "\"itl_p50_ms\": %.3f, \"itl_p99_ms\": %.3f}\n",
        concurrency, channels.size(), tokens / seconds, static_cast<long long>(done),
        errors.load(), Percentile(ttft, 50) * 1e3, Percentile(ttft, 99) * 1e3,
        Percentile(itl, 50) * 1e3, Percentile(itl, 99) * 1e3);
    std::fflush(stdout);
  }
  return 0;
}
