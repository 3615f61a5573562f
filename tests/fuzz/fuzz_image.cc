// Fuzz target: encoded images (PNG, JPEG) -> pixels -> ViT tiles (image/image_processor.h:
// DetectImageFormat, DecodeImage, TileImage). Input: the file's bytes. Expected error: ImageError.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "image/image_processor.h"
#include "tests/fuzz/fuzz_util.h"

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  at::set_num_threads(1);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace vlmgraph;
  const std::string bytes(reinterpret_cast<const char*>(data), size);
  const auto limits = fuzz::SmallLimits();
  // Both resize rules of nanoVLM's DynamicResize, picked by the input's length.
  VlmConfig cfg = fuzz::TinyConfig();
  cfg.resize_to_max_side_len = size % 2 == 1;
  fuzz::ExpectOnly<ImageError>("image", [&] {
    DetectImageFormat(bytes);
    const at::Tensor pixels = DecodeImage(bytes, {limits.max_image_bytes, limits.max_image_pixels});
    TileImage(pixels, cfg);
  });
  return 0;
}
