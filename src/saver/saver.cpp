// Saver: tags, regions, pause and resume (reservoir/saver.hpp): the public
// class, forwarding to Saver::Impl (saver_impl.hpp).
#include <cctype>
#include <cstdlib>
#include "reservoir/saver.hpp"

#include <fmt/format.h>

#include <filesystem>
#include <system_error>

#include "reservoir/errors.hpp"
#include "saver_impl.hpp"

namespace reservoir {

using detail::TagState;

namespace {

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

void check(const SaverOptions& o) {
  const std::size_t c = o.chunk_bytes;
  if (c < (std::size_t{64} << 10) || (c & (c - 1)) != 0) {
    throw UsageError(
        fmt::format("SaverOptions::chunk_bytes = {}: must be a power of two of at least 65536", c));
  }
  if (o.copy_streams < 1 || o.copy_streams > 64) {
    throw UsageError(
        fmt::format("SaverOptions::copy_streams = {}: must be 1 to 64", o.copy_streams));
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
Saver::Region Saver::untagged() {
  return Region(this, push_untagged());
}
namespace {

// A torch_memory_saver flag: on, off, or (anything else) a UsageError.
bool tms_flag(const char* value, const char* name) {
  if (value == nullptr || *value == '\0') return false;
  std::string v(value);
  for (char& ch : v) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  if (v == "1" || v == "true" || v == "yes" || v == "on") return true;
  if (v == "0" || v == "false" || v == "no" || v == "off") return false;
  throw UsageError(fmt::format("{}={}: not a flag (1, true, yes, on; or 0, false, no, off)", name, value));
}

}  // namespace

std::optional<SaverOptions::InitialRegion> initial_region_from_tms_env(const char* enable,
                                                                       const char* cpu_backup,
                                                                       const char* disk_backup,
                                                                       const char* backend) {
  const bool on = tms_flag(enable, "TMS_INIT_ENABLE");
  const bool cpu = tms_flag(cpu_backup, "TMS_INIT_ENABLE_CPU_BACKUP");
  const bool disk = tms_flag(disk_backup, "TMS_INIT_ENABLE_DISK_BACKUP");
  if (!on) return std::nullopt;
  SaverOptions::InitialRegion region;
  if (disk) {
    region.options.cpu_backup = true;
    region.options.storage = BackupStorage::disk;
  } else if (cpu) {
    region.options.cpu_backup = true;
    region.options.storage = backend != nullptr && *backend != '\0'
                                 ? parse_backup_storage(backend, "TMS_INIT_CPU_BACKUP_BACKEND")
                                 : BackupStorage::pinned;
  }
  return region;
}

void read_saver_environment(SaverOptions& options) {
  auto get = [](const char* name) -> const char* {
    const char* v = std::getenv(name);
    return v != nullptr && *v != '\0' ? v : nullptr;
  };
  if (const char* storage = get("RESERVOIR_BACKUP_STORAGE")) {
    options.storage = parse_backup_storage(storage, "RESERVOIR_BACKUP_STORAGE");
  }
  if (const char* dir = std::getenv("RESERVOIR_BACKUP_DIR")) options.mmap_directory = dir;
  if (const char* dir = get("RESERVOIR_DISK_BACKUP_DIR")) {
    options.disk_directory = dir;
  } else if (const char* tms_dir = get("TMS_DISK_BACKUP_DIR")) {
    options.disk_directory = tms_dir;
  }
  if (const char* mib = get("TMS_DISK_BACKUP_CHUNK_MB")) {
    char* end = nullptr;
    const unsigned long long n = std::strtoull(mib, &end, 10);
    if (end == mib || *end != '\0' || n == 0 || n > (std::uint64_t{1} << 20)) {
      throw UsageError(fmt::format("TMS_DISK_BACKUP_CHUNK_MB={}: not a number of MiB from 1 to 1048576", mib));
    }
    std::size_t bytes = std::size_t{1} << 20;
    while (bytes * 2 <= (static_cast<std::size_t>(n) << 20)) bytes *= 2;
    options.chunk_bytes = bytes;
  }
  options.initial_region = initial_region_from_tms_env(get("TMS_INIT_ENABLE"), get("TMS_INIT_ENABLE_CPU_BACKUP"),
                                                       get("TMS_INIT_ENABLE_DISK_BACKUP"),
                                                       get("TMS_INIT_CPU_BACKUP_BACKEND"));
}

std::uint64_t Saver::push_region(std::string_view tag, RegionOptions options) {
  return impl_->push(&impl_->tag_state(tag, options));
}
std::uint64_t Saver::push_untagged() {
  return impl_->push(nullptr);
}
void Saver::pop_region(std::uint64_t token) {
  impl_->pop(token);
}
std::string Saver::current_tag() const {
  const TagState* p = impl_->current();
  return p != nullptr ? p->tag : std::string();
}

void* Saver::allocate(std::size_t size, StreamId stream) {
  return impl_->allocate(size, stream);
}
void Saver::deallocate(void* ptr) {
  impl_->deallocate(ptr);
}
bool Saver::tagged(const void* ptr) const {
  return impl_->owner_of(ptr) != nullptr;
}
std::size_t Saver::block_size(const void* ptr) const {
  TagState* state = impl_->owner_of(ptr);
  if (state == nullptr) return impl_->untagged_.block_size(ptr);
  detail::SharedLock lock(state->mutex);
  return state->allocator.block_size(ptr);
}
void Saver::record_stream(void* ptr, StreamId stream) {
  impl_->record_stream(ptr, stream);
}
void Saver::begin_allocate_to_pool(PoolId id, PoolFilter filter) {
  impl_->begin_allocate_to_pool(id, std::move(filter));
}
void Saver::end_allocate_to_pool(PoolId id) {
  impl_->end_allocate_to_pool(id);
}
void Saver::release_pool(PoolId id) {
  impl_->release_pool(id);
}
void Saver::set_pool_allocator(PoolId id, std::shared_ptr<PoolSegmentAllocator> allocator) {
  impl_->set_pool_allocator(id, std::move(allocator));
}
void Saver::empty_cache() {
  impl_->empty_cache();
}

// Pause and resume, then (validation mode) the saver's validator, also when
// they threw: a failed pause or resume must leave every record consistent.
template <typename Call>
void Saver::checked(Call&& call) {
  if (!impl_->validate_each_call_.load(std::memory_order_relaxed)) return call();
  try {
    call();
  } catch (const InvariantError&) {
    throw;
  } catch (...) {
    validate();
    throw;
  }
  validate();
}

void Saver::pause(std::string_view tag) {
  checked([&] { impl_->pause(tag); });
}
void Saver::pause(std::string_view tag, PauseContents contents) {
  impl_->pause(tag, contents);
}
void Saver::pause() {
  checked([&] { impl_->pause_all(); });
}
void Saver::resume(std::string_view tag) {
  checked([&] { impl_->resume(tag); });
}
void Saver::resume() {
  checked([&] { impl_->resume_all(); });
}

void Saver::set_validate_each_call(bool on) {
  impl_->set_validate_each_call(on);
}

bool Saver::is_paused(std::string_view tag) const {
  std::vector<TagState*> states = impl_->tags_named(tag, "is_paused");
  return std::all_of(states.begin(), states.end(), Impl::paused_now);
}

void Saver::trim_backup() {
  impl_->host_cache_.empty_cache();
}

void Saver::set_disk_backup_dir(const std::string& path) {
  if (path.empty()) throw UsageError("set_disk_backup_dir: the path is empty");
  std::error_code ec;
  std::filesystem::create_directories(path, ec);
  if (ec || !std::filesystem::is_directory(path)) {
    throw UsageError(fmt::format("set_disk_backup_dir: cannot make the directory '{}': {}", path,
                                 ec ? ec.message() : "a file of that name exists"));
  }
  detail::LockGuard lock(impl_->disk_mutex_);
  impl_->disk_directory_ = path;
}
std::string Saver::disk_backup_dir() const {
  return impl_->disk_backup_dir();
}
void Saver::set_retain_backup(bool on) {
  impl_->set_retain_backup(on);
}
bool Saver::retain_backup() const noexcept {
  return impl_->retain_backup_.load(std::memory_order_relaxed);
}
void Saver::set_memory_margin(std::size_t bytes) noexcept {
  impl_->memory_margin_.store(bytes, std::memory_order_relaxed);
}
std::size_t Saver::memory_margin() const noexcept {
  return impl_->memory_margin_.load(std::memory_order_relaxed);
}
bool Saver::read_backup(const void* ptr, std::size_t bytes, void* out) const {
  if (bytes == 0) return false;
  if (out == nullptr) throw UsageError("read_backup: the destination is null");
  return impl_->read_backup(ptr, bytes, out);
}

std::string_view to_string(BackupStorage storage) noexcept {
  switch (storage) {
    case BackupStorage::pinned:
      return "pinned";
    case BackupStorage::mmap:
      return "mmap";
    case BackupStorage::disk:
      return "disk";
  }
  return "pinned";
}

BackupStorage parse_backup_storage(std::string_view text, std::string_view what) {
  if (text == "pinned") return BackupStorage::pinned;
  if (text == "mmap") return BackupStorage::mmap;
  if (text == "disk") return BackupStorage::disk;
  throw UsageError(fmt::format("{}: '{}' is not 'pinned', 'mmap' or 'disk'", what, text));
}

std::vector<TagInfo> Saver::tags() const {
  std::vector<TagInfo> out;
  for (TagState* p : impl_->all_tags()) out.push_back(impl_->info(*p));
  return out;
}

TagInfo Saver::tag_info(std::string_view tag) const {
  std::vector<TagState*> states = impl_->tags_named(tag, "tag_info");
  TagInfo total = impl_->info(*states.front());
  for (std::size_t i = 1; i < states.size(); ++i) {
    const TagInfo t = impl_->info(*states[i]);
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
  for (TagState* p : impl_->all_tags()) add_stats(total, p->allocator.stats());
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
  for (TagState* p : impl_->all_tags()) p->allocator.reset_peak_stats();
  if (const std::shared_ptr<CombinedStats> combined = impl_->combined()) combined->reset_peaks();
}

void Saver::reset_accumulated_stats() {
  impl_->untagged_.reset_accumulated_stats();
  for (TagState* p : impl_->all_tags()) p->allocator.reset_accumulated_stats();
}

DeviceStats Saver::stats(std::string_view tag) const {
  std::vector<TagState*> states = impl_->tags_named(tag, "stats");
  DeviceStats total = states.front()->allocator.stats();
  for (std::size_t i = 1; i < states.size(); ++i) add_stats(total, states[i]->allocator.stats());
  return total;
}

std::map<std::string, std::int64_t> Saver::stats_map() const {
  std::map<std::string, std::int64_t> out = to_map(stats());
  // PyTorch's private pools live in the untagged allocator.
  if (reports_private_pools(impl_->untagged_.config().pytorch_version)) {
    put_private_pools(out, impl_->untagged_.private_pool_reserved());
  }
  return out;
}

std::string Saver::memory_summary(bool abbreviated) const {
  std::string out = "Untagged memory\n" + impl_->untagged_.memory_summary(abbreviated);
  for (TagState* p : impl_->all_tags()) {
    const TagInfo t = impl_->info(*p);
    out += fmt::format("\nTag '{}'{}: {}, {} bytes of physical memory, {} bytes backed up\n", t.tag,
                       t.cpu_backup ? " (cpu backup)" : "", t.paused ? "paused" : "running",
                       t.physical_bytes, t.backup_bytes);
    out += p->allocator.memory_summary(abbreviated);
  }
  return out;
}

void Saver::record_history(const HistoryOptions& options) {
  impl_->record_history(options);
}

void Saver::set_oom_explainer(const OomExplainer& explainer) {
  impl_->set_oom_explainer(explainer);
}

Snapshot Saver::snapshot() const {
  return impl_->snapshot();
}

CachingAllocator& Saver::untagged_allocator() {
  return impl_->untagged_;
}

void Saver::validate() const {
  impl_->untagged_.validate();
  if (const std::shared_ptr<CombinedStats> combined = impl_->combined()) {
    try {
      combined->check();  // the sum's values are the allocators', its peaks at least them
    } catch (const InvariantError& e) {
      throw InvariantError(fmt::format("saver: {}", e.what()));
    }
  }
  for (TagState* p : impl_->all_tags()) {
    detail::SharedLock lock(p->mutex);
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
