// Fuzz target: the gRPC requests (server/grpc/convert.h: ToEngineRequest for GenerateRequest and
// ForwardRequest, ToTrainBatch; server/train/checkpoint_dir.h: CheckpointDirComponents for
// TrainRequest), with their images (encoded PNG/JPEG and raw tensors) decoded and tiled, and text
// or chat prompts tokenized.
// Input: one byte (message type: bits 0-1; bit 2: no tokenizer), then the serialized message as
// the gRPC server receives it. Expected errors: ServerError (INVALID_ARGUMENT, and
// FAILED_PRECONDITION without a tokenizer) and std::invalid_argument (ChatFormatError from the image
// string). CheckpointDirComponents checks the name alone: no file system access.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cstddef>
#include <cstdint>
#include <stdexcept>

#include "server/core/status.h"
#include "server/grpc/convert.h"
#include "server/train/checkpoint_dir.h"
#include "tests/fuzz/fuzz_util.h"

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  at::set_num_threads(1);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace vlmgraph;
  using namespace vlmgraph::server;
  if (size == 0) return 0;
  const uint8_t kind = data[0];
  const uint8_t* message = data + 1;
  const int message_size = static_cast<int>(size - 1);
  const VlmConfig& cfg = fuzz::TinyConfig();
  const Limits limits = fuzz::SmallLimits();
  const TextModel* text = kind & 4 ? nullptr : &fuzz::TinyTextModel();
  constexpr int64_t kMaxTokens = 512;
  fuzz::ExpectOnly<ServerError, std::invalid_argument>("convert", [&] {
    switch (kind & 3) {
      case 0: {
        v1::GenerateRequest r;
        if (!r.ParseFromArray(message, message_size)) return;
        const GenerateRequest g = ToEngineRequest(r, cfg, limits, text);
        CheckPrompt(g.input_ids, g.tiles, cfg, kMaxTokens, "input_ids");
        break;
      }
      case 1: {
        v1::ForwardRequest r;
        if (!r.ParseFromArray(message, message_size)) return;
        const ForwardRequest f = ToEngineRequest(r, cfg, limits, text);
        CheckPrompt(f.input_ids, f.tiles, cfg, kMaxTokens, "input_ids");
        break;
      }
      default: {
        v1::TrainRequest r;
        if (!r.ParseFromArray(message, message_size)) return;
        if (r.has_batch()) ToTrainBatch(r.batch(), cfg, limits, kMaxTokens);
        if (r.has_save())
          CheckpointDirComponents(r.save().directory());
        break;
      }
    }
  });
  return 0;
}
