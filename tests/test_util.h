// tests/test_util.h: shared helpers for the vlmgraph test suites.
#pragma once

#include <ATen/ATen.h>
#include <dirent.h>
#include <gtest/gtest.h>
#include <torch/cuda.h>
#include <unistd.h>

#include <string>

#include "base/safetensors.h"

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

// Removes `dir` and the files and symbolic links in it (not subdirectories), if it exists. Not
// std::filesystem::remove_all: the pip LibTorch exports an incompatible copy of it, which crashes
// on a directory holding symbolic links.
inline void RemoveFlatDirectory(const std::string& dir) {
  if (DIR* d = ::opendir(dir.c_str())) {
    while (const dirent* entry = ::readdir(d)) {
      const std::string name = entry->d_name;
      if (name != "." && name != "..") ::unlink((dir + "/" + name).c_str());
    }
    ::closedir(d);
  }
  ::rmdir(dir.c_str());
}

inline double MaxAbsDiff(const at::Tensor& a, const at::Tensor& b) {
  return (a.to(at::kCPU, at::kDouble) - b.to(at::kCPU, at::kDouble)).abs().max().item<double>();
}

#define VLMGRAPH_REQUIRE_CUDA()                                  \
  do {                                                           \
    if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA"; \
  } while (0)

}  // namespace vlmgraph::testing
