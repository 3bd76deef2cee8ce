/* A fake CUDA driver (built as libcuda.so.1) for the LD_PRELOAD test: cuInit
 * succeeds, so the runtime backend opens; the rest only has to exist (the
 * loader resolves every entry point) and is never called. No cuda.h: only
 * the exported names matter here. */
int cuInit(unsigned int flags) {
  (void)flags;
  return 0; /* CUDA_SUCCESS */
}
int cuGetErrorName(int error, const char** name) {
  (void)error;
  *name = "CUDA_ERROR_NOT_SUPPORTED";
  return 0;
}
#define NOT_SUPPORTED(name) \
  int name(void) { return 801; /* CUDA_ERROR_NOT_SUPPORTED */ }
NOT_SUPPORTED(cuDeviceGet)
NOT_SUPPORTED(cuDeviceGetAttribute)
NOT_SUPPORTED(cuDevicePrimaryCtxRetain)
NOT_SUPPORTED(cuDevicePrimaryCtxRelease_v2)
NOT_SUPPORTED(cuCtxGetCurrent)
NOT_SUPPORTED(cuCtxSetCurrent)
NOT_SUPPORTED(cuCtxSynchronize)
NOT_SUPPORTED(cuMemGetInfo_v2)
NOT_SUPPORTED(cuMemAlloc_v2)
NOT_SUPPORTED(cuMemFree_v2)
NOT_SUPPORTED(cuMemAddressReserve)
NOT_SUPPORTED(cuMemAddressFree)
NOT_SUPPORTED(cuMemCreate)
NOT_SUPPORTED(cuMemRelease)
NOT_SUPPORTED(cuMemMap)
NOT_SUPPORTED(cuMemUnmap)
NOT_SUPPORTED(cuMemSetAccess)
NOT_SUPPORTED(cuMemGetAllocationGranularity)
NOT_SUPPORTED(cuEventCreate)
NOT_SUPPORTED(cuEventDestroy_v2)
NOT_SUPPORTED(cuEventRecord)
NOT_SUPPORTED(cuEventQuery)
NOT_SUPPORTED(cuEventSynchronize)
NOT_SUPPORTED(cuStreamSynchronize)
NOT_SUPPORTED(cuStreamCreate)
NOT_SUPPORTED(cuStreamDestroy_v2)
NOT_SUPPORTED(cuMemcpyDtoHAsync_v2)
NOT_SUPPORTED(cuMemcpyHtoDAsync_v2)
