// Allocation traces, every layer: the model (trace_model.hpp), the formats
// (trace_formats.hpp), replay (replay.hpp) and verify (verify.hpp). Include
// the one a file needs; this header is for code that uses them all.
#pragma once

#include "reservoir/replay.hpp"
#include "reservoir/trace_formats.hpp"
#include "reservoir/trace_model.hpp"
#include "reservoir/verify.hpp"
