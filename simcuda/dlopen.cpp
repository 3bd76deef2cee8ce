// Libraries that open CUDA's runtime themselves get the simulated one,
// whatever path they find or name: vLLM's CudaRTLibrary (which opens the
// libcudart it finds mapped, by its path), CuPy, Numba and ctypes users.
// The simulated runtime is preloaded, so its dlopen comes before the C
// library's for every caller: a name whose file name is one of the
// libraries the simulation is (the driver, NVML, this runtime, and what
// the runtime loads with it: cuBLAS, cuBLASLt, CUPTI, cuDNN) opens the one
// already loaded under that soname instead of another copy from the path
// (the real runtime in PyTorch's wheel, the toolkit's, the driver's). Any
// other name, and a name of a family the simulation has not loaded (cuDNN
// beside the CUDA 12 runtime), is the C library's dlopen's.
//
// Both of glibc's versions of dlopen are defined (GLIBC_2.2.5, which older
// binaries bind, and GLIBC_2.34), each a version node of this library
// (dlopen.map), so that callers bound to either reach this one.
#include <dlfcn.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "sim.hpp"

namespace {

using Dlopen = void* (*)(const char*, int);

Dlopen libc_dlopen() {
  static const auto real = reinterpret_cast<Dlopen>(dlvsym(RTLD_NEXT, "dlopen", "GLIBC_2.34"));
  return real;
}

// The soname this runtime is (CUDA's major version: 13, 12 or 11.0).
#if defined(CUDART_VERSION) && CUDART_VERSION < 12000
constexpr const char* kRuntime = "libcudart.so.11.0";
constexpr const char* kRuntimeMajor = "libcudart.so.11.";
#elif defined(CUDART_VERSION) && CUDART_VERSION < 13000
constexpr const char* kRuntime = "libcudart.so.12";
constexpr const char* kRuntimeMajor = "libcudart.so.12";
#else
constexpr const char* kRuntime = "libcudart.so.13";
constexpr const char* kRuntimeMajor = "libcudart.so.13";
#endif

bool starts(const char* s, const char* prefix) {
  return std::strncmp(s, prefix, std::strlen(prefix)) == 0;
}

// The simulated library a file name is one of, by its soname; null for none.
// "libX.so" and "libX.so.N[.anything]" of the sonames' majors count.
const char* simulated(const char* file) {
  struct Family {
    const char* stem;    // "libcublas.so"
    const char* soname;  // what the simulation loaded it as
  };
  static const Family kFamilies[] = {
      {"libcuda.so", "libcuda.so.1"},      {"libnvidia-ml.so", "libnvidia-ml.so.1"},
      {"libcublas.so", "libcublas.so.13"}, {"libcublasLt.so", "libcublasLt.so.13"},
      {"libcupti.so", "libcupti.so.13"},   {"libcudnn.so", "libcudnn.so.9"},
  };
  const char* slash = std::strrchr(file, '/');
  const char* name = slash != nullptr ? slash + 1 : file;
  if (std::strcmp(name, "libcudart.so") == 0 || starts(name, kRuntimeMajor)) return kRuntime;
  for (const Family& f : kFamilies) {
    const std::size_t n = std::strlen(f.stem);
    if (std::strncmp(name, f.stem, n) != 0) continue;
    // The bare name, or a version; the driver's file is named by the
    // driver's release (libcuda.so.580.95.05): any version is it.
    const char* rest = name + n;
    if (*rest == '\0') return f.soname;
    if (*rest != '.') continue;
    if (std::strcmp(f.stem, "libcuda.so") == 0 || std::strcmp(f.stem, "libnvidia-ml.so") == 0)
      return f.soname;
    const char* major = f.soname + n;  // ".13"
    if (starts(rest, major) &&
        (rest[std::strlen(major)] == '\0' || rest[std::strlen(major)] == '.')) {
      return f.soname;
    }
  }
  return nullptr;
}

void* open_library(const char* file, int mode) {
  Dlopen real = libc_dlopen();
  if (real == nullptr) return nullptr;
  if (file != nullptr) {
    if (const char* soname = simulated(file)) {
      // Only the one loaded already: a family the simulation did not load
      // is opened as asked.
      if (void* loaded = real(soname, (mode & ~RTLD_NOW & ~RTLD_LAZY) | RTLD_NOLOAD | RTLD_LAZY)) {
        static const bool log = [] {
          const char* v = std::getenv("RESERVOIR_SIMCUDA_LOG");
          return v != nullptr && v[0] == '1';
        }();
        if (log && std::strcmp(file, soname) != 0) {
          std::fprintf(stderr, "reservoir simulated CUDA: dlopen(\"%s\") opens the simulated %s\n",
                       file, soname);
        }
        return loaded;
      }
    }
  }
  return real(file, mode);
}

}  // namespace

extern "C" {
SIMCUDA_API void* reservoir_simcuda_dlopen(const char* file, int mode) {
  return open_library(file, mode);
}
SIMCUDA_API void* reservoir_simcuda_dlopen_old(const char* file, int mode) {
  return open_library(file, mode);
}
}
__asm__(".symver reservoir_simcuda_dlopen_old,dlopen@GLIBC_2.2.5");
__asm__(".symver reservoir_simcuda_dlopen,dlopen@@GLIBC_2.34");
