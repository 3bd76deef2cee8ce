"""Scripts run by more than one test, under reservoir's torch_memory_saver
drop-in and the real torch_memory_saver alike (`tms`, `torch` and `MiB` are
set before them)."""

# Two tags, one backed up: each pause frees exactly its tag's memory, the
# device's free memory rises by it, resume keeps addresses and bytes; a tag
# with no memory pauses as a no-op; pause()/resume() take every tag.
PAUSE_RESUME = """
    with tms.region(tag="weights", enable_cpu_backup=True):
        w = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")
    with tms.region(tag="kv"):
        kv = torch.empty(128 * MiB, dtype=torch.uint8, device="cuda")
    cpu = torch.arange(64 * MiB, dtype=torch.int64).to(torch.uint8)
    w.copy_(cpu)
    pw, pk = w.data_ptr(), kv.data_ptr()
    free0 = torch.cuda.mem_get_info()[0]
    tms.pause("kv")
    free1 = torch.cuda.mem_get_info()[0]
    tms.pause("weights")
    free2 = torch.cuda.mem_get_info()[0]
    tms.resume("weights")
    tms.resume("kv")
    print((free1 - free0) // MiB, (free2 - free1) // MiB, w.data_ptr() == pw, kv.data_ptr() == pk,
          torch.equal(w.cpu(), cpu), torch.cuda.mem_get_info()[0] == free0)
    tms.pause("nosuch")  # a tag with no memory: nothing to do, both ways
    tms.pause()
    tms.resume()
    print(torch.equal(w.cpu(), cpu), w.data_ptr() == pw, flush=True)
    import os
    os._exit(0)  # torch_memory_saver's torch mode fails at interpreter exit (frees outside a region)
"""

# An RL loop's memory around a captured graph: tags for the weights (backed
# up), the KV cache and the graph's private pool (backed up); each of 100
# rounds releases all three for training (which allocates untagged memory),
# resumes the weights, then the KV cache and the graph, and replays the
# graph, whose captured copies read the input and write into the graph's
# pool and the KV cache. Printed: the device memory each pause gives back
# (MiB), the replayed values, whether addresses and bytes held, and the
# growth of device and host memory over the rounds.
GRAPH_RL_LOOP = """
    import resource
    with tms.region(tag="weights", enable_cpu_backup=True):
        w = torch.empty(32 * MiB, dtype=torch.uint8, device="cuda")
    wbytes = torch.arange(32 * MiB, dtype=torch.int64).to(torch.uint8)
    w.copy_(wbytes)
    with tms.region(tag="kv_cache"):
        kv = torch.zeros(64 * MiB, dtype=torch.uint8, device="cuda")
    static_in = torch.zeros(4 * MiB, dtype=torch.uint8, device="cuda")
    side = torch.cuda.Stream()
    g = torch.cuda.CUDAGraph()
    with tms.cuda_graph(g, stream=side, tag="graph", enable_cpu_backup=True):
        out = torch.empty(4 * MiB, dtype=torch.uint8, device="cuda")
        out.copy_(static_in)
        kv[:4 * MiB].copy_(out)
        last = torch.empty(4 * MiB, dtype=torch.uint8, device="cuda")
        last.copy_(w[:4 * MiB])
    static_in.fill_(0) if False else static_in.copy_(torch.full((4 * MiB,), 5, dtype=torch.uint8))
    g.replay()
    torch.cuda.synchronize()
    first = [int(out[0]), int(kv[4 * MiB - 1]), torch.equal(last.cpu(), wbytes[:4 * MiB])]
    addresses = (w.data_ptr(), kv.data_ptr(), out.data_ptr(), last.data_ptr())
    freed, ok = [], True
    free_start = torch.cuda.mem_get_info()[0]
    rss = []
    for i in range(100):
        before = torch.cuda.mem_get_info()[0]
        tms.pause("kv_cache")
        tms.pause("graph")
        tms.pause("weights")
        paused = torch.cuda.mem_get_info()[0]
        if i == 0:
            freed.append((paused - before) // MiB)
        grad = torch.empty(96 * MiB, dtype=torch.uint8, device="cuda")  # training's memory
        del grad
        tms.resume("weights")
        tms.resume("kv_cache")
        tms.resume("graph")
        value = i % 250 + 1
        static_in.copy_(torch.full((4 * MiB,), value, dtype=torch.uint8))
        g.replay()
        torch.cuda.synchronize()
        ok = ok and int(out[123]) == value and int(kv[4 * MiB - 7]) == value
        ok = ok and (w.data_ptr(), kv.data_ptr(), out.data_ptr(), last.data_ptr()) == addresses
        if i in (9, 99):
            ok = ok and torch.equal(w.cpu(), wbytes) and torch.equal(last.cpu(), wbytes[:4 * MiB])
            rss.append(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
    torch.cuda.empty_cache()
    print(first[0], first[1], first[2], freed[0], ok, (free_start - torch.cuda.mem_get_info()[0]) // MiB,
          (rss[1] - rss[0]) // 1024 < 64, flush=True)
    import os
    os._exit(0)
"""

