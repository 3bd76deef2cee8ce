// The profiler's memory events (torch_profiler.hpp).
#include "torch_profiler.hpp"

#include <c10/core/Allocator.h>
#include <c10/core/Device.h>
#include <c10/util/Exception.h>

#include "torch_entry.hpp"

namespace reservoir_torch_hooks {
namespace {

struct Usage {
  unsigned long long block_size = 0;
  unsigned long long allocated = 0;
  unsigned long long reserved = 0;
};

Usage usage(void* ptr, int device, std::size_t request = 0) {
  Usage u;
  TORCH_CHECK(entry().usage(device, ptr, request, &u.block_size, &u.allocated, &u.reserved) == 0,
              "reservoir (PyTorch's allocator): the profiler's memory event: ", entry().error());
  return u;
}

c10::Device cuda(int device) { return {c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(device)}; }

}  // namespace

bool profiling_memory() { return c10::memoryProfilingEnabled(); }

void report_allocation(void* ptr, int device) {
  if (!profiling_memory()) return;
  const Usage u = usage(ptr, device);
  c10::reportMemoryUsageToProfiler(ptr, static_cast<std::int64_t>(u.block_size), u.allocated, u.reserved,
                                   cuda(device));
}

std::size_t block_size_to_report(void* ptr, int device) {
  if (!profiling_memory()) return 0;
  return usage(ptr, device).block_size;
}

void report_free(void* ptr, std::size_t block_size, int device) {
  if (block_size == 0 || !profiling_memory()) return;
  const Usage u = usage(nullptr, device);
  c10::reportMemoryUsageToProfiler(ptr, -static_cast<std::int64_t>(block_size), u.allocated, u.reserved,
                                   cuda(device));
}

void report_out_of_memory(std::size_t size, int device) {
  if (!profiling_memory()) return;
  const Usage u = usage(nullptr, device, size);  // the request rounded, as PyTorch's
  c10::reportOutOfMemoryToProfiler(static_cast<std::int64_t>(u.block_size), u.allocated, u.reserved,
                                   cuda(device));
}

}  // namespace reservoir_torch_hooks
