// Generated programs: seeded allocation programs of the shapes deep-learning
// jobs have, for comparing policies where no recording covers a case.
//
// Each program is one to three parts, each of one family:
//   training   weights, then steps of forward (activations kept, workspaces
//              freed at once), backward (activations freed in reverse,
//              gradients made on the first step) and optimizer temporaries;
//   inference  weights, then requests of varying batch and sequence length:
//              a KV cache and per-layer activations scaled by both, attention
//              scores freed at once, all freed at the end of the request;
//   huge       many small and mid-sized allocations with a few of 0.5 to
//              2.5 GiB among them, freed in random order;
//   streams    random work on two to four streams, with some blocks used on
//              another stream (record_stream) before they are freed;
// with empty_cache() anywhere, and half the programs freeing everything at
// the end. The same seed gives the same program on every machine.
#pragma once

#include <cstdint>

#include "reservoir/replay.hpp"

namespace reservoir {

// The program of `seed`, named "generated #SEED (families)".
ReplayProgram generated_program(std::uint64_t seed);

}  // namespace reservoir
