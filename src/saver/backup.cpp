#include "backup.hpp"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "reservoir/errors.hpp"

namespace reservoir::detail {

namespace {

class PinnedStore final : public HostStore {
 public:
  PinnedStore(HostCachingAllocator& cache, std::size_t bytes, std::size_t chunk)
      : cache_(cache), bytes_(bytes), chunk_(chunk) {
    buffers_.reserve((bytes + chunk - 1) / chunk);
    try {
      for (std::size_t at = 0; at < bytes; at += chunk) {
        buffers_.push_back(static_cast<std::byte*>(cache.allocate(std::min(chunk, bytes - at))));
      }
    } catch (...) {
      release();
      throw;
    }
  }
  ~PinnedStore() override { release(); }
  PinnedStore(const PinnedStore&) = delete;
  PinnedStore& operator=(const PinnedStore&) = delete;

  std::size_t size() const noexcept override { return bytes_; }
  std::byte* at(std::size_t offset, std::size_t* contiguous) noexcept override {
    const std::size_t i = offset / chunk_;
    const std::size_t within = offset % chunk_;
    *contiguous = std::min(chunk_ - within, bytes_ - offset);
    return buffers_[i] + within;
  }
  bool staged() const noexcept override { return false; }

 private:
  void release() noexcept {
    for (std::byte* b : buffers_) {
      try {
        cache_.deallocate(b);
      } catch (...) {
        // Only a foreign pointer throws, and these came from the cache.
      }
    }
    buffers_.clear();
  }

  HostCachingAllocator& cache_;
  std::size_t bytes_;
  std::size_t chunk_;
  std::vector<std::byte*> buffers_;
};

class MmapStore final : public HostStore {
 public:
  MmapStore(const std::string& directory, std::size_t bytes) : bytes_(bytes) {
    if (directory.empty()) {
      fd_ = ::memfd_create("reservoir-backup", MFD_CLOEXEC);
      if (fd_ < 0) throw UsageError(fmt::format("backup: memfd_create failed: {}", std::strerror(errno)));
    } else {
      fd_ = ::open(directory.c_str(), O_TMPFILE | O_RDWR | O_CLOEXEC, 0600);
      if (fd_ < 0) {
        throw UsageError(fmt::format("backup: cannot create a file in mmap directory '{}': {}",
                                     directory, std::strerror(errno)));
      }
    }
    int err = ::ftruncate(fd_, static_cast<off_t>(bytes)) == 0 ? 0 : errno;
    if (err == 0 && !directory.empty()) err = ::posix_fallocate(fd_, 0, static_cast<off_t>(bytes));
    if (err != 0) {
      ::close(fd_);
      throw OutOfMemoryError(
          fmt::format("backup: cannot reserve {} bytes of {}: {}", bytes,
                      directory.empty() ? std::string("shared memory") : "'" + directory + "'",
                      std::strerror(err)),
          bytes, 0, 0);
    }
    void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd_, 0);
    if (p == MAP_FAILED) {
      err = errno;
      ::close(fd_);
      throw OutOfMemoryError(fmt::format("backup: mmap of {} bytes failed: {}", bytes, std::strerror(err)),
                             bytes, 0, 0);
    }
    base_ = static_cast<std::byte*>(p);
  }
  ~MmapStore() override {
    ::munmap(base_, bytes_);
    ::close(fd_);
  }
  MmapStore(const MmapStore&) = delete;
  MmapStore& operator=(const MmapStore&) = delete;

  std::size_t size() const noexcept override { return bytes_; }
  std::byte* at(std::size_t offset, std::size_t* contiguous) noexcept override {
    *contiguous = bytes_ - offset;
    return base_ + offset;
  }
  bool staged() const noexcept override { return true; }
  // The contents stay in the file (or the shared memory object); the
  // process's page tables let go of them until resume reads them again.
  void backed_up() noexcept override { (void)::madvise(base_, bytes_, MADV_DONTNEED); }

 private:
  std::size_t bytes_;
  int fd_ = -1;
  std::byte* base_ = nullptr;
};

}  // namespace

std::unique_ptr<HostStore> make_pinned_store(HostCachingAllocator& cache, std::size_t bytes,
                                             std::size_t chunk) {
  return std::make_unique<PinnedStore>(cache, bytes, chunk);
}

