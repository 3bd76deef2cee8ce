// Uses the installed package: allocate and free through the native policy.
#include <reservoir/caching_allocator.hpp>
#include <reservoir/sim_device.hpp>

#include <cstdio>

int main() {
  reservoir::SimDevice device;
  reservoir::CachingAllocator allocator(device, reservoir::AllocatorConfig{});
  void* p = allocator.allocate(1000);
  allocator.deallocate(p);
  const auto stats = allocator.stats_map();
  const bool ok = stats.at("reserved_bytes.all.current") == 2097152 &&
                  stats.at("allocated_bytes.all.current") == 0;
  std::printf("consumer: %s\n", ok ? "ok" : "wrong stats");
  return ok ? 0 : 1;
}
