#include "symbolize.hpp"

#include <cxxabi.h>
#include <dlfcn.h>
#include <execinfo.h>
#include <fmt/format.h>

#include <cstdlib>
#include <memory>
#include <mutex>
#include <unordered_map>

#if RESERVOIR_HAVE_LIBBACKTRACE
#include RESERVOIR_BACKTRACE_H
#endif

namespace reservoir::detail {
namespace {

std::string demangle(const char* name) {
  if (name == nullptr) return {};
  int status = 0;
  std::unique_ptr<char, decltype(&std::free)> out(
      abi::__cxa_demangle(name, nullptr, nullptr, &status), &std::free);
  return status == 0 && out ? std::string(out.get()) : std::string(name);
}

// Without debug information: the symbol table of the module holding pc.
Frame frame_from_dladdr(std::uintptr_t pc) {
  Frame f;
  Dl_info info{};
  if (dladdr(reinterpret_cast<void*>(pc), &info) != 0) {
    if (info.dli_fname != nullptr) f.filename = info.dli_fname;
    if (info.dli_sname != nullptr) {
      f.name = demangle(info.dli_sname);
    } else if (info.dli_fbase != nullptr) {
      f.name = fmt::format("{}+{:#x}", f.filename,
                           pc - reinterpret_cast<std::uintptr_t>(info.dli_fbase));
    }
  }
  if (f.name.empty()) f.name = fmt::format("{:#x}", pc);
  return f;
}

#if RESERVOIR_HAVE_LIBBACKTRACE
backtrace_state* state() {
  // One state for the process (libbacktrace keeps it for the process's life).
  static backtrace_state* s = backtrace_create_state(
      nullptr, /*threaded=*/1, [](void*, const char*, int) {}, nullptr);
  return s;
}

struct PcInfo {
  std::vector<Frame> frames;
};

int on_pcinfo(void* data, std::uintptr_t, const char* filename, int line, const char* function) {
  auto* info = static_cast<PcInfo*>(data);
  if (filename == nullptr && function == nullptr) return 0;
  Frame f;
  if (filename != nullptr) f.filename = filename;
  f.line = line;
  f.name = demangle(function);
  info->frames.push_back(std::move(f));
  return 0;
}
#endif

std::vector<Frame> frames_for(std::uintptr_t pc) {
  // Return addresses point after the call; look up the call itself.
  const std::uintptr_t lookup = pc - 1;
#if RESERVOIR_HAVE_LIBBACKTRACE
  if (backtrace_state* s = state()) {
    PcInfo info;
    backtrace_pcinfo(s, lookup, on_pcinfo, [](void*, const char*, int) {}, &info);
    bool named = !info.frames.empty();
    for (const Frame& f : info.frames) named = named && !f.name.empty();
    if (named) return info.frames;
  }
#endif
  return {frame_from_dladdr(lookup)};
}

}  // namespace

std::vector<std::uintptr_t> capture_stack(std::size_t skip, std::size_t max_frames) {
  constexpr std::size_t kMax = 128;
  void* buffer[kMax];
  const std::size_t want = std::min(kMax, skip + max_frames);
  const int n = ::backtrace(buffer, static_cast<int>(want));
  std::vector<std::uintptr_t> out;
  for (int i = static_cast<int>(skip); i < n; ++i) {
    out.push_back(reinterpret_cast<std::uintptr_t>(buffer[i]));
  }
  return out;
}

std::vector<Frame> symbolize(const std::vector<std::uintptr_t>& stack) {
  static std::mutex mutex;
  static auto* cache = new std::unordered_map<std::uintptr_t, std::vector<Frame>>;
  std::vector<Frame> out;
  std::lock_guard lock(mutex);
  for (const std::uintptr_t pc : stack) {
    auto it = cache->find(pc);
    if (it == cache->end()) it = cache->emplace(pc, frames_for(pc)).first;
    out.insert(out.end(), it->second.begin(), it->second.end());
  }
  return out;
}

}  // namespace reservoir::detail
