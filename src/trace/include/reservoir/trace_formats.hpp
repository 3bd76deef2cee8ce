// The trace formats: one table (trace_formats()) of each format's name,
// detection, reader and writer, which reading a file, `reservoir export` and
// the fuzz targets all go through; and each format's reader and writer.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "reservoir/trace_model.hpp"

namespace reservoir {

// The formats a trace file may be in, told apart by their first bytes: a
// pickle opens with PROTO (0x80), JSON with '{', RMM's CSV log with its
// header line ("Thread,"); anything else is read as our text format.
enum class TraceFormat { pytorch_pickle, snapshot_json, rmm_csv, text };
TraceFormat detect_trace_format(std::string_view bytes) noexcept;
// "pytorch-snapshot", "snapshot-json", "rmm-csv", "reservoir-text": the
// names Trace::format carries.
std::string_view to_string(TraceFormat format) noexcept;

// What a reader reads beyond the events: stacks (contexts) cost time and
// memory that replay does not need.
struct ReadOptions {
  bool contexts = true;  // false: every event and block has context 0
  // Called with a byte offset of the input once the reader has moved past
  // it for good (every few MB): read_trace_file hands a mapped file's pages
  // back behind the reader with it, so a large snapshot is never held whole.
  std::function<void(std::size_t offset)> consumed;
};

// Reads a trace, choosing the reader by content: a pickle (PyTorch snapshot),
// JSON (our snapshot export), RMM's CSV log (its header line), or our text
// format ("reservoir-trace" header). `device` picks one device's events and
// segments from a snapshot (Trace::device_count says how many it holds).
// Throws TraceError naming the file and the byte offset, line or field of
// the problem.
Trace read_trace_file(const std::string& path, int device = 0);
// Every device of a trace file, read once (one entry for formats that hold
// one device): entry d is device d, with no events when it recorded none.
std::vector<Trace> read_trace_devices(const std::string& path, const ReadOptions& options = {});
// The devices a tool works on: `device` when set (TraceError when the file
// has no such device), else every device with events or segments (device 0
// when none has any).
std::vector<Trace> select_devices(std::vector<Trace> devices, std::optional<int> device);
// PyTorch snapshot pickle, already in memory.
Trace read_pytorch_snapshot(std::span<const std::uint8_t> data, const std::string& name,
                            int device = 0, const ReadOptions& options = {});
std::vector<Trace> read_pytorch_snapshot_devices(std::span<const std::uint8_t> data,
                                                 const std::string& name,
                                                 const ReadOptions& options = {});
// reservoir's text format (docs/replay.md).
Trace read_text_trace(const std::string& text, const std::string& name);
std::string write_text_trace(const Trace& trace);
// Writes a trace as a PyTorch snapshot pickle (segments from final_state,
// device_traces from events, allocator_settings from recorded_config), which
// read_pytorch_snapshot reads back to the same trace.
std::string write_pytorch_snapshot(const Trace& trace);
// The same dict as JSON (keys and nesting as the pickle's; integers exact).
std::string write_snapshot_json(const Trace& trace);
// A snapshot of the allocator in JSON, read back to the same trace.
Trace read_snapshot_json(const std::string& text, const std::string& name, int device = 0);
std::vector<Trace> read_snapshot_json_devices(const std::string& text, const std::string& name);
// RMM's logging_resource_adaptor CSV (Thread,Time,Action,Pointer,Size,Stream).
Trace read_rmm_csv(const std::string& text, const std::string& name);

// A format, as the table lists it.
struct TraceFormatInfo {
  TraceFormat id;
  std::string_view name;         // what Trace::format carries ("pytorch-snapshot")
  std::string_view export_name;  // `reservoir export --format`'s name; "" when not written
  std::span<const std::string_view> extensions;  // file endings export writes it for
  // Whether a file opening with `head` is in this format (the table is asked
  // in order; the last entry takes anything).
  bool (*detect)(std::string_view head) noexcept;
  // Every device the bytes hold (one for formats of one device).
  std::vector<Trace> (*read)(std::span<const std::uint8_t> bytes, const std::string& name,
                             const ReadOptions& options);
  // One device, read alone; null for formats of one device.
  Trace (*read_device)(std::span<const std::uint8_t> bytes, const std::string& name, int device,
                       const ReadOptions& options);
  std::string (*write)(const Trace& trace);  // null when not written
};
// Every format, in the order detection asks them.
std::span<const TraceFormatInfo> trace_formats() noexcept;
const TraceFormatInfo& trace_format(TraceFormat id) noexcept;
// The format `reservoir export --format NAME` writes; null when none.
const TraceFormatInfo* exported_format(std::string_view export_name) noexcept;

}  // namespace reservoir
