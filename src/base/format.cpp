#include "reservoir/format.hpp"

#include <fmt/format.h>

#include <cctype>
#include <cmath>
#include <string_view>

#include "reservoir/errors.hpp"

namespace reservoir {

std::string format_size(std::uint64_t bytes) {
  if (bytes <= 1024) return fmt::format("{} bytes", bytes);
  const auto b = static_cast<double>(bytes);
  if (bytes <= 1048576) return fmt::format("{:.2f} KiB", b / 1024.0);
  if (bytes <= 1073741824ULL) return fmt::format("{:.2f} MiB", b / 1048576.0);
  return fmt::format("{:.2f} GiB", b / 1073741824.0);
}

std::uint64_t parse_size(const std::string& text) {
  std::size_t i = 0;
  while (i < text.size() && (std::isdigit(static_cast<unsigned char>(text[i])) || text[i] == '.')) {
    ++i;
  }
  const std::string number = text.substr(0, i);
  std::string unit = text.substr(i);
  for (char& c : unit) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (number.empty() || number.find('.') != number.rfind('.')) {
    throw UsageError(
        fmt::format("size '{}': expected a number with an optional unit "
                    "(B, KiB, MiB, GiB, TiB)",
                    text));
  }
  double scale = 1.0;
  if (unit.empty() || unit == "b") {
    scale = 1.0;
  } else if (unit == "k" || unit == "kb" || unit == "kib") {
    scale = 1024.0;
  } else if (unit == "m" || unit == "mb" || unit == "mib") {
    scale = 1024.0 * 1024.0;
  } else if (unit == "g" || unit == "gb" || unit == "gib") {
    scale = 1024.0 * 1024.0 * 1024.0;
  } else if (unit == "t" || unit == "tb" || unit == "tib") {
    scale = 1024.0 * 1024.0 * 1024.0 * 1024.0;
  } else {
    throw UsageError(fmt::format("size '{}': unknown unit '{}' (accepted: B, KiB, MiB, GiB, TiB)",
                                 text, text.substr(i)));
  }
  if (number == ".") throw UsageError(fmt::format("size '{}': expected a number", text));
  const double value = std::stod(number) * scale;
  if (!(value >= 0.0) || value >= 1.8e19) {
    throw UsageError(fmt::format("size '{}' is out of range", text));
  }
  return static_cast<std::uint64_t>(std::llround(value));
}

}  // namespace reservoir