namespace {
class ZeroStore final : public HostStore {
 public:
  ZeroStore(std::size_t bytes, std::size_t chunk) : bytes_(bytes), zeros_(chunk) {}
  std::size_t size() const noexcept override { return bytes_; }
  std::byte* at(std::size_t offset, std::size_t* contiguous) noexcept override {
    const std::size_t in = offset % zeros_.size();
    *contiguous = std::min(zeros_.size() - in, bytes_ - offset);
    return zeros_.data() + in;
  }
  bool staged() const noexcept override { return true; }

 private:
  std::size_t bytes_;
  std::vector<std::byte> zeros_;
};
}  // namespace

std::unique_ptr<HostStore> make_zero_store(std::size_t bytes, std::size_t chunk) {
  return std::make_unique<ZeroStore>(bytes, chunk);
}

std::unique_ptr<HostStore> make_mmap_store(const std::string& directory, std::size_t bytes) {
  return std::make_unique<MmapStore>(directory, bytes);
}

CopyEngine::CopyEngine(Device& device, HostCachingAllocator& cache, std::size_t chunk,
                       const std::vector<StreamId>& streams, HostStore& store, bool to_host)
    : device_(device),
      cache_(cache),
      chunk_(chunk),
      streams_(streams),
      store_(store),
      to_host_(to_host),
      staged_(store.staged()),
      slots_(streams.size()) {
  if (!staged_) return;
  try {
    for (Slot& s : slots_) s.staging = static_cast<std::byte*>(cache_.allocate(chunk_));
  } catch (...) {
    for (Slot& s : slots_) {
      if (s.staging != nullptr) cache_.deallocate(s.staging);
    }
    throw;
  }
}

CopyEngine::~CopyEngine() {
  (void)finish();
  for (Slot& s : slots_) {
    if (s.staging == nullptr) continue;
    try {
      cache_.deallocate(s.staging);
    } catch (...) {
      // Only a foreign pointer throws, and these came from the cache.
    }
  }
}

// Waits for slot k; a staged copy to the host lands in the store then.
Status CopyEngine::drain(std::size_t k) {
  Slot& s = slots_[k];
  if (!s.busy) return Status::ok;
  s.busy = false;
  if (Status st = device_.synchronize_stream(streams_[k]); st != Status::ok) return st;
  if (to_host_ && staged_) std::memcpy(s.host, s.staging, s.bytes);
  return Status::ok;
}

StepFailure CopyEngine::issue(const BackupPiece& piece) {
  if (failure_.failed()) return failure_;
  for (std::size_t done = 0; done < piece.bytes;) {
    std::size_t contiguous = 0;
    std::byte* host = store_.at(piece.offset + done, &contiguous);
    const std::size_t len = std::min({piece.bytes - done, contiguous, chunk_});
    const std::size_t k = next_++ % slots_.size();
    Slot& slot = slots_[k];
    // Unstaged copies queue up on their stream; a staging buffer is reused
    // only once its previous copy completed.
    if (staged_) {
      if (Status st = drain(k); st != Status::ok) {
        failure_ = {CallKind::synchronize_stream, st};
        break;
      }
    }
    const DevicePtr dev = piece.addr + done;
    if (to_host_) {
      const Status st = device_.copy_to_host(staged_ ? slot.staging : host, dev, len, streams_[k]);
      if (st != Status::ok) {
        failure_ = {CallKind::copy_to_host, st};
        break;
      }
    } else {
      if (staged_) std::memcpy(slot.staging, host, len);
      const Status st = device_.copy_to_device(dev, staged_ ? slot.staging : host, len, streams_[k]);
      if (st != Status::ok) {
        failure_ = {CallKind::copy_to_device, st};
        break;
      }
    }
    slot.host = host;
    slot.bytes = len;
    slot.busy = true;
    done += len;
    issued_ += len;
  }
  if (failure_.failed()) (void)finish();
  return failure_;
}

StepFailure CopyEngine::finish() {
  for (std::size_t k = 0; k < slots_.size(); ++k) {
    if (Status st = drain(k); st != Status::ok && !failure_.failed()) {
      failure_ = {CallKind::synchronize_stream, st};
    }
  }
  return failure_;
}

}  // namespace reservoir::detail
