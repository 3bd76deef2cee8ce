"""The simulated device's kernel attributes and occupancy, and its cuDNN,
through ctypes, without PyTorch: what a registered kernel answers (and an
unregistered pointer), the limits cudaFuncSetAttribute checks, occupancy
worked out by hand from an H100's limits; cuDNN's versions, handles and
errors, a convolution graph through the backend API (heuristics, engines
and their notes, a plan's workspace from the model, execute), its misuse
(an unfinalized descriptor, a wrong attribute type, a missing attribute, a
plan run without its workspace), and an LSTM's weight space.

Run by ctest with SIMCUDA naming build/simcuda; each case in a fresh process.
"""
import os
import subprocess
import sys
import textwrap

SIMCUDA = os.environ["SIMCUDA"]

PRELUDE = f"""
import ctypes, os
rt = ctypes.CDLL({os.path.join(SIMCUDA, "libcudart.so.13")!r})
drv = ctypes.CDLL({os.path.join(SIMCUDA, "libcuda.so.1")!r})
dnn = ctypes.CDLL({os.path.join(SIMCUDA, "libcudnn.so.9")!r})
dnn.cudnnGetErrorString.restype = ctypes.c_char_p
dnn.cudnnGetVersion.restype = ctypes.c_size_t
vp = ctypes.c_void_p
i64 = ctypes.c_int64
stub = ctypes.create_string_buffer(16)  # a host stub's address: any unique one
def register(name, limit=-1):
    rt.__cudaRegisterFunction(vp(0), vp(ctypes.addressof(stub)), name, name, limit, vp(0), vp(0), vp(0), vp(0),
                              vp(0))
    return ctypes.addressof(stub)
class FuncAttributes(ctypes.Structure):  # cudaFuncAttributes (CUDA 13)
    _fields_ = [("sharedSizeBytes", ctypes.c_size_t), ("constSizeBytes", ctypes.c_size_t),
                ("localSizeBytes", ctypes.c_size_t), ("maxThreadsPerBlock", ctypes.c_int),
                ("numRegs", ctypes.c_int), ("ptxVersion", ctypes.c_int), ("binaryVersion", ctypes.c_int),
                ("cacheModeCA", ctypes.c_int), ("maxDynamicSharedSizeBytes", ctypes.c_int),
                ("preferredShmemCarveout", ctypes.c_int), ("rest", ctypes.c_int * 24)]
def last_error():
    text = ctypes.create_string_buffer(512)
    dnn.cudnnGetLastErrorString(text, 512)
    return text.value.decode()
def desc(kind):
    d = vp()
    assert dnn.cudnnBackendCreateDescriptor(kind, ctypes.byref(d)) == 0
    return d
def set_(d, attr, kind, values, ctype):
    arr = (ctype * len(values))(*values)
    return dnn.cudnnBackendSetAttribute(d, attr, kind, len(values), arr)
# cuDNN 9's numbers: descriptor types, attributes, attribute types.
TENSOR, CONV, FWD, GRAPH, HEUR, CFG, ENGINE, PLAN, PACK = 17, 1, 10, 15, 4, 3, 2, 5, 16
HANDLE, DTYPE, BOOL, INT64, FLOAT, VOIDPTR, CONVMODE, HEURMODE, NOTE, DESC = 0, 1, 2, 3, 4, 6, 7, 8, 11, 15
def tensor(uid, dims, dtype=2):
    t = desc(TENSOR)
    strides, s = [], 1
    for d in reversed(dims):
        strides.insert(0, s); s *= d
    assert set_(t, 901, DTYPE, [dtype], ctypes.c_int) == 0          # DATA_TYPE
    assert set_(t, 902, INT64, dims, i64) == 0                      # DIMENSIONS
    assert set_(t, 903, INT64, strides, i64) == 0                   # STRIDES
    assert set_(t, 906, INT64, [uid], i64) == 0                     # UNIQUE_ID
    assert set_(t, 900, INT64, [16], i64) == 0                      # BYTE_ALIGNMENT
    assert dnn.cudnnBackendFinalize(t) == 0
    return t
def conv_graph(handle, x=(4, 3, 32, 32), w=(16, 3, 3, 3), y=(4, 16, 32, 32), dtype=2):
    c = desc(CONV)
    assert set_(c, 106, INT64, [2], i64) == 0                        # SPATIAL_DIMS
    assert set_(c, 100, DTYPE, [0], ctypes.c_int) == 0               # COMP_TYPE
    assert set_(c, 101, CONVMODE, [1], ctypes.c_int) == 0            # CROSS_CORRELATION
    for a in (102, 103, 104, 105):                                   # dilations, strides, pads
        assert set_(c, a, INT64, [1, 1], i64) == 0
    assert dnn.cudnnBackendFinalize(c) == 0
    op = desc(FWD)
    tx, tw, ty = tensor(1, list(x), dtype), tensor(2, list(w), dtype), tensor(3, list(y), dtype)
    for attr, d in ((704, tx), (703, tw), (705, ty), (702, c)):    # X, W, Y, CONV_DESC
        assert set_(op, attr, DESC, [d.value], vp) == 0
    assert set_(op, 700, FLOAT, [1.0], ctypes.c_float) == 0          # ALPHA
    assert set_(op, 701, FLOAT, [0.0], ctypes.c_float) == 0          # BETA
    assert dnn.cudnnBackendFinalize(op) == 0
    g = desc(GRAPH)
    assert set_(g, 800, HANDLE, [handle.value], vp) == 0
    assert set_(g, 801, DESC, [op.value], vp) == 0
    assert dnn.cudnnBackendFinalize(g) == 0
    return g
def heuristics(g, mode=0):
    h = desc(HEUR)
    assert set_(h, 200, HEURMODE, [mode], ctypes.c_int) == 0          # ENGINEHEUR_MODE
    assert set_(h, 201, DESC, [g.value], vp) == 0                     # ENGINEHEUR_OPERATION_GRAPH
    assert dnn.cudnnBackendFinalize(h) == 0
    n = i64()
    assert dnn.cudnnBackendGetAttribute(h, 202, DESC, 0, ctypes.byref(n), None) == 0
    cfgs = [desc(CFG) for _ in range(n.value)]
    arr = (vp * n.value)(*[c.value for c in cfgs])
    got = i64()
    assert dnn.cudnnBackendGetAttribute(h, 202, DESC, n.value, ctypes.byref(got), arr) == 0
    assert got.value == n.value
    return cfgs
def engine_of(cfg):
    e = desc(ENGINE)
    n = i64()
    assert dnn.cudnnBackendGetAttribute(cfg, 300, DESC, 1, ctypes.byref(n), ctypes.byref(e)) == 0
    index, notes, count = i64(), (ctypes.c_int * 8)(), i64()
    assert dnn.cudnnBackendGetAttribute(e, 1301, INT64, 1, None, ctypes.byref(index)) == 0      # GLOBAL_INDEX
    assert dnn.cudnnBackendGetAttribute(e, 1303, NOTE, 8, ctypes.byref(count), notes) == 0      # NUMERICAL_NOTE
    return index.value, sorted(notes[:count.value])
def plan(handle, cfg):
    p = desc(PLAN)
    assert set_(p, 400, HANDLE, [handle.value], vp) == 0
    assert set_(p, 401, DESC, [cfg.value], vp) == 0
    assert dnn.cudnnBackendFinalize(p) == 0
    ws = i64()
    assert dnn.cudnnBackendGetAttribute(p, 402, INT64, 1, None, ctypes.byref(ws)) == 0
    return p, ws.value
"""


