// Native call stacks: capture (cheap, return addresses only) and
// symbolization (slow, cached; done when a snapshot is exported).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "reservoir/snapshot.hpp"

namespace reservoir::detail {

// Return addresses of the calling thread's stack, innermost first, skipping
// `skip` innermost frames; at most `max_frames`.
std::vector<std::uintptr_t> capture_stack(std::size_t skip, std::size_t max_frames);

// Frames for return addresses (inlined calls expand to several frames),
// innermost first. File and line come from the binaries' debug information
// when it is present (GCC's libbacktrace), else the symbol table (dladdr);
// names are demangled.
std::vector<Frame> symbolize(const std::vector<std::uintptr_t>& stack);

}  // namespace reservoir::detail
