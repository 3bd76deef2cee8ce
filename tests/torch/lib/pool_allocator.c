/* An allocator of its own for torch.cuda.MemPool(allocator=...) in the
 * tests, as a program's CUDAPluggableAllocator over cudaMalloc is: it takes
 * memory from the process's CUDA runtime (the simulated device's, found at
 * call time), counts its calls, logs them ("a SIZE" / "f SIZE", in order,
 * in `calls`), and runs out of memory past `limit` bytes held (-1: none). */
#include <dlfcn.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>

int alloc_calls = 0;
int free_calls = 0;
long long limit = -1;
long long held = 0;
char calls[65536];

typedef int (*cuda_malloc_fn)(void**, size_t);
typedef int (*cuda_free_fn)(void*);

static void note(char what, size_t size) {
  size_t used = strlen(calls);
  if (used + 32 < sizeof(calls)) snprintf(calls + used, sizeof(calls) - used, "%c %zu;", what, size);
}

__attribute__((visibility("default"))) void* pool_alloc(size_t size, int device, void* stream) {
  (void)device;
  (void)stream;
  ++alloc_calls;
  note('a', size);
  if (limit >= 0 && held + (long long)size > limit) return NULL;
  cuda_malloc_fn cuda_malloc = (cuda_malloc_fn)dlsym(RTLD_DEFAULT, "cudaMalloc");
  void* p = NULL;
  if (cuda_malloc == NULL || cuda_malloc(&p, size) != 0) return NULL;
  held += (long long)size;
  return p;
}

__attribute__((visibility("default"))) void pool_free(void* ptr, size_t size, int device, void* stream) {
  (void)device;
  (void)stream;
  ++free_calls;
  note('f', size);
  held -= (long long)size;
  cuda_free_fn cuda_free = (cuda_free_fn)dlsym(RTLD_DEFAULT, "cudaFree");
  if (cuda_free != NULL) cuda_free(ptr);
}
