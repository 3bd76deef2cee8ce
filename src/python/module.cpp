// reservoir._core: the Python module (pybind11).
//
// Devices (HostDevice, SimDevice, and the CUDA backends), Saver with regions,
// pause and resume, stats, summaries and snapshots; default_saver(device) is
// the saver PyTorch allocates from once reservoir.install_torch() ran (this
// module's file also carries the pluggable allocator's entry points, see
// src/torch/reservoir_torch.cpp). Long calls release the GIL.
#include <fmt/format.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "advice_view.hpp"
#include "report_html.hpp"
#include "reservoir/caching_allocator.hpp"
#include "reservoir/explain.hpp"
#include "reservoir/trace_formats.hpp"
#include "reservoir/cuda_device.hpp"
#include "reservoir/errors.hpp"
#include "reservoir/host_device.hpp"
#include "reservoir/open_device.hpp"
#include "reservoir/saver.hpp"
#include "reservoir/sim_device.hpp"
#include "reservoir/trace.hpp"
#include "reservoir/version.hpp"
#include "torch_saver.hpp"

namespace py = pybind11;
using namespace reservoir;

namespace {

// The answer at an out-of-memory error (reservoir/explain.hpp), with the
// page of the full advice beside the snapshot.
ExplainOptions explain_options(const std::string& directory, int rank, const std::string& advise_command) {
  ExplainOptions options;
  options.directory = directory;
  if (!advise_command.empty()) options.advise_command = advise_command;
  if (rank >= 0) options.rank = rank;
  options.page = [](const Trace& trace, const Advice& advice) {
    return tools::html_page(
        "reservoir: out of memory",
        fmt::format("<p class=\"note\">{}, {} recorded events, analysed at the error.</p>\n{}",
                    tools::esc(trace.name), trace.events.size(), tools::advice_html(trace, advice, "advice")));
  };
  return options;
}

py::dict explain_snapshot(const py::bytes& data, int device, const std::string& directory, int rank,
                          std::uint64_t device_total, const std::string& advise_command, std::uint64_t memory_limit) {
  const std::string_view bytes = data;
  OomExplanation e;
  {
    py::gil_scoped_release release;
    const std::span<const std::uint8_t> span(reinterpret_cast<const std::uint8_t*>(bytes.data()), bytes.size());
    ExplainOptions options = explain_options(directory, rank, advise_command);
    if (device >= 0) options.device = device;
    if (device_total > 0) options.device_total = device_total;
    if (memory_limit > 0) options.memory_limit = memory_limit;
    try {
      const Trace trace = read_pytorch_snapshot(span, "snapshot at the error", device);
      e = explain_oom(trace, span, options);
    } catch (const std::exception& err) {
      e.lines.push_back(fmt::format("reservoir: could not read the snapshot taken at the error: {}", err.what()));
    }
  }
  py::dict out;
  out["lines"] = e.lines;
  out["snapshot_path"] = e.snapshot_path;
  out["page_path"] = e.page_path;
  out["seconds"] = e.seconds;
  return out;
}

// open_device's result as the concrete class a Python constructor returns.
template <typename T>
std::unique_ptr<T> open_as(DeviceKind kind, const OpenDeviceOptions& options) {
  std::unique_ptr<Device> device = open_device(kind, options);
  T* typed = dynamic_cast<T*>(device.get());
  if (typed == nullptr) {
    throw InvariantError(fmt::format("open_device({}) gave a {}", to_string(kind), device->name()));
  }
  device.release();
  return std::unique_ptr<T>(typed);
}

py::dict tag_dict(const TagInfo& t) {
  py::dict d;
  t.for_each_field([&](const char* name, const auto& value) { d[name] = value; });
  return d;
}

// A region as a Python context manager: opened by __enter__ on the calling
// thread, closed by __exit__.
class RegionScope {
 public:
  RegionScope(Saver& saver, std::optional<std::string> tag, bool cpu_backup,
              std::optional<BackupStorage> storage = std::nullopt)
      : saver_(saver), tag_(std::move(tag)), cpu_backup_(cpu_backup), storage_(storage) {}
  RegionScope& enter() {
    if (token_ != 0) throw UsageError("region: this region is open already");
    token_ = tag_ ? saver_.push_region(*tag_, {.cpu_backup = cpu_backup_, .storage = storage_})
                  : saver_.push_untagged();
    return *this;
  }
  void exit() {
    const std::uint64_t token = token_;
    token_ = 0;
    saver_.pop_region(token);
  }

