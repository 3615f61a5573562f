// tests/test_util.h: shared helpers for the vlmgraph test suites.
#pragma once

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/cuda.h>

#include <string>

#include "model/safetensors.h"

namespace vlmgraph::testing {

// tests/fixtures, set by CMake.
inline std::string FixturesDir() { return VLMGRAPH_FIXTURES_DIR; }
inline std::string TinyCheckpointDir() { return FixturesDir() + "/nanovlm-tiny"; }

// The upstream reference outputs for nanovlm-tiny (input_ids, targets, images, image_embeddings,
// logits, generated_ids), produced by upstream nanoVLM in PyTorch.
inline const SafetensorsFile& TinyReference() {
  static const SafetensorsFile ref =
      ReadSafetensors(TinyCheckpointDir() + "/reference.safetensors");
  return ref;
}

inline double MaxAbsDiff(const at::Tensor& a, const at::Tensor& b) {
  return (a.to(at::kCPU, at::kDouble) - b.to(at::kCPU, at::kDouble)).abs().max().item<double>();
}

#define VLMGRAPH_REQUIRE_CUDA()                                  \
  do {                                                           \
    if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA"; \
  } while (0)

}  // namespace vlmgraph::testing
