"""libreservoir_torch.so and python/reservoir_torch.py without a GPU: the
entry points PyTorch's CUDAPluggableAllocator calls, driven through ctypes on
a simulated device (RESERVOIR_TORCH_DEVICE=sim), with exact figures.

Usage: torch_plugin_test.py LIBRARY SOURCE_DIR WORK_DIR
"""
import ctypes
import os
import pickle
import sys

lib_path, src, work = sys.argv[1:4]
os.environ["RESERVOIR_TORCH_LIB"] = lib_path
os.environ["RESERVOIR_TORCH_DEVICE"] = "sim"
os.environ["RESERVOIR_ALLOC_CONF"] = "max_split_size_mb:64"
sys.path.insert(0, os.path.join(src, "python"))
import reservoir_torch as rt  # noqa: E402

lib = rt.library()
rt.record_memory_history(max_entries=100)
a = lib.reservoir_torch_malloc(1000, 0, None)
b = lib.reservoir_torch_malloc(30 << 20, 0, ctypes.c_void_p(7))
c = lib.reservoir_torch_malloc(4096, 1, None)  # a second device gets its own allocator
assert a and b and c
stats = rt.memory_stats(0)
assert stats["allocated_bytes.all.current"] == 1024 + (30 << 20), stats["allocated_bytes.all.current"]
assert stats["reserved_bytes.all.current"] == (2 << 20) + (30 << 20)
assert stats["max_split_size"] == 64 << 20
assert rt.memory_stats(1)["allocated_bytes.all.current"] == 4096
lib.reservoir_torch_record_stream(ctypes.c_void_p(b), ctypes.c_void_p(9))
lib.reservoir_torch_free(ctypes.c_void_p(b), 30 << 20, 0, ctypes.c_void_p(7))
lib.reservoir_torch_free(ctypes.c_void_p(a), 1000, 0, None)
lib.reservoir_torch_free(ctypes.c_void_p(c), 4096, 1, None)
assert rt.memory_stats(0)["allocated_bytes.all.current"] == 0
# A pointer that is not ours: an error message, no crash, the allocator intact.
lib.reservoir_torch_free(ctypes.c_void_p(a + 512), 1, 0, None)
assert "deallocate" in lib.reservoir_torch_last_error().decode()
summary = rt.memory_summary(0, abbreviated=True)
assert "PyTorch CUDA memory summary, device ID 0" in summary
snap = os.path.join(work, "torch_plugin.pickle")
os.makedirs(work, exist_ok=True)
rt.dump_snapshot(snap)
with open(snap, "rb") as f:
    s = pickle.load(f)
actions = [e["action"] for e in s["device_traces"][0]]
assert actions[:4] == ["segment_alloc", "alloc", "segment_alloc", "alloc"], actions
assert s["allocator_settings"]["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:64"
rt.empty_cache()
assert rt.memory_stats(0)["reserved_bytes.all.current"] == 0
# Out of memory: null and the reason.
rt.set_memory_fraction(0.000001)
assert not lib.reservoir_torch_malloc(1 << 30, 0, None)
assert "out of memory" in lib.reservoir_torch_last_error().decode().lower()
# The exported names PyTorch's loader looks up exist with C linkage.
for name in ("reservoir_torch_malloc", "reservoir_torch_free", "reservoir_torch_init",
             "reservoir_torch_reset", "reservoir_torch_set_memory_fraction",
             "reservoir_torch_record_stream"):
    getattr(lib, name)
print("torch plugin: all checks passed")