 private:
  Saver& saver_;
  std::optional<std::string> tag_;
  bool cpu_backup_;
  std::optional<BackupStorage> storage_;
  std::uint64_t token_ = 0;
};

// A Saver created from Python owns its options' strings; the device is kept
// alive by the binding (keep_alive).
std::unique_ptr<Saver> make_saver(Device& device, const std::string& config,
                                  const std::string& storage, const std::string& mmap_directory,
                                  std::size_t chunk_bytes, int copy_streams, Device* tag_device,
                                  bool exact_peaks) {
  SaverOptions o;
  o.config = AllocatorConfig::parse(config);
  o.storage = parse_backup_storage(storage, "Saver: storage");
  o.mmap_directory = mmap_directory;
  o.chunk_bytes = chunk_bytes;
  o.copy_streams = copy_streams;
  o.tag_device = tag_device;
  o.exact_peaks = exact_peaks;
  return std::make_unique<Saver>(device, o);
}

py::object snapshot_dict(const Saver& saver) {
  const std::string bytes = write_pytorch_snapshot(
      to_trace(saver.snapshot(), "reservoir", const_cast<Saver&>(saver).untagged_allocator().config().to_string()));
  return py::module_::import("pickle").attr("loads")(py::bytes(bytes));
}

}  // namespace

