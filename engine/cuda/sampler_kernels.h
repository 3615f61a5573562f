// engine/cuda/sampler_kernels.h: launchers of the sampler's kernels (sampler_kernels.cu). Plain
// pointers, no ATen; the checked ATen wrappers are NucleusPrefixCuda and GumbelMaxDrawCuda
// (engine/device.h), the formulas NucleusPrefix's and GumbelMaxDraw's (engine/sampler.h). Every
// pointer is device memory. Each launcher queues its kernels on `stream` and returns the first
// launch error.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace vlmgraph::cuda {

// Candidates per block of the draw's first pass; a row of C candidates takes ceil(C / kDrawChunk)
// blocks, whose winners the second pass reduces.
constexpr int64_t kDrawChunk = 2048;

struct SamplerArgs {
  const void* x;  // (rows, cols) float32, or bfloat16 when `bf16`
  bool bf16;
  const float* temperature;  // (rows) each
  const float* top_p;
  const int64_t* top_k;
  const int64_t* seed;
  const int64_t* draw;
  int64_t rows, cols;
};

// kept (rows) int64, one block per row.
cudaError_t LaunchNucleusPrefix(const SamplerArgs& args, int64_t* kept, cudaStream_t stream);

// ids (rows, cols) and kept (rows), or both nullptr; out (rows) int64. partial_scores /
// partial_ids: scratch of rows * ceil(cols / kDrawChunk) elements.
cudaError_t LaunchGumbelMaxDraw(const SamplerArgs& args, const int64_t* ids, const int64_t* kept,
                                float* partial_scores, int64_t* partial_ids, int64_t* out,
                                cudaStream_t stream);

}  // namespace vlmgraph::cuda
