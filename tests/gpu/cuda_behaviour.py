#!/usr/bin/env python3
"""What the CUDA runtime and driver answer to the calls reservoir makes.

Runs a fixed list of calls through ctypes -- good ones, bad ones, edge cases
-- and prints one JSON object: for each probe, the codes the calls returned
and the values worth comparing (alignments, address steps, granularity,
free-memory deltas), plus median call times. Run once on a real GPU and once
under the simulated device (LD_LIBRARY_PATH=build/simcuda, or --cudart and
--cuda naming its libraries), then compare the two with
tests/gpu/compare_behaviour.py: every difference is either made to agree in
the simulated device or listed there with its reason.

Nothing here touches device memory from the host (a real GPU's memory is
not host-visible): contents are checked with cuMemcpy.

    python3 tests/gpu/cuda_behaviour.py [--cudart PATH] [--cuda PATH] [--out FILE]
"""
import argparse
import ctypes
import glob
import json
import os
import statistics
import sys
import time

c_size = ctypes.c_size_t
c_ptr = ctypes.c_void_p
c_u64 = ctypes.c_uint64

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30


def load(names, explicit):
    tried = []
    for name in ([explicit] if explicit else []) + names:
        try:
            return ctypes.CDLL(name), name
        except OSError as e:
            tried.append(f"{name}: {e}")
    raise SystemExit("cannot load any of: " + "; ".join(tried))


def cudart_candidates():
    names = ["libcudart.so.13"]
    for base in sys.path:
        names += sorted(glob.glob(os.path.join(base, "nvidia", "*", "lib", "libcudart.so.13")))
    names += ["/usr/local/cuda/lib64/libcudart.so.13"]
    return names


class AllocProp(ctypes.Structure):  # CUmemAllocationProp
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int),
                ("loc_type", ctypes.c_int), ("loc_id", ctypes.c_int),
                ("win32HandleMetaData", c_ptr), ("compressionType", ctypes.c_ubyte),
                ("gpuDirectRDMACapable", ctypes.c_ubyte), ("usage", ctypes.c_ushort),
                ("reserved", ctypes.c_ubyte * 4)]


class AccessDesc(ctypes.Structure):  # CUmemAccessDesc
    _fields_ = [("loc_type", ctypes.c_int), ("loc_id", ctypes.c_int), ("flags", ctypes.c_int)]


class PointerAttributes(ctypes.Structure):  # cudaPointerAttributes
    _fields_ = [("type", ctypes.c_int), ("device", ctypes.c_int),
                ("devicePointer", c_ptr), ("hostPointer", c_ptr), ("reserved", ctypes.c_long * 8)]


class Probe:
    def __init__(self, rt, drv):
        self.rt = rt
        self.drv = drv
        self.out = {}
        self.times = {}

    def fn(self, lib, name):
        f = getattr(lib, name, None)
        if f is None:
            raise LookupError(f"{name} is not exported")
        f.restype = ctypes.c_int
        return f

    def r(self, name, *args):
        return self.fn(self.rt, name)(*args)

    def d(self, name, *args):
        return self.fn(self.drv, name)(*args)

    def run(self, name, body):
        try:
            self.out[name] = body()
        except Exception as e:  # a missing entry or a broken probe: recorded, the rest go on
            self.out[name] = {"error": f"{type(e).__name__}: {e}"}

    def malloc(self, size):
        p = c_ptr()
        code = self.r("cudaMalloc", ctypes.byref(p), c_size(size))
        return code, p.value or 0

    def timed(self, name, fn, n):
        samples = []
        for _ in range(n):
            t = time.perf_counter_ns()
            fn()
            samples.append(time.perf_counter_ns() - t)
        self.times[name] = statistics.median(samples) / 1000.0  # microseconds


PROBES = ("init", "malloc_edges", "malloc_layout", "malloc_sequence", "mem_info", "malloc_async", "pointer_attributes",
          "streams_events", "vmm", "timings", "call_costs", "vmm_bad_handles", "stream_capture")


