// PyTorch's profiler's memory events under reservoir's own allocator: with
// torch.profiler.profile(profile_memory=True) on the thread, every
// allocation and free reports the block's size (negative for a free) and the
// device's allocated and reserved bytes after it, and a failed request its
// size and the totals, as PyTorch's allocator reports them
// (c10::reportMemoryUsageToProfiler, reportOutOfMemoryToProfiler), so the
// profiler's memory columns, its memory timeline and export_memory_timeline
// see reservoir's allocations. Nothing is asked of reservoir while the
// profiler does not record memory. Internal to the per-release libraries.
#pragma once

#include <cstddef>
#include <cstdint>

namespace reservoir_torch_hooks {

// Whether the profiler records memory on this thread now.
bool profiling_memory();
// An allocation at ptr, just made.
void report_allocation(void* ptr, int device);
// The size of the live block at ptr, asked before it is freed (0 when the
// profiler does not record memory), and the free reported after it.
std::size_t block_size_to_report(void* ptr, int device);
void report_free(void* ptr, std::size_t block_size, int device);
// A request of `size` bytes the device could not serve.
void report_out_of_memory(std::size_t size, int device);

}  // namespace reservoir_torch_hooks
