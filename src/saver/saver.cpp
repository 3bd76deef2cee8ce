// Saver: tags, regions, pause and resume (reservoir/saver.hpp).
//
// Each tag (a name and a cpu_backup flag) is a TagPool: a CachingAllocator on
// a TagDevice. The pool's shared mutex is held shared by allocations and
// frees into the tag, exclusively by pause and resume, so those never run
// beside the tag's allocator. While paused, frees are checked against the
// blocks that were live at pause and queued; resume applies them.
#include "reservoir/saver.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <map>
#include <mutex>
#include <optional>
#include <shared_mutex>
#include <unordered_set>

#include "backup.hpp"
#include "reservoir/caching_allocator.hpp"
#include "reservoir/errors.hpp"
#include "reservoir/host_caching_allocator.hpp"
#include "tag_device.hpp"

namespace reservoir {

namespace detail {

struct TagPool {
  TagPool(std::string name, bool backup, Device& base, RangeIndex& index,
          const AllocatorConfig& config, int device_index)
      : tag(std::move(name)),
        cpu_backup(backup),
        device(base, index, this),
        allocator(device, config, device_index) {}

  const std::string tag;
  const bool cpu_backup;
  TagDevice device;
  CachingAllocator allocator;
  // Shared: allocations and frees; exclusive: pause and resume.
  mutable std::shared_mutex mutex;
  bool paused = false;
  // While paused (guarded by pending_mutex): the blocks live at pause that
  // were not freed since, and the frees to apply on resume.
  std::mutex pending_mutex;
  std::unordered_set<DevicePtr> live_at_pause;
  std::vector<void*> pending_frees;
  // The backup taken at pause (cpu_backup only).
  std::unique_ptr<HostStore> backup;
  std::vector<BackupPiece> pieces;
  PauseRecord record;  // guarded by mutex
};

}  // namespace detail

namespace {

using detail::BackupPiece;
using detail::TagPool;
using Clock = std::chrono::steady_clock;

struct Frame {
  const Saver::Impl* owner;
  TagPool* pool;  // nullptr: outside every tag
  std::uint64_t token;
};
thread_local std::vector<Frame> t_frames;
std::atomic<std::uint64_t> next_token{1};

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// Joins pieces that follow each other on the device and in the store.
std::vector<BackupPiece> coalesce(const std::vector<BackupPiece>& pieces) {
  std::vector<BackupPiece> out;
  for (const BackupPiece& p : pieces) {
    if (!out.empty() && out.back().addr + out.back().bytes == p.addr &&
        out.back().offset + out.back().bytes == p.offset) {
      out.back().bytes += p.bytes;
    } else {
      out.push_back(p);
    }
  }
  return out;
}

void add_stats(DeviceStats& into, const DeviceStats& from) {
  into.for_each_stat_pair(from, [](Stat& s, const Stat& f) {
    s.current += f.current;
    s.peak += f.peak;
    s.allocated += f.allocated;
    s.freed += f.freed;
  });
  into.num_alloc_retries += from.num_alloc_retries;
  into.num_ooms += from.num_ooms;
  into.num_sync_all_streams += from.num_sync_all_streams;
  into.num_device_alloc += from.num_device_alloc;
  into.num_device_free += from.num_device_free;
}

}  // namespace

class Saver::Impl {
 public:
  Impl(Device& device, SaverOptions options)
      : device_(device),
        options_(std::move(options)),
        tag_base_(options_.tag_device != nullptr ? *options_.tag_device : device),
        pinned_(options_.pinned_source != nullptr ? *options_.pinned_source : own_pinned_),
        host_cache_(pinned_, tag_base_),
        untagged_(device, options_.config, options_.device_index) {}

  ~Impl() {
    pools_.clear();  // allocators first: they give their segments back
    for (StreamId s : streams_) {
      if (s != 0) (void)tag_base_.destroy_stream(s);
    }
  }

