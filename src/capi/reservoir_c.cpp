// The C API over the C++ one: exceptions become statuses and a thread-local
// message.
#include <fmt/format.h>

#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <nlohmann/json.hpp>

#include "reservoir/caching_allocator.hpp"
#include "reservoir/errors.hpp"
#include "reservoir/history.hpp"
#include "reservoir/open_device.hpp"
#include "reservoir/reservoir.h"
#include "reservoir/saver.hpp"
#include "reservoir/trace.hpp"

struct reservoir_device {
  std::unique_ptr<reservoir::Device> device;
};
struct reservoir_allocator {
  std::unique_ptr<reservoir::CachingAllocator> allocator;
};
struct reservoir_saver {
  std::unique_ptr<reservoir::Saver> saver;
};

namespace {

thread_local std::string last_error;

reservoir_status fail(reservoir_status status, std::string message) {
  last_error = std::move(message);
  return status;
}

// Runs f, turning what it throws into a status.
template <typename F>
reservoir_status guarded(const char* function, F&& f) {
  try {
    f();
    return RESERVOIR_OK;
  } catch (const reservoir::OutOfMemoryError& e) {
    return fail(RESERVOIR_ERROR_OUT_OF_MEMORY, e.what());
  } catch (const reservoir::InvalidPointerError& e) {
    return fail(RESERVOIR_ERROR_INVALID_POINTER, e.what());
  } catch (const reservoir::ConfigError& e) {
    return fail(RESERVOIR_ERROR_CONFIG, e.what());
  } catch (const reservoir::DeviceUnavailableError& e) {
    return fail(RESERVOIR_ERROR_UNAVAILABLE, e.what());
  } catch (const reservoir::DeviceError& e) {
    return fail(RESERVOIR_ERROR_DEVICE, e.what());
  } catch (const reservoir::UsageError& e) {
    return fail(RESERVOIR_ERROR_USAGE, e.what());
  } catch (const reservoir::InvariantError& e) {
    return fail(RESERVOIR_ERROR_INTERNAL, e.what());
  } catch (const std::bad_alloc&) {
    return fail(RESERVOIR_ERROR_OUT_OF_MEMORY, fmt::format("{}: out of host memory", function));
  } catch (const std::exception& e) {
    return fail(RESERVOIR_ERROR_INTERNAL, fmt::format("{}: {}", function, e.what()));
  }
}

#define RESERVOIR_REQUIRE(cond, what)                                                   \
  if (!(cond)) {                                                                        \
    return fail(RESERVOIR_ERROR_INVALID_ARGUMENT, fmt::format("{}: {}", __func__, what)); \
  }

char* copy_string(const std::string& s) {
  char* out = static_cast<char*>(std::malloc(s.size() + 1));
  if (out == nullptr) throw std::bad_alloc();
  std::memcpy(out, s.data(), s.size() + 1);
  return out;
}

reservoir::Trace snapshot_trace(reservoir_allocator* a) {
  return reservoir::to_trace(a->allocator->snapshot(), "reservoir",
                             a->allocator->config().to_string());
}

}  // namespace

