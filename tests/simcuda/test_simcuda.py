"""The simulated CUDA device's own calls, through ctypes, without PyTorch:
the virtual-memory calls on real pages (reserve, create, map, set access,
unmap, release, shareable file descriptors), cudaMalloc's address ranges
and capacity, memory info, several devices, held events, kernel launches
refused unless allowed, refusals that name the call, and fault injection.

Run by ctest with SIMCUDA naming build/simcuda; each case runs in a fresh
process (the device reads its settings once).
"""
import os
import subprocess
import sys
import textwrap

import pytest

SIMCUDA = os.environ["SIMCUDA"]
MiB = 1 << 20

PRELUDE = f"""
import ctypes, os
MiB = 1 << 20
drv = ctypes.CDLL({os.path.join(SIMCUDA, "libcuda.so.1")!r})
rt = ctypes.CDLL({os.path.join(SIMCUDA, "libcudart.so.13")!r})
rt.cudaGetErrorString.restype = ctypes.c_char_p
ptr = ctypes.c_uint64
class Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]
class Prop(ctypes.Structure):  # CUmemAllocationProp
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int),
                ("location", Location), ("win32HandleMetaData", ctypes.c_void_p),
                ("allocFlags", ctypes.c_ubyte * 8)]
class Access(ctypes.Structure):  # CUmemAccessDesc
    _fields_ = [("location", Location), ("flags", ctypes.c_int)]
def prop(device=0):
    p = Prop()
    p.type, p.location.type, p.location.id = 1, 1, device  # pinned, on a device
    p.requestedHandleTypes = 1  # POSIX file descriptor
    return p
def rw(device=0):
    a = Access()
    a.location.type, a.location.id, a.flags = 1, device, 3  # read and write
    return a
def reserve_and_map(reserved, mapped, access=True):
    # A reservation of `reserved` bytes whose first `mapped` are mapped (and
    # readable and writable when `access`): its address.
    assert drv.cuInit(0) == 0
    va, h = ptr(), ptr()
    assert drv.cuMemAddressReserve(ctypes.byref(va), reserved, 0, 0, 0) == 0
    assert drv.cuMemCreate(ctypes.byref(h), mapped, ctypes.byref(prop()), 0) == 0
    assert drv.cuMemMap(ptr(va.value), mapped, 0, h, 0) == 0
    if access:
        assert drv.cuMemSetAccess(ptr(va.value), mapped, ctypes.byref(rw()), 1) == 0
    return va.value
def free_bytes():
    free, total = ctypes.c_size_t(), ctypes.c_size_t()
    assert rt.cudaMemGetInfo(ctypes.byref(free), ctypes.byref(total)) == 0
    return free.value, total.value
"""


