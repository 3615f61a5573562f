// bench/pdl_chain_bench.cu: what one dependent kernel costs in a chain, the floor under the
// decode step's 5 kernels per decoder block (figures and what they mean in
// docs/design/decode-kernels.md, "The cost of a dependent kernel").
//
//   vlmgraph-pdl-chain-bench        (needs compute capability 9.0; plain CUDA, no LibTorch)
//
// A CUDA graph of 64 kernels, each reading the whole vector (up to 1024 floats) the previous one
// wrote, reducing it over the block and writing 8 values per block, as a decode GEMV stages its
// input, reduces and writes its columns, with almost no work of its own. Per kernel, median graph
// time / 64 over 20 replays after 3 warm-up ones, for 120, 200 and 640 blocks of 256 threads
// (nanovlm-460m's out / qkv / gate-up GEMV grids), and four ways of chaining:
// - pdl wait: programmatic dependent launch, griddepcontrol.wait before reading, the next kernel
//   allowed to launch after the input is staged (what the decode kernels do);
// - no pdl: plain stream order;
// - counter: every kernel allows the next one to launch at once; its blocks wait on a counter
//   that each block of the previous kernel increments (release / acquire) when it has written;
// - flags: the same with one flag per block of the previous kernel, polled by one warp.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define CHECK_CUDA(x)                                                       \
  do {                                                                      \
    cudaError_t e = (x);                                                    \
    if (e != cudaSuccess) {                                                 \
      std::printf("%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e)); \
      std::exit(1);                                                         \
    }                                                                       \
  } while (0)

namespace {

constexpr int kThreads = 256;
enum Mode : int { kPdlWait = 0, kNoPdl = 1, kCounter = 2, kFlags = 3 };

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
__device__ __forceinline__ void Wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
__device__ __forceinline__ void Trigger() {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}
__device__ __forceinline__ int LoadAcquire(const int* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void AddRelease(int* p, int v) {
  asm volatile("red.release.gpu.global.add.s32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ void StoreRelease(int* p, int v) {
  asm volatile("st.release.gpu.global.b32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
#else  // not built for sm_90: the bench refuses to run there
__device__ __forceinline__ void Wait() {}
__device__ __forceinline__ void Trigger() {}
__device__ __forceinline__ int LoadAcquire(const int* p) { return *p; }
__device__ __forceinline__ void AddRelease(int* p, int v) { atomicAdd(p, v); }
__device__ __forceinline__ void StoreRelease(int* p, int v) { *p = v; }
#endif

template <int kMode>
__global__ void __launch_bounds__(kThreads)
    StepKernel(const float* __restrict__ in, float* __restrict__ out, int n, const int* prev,
               int* cur, int prev_blocks) {
  __shared__ float red[kThreads / 32];
  __shared__ float xs[1024];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (kMode == kCounter || kMode == kFlags) Trigger();
  if (kMode == kPdlWait) Wait();
  if (kMode == kCounter) {
    if (prev && threadIdx.x == 0) {
      while (LoadAcquire(prev) < prev_blocks) {
      }
    }
    __syncthreads();
  }
  if (kMode == kFlags) {
    if (prev && warp == 0) {
      bool done;
      do {
        bool ok = true;
        for (int b = lane; b < prev_blocks; b += 32) ok &= LoadAcquire(prev + b) != 0;
        done = __all_sync(0xffffffffu, ok);
      } while (!done);
    }
    __syncthreads();
  }
  float s = 0.f;
  for (int i = threadIdx.x; i < n / 4; i += kThreads) {
    const float4 v = __ldcg(reinterpret_cast<const float4*>(in) + i);
    reinterpret_cast<float4*>(xs)[i] = v;
    s += v.x + v.y + v.z + v.w;
  }
  for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
  if (lane == 0) red[warp] = s;
  __syncthreads();
  if (kMode == kPdlWait) Trigger();
  float total = 0.f;
  for (int w = 0; w < kThreads / 32; ++w) total += red[w];
  const int col = blockIdx.x * 8 + warp;
  float d = xs[(col * 7) % n] * 0.5f;
  for (int o = 16; o > 0; o >>= 1) d += __shfl_xor_sync(0xffffffffu, d, o);
  if (lane == 0 && col < n) out[col] = total * 1e-6f + d * 1e-3f + 1.f;
  if (kMode == kCounter || kMode == kFlags) {
    __syncthreads();
    if (threadIdx.x == 0) {
      __threadfence();
      if (kMode == kCounter) {
        AddRelease(cur, 1);
      } else {
        StoreRelease(cur + blockIdx.x, 1);
      }
    }
  }
}

}  // namespace

int main() {
  int major = 0;
  CHECK_CUDA(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0));
  if (major < 9) {
    std::printf("needs compute capability 9.0 or newer (programmatic dependent launch)\n");
    return 1;
  }
  constexpr int kKernels = 64, kReps = 20, kMaxBlocks = 1024;
  float *a = nullptr, *b = nullptr;
  int* sync = nullptr;
  CHECK_CUDA(cudaMalloc(&a, 1 << 20));
  CHECK_CUDA(cudaMalloc(&b, 1 << 20));
  CHECK_CUDA(cudaMemset(a, 0, 1 << 20));
  CHECK_CUDA(cudaMemset(b, 0, 1 << 20));
  CHECK_CUDA(cudaMalloc(&sync, sizeof(int) * kKernels * kMaxBlocks));
  cudaStream_t stream;
  CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const char* names[] = {"pdl wait", "no pdl", "counter", "flags"};
  for (int mode = kPdlWait; mode <= kFlags; ++mode) {
    for (int blocks : {120, 200, 640}) {
      const int n = std::min(blocks * 8, 1024);
      cudaGraph_t graph;
      cudaGraphExec_t exec;
      CHECK_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
      CHECK_CUDA(cudaMemsetAsync(sync, 0, sizeof(int) * kKernels * kMaxBlocks, stream));
      for (int i = 0; i < kKernels; ++i) {
        cudaLaunchConfig_t config = {};
        config.gridDim = dim3(blocks);
        config.blockDim = dim3(kThreads);
        config.stream = stream;
        cudaLaunchAttribute attribute;
        attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
        attribute.val.programmaticStreamSerializationAllowed = 1;
        config.attrs = &attribute;
        config.numAttrs = mode == kNoPdl || i == 0 ? 0 : 1;
        const float* in = (i & 1) ? b : a;
        float* out = (i & 1) ? a : b;
        const int stride = mode == kFlags ? kMaxBlocks : 1;
        const int* prev = i == 0 ? nullptr : sync + (i - 1) * stride;
        int* cur = sync + i * stride;
        if (mode <= kNoPdl) {
          CHECK_CUDA(
              cudaLaunchKernelEx(&config, StepKernel<kPdlWait>, in, out, n, prev, cur, blocks));
        } else if (mode == kCounter) {
          CHECK_CUDA(
              cudaLaunchKernelEx(&config, StepKernel<kCounter>, in, out, n, prev, cur, blocks));
        } else {
          CHECK_CUDA(
              cudaLaunchKernelEx(&config, StepKernel<kFlags>, in, out, n, prev, cur, blocks));
        }
      }
      CHECK_CUDA(cudaStreamEndCapture(stream, &graph));
      CHECK_CUDA(cudaGraphInstantiate(&exec, graph, 0));
      for (int r = 0; r < 3; ++r) CHECK_CUDA(cudaGraphLaunch(exec, stream));
      CHECK_CUDA(cudaStreamSynchronize(stream));
      cudaEvent_t start, stop;
      CHECK_CUDA(cudaEventCreate(&start));
      CHECK_CUDA(cudaEventCreate(&stop));
      std::vector<float> ms;
      for (int r = 0; r < kReps; ++r) {
        CHECK_CUDA(cudaEventRecord(start, stream));
        CHECK_CUDA(cudaGraphLaunch(exec, stream));
        CHECK_CUDA(cudaEventRecord(stop, stream));
        CHECK_CUDA(cudaEventSynchronize(stop));
        float t = 0.f;
        CHECK_CUDA(cudaEventElapsedTime(&t, start, stop));
        ms.push_back(t);
      }
      std::sort(ms.begin(), ms.end());
      std::printf("%-8s %4d blocks: %.3f us per kernel\n", names[mode], blocks,
                  ms[kReps / 2] * 1000.f / kKernels);
      CHECK_CUDA(cudaEventDestroy(start));
      CHECK_CUDA(cudaEventDestroy(stop));
      CHECK_CUDA(cudaGraphExecDestroy(exec));
      CHECK_CUDA(cudaGraphDestroy(graph));
    }
  }
  return 0;
}
