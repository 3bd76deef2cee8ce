// PyTorch's allocator types as each release names them, and the small
// conversions between reservoir's answers (JSON from its entry points) and
// them, shared by the files of reservoir's own CUDAAllocator
// (torch_allocator.hpp). Internal to the per-release libraries.
#pragma once

#if __has_include(<c10/core/AllocatorConfig.h>)
#include <c10/core/AllocatorConfig.h>
#endif
#include <c10/core/CachingDeviceAllocator.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/util/Exception.h>

#include <nlohmann/json.hpp>

#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>

#include "torch_entry.hpp"
#include "torch_releases.hpp"

namespace reservoir_torch_hooks {

using c10::cuda::CUDACachingAllocator::CUDAAllocator;
namespace cca = c10::cuda::CUDACachingAllocator;
#if RESERVOIR_TORCH_C10_MEMPOOL_ID
using MempoolId = c10::MempoolId_t;
#else
using MempoolId = c10::cuda::MempoolId_t;
#endif
#if RESERVOIR_TORCH_DEVICE_TRACE_TYPES
namespace trace_types = c10::CachingDeviceAllocator;
#else
namespace trace_types = c10::cuda::CUDACachingAllocator;
#endif

// The default pools' id.
inline constexpr MempoolId kDefaultPools{0, 0};

// A stream as the snapshot's types hold it (void* from 2.11, cudaStream_t before).
using TraceStream = decltype(trace_types::TraceEntry::stream_);
template <class T>
TraceStream trace_stream(T stream) {
  if constexpr (std::is_integral_v<T>) {
    return reinterpret_cast<TraceStream>(static_cast<std::uintptr_t>(stream));
  } else if constexpr (std::is_null_pointer_v<T>) {
    return nullptr;
  } else {
    return reinterpret_cast<TraceStream>(stream);
  }
}

// A trace entry (with its user metadata from 2.10).
template <class Stream>
trace_types::TraceEntry trace_entry(trace_types::TraceEntry::Action action, int device,
                                    std::size_t addr, std::size_t size, Stream stream,
                                    std::shared_ptr<c10::GatheredContext> context,
                                    std::string compile_context, std::string user_metadata) {
  // clang-format off: one initializer per release's TraceEntry
#if RESERVOIR_TORCH_USER_METADATA
  return {action, static_cast<c10::DeviceIndex>(device), addr, size, trace_stream(stream), {0, 0}, 0,
          std::move(context), std::move(compile_context), std::move(user_metadata)};
#elif RESERVOIR_TORCH_COMPILE_CONTEXT
  (void)user_metadata;
  return {action, static_cast<c10::DeviceIndex>(device), addr, size, trace_stream(stream), {0, 0}, 0,
          std::move(context), std::move(compile_context)};
#else
  (void)user_metadata, (void)compile_context;
  return {action, static_cast<c10::DeviceIndex>(device), addr, size, trace_stream(stream), 0,
          std::move(context)};
#endif
  // clang-format on
}

// The pool a segment of reservoir's snapshot JSON belongs to (kDefaultPools: the default pools).
inline MempoolId pool_of(const nlohmann::json& segment) {
  return {segment["pool"][0].get<unsigned long long>(),
          segment["pool"][1].get<unsigned long long>()};
}

// A JSON answer of reservoir's (freed here); PyTorch's error with reservoir's
// reason when there is none.
inline nlohmann::json parsed(char* text, const char* method) {
  TORCH_CHECK(text != nullptr, "reservoir (PyTorch's allocator): ", method, ": ", entry().error());
  nlohmann::json j = nlohmann::json::parse(text);
  std::free(text);
  return j;
}

// reservoir's segments and history of a device, as JSON.
inline nlohmann::json state_of(int device) {
  return parsed(entry().snapshot_json(device), "snapshot");
}

}  // namespace reservoir_torch_hooks
