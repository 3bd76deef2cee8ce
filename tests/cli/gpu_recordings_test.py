"""`reservoir verify` and `reservoir advise` on snapshots recorded on a real
GPU (tests/data/gpu/h100-2026-11-25: PyTorch 2.11.0+cu130 on an H100, by
tests/gpu/record_gpu_snapshots.py): every recording agrees event for event,
or says precisely why it cannot be verified; the out-of-memory one is
explained.

Usage: gpu_recordings_test.py RESERVOIR_BINARY SOURCE_DIR
"""
import os
import re
import subprocess
import sys

binary, src = sys.argv[1], sys.argv[2]
data = os.path.join(src, "tests", "data", "gpu", "h100-2026-11-25")
failures = []


def check(cond, what):
    if not cond:
        failures.append(str(what))


def has(text, part):
    """part in text, read as words: lines over 100 columns wrap at spaces."""
    return " ".join(part.split()) in " ".join(text.split())


def run(*args):
    return subprocess.run([binary, *args], capture_output=True, text=True)


# name -> (events, alloc addresses, segment_allocs, segment_frees, ooms) the verifier reports
# agreeing; under expandable segments the segment counts are maps and unmaps.
AGREES = {
    "default.pickle": "5496 events.*1776 alloc addresses, 93 segment_alloc sizes and addresses, 87 segment_free, 0 oom",
    "split_roundup.pickle":
        "5512 events.*1776 alloc addresses, 101 segment_alloc sizes and addresses, 95 segment_free, 0 oom",
    "two_streams.pickle": "3483 events.*1224 alloc addresses, 54 segment_alloc sizes and addresses, 0 segment_free",
    "expandable.pickle": "5411 events.*1776 alloc addresses.*2 new reservations, 83 segment_map and 12 segment_unmap",
    "oom.pickle": "2584 events.*984 alloc addresses, 71 segment_alloc sizes and addresses, 12 segment_free, 1 oom",
}
for name, pattern in AGREES.items():
    r = run("verify", os.path.join(data, name))
    text = " ".join(r.stdout.split())
    check(r.returncode == 0, f"{name}: verify exit {r.returncode}: {r.stdout}{r.stderr}")
    check(has(r.stdout, "agrees with the recording"), f"{name}: {r.stdout}")
    check(re.search(pattern, text), f"{name}: expected /{pattern}/ in {r.stdout}")
    check(has(r.stdout, "final segment layout identical"), f"{name}: {r.stdout}")

# The empty_cache() calls between steps are seen as such.
r = run("verify", os.path.join(data, "default.pickle"))
check(has(r.stdout, "3 empty_cache() calls"), r.stdout)

# With the limit the program set (set_per_process_memory_fraction of 1.5 GiB on a device
# CUDA reports as 85017493504 bytes), the out-of-memory error is checked against it exactly.
r = run("verify", os.path.join(data, "oom.pickle"), "--memory-fraction", repr(1610612736 / 85017493504),
        "--device-memory", "85017493504B")
check(r.returncode == 0 and has(r.stdout, "1 oom checked"), f"oom with its limit: {r.returncode} {r.stdout}{r.stderr}")

# A MemPool and a CUDA graph: the recording does not say which allocations went to the
# private pool, so verification stops there, says so, and exits 3.
r = run("verify", os.path.join(data, "mempool_graph.pickle"))
check(r.returncode == 3, f"mempool_graph: exit {r.returncode}, expected 3: {r.stdout}{r.stderr}")
check(has(r.stdout, "CANNOT VERIFY at event 677 of 1530"), r.stdout)
check(has(r.stdout, "private pool (0, 1)") and has(r.stdout, "CUDA graph capture or torch.cuda.MemPool"), r.stdout)
check(has(r.stdout, "agreed before it: 272 alloc addresses, 29 segment_allocs"), r.stdout)

# advise explains the out-of-memory error: the request, where the memory was, and what fits.
r = run("advise", os.path.join(data, "oom.pickle"))
check(r.returncode == 0, f"advise exit {r.returncode}: {r.stderr}")
out = r.stdout
check(has(out, "failed request        31.25 MiB on the default stream, large pool"), out[:2000])
check(has(out, "reserved, unallocated 79.67 MiB"), out[:2000])
check(has(out, "fragmentation"), out[:2000])
check(has(out, "record_gpu_snapshots.py:99 step"), out[:2000])
# The device had 76.97 GiB free: the program's own 1.5 GiB limit refused the segment, and the
# advice is judged against that limit, under which the recorded settings run out of memory.
check(has(out, "memory limit          at least 1.47 GiB, below 1.50 GiB"), out[:3000])
check(has(out, "own memory limit (torch.cuda.set_per_process_memory_fraction)"), out[:3000])
check(re.search(r"native defaults \(recorded\)\s+1\.50 GiB\s+1\.0591.*\s1\n", out), out)
check(has(out, "PYTORCH_ALLOC_CONF=max_split_size_mb:20") and has(out, "24.00 MiB of headroom on 1.47 GiB"), out)

if failures:
    print("\n".join(failures))
    sys.exit(1)
print(f"{len(AGREES)} GPU recordings agree; the MemPool/graph one says why it cannot; advise explains the OOM")