  // ---- regions ----
  TagPool& pool_for(std::string_view tag, bool cpu_backup) {
    if (tag.empty()) throw UsageError("region: the tag is empty");
    if (!tag_base_.supports_virtual_memory()) {
      throw UsageError(fmt::format(
          "region '{}': tagged memory needs a device with virtual memory, and '{}' has none "
          "(use cuda-vmm, or give SaverOptions::tag_device)",
          tag, tag_base_.name()));
    }
    const auto key = std::make_pair(std::string(tag), cpu_backup);
    {
      std::shared_lock lock(pools_mutex_);
      if (auto it = pools_.find(key); it != pools_.end()) return *it->second;
    }
    std::unique_lock lock(pools_mutex_);
    if (auto it = pools_.find(key); it != pools_.end()) return *it->second;
    auto pool = std::make_unique<TagPool>(key.first, cpu_backup, tag_base_, index_,
                                          options_.config, options_.device_index);
    if (history_) pool->allocator.record_history(*history_);
    if (options_.exact_peaks && !combined_) {
      // From the first tag on, the saver's peaks are those of the sum (the
      // untagged allocator's peaks were the saver's until now).
      auto combined = std::make_shared<CombinedStats>();
      untagged_.combine_stats(combined, true);
      combined_ = std::move(combined);
    }
    if (combined_) pool->allocator.combine_stats(combined_, false);
    return *pools_.emplace(key, std::move(pool)).first->second;
  }

  std::shared_ptr<CombinedStats> combined() const {
    std::shared_lock lock(pools_mutex_);
    return combined_;
  }

  std::uint64_t push(TagPool* pool) {
    const std::uint64_t token = next_token.fetch_add(1, std::memory_order_relaxed);
    t_frames.push_back({this, pool, token});
    return token;
  }

  void pop(std::uint64_t token) {
    for (auto it = t_frames.rbegin(); it != t_frames.rend(); ++it) {
      if (it->owner != this) continue;
      if (it->token != token) {
        throw UsageError(fmt::format(
            "region: closing region {} while region {} ('{}') opened inside it is still open "
            "(regions close innermost first, on the thread that opened them)",
            token, it->token, it->pool != nullptr ? it->pool->tag : std::string("untagged")));
      }
      t_frames.erase(std::next(it).base());
      return;
    }
    throw UsageError(fmt::format("region: no open region {} on this thread", token));
  }

  TagPool* current() const noexcept {
    for (auto it = t_frames.rbegin(); it != t_frames.rend(); ++it) {
      if (it->owner == this) return it->pool;
    }
    return nullptr;
  }

  // ---- allocation ----
  void* allocate(std::size_t size, StreamId stream) {
    TagPool* pool = current();
    if (pool == nullptr) return untagged_.allocate(size, stream);
    std::shared_lock lock(pool->mutex);
    if (pool->paused) {
      throw UsageError(fmt::format(
          "allocation of {} bytes into tag '{}', which is paused (resume it first, or "
          "allocate outside it)",
          size, pool->tag));
    }
    return pool->allocator.allocate(size, stream);
  }

  TagPool* owner_of(const void* ptr) const {
    if (index_.empty()) return nullptr;
    return static_cast<TagPool*>(index_.find(reinterpret_cast<DevicePtr>(ptr)));
  }

  void deallocate(void* ptr) {
    if (ptr == nullptr) return;
    // Untagged blocks first, found by the allocator's own lookup: a free
    // outside every tag costs what it costs without a saver.
    if (index_.empty()) return untagged_.deallocate(ptr);
    if (untagged_.try_deallocate(ptr)) return;
    TagPool* pool = owner_of(ptr);
    if (pool == nullptr) return untagged_.deallocate(ptr);  // says why it is not ours
    std::shared_lock lock(pool->mutex);
    if (!pool->paused) return pool->allocator.deallocate(ptr);
    std::lock_guard pending(pool->pending_mutex);
    if (pool->live_at_pause.erase(reinterpret_cast<DevicePtr>(ptr)) == 0) {
      throw InvalidPointerError(fmt::format(
          "free of {}: not a live allocation of tag '{}' (paused): freed already, or not the "
          "start of a block",
          ptr, pool->tag));
    }
    pool->pending_frees.push_back(ptr);
  }

