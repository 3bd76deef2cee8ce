// The private pools PyTorch routes allocations to under reservoir's own
// allocator (MemPool objects, CUDA graphs' pools): their routes and stream
// filters, their users (a pool's memory goes back when its last user
// releases it), and their options (use_on_oom, no_split). reservoir holds a
// pool once a route to it began. Thread-safe: a lock of its own, never held
// while reservoir is called. Internal to the per-release libraries.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <utility>

#include "torch_types.hpp"

namespace reservoir_torch_hooks {

class Pools {
 public:
  // beginAllocateToPool / endAllocateToPool: allocations on the streams
  // `filter` accepts go to the pool until the route ends.
  void begin_route(c10::DeviceIndex device, MempoolId id, std::function<bool(cudaStream_t)> filter);
  void end_route(c10::DeviceIndex device, MempoolId id);
  // A user more (a MemPool, a graph); released by release(), whose last
  // user gives the pool's memory back.
  void add_user(c10::DeviceIndex device, MempoolId id);
  void release(c10::DeviceIndex device, MempoolId id);
  int users(c10::DeviceIndex device, MempoolId id);
  // Whether the pool has a user.
  bool known(c10::DeviceIndex device, MempoolId id);
  // MemPool(use_on_oom=True): the pool's free blocks are the last resort
  // before running out; MemPool(no_split=True): its blocks are handed out whole.
  static void set_use_on_oom(c10::DeviceIndex device, MempoolId id, bool use_on_oom);
  static void set_no_split(c10::DeviceIndex device, MempoolId id);
  // MemPool(allocator=...): the pool's segments come from `allocator`'s
  // raw_alloc and go back to its raw_delete, as under PyTorch's allocator.
  // `owner` keeps it alive while a segment of it is held (PyTorch 2.11 and
  // later hand it over shared); null where the release hands a bare pointer,
  // which lives as long as the MemPool (as PyTorch's own pool keeps it).
  // Forgotten again by release() when the pool was never routed to.
  void set_allocator(c10::DeviceIndex device, MempoolId id, CUDAAllocator* allocator,
                     std::shared_ptr<CUDAAllocator> owner);
  bool has_allocator(c10::DeviceIndex device, MempoolId id);

 private:
  using Key = std::pair<int, MempoolId>;
  std::mutex mutex_;
  std::map<Key, std::unique_ptr<std::function<bool(cudaStream_t)>>> filters_;
  std::map<Key, int> users_;
  std::set<Key> routed_;  // pools reservoir holds (begun at least once)
  std::set<Key> with_allocator_;  // pools given an allocator of their own
};

}  // namespace reservoir_torch_hooks
