// A model of the native policy beside an allocator of another policy: the
// same requests (sizes, streams, frees, stream uses, empty_cache) replayed on
// a CachingAllocator with the native policy over a simulated device without
// a capacity limit, so that the other policy knows what the native one
// would reserve for the same program at the same point.
//
// Cheap on the hot path: a request is logged (one entry) and applied only
// when the reserved figure is asked for (on a miss), or when the log is long.
// Default pools only: private pools keep classic segments under every policy,
// by the same rules, so they are the same in both.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "reservoir/caching_allocator.hpp"
#include "reservoir/config.hpp"
#include "reservoir/sim_device.hpp"

namespace reservoir::detail {

class NativeShadow {
 public:
  explicit NativeShadow(const AllocatorConfig& config);
  NativeShadow(const NativeShadow&) = delete;
  NativeShadow& operator=(const NativeShadow&) = delete;

  // The allocator's settings changed (the model takes the native policy's part).
  void configure(const AllocatorConfig& config);
  // An allocation of a default pool served at ptr, a free, a use on another stream.
  void allocated(DevicePtr ptr, std::size_t size, StreamId stream) {
    log(Op{Kind::alloc, ptr, size, stream});
  }
  void freed(DevicePtr ptr) { log(Op{Kind::free, ptr, 0, 0}); }
  void stream_used(DevicePtr ptr, StreamId stream) { log(Op{Kind::stream_use, ptr, 0, stream}); }
  void cache_emptied() { log(Op{Kind::empty_cache, 0, 0, 0}); }
  // The request being served, applied at once (its pointer comes later:
  // allocated() then pairs with it), so that reserved() counts it. Called
  // again for the same request (the retry ladder), it changes nothing.
  void begin_request(std::size_t size, StreamId stream);
  // The request begun failed: the model frees its block.
  void abandon_request();
  bool in_request() const noexcept { return pending_.has_value(); }
  // What the native policy reserves now in its default pools.
  std::size_t reserved();
  // The streams the program has allocated on.
  std::size_t streams() const noexcept { return streams_.size(); }

 private:
  enum class Kind : std::uint8_t { alloc, free, stream_use, empty_cache };
  struct Op {
    Kind kind;
    DevicePtr ptr;
    std::size_t size;
    StreamId stream;
  };
  struct Pending {
    void* block;
    std::size_t size;
    StreamId stream;
  };
  static constexpr std::size_t kMaxLog = std::size_t{1} << 14;
  void log(const Op& op) {
    log_.push_back(op);
    if (log_.size() >= kMaxLog) [[unlikely]]
      flush();
  }
  void flush();
  void apply(const Op& op);

  SimDevice device_;
  CachingAllocator native_;
  std::vector<Op> log_;
  std::unordered_map<DevicePtr, void*> block_of_;  // the allocator's pointer -> the model's
  std::unordered_set<StreamId> streams_;
  std::optional<Pending> pending_;
};

}  // namespace reservoir::detail