  void record_stream(void* ptr, StreamId stream) {
    TagPool* pool = owner_of(ptr);
    if (pool == nullptr) return untagged_.record_stream(ptr, stream);
    std::shared_lock lock(pool->mutex);
    pool->allocator.record_stream(ptr, stream);
  }

  void empty_cache() {
    untagged_.empty_cache();
    for (TagPool* pool : all_pools()) {
      std::shared_lock lock(pool->mutex);
      pool->allocator.empty_cache();
    }
  }

  // ---- pause and resume ----
  std::vector<TagPool*> all_pools() const {
    std::shared_lock lock(pools_mutex_);
    std::vector<TagPool*> out;
    for (const auto& [key, pool] : pools_) out.push_back(pool.get());
    return out;
  }

  std::vector<TagPool*> pools_named(std::string_view tag, const char* operation) const {
    std::vector<TagPool*> out;
    std::vector<std::string> known;
    for (TagPool* pool : all_pools()) {
      if (pool->tag == tag) out.push_back(pool);
      if (known.empty() || known.back() != pool->tag) known.push_back(pool->tag);
    }
    if (out.empty()) {
      throw UsageError(fmt::format("{}: unknown tag '{}' (known tags: {})", operation, tag,
                                   known.empty() ? std::string("none") : fmt::format("'{}'", fmt::join(known, "', '"))));
    }
    return out;
  }

  static bool paused_now(TagPool* pool) {
    std::shared_lock lock(pool->mutex);
    return pool->paused;
  }

  const std::vector<StreamId>& copy_streams() {
    std::lock_guard lock(streams_mutex_);
    if (streams_.empty()) {
      for (int i = 0; i < options_.copy_streams; ++i) {
        StreamId s = 0;
        if (tag_base_.create_stream(&s) != Status::ok) break;
        streams_.push_back(s);
      }
      if (streams_.empty()) streams_.push_back(0);  // the device has no streams of its own
    }
    return streams_;
  }

  void pause_pool(TagPool& pool) {
    std::unique_lock lock(pool.mutex);
    if (pool.paused) return;
    const auto t0 = Clock::now();
    const std::string what = fmt::format("pause of tag '{}'", pool.tag);
    if (Status s = tag_base_.synchronize_device(); s != Status::ok) {
      throw DeviceError(CallKind::synchronize_device, s,
                        what + ": synchronizing the device (the tag is left running, untouched)");
    }
    // The live allocations: what must survive (and, with backup, be copied).
    std::unordered_set<DevicePtr> live;
    std::vector<BackupPiece> pieces;
    std::size_t total = 0;
    for (const auto& [address, requested] : pool.allocator.live_allocations()) {
      live.insert(address);
      if (pool.cpu_backup && requested > 0) {
        pieces.push_back({address, requested, total});
        total += requested;
      }
    }
    std::unique_ptr<detail::HostStore> store;
    if (total > 0) {
      store = options_.storage == BackupStorage::pinned
                  ? detail::make_pinned_store(host_cache_, total, options_.chunk_bytes)
                  : detail::make_mmap_store(options_.mmap_directory, total);
      detail::CopyEngine engine(tag_base_, host_cache_, options_.chunk_bytes, copy_streams(), *store,
                                /*to_host=*/true);
      detail::StepFailure f;
      for (const BackupPiece& p : coalesce(pieces)) {
        if (f = engine.issue(p); f.failed()) break;
      }
      if (!f.failed()) f = engine.finish();
      if (f.failed()) {
        throw DeviceError(f.call, f.status,
                          fmt::format("{}: copying {} bytes to host memory (the tag is left "
                                      "running, untouched)",
                                      what, total));
      }
    }
    std::size_t released = 0;
    if (auto f = pool.device.release_all(&released); f.failed()) {
      throw DeviceError(f.call, f.status,
                        fmt::format("{}: releasing its memory (the tag is left running, untouched)", what));
    }
    if (store) store->backed_up();
    {
      std::lock_guard pending(pool.pending_mutex);
      pool.live_at_pause = std::move(live);
      pool.pending_frees.clear();
    }
    pool.backup = std::move(store);
    pool.pieces = std::move(pieces);
    pool.paused = true;
    pool.record.pauses += 1;
    pool.record.last_pause_copied = total;
    pool.record.last_released_bytes = released;
    pool.record.last_pause_seconds = seconds_since(t0);
  }