def run(body, **env):
    r = subprocess.run([sys.executable, "-c", PRELUDE + textwrap.dedent(body)],
                       env={**os.environ, **env}, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout.split(), r.stderr


def test_kernel_attributes_as_an_h100_answers_them():
    out, _ = run("""
        a = FuncAttributes()
        assert rt.cudaFuncGetAttributes(ctypes.byref(a), vp(12345)) == 98  # no registered kernel
        f = register(b"my_kernel")
        assert rt.cudaFuncGetAttributes(ctypes.byref(a), vp(f)) == 0
        print(a.numRegs, a.ptxVersion, a.binaryVersion, a.maxThreadsPerBlock, a.maxDynamicSharedSizeBytes,
              a.sharedSizeBytes, a.preferredShmemCarveout)
        assert rt.cudaFuncSetAttribute(vp(f), 8, 100000) == 0          # MaxDynamicSharedMemorySize
        assert rt.cudaFuncSetAttribute(vp(f), 8, 232449) == 1          # past the 227 KiB opt-in: invalid value
        assert rt.cudaFuncSetAttribute(vp(f), 9, 101) == 1             # a carveout past 100 percent
        assert rt.cudaFuncSetAttribute(vp(f), 4, 64) == 1              # the binary's own: read-only
        assert rt.cudaFuncGetAttributes(ctypes.byref(a), vp(f)) == 0
        print(a.maxDynamicSharedSizeBytes)
        name = ctypes.c_char_p()
        assert rt.cudaFuncGetName(ctypes.byref(name), vp(f)) == 0
        print(name.value.decode())
        v = ctypes.c_int()
        assert drv.cuFuncGetAttribute(ctypes.byref(v), 8, vp(f)) == 0
        print(v.value)
        assert drv.cuFuncGetAttribute(ctypes.byref(v), 4, vp(777)) == 400  # the driver: invalid handle
    """)
    assert out == ["32", "90", "90", "1024", "49152", "0", "-1", "100000", "my_kernel", "100000"]


def test_occupancy_worked_out_from_an_h100s_limits():
    out, _ = run("""
        f = register(b"k")
        n = ctypes.c_int()
        def blocks(threads, shared):
            assert rt.cudaOccupancyMaxActiveBlocksPerMultiprocessor(ctypes.byref(n), vp(f), threads,
                                                                    ctypes.c_size_t(shared)) == 0
            return n.value
        # 256 threads: 8 warps, 64 a multiprocessor holds and their registers allow: 8 blocks.
        # 128 threads with 48 KiB each: 49152 + 1024 reserved, 4 in 228 KiB.
        # 60000 bytes is past the kernel's 48 KiB default: none.
        print(blocks(256, 0), blocks(128, 49152), blocks(128, 60000), blocks(2048, 0))
        grid, block = ctypes.c_int(), ctypes.c_int()
        assert drv.cuOccupancyMaxPotentialBlockSize(ctypes.byref(grid), ctypes.byref(block), vp(f), None,
                                                    ctypes.c_size_t(0), 0) == 0
        print(block.value, grid.value)
        s = ctypes.c_size_t()
        assert rt.cudaOccupancyAvailableDynamicSMemPerBlock(ctypes.byref(s), vp(f), 2, 256) == 0
        print(s.value)
    """)
    # 1024 threads reach 2048 a multiprocessor (2 blocks), as smaller blocks
    # do; the largest such is chosen; 2 x 132 multiprocessors fill the device.
    # Two blocks: 233472 / 2, less the 1 KiB each reserves.
    assert out == ["8", "4", "0", "0", "1024", "264", "115712"]


def test_cudnn_versions_handles_and_errors():
    out, _ = run("""
        print(dnn.cudnnGetVersion(), dnn.cudnnGetCudartVersion())
        h = vp()
        assert dnn.cudnnCreate(ctypes.byref(h)) == 0
        s = vp(99)
        assert dnn.cudnnSetStream(h, s) == 0
        got = vp()
        assert dnn.cudnnGetStream(h, ctypes.byref(got)) == 0 and got.value == 99
        assert dnn.cudnnDestroy(h) == 0
        assert dnn.cudnnDestroy(h) == 2000                 # destroyed: a bad parameter
        assert dnn.cudnnSetStream(h, s) == 2000
        print(dnn.cudnnGetErrorString(3000).decode().split()[0])
        # A call the simulation does not serve refuses, naming itself.
        assert dnn.cudnnMultiHeadAttnForward() == 3000
        print(last_error().split()[0])
    """)
    assert out == ["92600", "13000", "CUDNN_STATUS_NOT_SUPPORTED", "cudnnMultiHeadAttnForward"]
    out, _ = run("print(dnn.cudnnGetVersion())", RESERVOIR_SIMCUDA_CUDNN_VERSION="91900")
    assert out == ["91900"]


def test_a_convolution_through_the_backend_api():
    out, _ = run("""
        h = vp()
        assert dnn.cudnnCreate(ctypes.byref(h)) == 0
        g = conv_graph(h)
        count = i64()
        assert dnn.cudnnBackendGetAttribute(g, 802, INT64, 1, None, ctypes.byref(count)) == 0  # GLOBAL_COUNT
        cfgs = heuristics(g)
        print(count.value, len(cfgs), len(heuristics(g, mode=2)))   # instant, then the fallback list
        print([engine_of(c) for c in cfgs])
        p0, ws0 = plan(h, cfgs[0])
        p1, ws1 = plan(h, cfgs[1])
        print(ws0, ws1)
        pack = desc(PACK)
        x = ctypes.create_string_buffer(1 << 20)
        ptrs = (vp * 3)(*[ctypes.addressof(x)] * 3)
        uids = (i64 * 3)(1, 2, 3)
        assert dnn.cudnnBackendSetAttribute(pack, 1001, VOIDPTR, 3, ptrs) == 0   # DATA_POINTERS
        assert dnn.cudnnBackendSetAttribute(pack, 1000, INT64, 3, uids) == 0     # UNIQUE_IDS
        assert dnn.cudnnBackendFinalize(pack) == 0
        print(dnn.cudnnBackendExecute(h, p0, pack), last_error().split(":")[0])  # no workspace given
        print(dnn.cudnnBackendExecute(h, p1, pack))                 # a kernel: refused unless allowed
    """)
    # Tensor-core engine 0 (fp16: its note), CUDA-core engine 1; fp16 NCHW:
    # x 24576, w 864 -> 1024, y 131072 bytes into the workspace.
    assert out == ["2", "2", "1", "[(0,", "[0]),", "(1,", "[])]", "156672", "0", "2000", "cudnnBackendExecute", "3000"]
    out, _ = run("""
        h = vp()
        assert dnn.cudnnCreate(ctypes.byref(h)) == 0
        p, ws = plan(h, heuristics(conv_graph(h))[1])
        pack = desc(PACK)
        assert dnn.cudnnBackendFinalize(pack) == 0
        print(dnn.cudnnBackendExecute(h, p, pack))
    """, RESERVOIR_SIMCUDA_KERNELS="skip")
    assert out == ["0"]


def test_backend_misuse_is_refused_with_its_reason():
    out, _ = run("""
        t = desc(TENSOR)
        n = i64()
        print(dnn.cudnnBackendGetAttribute(t, 902, INT64, 0, ctypes.byref(n), None))   # not finalized
        print(set_(t, 902, 99, [1], i64))                                               # no such type
        print(dnn.cudnnBackendFinalize(t), last_error())                                # nothing set
        assert set_(t, 901, DTYPE, [2], ctypes.c_int) == 0
        assert set_(t, 902, INT64, [2, 3], i64) == 0
        assert set_(t, 903, INT64, [3], i64) == 0
        assert set_(t, 906, INT64, [7], i64) == 0
        print(dnn.cudnnBackendFinalize(t))                                              # 2 dims, 1 stride
        print(set_(desc(GRAPH), 801, DESC, [12345], vp))                                # no such descriptor
        assert dnn.cudnnBackendDestroyDescriptor(t) == 0
        print(dnn.cudnnBackendDestroyDescriptor(t))
    """)
    assert out[:3] == ["2004", "2010", "2000"]
    assert " ".join(out[3:-3]) == ("cudnnBackendFinalize: descriptor type 17, attribute 901 is required and was "
                                   "not set")
    assert out[-3:] == ["2000", "2000", "2000"]


def test_an_lstms_weight_space_is_laid_out_as_pytorch_checks_it():
    out, _ = run("""
        h, r, drop = vp(), vp(), vp()
        assert dnn.cudnnCreate(ctypes.byref(h)) == 0
        assert dnn.cudnnCreateRNNDescriptor(ctypes.byref(r)) == 0
        assert dnn.cudnnCreateDropoutDescriptor(ctypes.byref(drop)) == 0
        # LSTM, double bias, unidirectional, linear input, float, 32 -> 64, two layers.
        assert dnn.cudnnSetRNNDescriptor_v8(r, 0, 2, 2, 0, 0, 0, 0, 0, 32, 64, 64, 2, drop, 0) == 0
        size = ctypes.c_size_t()
        assert dnn.cudnnGetRNNWeightSpaceSize(h, r, ctypes.byref(size)) == 0
        print(size.value)
        space = ctypes.create_string_buffer(size.value)
        base = ctypes.addressof(space)
        md, bd = vp(), vp()
        assert dnn.cudnnCreateTensorDescriptor(ctypes.byref(md)) == 0
        assert dnn.cudnnCreateTensorDescriptor(ctypes.byref(bd)) == 0
        m, b = vp(), vp()
        dims, strides, nd, dt = (ctypes.c_int * 3)(), (ctypes.c_int * 3)(), ctypes.c_int(), ctypes.c_int()
        for layer, lin in ((0, 0), (0, 4), (0, 7), (1, 0)):
            assert dnn.cudnnGetRNNWeightParams(h, r, layer, size, space, lin, md, ctypes.byref(m), bd,
                                               ctypes.byref(b)) == 0
            assert dnn.cudnnGetTensorNdDescriptor(md, 3, ctypes.byref(dt), ctypes.byref(nd), dims, strides) == 0
            print((m.value - base) // 4, dims[1], dims[2], (b.value - base) // 4)
        print(dnn.cudnnGetRNNWeightParams(h, r, 2, size, space, 0, md, ctypes.byref(m), bd, ctypes.byref(b)))
    """)
    # Layer 0: W_ih 4 x (64 x 32), W_hh 4 x (64 x 64), 8 biases of 64: 25088
    # floats; layer 1: 4 x (64 x 64) twice and 8 biases: 33280.
    assert out == ["233472",
                   "0", "64", "32", "24576",
                   "8192", "64", "64", "24832",
                   "20480", "64", "64", "25024",
                   "25088", "64", "64", "57856",
                   "2000"]


def test_a_library_opening_the_runtime_by_path_gets_the_simulated_one():
    # As vLLM's CudaRTLibrary does (the path of the libcudart it finds
    # mapped), or a program naming the toolkit's or the driver's files: the
    # simulated library already loaded under that soname, never the file.
    out, _ = run("""
        mine = ctypes.CDLL("libcudart.so.13")
        for path in ("/opt/elsewhere/libcudart.so.13", "/opt/elsewhere/libcudart.so.13.2.86",
                     "/usr/lib/x86_64-linux-gnu/libcuda.so.580.95.05", "libcudnn.so.9", "libcublas.so"):
            lib = ctypes.CDLL(path)
            print(path.rsplit("/", 1)[-1], hasattr(lib, "cudaMalloc") and
                  ctypes.cast(lib.cudaMalloc, vp).value == ctypes.cast(mine.cudaMalloc, vp).value)
        print(ctypes.CDLL("/usr/lib/x86_64-linux-gnu/libcuda.so.580.95.05").reservoirSimCudaIsSimulated())
        for path in ("/opt/elsewhere/libcudart.so.12", "/opt/elsewhere/libcudnn_graph.so.9"):
            try:
                ctypes.CDLL(path)
                print("opened", path)
            except OSError:
                print("refused")
    """, LD_PRELOAD=os.path.join(SIMCUDA, "libcudart.so.13"))
    # Another CUDA's runtime and a library the simulation is not are the C
    # library's to open (here: no such files).
    assert out == ["libcudart.so.13", "True", "libcudart.so.13.2.86", "True", "libcuda.so.580.95.05", "False",
                   "libcudnn.so.9", "False", "libcublas.so", "False", "1", "refused", "refused"]
