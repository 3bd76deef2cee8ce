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

// RMM and text traces: one device.
Trace read_single(const std::string& bytes, const std::string& path) {
  Trace t = detect_trace_format(bytes) == TraceFormat::rmm_csv ? read_rmm_csv(bytes, path)
                                                               : read_text_trace(bytes, path);
  t.device_events = {t.events.size()};
  return t;
}

}  // namespace

Trace read_trace_file(const std::string& path, int device) {
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
