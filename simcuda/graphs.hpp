// Stream capture and CUDA graphs of the simulated runtime (graphs.cpp).
//
// A stream that captures does not run the work queued on it: each copy,
// memset, kernel, host function, event record and graph launch becomes a
// node of the capture's graph, depending on the nodes the stream's work
// depended on last (as CUDA builds it). Other streams join a capture by
// waiting on an event recorded in it, and must be joined back before it
// ends. An executable graph runs its nodes in order when launched, each as
// the eager call would (copies and memsets through the device's reach
// check, kernels as RESERVOIR_SIMCUDA_KERNELS says).
//
// What CUDA refuses while a capture is under way is refused here with
// CUDA's codes, and the capture is invalidated as CUDA does it: its later
// work answers cudaErrorStreamCaptureInvalidated and its end gives no graph.
// A "potentially unsafe" call (cudaMalloc, cudaFree, cudaFreeHost, the
// synchronous cudaMemcpy and cudaMemset, cudaEventQuery and
// cudaEventSynchronize, a stream's synchronize or query) is judged by the
// calling thread's capture interaction mode (cudaThreadExchangeStreamCaptureMode):
// global: refused while this thread has a capture begun in global or
// thread-local mode or any thread has one begun in global mode;
// thread-local: refused while this thread has such a capture; relaxed: never.
#pragma once

#include <cuda_runtime_api.h>

namespace reservoir::simcuda::capture {

// Returned by the capture_* calls when the stream does not capture: the
// caller does the work now.
constexpr int kNotCapturing = -1;

// Work queued on stream `s`: a node of its capture (kSuccess), an error
// of the capture, or kNotCapturing.
int capture_kernel(cudaStream_t s, const void* function, double ms);
int capture_copy(cudaStream_t s, void* dst, const void* src, size_t count);
int capture_copy_2d(cudaStream_t s, void* dst, size_t dpitch, const void* src, size_t spitch, size_t width,
                    size_t height);
int capture_fill(cudaStream_t s, void* ptr, int value, size_t count);
int capture_host(cudaStream_t s, cudaHostFn_t fn, void* data);
// An event recorded in a capturing stream remembers the work it follows
// (its capture and nodes); recorded elsewhere it forgets it (and
// kNotCapturing is returned: record it on the device).
int capture_record(cudaEvent_t e, cudaStream_t s);
// A stream waiting on an event recorded in a capture joins that capture
// (or, already in it, depends on the event's nodes too).
int capture_wait(cudaStream_t s, cudaEvent_t e);
// Stream-ordered allocation is not served during a capture (no memory
// nodes): kNotSupported naming the call, after invalidating the capture.
int capture_refuses(cudaStream_t s, const char* call);

// Calls CUDA restricts while captures are under way: kSuccess when the
// call may go on, else its error (the captures concerned invalidated).
int unsafe_call();                           // by the thread's interaction mode
int stream_sync(cudaStream_t s, int device); // synchronize or query of a stream
int device_sync(int device);                 // cudaDeviceSynchronize
int event_sync(cudaEvent_t e);               // cudaEventQuery, cudaEventSynchronize
// Work on the legacy default stream while a blocking stream of `device`
// captures: cudaErrorStreamCaptureImplicit.
int legacy_use(cudaStream_t s, int device);

void forget_stream(cudaStream_t s);
void forget_event(cudaEvent_t e);

}  // namespace reservoir::simcuda::capture
