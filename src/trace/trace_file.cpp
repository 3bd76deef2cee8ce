// Reading a trace file of any supported format, told apart by content.
#include <fmt/format.h>

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

Trace read_trace_file(const std::string& path, int device) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw TraceError(fmt::format("trace {}: cannot open the file", path));
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (in.bad()) throw TraceError(fmt::format("trace {}: read error", path));
  switch (detect_trace_format(bytes)) {
    case TraceFormat::pytorch_pickle:
      return read_pytorch_snapshot(
          std::span(reinterpret_cast<const std::uint8_t*>(bytes.data()), bytes.size()), path,
          device);
    case TraceFormat::snapshot_json: return read_snapshot_json(bytes, path, device);
    case TraceFormat::rmm_csv:
    case TraceFormat::text: break;
  }
  if (device != 0) {
    throw TraceError(fmt::format("trace {}: a {} trace holds one device; device {} was asked for",
                                 path, to_string(detect_trace_format(bytes)), device));
  }
  if (detect_trace_format(bytes) == TraceFormat::rmm_csv) return read_rmm_csv(bytes, path);
  return read_text_trace(bytes, path);
}

}  // namespace reservoir
