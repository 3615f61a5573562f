// Fuzz target: safetensors files (base/safetensors.h: ReadSafetensors), header and data. Input:
// the file's bytes, handed to ReadSafetensors through a memfd (no disk writes). Expected error:
// SafetensorsError.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "base/safetensors.h"
#include "tests/fuzz/fuzz_util.h"

namespace {
int g_fd = -1;
}

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  at::set_num_threads(1);
  g_fd = memfd_create("fuzz_safetensors", 0);
  if (g_fd < 0) std::abort();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace vlmgraph;
  if (ftruncate(g_fd, 0) != 0 || pwrite(g_fd, data, size, 0) != static_cast<ssize_t>(size))
    std::abort();
  const std::string path = "/proc/self/fd/" + std::to_string(g_fd);
  fuzz::ExpectOnly<SafetensorsError>("safetensors", [&] {
    const SafetensorsFile f = ReadSafetensors(path);
    for (const auto& [name, t] : f.tensors) (void)t.sum();  // touches every byte read
  });
  return 0;
}
