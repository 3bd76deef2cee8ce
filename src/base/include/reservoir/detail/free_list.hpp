// A free list of ranges (start -> length), taken first fit and merged with
// its neighbours when given back: the simulated devices' address allocators
// (SimDevice's freed segment ranges; simcuda's device memory and address
// spaces).
#pragma once

#include <iterator>
#include <map>

namespace reservoir::detail {

// Takes `bytes` at the lowest start that fits, aligned to `alignment` (a
// power of two; 1: none); what is left before and after stays in the list.
// False when no range fits.
template <typename Key, typename Length>
bool take_first_fit(std::map<Key, Length>& ranges, Length bytes, Length alignment, Key* start) {
  for (auto it = ranges.begin(); it != ranges.end(); ++it) {
    const Key from = it->first;
    const Key end = from + it->second;
    const Key at = (from + alignment - 1) & ~static_cast<Key>(alignment - 1);
    if (at < from || at > end || end - at < bytes) continue;
    ranges.erase(it);
    if (at > from) ranges.emplace(from, at - from);
    if (at + bytes < end) ranges.emplace(at + bytes, end - at - bytes);
    *start = at;
    return true;
  }
  return false;
}

// Puts [start, start + length) back, merged with the ranges it touches.
template <typename Key, typename Length>
void give_back(std::map<Key, Length>& ranges, Key start, Length length) {
  auto next = ranges.lower_bound(start);
  if (next != ranges.end() && next->first == start + length) {
    length += next->second;
    next = ranges.erase(next);
  }
  if (next != ranges.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second == start) {
      start = prev->first;
      length += prev->second;
      ranges.erase(prev);
    }
  }
  ranges.emplace(start, length);
}

}  // namespace reservoir::detail