PYBIND11_MODULE(_core, m) {
  m.doc() = "reservoir: GPU memory management (caching allocator, pause/resume of tagged memory)";
  m.attr("__version__") = RESERVOIR_VERSION_STRING;

  auto error = py::register_exception<Error>(m, "Error", PyExc_RuntimeError);
  py::register_exception<ConfigError>(m, "ConfigError", error.ptr());
  py::register_exception<UsageError>(m, "UsageError", error.ptr());
  py::register_exception<DeviceError>(m, "DeviceError", error.ptr());
  py::register_exception<InvalidPointerError>(m, "InvalidPointerError", error.ptr());
  py::register_exception<DeviceUnavailableError>(m, "DeviceUnavailableError", error.ptr());
  py::register_exception<OutOfMemoryError>(m, "OutOfMemoryError", error.ptr());
  py::register_exception<TraceError>(m, "TraceError", error.ptr());
  py::register_exception<InvariantError>(m, "InvariantError", error.ptr());

  py::class_<Device>(m, "Device")
      .def_property_readonly("name", [](const Device& d) { return std::string(d.name()); })
      .def_property_readonly("granularity", &Device::granularity);
  // Every constructor opens its device through open_device, as the C API and
  // the PyTorch plug-in do; open_device(kind) gives the backend by name.
  m.def("open_device",
        [](const std::string& kind, int index, std::size_t capacity, std::size_t granularity) {
          return open_device(kind, {.index = index, .capacity = capacity, .granularity = granularity});
        },
        "A device by kind: sim, host, cuda-runtime or cuda-vmm (capacity and granularity: 0 for "
        "the backend's default)",
        py::arg("kind"), py::arg("index") = 0, py::arg("capacity") = 0, py::arg("granularity") = 0);
  py::class_<HostDevice, Device>(m, "HostDevice",
                                 "Real host memory driven through CUDA's virtual-memory protocol")
      .def(py::init([](std::size_t capacity, std::size_t granularity) {
             return open_as<HostDevice>(DeviceKind::host, {.capacity = capacity, .granularity = granularity});
           }),
           py::arg("capacity") = std::size_t{8} << 30, py::arg("granularity") = std::size_t{2} << 20)
      .def_property_readonly("used_bytes", &HostDevice::used_bytes);
  py::class_<SimDevice, Device>(m, "SimDevice", "Simulated device: accounting only, no contents")
      .def(py::init([](std::size_t capacity, std::size_t granularity) {
             return open_as<SimDevice>(DeviceKind::sim, {.capacity = capacity, .granularity = granularity});
           }),
           py::arg("capacity") = std::size_t{80} << 30, py::arg("granularity") = std::size_t{2} << 20)
      .def_property_readonly("used_bytes", &SimDevice::used_bytes);
  py::class_<CudaVmmDevice, Device>(m, "CudaVmmDevice", "A GPU through CUDA's driver API")
      .def(py::init([](int device) { return open_as<CudaVmmDevice>(DeviceKind::cuda_vmm, {.index = device}); }),
           py::arg("device") = 0);
  py::class_<CudaRuntimeDevice, Device>(m, "CudaRuntimeDevice", "A GPU through cudaMalloc")
      .def(py::init([](int device) {
             return open_as<CudaRuntimeDevice>(DeviceKind::cuda_runtime, {.index = device});
           }),
           py::arg("device") = 0);

  py::class_<RegionScope>(m, "Region")
      .def("__enter__", &RegionScope::enter, py::return_value_policy::reference)
      .def("__exit__", [](RegionScope& r, py::args) {
        r.exit();
        return false;
      });

  const auto release = py::call_guard<py::gil_scoped_release>();
  py::class_<Saver>(m, "Saver", "Tagged regions of device memory that can be paused and resumed")
      .def(py::init(&make_saver), py::arg("device"), py::arg("config") = "",
           py::arg("storage") = "pinned", py::arg("mmap_directory") = "",
           py::arg("chunk_bytes") = std::size_t{32} << 20, py::arg("copy_streams") = 4,
           py::arg("tag_device") = nullptr, py::arg("exact_peaks") = true, py::keep_alive<1, 2>(),
           py::keep_alive<1, 8>())
      .def(
          "region",
          [](Saver& s, const std::string& tag, bool cpu_backup, std::optional<std::string> storage) {
            return RegionScope(s, tag, cpu_backup,
                               storage ? std::optional(parse_backup_storage(*storage, "region: storage"))
                                       : std::nullopt);
          },
          py::arg("tag"), py::arg("cpu_backup") = false, py::arg("storage") = py::none(),
          py::keep_alive<0, 1>(),
          "with saver.region('kv_cache', cpu_backup=True): ... allocations go to that tag; "
          "storage: 'pinned', 'mmap' or 'disk' (the saver's when None)")
      .def(
          "untagged", [](Saver& s) { return RegionScope(s, std::nullopt, false); },
          py::keep_alive<0, 1>(), "with saver.untagged(): ... allocations outside every tag")
      .def("current_tag", &Saver::current_tag)
      .def(
          "allocate",
          [](Saver& s, std::size_t size, std::uint64_t stream) {
            return reinterpret_cast<std::uintptr_t>(s.allocate(size, stream));
          },
          py::arg("size"), py::arg("stream") = 0, release)
      .def(
          "free", [](Saver& s, std::uintptr_t ptr) { s.deallocate(reinterpret_cast<void*>(ptr)); },
          py::arg("ptr"), release)
      .def(
          "record_stream",
          [](Saver& s, std::uintptr_t ptr, std::uint64_t stream) {
            s.record_stream(reinterpret_cast<void*>(ptr), stream);
          },
          py::arg("ptr"), py::arg("stream"))
      .def(
          "pause",
          [](Saver& s, std::optional<std::string> tag, const std::string& contents) {
            const PauseContents how = parse_pause_contents(contents, "pause: contents");
            if (tag) return s.pause(*tag, how);
            if (how == PauseContents::as_regions) return s.pause();
            // Every running tag, each as asked.
            std::vector<std::string> running;
            for (const TagInfo& t : s.tags()) {
              if (!t.paused && std::find(running.begin(), running.end(), t.tag) == running.end()) {
                running.push_back(t.tag);
              }
            }
            for (const std::string& t : running) s.pause(t, how);
          },
          py::arg("tag") = py::none(), py::arg("contents") = "as_regions", release,
          "Pause one tag (or every running one), keeping of its contents what `contents` says: "
          "'as_regions' (the backup its regions asked for), 'discard' or 'zero' (zeroed on resume)")
      .def(
          "resume",
          [](Saver& s, std::optional<std::string> tag) { tag ? s.resume(*tag) : s.resume(); },
          py::arg("tag") = py::none(), release)
      .def("is_paused", &Saver::is_paused, py::arg("tag"))
      .def("empty_cache", &Saver::empty_cache, release)
      .def("trim_backup", &Saver::trim_backup, release)
      .def("set_disk_backup_dir", &Saver::set_disk_backup_dir, py::arg("path"),
           "where storage='disk' backups go from the next pause on (created when missing)")
      .def_property_readonly("disk_backup_dir", &Saver::disk_backup_dir)
      .def_property("retain_backup", &Saver::retain_backup, &Saver::set_retain_backup,
                    "keep each tag's backup after resume (read_backup still finds it)")
      .def_property("memory_margin", &Saver::memory_margin, &Saver::set_memory_margin,
                    "device bytes tagged allocations must leave free (0: off)")
      .def(
          "read_backup",
          [](const Saver& s, std::uintptr_t ptr, std::size_t bytes) -> py::object {
            std::string out(bytes, '\0');
            bool found = false;
            {
              py::gil_scoped_release unlocked;
              found = s.read_backup(reinterpret_cast<const void*>(ptr), bytes, out.data());
            }
            if (!found) return py::none();
            return py::bytes(out);
          },
          py::arg("ptr"), py::arg("bytes"),
          "the backed-up bytes of [ptr, ptr + bytes) as at the last pause, or None")
      .def("tags",
           [](const Saver& s) {
             py::list out;
             for (const TagInfo& t : s.tags()) out.append(tag_dict(t));
             return out;
           })
      .def("tag_info", [](const Saver& s, const std::string& tag) { return tag_dict(s.tag_info(tag)); },
           py::arg("tag"))
      .def(
          "stats",
          [](const Saver& s, std::optional<std::string> tag) {
            return tag ? to_map(s.stats(*tag)) : s.stats_map();
          },
          py::arg("tag") = py::none(), "torch.cuda.memory_stats()'s keys")
      .def("reset_peak_stats", &Saver::reset_peak_stats,
           "peaks fall to the current values (torch.cuda.reset_peak_memory_stats)")
      .def("reset_accumulated_stats", &Saver::reset_accumulated_stats,
           "totals and counters fall to zero (torch.cuda.reset_accumulated_memory_stats)")
      .def("memory_summary", &Saver::memory_summary, py::arg("abbreviated") = false)
      .def("snapshot", &snapshot_dict, "PyTorch's snapshot dict (what memory_viz reads)")
      .def("validate", &Saver::validate)
      .def(
          "record_memory_history",
          [](Saver& s, bool enabled, std::size_t max_entries, bool stacks) {
            s.record_history(
                {.enabled = enabled, .max_entries = max_entries, .stacks = stacks, .max_frames = 32});
          },
          py::arg("enabled") = true, py::arg("max_entries") = 1000000, py::arg("stacks") = false,
          "History of every allocator (tags included), returned by snapshot()")
      .def(
          "set_memory_fraction",
          [](Saver& s, double fraction) { s.untagged_allocator().set_memory_fraction(fraction); },
          py::arg("fraction"));

  m.def("default_saver_devices", &torch_saver_devices,
        "The devices whose default saver exists (PyTorch allocated there, or default_saver(device) was called)");
  m.def(
      "_push_region_everywhere",
      [](std::optional<std::string> tag, bool cpu_backup, std::optional<std::string> storage) {
        return torch_push_region_everywhere(
            std::move(tag), {.cpu_backup = cpu_backup,
                             .storage = storage ? std::optional(parse_backup_storage(*storage, "region: storage"))
                                                : std::nullopt});
      },
      py::arg("tag"), py::arg("cpu_backup") = false, py::arg("storage") = py::none(),
      "Opens a region on this thread of every device's default saver (those created later too); "
      "returns its id for _pop_region_everywhere");
  m.def("_pop_region_everywhere", &torch_pop_region_everywhere, py::arg("id"));
  m.def("default_saver", &torch_saver, py::arg("device") = 0, py::return_value_policy::reference,
        "The saver PyTorch's allocator uses for this GPU (created on first use from "
        "RESERVOIR_ALLOC_CONF and RESERVOIR_TORCH_DEVICE)");
  m.def("_explain_snapshot", &explain_snapshot, py::arg("data"), py::arg("device"), py::arg("directory"),
        py::arg("rank") = -1, py::arg("device_total") = 0, py::arg("advise_command") = "",
        py::arg("memory_limit") = 0,
        "The answer to an out-of-memory error from PyTorch's snapshot (pickle bytes) of that moment: "
        "{lines, snapshot_path, page_path, seconds}; the files go to directory ('' writes none). "
        "device_total: the device's memory; memory_limit: the process's own limit, 0 for none");
  m.def(
      "_explain_torch_allocator",
      [](const std::string& directory, int rank, std::size_t max_entries, const std::string& advise_command) {
        torch_explain_oom(explain_options(directory, rank, advise_command), max_entries);
      },
      py::arg("directory"), py::arg("rank") = -1, py::arg("max_entries") = 100000, py::arg("advise_command") = "",
      "Under reservoir as PyTorch's allocator: every device's out-of-memory error carries the answer");
  m.def(
      "_set_process_rank", [](int rank) { set_process_rank(rank >= 0 ? std::optional<int>(rank) : std::nullopt); },
      py::arg("rank"),
      "The process's rank as torch.distributed knows it, for the answers at later errors (-1: none)");
  m.def("rss_bytes", &current_rss_bytes, "Resident memory of this process, in bytes");
}
