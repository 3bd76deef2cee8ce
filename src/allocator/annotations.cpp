// Annotations: per-thread stacks of interned names.
//
// Each distinct path (parent, name) is interned once, process-wide, as a
// node id; a thread keeps its stack of ids and a private cache of the nodes
// it has entered, so a push that was seen before takes no lock.
#include <fmt/format.h>

#include <deque>
#include <mutex>
#include <unordered_map>

#include "reservoir/errors.hpp"
#include "reservoir/history.hpp"

namespace reservoir {
namespace {

struct Node {
  std::uint32_t parent;
  std::string name;
};

struct Table {
  std::mutex mutex;
  std::deque<Node> nodes{Node{0, ""}};  // [0]: the root (no annotation)
  std::unordered_map<std::string, std::uint32_t> ids;  // key: parent id, '/', name

  std::uint32_t intern(std::uint32_t parent, std::string_view name) {
    std::string key = fmt::format("{}/{}", parent, name);
    std::lock_guard lock(mutex);
    auto [it, inserted] = ids.try_emplace(std::move(key), 0);
    if (inserted) {
      it->second = static_cast<std::uint32_t>(nodes.size());
      nodes.push_back(Node{parent, std::string(name)});
    }
    return it->second;
  }
};

Table& table() {
  static Table* t = new Table;  // never destroyed: threads may annotate during exit
  return *t;
}

struct CachedChild {
  std::uint32_t parent;
  std::string name;
  std::uint32_t id;
};

struct ThreadState {
  std::vector<std::uint32_t> stack;
  std::unordered_multimap<std::size_t, CachedChild> children;
};

ThreadState& thread_state() {
  thread_local ThreadState state;
  return state;
}

}  // namespace

void push_annotation(std::string_view name) {
  ThreadState& t = thread_state();
  const std::uint32_t parent = t.stack.empty() ? 0 : t.stack.back();
  const std::size_t hash = std::hash<std::string_view>{}(name) ^ (std::size_t{parent} * 0x9e3779b97f4a7c15ULL);
  auto [first, last] = t.children.equal_range(hash);
  for (auto it = first; it != last; ++it) {
    if (it->second.parent == parent && it->second.name == name) {
      t.stack.push_back(it->second.id);
      return;
    }
  }
  const std::uint32_t id = table().intern(parent, name);
  t.children.emplace(hash, CachedChild{parent, std::string(name), id});
  t.stack.push_back(id);
}

void pop_annotation() {
  ThreadState& t = thread_state();
  if (t.stack.empty()) throw UsageError("pop_annotation: this thread has no annotation to leave");
  t.stack.pop_back();
}

void ScopedAnnotation::pop_annotation_noexcept() noexcept {
  ThreadState& t = thread_state();
  if (!t.stack.empty()) t.stack.pop_back();
}

std::vector<std::string> current_annotations() {
  return detail::annotation_path(detail::current_annotation_id());
}

namespace detail {

std::uint32_t current_annotation_id() noexcept {
  const ThreadState& t = thread_state();
  return t.stack.empty() ? 0 : t.stack.back();
}

std::vector<std::string> annotation_path(std::uint32_t id) {
  std::vector<std::string> path;
  Table& tab = table();
  std::lock_guard lock(tab.mutex);
  if (id >= tab.nodes.size()) return path;
  while (id != 0) {
    path.push_back(tab.nodes[id].name);
    id = tab.nodes[id].parent;
  }
  return {path.rbegin(), path.rend()};
}

}  // namespace detail
}  // namespace reservoir
