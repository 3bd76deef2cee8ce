"""PyTorch's native caching allocator measured from C++ beside reservoir and
CUDA's own allocation calls (torch_native_bench.cpp, built here with
PyTorch's C++ extension loader: ninja and the machine's C++ compiler).

Usage: torch_native_bench.py LIBRESERVOIR_TORCH [BUILD_DIR]
Prints one JSON line last: {"cache_hit": {size: {kind: median ns}}, "cache_miss": ...,
"rounds": ..., "ratio_reservoir_over_torch": {size: ratio}}. Exit 77 without CUDA PyTorch.
"""
import json
import os
import statistics
import sys
import tempfile

lib = os.path.abspath(sys.argv[1])
build_dir = sys.argv[2] if len(sys.argv) > 2 else tempfile.mkdtemp(prefix="reservoir_native_bench_")

try:
    import torch
    if not torch.cuda.is_available():
        raise ImportError("torch.cuda.is_available() is False")
except ImportError as e:
    print(f"SKIPPED: {e}")
    sys.exit(77)

from torch.utils.cpp_extension import load

os.makedirs(build_dir, exist_ok=True)
ext = load(name="reservoir_native_bench",
           sources=[os.path.join(os.path.dirname(os.path.abspath(__file__)), "torch_native_bench.cpp")],
           extra_cflags=["-O2"], with_cuda=True, build_directory=build_dir, verbose=False)
torch.cuda.init()
torch.zeros(1, device="cuda")
ext.load_plugin(lib)

KINDS = ["torch", "reservoir", "cudaMalloc", "cudaMallocAsync"]
result = {"cache_hit": {}, "cache_miss": {}, "unit": "ns per allocate+free pair (median)"}
rounds = {}
for size in (4096, 1 << 20, 64 << 20):
    runs = ext.measure(KINDS, size, False, 20000 if size < (64 << 20) else 2000, 9)
    result["cache_hit"][str(size)] = {k: statistics.median(v) for k, v in runs.items()}
    rounds[f"hit_{size}"] = runs
for size in (4096, 64 << 20):
    runs = ext.measure(KINDS, size, True, 100, 5)
    result["cache_miss"][str(size)] = {k: statistics.median(v) for k, v in runs.items()}
    rounds[f"miss_{size}"] = runs
result["ratio_reservoir_over_torch"] = {
    size: row["reservoir"] / row["torch"] for size, row in result["cache_hit"].items()}
result["rounds"] = rounds
for what in ("cache_hit", "cache_miss"):
    for size, row in result[what].items():
        print(f"{what} {int(size):>9} B: " + "  ".join(f"{k} {v:9.1f} ns" for k, v in row.items()))
print(json.dumps(result))