# CUDA graphs under one of three allocators (argv[1]: native, own: reservoir
# as PyTorch's own allocator, pluggable: reservoir's pluggable allocator),
# with the settings of PYTORCH_CUDA_ALLOC_CONF; record(name) keeps the pools'
# layout (pool ids, segment sizes and pools, block sizes and states, whether
# expandable) and the
# statistics, emit() prints them as one RESULT line.
GRAPHS_PRELUDE = """
import gc, json, os, sys
import torch
mode = sys.argv[1]
if mode == "own":
    import reservoir
    reservoir.use_as_allocator(os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""))
elif mode == "pluggable":
    import reservoir
    reservoir.install_torch(os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""))
MiB = 1 << 20
out = {}

def stats():
    s = reservoir.stats(0) if mode == "pluggable" else torch.cuda.memory_stats()
    kept = ("allocated_bytes", "reserved_bytes", "active_bytes", "segment", "allocation", "active",
            "inactive_split", "inactive_split_bytes", "requested_bytes")
    return {k: v for k, v in s.items() if k.split(".")[0] in kept}

def layout():
    segs = reservoir.snapshot(0)["segments"] if mode == "pluggable" else torch.cuda.memory_snapshot()
    segs = sorted(segs, key=lambda s: s["address"])
    return [[list(s["segment_pool_id"]), s["total_size"], s["segment_type"],
             [[b["size"], b["state"]] for b in s["blocks"]], s["is_expandable"]] for s in segs]

def record(name):
    torch.cuda.synchronize()
    out[name] = {"layout": layout(), "stats": stats()}

def emit():
    print("RESULT " + json.dumps(out), flush=True)
    # Every program ends here, without Python's finalization: PyTorch's
    # autograd threads (make_graphed_callables ran a backward) can abort a
    # finalizing interpreter ("terminate called without an active
    # exception", pytorch/pytorch#38228), under any allocator, after the
    # result is out.
    sys.stderr.flush()
    os._exit(0)
"""

# Capture, replay, a second graph in the first one's pool, a capture CUDA
# invalidates (a synchronize inside it), the graphs deleted, a graph of
# copies replayed with new input, make_graphed_callables.
# The first graph both programs capture: a kernel's output, a large and a
# small block, a temporary freed inside the capture.
FIRST_GRAPH = """
static_in = torch.ones(256 * 1024, device="cuda")
g1 = torch.cuda.CUDAGraph()
with torch.cuda.graph(g1):
    a = static_in * 2
    b = torch.empty(3 * MiB, dtype=torch.uint8, device="cuda")
    tmp = torch.empty(5 * MiB, dtype=torch.uint8, device="cuda")
    del tmp
    c = torch.empty(700, dtype=torch.uint8, device="cuda")
"""

