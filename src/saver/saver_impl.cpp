// Saver::Impl: regions (per-thread stacks of open regions), allocation and
// frees routed to the tag that owns them, and observation.
#include "saver_impl.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>

#include "reservoir/errors.hpp"
#include "reservoir/format.hpp"

namespace reservoir {

using detail::TagState;

namespace {

struct Frame {
  const Saver::Impl* owner;
  TagState* state;  // nullptr: outside every tag
  std::uint64_t token;
};
thread_local std::vector<Frame> t_frames;
std::atomic<std::uint64_t> next_token{1};
std::atomic<std::uint64_t> next_saver_id{1};

// The innermost frame of one saver on this thread, as push and pop leave it
// (saver 0: nothing known): a plain thread_local, read without the
// vector's initialization guard on every allocation.
struct Innermost {
  std::uint64_t saver;
  TagState* state;
};
thread_local Innermost t_innermost{0, nullptr};

// The innermost region of `owner` on this thread: its tag (null when
// untagged), or `initial` when the thread opened none.
TagState* innermost(const Saver::Impl* owner, TagState* initial) noexcept {
  for (auto it = t_frames.rbegin(); it != t_frames.rend(); ++it) {
    if (it->owner == owner) return it->state;
  }
  return initial;
}

}  // namespace

TagState& Saver::Impl::tag_state(std::string_view tag, const RegionOptions& options) {
  if (tag.empty()) throw UsageError("region: the tag is empty");
  if (options.storage && !options.cpu_backup) {
    throw UsageError(fmt::format("region '{}': a backup storage ('{}') needs cpu_backup", tag,
                                 to_string(*options.storage)));
  }
  const BackupStorage storage = options.storage.value_or(options_.storage);
  if (!tag_base_.supports_virtual_memory()) {
    throw UsageError(fmt::format(
        "region '{}': tagged memory needs a device with virtual memory, and '{}' has none "
        "(use cuda-vmm, or give SaverOptions::tag_device)",
        tag, tag_base_.name()));
  }
  const auto key =
      std::make_pair(std::string(tag), options.cpu_backup ? 1 + static_cast<int>(storage) : 0);
  {
    detail::SharedLock lock(tags_mutex_);
    if (auto it = tags_.find(key); it != tags_.end()) return *it->second;
  }
  detail::UniqueLock lock(tags_mutex_);
  if (auto it = tags_.find(key); it != tags_.end()) return *it->second;
  auto state = std::make_unique<TagState>(key.first, options.cpu_backup, storage, tag_base_, index_,
                                          &memory_margin_, options_.config, options_.device_index);
  if (history_) state->allocator.record_history(*history_);
  if (oom_explainer_) state->allocator.set_oom_explainer(oom_explainer_);
  if (options_.exact_peaks && !combined_) {
    // From the first tag on, the saver's peaks are those of the sum (the
    // untagged allocator's peaks were the saver's until now).
    auto combined = std::make_shared<CombinedStats>();
    untagged_.combine_stats(combined, true);
    combined_ = std::move(combined);
  }
  if (combined_) state->allocator.combine_stats(combined_, false);
  state->allocator.set_validate_each_call(validate_each_call_.load(std::memory_order_relaxed));
  return *tags_.emplace(key, std::move(state)).first->second;
}

std::shared_ptr<CombinedStats> Saver::Impl::combined() const {
  detail::SharedLock lock(tags_mutex_);
  return combined_;
}

std::uint64_t Saver::Impl::push(TagState* state) {
  const std::uint64_t token = next_token.fetch_add(1, std::memory_order_relaxed);
  t_frames.push_back({this, state, token});
  t_innermost = {id_, state};
  return token;
}

void Saver::Impl::pop(std::uint64_t token) {
  for (auto it = t_frames.rbegin(); it != t_frames.rend(); ++it) {
    if (it->owner != this) continue;
    if (it->token != token) {
      throw UsageError(fmt::format(
          "region: closing region {} while region {} ('{}') opened inside it is still open "
          "(regions close innermost first, on the thread that opened them)",
          token, it->token, it->state != nullptr ? it->state->tag : std::string("untagged")));
    }
    t_frames.erase(std::next(it).base());
    t_innermost = {id_, innermost(this, initial_state_)};
    return;
  }
  throw UsageError(fmt::format("region: no open region {} on this thread", token));
}

std::uint64_t Saver::Impl::next_id() noexcept {
  return next_saver_id.fetch_add(1, std::memory_order_relaxed);
}

TagState* Saver::Impl::current() const noexcept {
  if (t_innermost.saver == id_) return t_innermost.state;
  TagState* state = innermost(this, initial_state_);
  t_innermost = {id_, state};
  return state;
}

void* Saver::Impl::allocate(std::size_t size, StreamId stream) {
  TagState* state = current();
  if (state == nullptr) return untagged_.allocate(size, stream);
  detail::SharedLock lock(state->mutex);
  if (state->paused) {
    throw UsageError(
        fmt::format("allocation of {} bytes into tag '{}', which is paused (resume it first, or "
                    "allocate outside it)",
                    size, state->tag));
  }
  if (active_routes_.load(std::memory_order_acquire) > 0) [[unlikely]]
    route_into(*state, stream);
  try {
    try {
      return state->allocator.allocate(size, stream);
    } catch (const OutOfMemoryError&) {
      // The tag ran out after its own retry ladder: memory the other
      // allocators cache goes back to the device, and it tries once more (as
      // PyTorch's ladder frees the cached blocks of every pool).
      if (reclaim(*state) <= 0) throw;
      return state->allocator.allocate(size, stream);
    }
  } catch (const OutOfMemoryError& e) {
    const std::size_t margin = memory_margin_.load(std::memory_order_relaxed);
    if (margin == 0) throw;
    // The device's free memory in the message includes the margin the tag
    // may not touch: say so, or the message contradicts itself.
    throw OutOfMemoryError(
        fmt::format("{} Tagged allocations leave {} of the device free (the memory margin, "
                    "set_memory_margin): tag '{}' can use only the memory above it.",
                    e.what(), format_size(margin), state->tag),
        e.requested_bytes(), e.device_free(), e.device_total());
  }
}

namespace {
// A pool's own allocator (MemPool(allocator=...)) as a tag's allocator uses
// it: the segments it gives are the tag's in the saver's index, so that
// their blocks are freed into the tag's allocator as the tag's own are.
class TagPoolAllocator final : public PoolSegmentAllocator {
 public:
  TagPoolAllocator(std::shared_ptr<PoolSegmentAllocator> inner, detail::RangeIndex& index, TagState* owner)
      : inner_(std::move(inner)), index_(index), owner_(owner) {}
  DevicePtr allocate(std::size_t size, StreamId stream) override {
    const DevicePtr p = inner_->allocate(size, stream);
    if (p != 0) {
      try {
        index_.insert(p, size, owner_);
      } catch (...) {
        inner_->free(p, size, stream);
        throw;
      }
    }
    return p;
  }
  void free(DevicePtr ptr, std::size_t size, StreamId stream) override {
    inner_->free(ptr, size, stream);
    index_.erase(ptr);
  }

