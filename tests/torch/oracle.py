"""Random allocation programs through PyTorch's own caching allocator, each
dumped as the snapshot PyTorch writes: the oracle reservoir verify is
checked against (tests/torch/test_oracle.py).

usage: oracle.py OUT_DIR SEED PROGRAMS [--oom | --keep-going] [--fraction F] [--own]

Runs PROGRAMS programs in this process under the settings of
PYTORCH_CUDA_ALLOC_CONF, each starting from an empty allocator: sizes from a
byte to a GiB (log-uniform), two streams, record_stream, frees in random
order, empty_cache anywhere. With --oom each program allocates until PyTorch
runs out of memory (on a device made small for it) and the snapshot is
dumped at the failure, as training scripts do. With --keep-going a program
that runs out of memory catches the error, frees about half of what it
holds and goes on, as a server that sheds load does (its snapshot holds
every oom). --fraction F calls set_per_process_memory_fraction(F) before
the first allocation (garbage_collection_threshold acts only under one;
without --fraction such settings get 1.0). --own runs the programs on
reservoir as PyTorch's own allocator instead. Writes OUT_DIR/pNNNN.pickle.
"""
import os
import pickle
import random
import sys

import torch

out_dir, seed, programs = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
oom = "--oom" in sys.argv
keep_going = "--keep-going" in sys.argv
fraction = float(sys.argv[sys.argv.index("--fraction") + 1]) if "--fraction" in sys.argv else None
if fraction is None and "garbage_collection_threshold" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""):
    fraction = 1.0  # garbage collection acts only under a memory fraction
os.makedirs(out_dir, exist_ok=True)
if "--own" in sys.argv:
    # reservoir as PyTorch's own allocator, under RESERVOIR_ALLOC_CONF's
    # settings (reservoir's policies among them), else PYTORCH_CUDA_ALLOC_CONF's:
    # the snapshots are its own, for verify to check against reservoir's
    # rules of the running release.
    import reservoir

    reservoir.use_as_allocator(os.environ.get("RESERVOIR_ALLOC_CONF") or
                               os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""))
torch.cuda.init()
if fraction is not None:
    # Set before any allocation; a snapshot does not record it.
    torch.cuda.set_per_process_memory_fraction(fraction)
streams = [torch.cuda.current_stream(), torch.cuda.Stream()]
MiB = 1 << 20
# PyTorch 2.15's annotations of live allocations (trace action "annotate").
annotate = getattr(torch.cuda.memory, "_annotate_tensor", None)


def program(rng):
    live = []
    steps = rng.randrange(20, 300)
    try:
        for _ in range(steps if not oom else 100000):
            r = rng.random()
            if oom or r < 0.55 or not live:
                top = 32 if oom or keep_going else 30
                n = max(1, int(2 ** rng.uniform(0, top)))
                try:
                    with torch.cuda.stream(rng.choice(streams)):
                        live.append(torch.empty(n, dtype=torch.uint8, device="cuda"))
                except torch.cuda.OutOfMemoryError:
                    if not keep_going:
                        raise
                    rng.shuffle(live)
                    del live[:(len(live) + 1) // 2]
                    continue
                if rng.random() < 0.05:
                    live[-1].record_stream(rng.choice(streams))
                if annotate is not None and rng.random() < 0.05:
                    annotate(live[-1][n // 2:], f"tensor {len(live)}")
                if oom and rng.random() < 0.3:
                    live.pop(rng.randrange(len(live)))
            elif r < 0.98:
                live.pop(rng.randrange(len(live)))
            else:
                torch.cuda.empty_cache()
    except torch.cuda.OutOfMemoryError:
        if not oom:
            raise
    return live


def record(on):
    """Starts (on) or stops the allocator's history as the running release
    spells it: 2.0's takes a flag, trace_alloc_max_entries and whether its
    events carry their stacks (as 2.1's and later's do by default), 2.1's
    and later's `enabled` ("all" or None) and max_entries."""
    if HISTORY_2_0:
        torch.cuda.memory._record_memory_history(on, trace_alloc_max_entries=1000000 if on else 1,
                                                 trace_alloc_record_context=on)
    else:
        torch.cuda.memory._record_memory_history(**({"max_entries": 1000000} if on else {"enabled": None}))


def dump(path):
    """The snapshot as the release writes it: _dump_snapshot from 2.1; 2.0's
    users pickled _snapshot() themselves (its documentation's way)."""
    if HISTORY_2_0:
        with open(path, "wb") as f:
            pickle.dump(torch.cuda.memory._snapshot(), f)
    else:
        torch.cuda.memory._dump_snapshot(path)


HISTORY_2_0 = not hasattr(torch.cuda.memory, "_dump_snapshot")
rng = random.Random(seed)
for i in range(programs):
    record(True)
    live = program(rng)
    dump(os.path.join(out_dir, f"p{i:04d}.pickle"))
    record(False)
    del live
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    assert torch.cuda.memory_reserved() == 0
