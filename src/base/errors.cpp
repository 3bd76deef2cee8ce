// Out-of-line members of reservoir's exceptions.
#include "reservoir/errors.hpp"

#include <fmt/format.h>

namespace reservoir {

DeviceError::DeviceError(CallKind call, Status status, const std::string& context)
    : Error(fmt::format("{}: device call {} failed with {}", context, to_string(call),
                        to_string(status))),
      call_(call),
      status_(status) {}

}  // namespace reservoir
