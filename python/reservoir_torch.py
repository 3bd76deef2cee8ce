"""Install reservoir as PyTorch's CUDA allocator.

    import reservoir_torch
    reservoir_torch.install("expandable_segments:True")   # before the first CUDA tensor
    ...
    print(reservoir_torch.memory_summary())
    reservoir_torch.dump_snapshot("snap.pickle")           # opens in pytorch.org/memory_viz

install() loads libreservoir_torch.so (RESERVOIR_TORCH_LIB, else the one in
the reservoir package, else one next to this file) through torch.cuda.memory.
CUDAPluggableAllocator (PyTorch 2.0 and later) and makes it the current
allocator. The config uses PYTORCH_CUDA_ALLOC_CONF's syntax and reservoir's
policies (policy:paging); expandable and paging run on CUDA's virtual-memory
API. The other functions read the library directly, so they work with or
without PyTorch.
"""
import ctypes
import importlib.util
import json
import os

_lib = None


def library_path():
    env = os.environ.get("RESERVOIR_TORCH_LIB")
    if env:
        return env
    candidates = []
    spec = importlib.util.find_spec("reservoir")  # finds the package without importing it
    if spec is not None and spec.origin:
        candidates.append(os.path.join(os.path.dirname(spec.origin), "lib", "libreservoir_torch.so"))
    candidates.append(os.path.join(os.path.dirname(os.path.abspath(__file__)), "libreservoir_torch.so"))
    for candidate in candidates:
        if os.path.exists(candidate):
            return os.path.abspath(candidate)
    raise FileNotFoundError("libreservoir_torch.so not found (looked at " + ", ".join(candidates) +
                            "): install reservoir (pip install .) or set RESERVOIR_TORCH_LIB")


def library():
    """The loaded library (ctypes), loaded once."""
    global _lib
    if _lib is None:
        lib = ctypes.CDLL(library_path())
        lib.reservoir_torch_malloc.restype = ctypes.c_void_p
        lib.reservoir_torch_malloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
        lib.reservoir_torch_free.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int,
                                             ctypes.c_void_p]
        for name in ("reservoir_torch_stats_json", "reservoir_torch_memory_summary"):
            getattr(lib, name).restype = ctypes.c_void_p  # freed with libc free
        lib.reservoir_torch_stats_json.argtypes = [ctypes.c_int]
        lib.reservoir_torch_memory_summary.argtypes = [ctypes.c_int, ctypes.c_int]
        lib.reservoir_torch_last_error.restype = ctypes.c_char_p
        lib.reservoir_torch_record_history.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_size_t,
                                                       ctypes.c_int]
        lib.reservoir_torch_dump_snapshot.argtypes = [ctypes.c_int, ctypes.c_char_p]
        lib.reservoir_torch_set_memory_fraction.argtypes = [ctypes.c_double, ctypes.c_int]
        lib.reservoir_torch_record_stream.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        _lib = lib
    return _lib


def _take_string(ptr):
    if not ptr:
        raise RuntimeError(library().reservoir_torch_last_error().decode())
    try:
        return ctypes.string_at(ptr).decode()
    finally:
        ctypes.CDLL(None).free(ctypes.c_void_p(ptr))


def install(config=None, device_kind=None):
    """Make reservoir PyTorch's CUDA allocator (call before any CUDA allocation)."""
    import torch

    if config is not None:
        os.environ["RESERVOIR_ALLOC_CONF"] = config
    if device_kind is not None:
        os.environ["RESERVOIR_TORCH_DEVICE"] = device_kind
    pluggable = getattr(torch.cuda.memory, "CUDAPluggableAllocator", None)
    if pluggable is None:
        raise RuntimeError(f"PyTorch {torch.__version__} has no CUDAPluggableAllocator (2.0+ needed)")
    allocator = pluggable(library_path(), "reservoir_torch_malloc", "reservoir_torch_free")
    torch.cuda.memory.change_current_allocator(allocator)
    return allocator


def memory_stats(device=0):
    """torch.cuda.memory_stats()'s keys and values, from reservoir."""
    return json.loads(_take_string(library().reservoir_torch_stats_json(device)))


def memory_summary(device=0, abbreviated=False):
    return _take_string(library().reservoir_torch_memory_summary(device, int(abbreviated)))


def empty_cache():
    library().reservoir_torch_empty_cache()


def set_memory_fraction(fraction, device=0):
    if library().reservoir_torch_set_memory_fraction(fraction, device) != 0:
        raise ValueError(library().reservoir_torch_last_error().decode())


def record_memory_history(enabled=True, max_entries=1_000_000, stacks=False, device=0):
    if library().reservoir_torch_record_history(device, int(enabled), max_entries, int(stacks)) != 0:
        raise RuntimeError(library().reservoir_torch_last_error().decode())


def dump_snapshot(path, device=0):
    """The allocator's snapshot as a PyTorch pickle (memory_viz reads it)."""
    if library().reservoir_torch_dump_snapshot(device, os.fsencode(path)) != 0:
        raise RuntimeError(library().reservoir_torch_last_error().decode())
