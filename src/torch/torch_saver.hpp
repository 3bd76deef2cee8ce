// The saver PyTorch's pluggable allocator serves device `device` from,
// created on first use (see reservoir_torch.cpp). Throws on failure.
#pragma once

#include "reservoir/saver.hpp"

namespace reservoir {
Saver& torch_saver(int device);
}  // namespace reservoir
