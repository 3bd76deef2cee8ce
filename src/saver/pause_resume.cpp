// Pause and resume of a tag. Pause synchronizes the device, copies the live
// allocations to host memory (cpu_backup) over the copy streams in chunks,
// and releases the tag's physical memory, keeping its addresses; resume maps
// memory back at the same addresses and copies the contents back. A failure
// leaves the tag as it was (pause) or paused and retryable (resume).
#include "saver_impl.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <chrono>
#include <cstring>

#include "reservoir/errors.hpp"

namespace reservoir {

using detail::TagState;

namespace {

using detail::BackupPiece;
using Clock = std::chrono::steady_clock;

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

}  // namespace

std::vector<TagState*> Saver::Impl::all_tags() const {
  detail::SharedLock lock(tags_mutex_);
  std::vector<TagState*> out;
  for (const auto& [key, state] : tags_) out.push_back(state.get());
  return out;
}

std::vector<TagState*> Saver::Impl::tags_named(std::string_view tag, const char* operation) const {
  std::vector<TagState*> out;
  std::vector<std::string> known;
  for (TagState* state : all_tags()) {
    if (state->tag == tag) out.push_back(state);
    if (known.empty() || known.back() != state->tag) known.push_back(state->tag);
  }
  if (out.empty()) {
    throw UsageError(fmt::format("{}: unknown tag '{}' (known tags: {})", operation, tag,
                                 known.empty() ? std::string("none") : fmt::format("'{}'", fmt::join(known, "', '"))));
  }
  return out;
}

bool Saver::Impl::paused_now(TagState* state) {
  detail::SharedLock lock(state->mutex);
  return state->paused;
}

const std::vector<StreamId>& Saver::Impl::copy_streams() {
  detail::LockGuard lock(streams_mutex_);
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

void Saver::Impl::pause_tag(TagState& state, PauseContents contents) {
  detail::UniqueLock lock(state.mutex);
  if (state.paused) return;
  const auto t0 = Clock::now();
  const std::string what = fmt::format("pause of tag '{}'", state.tag);
  if (Status s = tag_base_.synchronize_device(); s != Status::ok) {
    throw DeviceError(CallKind::synchronize_device, s,
                      what + ": synchronizing the device (the tag is left running, untouched)");
  }
  // The live allocations: what must survive (and, with backup, be copied).
  std::unordered_set<DevicePtr> live;
  std::vector<BackupPiece> pieces;
  std::size_t total = 0;
  const bool copy = state.cpu_backup && contents == PauseContents::as_regions;
  for (const auto& [address, requested] : state.allocator.live_allocations()) {
    live.insert(address);
    if ((copy || contents == PauseContents::zero) && requested > 0) {
      pieces.push_back({address, requested, total});
      total += requested;
    }
  }
  std::unique_ptr<detail::HostStore> store;
  if (contents == PauseContents::zero) {
    // What comes back is zeros: nothing to copy now.
    store = detail::make_zero_store(total, options_.chunk_bytes);
  } else if (total > 0) {
    switch (state.storage) {
      case BackupStorage::pinned:
        store = detail::make_pinned_store(host_cache_, total, options_.chunk_bytes);
        break;
      case BackupStorage::mmap:
        store = detail::make_mmap_store(options_.mmap_directory, total);
        break;
      case BackupStorage::disk: {
        const std::string directory = disk_backup_dir();
        if (directory.empty()) {
          throw UsageError(fmt::format(
              "{}: its backup goes to disk, and no disk backup directory is set "
              "(Saver::set_disk_backup_dir, SaverOptions::disk_directory; the tag is left running, "
              "untouched)",
              what));
        }
        store = detail::make_mmap_store(directory, total);
        break;
      }
    }
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
  if (auto f = state.device.release_all(&released); f.failed()) {
    throw DeviceError(f.call, f.status,
                      fmt::format("{}: releasing its memory (the tag is left running, untouched)", what));
  }
  if (store) store->backed_up();
  {
    detail::LockGuard pending(state.pending_mutex);
    state.live_at_pause = std::move(live);
    state.pending_frees.clear();
  }
  state.backup = std::move(store);
  state.pieces = std::move(pieces);
  state.zeroed = contents == PauseContents::zero;
  state.paused = true;
  state.record.pauses += 1;
  state.record.last_pause_copied = state.zeroed ? 0 : total;
  state.record.last_released_bytes = released;
  state.record.last_pause_seconds = seconds_since(t0);
}

void Saver::Impl::resume_tag(TagState& state) {
  detail::UniqueLock lock(state.mutex);
  if (!state.paused) return;
  const auto t0 = Clock::now();
  const std::string what = fmt::format("resume of tag '{}'", state.tag);
  const char* const stays =
      state.backup && !state.zeroed ? "the tag stays paused with its backup" : "the tag stays paused";
  (void)state.device.retry_releases();
  // What comes back from the host: the backup less the blocks freed meanwhile.
  std::vector<BackupPiece> wanted;
  std::size_t copied = 0;
  if (state.backup) {
    std::unordered_set<DevicePtr> freed;
    {
      detail::LockGuard pending(state.pending_mutex);
      for (void* p : state.pending_frees) freed.insert(reinterpret_cast<DevicePtr>(p));
    }
    for (const BackupPiece& p : state.pieces) {
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
    engine.emplace(tag_base_, host_cache_, options_.chunk_bytes, copy_streams(), *state.backup,
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
  detail::StepFailure f = state.device.restore_all(on_mapped, before_undo);
  if (!f.failed() && engine) {
    f = engine->finish();
    if (f.failed()) {
      std::size_t ignored = 0;
      const bool back = !state.device.release_all(&ignored).failed();
      if (!back) state.paused = false;  // mapped, contents incomplete: say so
      throw DeviceError(f.call, f.status,
                        fmt::format("{}: {} {} bytes {} ({})", what, state.zeroed ? "zeroing" : "copying",
                                    copied, state.zeroed ? "of its allocations" : "back from host memory",
                                    back ? stays
                                         : "its memory could not be released again: the tag "
                                           "is running with incomplete contents"));
    }
  }
  if (f.failed()) {
    if (f.status == Status::out_of_memory) {
      MemoryInfo info;
      (void)tag_base_.memory_info(&info);
      const std::size_t needed = state.allocator.stats().reserved_bytes[0].current;
      throw OutOfMemoryError(
          fmt::format("{}: out of memory recreating its {} bytes of physical memory ({} bytes "
                      "free of {}); {}",
                      what, needed, info.free, info.total, stays),
          needed, info.free, info.total);
    }
    throw DeviceError(f.call, f.status,
                      fmt::format("{}: {} ({})", what,
                                  f.call == CallKind::copy_to_device || f.call == CallKind::synchronize_stream
                                      ? (state.zeroed ? "zeroing its allocations"
                                                      : "copying its contents back from host memory")
                                      : "mapping its memory again",
                                  stays));
  }
  state.paused = false;
  engine.reset();
  if (!retain_backup_.load(std::memory_order_relaxed) || state.zeroed) {
    state.backup.reset();
    state.pieces.clear();
  }
  state.zeroed = false;
  std::vector<void*> frees;
  {
    detail::LockGuard pending(state.pending_mutex);
    frees.swap(state.pending_frees);
    state.live_at_pause.clear();
  }
  for (void* p : frees) state.allocator.deallocate(p);  // checked live when queued
  state.record.resumes += 1;
  state.record.last_resume_copied = copied;
  state.record.last_resume_seconds = seconds_since(t0);
}

void Saver::Impl::pause(std::string_view tag, PauseContents contents) {
  std::vector<TagState*> states = tags_named(tag, "pause");
  if (std::all_of(states.begin(), states.end(), paused_now)) {
    throw UsageError(fmt::format("pause: tag '{}' is paused already", tag));
  }
  for (TagState* p : states) pause_tag(*p, contents);
}

std::string_view to_string(PauseContents contents) noexcept {
  switch (contents) {
    case PauseContents::as_regions: return "as_regions";
    case PauseContents::discard: return "discard";
    case PauseContents::zero: return "zero";
  }
  return "as_regions";
}

PauseContents parse_pause_contents(std::string_view text, std::string_view what) {
  for (PauseContents c : {PauseContents::as_regions, PauseContents::discard, PauseContents::zero}) {
    if (text == to_string(c)) return c;
  }
  throw UsageError(fmt::format("{}: '{}' is not a way to pause (as_regions, discard or zero)", what, text));
}

void Saver::Impl::resume(std::string_view tag) {
  std::vector<TagState*> states = tags_named(tag, "resume");
  if (std::none_of(states.begin(), states.end(), paused_now)) {
    throw UsageError(fmt::format("resume: tag '{}' is not paused", tag));
  }
  for (TagState* p : states) resume_or_reclaim(*p);
}

std::int64_t Saver::Impl::reclaim(const TagState& except) {
  auto reserved = [](const CachingAllocator& a) { return a.stats().reserved_bytes[0].current; };
  std::int64_t released = reserved(untagged_);
  untagged_.empty_cache();
  released -= reserved(untagged_);
  for (TagState* state : all_tags()) {
    if (state == &except) continue;
    detail::SharedLock lock(state->mutex);
    if (state->paused) continue;  // its memory is gone already
    const std::int64_t before = reserved(state->allocator);
    state->allocator.empty_cache();
    released += before - reserved(state->allocator);
  }
  return released;
}

void Saver::Impl::resume_or_reclaim(TagState& state) {
  try {
    resume_tag(state);
  } catch (const OutOfMemoryError&) {
    // Cached memory of the other allocators is memory this resume may have:
    // give it back to the device and try once more.
    if (reclaim(state) <= 0) throw;
    resume_tag(state);
  }
}

void Saver::Impl::pause_all() {
  for (TagState* p : all_tags()) pause_tag(*p);
}

void Saver::Impl::resume_all() {
  for (TagState* p : all_tags()) resume_or_reclaim(*p);
}

void Saver::Impl::set_retain_backup(bool on) {
  retain_backup_.store(on, std::memory_order_relaxed);
  if (on) return;
  for (TagState* state : all_tags()) {
    detail::UniqueLock lock(state->mutex);
    if (!state->paused) {
      state->backup.reset();
      state->pieces.clear();
    }
  }
}

bool Saver::Impl::read_backup(const void* ptr, std::size_t bytes, void* out) const {
  TagState* state = owner_of(ptr);
  if (state == nullptr) return false;
  const auto addr = reinterpret_cast<DevicePtr>(ptr);
  detail::SharedLock lock(state->mutex);
  if (!state->backup || state->zeroed) return false;
  for (const BackupPiece& p : state->pieces) {
    if (addr < p.addr || addr >= p.addr + p.bytes) continue;
    if (bytes > p.addr + p.bytes - addr) {
      throw UsageError(fmt::format(
          "read_backup: {} bytes from {:#x} run past the backed-up allocation of tag '{}' at "
          "{:#x} ({} bytes)",
          bytes, addr, state->tag, p.addr, p.bytes));
    }
    auto* to = static_cast<std::byte*>(out);
    std::size_t offset = p.offset + (addr - p.addr);
    for (std::size_t left = bytes; left > 0;) {
      std::size_t contiguous = 0;
      const std::byte* from = state->backup->at(offset, &contiguous);
      const std::size_t n = std::min(left, contiguous);
      std::memcpy(to, from, n);
      to += n;
      offset += n;
      left -= n;
    }
    return true;
  }
  return false;
}

}  // namespace reservoir