  void resume_pool(TagPool& pool) {
    std::unique_lock lock(pool.mutex);
    if (!pool.paused) return;
    const auto t0 = Clock::now();
    const std::string what = fmt::format("resume of tag '{}'", pool.tag);
    (void)pool.device.retry_releases();
    // What comes back from the host: the backup less the blocks freed meanwhile.
    std::vector<BackupPiece> wanted;
    std::size_t copied = 0;
    if (pool.backup) {
      std::unordered_set<DevicePtr> freed;
      {
        std::lock_guard pending(pool.pending_mutex);
        for (void* p : pool.pending_frees) freed.insert(reinterpret_cast<DevicePtr>(p));
      }
      for (const BackupPiece& p : pool.pieces) {
        if (freed.count(p.addr) == 0) {
          wanted.push_back(p);
          copied += p.bytes;
        }
      }
      wanted = coalesce(wanted);
    }
    // Copies start as soon as their memory is mapped, while the rest is
    // being created and mapped.
    std::optional<detail::CopyEngine> engine;
    if (!wanted.empty()) {
      engine.emplace(tag_base_, host_cache_, options_.chunk_bytes, copy_streams(), *pool.backup,
                     /*to_host=*/false);
    }
    std::size_t next_piece = 0;
    auto on_mapped = [&](DevicePtr frontier) -> detail::StepFailure {
      for (; next_piece < wanted.size() && wanted[next_piece].addr + wanted[next_piece].bytes <= frontier;
           ++next_piece) {
        if (auto f = engine->issue(wanted[next_piece]); f.failed()) return f;
      }
      return {};
    };
    auto before_undo = [&] {
      if (engine) (void)engine->finish();
    };
    detail::StepFailure f = pool.device.restore_all(on_mapped, before_undo);
    if (!f.failed() && engine) {
      f = engine->finish();
      if (f.failed()) {
        std::size_t ignored = 0;
        const bool back = !pool.device.release_all(&ignored).failed();
        if (!back) pool.paused = false;  // mapped, contents incomplete: say so
        throw DeviceError(f.call, f.status,
                          fmt::format("{}: copying {} bytes back from host memory ({})", what,
                                      copied,
                                      back ? "the tag stays paused with its backup"
                                           : "its memory could not be released again: the tag "
                                             "is running with incomplete contents"));
      }
    }
    if (f.failed()) {
      if (f.status == Status::out_of_memory) {
        MemoryInfo info;
        (void)tag_base_.memory_info(&info);
        const std::size_t needed = pool.allocator.stats().reserved_bytes[0].current;
        throw OutOfMemoryError(
            fmt::format("{}: out of memory recreating its {} bytes of physical memory ({} bytes "
                        "free of {}); the tag stays paused with its backup",
                        what, needed, info.free, info.total),
            needed, info.free, info.total);
      }
      throw DeviceError(f.call, f.status,
                        fmt::format("{}: {} (the tag stays paused with its backup)", what,
                                    f.call == CallKind::copy_to_device || f.call == CallKind::synchronize_stream
                                        ? "copying its contents back from host memory"
                                        : "mapping its memory again"));
    }
    pool.paused = false;
    engine.reset();
    pool.backup.reset();
    pool.pieces.clear();
    std::vector<void*> frees;
    {
      std::lock_guard pending(pool.pending_mutex);
      frees.swap(pool.pending_frees);
      pool.live_at_pause.clear();
    }
    for (void* p : frees) pool.allocator.deallocate(p);  // checked live when queued
    pool.record.resumes += 1;
    pool.record.last_resume_copied = copied;
    pool.record.last_resume_seconds = seconds_since(t0);
  }

