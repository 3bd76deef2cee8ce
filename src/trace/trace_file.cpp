// Reading a trace file of any supported format, told apart by content.
#include <fmt/format.h>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fstream>
#include <iterator>

#include "reservoir/errors.hpp"
#include "reservoir/trace.hpp"

namespace reservoir {

std::string_view to_string(TraceFormat format) noexcept {
  switch (format) {
    case TraceFormat::pytorch_pickle: return "pytorch-snapshot";
    case TraceFormat::snapshot_json: return "snapshot-json";
    case TraceFormat::rmm_csv: return "rmm-csv";
    case TraceFormat::text: return "reservoir-text";
  }
  return "unknown";
}

TraceFormat detect_trace_format(std::string_view bytes) noexcept {
  // Pickle protocol 2 and later open with PROTO (0x80).
  if (!bytes.empty() && static_cast<unsigned char>(bytes[0]) == 0x80) {
    return TraceFormat::pytorch_pickle;
  }
  const std::size_t first = bytes.find_first_not_of(" \t\r\n");
  if (first != std::string_view::npos && bytes[first] == '{') return TraceFormat::snapshot_json;
  if (bytes.starts_with("Thread,")) return TraceFormat::rmm_csv;
  // Anything else is read as our text format, whose reader says what is wrong.
  return TraceFormat::text;
}

void set_recorded_config(Trace& trace, const std::string& text) {
  trace.settings = AllocatorConfig::parse(text);
  trace.recorded_config = text;
}

namespace {

std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw TraceError(fmt::format("trace {}: cannot open the file", path));
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (in.bad()) throw TraceError(fmt::format("trace {}: read error", path));
  return bytes;
}

std::span<const std::uint8_t> as_span(const std::string& bytes) {
  return {reinterpret_cast<const std::uint8_t*>(bytes.data()), bytes.size()};
}

// A file mapped read-only, whose pages the reader hands back behind it: a
// snapshot of hundreds of MB is never resident whole. Empty when the file
// cannot be mapped (a pipe, an empty file): callers read it instead.
class MappedFile {
 public:
  explicit MappedFile(const std::string& path) {
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) return;
    struct stat st {};
    if (::fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && st.st_size > 0) {
      void* p = ::mmap(nullptr, static_cast<std::size_t>(st.st_size), PROT_READ, MAP_PRIVATE, fd, 0);
      if (p != MAP_FAILED) {
        data_ = static_cast<const std::uint8_t*>(p);
        size_ = static_cast<std::size_t>(st.st_size);
        ::madvise(p, size_, MADV_SEQUENTIAL);
      }
    }
    ::close(fd);
  }
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  ~MappedFile() {
    if (data_ != nullptr) ::munmap(const_cast<std::uint8_t*>(data_), size_);
  }

  bool mapped() const { return data_ != nullptr; }
  std::span<const std::uint8_t> bytes() const { return {data_, size_}; }
  std::string_view head(std::size_t n) const {
    return {reinterpret_cast<const char*>(data_), std::min(n, size_)};
  }
  // Drops the pages wholly before `offset` (they are read from the file
  // again should anything touch them).
  void release_before(std::size_t offset) {
    const auto page = static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
    const std::size_t end = std::min(offset, size_) / page * page;
    if (end <= released_) return;
    ::madvise(const_cast<std::uint8_t*>(data_) + released_, end - released_, MADV_DONTNEED);
    released_ = end;
  }

 private:
  const std::uint8_t* data_ = nullptr;
  std::size_t size_ = 0;
  std::size_t released_ = 0;
};

// A pickle, when the file maps: read with its pages handed back behind the
// reader. Null when the file is not a pickle or does not map.
template <typename Read>
auto read_mapped_pickle(const std::string& path, const ReadOptions& options, Read read)
    -> std::optional<decltype(read(std::span<const std::uint8_t>{}, options))> {
  MappedFile file(path);
  if (!file.mapped() || detect_trace_format(file.head(1)) != TraceFormat::pytorch_pickle) {
    return std::nullopt;
  }
  ReadOptions mapped = options;
  mapped.consumed = [&](std::size_t offset) {
    file.release_before(offset);
    if (options.consumed) options.consumed(offset);
  };
  return read(file.bytes(), mapped);
}

// RMM and text traces: one device.
Trace read_single(const std::string& bytes, const std::string& path) {
  Trace t = detect_trace_format(bytes) == TraceFormat::rmm_csv ? read_rmm_csv(bytes, path)
                                                               : read_text_trace(bytes, path);
  t.device_events = {t.events.size()};
  return t;
}

}  // namespace

Trace read_trace_file(const std::string& path, int device) {
  if (auto t = read_mapped_pickle(path, {}, [&](std::span<const std::uint8_t> bytes,
                                                const ReadOptions& options) {
        return read_pytorch_snapshot(bytes, path, device, options);
      })) {
    return std::move(*t);
  }
  const std::string bytes = read_bytes(path);
  switch (detect_trace_format(bytes)) {
    case TraceFormat::pytorch_pickle: return read_pytorch_snapshot(as_span(bytes), path, device);
    case TraceFormat::snapshot_json: return read_snapshot_json(bytes, path, device);
    case TraceFormat::rmm_csv:
    case TraceFormat::text: break;
  }
  if (device != 0) {
    throw TraceError(fmt::format("trace {}: a {} trace holds one device; device {} was asked for",
                                 path, to_string(detect_trace_format(bytes)), device));
  }
  return read_single(bytes, path);
}

std::vector<Trace> read_trace_devices(const std::string& path, const ReadOptions& options) {
  if (auto t = read_mapped_pickle(path, options, [&](std::span<const std::uint8_t> bytes,
                                                     const ReadOptions& mapped) {
        return read_pytorch_snapshot_devices(bytes, path, mapped);
      })) {
    return std::move(*t);
  }
  const std::string bytes = read_bytes(path);
  switch (detect_trace_format(bytes)) {
    case TraceFormat::pytorch_pickle:
      return read_pytorch_snapshot_devices(as_span(bytes), path, options);
    case TraceFormat::snapshot_json: return read_snapshot_json_devices(bytes, path);
    case TraceFormat::rmm_csv:
    case TraceFormat::text: break;
  }
  std::vector<Trace> out;
  out.push_back(read_single(bytes, path));
  return out;
}

std::vector<Trace> select_devices(std::vector<Trace> devices, std::optional<int> device) {
  if (devices.empty()) return devices;
  if (device) {
    if (*device < 0 || static_cast<std::size_t>(*device) >= devices.size()) {
      throw TraceError(fmt::format("trace {}: no device {} (the file holds {})",
                                   devices.front().name, *device, devices.size()));
    }
    std::vector<Trace> one;
    one.push_back(std::move(devices[static_cast<std::size_t>(*device)]));
    return one;
  }
  std::vector<Trace> used;
  for (Trace& t : devices) {
    if (!t.events.empty() || !t.final_state.segments.empty()) used.push_back(std::move(t));
  }
  if (used.empty()) used.push_back(std::move(devices.front()));
  return used;
}

}  // namespace reservoir