def run(body, **env):
    r = subprocess.run([sys.executable, "-c", PRELUDE + textwrap.dedent(body)],
                       env={**os.environ, **env}, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout.split(), r.stderr


def test_virtual_memory_on_real_pages():
    out, _ = run("""
        assert drv.cuInit(0) == 0
        g = ctypes.c_size_t()
        assert drv.cuMemGetAllocationGranularity(ctypes.byref(g), ctypes.byref(prop()), 0) == 0
        va, h1, h2 = ptr(), ptr(), ptr()
        assert drv.cuMemAddressReserve(ctypes.byref(va), 8 * MiB, 0, 0, 0) == 0
        assert va.value % (2 * MiB) == 0
        free0 = free_bytes()[0]
        assert drv.cuMemCreate(ctypes.byref(h1), 4 * MiB, ctypes.byref(prop()), 0) == 0
        assert drv.cuMemCreate(ctypes.byref(h2), 4 * MiB, ctypes.byref(prop()), 0) == 0
        assert free0 - free_bytes()[0] == 8 * MiB
        assert drv.cuMemMap(ptr(va.value), 4 * MiB, 0, h1, 0) == 0
        assert drv.cuMemMap(ptr(va.value + 4 * MiB), 4 * MiB, 0, h2, 0) == 0
        assert drv.cuMemMap(ptr(va.value), 4 * MiB, 0, h2, 0) == 1  # over a mapping: invalid value
        assert drv.cuMemSetAccess(ptr(va.value), 8 * MiB, ctypes.byref(rw()), 1) == 0
        ctypes.memset(va.value, 7, 8 * MiB)
        # The same physical memory, exported as a descriptor, imported, mapped
        # again elsewhere: it reads what was written.
        fd, h3, va2 = ctypes.c_int(), ptr(), ptr()
        assert drv.cuMemExportToShareableHandle(ctypes.byref(fd), h1, 1, 0) == 0
        assert drv.cuMemImportFromShareableHandle(ctypes.byref(h3), ctypes.c_void_p(fd.value), 1) == 0
        assert drv.cuMemAddressReserve(ctypes.byref(va2), 4 * MiB, 0, 0, 0) == 0
        assert drv.cuMemMap(ptr(va2.value), 4 * MiB, 0, h3, 0) == 0
        assert drv.cuMemSetAccess(ptr(va2.value), 4 * MiB, ctypes.byref(rw()), 1) == 0
        print(ctypes.string_at(va2.value + 12345, 1) == bytes([7]))
        h = ptr()
        assert drv.cuMemRetainAllocationHandle(ctypes.byref(h), ctypes.c_void_p(va.value + 5 * MiB)) == 0
        print(h.value == h2.value)
        assert drv.cuMemRelease(h) == 0  # the retain
        for v, n in ((va, 8), (va2, 4)):
            assert drv.cuMemUnmap(ptr(v.value), n * MiB) == 0
        for x in (h1, h2, h3):
            assert drv.cuMemRelease(x) == 0
        assert drv.cuMemAddressFree(ptr(va.value), 8 * MiB) == 0
        assert drv.cuMemAddressFree(ptr(va2.value), 4 * MiB) == 0
        print(free_bytes()[0] == free0)
    """)
    assert out == ["True", "True", "True"]


def test_cudamalloc_ascends_and_memory_info_follows_the_capacity():
    out, _ = run("""
        a, b = ctypes.c_void_p(), ctypes.c_void_p()
        assert rt.cudaMalloc(ctypes.byref(a), 3 * MiB) == 0
        assert rt.cudaMalloc(ctypes.byref(b), 1) == 0
        print(b.value - a.value, free_bytes())
        big = ctypes.c_void_p()
        print(rt.cudaMalloc(ctypes.byref(big), 1 << 30))  # beyond 1 GiB less 6 MiB in use
        print(rt.cudaGetLastError(), rt.cudaGetLastError())
        ctypes.memset(a, 1, 3 * MiB)
        assert rt.cudaFree(a) == 0 and rt.cudaFree(b) == 0
        print(rt.cudaFree(a))  # not a live allocation: invalid value
    """, RESERVOIR_SIMCUDA_MEMORY="1GiB")
    # 2 MiB aligned first fit: 3 MiB takes 4 MiB; 1 GiB in all.
    assert out == [str(4 * MiB), f"({(1 << 30) - 6 * MiB},", f"{1 << 30})", "2", "2", "0", "1"]


def test_small_cudamalloc_shares_pages_as_a_gpu_does():
    out, _ = run("""
        free0 = free_bytes()[0]
        ptrs = [ctypes.c_void_p() for _ in range(4)]
        for p, size in zip(ptrs, (1, 512, 4096, MiB)):
            assert rt.cudaMalloc(ctypes.byref(p), size) == 0
        print(",".join(str(q.value - ptrs[0].value) for q in ptrs), free0 - free_bytes()[0])
        assert rt.cudaFree(ptrs[1]) == 0
        again = ctypes.c_void_p()
        assert rt.cudaMalloc(ctypes.byref(again), 300) == 0  # the freed slot, first fit
        print(again.value - ptrs[0].value)
        for p in (ptrs[0], ptrs[2], ptrs[3], again):
            assert rt.cudaFree(p) == 0
        print(free0 - free_bytes()[0])  # the page went back with its last slot
    """)
    # 512-byte slots in one 2 MiB page (as an H100 places them: tests/data/gpu).
    assert out == ["0,512,1024,5120", str(2 * MiB), "512", "0"]


def test_several_devices_and_their_names():
    out, _ = run("""
        n = ctypes.c_int()
        assert rt.cudaGetDeviceCount(ctypes.byref(n)) == 0
        assert rt.cudaSetDevice(1) == 0
        a = ctypes.c_void_p()
        assert rt.cudaMalloc(ctypes.byref(a), MiB) == 0
        name = ctypes.create_string_buffer(64)
        assert drv.cuDeviceGetName(name, 64, 1) == 0
        print(n.value, drv.reservoirSimCudaUsed(0), drv.reservoirSimCudaUsed(1), name.value.decode())
        print(rt.cudaSetDevice(3))
    """, RESERVOIR_SIMCUDA_DEVICES="3", RESERVOIR_SIMCUDA_NAME="SimGPU")
    assert out == ["3", "0", str(2 * MiB), "SimGPU", "101"]


def test_a_contexts_device_in_cuda_13s_form():
    """cuCtxGetDevice_v2 (what cuda-bindings 13 calls for cuCtxGetDevice,
    Numba's first question): a context's device, the current one's for
    null, and a pointer the driver never handed out refused."""
    out, _ = run("""
        assert drv.cuInit(0) == 0
        ctx, dev = ctypes.c_void_p(), ctypes.c_int(-1)
        assert drv.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 1) == 0
        print(drv.cuCtxGetDevice_v2(ctypes.byref(dev), ctx), dev.value)
        assert drv.cuCtxSetCurrent(ctx) == 0
        dev.value = -1
        print(drv.cuCtxGetDevice_v2(ctypes.byref(dev), None), dev.value)
        bogus = ctypes.create_string_buffer(16)
        name = ctypes.c_char_p()
        code = drv.cuCtxGetDevice_v2(ctypes.byref(dev), ctypes.cast(bogus, ctypes.c_void_p))
        assert drv.cuGetErrorName(code, ctypes.byref(name)) == 0
        print(code, name.value.decode(), drv.cuCtxGetDevice_v2(None, ctx))
    """, RESERVOIR_SIMCUDA_DEVICES="2")
    assert out == ["0", "1", "0", "1", "201", "CUDA_ERROR_INVALID_CONTEXT", "1"]


def test_events_complete_when_recorded_or_when_released():
    out, _ = run("""
        e = ctypes.c_void_p()
        assert rt.cudaEventCreateWithFlags(ctypes.byref(e), 0) == 0
        assert rt.cudaEventRecord(e, None) == 0
        print(rt.cudaEventQuery(e))
        drv.reservoirSimCudaHoldEvents(1)
        assert rt.cudaEventRecord(e, None) == 0
        print(rt.cudaEventQuery(e))  # not ready
        drv.reservoirSimCudaCompleteEvents()
        print(rt.cudaEventQuery(e))
        assert rt.cudaEventRecord(e, None) == 0
        print(rt.cudaEventQuery(e), rt.cudaEventSynchronize(e), rt.cudaEventQuery(e))
    """)
    assert out == ["0", "600", "0", "600", "0", "0"]


def test_kernels_refused_unless_allowed_and_refusals_name_the_call():
    out, err = run("""
        dim3 = ctypes.c_uint * 3
        args = (ctypes.c_void_p(1), dim3(1, 1, 1), dim3(1, 1, 1), ctypes.c_void_p(), ctypes.c_size_t(0),
                ctypes.c_void_p())
        print(rt.cudaLaunchKernel(*args))
        print(rt.cudaGetErrorString(801).decode().replace(" ", "_"))
        drv.reservoirSimCudaAllowKernels(1)
        print(rt.cudaLaunchKernel(*args))
        m = ctypes.c_void_p()
        print(rt.cudaMallocArray(ctypes.byref(m), None, 1, 1, 0))  # a call the simulation does not serve
        print(rt.cudaGetErrorString(801).decode().replace(" ", "_"))
    """)
    assert out == [
        "801", "operation_not_supported:_cudaLaunchKernel_is_not_served_by_reservoir's_simulated_CUDA_device",
        "0", "801",
        "operation_not_supported:_cudaMallocArray_is_not_served_by_reservoir's_simulated_CUDA_device"]
    assert "cudaLaunchKernel is not served by the simulated device" in err


def test_fault_injection_by_environment_and_by_call():
    out, _ = run("""
        a = ctypes.c_void_p()
        print([rt.cudaMalloc(ctypes.byref(a), MiB) for _ in range(4)])
        h = ptr()
        drv.reservoirSimCudaFailAt(b"cuMemCreate", 2)
        print([drv.cuMemCreate(ctypes.byref(h), 2 * MiB, ctypes.byref(prop()), 0) for _ in range(3)])
        print(drv.reservoirSimCudaCalls(b"cudaMalloc"), drv.reservoirSimCudaCalls(b"cuMemCreate"))
    """, RESERVOIR_SIMCUDA_FAIL="cudaMalloc:2,cudaMalloc:4")
    # Allocation calls fail as out of memory.
    assert out == ["[0,", "2,", "0,", "2]", "[0,", "2,", "0]", "4", "3"]


IPC_CHILD = """
import ctypes, sys
rt = ctypes.CDLL(sys.argv[1])
class Handle(ctypes.Structure):  # cudaIpcMemHandle_t / cudaIpcEventHandle_t: passed by value
    _fields_ = [("reserved", ctypes.c_char * 64)]
handle = Handle.from_buffer_copy(bytes.fromhex(sys.argv[2]))
event_handle = Handle.from_buffer_copy(bytes.fromhex(sys.argv[3]))
a, b = ctypes.c_void_p(), ctypes.c_void_p()
assert rt.cudaIpcOpenMemHandle(ctypes.byref(a), handle, 1) == 0
assert rt.cudaIpcOpenMemHandle(ctypes.byref(b), handle, 1) == 0 and b.value == a.value
ev = ctypes.c_void_p()
assert rt.cudaIpcOpenEventHandle(ctypes.byref(ev), event_handle) == 0
assert rt.cudaEventSynchronize(ev) == 0
host = (ctypes.c_ubyte * 16)()
assert rt.cudaMemcpy(host, ctypes.c_void_p(a.value + 6 * 2**20 - 16), 16, 2) == 0
assert bytes(host) == b"\\x5a" * 16, bytes(host)
assert rt.cudaMemset(ctypes.c_void_p(a.value + 4096), 0x33, 8) == 0
stranger = Handle()
print(rt.cudaIpcOpenMemHandle(ctypes.byref(b), stranger, 1))
assert rt.cudaIpcCloseMemHandle(a) == 0 and rt.cudaIpcCloseMemHandle(a) == 0
print(rt.cudaIpcCloseMemHandle(a))
"""


def test_ipc_memory_and_events_shared_between_processes():
    # The exporter writes, hands its handles to a child process through a
    # pipe, and waits; the child opens them, reads, writes back, opens the
    # same handle again (the same pointer, counted), closes both. Misuse:
    # a small allocation, a pointer not at an allocation's start, the own
    # process opening its handle, a stranger's bytes, an event made without
    # cudaEventInterprocess.
    out, _ = run(f"""
        import subprocess, sys
        IPC_CHILD = {IPC_CHILD!r}
        class Handle(ctypes.Structure):  # cudaIpcMemHandle_t / cudaIpcEventHandle_t: passed by value
            _fields_ = [("reserved", ctypes.c_char * 64)]
        handle = Handle()
        event_handle = Handle()
        p = ctypes.c_void_p()
        assert rt.cudaMalloc(ctypes.byref(p), 6 * MiB) == 0
        assert rt.cudaMemset(p, 0x5A, 6 * MiB) == 0
        assert rt.cudaIpcGetMemHandle(ctypes.byref(handle), p) == 0
        ev = ctypes.c_void_p()
        assert rt.cudaEventCreateWithFlags(ctypes.byref(ev), 0x2 | 0x4) == 0  # disable timing, interprocess
        assert rt.cudaIpcGetEventHandle(ctypes.byref(event_handle), ev) == 0
        plain = ctypes.c_void_p()
        assert rt.cudaEventCreateWithFlags(ctypes.byref(plain), 0) == 0
        misuse = [rt.cudaIpcGetEventHandle(ctypes.byref(event_handle), plain)]
        small = ctypes.c_void_p()
        assert rt.cudaMalloc(ctypes.byref(small), 4096) == 0
        other = Handle()
        misuse.append(rt.cudaIpcGetMemHandle(ctypes.byref(other), small))
        misuse.append(rt.cudaIpcGetMemHandle(ctypes.byref(other), ctypes.c_void_p(p.value + 4096)))
        opened = ctypes.c_void_p()
        misuse.append(rt.cudaIpcOpenMemHandle(ctypes.byref(opened), handle, 1))
        assert rt.cudaIpcGetEventHandle(ctypes.byref(event_handle), ev) == 0
        r = subprocess.run([sys.executable, "-c", IPC_CHILD, rt._name, bytes(handle).hex(), bytes(event_handle).hex()],
                           capture_output=True, text=True)
        assert r.returncode == 0, r.stdout + r.stderr
        seen = (ctypes.c_ubyte * 8)()
        assert rt.cudaMemcpy(seen, ctypes.c_void_p(p.value + 4096), 8, 2) == 0
        assert rt.cudaFree(p) == 0
        print(*misuse, *r.stdout.split(), bytes(seen).hex())
    """)
    # cudaErrorInvalidResourceHandle, refused (not served: under 2 MiB),
    # cudaErrorInvalidValue, cudaErrorDeviceUninitialized (own process);
    # the child: a stranger's bytes, a third close.
    assert out == ["400", "801", "1", "201", "400", "1", "33" * 8], out


def test_registered_host_memory_is_pinned_until_unregistered():
    # cudaPointerGetAttributes's type (what PyTorch's is_pinned() reads):
    # 1 host (pinned), 0 unregistered; the runtime's errors for a range
    # registered twice (712) and a pointer never registered (713).
    out, _ = run("""
        class Attributes(ctypes.Structure):
            _fields_ = [("type", ctypes.c_int), ("device", ctypes.c_int),
                        ("devicePointer", ctypes.c_void_p), ("hostPointer", ctypes.c_void_p),
                        ("reserved", ctypes.c_long * 16)]  # room for the runtime's whole struct
        buf = ctypes.create_string_buffer(3 * MiB)
        inner = ctypes.c_void_p(ctypes.addressof(buf) + MiB)
        def kind(p):
            a = Attributes()
            assert rt.cudaPointerGetAttributes(ctypes.byref(a), p) == 0
            return a.type
        print(kind(buf), rt.cudaHostRegister(buf, ctypes.c_size_t(2 * MiB), 0), kind(buf), kind(inner),
              rt.cudaHostRegister(inner, ctypes.c_size_t(MiB), 0), rt.cudaHostUnregister(inner),
              rt.cudaHostUnregister(buf), kind(buf), rt.cudaHostUnregister(buf),
              rt.cudaHostRegister(None, ctypes.c_size_t(MiB), 0))
    """)
    assert out == ["0", "0", "1", "1", "712", "713", "0", "0", "713", "1"]


def test_a_spinning_kernel_keeps_its_stream_busy_and_events_complete_in_order():
    # A kernel registered as a spin kernel (as torch.cuda._sleep's) keeps its
    # stream busy for its cycles at 1.98e6 a millisecond; events behind it,
    # the stream, and the legacy stream (which waits for blocking streams)
    # are not ready until then, a non-blocking stream is; synchronizing waits.
    out, _ = run("""
        import time
        class Dim3(ctypes.Structure):
            _fields_ = [("x", ctypes.c_uint), ("y", ctypes.c_uint), ("z", ctypes.c_uint)]
        stub = ctypes.create_string_buffer(8)  # a host stub's address
        rt.__cudaRegisterFunction(None, stub, b"spin", b"_ZN2at4cuda11spin_kernelEl", -1,
                                  None, None, None, None, None)
        def stream(flags):
            s = ctypes.c_void_p()
            assert rt.cudaStreamCreateWithFlags(ctypes.byref(s), flags) == 0
            return s
        def event(s):
            e = ctypes.c_void_p()
            assert rt.cudaEventCreate(ctypes.byref(e)) == 0
            assert rt.cudaEventRecord(e, s) == 0
            return e
        blocking, side = stream(0), stream(1)
        start = event(blocking)
        cycles = ctypes.c_int64(int(80 * 1.98e6))  # 80 ms
        args = (ctypes.c_void_p * 1)(ctypes.cast(ctypes.pointer(cycles), ctypes.c_void_p))
        t0 = time.monotonic()
        assert rt.cudaLaunchKernel(stub, Dim3(1, 1, 1), Dim3(1, 1, 1), args, ctypes.c_size_t(0), blocking) == 0
        end, other, legacy = event(blocking), event(side), event(None)
        print(rt.cudaEventQuery(start), rt.cudaEventQuery(end), rt.cudaStreamQuery(blocking),
              rt.cudaEventQuery(other), rt.cudaStreamQuery(side), rt.cudaEventQuery(legacy))
        assert rt.cudaEventSynchronize(end) == 0
        waited = time.monotonic() - t0
        ms = ctypes.c_float()
        assert rt.cudaEventElapsedTime(ctypes.byref(ms), start, end) == 0
        print(rt.cudaEventQuery(end), rt.cudaStreamQuery(blocking), rt.cudaEventQuery(legacy),
              waited >= 0.079, 79 <= ms.value <= 200)
    """, RESERVOIR_SIMCUDA_KERNELS="skip")
    assert out == ["0", "600", "600", "0", "0", "600", "0", "0", "0", "True", "True"]


def test_managed_memory_is_reachable_from_the_host_and_freed_by_cudafree():
    out, _ = run("""
        class Attributes(ctypes.Structure):
            _fields_ = [("type", ctypes.c_int), ("device", ctypes.c_int),
                        ("devicePointer", ctypes.c_void_p), ("hostPointer", ctypes.c_void_p),
                        ("reserved", ctypes.c_long * 16)]
        class MemLocation(ctypes.Structure):
            _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]
        p = ctypes.c_void_p()
        before = free_bytes()[0]
        print(rt.cudaMallocManaged(ctypes.byref(p), ctypes.c_size_t(3 * MiB), 1), free_bytes()[0] == before)
        ctypes.memmove(p, b"managed", 7)  # the host reaches it
        a = Attributes()
        assert rt.cudaPointerGetAttributes(ctypes.byref(a), p) == 0
        print(a.type, a.devicePointer == a.hostPointer == p.value, ctypes.string_at(p, 7) == b"managed")
        plain = ctypes.c_void_p()
        assert rt.cudaMalloc(ctypes.byref(plain), ctypes.c_size_t(MiB)) == 0
        print(rt.cudaMemAdvise(p, ctypes.c_size_t(MiB), 1, MemLocation(1, 0)),
              rt.cudaMemPrefetchAsync(p, ctypes.c_size_t(MiB), MemLocation(1, 0), 0, None),
              rt.cudaMemPrefetchAsync(plain, ctypes.c_size_t(MiB), MemLocation(1, 0), 0, None))
        q = ctypes.c_void_p()
        print(rt.cudaFree(p), rt.cudaFree(p), rt.cudaMallocManaged(ctypes.byref(q), ctypes.c_size_t(MiB), 4),
              rt.cudaMallocManaged(ctypes.byref(q), ctypes.c_size_t(0), 1), rt.cudaFree(plain))
    """)
    assert out == ["0", "True", "3", "True", "True", "0", "0", "1", "0", "1", "1", "1", "0"]


def test_cublas_handles_without_math():
    # cuBLAS as the runtime loads it: a handle's stream, workspace and modes
    # kept, a destroyed handle not initialized (1); a GEMM refused (15) unless
    # kernels are allowed, then taken without computing, as a skipped kernel.
    body = """
        blas = ctypes.CDLL(os.path.join(os.path.dirname(rt._name), "libcublas.so.13"))
        h = ctypes.c_void_p()
        print(blas.cublasCreate_v2(ctypes.byref(h)))
        s = ctypes.c_void_p()
        assert rt.cudaStreamCreate(ctypes.byref(s)) == 0
        ws = ctypes.c_void_p()
        assert rt.cudaMalloc(ctypes.byref(ws), ctypes.c_size_t(4 * MiB)) == 0
        got, mode = ctypes.c_void_p(), ctypes.c_int()
        print(blas.cublasSetStream_v2(h, s), blas.cublasGetStream_v2(h, ctypes.byref(got)), got.value == s.value,
              blas.cublasSetWorkspace_v2(h, ws, ctypes.c_size_t(4 * MiB)),
              blas.cublasSetWorkspace_v2(h, ctypes.c_void_p(ws.value + 8), ctypes.c_size_t(MiB)),
              blas.cublasSetMathMode(h, 3), blas.cublasGetMathMode(h, ctypes.byref(mode)), mode.value)
        one = ctypes.c_float(1.0)
        print(blas.cublasSgemm_v2(h, 0, 0, 2, 2, 2, ctypes.byref(one), ws, 2, ws, 2, ctypes.byref(one), ws, 2))
        print(blas.cublasDestroy_v2(h), blas.cublasDestroy_v2(h))
    """
    out, _ = run(body)
    assert out == ["0", "0", "0", "True", "0", "7", "0", "0", "3", "15", "0", "1"]
    out, _ = run(body, RESERVOIR_SIMCUDA_KERNELS="skip")
    assert out[9] == "0"


def test_cupti_answers_that_there_is_nothing_to_trace():
    # CUPTI as the runtime loads it (the same library by soname): its
    # version, result names, and every other call refused with
    # CUPTI_ERROR_NOT_SUPPORTED (27), saying so once on stderr.
    out, err = run("""
        cupti = ctypes.CDLL(os.path.join(os.path.dirname(rt._name), "libcupti.so.13"))
        v = ctypes.c_uint32()
        print(cupti.cuptiGetVersion(ctypes.byref(v)), v.value, cupti.cuptiGetVersion(None))
        text = ctypes.c_char_p()
        print(cupti.cuptiGetResultString(27, ctypes.byref(text)), text.value.decode().split()[0])
        print(cupti.cuptiGetResultString(12345, ctypes.byref(text)), text.value.decode())
        sub = ctypes.c_void_p()
        print(cupti.cuptiSubscribe(ctypes.byref(sub), None, None), cupti.cuptiActivityEnable(10),
              cupti.cuptiActivityFlushAll(0), cupti.cuptiFinalize())
        # The runtime's own library, not another found on the path.
        import re
        maps = open("/proc/self/maps").read()
        print(sorted(set(re.findall(r"\\S*libcupti\\.so\\.13", maps))) == [os.path.join(os.path.dirname(rt._name), "libcupti.so.13")])
    """)
    assert out == ["0", "130001", "1", "0", "CUPTI_ERROR_NOT_SUPPORTED", "1", "CUPTI_ERROR_UNKNOWN",
                   "27", "27", "27", "27", "True"]
    assert err.count("CUPTI is not served by the simulated device (cuptiSubscribe)") == 1
    assert err.count("CUPTI is not served") == 1


def test_a_copy_into_unmapped_address_space_is_a_sticky_illegal_address():
    # As a GPU: reserved but unmapped (or mapped without access) memory
    # faults with error 700 instead of being touched, and the context is lost:
    # later work answers 700 too, while device queries still answer.
    out, _ = run("""
        va = reserve_and_map(8 * MiB, 4 * MiB)
        host = ctypes.create_string_buffer(8 * MiB)
        print(rt.cudaMemcpy(ctypes.c_void_p(va), host, 4 * MiB, 1))  # mapped: fine
        print(rt.cudaMemset(ctypes.c_void_p(va + 2 * MiB), 0, 2 * MiB))
        # Across the end of the mapping into the unmapped half: a fault.
        print(rt.cudaMemcpy(host, ctypes.c_void_p(va + 3 * MiB), 2 * MiB, 2))
        print(rt.cudaGetErrorString(700).decode().replace(" ", "_"))
        d = ctypes.c_void_p()
        print(rt.cudaMalloc(ctypes.byref(d), MiB), rt.cudaDeviceSynchronize())
        dev = ctypes.c_int(-1)
        print(rt.cudaGetDevice(ctypes.byref(dev)), dev.value)
    """)
    assert out == ["0", "0", "700", "an_illegal_memory_access_was_encountered", "700", "700", "0", "0"]


def test_mapped_memory_without_access_faults_too():
    out, _ = run("""
        va = reserve_and_map(2 * MiB, 2 * MiB, access=False)
        print(drv.cuMemsetD8_v2(ptr(va), 1, 4096))
    """)
    assert out == ["700"]




def test_stream_capture_answers_as_cuda_documents_them():
    # tests/gpu/stream_capture_sim.json: what the simulated device answers to
    # tests/gpu/cuda_behaviour.py's stream_capture probe, CUDA's codes as
    # documented (401 illegal state, 900 not permitted while capturing, 901
    # invalidated, 902 merge, 903 unmatched, 904 unjoined, 906 implicit
    # legacy-stream dependency, 907 captured event, 908 wrong thread, 910
    # exec update failure). The GPU bundle's graphs step records a GPU's
    # answers beside it; simcuda_matches_gpu compares a kept GPU record.
    probe = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "gpu", "cuda_behaviour.py")
    r = subprocess.run([sys.executable, probe, "--only", "init,stream_capture",
                        "--cudart", os.path.join(SIMCUDA, "libcudart.so.13"),
                        "--cuda", os.path.join(SIMCUDA, "libcuda.so.1")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    import json
    got = json.loads(r.stdout)["probes"]["stream_capture"]
    with open(os.path.join(os.path.dirname(probe), "stream_capture_sim.json")) as f:
        assert got == json.load(f)


CAPTURE_PRELUDE = """
class Dim3(ctypes.Structure):
    _fields_ = [("x", ctypes.c_uint), ("y", ctypes.c_uint), ("z", ctypes.c_uint)]
def stream():
    s = ctypes.c_void_p()
    assert rt.cudaStreamCreateWithFlags(ctypes.byref(s), 1) == 0
    return s
def end(s):
    g = ctypes.c_void_p()
    code = rt.cudaStreamEndCapture(s, ctypes.byref(g))
    return code, g
def count(g):
    n = ctypes.c_size_t()
    assert rt.cudaGraphGetNodes(g, None, ctypes.byref(n)) == 0
    return n.value
stub = ctypes.create_string_buffer(8)
rt.__cudaRegisterFunction(None, stub, b"k", b"_Z6kernelv", -1, None, None, None, None, None)
def kernel(s):
    return rt.cudaLaunchKernel(stub, Dim3(1, 1, 1), Dim3(1, 1, 1), None, ctypes.c_size_t(0), s)
"""


def run_captured(body, **env):
    return run(CAPTURE_PRELUDE + textwrap.dedent(body), **env)


def test_captured_kernels_follow_the_kernel_setting():
    # Refused kernels refuse in a capture too, and invalidate it; skipped
    # ones become nodes that a launch runs (in the stream's order).
    out, err = run_captured("""
        s = stream()
        assert rt.cudaStreamBeginCapture(s, 0) == 0
        print(kernel(s))
        code, g = end(s)
        print(code, g.value is None)
        drv.reservoirSimCudaAllowKernels(1)
        assert rt.cudaStreamBeginCapture(s, 0) == 0
        print(kernel(s), kernel(s))
        code, g = end(s)
        ex = ctypes.c_void_p()
        assert rt.cudaGraphInstantiate(ctypes.byref(ex), g, ctypes.c_ulonglong(0)) == 0
        print(code, count(g), rt.cudaGraphLaunch(ex, s), rt.cudaStreamSynchronize(s))
        drv.reservoirSimCudaAllowKernels(0)
        print(rt.cudaGraphLaunch(ex, s))
    """)
    assert out == ["801", "901", "True", "0", "0", "0", "2", "0", "0", "801"]
    assert "is not served by the simulated device" in err


def test_a_graph_holds_host_nodes_and_user_objects():
    # A host function launched in a capture runs at each launch, not at the
    # capture; a user object retained by the graph lives until the graph and
    # every executable graph made from it are destroyed.
    out, _ = run_captured("""
        calls = []
        HostFn = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
        host = HostFn(lambda data: calls.append("host"))
        gone = HostFn(lambda data: calls.append("destroyed"))
        s = stream()
        assert rt.cudaLaunchHostFunc(s, host, None) == 0  # outside a capture: at once
        assert rt.cudaStreamBeginCapture(s, 0) == 0
        assert rt.cudaLaunchHostFunc(s, host, None) == 0
        graph, status, ident = ctypes.c_void_p(), ctypes.c_int(), ctypes.c_ulonglong()
        assert rt.cudaStreamGetCaptureInfo(s, ctypes.byref(status), ctypes.byref(ident), ctypes.byref(graph),
                                           None, None, None) == 0
        obj = ctypes.c_void_p()
        print(rt.cudaUserObjectCreate(ctypes.byref(obj), None, gone, 1, 0))  # flags must be NoDestructorSync
        assert rt.cudaUserObjectCreate(ctypes.byref(obj), None, gone, 1, 1) == 0
        assert rt.cudaGraphRetainUserObject(graph, obj, 1, 1) == 0  # moves the caller's reference
        code, g = end(s)
        print(len(calls), g.value == graph.value)
        ex = ctypes.c_void_p()
        assert rt.cudaGraphInstantiate(ctypes.byref(ex), g, ctypes.c_ulonglong(0)) == 0
        assert rt.cudaGraphLaunch(ex, s) == 0 and rt.cudaGraphLaunch(ex, s) == 0
        assert rt.cudaGraphDestroy(g) == 0
        print(",".join(calls))
        assert rt.cudaGraphExecDestroy(ex) == 0
        print(",".join(calls), rt.cudaGraphExecDestroy(ex))
    """, RESERVOIR_SIMCUDA_KERNELS="skip")
    assert out == ["1", "1", "True", "host,host,host", "host,host,host,destroyed", "1"]


def test_an_empty_node_added_to_a_capture_orders_what_the_stream_captures_next():
    # What PyTorch 2.9's allocator does when it frees a block during a
    # capture: an empty node after the stream's last nodes
    # (cudaGraphAddEmptyNode into the capture's graph), made the stream's only
    # dependency; the stream's next work depends on it. Bad arguments are
    # refused.
    out, _ = run_captured("""
        s = stream()
        dev = ctypes.c_void_p()
        assert rt.cudaMalloc(ctypes.byref(dev), 8192) == 0
        assert rt.cudaStreamBeginCapture(s, 0) == 0
        assert rt.cudaMemsetAsync(dev, 1, ctypes.c_size_t(4096), s) == 0
        graph, status, ident = ctypes.c_void_p(), ctypes.c_int(), ctypes.c_ulonglong()
        deps, n = ctypes.POINTER(ctypes.c_void_p)(), ctypes.c_size_t()
        assert rt.cudaStreamGetCaptureInfo(s, ctypes.byref(status), ctypes.byref(ident), ctypes.byref(graph),
                                           ctypes.byref(deps), None, ctypes.byref(n)) == 0
        memset = deps[0]
        empty = ctypes.c_void_p()
        after = (ctypes.c_void_p * 1)(memset)
        assert rt.cudaGraphAddEmptyNode(ctypes.byref(empty), graph, after, ctypes.c_size_t(1)) == 0
        marker = (ctypes.c_void_p * 1)(empty.value)
        assert rt.cudaStreamUpdateCaptureDependencies(s, marker, None, ctypes.c_size_t(1), 1) == 0
        assert rt.cudaMemsetAsync(ctypes.c_void_p(dev.value + 4096), 2, ctypes.c_size_t(4096), s) == 0
        assert rt.cudaStreamGetCaptureInfo(s, ctypes.byref(status), ctypes.byref(ident), ctypes.byref(graph),
                                           ctypes.byref(deps), None, ctypes.byref(n)) == 0
        last = deps[0]
        got, k = (ctypes.c_void_p * 2)(), ctypes.c_size_t(2)
        edges = (ctypes.c_ubyte * 16)()
        assert rt.cudaGraphNodeGetDependencies(ctypes.c_void_p(last), got, edges, ctypes.byref(k)) == 0
        kind = ctypes.c_int()
        assert rt.cudaGraphNodeGetType(empty, ctypes.byref(kind)) == 0
        print(k.value, got[0] == empty.value, kind.value)
        k = ctypes.c_size_t(2)
        assert rt.cudaGraphNodeGetDependencies(empty, got, edges, ctypes.byref(k)) == 0
        print(k.value, got[0] == memset)
        print(rt.cudaGraphAddEmptyNode(None, graph, None, ctypes.c_size_t(0)),
              rt.cudaGraphAddEmptyNode(ctypes.byref(empty), ctypes.c_void_p(12345), None, ctypes.c_size_t(0)),
              rt.cudaGraphAddEmptyNode(ctypes.byref(empty), graph, None, ctypes.c_size_t(1)))
        code, g = end(s)
        count = ctypes.c_size_t(0)
        assert rt.cudaGraphGetNodes(g, None, ctypes.byref(count)) == 0
        print(code, count.value)
    """)
    # cudaGraphNodeTypeEmpty is 5; cudaErrorInvalidValue 1.
    assert out == ["1", "True", "5", "1", "True", "1", "1", "1", "0", "3"]


def test_graph_calls_take_injected_faults():
    # Each graph call answers an injected failure (an unknown error) and
    # leaves no capture behind.
    out, _ = run_captured("""
        s = stream()
        print(rt.cudaStreamBeginCapture(s, 0))
        st = ctypes.c_int()
        assert rt.cudaStreamIsCapturing(s, ctypes.byref(st)) == 0
        print(st.value)
        assert rt.cudaStreamBeginCapture(s, 0) == 0
        code, g = end(s)
        print(code, g.value is None)
        code, g = end(s)
        ex = ctypes.c_void_p()
        print(code, rt.cudaGraphInstantiateWithFlags(ctypes.byref(ex), g, ctypes.c_ulonglong(1)))
        assert rt.cudaGraphInstantiateWithFlags(ctypes.byref(ex), g, ctypes.c_ulonglong(1)) == 0
        print(rt.cudaGraphLaunch(ex, s), rt.cudaGraphLaunch(ex, s))
    """, RESERVOIR_SIMCUDA_KERNELS="skip",
        RESERVOIR_SIMCUDA_FAIL="cudaStreamBeginCapture:1,cudaStreamEndCapture:1,"
                               "cudaGraphInstantiateWithFlags:1,cudaGraphLaunch:1")
    assert out == ["999", "0", "999", "True", "0", "999", "999", "0"]


def test_per_thread_default_streams_capture_apart():
    # cudaStreamPerThread is each thread's own: a capture on another thread's
    # does not make this thread's capturing, and, being a blocking stream, it
    # refuses work on the legacy stream (906) from any thread.
    out, _ = run_captured("""
        import threading
        per_thread = ctypes.c_void_p(2)
        st = ctypes.c_int()
        began, done = threading.Event(), threading.Event()
        codes = {}
        def other():
            codes["begin"] = rt.cudaStreamBeginCapture(per_thread, 2)  # relaxed
            began.set()
            done.wait()
            codes["end"] = end(per_thread)[0]
        t = threading.Thread(target=other)
        t.start()
        began.wait()
        assert rt.cudaStreamIsCapturing(per_thread, ctypes.byref(st)) == 0
        mine = st.value
        buf = ctypes.c_void_p()
        assert rt.cudaMalloc(ctypes.byref(buf), 4096) == 0
        legacy = rt.cudaMemsetAsync(buf, 0, ctypes.c_size_t(16), None)
        rt.cudaGetLastError()
        done.set()
        t.join()
        print(codes["begin"], mine, legacy, codes["end"])
    """)
    assert out == ["0", "0", "906", "901"]


# The runtimes built for older CUDAs (SIMCUDA_OLDER: cuda11/libcudart.so.11.0,
# cuda12/libcudart.so.12, those the build made), each called with its own
# CUDA's signatures where they differ from 13's: a memset captured, the
# capture queried, the graph instantiated, updated and launched, a node's
# dependencies read and a capture's set, every edge-less form.
OLDER = [p for p in os.environ.get("SIMCUDA_OLDER", "").split(":") if p]
OLDER_PROGRAM = """
import ctypes, sys
rt = ctypes.CDLL(sys.argv[1])
major = int(sys.argv[2])
v = ctypes.c_int()
assert rt.cudaRuntimeGetVersion(ctypes.byref(v)) == 0 and v.value // 1000 == major, v.value
MiB = 1 << 20
dev = ctypes.c_void_p()
assert rt.cudaMalloc(ctypes.byref(dev), MiB) == 0
s = ctypes.c_void_p()
assert rt.cudaStreamCreateWithFlags(ctypes.byref(s), 1) == 0
assert rt.cudaStreamBeginCapture(s, 0) == 0
assert rt.cudaMemsetAsync(dev, 7, ctypes.c_size_t(MiB), s) == 0
status, cid = ctypes.c_int(), ctypes.c_ulonglong()
graph, deps, n = ctypes.c_void_p(), ctypes.POINTER(ctypes.c_void_p)(), ctypes.c_size_t()
if major == 11:  # 11's unsuffixed query: status and id only
    assert rt.cudaStreamGetCaptureInfo(s, ctypes.byref(status), ctypes.byref(cid)) == 0
    assert status.value == 1 and cid.value > 0
# 11's and 12's _v2: the graph and the dependencies too (no edges)
assert rt.cudaStreamGetCaptureInfo_v2(s, ctypes.byref(status), ctypes.byref(cid), ctypes.byref(graph),
                                      ctypes.byref(deps), ctypes.byref(n)) == 0
assert status.value == 1 and n.value == 1 and graph.value
memset_node = deps[0]
# Edge-less: the capture's next work depends on the memset alone (set).
node_array = (ctypes.c_void_p * 1)(memset_node)
assert rt.cudaStreamUpdateCaptureDependencies(s, node_array, ctypes.c_size_t(1), 1) == 0
assert rt.cudaMemsetAsync(ctypes.c_void_p(dev.value + 4096), 9, ctypes.c_size_t(4096), s) == 0
captured = ctypes.c_void_p()
assert rt.cudaStreamEndCapture(s, ctypes.byref(captured)) == 0 and captured.value == graph.value
nodes, count = (ctypes.c_void_p * 2)(), ctypes.c_size_t(2)
assert rt.cudaGraphGetNodes(captured, nodes, ctypes.byref(count)) == 0 and count.value == 2
got, k = (ctypes.c_void_p * 1)(), ctypes.c_size_t(1)
assert rt.cudaGraphNodeGetDependencies(ctypes.c_void_p(nodes[1]), got, ctypes.byref(k)) == 0
assert k.value == 1 and got[0] == memset_node
exec_ = ctypes.c_void_p()
if major == 11:  # where it failed and a log, in place of flags
    error_node, log = ctypes.c_void_p(1), ctypes.create_string_buffer(b"x" * 16)
    assert rt.cudaGraphInstantiate(ctypes.byref(exec_), captured, ctypes.byref(error_node), log,
                                   ctypes.c_size_t(16)) == 0
    assert error_node.value is None and log.value == b""
else:
    assert rt.cudaGraphInstantiate(ctypes.byref(exec_), captured, ctypes.c_ulonglong(0)) == 0
if major == 11:  # the verdict by pointer
    error_node, verdict = ctypes.c_void_p(1), ctypes.c_int(-1)
    assert rt.cudaGraphExecUpdate(exec_, captured, ctypes.byref(error_node), ctypes.byref(verdict)) == 0
    assert verdict.value == 0 and error_node.value is None
    other = ctypes.c_void_p()
    assert rt.cudaGraphCreate(ctypes.byref(other), 0) == 0
    assert rt.cudaGraphExecUpdate(exec_, other, ctypes.byref(error_node), ctypes.byref(verdict)) == 910
    assert verdict.value == 2  # cudaGraphExecUpdateErrorTopologyChanged
assert rt.cudaGraphLaunch(exec_, s) == 0 and rt.cudaStreamSynchronize(s) == 0
host = (ctypes.c_ubyte * (2 * 4096))()
assert rt.cudaMemcpy(host, dev, ctypes.c_size_t(2 * 4096), 2) == 0
assert bytes(host[:4096]) == b"\\x07" * 4096 and bytes(host[4096:]) == b"\\x09" * 4096
print("ok")
"""


@pytest.mark.parametrize("runtime", OLDER)
def test_an_older_cudas_runtime_answers_in_its_own_signatures(runtime):
    major = int(os.path.basename(os.path.dirname(runtime))[len("cuda"):])
    r = subprocess.run([sys.executable, "-c", OLDER_PROGRAM, os.path.join(SIMCUDA, runtime), str(major)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.split() == ["ok"], r.stdout + r.stderr
