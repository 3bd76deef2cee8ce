// The fuzz targets read and write each format through the format table
// (reservoir/trace_formats.hpp), as reading a file and `reservoir export` do.
#pragma once

#include <cstdint>
#include <span>
#include <string>

#include "reservoir/trace_formats.hpp"

namespace reservoir::fuzz {

inline std::span<const std::uint8_t> bytes_of(const std::string& s) {
  return {reinterpret_cast<const std::uint8_t*>(s.data()), s.size()};
}

// Device 0 of the bytes, read as the format's table entry reads it.
inline Trace read_as(TraceFormat id, std::span<const std::uint8_t> bytes) {
  const TraceFormatInfo& f = trace_format(id);
  return f.read_device != nullptr ? f.read_device(bytes, "fuzz", 0, {}) : f.read(bytes, "fuzz", {}).front();
}

inline std::string write_as(TraceFormat id, const Trace& trace) { return trace_format(id).write(trace); }

}  // namespace reservoir::fuzz