GRAPHS = FIRST_GRAPH + """
record("captured")
g1.replay()
record("replayed")
g2 = torch.cuda.CUDAGraph()
with torch.cuda.graph(g2, pool=g1.pool()):
    d = torch.empty(2 * MiB, dtype=torch.uint8, device="cuda")
    e = a + 1
record("a second graph in the first one's pool")
g2.replay()
g1.replay()
g3 = torch.cuda.CUDAGraph()
try:
    with torch.cuda.graph(g3):
        f = torch.empty(MiB, dtype=torch.uint8, device="cuda")
        torch.cuda.synchronize()
    out["a synchronize in a capture"] = "no error"
except RuntimeError as err:
    out["a synchronize in a capture"] = str(err).splitlines()[0]
record("after the invalidated capture")
del g3, f
gc.collect()
del g1, g2, a, b, c, d, e
gc.collect()
torch.cuda.empty_cache()
record("graphs deleted")
# A graph of copies: the captured copy runs at each replay, not at capture.
src = torch.zeros(4 * MiB, dtype=torch.uint8, device="cuda")
dst = torch.zeros(4 * MiB, dtype=torch.uint8, device="cuda")
g4 = torch.cuda.CUDAGraph()
with torch.cuda.graph(g4):
    dst.copy_(src)
    scratch = torch.empty(MiB, dtype=torch.uint8, device="cuda")
    scratch.fill_(0)
src.copy_(torch.full((4 * MiB,), 7, dtype=torch.uint8))
out["before replay"] = int(dst.cpu()[123])
g4.replay()
out["after replay"] = int(dst.cpu()[123])
src.copy_(torch.full((4 * MiB,), 9, dtype=torch.uint8))
g4.replay()
out["after a second replay"] = int(dst.cpu()[123])
record("a graph of copies")
# make_graphed_callables: its warm-up, forward and backward graphs in one pool.
model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8)).cuda()
x = torch.randn(32, 64, device="cuda", requires_grad=True)
graphed = torch.cuda.make_graphed_callables(model, (x,))
y = graphed(x)
y.sum().backward()
record("make_graphed_callables")
# Autograd's thread frees in an order that varies from run to run: PyTorch's
# own allocator counts 30 splits one run and 31 the next. Kept: the current
# values and the layout.
out["make_graphed_callables"]["stats"] = {
    k: v for k, v in out["make_graphed_callables"]["stats"].items()
    if not k.startswith("inactive_split") or k.endswith(".current")}
emit()
"""


# pytorch/pytorch#189504: a 600 MiB segment split 400 + 200 MiB, the 400 MiB
# block freed while a side stream that used it is busy, the device filled,
# and a 400 MiB request. PyTorch's ladder waits for the pending free, asks
# only the device, and raises; the same request an instant later is served.
# reservoir's allocator (own, pluggable, the saver's drop-in) serves the first
# request from the block the wait freed; retry_searches_pool:False keeps
# PyTorch's ladder. Needs MiB, and RESERVOIR_SIMCUDA_KERNELS=skip (the side
# stream's sleep is a busy kernel).
PENDING_FREE = """
total = torch.cuda.mem_get_info()[1]
whole = torch.empty(600 * MiB, dtype=torch.uint8, device="cuda")
base = whole.data_ptr()
whole = None
front = torch.empty(400 * MiB, dtype=torch.uint8, device="cuda")
tail = torch.empty(200 * MiB, dtype=torch.uint8, device="cuda")
filler = torch.empty(torch.cuda.mem_get_info()[0] - 64 * MiB, dtype=torch.uint8, device="cuda")
side = torch.cuda.Stream()
with torch.cuda.stream(side):
    torch.cuda._sleep(200_000_000)  # about 0.1 s of device time on the side stream
front.record_stream(side)
front = None
outcome = []
for attempt in range(2):
    try:
        t = torch.empty(400 * MiB, dtype=torch.uint8, device="cuda")
        outcome.append(t.data_ptr() - base)
        break
    except torch.OutOfMemoryError:
        outcome.append("oom")
"""


# Fragmentation on a 1 GiB device (`torch` and `MiB` set before): two 400 MiB
# blocks freed (one segment of 800 MiB cached), twelve 60 MiB blocks carved
# from it of which every other one is kept: 440 MiB reserved but unused, in
# pieces of 60 MiB (the largest 100 MiB with the segment's tail), so a
# 500 MiB request (FRAGMENTED_REQUEST) finds no room, though 360 MiB is all
# that is in use. FRAGMENTATION_LINE: reservoir's first line at that error.
FRAGMENTING_STEPS = """
a = torch.empty(400 * MiB, dtype=torch.uint8, device="cuda")
b = torch.empty(400 * MiB, dtype=torch.uint8, device="cuda")
del a, b
ts = [torch.empty(60 * MiB, dtype=torch.uint8, device="cuda") for _ in range(12)]
keep = ts[::2]
del ts
"""
FRAGMENTED_REQUEST = 'torch.empty(500 * MiB, dtype=torch.uint8, device="cuda")'
FRAGMENTATION_LINE = ("reservoir: out of memory on a 500.00 MiB request: fragmentation: 440.00 MiB sat reserved "
                      "but unused, in pieces too small for it (the largest 100.00 MiB), and the device had "
                      "224.00 MiB free: this request would have fit without it; whether the rest of the step "
                      "fits is not known (it had not run).")


