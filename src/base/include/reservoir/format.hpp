// Size formatting as PyTorch prints it.
#pragma once

#include <cstdint>
#include <string>

namespace reservoir {

// "512 bytes", "1.50 KiB", "20.00 MiB", "1.25 GiB": the format of PyTorch's
// out-of-memory message (two decimals, binary units, <= 1024 is bytes).
std::string format_size(std::uint64_t bytes);

// Parses "123", "4096B", "1.5KiB", "20MiB", "2GiB", "1GB" (decimal units are
// accepted as binary ones, as GPU sizes are spoken of). Throws UsageError.
std::uint64_t parse_size(const std::string& text);

}  // namespace reservoir
