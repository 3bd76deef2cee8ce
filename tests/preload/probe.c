/* A plain CUDA program: cudaMalloc/cudaFree in a loop, a pointer from
 * elsewhere freed with cudaFree, cudaFreeAsync. Prints what the (fake)
 * runtime saw, so the test can tell whether reservoir served the calls.
 * Built with PROBE_AS_LIBRARY it is a shared library whose probe_main
 * probe_loader.c calls after loading it with RTLD_LOCAL, so that the runtime
 * is outside the global scope, as in a Python extension module. */
#include <cuda_runtime_api.h>
#include <stdio.h>
#include <string.h>

int fake_cudart_mallocs(void);
int fake_cudart_frees(void);
int fake_cudart_foreign_frees(void);
void* fake_cudart_raw_alloc(size_t size);

#ifdef PROBE_AS_LIBRARY
int probe_main(void);
#define PROBE_MAIN probe_main
#else
#define PROBE_MAIN main
#endif

int PROBE_MAIN(void) {
  void* first = NULL;
  int reused = 0;
  for (int i = 0; i < 100; ++i) {
    void* p = NULL;
    if (cudaMalloc(&p, 4096 + (size_t)i) != cudaSuccess || p == NULL) return 2;
    memset(p, 0x5a, 4096); /* the fake's device memory is host memory */
    if (i == 0) first = p;
    reused += p == first;
    if (cudaFree(p) != cudaSuccess) return 3;
  }
  void* big = NULL;
  if (cudaMalloc(&big, (size_t)64 << 20) != cudaSuccess) return 4;
  if (cudaFreeAsync(big, (cudaStream_t)0) != cudaSuccess) return 5;
  void* foreign = fake_cudart_raw_alloc(1000);
  if (cudaFree(foreign) != cudaSuccess) return 6; /* not reservoir's: the real cudaFree */
  if (cudaFree(NULL) != cudaSuccess) return 7;
  void* bad = (void*)0x1234;
  if (cudaFree(bad) == cudaSuccess) return 8; /* neither's: the real cudaFree's error */
  printf("mallocs=%d frees=%d foreign_frees=%d reused=%d\n", fake_cudart_mallocs(),
         fake_cudart_frees(), fake_cudart_foreign_frees(), reused);
  return 0;
}
