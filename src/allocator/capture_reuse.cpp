// graph_capture_record_stream_reuse:True (PyTorch 2.10 and later): during a
// CUDA graph capture, a block freed after use on other streams
// (record_stream) need not wait for the capture to end. It is marked with
// the nodes each of its streams' work ends at when it is freed (its "free
// markers"); a later request on the block's stream frees it once every
// marker is an ancestor of that stream's next work, found by walking the
// capture's graph back from the stream's last nodes. Then all the work the
// capture adds on the stream comes after the block's last use on every
// stream, which an event would otherwise have to tell, and events cannot
// be asked during a capture. The walk's findings are kept per capture and
// stream (the graph only grows), and forgotten when the capture's route
// ends, as PyTorch's allocator does from 2.10. 2.9, where the setting came
// in, marks a freed block with empty nodes it adds to the capture after
// each stream's last nodes; on the simulated device its allocator gave such
// a block back only at the capture's end (test_release.py's program), and
// under 2.9 reservoir leaves it to the end too (as without the setting).
#include <fmt/format.h>

#include <algorithm>

#include "allocator_impl.hpp"
#include "reservoir/errors.hpp"

namespace reservoir {

using detail::Block;

CaptureFrontier CachingAllocator::Impl::frontier_of(StreamId stream) {
  CaptureFrontier f;
  const Status status = device_.capture_frontier(stream, &f);
  if (status != Status::ok) {
    throw DeviceError(CallKind::capture_frontier, status,
                      fmt::format("asking stream {} for the capture it takes part in", stream));
  }
  return f;
}

void CachingAllocator::Impl::mark_capture_free(const Block* block) {
  if (!config_.pytorch_version.empty() && compare_versions(config_.pytorch_version, "2.10") < 0) return;
  // Every stream's last nodes, each once; none (the block waits for the
  // capture's end) when one of the streams does not capture or captures
  // into another graph.
  std::vector<StreamId> streams{block->stream};
  streams.insert(streams.end(), block->stream_uses.begin(), block->stream_uses.end());
  std::vector<GraphNode> markers;
  std::uint64_t capture = 0;
  for (StreamId s : streams) {
    const CaptureFrontier f = frontier_of(s);
    if (f.id == 0 || (capture != 0 && f.id != capture)) return;
    capture = f.id;
    for (GraphNode n : f.nodes) {
      if (std::find(markers.begin(), markers.end(), n) == markers.end()) markers.push_back(n);
    }
  }
  if (!markers.empty()) capture_markers_[block] = std::move(markers);
}

void CachingAllocator::Impl::reuse_freed_in_capture(StreamId stream) {
  const CaptureFrontier f = frontier_of(stream);
  if (f.id == 0 || f.nodes.empty()) return;
  auto found = capture_visited_.find(f.id);
  if (found == capture_visited_.end()) {
    // The capture's pool: the innermost route that takes the stream.
    auto route = std::find_if(routes_.rbegin(), routes_.rend(),
                              [&](const auto& r) { return r.second(stream); });
    if (route == routes_.rend()) return;  // a capture no pool is routed to
    found =
        capture_visited_.emplace(f.id, std::map<StreamId, std::unordered_set<GraphNode>>{}).first;
    pool_capture_[route->first] = f.id;
  }
  std::unordered_set<GraphNode>& visited = found->second[stream];
  // Every ancestor of the stream's last nodes (and they themselves). All or
  // nothing: when a query fails, the nodes this walk added are taken back,
  // so that the next walk explores them again.
  std::vector<GraphNode> stack = f.nodes;
  std::vector<GraphNode> added;
  std::vector<GraphNode> parents;
  try {
    while (!stack.empty()) {
      const GraphNode v = stack.back();
      stack.pop_back();
      if (visited.count(v) != 0) continue;
      const Status status = device_.node_dependencies(v, &parents);
      if (status != Status::ok) {
        throw DeviceError(
            CallKind::node_dependencies, status,
            fmt::format("asking node {:#x} of capture {} for its dependencies", v, f.id));
      }
      visited.insert(v);
      added.push_back(v);
      stack.insert(stack.end(), parents.begin(), parents.end());
    }
  } catch (...) {
    for (GraphNode v : added) visited.erase(v);
    throw;
  }
  // The stream's marked blocks whose every marker was reached, in the
  // order they were freed.
  for (auto it = deferred_event_blocks_.begin(); it != deferred_event_blocks_.end();) {
    Block* block = *it;
    auto marked = capture_markers_.find(block);
    if (block->stream != stream || marked == capture_markers_.end() ||
        !std::all_of(marked->second.begin(), marked->second.end(),
                     [&](GraphNode n) { return visited.count(n) != 0; })) {
      ++it;
      continue;
    }
    capture_markers_.erase(marked);
    it = deferred_event_blocks_.erase(it);
    block->stream_uses.clear();  // the graph orders its uses: no event needed
    free_block(block);
  }
}

void CachingAllocator::Impl::end_capture_reuse(PoolId id) {
  auto it = pool_capture_.find(id);
  if (it == pool_capture_.end()) return;
  capture_visited_.erase(it->second);
  pool_capture_.erase(it);
}

}  // namespace reservoir
