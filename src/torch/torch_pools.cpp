// Private pools' routes, users and options (torch_pools.hpp).
#include "torch_pools.hpp"

#include <string>

namespace reservoir_torch_hooks {

void Pools::begin_route(c10::DeviceIndex device, MempoolId id,
                        std::function<bool(cudaStream_t)> filter) {
  auto owned = std::make_unique<std::function<bool(cudaStream_t)>>(std::move(filter));
  void* context = owned.get();
  {
    // A route is a user of the pool too (PyTorch releases it after
    // endAllocateToPool, as it does a MemPool's).
    std::lock_guard lock(mutex_);
    filters_[{device, id}] = std::move(owned);
    ++users_[{device, id}];
  }
  TORCH_CHECK(
      entry().begin_allocate_to_pool(device, id.first, id.second, call_stream_filter, context) == 0,
      "reservoir (PyTorch's allocator): beginAllocateToPool: ", entry().error());
  // reservoir counts a use of the pool per route begun after its first;
  // here users_ counts them all, and reservoir hears of the last release
  // alone: its count stays at one.
  bool again = false;
  {
    std::lock_guard lock(mutex_);
    again = !routed_.insert({device, id}).second;
  }
  if (again) {
    TORCH_CHECK(entry().release_pool(device, id.first, id.second) == 0,
                "reservoir (PyTorch's allocator): beginAllocateToPool: ", entry().error());
  }
}

void Pools::end_route(c10::DeviceIndex device, MempoolId id) {
  TORCH_CHECK(entry().end_allocate_to_pool(device, id.first, id.second) == 0,
              "reservoir (PyTorch's allocator): endAllocateToPool: ", entry().error());
  std::lock_guard lock(mutex_);
  filters_.erase({device, id});
}

void Pools::add_user(c10::DeviceIndex device, MempoolId id) {
  std::lock_guard lock(mutex_);
  ++users_[{device, id}];
}

void Pools::release(c10::DeviceIndex device, MempoolId id) {
  {
    std::lock_guard lock(mutex_);
    auto it = users_.find({device, id});
    if (it != users_.end() && --it->second > 0) return;
    if (it != users_.end()) users_.erase(it);
    // A pool never allocated to holds nothing in reservoir (but its
    // allocator, which it forgets).
    const bool had_allocator = with_allocator_.erase({device, id}) > 0;
    if (routed_.erase({device, id}) == 0) {
      if (had_allocator) {
        TORCH_CHECK(entry().set_pool_allocator(device, id.first, id.second, nullptr, nullptr,
                                               nullptr, nullptr) == 0,
                    "reservoir (PyTorch's allocator): releasePool: ", entry().error());
      }
      return;
    }
  }
  TORCH_CHECK(entry().release_pool(device, id.first, id.second) == 0,
              "reservoir (PyTorch's allocator): releasePool: ", entry().error());
}

int Pools::users(c10::DeviceIndex device, MempoolId id) {
  std::lock_guard lock(mutex_);
  auto it = users_.find({device, id});
  return it == users_.end() ? 0 : it->second;
}

bool Pools::known(c10::DeviceIndex device, MempoolId id) {
  std::lock_guard lock(mutex_);
  return users_.count({device, id}) > 0;
}

void Pools::set_use_on_oom(c10::DeviceIndex device, MempoolId id, bool use_on_oom) {
  TORCH_CHECK(entry().set_pool_option(device, id.first, id.second, 0, use_on_oom ? 1 : 0) == 0,
              "reservoir (PyTorch's allocator): setUseOnOOM: ", entry().error());
}

namespace {
// The pool's allocator, as reservoir's callbacks reach it.
struct PoolAllocatorRef {
  CUDAAllocator* allocator;
  std::shared_ptr<CUDAAllocator> owner;
};

// The other allocator's exceptions come back as reservoir's errors, with
// PyTorch's message (last_error(): this thread's, read at once).
void* pool_alloc(void* context, size_t size, cudaStream_t, const char** error) {
  void* out = nullptr;
  // PyTorch asks raw_alloc (the current device's current stream: the
  // request's), and takes null as the device's out-of-memory.
  if (guarded([&] { out = static_cast<PoolAllocatorRef*>(context)->allocator->raw_alloc(size); }) != 0) {
    *error = last_error().c_str();
  }
  return out;
}

int pool_free(void* context, void* ptr, size_t, cudaStream_t, const char** error) {
  const int rc = guarded([&] { static_cast<PoolAllocatorRef*>(context)->allocator->raw_delete(ptr); });
  if (rc != 0) *error = last_error().c_str();
  return rc;
}

void pool_drop(void* context) { delete static_cast<PoolAllocatorRef*>(context); }
}  // namespace

void Pools::set_allocator(c10::DeviceIndex device, MempoolId id, CUDAAllocator* allocator,
                          std::shared_ptr<CUDAAllocator> owner) {
  auto* ref = new PoolAllocatorRef{allocator, std::move(owner)};
  // (reservoir drops the reference, also when the call fails.)
  TORCH_CHECK(entry().set_pool_allocator(device, id.first, id.second, pool_alloc, pool_free, pool_drop,
                                         ref) == 0,
              "reservoir (PyTorch's allocator): MemPool(allocator=...): ", entry().error());
  std::lock_guard lock(mutex_);
  with_allocator_.insert({device, id});
}

bool Pools::has_allocator(c10::DeviceIndex device, MempoolId id) {
  std::lock_guard lock(mutex_);
  return with_allocator_.count({device, id}) > 0;
}

void Pools::set_no_split(c10::DeviceIndex device, MempoolId id) {
  TORCH_CHECK(entry().set_pool_option(device, id.first, id.second, 1, 1) == 0,
              "reservoir (PyTorch's allocator): setNoSplit: ", entry().error());
}

}  // namespace reservoir_torch_hooks
