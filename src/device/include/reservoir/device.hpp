// The device contract: the only portability layer of reservoir.
//
// Every backend (SimDevice, HostDevice, and the CUDA backends) implements this
// small set of primitive operations. Operations return a Status and never
// throw; the allocator turns failures into exceptions with context.
//
// Glossary
//   segment   memory obtained whole from the device (cudaMalloc/cudaFree).
//   reservation  a range of virtual addresses with no memory behind it.
//   physical  a handle to physical memory that can be mapped into a
//             reservation (cuMemCreate).
//   stream    an ordered queue of device work; 0 is the default stream.
//   event     a marker recorded on a stream; it completes when the work
//             queued before it completes.
//   capture   a stream recording its work into a CUDA graph instead of
//             running it; the graph's nodes are what the work became.
//
// Thread safety: every backend is safe to call from several threads at once.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>
#include <vector>

#include "reservoir/status.hpp"

namespace reservoir {

struct MemoryInfo {
  std::size_t free = 0;
  std::size_t total = 0;
};

// A process using the device and the device memory it holds (NVML's
// nvmlDeviceGetComputeRunningProcesses: allocations, the CUDA context, any
// library's memory).
struct ProcessMemory {
  unsigned int pid = 0;
  std::uint64_t used = 0;
};

// A node of a CUDA graph being captured (cudaGraphNode_t), and what a
// capturing stream's next work would depend on (Device::capture_frontier).
using GraphNode = std::uintptr_t;
struct CaptureFrontier {
  std::uint64_t id = 0;  // the capture's id; 0: the stream does not capture
  std::vector<GraphNode> nodes;
};

class Device {
 public:
  virtual ~Device() = default;

  // A short name for messages ("sim", "host", "cuda-runtime", "cuda-vmm").
  virtual std::string_view name() const noexcept = 0;

  // ---- classic segments ---------------------------------------------------
  // allocate_segment: bytes > 0. On ok, *addr is aligned to at least 512 bytes
  // and the range [*addr, *addr + bytes) overlaps no other live memory of this
  // device. out_of_memory when the device cannot hold bytes more.
  virtual Status allocate_segment(std::size_t bytes, DevicePtr* addr) noexcept = 0;
  // allocate_segment_on: the same, for a request made on `stream`. A device
  // whose allocation call CUDA refuses while that stream captures a graph
  // (cudaMalloc, in the global and thread-local capture modes) makes it in
  // the relaxed mode then, as PyTorch's allocator does: the graph's private
  // pool gets the memory and the capture goes on. Others ignore the stream.
  virtual Status allocate_segment_on(std::size_t bytes, StreamId stream, DevicePtr* addr) noexcept {
    (void)stream;
    return allocate_segment(bytes, addr);
  }
  // free_segment: addr was returned by allocate_segment and not freed since.
  virtual Status free_segment(DevicePtr addr) noexcept = 0;

  // ---- virtual memory (optional capability) -------------------------------
  virtual bool supports_virtual_memory() const noexcept = 0;
  // The size and alignment unit of physical memory and of mappings.
  virtual std::size_t granularity() const noexcept = 0;
  // reserve: bytes > 0 and a multiple of granularity(); alignment is 0 or a
  // power of two. Reserves address space only: nothing is accessible.
  virtual Status reserve(std::size_t bytes, std::size_t alignment, DevicePtr* va) noexcept = 0;
  // unreserve: [va, va + bytes) is exactly one reservation with no mapping left.
  virtual Status unreserve(DevicePtr va, std::size_t bytes) noexcept = 0;
  // create_physical: bytes > 0 and a multiple of granularity(). Counts against
  // the device's capacity; out_of_memory when it does not fit.
  virtual Status create_physical(std::size_t bytes, PhysicalHandle* handle) noexcept = 0;
  // release_physical: handle is live. Memory is returned once no mapping of
  // the handle remains (as with cuMemRelease).
  virtual Status release_physical(PhysicalHandle handle) noexcept = 0;
  // map: va and bytes are multiples of granularity(), [va, va + bytes) lies in
  // one reservation and is not mapped (else invalid_argument); offset is 0
  // and bytes <= size of handle (else not_supported, as CUDA's cuMemMap:
  // a handle is mapped from its start, never from a page inside it).
  virtual Status map(DevicePtr va, std::size_t bytes, PhysicalHandle handle,
                     std::size_t offset) noexcept = 0;
  // unmap: [va, va + bytes) is the union of whole earlier mappings.
  virtual Status unmap(DevicePtr va, std::size_t bytes) noexcept = 0;
  // set_access: [va, va + bytes) is mapped; makes it readable and writable.
  virtual Status set_access(DevicePtr va, std::size_t bytes) noexcept = 0;

  // ---- information --------------------------------------------------------
  virtual Status memory_info(MemoryInfo* info) noexcept = 0;
  // Optional: the processes using the device, as NVML lists them (PyTorch's
  // out-of-memory message names each). Backends that cannot tell keep the
  // default, not_supported, and the message leaves the sentence out.
  virtual Status running_processes(std::vector<ProcessMemory>* /*out*/) noexcept {
    return Status::not_supported;
  }

  // ---- streams and events -------------------------------------------------
  virtual Status create_event(EventId* event) noexcept = 0;
  // destroy_event: event is live and not needed by any pending query.
  virtual Status destroy_event(EventId event) noexcept = 0;
  // record_event: event is live; (re)records it on stream.
  virtual Status record_event(EventId event, StreamId stream) noexcept = 0;
  // query_event: ok when completed, not_ready when not yet.
  virtual Status query_event(EventId event) noexcept = 0;
  virtual Status synchronize_event(EventId event) noexcept = 0;
  virtual Status synchronize_stream(StreamId stream) noexcept = 0;
  virtual Status synchronize_device() noexcept = 0;
  // Optional: a new stream that does not synchronize with stream 0 (for
  // overlapped copies). Backends without streams of their own keep the
  // default, not_supported, and callers use stream 0.
  virtual Status create_stream(StreamId* /*stream*/) noexcept { return Status::not_supported; }
  // destroy_stream: stream came from create_stream; work queued on it completes first.
  virtual Status destroy_stream(StreamId /*stream*/) noexcept { return Status::not_supported; }

  // ---- stream capture (optional) -----------------------------------------
  // The CUDA graph capture `stream` takes part in (cudaStreamGetCaptureInfo):
  // its id (0 when the stream does not capture) and the nodes the next work
  // queued on the stream would depend on. Backends without capture keep the
  // default: nothing captures. An invalidated capture is a device_error.
  virtual Status capture_frontier(StreamId /*stream*/, CaptureFrontier* out) noexcept {
    out->id = 0;
    out->nodes.clear();
    return Status::ok;
  }
  // The nodes a node of a capture's graph depends on
  // (cudaGraphNodeGetDependencies), into *out.
  virtual Status node_dependencies(GraphNode /*node*/, std::vector<GraphNode>* out) noexcept {
    out->clear();
    return Status::not_supported;
  }

  // ---- copies (for backup) ------------------------------------------------
  // Ranges lie inside live, accessible device memory; ordered on stream.
  virtual Status copy_to_host(void* dst, DevicePtr src, std::size_t bytes,
                              StreamId stream) noexcept = 0;
  virtual Status copy_to_device(DevicePtr dst, const void* src, std::size_t bytes,
                                StreamId stream) noexcept = 0;
};

}  // namespace reservoir
