// A fake CUDA runtime (built as libcudart.so.13) for the LD_PRELOAD test:
// cudaMalloc hands out host memory and counts calls, so a program and the
// interposer can run without a GPU.
#include <cuda_runtime_api.h>

#include <cstdlib>
#include <mutex>
#include <set>

namespace {
std::mutex mutex;
std::set<void*> live;
int mallocs = 0;
int frees = 0;
int foreign_frees = 0;
}  // namespace

extern "C" {

int fake_cudart_mallocs() { return mallocs; }
int fake_cudart_frees() { return frees; }
int fake_cudart_foreign_frees() { return foreign_frees; }
// Memory the program gets without cudaMalloc (as from another allocator).
void* fake_cudart_raw_alloc(size_t size) {
  std::lock_guard lock(mutex);
  void* p = std::aligned_alloc(512, (size + 511) / 512 * 512);
  live.insert(p);
  return p;
}

cudaError_t cudaSetDevice(int d) { return d == 0 ? cudaSuccess : cudaErrorInvalidDevice; }
cudaError_t cudaGetDevice(int* d) {
  *d = 0;
  return cudaSuccess;
}
cudaError_t cudaGetLastError() { return cudaSuccess; }
const char* cudaGetErrorName(cudaError_t) { return "cudaError"; }
cudaError_t cudaMalloc(void** p, size_t size) {
  std::lock_guard lock(mutex);
  ++mallocs;
  *p = std::aligned_alloc(512, (size + 511) / 512 * 512);
  if (*p == nullptr) return cudaErrorMemoryAllocation;
  live.insert(*p);
  return cudaSuccess;
}
cudaError_t cudaFree(void* p) {
  std::lock_guard lock(mutex);
  if (p == nullptr) return cudaSuccess;
  if (live.erase(p) == 0) return cudaErrorInvalidValue;
  ++frees;
  std::free(p);
  return cudaSuccess;
}
cudaError_t cudaMallocAsync(void** p, size_t size, cudaStream_t) { return cudaMalloc(p, size); }
cudaError_t cudaFreeAsync(void* p, cudaStream_t) {
  {
    std::lock_guard lock(mutex);
    ++foreign_frees;
  }
  return cudaFree(p);
}
cudaError_t cudaMemGetInfo(size_t* free, size_t* total) {
  *free = size_t{1} << 30;
  *total = size_t{1} << 30;
  return cudaSuccess;
}
cudaError_t cudaEventCreateWithFlags(cudaEvent_t* e, unsigned int) {
  *e = reinterpret_cast<cudaEvent_t>(new int(0));
  return cudaSuccess;
}
cudaError_t cudaEventDestroy(cudaEvent_t e) {
  delete reinterpret_cast<int*>(e);
  return cudaSuccess;
}
cudaError_t cudaEventRecord(cudaEvent_t, cudaStream_t) { return cudaSuccess; }
cudaError_t cudaEventQuery(cudaEvent_t) { return cudaSuccess; }
cudaError_t cudaEventSynchronize(cudaEvent_t) { return cudaSuccess; }
cudaError_t cudaStreamSynchronize(cudaStream_t) { return cudaSuccess; }
cudaError_t cudaStreamCreateWithFlags(cudaStream_t* s, unsigned int) {
  *s = nullptr;
  return cudaErrorNotSupported;
}
cudaError_t cudaStreamDestroy(cudaStream_t) { return cudaErrorNotSupported; }
cudaError_t cudaDeviceSynchronize() { return cudaSuccess; }
cudaError_t cudaMemcpyAsync(void*, const void*, size_t, cudaMemcpyKind, cudaStream_t) {
  return cudaSuccess;
}

cudaError_t cudaHostAlloc(void** p, size_t size, unsigned int) {
  *p = std::aligned_alloc(4096, (size + 4095) / 4096 * 4096);
  return *p != nullptr ? cudaSuccess : cudaErrorMemoryAllocation;
}
cudaError_t cudaFreeHost(void* p) {
  std::free(p);
  return cudaSuccess;
}

}  // extern "C"