  void pause(std::string_view tag) {
    std::vector<TagPool*> pools = pools_named(tag, "pause");
    if (std::all_of(pools.begin(), pools.end(), paused_now)) {
      throw UsageError(fmt::format("pause: tag '{}' is paused already", tag));
    }
    for (TagPool* p : pools) pause_pool(*p);
  }

  void resume(std::string_view tag) {
    std::vector<TagPool*> pools = pools_named(tag, "resume");
    if (std::none_of(pools.begin(), pools.end(), paused_now)) {
      throw UsageError(fmt::format("resume: tag '{}' is not paused", tag));
    }
    for (TagPool* p : pools) resume_pool(*p);
  }

  void pause_all() {
    for (TagPool* p : all_pools()) pause_pool(*p);
  }
  void resume_all() {
    for (TagPool* p : all_pools()) resume_pool(*p);
  }

  // ---- observation ----
  TagInfo info(TagPool& pool) const {
    std::shared_lock lock(pool.mutex);
    TagInfo t;
    static_cast<PauseRecord&>(t) = pool.record;
    t.tag = pool.tag;
    t.cpu_backup = pool.cpu_backup;
    t.paused = pool.paused;
    const DeviceStats s = pool.allocator.stats();
    t.allocated_bytes = static_cast<std::size_t>(s.allocated_bytes[0].current);
    t.reserved_bytes = static_cast<std::size_t>(s.reserved_bytes[0].current);
    t.physical_bytes = pool.device.physical_bytes();
    t.backup_bytes = pool.backup ? pool.backup->size() : 0;
    {
      std::lock_guard pending(pool.pending_mutex);
      t.pending_frees = pool.pending_frees.size();
    }
    return t;
  }

  void record_history(const HistoryOptions& options) {
    untagged_.record_history(options);  // checks the options first
    std::unique_lock lock(pools_mutex_);
    history_ = options.enabled ? std::optional<HistoryOptions>(options) : std::nullopt;
    for (auto& [key, pool] : pools_) pool->allocator.record_history(options);
  }

