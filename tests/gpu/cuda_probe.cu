// A plain CUDA program, as users write them: it allocates through the CUDA
// runtime (cudaMalloc, cudaMallocAsync, and cudaMallocPitch, which the
// interposer does not serve), fills each buffer with a kernel, reads it back,
// checks every byte and frees it. Built with `-cudart shared` so that
// libreservoir_preload.so can serve its calls. It prints one line whose
// checksum depends only on the data, so a run under the interposer must print
// the same line as a run without it.
//
// Exit status: 0 ok, 1 a check failed, 77 no CUDA device.
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <vector>

namespace {

__global__ void fill(std::uint32_t* p, std::size_t n, std::uint32_t seed) {
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    p[i] = static_cast<std::uint32_t>(i) * 2654435761u ^ seed;
  }
}

bool ok(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return true;
  std::printf("cuda_probe: %s failed: %s (%s)\n", what, cudaGetErrorName(e), cudaGetErrorString(e));
  return false;
}

// Fills `words` 32-bit words at p on `stream`, copies them back and checks
// them; adds them to the checksum.
bool fill_and_check(std::uint32_t* p, std::size_t words, std::uint32_t seed, cudaStream_t stream,
                    std::uint64_t* checksum) {
  fill<<<256, 256, 0, stream>>>(p, words, seed);
  if (!ok(cudaGetLastError(), "kernel launch")) return false;
  std::vector<std::uint32_t> host(words);
  if (!ok(cudaMemcpyAsync(host.data(), p, words * 4, cudaMemcpyDeviceToHost, stream), "cudaMemcpyAsync") ||
      !ok(cudaStreamSynchronize(stream), "cudaStreamSynchronize")) {
    return false;
  }
  for (std::size_t i = 0; i < words; ++i) {
    const std::uint32_t want = static_cast<std::uint32_t>(i) * 2654435761u ^ seed;
    if (host[i] != want) {
      std::printf("cuda_probe: word %zu of a %zu-byte buffer is %08x, expected %08x\n", i, words * 4,
                  host[i], want);
      return false;
    }
    *checksum = *checksum * 1099511628211ull ^ host[i];
  }
  return true;
}

}  // namespace

int main() {
  int devices = 0;
  const cudaError_t e = cudaGetDeviceCount(&devices);
  if (e != cudaSuccess || devices == 0) {
    std::printf("cuda_probe: no CUDA device: %s\n",
                e != cudaSuccess ? cudaGetErrorString(e) : "the runtime sees none");
    return 77;
  }
  std::uint64_t checksum = 14695981039346656037ull;
  unsigned calls = 0;
  // Sizes from a few bytes to 64 MiB, several of them live at once, freed in
  // an order other than their allocation's.
  const std::size_t sizes[] = {4, 4096, 500000, 1 << 20, 3 << 20, 25 << 20, 64 << 20};
  for (int round = 0; round < 3; ++round) {
    std::vector<std::uint32_t*> live;
    for (std::size_t k = 0; k < sizeof sizes / sizeof sizes[0]; ++k) {
      void* p = nullptr;
      if (!ok(cudaMalloc(&p, sizes[k]), "cudaMalloc")) return 1;
      ++calls;
      const auto seed = static_cast<std::uint32_t>(round * 97 + k);
      if (!fill_and_check(static_cast<std::uint32_t*>(p), sizes[k] / 4, seed, nullptr, &checksum)) {
        return 1;
      }
      live.push_back(static_cast<std::uint32_t*>(p));
    }
    for (std::size_t k = 0; k < live.size(); k += 2) {
      if (!ok(cudaFree(live[k]), "cudaFree")) return 1;
    }
    for (std::size_t k = 1; k < live.size(); k += 2) {
      if (!ok(cudaFree(live[k]), "cudaFree")) return 1;
    }
  }
  // Stream-ordered allocation on a stream of its own.
  cudaStream_t stream = nullptr;
  if (!ok(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate")) return 1;
  for (int i = 0; i < 10; ++i) {
    void* p = nullptr;
    if (!ok(cudaMallocAsync(&p, std::size_t{8} << 20, stream), "cudaMallocAsync")) return 1;
    ++calls;
    if (!fill_and_check(static_cast<std::uint32_t*>(p), (std::size_t{8} << 20) / 4,
                        static_cast<std::uint32_t>(1000 + i), stream, &checksum) ||
        !ok(cudaFreeAsync(p, stream), "cudaFreeAsync")) {
      return 1;
    }
  }
  if (!ok(cudaStreamSynchronize(stream), "cudaStreamSynchronize") ||
      !ok(cudaStreamDestroy(stream), "cudaStreamDestroy")) {
    return 1;
  }
  // Memory the interposer does not hand out: freed by the real cudaFree.
  void* pitched = nullptr;
  std::size_t pitch = 0;
  if (!ok(cudaMallocPitch(&pitched, &pitch, 1000, 64), "cudaMallocPitch")) return 1;
  if (!fill_and_check(static_cast<std::uint32_t*>(pitched), pitch * 64 / 4, 7, nullptr, &checksum) ||
      !ok(cudaFree(pitched), "cudaFree of cudaMallocPitch memory")) {
    return 1;
  }
  std::printf("cuda_probe: ok, %u allocations checked, checksum %016llx\n", calls,
              static_cast<unsigned long long>(checksum));
  return 0;
}