extern "C" {

const char* reservoir_last_error(void) { return last_error.c_str(); }

const char* reservoir_status_name(reservoir_status status) {
  switch (status) {
    case RESERVOIR_OK: return "ok";
    case RESERVOIR_ERROR_OUT_OF_MEMORY: return "out of memory";
    case RESERVOIR_ERROR_INVALID_POINTER: return "invalid pointer";
    case RESERVOIR_ERROR_CONFIG: return "config error";
    case RESERVOIR_ERROR_USAGE: return "usage error";
    case RESERVOIR_ERROR_DEVICE: return "device error";
    case RESERVOIR_ERROR_UNAVAILABLE: return "unavailable";
    case RESERVOIR_ERROR_INVALID_ARGUMENT: return "invalid argument";
    case RESERVOIR_ERROR_INTERNAL: return "internal error";
  }
  return "unknown status";
}

void reservoir_string_free(char* s) { std::free(s); }

reservoir_status reservoir_device_open(const char* kind, int index, size_t capacity,
                                       reservoir_device** out) {
  RESERVOIR_REQUIRE(kind != nullptr && out != nullptr, "kind and out must not be NULL");
  *out = nullptr;
  const std::string k = kind;
  return guarded(__func__, [&] {
    auto d = std::make_unique<reservoir_device>();
    reservoir::DeviceKind parsed{};
    try {
      parsed = reservoir::parse_device_kind(k);
    } catch (const reservoir::UsageError& e) {
      throw reservoir::UsageError(fmt::format("reservoir_device_open: {}", e.what()));
    }
    d->device = reservoir::open_device(parsed, {.index = index, .capacity = capacity, .granularity = 0});
    *out = d.release();
  });
}

void reservoir_device_close(reservoir_device* device) { delete device; }

reservoir_status reservoir_allocator_create(reservoir_device* device, const char* config,
                                            int device_index, reservoir_allocator** out) {
  RESERVOIR_REQUIRE(device != nullptr && out != nullptr, "device and out must not be NULL");
  *out = nullptr;
  return guarded(__func__, [&] {
    const reservoir::AllocatorConfig c = config == nullptr ? reservoir::AllocatorConfig::from_env()
                                                           : reservoir::AllocatorConfig::parse(config);
    auto a = std::make_unique<reservoir_allocator>();
    a->allocator = std::make_unique<reservoir::CachingAllocator>(*device->device, c, device_index);
    *out = a.release();
  });
}

void reservoir_allocator_destroy(reservoir_allocator* allocator) { delete allocator; }

reservoir_status reservoir_malloc(reservoir_allocator* a, size_t size, uint64_t stream, void** out) {
  RESERVOIR_REQUIRE(a != nullptr && out != nullptr, "allocator and out must not be NULL");
  *out = nullptr;
  return guarded(__func__, [&] { *out = a->allocator->allocate(size, stream); });
}

reservoir_status reservoir_free(reservoir_allocator* a, void* ptr) {
  RESERVOIR_REQUIRE(a != nullptr, "allocator must not be NULL");
  return guarded(__func__, [&] { a->allocator->deallocate(ptr); });
}

reservoir_status reservoir_record_stream(reservoir_allocator* a, void* ptr, uint64_t stream) {
  RESERVOIR_REQUIRE(a != nullptr, "allocator must not be NULL");
  return guarded(__func__, [&] { a->allocator->record_stream(ptr, stream); });
}

reservoir_status reservoir_empty_cache(reservoir_allocator* a) {
  RESERVOIR_REQUIRE(a != nullptr, "allocator must not be NULL");
  return guarded(__func__, [&] { a->allocator->empty_cache(); });
}

reservoir_status reservoir_set_memory_fraction(reservoir_allocator* a, double fraction) {
  RESERVOIR_REQUIRE(a != nullptr, "allocator must not be NULL");
  return guarded(__func__, [&] { a->allocator->set_memory_fraction(fraction); });
}

reservoir_status reservoir_set_config(reservoir_allocator* a, const char* config) {
  RESERVOIR_REQUIRE(a != nullptr && config != nullptr, "allocator and config must not be NULL");
  return guarded(__func__, [&] { a->allocator->set_config(reservoir::AllocatorConfig::parse(config)); });
}

reservoir_status reservoir_get_config(reservoir_allocator* a, char** out) {
  RESERVOIR_REQUIRE(a != nullptr && out != nullptr, "allocator and out must not be NULL");
  return guarded(__func__, [&] { *out = copy_string(a->allocator->config().to_string()); });
}

reservoir_status reservoir_stat(reservoir_allocator* a, const char* key, int64_t* value) {
  RESERVOIR_REQUIRE(a != nullptr && key != nullptr && value != nullptr,
                    "allocator, key and value must not be NULL");
  const auto stats = a->allocator->stats_map();
  const auto it = stats.find(key);
  if (it == stats.end()) {
    return fail(RESERVOIR_ERROR_INVALID_ARGUMENT,
                fmt::format("reservoir_stat: no stat '{}' (keys as torch.cuda.memory_stats)", key));
  }
  *value = it->second;
  return RESERVOIR_OK;
}

reservoir_status reservoir_stats_json(reservoir_allocator* a, char** out) {
  RESERVOIR_REQUIRE(a != nullptr && out != nullptr, "allocator and out must not be NULL");
  return guarded(__func__, [&] {
    nlohmann::json j(a->allocator->stats_map());
    *out = copy_string(j.dump());
  });
}

reservoir_status reservoir_reset_peak_stats(reservoir_allocator* a) {
  RESERVOIR_REQUIRE(a != nullptr, "allocator must not be NULL");
  return guarded(__func__, [&] { a->allocator->reset_peak_stats(); });
}

reservoir_status reservoir_reset_accumulated_stats(reservoir_allocator* a) {
  RESERVOIR_REQUIRE(a != nullptr, "allocator must not be NULL");
  return guarded(__func__, [&] { a->allocator->reset_accumulated_stats(); });
}

reservoir_status reservoir_memory_summary(reservoir_allocator* a, int abbreviated, char** out) {
  RESERVOIR_REQUIRE(a != nullptr && out != nullptr, "allocator and out must not be NULL");
  return guarded(__func__, [&] { *out = copy_string(a->allocator->memory_summary(abbreviated != 0)); });
}

reservoir_status reservoir_record_history(reservoir_allocator* a, int enabled, size_t max_entries,
                                          int stacks) {
  RESERVOIR_REQUIRE(a != nullptr, "allocator must not be NULL");
  return guarded(__func__, [&] {
    a->allocator->record_history(
        {.enabled = enabled != 0, .max_entries = max_entries, .stacks = stacks != 0, .max_frames = 32});
  });
}

reservoir_status reservoir_push_annotation(const char* name) {
  RESERVOIR_REQUIRE(name != nullptr, "name must not be NULL");
  return guarded(__func__, [&] { reservoir::push_annotation(name); });
}

reservoir_status reservoir_pop_annotation(void) {
  return guarded(__func__, [&] { reservoir::pop_annotation(); });
}

reservoir_status reservoir_snapshot_pickle(reservoir_allocator* a, char** out, size_t* size) {
  RESERVOIR_REQUIRE(a != nullptr && out != nullptr && size != nullptr,
                    "allocator, out and size must not be NULL");
  return guarded(__func__, [&] {
    const std::string bytes = reservoir::write_pytorch_snapshot(snapshot_trace(a));
    *out = copy_string(bytes);
    *size = bytes.size();
  });
}

reservoir_status reservoir_snapshot_json(reservoir_allocator* a, char** out) {
  RESERVOIR_REQUIRE(a != nullptr && out != nullptr, "allocator and out must not be NULL");
  return guarded(__func__, [&] { *out = copy_string(reservoir::write_snapshot_json(snapshot_trace(a))); });
}


reservoir_status reservoir_saver_create(reservoir_device* device, const char* config,
                                        const char* storage, reservoir_saver** out) {
  RESERVOIR_REQUIRE(device != nullptr && out != nullptr, "device and out must not be NULL");
  *out = nullptr;
  const std::string st = storage == nullptr ? "pinned" : storage;
  RESERVOIR_REQUIRE(st == "pinned" || st == "mmap",
                    fmt::format("storage '{}' is not pinned or mmap", st));
  return guarded(__func__, [&] {
    reservoir::SaverOptions o;
    o.config = config == nullptr ? reservoir::AllocatorConfig::from_env()
                                 : reservoir::AllocatorConfig::parse(config);
    o.storage = st == "mmap" ? reservoir::BackupStorage::mmap : reservoir::BackupStorage::pinned;
    auto s = std::make_unique<reservoir_saver>();
    s->saver = std::make_unique<reservoir::Saver>(*device->device, o);
    *out = s.release();
  });
}

void reservoir_saver_destroy(reservoir_saver* saver) { delete saver; }

reservoir_status reservoir_saver_region_push(reservoir_saver* saver, const char* tag, int cpu_backup,
                                             uint64_t* token) {
  RESERVOIR_REQUIRE(saver != nullptr && token != nullptr, "saver and token must not be NULL");
  return guarded(__func__, [&] {
    *token = tag == nullptr ? saver->saver->push_untagged()
                            : saver->saver->push_region(tag, {.cpu_backup = cpu_backup != 0});
  });
}

reservoir_status reservoir_saver_region_pop(reservoir_saver* saver, uint64_t token) {
  RESERVOIR_REQUIRE(saver != nullptr, "saver must not be NULL");
  return guarded(__func__, [&] { saver->saver->pop_region(token); });
}

reservoir_status reservoir_saver_malloc(reservoir_saver* saver, size_t size, uint64_t stream,
                                        void** out) {
  RESERVOIR_REQUIRE(saver != nullptr && out != nullptr, "saver and out must not be NULL");
  *out = nullptr;
  return guarded(__func__, [&] { *out = saver->saver->allocate(size, stream); });
}

reservoir_status reservoir_saver_free(reservoir_saver* saver, void* ptr) {
  RESERVOIR_REQUIRE(saver != nullptr, "saver must not be NULL");
  return guarded(__func__, [&] { saver->saver->deallocate(ptr); });
}

reservoir_status reservoir_saver_pause(reservoir_saver* saver, const char* tag) {
  RESERVOIR_REQUIRE(saver != nullptr, "saver must not be NULL");
  return guarded(__func__, [&] { tag == nullptr ? saver->saver->pause() : saver->saver->pause(tag); });
}

reservoir_status reservoir_saver_pause_keeping(reservoir_saver* saver, const char* tag, const char* contents) {
  RESERVOIR_REQUIRE(saver != nullptr && tag != nullptr, "saver and tag must not be NULL");
  reservoir::PauseContents keeps = reservoir::PauseContents::as_regions;
  if (contents != nullptr) {
    try {
      keeps = reservoir::parse_pause_contents(contents, "contents");
    } catch (const reservoir::UsageError& e) {
      return fail(RESERVOIR_ERROR_INVALID_ARGUMENT, fmt::format("{}: {}", __func__, e.what()));
    }
  }
  return guarded(__func__, [&] { saver->saver->pause(tag, keeps); });
}

reservoir_status reservoir_saver_resume(reservoir_saver* saver, const char* tag) {
  RESERVOIR_REQUIRE(saver != nullptr, "saver must not be NULL");
  return guarded(__func__, [&] { tag == nullptr ? saver->saver->resume() : saver->saver->resume(tag); });
}

reservoir_status reservoir_saver_is_paused(reservoir_saver* saver, const char* tag, int* paused) {
  RESERVOIR_REQUIRE(saver != nullptr && tag != nullptr && paused != nullptr,
                    "saver, tag and paused must not be NULL");
  return guarded(__func__, [&] { *paused = saver->saver->is_paused(tag) ? 1 : 0; });
}

reservoir_status reservoir_saver_tags_json(reservoir_saver* saver, char** out) {
  RESERVOIR_REQUIRE(saver != nullptr && out != nullptr, "saver and out must not be NULL");
  return guarded(__func__, [&] {
    nlohmann::json tags = nlohmann::json::array();
    for (const reservoir::TagInfo& t : saver->saver->tags()) {
      nlohmann::json fields = nlohmann::json::object();
      t.for_each_field([&](const char* name, const auto& value) { fields[name] = value; });
      tags.push_back(std::move(fields));
    }
    *out = copy_string(tags.dump());
  });
}

}  // extern "C"
