// The simulated device's CUPTI (libcupti.so.13): a profiling interface that
// says there is no GPU activity to trace, as CUPTI does on a device it
// cannot profile. PyTorch's profiler (Kineto) binds to libcupti.so.13 by
// soname; the real one, with no driver of its own underneath, asks the
// driver for its private export tables (cuGetExportTable, which no
// simulation can serve) and, in CUPTI 13.2 (PyTorch 2.15's), recurses on
// the refusal until the stack overflows, so `torch.profiler.profile()` with
// its default activities killed the process. The runtime loads this one with
// itself, so PyTorch binds to it instead: cuptiGetVersion answers, result
// codes have their names, and every other call (cuptiSubscribe first) is
// refused with CUPTI_ERROR_NOT_SUPPORTED, which Kineto reports ("CUPTI
// initialization failed - CUDA profiler activities will be missing") before
// profiling the CPU side and the allocator's memory events, which need no
// CUPTI. Every name the real library exports exists (gen_stubs.py:
// exports/cupti.txt), each a refusal.
#include <atomic>
#include <cstdint>
#include <cstdio>

#define SIMCUPTI_API extern "C" __attribute__((visibility("default")))

namespace {

// CUptiResult's values (cupti_result.h) that this library gives or names.
constexpr int kSuccess = 0;
constexpr int kInvalidParameter = 1;
constexpr int kNotInitialized = 15;
constexpr int kNotSupported = 27;
constexpr int kInsufficientPrivileges = 35;
constexpr int kUnknown = 999;

// CUDA 13.0's CUPTI (CUPTI_API_VERSION of its headers), the toolkit the
// simulated runtime is built against.
constexpr std::uint32_t kApiVersion = 130001;

std::atomic<bool> told{false};

}  // namespace

// Every exported name without a definition here is a stub that calls this.
SIMCUPTI_API int reservoir_simcupti_refuse(const char* name) {
  if (!told.exchange(true)) {
    std::fprintf(stderr,
                 "reservoir simulated CUDA: CUPTI is not served by the simulated device (%s): "
                 "a profiler records no GPU activity\n",
                 name);
  }
  return kNotSupported;
}

SIMCUPTI_API int cuptiGetVersion(std::uint32_t* version) {
  if (version == nullptr) return kInvalidParameter;
  *version = kApiVersion;
  return kSuccess;
}

SIMCUPTI_API int cuptiGetResultString(int result, const char** text) {
  if (text == nullptr) return kInvalidParameter;
  switch (result) {
    case kSuccess: *text = "CUPTI_SUCCESS"; break;
    case kInvalidParameter: *text = "CUPTI_ERROR_INVALID_PARAMETER"; break;
    case kNotInitialized: *text = "CUPTI_ERROR_NOT_INITIALIZED"; break;
    case kNotSupported:
      *text = "CUPTI_ERROR_NOT_SUPPORTED (reservoir's simulated CUDA device traces no GPU activity)";
      break;
    case kInsufficientPrivileges: *text = "CUPTI_ERROR_INSUFFICIENT_PRIVILEGES"; break;
    default: *text = "CUPTI_ERROR_UNKNOWN"; return result == kUnknown ? kSuccess : kInvalidParameter;
  }
  return kSuccess;
}
