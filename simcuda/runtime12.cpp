// What the simulated runtime serves only as CUDA 12's libcudart.so.12 and
// 11's libcudart.so.11.0 (built against their headers, for the PyTorch
// releases built with them): the calls CUDA 13 renamed or dropped, each in
// terms of the call that replaced it. The rest of the runtime is the same
// source as 13's (SIMCUDA_12_NAME in sim.hpp names what 12 suffixes; what
// 11 calls differently is under CUDART_VERSION < 12000 there).
#include <cuda_runtime_api.h>

#include "sim.hpp"

#if CUDART_VERSION >= 13000
#error "runtime12.cpp is built against CUDA 12's or 11's headers only"
#endif

extern "C" {

#if CUDART_VERSION >= 12000
// 12's default capture query: 13's without the edges.
SIMCUDA_API cudaError_t cudaStreamGetCaptureInfo_v2(cudaStream_t s, cudaStreamCaptureStatus* status,
                                                    unsigned long long* id, cudaGraph_t* graph,
                                                    const cudaGraphNode_t** deps, size_t* count) {
  return cudaStreamGetCaptureInfo_v3(s, status, id, graph, deps, nullptr, count);
}
SIMCUDA_API cudaError_t cudaStreamGetCaptureInfo_v2_ptsz(cudaStream_t s, cudaStreamCaptureStatus* status,
                                                         unsigned long long* id, cudaGraph_t* graph,
                                                         const cudaGraphNode_t** deps, size_t* count) {
  return cudaStreamGetCaptureInfo_v3(s, status, id, graph, deps, nullptr, count);
}
// 12.8's name for the elapsed time that 13 keeps unsuffixed.
SIMCUDA_API cudaError_t cudaEventElapsedTime_v2(float* ms, cudaEvent_t start, cudaEvent_t end) {
  return cudaEventElapsedTime(ms, start, end);
}
#endif
// CUDA 11 and 12 still export the thread calls 10.0 deprecated; the device calls
// replaced them.
SIMCUDA_API cudaError_t cudaThreadSynchronize() { return cudaDeviceSynchronize(); }

}  // extern "C"
