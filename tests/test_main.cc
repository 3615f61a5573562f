// GoogleTest main for vlmgraph: tests whose name ends in `_CUDA` need a GPU; without one they are
// filtered out here (and skip themselves when run by name), so CPU CI runs everything else.
#include <gtest/gtest.h>
#include <torch/cuda.h>

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  if (!torch::cuda::is_available()) {
    std::string filter = ::testing::GTEST_FLAG(filter);
    const bool has_negative = filter.find('-') != std::string::npos;
    filter += has_negative ? ":*_CUDA*" : "-*_CUDA*";
    ::testing::GTEST_FLAG(filter) = filter;
    std::printf("vlmgraph tests: no CUDA device, skipping *_CUDA tests\n");
  }
  return RUN_ALL_TESTS();
}