# A block freed during a capture after use on a side stream (record_stream):
# with graph_capture_record_stream_reuse:True (2.9 and later) PyTorch reuses
# it within the capture once the capture stream has waited on the side
# stream; before that join, on another stream, and without the setting, it
# waits for the capture to end. `reused` says which of the four requests
# after the free (before the join, on the side stream, after it, again) got
# the freed block; `history` is the history of the 3 MiB blocks and the
# large segments (addresses from the freed block's), when the block came
# back among it.
# RESERVOIR_SIMCUDA_KERNELS=skip: the kernels are captured, not run.
CAPTURE_REUSE = """
torch.cuda.memory._record_memory_history(max_entries=100000)
side = torch.cuda.Stream()
g = torch.cuda.CUDAGraph()
with torch.cuda.graph(g):
    cap = torch.cuda.current_stream()
    x = torch.empty(3 * MiB, dtype=torch.uint8, device="cuda")
    x.fill_(1)
    side.wait_stream(cap)
    with torch.cuda.stream(side):
        x.add_(1)
    x.record_stream(side)
    freed = x.data_ptr()
    del x
    y = torch.empty(3 * MiB, dtype=torch.uint8, device="cuda")
    with torch.cuda.stream(side):
        s = torch.empty(3 * MiB, dtype=torch.uint8, device="cuda")
    cap.wait_stream(side)
    z = torch.empty(3 * MiB, dtype=torch.uint8, device="cuda")
    w = torch.empty(3 * MiB, dtype=torch.uint8, device="cuda")
reused = [t.data_ptr() == freed for t in (y, s, z, w)]
trace = torch.cuda.memory._snapshot()["device_traces"][0]
history = [[e["action"], e["addr"] - freed, e["size"]] for e in trace
           if e["size"] == 3 * MiB or (e["action"] == "segment_alloc" and e["size"] >= 20 * MiB)]
"""


# torch.cuda.MemPool(allocator=...): the other allocator
# (tests/torch/lib/pool_allocator.c, RESERVOIR_TEST_POOL_ALLOCATOR) as a
# CUDAPluggableAllocator, its log of calls and counters, and a snapshot's
# segments as a comparable layout (addresses from `base`).
POOL_ALLOCATOR_PRELUDE = """
import ctypes, json, os
LIB = os.environ["RESERVOIR_TEST_POOL_ALLOCATOR"]
lib = ctypes.CDLL(LIB)
def calls():
    return ctypes.c_char_p(ctypes.addressof(ctypes.c_char.in_dll(lib, "calls"))).value.decode()
def counter(name):
    return ctypes.c_int.in_dll(lib, name).value
other = torch.cuda.memory.CUDAPluggableAllocator(LIB, "pool_alloc", "pool_free")
def emit(**kw):
    print("RESULT " + json.dumps(kw), flush=True)
def layout(segments, base):
    return sorted((s["address"] - base, s["total_size"], s["segment_type"],
                   [(b["size"], b["state"]) for b in s["blocks"]]) for s in segments)
"""

# Both pools of the MemPool, a split and its reuse, a block outside the pool,
# empty_cache with the pool alive, then the pool deleted.
POOL_ALLOCATOR_STEPS = """
pool = torch.cuda.MemPool(other.allocator())
with torch.cuda.use_mem_pool(pool):
    a = torch.empty(MiB, dtype=torch.uint8, device="cuda")       # the small pool: 2 MiB
    b = torch.empty(3 * MiB, dtype=torch.uint8, device="cuda")   # 20 MiB, split
    c = torch.empty(3 * MiB, dtype=torch.uint8, device="cuda")
    big = torch.empty(25 * MiB, dtype=torch.uint8, device="cuda")  # a segment of its own
base = a.data_ptr()
outside = torch.empty(3 * MiB, dtype=torch.uint8, device="cuda")  # PyTorch's own memory
steps = [dict(calls=calls(), stats=torch.cuda.memory_stats(),
              segments=layout(torch.cuda.memory_snapshot(), base))]
del b
with torch.cuda.use_mem_pool(pool):
    d = torch.empty(2 * MiB, dtype=torch.uint8, device="cuda")  # in b's place
steps.append(dict(d=d.data_ptr() - base, stats=torch.cuda.memory_stats(),
                  segments=layout(torch.cuda.memory_snapshot(), base)))
del a, c, d, big
torch.cuda.empty_cache()  # the pool is alive: its segments stay
steps.append(dict(calls=calls(), stats=torch.cuda.memory_stats()))
del pool
torch.cuda.empty_cache()
steps.append(dict(calls=calls(), frees=counter("free_calls"), stats=torch.cuda.memory_stats(),
                  segments=layout(torch.cuda.memory_snapshot(), base)))
emit(steps=steps, outside=outside.data_ptr() - base)
"""
