/* Test control of the simulated CUDA device (exported by its libcuda.so.1;
 * from Python: ctypes.CDLL("libcuda.so.1")). */
#ifndef RESERVOIR_SIMCUDA_CONTROL_H
#define RESERVOIR_SIMCUDA_CONTROL_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

/* The `nth` use of `call` from now on fails (1: the next one). */
void reservoirSimCudaFailAt(const char* call, unsigned long long nth);
/* How many times `call` has been made (served or refused). */
unsigned long long reservoirSimCudaCalls(const char* call);
/* Events recorded from now on stay pending (1) until released, or
 * complete when recorded (0). */
void reservoirSimCudaHoldEvents(int held);
/* Completes every pending event. */
void reservoirSimCudaCompleteEvents(void);
/* Kernel launches succeed without running (1) or are refused (0). */
void reservoirSimCudaAllowKernels(int allow);
/* Bytes of device memory in use on `device` (cudaMalloc'd and physical). */
size_t reservoirSimCudaUsed(int device);
/* 1: this process's CUDA is the simulation. */
int reservoirSimCudaIsSimulated(void);

#ifdef __cplusplus
}
#endif

#endif
