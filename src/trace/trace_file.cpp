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

namespace {

std::string as_string(std::span<const std::uint8_t> bytes) {
  return {reinterpret_cast<const char*>(bytes.data()), bytes.size()};
}

// Formats of one device: their one trace, with its event count as the device's.
template <Trace (*Read)(const std::string&, const std::string&)>
std::vector<Trace> read_one_device(std::span<const std::uint8_t> bytes, const std::string& name,
                                   const ReadOptions&) {
  std::vector<Trace> out;
  out.push_back(Read(as_string(bytes), name));
  out.back().device_events = {out.back().events.size()};
  return out;
}

constexpr std::string_view kPickleEndings[] = {".pickle", ".pkl"};
constexpr std::string_view kJsonEndings[] = {".json"};
constexpr std::string_view kTextEndings[] = {".trace", ".txt"};

const TraceFormatInfo kFormats[] = {
    {TraceFormat::pytorch_pickle, "pytorch-snapshot", "pickle", kPickleEndings,
     // Pickle protocol 2 and later open with PROTO (0x80).
     [](std::string_view head) noexcept {
       return !head.empty() && static_cast<unsigned char>(head[0]) == 0x80;
     },
     [](std::span<const std::uint8_t> bytes, const std::string& name, const ReadOptions& options) {
       return read_pytorch_snapshot_devices(bytes, name, options);
     },
     [](std::span<const std::uint8_t> bytes, const std::string& name, int device,
        const ReadOptions& options) { return read_pytorch_snapshot(bytes, name, device, options); },
     &write_pytorch_snapshot},
    {TraceFormat::snapshot_json, "snapshot-json", "json", kJsonEndings,
     [](std::string_view head) noexcept {
       const std::size_t first = head.find_first_not_of(" \t\r\n");
       return first != std::string_view::npos && head[first] == '{';
     },
     [](std::span<const std::uint8_t> bytes, const std::string& name, const ReadOptions&) {
       return read_snapshot_json_devices(as_string(bytes), name);
     },
     [](std::span<const std::uint8_t> bytes, const std::string& name, int device,
        const ReadOptions&) { return read_snapshot_json(as_string(bytes), name, device); },
     &write_snapshot_json},
    {TraceFormat::rmm_csv, "rmm-csv", "", {},
     [](std::string_view head) noexcept { return head.starts_with("Thread,"); },
     &read_one_device<&read_rmm_csv>, nullptr, nullptr},
    // Anything else is read as our text format, whose reader says what is wrong.
    {TraceFormat::text, "reservoir-text", "text", kTextEndings,
     [](std::string_view) noexcept { return true; }, &read_one_device<&read_text_trace>, nullptr,
     &write_text_trace},
};

}  // namespace

std::span<const TraceFormatInfo> trace_formats() noexcept { return kFormats; }

const TraceFormatInfo& trace_format(TraceFormat id) noexcept {
  for (const TraceFormatInfo& f : kFormats) {
    if (f.id == id) return f;
  }
  return kFormats[std::size(kFormats) - 1];
}

const TraceFormatInfo* exported_format(std::string_view export_name) noexcept {
  for (const TraceFormatInfo& f : kFormats) {
    if (!export_name.empty() && f.export_name == export_name && f.write != nullptr) return &f;
  }
  return nullptr;
}

std::string_view to_string(TraceFormat format) noexcept { return trace_format(format).name; }

TraceFormat detect_trace_format(std::string_view bytes) noexcept {
  for (const TraceFormatInfo& f : kFormats) {
    if (f.detect(bytes)) return f.id;
  }
  return TraceFormat::text;
}

void set_recorded_config(Trace& trace, const std::string& text) {
  trace.settings = AllocatorConfig::parse(text);
  trace.recorded_config = text;
}

namespace {

// A stream (a pipe, a device) is read whole, in memory, up to this much;
// files are mapped or read at their size.
constexpr std::size_t kLargestStream = std::size_t{4} << 30;

std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw TraceError(fmt::format("trace {}: cannot open the file", path));
  struct stat st {};
  const bool regular = ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode);
  std::string bytes;
  char chunk[1 << 16];
  bool looked = false;
  while (in.read(chunk, sizeof chunk) || in.gcount() > 0) {
    bytes.append(chunk, static_cast<std::size_t>(in.gcount()));
    if (!looked && (bytes.size() >= 4096 || in.eof())) {
      // Text (the format anything unknown is read as) has no NUL byte: a
      // binary stream such as /dev/zero is refused before it is read on.
      looked = true;
      const std::string_view head(bytes.data(), std::min<std::size_t>(bytes.size(), 4096));
      if (detect_trace_format(head) == TraceFormat::text && head.find('\0') != head.npos) {
        throw TraceError(fmt::format(
            "trace {}: byte {}: a NUL byte: binary data that is no trace format reservoir reads "
            "(PyTorch snapshot pickles, snapshot JSON, RMM CSV, reservoir's text)",
            path, head.find('\0')));
      }
    }
    if (!regular && bytes.size() > kLargestStream) {
      throw TraceError(fmt::format(
          "trace {}: a stream of more than {} bytes: write it to a file and give its path "
          "(files are mapped, streams are held in memory whole)",
          path, kLargestStream));
    }
  }
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

}  // namespace

Trace read_trace_file(const std::string& path, int device) {
  if (auto t = read_mapped_pickle(path, {}, [&](std::span<const std::uint8_t> bytes,
                                                const ReadOptions& options) {
        return read_pytorch_snapshot(bytes, path, device, options);
      })) {
    return std::move(*t);
  }
  const std::string bytes = read_bytes(path);
  const TraceFormatInfo& format = trace_format(detect_trace_format(bytes));
  if (format.read_device != nullptr) return format.read_device(as_span(bytes), path, device, {});
  if (device != 0) {
    throw TraceError(fmt::format("trace {}: a {} trace holds one device; device {} was asked for",
                                 path, format.name, device));
  }
  return std::move(format.read(as_span(bytes), path, {}).front());
}

// Never empty: a snapshot of no device is the snapshot reader's TraceError.
std::vector<Trace> read_trace_devices(const std::string& path, const ReadOptions& options) {
  if (auto t = read_mapped_pickle(path, options, [&](std::span<const std::uint8_t> bytes,
                                                     const ReadOptions& mapped) {
        return read_pytorch_snapshot_devices(bytes, path, mapped);
      })) {
    return std::move(*t);
  }
  const std::string bytes = read_bytes(path);
  return trace_format(detect_trace_format(bytes)).read(as_span(bytes), path, options);
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