 private:
  std::shared_ptr<PoolSegmentAllocator> inner_;
  detail::RangeIndex& index_;
  TagState* owner_;
};

// The pool's allocator as the tag's allocator uses it (null: none).
std::shared_ptr<PoolSegmentAllocator> for_tag(const std::shared_ptr<PoolSegmentAllocator>& allocator,
                                              detail::RangeIndex& index, TagState& state) {
  return allocator ? std::make_shared<TagPoolAllocator>(allocator, index, &state) : nullptr;
}
}  // namespace

void Saver::Impl::route_into(TagState& state, StreamId stream) {
  detail::LockGuard lock(routes_mutex_);
  for (Route& r : routes_) {
    if (std::find(r.begun.begin(), r.begun.end(), &state.allocator) != r.begun.end()) continue;
    if (!r.filter(stream)) continue;
    if (auto a = pool_allocators_.find(r.id); a != pool_allocators_.end()) {
      state.allocator.set_pool_allocator(r.id, for_tag(a->second, index_, state));
    }
    state.allocator.begin_allocate_to_pool(r.id, r.filter);
    r.begun.push_back(&state.allocator);
    tag_pool_uses_[r.id].push_back(&state);
  }
}

void Saver::Impl::begin_allocate_to_pool(PoolId id, PoolFilter filter) {
  detail::LockGuard lock(routes_mutex_);
  untagged_.begin_allocate_to_pool(id, filter);  // says what is wrong first
  routes_.push_back({id, std::move(filter), {}});
  active_routes_.fetch_add(1, std::memory_order_release);
}

void Saver::Impl::end_allocate_to_pool(PoolId id) {
  detail::LockGuard lock(routes_mutex_);
  untagged_.end_allocate_to_pool(id);
  for (auto it = routes_.begin(); it != routes_.end(); ++it) {
    if (it->id != id) continue;
    for (CachingAllocator* a : it->begun) a->end_allocate_to_pool(id);
    routes_.erase(it);
    active_routes_.fetch_sub(1, std::memory_order_release);
    return;
  }
}

void Saver::Impl::release_pool(PoolId id) {
  detail::LockGuard lock(routes_mutex_);
  untagged_.release_pool(id);
  pool_allocators_.erase(id);  // each allocator's pool keeps its own
  auto it = tag_pool_uses_.find(id);
  if (it == tag_pool_uses_.end()) return;
  // One use per allocator, as the untagged allocator gives up one.
  std::vector<TagState*>& uses = it->second;
  std::vector<TagState*> released;
  for (auto u = uses.begin(); u != uses.end();) {
    if (std::find(released.begin(), released.end(), *u) != released.end()) {
      ++u;
      continue;
    }
    (*u)->allocator.release_pool(id);
    released.push_back(*u);
    u = uses.erase(u);
  }
  if (uses.empty()) tag_pool_uses_.erase(it);
}

void Saver::Impl::set_pool_allocator(PoolId id, std::shared_ptr<PoolSegmentAllocator> allocator) {
  detail::LockGuard lock(routes_mutex_);
  untagged_.set_pool_allocator(id, allocator);  // says what is wrong first
  if (auto it = tag_pool_uses_.find(id); it != tag_pool_uses_.end()) {
    std::vector<TagState*> done;  // a tag may use the pool more than once
    for (TagState* state : it->second) {
      if (std::find(done.begin(), done.end(), state) != done.end()) continue;
      state->allocator.set_pool_allocator(id, for_tag(allocator, index_, *state));
      done.push_back(state);
    }
  }
  if (allocator) {
    pool_allocators_[id] = std::move(allocator);
  } else {
    pool_allocators_.erase(id);
  }
}

TagState* Saver::Impl::owner_of(const void* ptr) const {
  const auto addr = reinterpret_cast<DevicePtr>(ptr);
  if (index_.empty() || !index_.may_hold(addr)) return nullptr;
  return static_cast<TagState*>(index_.find(addr));
}

void Saver::Impl::deallocate(void* ptr) {
  if (ptr == nullptr) return;
  // Tagged memory lies in its tags' address ranges (the index), untagged
  // memory outside them.
  TagState* state = owner_of(ptr);
  if (state == nullptr) return untagged_.deallocate(ptr);  // or says why it is not ours
  detail::SharedLock lock(state->mutex);
  if (!state->paused) return state->allocator.deallocate(ptr);
  detail::LockGuard pending(state->pending_mutex);
  if (state->live_at_pause.erase(reinterpret_cast<DevicePtr>(ptr)) == 0) {
    throw InvalidPointerError(fmt::format(
        "free of {}: not a live allocation of tag '{}' (paused): freed already, or not the "
        "start of a block",
        ptr, state->tag));
  }
  state->pending_frees.push_back(ptr);
}

void Saver::Impl::record_stream(void* ptr, StreamId stream) {
  TagState* state = owner_of(ptr);
  if (state == nullptr) return untagged_.record_stream(ptr, stream);
  detail::SharedLock lock(state->mutex);
  state->allocator.record_stream(ptr, stream);
}

void Saver::Impl::empty_cache() {
  untagged_.empty_cache();
  for (TagState* state : all_tags()) {
    detail::SharedLock lock(state->mutex);
    state->allocator.empty_cache();
  }
}

TagInfo Saver::Impl::info(TagState& state) const {
  detail::SharedLock lock(state.mutex);
  TagInfo t;
  static_cast<PauseRecord&>(t) = state.record;
  t.tag = state.tag;
  t.cpu_backup = state.cpu_backup;
  t.backup_storage = state.cpu_backup ? std::string(to_string(state.storage)) : std::string();
  t.paused = state.paused;
  const DeviceStats s = state.allocator.stats();
  t.allocated_bytes = static_cast<std::size_t>(s.allocated_bytes[0].current);
  t.reserved_bytes = static_cast<std::size_t>(s.reserved_bytes[0].current);
  t.physical_bytes = state.device.physical_bytes();
  t.backup_bytes = state.backup && !state.zeroed ? state.backup->size() : 0;  // zeros hold nothing
  {
    detail::LockGuard pending(state.pending_mutex);
    t.pending_frees = state.pending_frees.size();
  }
  return t;
}

void Saver::Impl::record_history(const HistoryOptions& options) {
  untagged_.record_history(options);  // checks the options first
  detail::UniqueLock lock(tags_mutex_);
  history_ = options.enabled ? std::optional<HistoryOptions>(options) : std::nullopt;
  for (auto& [key, state] : tags_) state->allocator.record_history(options);
}

void Saver::Impl::set_oom_explainer(const OomExplainer& explainer) {
  untagged_.set_oom_explainer(explainer);
  detail::UniqueLock lock(tags_mutex_);
  oom_explainer_ = explainer;
  for (auto& [key, state] : tags_) state->allocator.set_oom_explainer(explainer);
}

Snapshot Saver::Impl::snapshot() const {
  Snapshot out = untagged_.snapshot();
  for (TagState* state : all_tags()) {
    Snapshot s = state->allocator.snapshot();
    const std::string label = fmt::format("reservoir.tag={}", state->tag);
    std::map<std::uint32_t, std::uint32_t> remap;
    auto context_of = [&](std::uint32_t c) {
      auto [it, fresh] = remap.try_emplace(c, 0);
      if (fresh) {
        Context ctx = c < s.contexts.size() ? s.contexts[c] : Context{};
        ctx.annotations.insert(ctx.annotations.begin(), label);
        it->second = static_cast<std::uint32_t>(out.contexts.size());
        out.contexts.push_back(std::move(ctx));
      }
      return it->second;
    };
    for (SegmentInfo& seg : s.segments) {
      for (BlockInfo& b : seg.blocks) b.context = context_of(b.context);
      out.segments.push_back(std::move(seg));
    }
    for (TraceEvent& e : s.history) {
      if (e.action == TraceAction::snapshot) continue;  // one snapshot event: the untagged one
      e.context = context_of(e.context);
      out.history.push_back(e);
    }
  }
  std::sort(out.segments.begin(), out.segments.end(),
            [](const SegmentInfo& a, const SegmentInfo& b) { return a.address < b.address; });
  std::stable_sort(out.history.begin(), out.history.end(),
                   [](const TraceEvent& a, const TraceEvent& b) { return a.time_us < b.time_us; });
  return out;
}

void Saver::Impl::set_validate_each_call(bool on) {
  detail::UniqueLock lock(tags_mutex_);
  validate_each_call_.store(on, std::memory_order_relaxed);
  untagged_.set_validate_each_call(on);
  for (auto& [key, state] : tags_) state->allocator.set_validate_each_call(on);
}

}  // namespace reservoir