def probes(p, save, only):
    r, d = p.r, p.d

    def init():
        count = ctypes.c_int()
        out = {"cudaGetDeviceCount": r("cudaGetDeviceCount", ctypes.byref(count)), "count": count.value}
        out["cudaSetDevice(0)"] = r("cudaSetDevice", 0)
        out["cudaFree(NULL) first call"] = r("cudaFree", c_ptr(0))
        out["cudaSetDevice(99)"] = r("cudaSetDevice", 99)
        out["cudaGetLastError after bad set"] = r("cudaGetLastError")
        out["cuInit"] = d("cuInit", 0)
        v = ctypes.c_int()
        out["cudaDeviceGetAttribute(bad)"] = r("cudaDeviceGetAttribute", ctypes.byref(v), 99999, 0)
        r("cudaGetLastError")
        return out

    def malloc_edges():
        out = {}
        code, ptr = p.malloc(0)
        out["cudaMalloc(0)"] = code
        out["cudaMalloc(0) pointer is null"] = ptr == 0
        code, ptr = p.malloc(1 << 50)
        out["cudaMalloc(1 PiB)"] = code
        out["cudaGetLastError after"] = r("cudaGetLastError")
        out["cudaGetLastError again"] = r("cudaGetLastError")
        out["cudaFree(NULL)"] = r("cudaFree", c_ptr(0))
        out["cudaFree(0x1000)"] = r("cudaFree", c_ptr(0x1000))
        r("cudaGetLastError")
        code, ptr = p.malloc(4 * MiB)
        out["cudaMalloc(4 MiB)"] = code
        out["cudaFree(interior)"] = r("cudaFree", c_ptr(ptr + 256))
        r("cudaGetLastError")
        out["cudaFree(ptr)"] = r("cudaFree", c_ptr(ptr))
        out["cudaFree(ptr) again"] = r("cudaFree", c_ptr(ptr))
        r("cudaGetLastError")
        out["cudaMalloc(NULL out)"] = r("cudaMalloc", c_ptr(0), c_size(64))
        r("cudaGetLastError")
        return out

    def malloc_layout():
        out = {}
        for size in (1, 512, 4096, MiB, 2 * MiB, 3 * MiB, 20 * MiB + 1, 1 * GiB):
            ptrs = []
            for _ in range(4):
                code, ptr = p.malloc(size)
                if code:
                    out[str(size)] = {"code": code}
                    break
                ptrs.append(ptr)
            if ptrs:
                out[str(size)] = {
                    "align_2MiB": all(x % (2 * MiB) == 0 for x in ptrs),
                    "align_512": all(x % 512 == 0 for x in ptrs),
                    "low_zero_bits": min((x & -x).bit_length() - 1 for x in ptrs),
                    "steps": [b - a for a, b in zip(ptrs, ptrs[1:])],
                }
            for x in ptrs:
                r("cudaFree", c_ptr(x))
        return out

    def malloc_sequence():
        # Where cudaMalloc places a mixed sequence, and what it reuses after frees: raw addresses.
        first = [512, MiB, 2 * MiB, 3 * MiB, 20 * MiB, 512, 64 * MiB, 1024, 2 * MiB + 1, 200 * MiB, 4096, GiB,
                 10 * MiB, 100, 8 * MiB, 96 * KiB, 1536 * KiB]
        second = [MiB, 3 * MiB, 512, 1024, 200 * MiB, 300 * MiB, 16 * MiB, 2 * MiB, 4096, 6 * MiB]
        out = {"first": [], "second": []}
        ptrs = []
        for size in first:
            code, ptr = p.malloc(size)
            out["first"].append([size, code, ptr])
            ptrs.append(ptr)
        freed = (1, 3, 5, 7, 9, 12)
        for i in freed:
            r("cudaFree", c_ptr(ptrs[i]))
        out["freed"] = list(freed)
        for size in second:
            code, ptr = p.malloc(size)
            out["second"].append([size, code, ptr])
            ptrs.append(ptr)
        for i, ptr in enumerate(ptrs):
            if i not in freed:
                r("cudaFree", c_ptr(ptr))
        return out

    def mem_info():
        free, total = c_size(), c_size()
        out = {"cudaMemGetInfo": r("cudaMemGetInfo", ctypes.byref(free), ctypes.byref(total))}
        out["total"] = total.value
        f0 = free.value
        code, ptr = p.malloc(GiB)
        r("cudaMemGetInfo", ctypes.byref(free), ctypes.byref(total))
        out["free drop for 1 GiB cudaMalloc"] = f0 - free.value
        code, ptr2 = p.malloc(MiB)
        f1 = free.value
        r("cudaMemGetInfo", ctypes.byref(free), ctypes.byref(total))
        out["free drop for 1 MiB cudaMalloc"] = f1 - free.value
        r("cudaFree", c_ptr(ptr2))
        r("cudaFree", c_ptr(ptr))
        r("cudaMemGetInfo", ctypes.byref(free), ctypes.byref(total))
        out["free back after cudaFree"] = free.value - f0
        f, t = c_size(), c_size()
        out["cuMemGetInfo_v2"] = d("cuMemGetInfo_v2", ctypes.byref(f), ctypes.byref(t))
        out["cuMemGetInfo total equals"] = t.value == total.value
        return out

    def malloc_async():
        out = {}
        ptr = c_ptr()
        out["cudaMallocAsync(0)"] = r("cudaMallocAsync", ctypes.byref(ptr), c_size(0), c_ptr(0))
        out["cudaMallocAsync(0) pointer is null"] = not ptr.value
        sizes, ptrs = (1, 4096, MiB, 3 * MiB), []
        for size in sizes:
            q = c_ptr()
            out[f"cudaMallocAsync({size})"] = r("cudaMallocAsync", ctypes.byref(q), c_size(size), c_ptr(0))
            ptrs.append(q.value or 0)
        out["low_zero_bits"] = min((x & -x).bit_length() - 1 for x in ptrs if x)
        for x in ptrs:
            r("cudaFreeAsync", c_ptr(x), c_ptr(0))
        out["cudaStreamSynchronize"] = r("cudaStreamSynchronize", c_ptr(0))
        out["cudaFreeAsync(0x1000)"] = r("cudaFreeAsync", c_ptr(0x1000), c_ptr(0))
        out["cudaGetLastError after"] = r("cudaGetLastError")
        out["cudaMallocAsync(1 PiB)"] = r("cudaMallocAsync", ctypes.byref(ptr), c_size(1 << 50), c_ptr(0))
        r("cudaGetLastError")
        r("cudaDeviceSynchronize")
        return out

    def pointer_attributes():
        out = {}
        code, dev = p.malloc(MiB)
        host = ctypes.create_string_buffer(64)
        pinned = c_ptr()
        out["cudaMallocHost"] = r("cudaMallocHost", ctypes.byref(pinned), c_size(4096))
        for name, ptr in (("device", dev), ("device interior", dev + 4096), ("host", ctypes.addressof(host)),
                          ("pinned", pinned.value or 0), ("null", 0), ("0x1000", 0x1000)):
            a = PointerAttributes()
            code = r("cudaPointerGetAttributes", ctypes.byref(a), c_ptr(ptr))
            out[name] = {"code": code, "type": a.type if code == 0 else None}
            r("cudaGetLastError")
        base, size = c_u64(), c_size()
        out["cuMemGetAddressRange_v2(interior)"] = d("cuMemGetAddressRange_v2", ctypes.byref(base),
                                                     ctypes.byref(size), c_u64(dev + 4096))
        out["address range is the allocation"] = base.value == dev and size.value == MiB
        out["cuMemGetAddressRange_v2(0x1000)"] = d("cuMemGetAddressRange_v2", ctypes.byref(base),
                                                   ctypes.byref(size), c_u64(0x1000))
        out["cudaFreeHost(pinned)"] = r("cudaFreeHost", pinned)
        out["cudaFreeHost(0x1000)"] = r("cudaFreeHost", c_ptr(0x1000))
        r("cudaGetLastError")
        r("cudaFree", c_ptr(dev))
        return out

    def streams_events():
        out = {}
        s, e1, e2 = c_ptr(), c_ptr(), c_ptr()
        out["cudaStreamCreate"] = r("cudaStreamCreate", ctypes.byref(s))
        out["cudaStreamQuery(new)"] = r("cudaStreamQuery", s)
        out["cudaEventCreate"] = r("cudaEventCreate", ctypes.byref(e1))
        r("cudaEventCreate", ctypes.byref(e2))
        out["cudaEventQuery(never recorded)"] = r("cudaEventQuery", e1)
        ms = ctypes.c_float()
        out["cudaEventElapsedTime(never recorded)"] = r("cudaEventElapsedTime", ctypes.byref(ms), e1, e2)
        r("cudaGetLastError")
        out["cudaEventRecord"] = r("cudaEventRecord", e1, s)
        out["cudaEventSynchronize"] = r("cudaEventSynchronize", e1)
        out["cudaEventQuery(recorded)"] = r("cudaEventQuery", e1)
        out["cudaStreamWaitEvent"] = r("cudaStreamWaitEvent", c_ptr(0), e1, 0)
        out["cudaEventDestroy"] = r("cudaEventDestroy", e1)
        r("cudaEventDestroy", e2)
        out["cudaStreamDestroy"] = r("cudaStreamDestroy", s)
        out["cudaMemcpy(0 bytes)"] = r("cudaMemcpy", c_ptr(0), c_ptr(0), c_size(0), 4)
        r("cudaGetLastError")
        return out

    def vmm():
        out = {}
        prop = AllocProp(type=1, requestedHandleTypes=0, loc_type=1, loc_id=0)
        g_min, g_rec = c_size(), c_size()
        out["cuMemGetAllocationGranularity(min)"] = d("cuMemGetAllocationGranularity", ctypes.byref(g_min),
                                                      ctypes.byref(prop), 0)
        out["cuMemGetAllocationGranularity(recommended)"] = d("cuMemGetAllocationGranularity",
                                                              ctypes.byref(g_rec), ctypes.byref(prop), 1)
        g = g_min.value
        out["granularity"] = [g, g_rec.value]
        fd_prop = AllocProp(type=1, requestedHandleTypes=1, loc_type=1, loc_id=0)
        g_fd = c_size()
        out["granularity(posix fd)"] = [d("cuMemGetAllocationGranularity", ctypes.byref(g_fd),
                                          ctypes.byref(fd_prop), 0), g_fd.value]
        bad_prop = AllocProp(type=1, requestedHandleTypes=0, loc_type=1, loc_id=99)
        out["granularity(device 99)"] = d("cuMemGetAllocationGranularity", ctypes.byref(g_fd),
                                          ctypes.byref(bad_prop), 0)
        va = c_u64()
        out["cuMemAddressReserve(g+1)"] = d("cuMemAddressReserve", ctypes.byref(va), c_size(g + 1), c_size(0),
                                            c_u64(0), c_u64(0))
        if out["cuMemAddressReserve(g+1)"] == 0:
            out["reserve(g+1) aligned"] = va.value % g == 0
            d("cuMemAddressFree", c_u64(va.value), c_size(g + 1))
        out["cuMemAddressReserve(0)"] = d("cuMemAddressReserve", ctypes.byref(va), c_size(0), c_size(0),
                                          c_u64(0), c_u64(0))
        out["cuMemAddressReserve(4g, align 3)"] = d("cuMemAddressReserve", ctypes.byref(va), c_size(4 * g),
                                                    c_size(3), c_u64(0), c_u64(0))
        out["cuMemAddressReserve(4g, align 16g)"] = d("cuMemAddressReserve", ctypes.byref(va), c_size(4 * g),
                                                      c_size(16 * g), c_u64(0), c_u64(0))
        out["reserve(align 16g) aligned"] = va.value % (16 * g) == 0
        d("cuMemAddressFree", c_u64(va.value), c_size(4 * g))
        out["cuMemAddressReserve(4g)"] = d("cuMemAddressReserve", ctypes.byref(va), c_size(4 * g), c_size(0),
                                           c_u64(0), c_u64(0))
        base = va.value
        out["reserve aligned to g"] = base % g == 0
        h, h2 = c_u64(), c_u64()
        out["cuMemCreate(g/2)"] = d("cuMemCreate", ctypes.byref(h2), c_size(g // 2), ctypes.byref(prop), c_u64(0))
        out["cuMemCreate(1<<46)"] = d("cuMemCreate", ctypes.byref(h2), c_size(1 << 46), ctypes.byref(prop),
                                      c_u64(0))
        out["cuMemCreate(g, device 99)"] = d("cuMemCreate", ctypes.byref(h2), c_size(g), ctypes.byref(bad_prop),
                                             c_u64(0))
        out["cuMemCreate(g)"] = d("cuMemCreate", ctypes.byref(h), c_size(g), ctypes.byref(prop), c_u64(0))
        out["cuMemMap(base+g/2)"] = d("cuMemMap", c_u64(base + g // 2), c_size(g), c_size(0), h, c_u64(0))
        out["cuMemMap(base, 2g, handle of g)"] = d("cuMemMap", c_u64(base), c_size(2 * g), c_size(0), h, c_u64(0))
        out["cuMemMap(base, g, offset g/2)"] = d("cuMemMap", c_u64(base), c_size(g), c_size(g // 2), h, c_u64(0))
        out["cuMemMap(outside any reservation)"] = d("cuMemMap", c_u64(0x1000000), c_size(g), c_size(0), h,
                                                     c_u64(0))
        out["cuMemMap(base)"] = d("cuMemMap", c_u64(base), c_size(g), c_size(0), h, c_u64(0))
        out["cuMemMap(base) again"] = d("cuMemMap", c_u64(base), c_size(g), c_size(0), h, c_u64(0))
        out["cuMemMap(base+g, same handle twice)"] = d("cuMemMap", c_u64(base + g), c_size(g), c_size(0), h,
                                                       c_u64(0))
        acc = AccessDesc(loc_type=1, loc_id=0, flags=3)
        out["cuMemSetAccess(base)"] = d("cuMemSetAccess", c_u64(base), c_size(g), ctypes.byref(acc), c_size(1))
        out["cuMemSetAccess(unmapped)"] = d("cuMemSetAccess", c_u64(base + 2 * g), c_size(g), ctypes.byref(acc),
                                            c_size(1))
        out["cuMemsetD8_v2"] = d("cuMemsetD8_v2", c_u64(base), ctypes.c_ubyte(0x5A), c_size(g))
        out["cuMemRetainAllocationHandle"] = d("cuMemRetainAllocationHandle", ctypes.byref(h2), c_ptr(base))
        if out["cuMemRetainAllocationHandle"] == 0:
            out["retained handle equals"] = h2.value == h.value
            d("cuMemRelease", h2)
        out["cuMemRelease(mapped)"] = d("cuMemRelease", h)
        buf = ctypes.create_string_buffer(16)
        out["cuMemcpyDtoH after release"] = d("cuMemcpyDtoH_v2", buf, c_u64(base + 100), c_size(16))
        out["contents kept after release"] = buf.raw == b"\x5a" * 16
        out["cuMemAddressFree(mapped)"] = d("cuMemAddressFree", c_u64(base), c_size(4 * g))
        out["cuMemUnmap(unmapped)"] = d("cuMemUnmap", c_u64(base + 2 * g), c_size(g))
        out["cuMemUnmap(half)"] = d("cuMemUnmap", c_u64(base), c_size(g // 2))
        out["cuMemUnmap(base)"] = d("cuMemUnmap", c_u64(base), c_size(g))
        out["cuMemUnmap(base+g)"] = d("cuMemUnmap", c_u64(base + g), c_size(g))
        out["cuMemRelease(released)"] = d("cuMemRelease", h)
        out["cuMemAddressFree(base)"] = d("cuMemAddressFree", c_u64(base), c_size(4 * g))
        out["cuMemAddressFree(base) again"] = d("cuMemAddressFree", c_u64(base), c_size(4 * g))
        out["cuMemAddressFree(0x1000)"] = d("cuMemAddressFree", c_u64(0x1000), c_size(g))
        # Two handles into one reservation, unmapped in one call across both.
        d("cuMemAddressReserve", ctypes.byref(va), c_size(2 * g), c_size(0), c_u64(0), c_u64(0))
        base = va.value
        d("cuMemCreate", ctypes.byref(h), c_size(g), ctypes.byref(prop), c_u64(0))
        d("cuMemCreate", ctypes.byref(h2), c_size(g), ctypes.byref(prop), c_u64(0))
        d("cuMemMap", c_u64(base), c_size(g), c_size(0), h, c_u64(0))
        d("cuMemMap", c_u64(base + g), c_size(g), c_size(0), h2, c_u64(0))
        out["cuMemSetAccess(across two handles)"] = d("cuMemSetAccess", c_u64(base), c_size(2 * g),
                                                      ctypes.byref(acc), c_size(1))
        out["cuMemUnmap(across two handles)"] = d("cuMemUnmap", c_u64(base), c_size(2 * g))
        d("cuMemRelease", h)
        d("cuMemRelease", h2)
        d("cuMemAddressFree", c_u64(base), c_size(2 * g))
        # Free memory: does a mapped handle count at create or at map?
        free, total = c_size(), c_size()
        d("cuMemGetInfo_v2", ctypes.byref(free), ctypes.byref(total))
        f0 = free.value
        d("cuMemCreate", ctypes.byref(h), c_size(64 * g), ctypes.byref(prop), c_u64(0))
        d("cuMemGetInfo_v2", ctypes.byref(free), ctypes.byref(total))
        out["free drop at cuMemCreate(64g)"] = f0 - free.value
        d("cuMemRelease", h)
        d("cuMemGetInfo_v2", ctypes.byref(free), ctypes.byref(total))
        out["free back after cuMemRelease"] = free.value - f0
        return out

    def call_costs():
        # Each call timed alone (median of n, microseconds), per size: the latency model's inputs.
        prop = AllocProp(type=1, requestedHandleTypes=0, loc_type=1, loc_id=0)
        acc = AccessDesc(loc_type=1, loc_id=0, flags=3)
        out = {}

        def med(samples):
            return round(statistics.median(samples) / 1000.0, 2)

        def clock(fn):
            t = time.perf_counter_ns()
            fn()
            return time.perf_counter_ns() - t

        n = 15
        for size, label in ((4 * KiB, "4KiB"), (2 * MiB, "2MiB"), (64 * MiB, "64MiB"), (GiB, "1GiB"),
                            (8 * GiB, "8GiB")):
            ta, tf = [], []
            for _ in range(n if size < GiB else 7):
                ptr = c_ptr()
                ta.append(clock(lambda: r("cudaMalloc", ctypes.byref(ptr), c_size(size))))
                tf.append(clock(lambda: r("cudaFree", ptr)))
            out[f"cudaMalloc {label}"], out[f"cudaFree {label}"] = med(ta), med(tf)
            if size < 2 * MiB:
                continue
            cols = {k: [] for k in ("reserve", "create", "map", "set_access", "unmap", "release", "address_free")}
            for _ in range(n if size < GiB else 7):
                va, h = c_u64(), c_u64()
                cols["reserve"].append(clock(lambda: d("cuMemAddressReserve", ctypes.byref(va), c_size(size),
                                                       c_size(0), c_u64(0), c_u64(0))))
                cols["create"].append(clock(lambda: d("cuMemCreate", ctypes.byref(h), c_size(size),
                                                      ctypes.byref(prop), c_u64(0))))
                cols["map"].append(clock(lambda: d("cuMemMap", c_u64(va.value), c_size(size), c_size(0), h,
                                                   c_u64(0))))
                cols["set_access"].append(clock(lambda: d("cuMemSetAccess", c_u64(va.value), c_size(size),
                                                          ctypes.byref(acc), c_size(1))))
                cols["unmap"].append(clock(lambda: d("cuMemUnmap", c_u64(va.value), c_size(size))))
                cols["release"].append(clock(lambda: d("cuMemRelease", h)))
                cols["address_free"].append(clock(lambda: d("cuMemAddressFree", c_u64(va.value), c_size(size))))
            for k, v in cols.items():
                out[f"{k} {label}"] = med(v)
        # 2 MiB handles mapped side by side into one 64 MiB reservation (the paging policy's pattern).
        va = c_u64()
        pages = 32
        d("cuMemAddressReserve", ctypes.byref(va), c_size(pages * 2 * MiB), c_size(0), c_u64(0), c_u64(0))
        hs = [c_u64() for _ in range(pages)]
        tc, tm, ts, tu, tr = [], [], [], [], []
        for i, h in enumerate(hs):
            tc.append(clock(lambda: d("cuMemCreate", ctypes.byref(h), c_size(2 * MiB), ctypes.byref(prop), c_u64(0))))
            tm.append(clock(lambda: d("cuMemMap", c_u64(va.value + i * 2 * MiB), c_size(2 * MiB), c_size(0), h,
                                      c_u64(0))))
            ts.append(clock(lambda: d("cuMemSetAccess", c_u64(va.value + i * 2 * MiB), c_size(2 * MiB),
                                      ctypes.byref(acc), c_size(1))))
        out["set_access 64MiB over 32 handles"] = med([clock(lambda: d("cuMemSetAccess", c_u64(va.value),
                                                                        c_size(pages * 2 * MiB), ctypes.byref(acc),
                                                                        c_size(1))) for _ in range(5)])
        for i, h in enumerate(hs):
            tu.append(clock(lambda: d("cuMemUnmap", c_u64(va.value + i * 2 * MiB), c_size(2 * MiB))))
            tr.append(clock(lambda: d("cuMemRelease", h)))
        d("cuMemAddressFree", c_u64(va.value), c_size(pages * 2 * MiB))
        out.update({"page create 2MiB": med(tc), "page map 2MiB": med(tm), "page set_access 2MiB": med(ts),
                    "page unmap 2MiB": med(tu), "page release 2MiB": med(tr)})
        free, total = c_size(), c_size()
        out["cudaMemGetInfo"] = med([clock(lambda: r("cudaMemGetInfo", ctypes.byref(free), ctypes.byref(total)))
                                     for _ in range(n)])
        ev, s = c_ptr(), c_ptr()
        r("cudaStreamCreate", ctypes.byref(s))
        cols = {k: [] for k in ("event_create", "event_record", "event_query", "event_synchronize",
                                "event_destroy", "stream_synchronize", "device_synchronize")}
        for _ in range(n):
            cols["event_create"].append(clock(lambda: r("cudaEventCreateWithFlags", ctypes.byref(ev), 2)))
            cols["event_record"].append(clock(lambda: r("cudaEventRecord", ev, s)))
            cols["event_query"].append(clock(lambda: r("cudaEventQuery", ev)))
            cols["event_synchronize"].append(clock(lambda: r("cudaEventSynchronize", ev)))
            cols["event_destroy"].append(clock(lambda: r("cudaEventDestroy", ev)))
            cols["stream_synchronize"].append(clock(lambda: r("cudaStreamSynchronize", s)))
            cols["device_synchronize"].append(clock(lambda: r("cudaDeviceSynchronize")))
        r("cudaStreamDestroy", s)
        for k, v in cols.items():
            out[k] = med(v)
        pinned = c_ptr()
        out["cudaMallocHost 1GiB"] = med([clock(lambda: r("cudaMallocHost", ctypes.byref(pinned), c_size(GiB)))])
        out["cudaFreeHost 1GiB"] = med([clock(lambda: r("cudaFreeHost", pinned))])
        return {"median_us": out}

    def vmm_bad_handles():
        # A handle is the driver's own pointer: a made-up one may crash a real driver, so this runs last,
        # alone, and a crash is itself the answer.
        prop = AllocProp(type=1, requestedHandleTypes=0, loc_type=1, loc_id=0)
        g = c_size()
        d("cuMemGetAllocationGranularity", ctypes.byref(g), ctypes.byref(prop), 0)
        va = c_u64()
        d("cuMemAddressReserve", ctypes.byref(va), c_size(g.value), c_size(0), c_u64(0), c_u64(0))
        out = {"cuMemRelease(0)": d("cuMemRelease", c_u64(0))}
        out["cuMemMap(handle 0)"] = d("cuMemMap", c_u64(va.value), g, c_size(0), c_u64(0), c_u64(0))
        out["cuMemRelease(12345)"] = d("cuMemRelease", c_u64(12345))
        out["cuMemMap(handle 12345)"] = d("cuMemMap", c_u64(va.value), g, c_size(0), c_u64(12345), c_u64(0))
        d("cuMemAddressFree", c_u64(va.value), g)
        return out

    def timings():
        prop = AllocProp(type=1, requestedHandleTypes=0, loc_type=1, loc_id=0)
        acc = AccessDesc(loc_type=1, loc_id=0, flags=3)
        for size, label in ((2 * MiB, "2MiB"), (64 * MiB, "64MiB"), (GiB, "1GiB")):
            def pair(size=size):
                _, ptr = p.malloc(size)
                r("cudaFree", c_ptr(ptr))
            p.timed(f"cudaMalloc+cudaFree {label}", pair, 21)

            def vm(size=size):
                va, h = c_u64(), c_u64()
                d("cuMemAddressReserve", ctypes.byref(va), c_size(size), c_size(0), c_u64(0), c_u64(0))
                d("cuMemCreate", ctypes.byref(h), c_size(size), ctypes.byref(prop), c_u64(0))
                d("cuMemMap", c_u64(va.value), c_size(size), c_size(0), h, c_u64(0))
                d("cuMemSetAccess", c_u64(va.value), c_size(size), ctypes.byref(acc), c_size(1))
                d("cuMemUnmap", c_u64(va.value), c_size(size))
                d("cuMemRelease", h)
                d("cuMemAddressFree", c_u64(va.value), c_size(size))
            p.timed(f"reserve+create+map+access+unmap+release+free {label}", vm, 21)
        return {"median_us": p.times}

    def stream_capture():
        # Stream capture and graphs: what a capture records, what CUDA refuses
        # during one (and the invalidated capture after), and graph launches.
        out = {}
        cudaStreamNonBlocking, GLOBAL, THREAD_LOCAL, RELAXED = 1, 0, 1, 2
        D2H, H2D = 2, 1

        def stream(flags=cudaStreamNonBlocking):
            s = c_ptr()
            r("cudaStreamCreateWithFlags", ctypes.byref(s), flags)
            return s

        def event():
            e = c_ptr()
            r("cudaEventCreateWithFlags", ctypes.byref(e), 2)  # cudaEventDisableTiming
            return e

        def status(s):
            st = ctypes.c_int(-1)
            code = r("cudaStreamIsCapturing", s, ctypes.byref(st))
            return [code, st.value]

        def info(s):
            st, ident, n = ctypes.c_int(-1), ctypes.c_ulonglong(), c_size()
            deps = c_ptr()
            code = r("cudaStreamGetCaptureInfo", s, ctypes.byref(st), ctypes.byref(ident), c_ptr(0),
                     ctypes.byref(deps), c_ptr(0), ctypes.byref(n))
            return code, st.value, ident.value, n.value

        def end(s):
            g = c_ptr()
            code = r("cudaStreamEndCapture", s, ctypes.byref(g))
            return code, g

        def close(s):
            # Ends a capture that may fail: its code, the error cleared, any graph destroyed.
            code, g = end(s)
            r("cudaGetLastError")
            if g.value:
                r("cudaGraphDestroy", g)
            return code

        def nodes(g):
            n = c_size()
            r("cudaGraphGetNodes", g, c_ptr(0), ctypes.byref(n))
            return n.value

        def mode(m):
            v = ctypes.c_int(m)
            r("cudaThreadExchangeStreamCaptureMode", ctypes.byref(v))
            return v.value

        def read(ptr, n=16):
            buf = (ctypes.c_ubyte * n)()
            r("cudaMemcpy", buf, c_ptr(ptr), c_size(n), D2H)
            return bytes(buf).hex()

        code, buf = p.malloc(MiB)
        out["cudaMalloc before"] = code
        r("cudaMemset", c_ptr(buf), 0, c_size(MiB))
        s1, s2, s3 = stream(), stream(), stream()
        # The legacy stream cannot capture; a bad mode is refused.
        out["begin(legacy stream)"] = r("cudaStreamBeginCapture", c_ptr(0), GLOBAL)
        r("cudaGetLastError")
        out["begin(mode 7)"] = r("cudaStreamBeginCapture", s1, 7)
        r("cudaGetLastError")
        out["not capturing: status"] = status(s1)
        # A captured memset runs at launch, not at capture.
        out["begin global"] = r("cudaStreamBeginCapture", s1, GLOBAL)
        code, st, id1, n = info(s1)
        out["info while capturing"] = [code, st, id1 > 0, n]
        out["begin again"] = r("cudaStreamBeginCapture", s1, GLOBAL)
        r("cudaGetLastError")
        out["memset in capture"] = r("cudaMemsetAsync", c_ptr(buf), 0x5A, c_size(16), s1)
        code, st, _, n = info(s1)
        out["info after a node"] = [code, st, n]
        code, g = end(s1)
        out["end"] = [code, g.value is not None, nodes(g)]
        out["memory after capture"] = read(buf)
        ex = c_ptr()
        out["instantiate(bad flags)"] = r("cudaGraphInstantiateWithFlags", ctypes.byref(ex), g, c_u64(1 << 20))
        r("cudaGetLastError")
        out["instantiate(AutoFreeOnLaunch|UseNodePriority)"] = r("cudaGraphInstantiateWithFlags", ctypes.byref(ex),
                                                                 g, c_u64(1 | 8))
        out["launch"] = r("cudaGraphLaunch", ex, s1)
        out["synchronize"] = r("cudaStreamSynchronize", s1)
        out["memory after launch"] = read(buf)
        out["upload"] = r("cudaGraphUpload", ex, s1)
        out["end when not capturing"] = end(s1)[0]
        r("cudaGetLastError")
        # Update: the same topology with another value.
        r("cudaMemset", c_ptr(buf), 0, c_size(16))
        r("cudaStreamBeginCapture", s1, GLOBAL)
        code, _, id2, _ = info(s1)
        out["capture ids grow"] = id2 > id1
        r("cudaMemsetAsync", c_ptr(buf), 0x33, c_size(16), s1)
        _, g2 = end(s1)
        res = (ctypes.c_int * 6)()
        out["exec update(same shape)"] = r("cudaGraphExecUpdate", ex, g2, ctypes.byref(res))
        r("cudaGraphLaunch", ex, s1)
        r("cudaStreamSynchronize", s1)
        out["memory after updated launch"] = read(buf)
        r("cudaStreamBeginCapture", s1, GLOBAL)
        r("cudaMemsetAsync", c_ptr(buf), 0x11, c_size(16), s1)
        r("cudaMemsetAsync", c_ptr(buf), 0x22, c_size(16), s1)
        _, g3 = end(s1)
        out["exec update(other shape)"] = [r("cudaGraphExecUpdate", ex, g3, ctypes.byref(res)), res[0]]
        r("cudaGetLastError")
        # A graph launched in a capture is a child graph node.
        r("cudaStreamBeginCapture", s2, GLOBAL)
        out["launch in capture"] = r("cudaGraphLaunch", ex, s2)
        code, g4 = end(s2)
        out["end with a child graph"] = [code, nodes(g4)]
        for x in (g, g2, g3, g4):
            r("cudaGraphDestroy", x)
        out["exec destroy"] = r("cudaGraphExecDestroy", ex)

        # Potentially unsafe calls in a global capture, and the invalidated capture after.
        r("cudaStreamBeginCapture", s1, GLOBAL)
        code, extra = p.malloc(4096)
        out["global: cudaMalloc"] = code
        r("cudaGetLastError")
        out["global: status after"] = status(s1)
        out["global: work after"] = r("cudaMemsetAsync", c_ptr(buf), 1, c_size(16), s1)
        r("cudaGetLastError")
        code, g = end(s1)
        out["global: end after"] = [code, g.value is None]
        r("cudaGetLastError")
        out["status after the invalidated end"] = status(s1)
        if extra:
            r("cudaFree", c_ptr(extra))
        # The same call with the thread in relaxed mode, as PyTorch's allocator makes it.
        r("cudaStreamBeginCapture", s1, GLOBAL)
        was = mode(RELAXED)
        code, extra = p.malloc(4096)
        out["global, thread relaxed: cudaMalloc"] = code
        out["mode swapped back"] = [mode(was), was]
        code, g = end(s1)
        out["global, thread relaxed: end"] = code
        if g.value:
            r("cudaGraphDestroy", g)
        r("cudaFree", c_ptr(extra))
        r("cudaStreamBeginCapture", s1, RELAXED)
        code, extra = p.malloc(4096)
        out["relaxed: cudaMalloc"] = code
        out["relaxed: cudaFree"] = r("cudaFree", c_ptr(extra))
        code, g = end(s1)
        out["relaxed: end"] = code
        if g.value:
            r("cudaGraphDestroy", g)
        e = event()
        for label, call in (("cudaStreamSynchronize(capturing)", lambda: r("cudaStreamSynchronize", s1)),
                            ("cudaStreamQuery(capturing)", lambda: r("cudaStreamQuery", s1)),
                            ("cudaDeviceSynchronize", lambda: r("cudaDeviceSynchronize")),
                            ("cudaEventQuery(recorded in capture)",
                             lambda: (r("cudaEventRecord", e, s1), r("cudaEventQuery", e))[1]),
                            ("cudaStreamQuery(other stream)", lambda: r("cudaStreamQuery", s3))):
            r("cudaStreamBeginCapture", s1, GLOBAL)
            first = call()
            r("cudaGetLastError")
            out[f"global: {label}"] = [first, close(s1)]
        r("cudaEventRecord", e, s3)  # recorded outside any capture again
        # Fork and join through events.
        e1, e2 = event(), event()
        r("cudaStreamBeginCapture", s1, GLOBAL)
        r("cudaMemsetAsync", c_ptr(buf), 1, c_size(16), s1)
        r("cudaEventRecord", e1, s1)
        out["fork: wait"] = r("cudaStreamWaitEvent", s2, e1, 0)
        code, st, ident, n = info(s2)
        _, _, origin_id, _ = info(s1)
        out["fork: joined stream info"] = [code, st, ident == origin_id, n]
        r("cudaMemsetAsync", c_ptr(buf + 4096), 2, c_size(16), s2)
        code, g = end(s1)
        out["fork: end unjoined"] = [code, g.value is None]
        r("cudaGetLastError")
        out["fork: joined stream after"] = status(s2)
        r("cudaStreamBeginCapture", s1, GLOBAL)
        r("cudaEventRecord", e1, s1)
        r("cudaStreamWaitEvent", s2, e1, 0)
        out["fork: end on the joined stream"] = end(s2)[0]
        r("cudaGetLastError")
        out["fork: end on the origin after"] = end(s1)[0]
        r("cudaGetLastError")
        r("cudaStreamBeginCapture", s1, GLOBAL)
        r("cudaMemsetAsync", c_ptr(buf), 1, c_size(16), s1)
        r("cudaEventRecord", e1, s1)
        r("cudaStreamWaitEvent", s2, e1, 0)
        r("cudaMemsetAsync", c_ptr(buf + 4096), 2, c_size(16), s2)
        r("cudaEventRecord", e2, s2)
        r("cudaStreamWaitEvent", s1, e2, 0)
        code, g = end(s1)
        out["fork: end joined"] = [code, nodes(g)]
        dep_count = c_size()
        all_nodes = (c_ptr * 2)()
        n = c_size(2)
        r("cudaGraphGetNodes", g, all_nodes, ctypes.byref(n))
        r("cudaGraphNodeGetDependencies", c_ptr(all_nodes[1]), c_ptr(0), c_ptr(0), ctypes.byref(dep_count))
        out["fork: second node's dependencies"] = dep_count.value
        r("cudaGraphDestroy", g)
        # Waiting on an event recorded outside the capture.
        r("cudaEventRecord", e1, s3)
        r("cudaStreamBeginCapture", s1, GLOBAL)
        out["wait on an uncaptured event"] = r("cudaStreamWaitEvent", s1, e1, 0)
        r("cudaGetLastError")
        out["wait on an uncaptured event: end"] = close(s1)
        # Two captures merged by an event.
        r("cudaStreamBeginCapture", s1, GLOBAL)
        r("cudaStreamBeginCapture", s2, GLOBAL)
        r("cudaEventRecord", e1, s1)
        out["merge: wait"] = r("cudaStreamWaitEvent", s2, e1, 0)
        r("cudaGetLastError")
        for s in (s1, s2):
            close(s)
        # A blocking stream's capture and the legacy stream.
        sb = stream(0)
        r("cudaStreamBeginCapture", sb, GLOBAL)
        out["legacy stream work while a blocking stream captures"] = r("cudaMemsetAsync", c_ptr(buf), 3,
                                                                        c_size(16), c_ptr(0))
        r("cudaGetLastError")
        out["blocking capture end after"] = close(sb)
        r("cudaStreamDestroy", sb)

        # Other threads: global capture forbids their unsafe calls, thread-local does not; a
        # global capture ends only on the thread that began it.
        import threading

        def on_thread(fn):
            box = {}
            t = threading.Thread(target=lambda: box.update(v=fn()))
            t.start()
            t.join()
            return box["v"]

        def malloc_free():
            code, q = p.malloc(4096)
            if q:
                r("cudaFree", c_ptr(q))
            r("cudaGetLastError")
            return code
        for label, m in (("global", GLOBAL), ("thread_local", THREAD_LOCAL), ("relaxed", RELAXED)):
            r("cudaStreamBeginCapture", s1, m)
            other = on_thread(malloc_free)
            out[f"{label}: cudaMalloc on another thread, end"] = [other, close(s1)]
        for label, m in (("global", GLOBAL), ("relaxed", RELAXED)):
            r("cudaStreamBeginCapture", s1, m)
            code = on_thread(lambda: (lambda g: (r("cudaStreamEndCapture", s1, ctypes.byref(g)), g))(c_ptr()))
            r("cudaGetLastError")
            out[f"{label}: end on another thread"] = code[0]
            if code[0] != 0:
                out[f"{label}: end on its own thread after"] = close(s1)
            elif code[1].value:
                r("cudaGraphDestroy", code[1])
        for x in (e, e1, e2):
            r("cudaEventDestroy", x)
        for s in (s1, s2, s3):
            r("cudaStreamDestroy", s)
        r("cudaFree", c_ptr(buf))
        out["last error at the end"] = r("cudaGetLastError")
        return out

    for name, body in (("init", init), ("malloc_edges", malloc_edges), ("malloc_layout", malloc_layout),
                       ("malloc_sequence", malloc_sequence),
                       ("mem_info", mem_info), ("malloc_async", malloc_async),
                       ("pointer_attributes", pointer_attributes), ("streams_events", streams_events),
                       ("vmm", vmm), ("timings", timings), ("call_costs", call_costs),
                       ("vmm_bad_handles", vmm_bad_handles), ("stream_capture", stream_capture)):
        if only and name not in only:
            continue
        p.run(name, body)
        save()  # what is known so far survives a crash in a later probe


def isolated(args):
    import subprocess
    import tempfile
    merged = {}
    for name in PROBES:
        with tempfile.NamedTemporaryFile(suffix=".json") as tmp:
            argv = [sys.executable, os.path.abspath(__file__), "--only", f"init,{name}", "--out", tmp.name]
            for opt in ("cudart", "cuda"):
                if getattr(args, opt):
                    argv += [f"--{opt}", getattr(args, opt)]
            p = subprocess.run(argv, capture_output=True, text=True, timeout=120)
            try:
                with open(tmp.name) as f:
                    got = json.load(f)
            except (OSError, ValueError):
                got = {"probes": {}}
        merged.setdefault("device", got.get("device"))
        merged.setdefault("cudart", got.get("cudart"))
        merged.setdefault("probes", {}).update(got.get("probes", {}))
        if p.returncode != 0:
            merged["probes"][name] = {"crashed": p.returncode, "partial": got.get("probes", {}).get(name),
                                      "stderr": p.stderr[-500:]}
    text = json.dumps(merged, indent=1, sort_keys=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(text)
    return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cudart")
    ap.add_argument("--cuda")
    ap.add_argument("--out")
    ap.add_argument("--only", default="", help="comma-separated probes (default: all, in this process)")
    ap.add_argument("--isolate", action="store_true",
                    help="each probe in its own process: a crash loses only that probe, and is recorded")
    args = ap.parse_args()
    if args.isolate:
        return isolated(args)
    rt, rt_name = load(cudart_candidates(), args.cudart)
    drv, drv_name = load(["libcuda.so.1"], args.cuda)
    p = Probe(rt, drv)
    name = ctypes.create_string_buffer(256)

    def result():
        return {"device": name.value.decode(errors="replace"), "cudart": rt_name, "probes": p.out}

    def save():
        if args.out:
            with open(args.out, "w") as f:
                f.write(json.dumps(result(), indent=1, sort_keys=True) + "\n")

    probes(p, save, [x for x in args.only.split(",") if x])
    try:
        p.fn(drv, "cuDeviceGetName")(name, 256, 0)
    except LookupError:
        pass
    save()
    print(json.dumps(result(), indent=1, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
