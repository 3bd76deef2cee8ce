/* Loads the probe library (probe.c built with PROBE_AS_LIBRARY) with
 * RTLD_LOCAL, as Python loads extension modules, and runs it: the CUDA
 * runtime it links is then outside the global scope, where dlsym(RTLD_NEXT)
 * does not look. */
#include <dlfcn.h>
#include <stdio.h>

int main(int argc, char** argv) {
  if (argc != 2) {
    fprintf(stderr, "usage: %s LIBRARY\n", argv[0]);
    return 10;
  }
  void* lib = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
  if (lib == NULL) {
    fprintf(stderr, "%s\n", dlerror());
    return 11;
  }
  int (*probe_main)(void) = (int (*)(void))dlsym(lib, "probe_main");
  if (probe_main == NULL) {
    fprintf(stderr, "probe_main not found\n");
    return 12;
  }
  return probe_main();
}