  Snapshot snapshot() const {
    Snapshot out = untagged_.snapshot();
    for (TagPool* pool : all_pools()) {
      Snapshot s = pool->allocator.snapshot();
      const std::string label = fmt::format("reservoir.tag={}", pool->tag);
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

  Device& device_;
  SaverOptions options_;
  Device& tag_base_;
  HostPinnedMemory own_pinned_;
  PinnedMemorySource& pinned_;
  HostCachingAllocator host_cache_;
  CachingAllocator untagged_;
  detail::RangeIndex index_;
  std::mutex streams_mutex_;
  std::vector<StreamId> streams_;
  mutable std::shared_mutex pools_mutex_;
  std::optional<HistoryOptions> history_;  // guarded by pools_mutex_
  // Current values and peaks of all allocators together, from the first tag
  // on (before it the untagged allocator's are the saver's); guarded by
  // pools_mutex_.
  std::shared_ptr<CombinedStats> combined_;
  // Declared last: destroyed first, while the index and the host cache live.
  std::map<std::pair<std::string, bool>, std::unique_ptr<TagPool>> pools_;
};

// ---- Saver -------------------------------------------------------------------

namespace {
void check(const SaverOptions& o) {
  const std::size_t c = o.chunk_bytes;
  if (c < (std::size_t{64} << 10) || (c & (c - 1)) != 0) {
    throw UsageError(fmt::format(
        "SaverOptions::chunk_bytes = {}: must be a power of two of at least 65536", c));
  }
  if (o.copy_streams < 1 || o.copy_streams > 64) {
    throw UsageError(fmt::format("SaverOptions::copy_streams = {}: must be 1 to 64", o.copy_streams));
  }
}
}  // namespace

Saver::Saver(Device& device, SaverOptions options) {
  check(options);
  impl_ = std::make_unique<Impl>(device, std::move(options));
}
Saver::~Saver() = default;

Saver::Region::Region(Region&& other) noexcept : saver_(other.saver_), token_(other.token_) {
  other.saver_ = nullptr;
}
Saver::Region::~Region() {
  if (saver_ == nullptr) return;
  try {
    saver_->pop_region(token_);
  } catch (...) {
    // Closed out of order by hand: the explicit pop said so already.
  }
}

Saver::Region Saver::region(std::string_view tag, RegionOptions options) {
  return Region(this, push_region(tag, options));
}
Saver::Region Saver::untagged() { return Region(this, push_untagged()); }
std::uint64_t Saver::push_region(std::string_view tag, RegionOptions options) {
  return impl_->push(&impl_->pool_for(tag, options.cpu_backup));
}
std::uint64_t Saver::push_untagged() { return impl_->push(nullptr); }
void Saver::pop_region(std::uint64_t token) { impl_->pop(token); }
std::string Saver::current_tag() const {
  const TagPool* p = impl_->current();
  return p != nullptr ? p->tag : std::string();
}

void* Saver::allocate(std::size_t size, StreamId stream) { return impl_->allocate(size, stream); }
void Saver::deallocate(void* ptr) { impl_->deallocate(ptr); }
void Saver::record_stream(void* ptr, StreamId stream) { impl_->record_stream(ptr, stream); }
void Saver::empty_cache() { impl_->empty_cache(); }

void Saver::pause(std::string_view tag) { impl_->pause(tag); }
void Saver::pause() { impl_->pause_all(); }
void Saver::resume(std::string_view tag) { impl_->resume(tag); }
void Saver::resume() { impl_->resume_all(); }

bool Saver::is_paused(std::string_view tag) const {
  std::vector<TagPool*> pools = impl_->pools_named(tag, "is_paused");
  return std::all_of(pools.begin(), pools.end(), Impl::paused_now);
}

void Saver::trim_backup() { impl_->host_cache_.empty_cache(); }

std::vector<TagInfo> Saver::tags() const {
  std::vector<TagInfo> out;
  for (TagPool* p : impl_->all_pools()) out.push_back(impl_->info(*p));
  return out;
}

TagInfo Saver::tag_info(std::string_view tag) const {
  std::vector<TagPool*> pools = impl_->pools_named(tag, "tag_info");
  TagInfo total = impl_->info(*pools.front());
  for (std::size_t i = 1; i < pools.size(); ++i) {
    const TagInfo t = impl_->info(*pools[i]);
    total.cpu_backup = total.cpu_backup || t.cpu_backup;
    total.paused = total.paused && t.paused;
    total.allocated_bytes += t.allocated_bytes;
    total.reserved_bytes += t.reserved_bytes;
    total.physical_bytes += t.physical_bytes;
    total.backup_bytes += t.backup_bytes;
    total.pending_frees += t.pending_frees;
    total.last_pause_copied += t.last_pause_copied;
    total.last_resume_copied += t.last_resume_copied;
    total.last_released_bytes += t.last_released_bytes;
    total.last_pause_seconds += t.last_pause_seconds;
    total.last_resume_seconds += t.last_resume_seconds;
  }
  return total;
}

DeviceStats Saver::stats() const {
  const std::shared_ptr<CombinedStats> combined = impl_->combined();
  DeviceStats total = impl_->untagged_.stats();
  for (TagPool* p : impl_->all_pools()) add_stats(total, p->allocator.stats());
  if (combined) {
    total.for_each_stat_pair(combined->read(), [](Stat& s, const Stat& exact) {
      s.current = exact.current;
      s.peak = exact.peak;
    });
  }
  return total;
}

void Saver::reset_peak_stats() {
  impl_->untagged_.reset_peak_stats();
  for (TagPool* p : impl_->all_pools()) p->allocator.reset_peak_stats();
  if (const std::shared_ptr<CombinedStats> combined = impl_->combined()) combined->reset_peaks();
}

void Saver::reset_accumulated_stats() {
  impl_->untagged_.reset_accumulated_stats();
  for (TagPool* p : impl_->all_pools()) p->allocator.reset_accumulated_stats();
}

DeviceStats Saver::stats(std::string_view tag) const {
  std::vector<TagPool*> pools = impl_->pools_named(tag, "stats");
  DeviceStats total = pools.front()->allocator.stats();
  for (std::size_t i = 1; i < pools.size(); ++i) add_stats(total, pools[i]->allocator.stats());
  return total;
}

std::map<std::string, std::int64_t> Saver::stats_map() const { return to_map(stats()); }

std::string Saver::memory_summary(bool abbreviated) const {
  std::string out = "Untagged memory\n" + impl_->untagged_.memory_summary(abbreviated);
  for (TagPool* p : impl_->all_pools()) {
    const TagInfo t = impl_->info(*p);
    out += fmt::format("\nTag '{}'{}: {}, {} bytes of physical memory, {} bytes backed up\n",
                       t.tag, t.cpu_backup ? " (cpu backup)" : "", t.paused ? "paused" : "running",
                       t.physical_bytes, t.backup_bytes);
    out += p->allocator.memory_summary(abbreviated);
  }
  return out;
}

void Saver::record_history(const HistoryOptions& options) { impl_->record_history(options); }

Snapshot Saver::snapshot() const { return impl_->snapshot(); }

CachingAllocator& Saver::untagged_allocator() { return impl_->untagged_; }

void Saver::validate() const {
  impl_->untagged_.validate();
  if (const std::shared_ptr<CombinedStats> combined = impl_->combined()) {
    // Compared only when nothing was published while the allocators were
    // read (each publishes before releasing its lock, so then the two agree).
    const std::uint64_t before = combined->version();
    DeviceStats summed = impl_->untagged_.stats();
    for (TagPool* p : impl_->all_pools()) add_stats(summed, p->allocator.stats());
    const DeviceStats sum = combined->read();
    if (combined->version() == before) {
      const auto want = to_map(summed);
      const auto got = to_map(sum);
      auto ends_with = [](const std::string& key, std::string_view end) {
        return key.size() > end.size() && key.compare(key.size() - end.size(), end.size(), end) == 0;
      };
      for (const auto& [key, value] : got) {
        if (ends_with(key, ".current") && value != want.at(key)) {
          throw InvariantError(fmt::format(
              "saver: combined statistics have {} = {}, the allocators add up to {}", key, value,
              want.at(key)));
        }
        if (ends_with(key, ".peak")) {
          const std::int64_t current = got.at(key.substr(0, key.size() - 5) + ".current");
          if (value < current) {
            throw InvariantError(fmt::format(
                "saver: combined statistics have {} = {}, below the current {}", key, value,
                current));
          }
        }
      }
    }
  }
  for (TagPool* p : impl_->all_pools()) {
    std::shared_lock lock(p->mutex);
    p->allocator.validate();
    p->device.validate();
    if (p->paused != p->device.paused()) {
      throw InvariantError(fmt::format("saver: tag '{}' is {} but its memory is {}", p->tag,
                                       p->paused ? "paused" : "running",
                                       p->device.paused() ? "released" : "mapped"));
    }
    if (p->paused && p->device.physical_bytes() != 0) {
      throw InvariantError(fmt::format("saver: paused tag '{}' holds {} bytes of physical memory",
                                       p->tag, p->device.physical_bytes()));
    }
  }
}

}  // namespace reservoir
