#include "event_history.hpp"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <string_view>

#include "symbolize.hpp"
#include "reservoir/errors.hpp"

namespace reservoir::detail {

void EventHistory::configure(const HistoryOptions& options) {
  if (options.enabled && options.max_entries == 0) {
    throw UsageError("record_history: max_entries must be at least 1");
  }
  if (options.max_frames > 64) {
    throw UsageError("record_history: max_frames must be at most 64");
  }
  if (!options.enabled) {
    on_ = false;
    ring_.clear();
    ring_.shrink_to_fit();
    next_ = 0;
    return;
  }
  if (options.max_entries != max_entries_ && !ring_.empty()) {
    // Keep the latest events, oldest first.
    std::rotate(ring_.begin(), ring_.begin() + static_cast<std::ptrdiff_t>(next_), ring_.end());
    if (ring_.size() > options.max_entries) {
      ring_.erase(ring_.begin(), ring_.end() - static_cast<std::ptrdiff_t>(options.max_entries));
    }
    next_ = ring_.size() % options.max_entries;
  }
  on_ = true;
  capture_stacks_ = options.stacks;
  max_frames_ = options.max_frames;
  max_entries_ = options.max_entries;
}

// Microseconds since the epoch, strictly increasing across every history of
// the process (a tie moves on by a microsecond), so events of several
// allocators merge into one order by time alone.
std::int64_t EventHistory::unique_time_us() noexcept {
  static std::atomic<std::int64_t> last{0};
  const std::int64_t now = std::chrono::duration_cast<std::chrono::microseconds>(
                               std::chrono::system_clock::now().time_since_epoch())
                               .count();
  std::int64_t prev = last.load(std::memory_order_relaxed);
  std::int64_t next = 0;
  do {
    next = std::max(now, prev + 1);
  } while (!last.compare_exchange_weak(prev, next, std::memory_order_relaxed));
  return next;
}

std::uint32_t EventHistory::record(TraceAction action, DevicePtr addr, std::uint64_t size,
                              StreamId stream) {
  std::uint32_t stack = 0;
  // Skip this function and the allocator's own frames above it (the rest
  // are cut by name when symbolized).
  if (capture_stacks_) stack = intern_stack(capture_stack(1, max_frames_ + 8));
  const std::uint32_t context = intern_context(current_annotation_id(), stack);
  Entry entry{TraceEvent{action, addr, size, stream, unique_time_us(), 0}, context};
  if (ring_.size() < max_entries_) {
    ring_.push_back(entry);
    next_ = ring_.size() % max_entries_;
  } else {
    ring_[next_] = entry;
    next_ = (next_ + 1) % max_entries_;
  }
  return context;
}

std::uint32_t EventHistory::intern_stack(std::vector<std::uintptr_t>&& pcs) {
  std::size_t hash = pcs.size();
  for (const std::uintptr_t pc : pcs) hash = hash * 1099511628211ULL ^ pc;
  std::vector<std::uint32_t>& ids = stack_ids_[hash];
  for (const std::uint32_t id : ids) {
    if (stacks_[id] == pcs) return id;
  }
  const auto id = static_cast<std::uint32_t>(stacks_.size());
  stacks_.push_back(std::move(pcs));
  ids.push_back(id);
  return id;
}

std::uint32_t EventHistory::intern_context(std::uint32_t annotation, std::uint32_t stack) {
  if (annotation == 0 && stack == 0) return 0;
  if (annotation == last_.first && stack == last_.second) return last_context_;
  last_ = {annotation, stack};
  const std::uint64_t key = (std::uint64_t{annotation} << 32) | stack;
  auto [it, inserted] = context_ids_.try_emplace(key, 0);
  if (inserted) {
    it->second = static_cast<std::uint32_t>(contexts_.size());
    contexts_.emplace_back(annotation, stack);
  }
  last_context_ = it->second;
  return it->second;
}

namespace {

// The allocator's source folder from the checkout's root ("src/allocator/"):
// debug information names its files by an absolute path, or one relative
// to the build folder where a compiler cache rewrote it ("../src/...").
constexpr std::string_view source_dir() {
  constexpr std::string_view file = __FILE__;
  constexpr std::string_view dir = file.substr(0, file.rfind('/') + 1);
  constexpr std::size_t src = dir.rfind("src/");
  return src == std::string_view::npos ? dir : dir.substr(src);
}

bool in_source_dir(std::string_view filename) {
  constexpr std::string_view dir = source_dir();
  if (dir.size() <= 1) return false;
  if (filename.starts_with(dir)) return true;
  const std::size_t at = filename.find(dir);
  return at != std::string_view::npos && at > 0 && filename[at - 1] == '/';
}

// Frames of the allocator itself (and of the capture, when not inlined), at
// the inner end of a captured stack: by name, or, for lambdas that debug
// information names only "operator()", by the file they are in.
bool internal_frame(const Frame& f) {
  return f.name.starts_with("reservoir::CachingAllocator") ||
         f.name.starts_with("reservoir::detail::") || in_source_dir(f.filename);
}

}  // namespace

std::uint32_t EventHistory::Exporter::operator()(std::uint32_t internal) {
  if (internal == 0 || internal >= history_.contexts_.size()) return 0;
  auto [it, inserted] = exported_.try_emplace(internal, 0);
  if (!inserted) return it->second;
  const auto [annotation, stack] = history_.contexts_[internal];
  Context c;
  c.annotations = annotation_path(annotation);
  if (stack != 0) {
    std::vector<Frame> frames = symbolize(history_.stacks_[stack]);
    auto first = std::find_if_not(frames.begin(), frames.end(), internal_frame);
    c.frames.assign(std::make_move_iterator(first), std::make_move_iterator(frames.end()));
    if (c.frames.size() > history_.max_frames_) c.frames.resize(history_.max_frames_);
  }
  // Different stacks can symbolize alike (different call sites of one line,
  // cut to max_frames): export each distinct context once.
  auto [same, added] = by_content_.try_emplace(context_key(c), 0);
  if (added) {
    same->second = static_cast<std::uint32_t>(out_.size());
    out_.push_back(std::move(c));
  }
  it->second = same->second;
  return it->second;
}

void EventHistory::append_events(std::vector<TraceEvent>& out, Exporter& ctx) const {
  const std::size_t n = ring_.size();
  const std::size_t start = n < max_entries_ ? 0 : next_;
  out.reserve(out.size() + n);
  for (std::size_t i = 0; i < n; ++i) {
    const Entry& e = ring_[(start + i) % n];
    TraceEvent ev = e.event;
    ev.context = ctx(e.context);
    out.push_back(ev);
  }
}

}  // namespace reservoir::detail
