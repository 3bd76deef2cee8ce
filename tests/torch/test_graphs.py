"""CUDA graphs under the real PyTorch on the simulated device, which captures
as CUDA does (simcuda/graphs.cpp): PyTorch's own allocator, reservoir as
PyTorch's own allocator (use_as_allocator) and reservoir's pluggable
allocator (install_torch) run the same program, each in its own process,
and give the same private-pool segments, blocks and statistics after each
step: capture, replay, a second graph sharing the first one's pool,
make_graphed_callables, a graph captured into a MemPool, a capture that
CUDA invalidates, and the graphs deleted. Kernels are skipped
(RESERVOIR_SIMCUDA_KERNELS=skip); captured copies are real and run at each
replay.
"""
import json
import os
import subprocess
import sys
import textwrap

import pytest
from scenarios import CAPTURE_REUSE, FIRST_GRAPH, GRAPHS, GRAPHS_PRELUDE as PRELUDE

torch = pytest.importorskip("torch")
# The running release, (major, minor).
RELEASE = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])

def run(mode, body, env=None):
    full = {**os.environ, "RESERVOIR_SIMCUDA_KERNELS": "skip", **(env or {})}
    r = subprocess.run([sys.executable, "-W", "ignore", "-c", PRELUDE + textwrap.dedent(body), mode],
                       capture_output=True, text=True, timeout=300, env=full)
    lines = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
    assert r.returncode == 0 and lines, f"{mode}: exit {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
    return json.loads(lines[-1][len("RESULT "):])


def same_everywhere(body, modes=("native", "own", "pluggable"), env=None):
    results = {m: run(m, body, env) for m in modes}
    native = results["native"]
    for m in modes[1:]:
        for step in native:
            assert results[m].get(step) == native[step], f"{m} differs from PyTorch's allocator at {step!r}"
        assert set(results[m]) == set(native)
    return native


MiB = 1 << 20
EXPANDABLE = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}


def test_graph_pools_are_laid_out_as_under_pytorchs_allocator():
    got = same_everywhere(GRAPHS)
    # The steps did what they say (a check of the program, the same everywhere).
    pools = {tuple(s[0]) for s in got["captured"]["layout"]}
    assert pools == {(0, 0), (1, 0)}
    assert len(got["a second graph in the first one's pool"]["layout"]) == \
        len(got["captured"]["layout"]) + 1
    assert got["a synchronize in a capture"] == \
        "CUDA error: operation failed due to a previous error during capture"
    # The invalidated capture's pool: PyTorch 2.11 never releases it (its
    # capture did not end), 2.15 does.
    assert {tuple(s[0]) for s in got["graphs deleted"]["layout"]} == \
        ({(0, 0), (2, 0)} if RELEASE < (2, 15) else {(0, 0)})
    assert (got["before replay"], got["after replay"], got["after a second replay"]) == (0, 7, 9)


def test_graph_pools_under_expandable_segments():
    # PyTorch makes a private pool's memory expandable too (from 2.5): a
    # reservation per stream and pool, pages mapped as the capture asks.
    got = same_everywhere(GRAPHS, env=EXPANDABLE)
    captured = got["captured"]["layout"]
    assert {s[4] for s in captured} == {True}
    assert {tuple(s[0]) for s in captured} == {(0, 0), (1, 0)}
    assert sorted(s[1] for s in captured if tuple(s[0]) == (1, 0)) == [2 * 1024 * 1024, 20 * 1024 * 1024]
    assert {tuple(s[0]) for s in got["graphs deleted"]["layout"]} == \
        ({(0, 0), (2, 0)} if RELEASE < (2, 15) else {(0, 0)})


MEMPOOL = """
pool = torch.cuda.MemPool()
g = torch.cuda.CUDAGraph()
with torch.cuda.graph(g, pool=pool.id):
    a = torch.empty(3 * MiB, dtype=torch.uint8, device="cuda")
    b = torch.empty(100, dtype=torch.uint8, device="cuda")
out["pool id"] = list(pool.id)
record("captured into a MemPool")
with torch.cuda.use_mem_pool(pool):
    c = torch.empty(MiB, dtype=torch.uint8, device="cuda")
record("the same pool used eagerly")
g.replay()
del g, a, b, c
gc.collect()
torch.cuda.empty_cache()
record("graph deleted, pool alive")
del pool
gc.collect()
torch.cuda.empty_cache()
record("pool deleted")
emit()
"""


def test_a_graph_captured_into_a_mempool():
    # PyTorch 2.11 to 2.15 refuse a MemPool object while a pluggable
    # allocator is current: reservoir as PyTorch's own allocator only.
    got = same_everywhere(MEMPOOL, modes=("native", "own"))
    assert got["pool id"][0] == 0 and got["pool id"][1] > 0
    assert [s[0] for s in got["pool deleted"]["layout"]] == []


def test_a_mempool_under_expandable_segments():
    got = same_everywhere(MEMPOOL, modes=("native", "own"), env=EXPANDABLE)
    pool = got["pool id"]
    # The capture's stream and the eager one each have a reservation of the pool.
    assert [s[4] for s in got["the same pool used eagerly"]["layout"] if s[0] == pool] == [True] * 3
    assert [s[0] for s in got["pool deleted"]["layout"]] == []


FAULT = """
import ctypes
side = torch.cuda.Stream()
x = torch.ones(1024, device="cuda")
g = torch.cuda.CUDAGraph()
if os.environ.get("FAIL_NEXT"):  # the next use of this call from here fails
    ctypes.CDLL("libcuda.so.1").reservoirSimCudaFailAt(os.environ["FAIL_NEXT"].encode(), 1)
try:
    with torch.cuda.graph(g, stream=side):
        y = torch.empty(3 * MiB, dtype=torch.uint8, device="cuda")
    g.replay()
    out["graph"] = "ok"
except RuntimeError as err:
    out["graph"] = str(err).splitlines()[0]
record("after the failure")
g = None
gc.collect()
torch.cuda.empty_cache()
record("graph deleted")
g = torch.cuda.CUDAGraph()
with torch.cuda.graph(g, stream=side):
    z = torch.empty(MiB, dtype=torch.uint8, device="cuda")
g.replay()
record("a capture after")
emit()
"""


@pytest.mark.parametrize("call", ["cudaStreamBeginCapture", "cudaGraphInstantiateWithFlags", "cudaGraphLaunch"])
def test_a_failing_graph_call_leaves_both_allocators_alike(call):
    # An injected failure of a graph call PyTorch's capture depends on: the
    # same error, and the same pools after it, after the graph is deleted and
    # after a capture that works. (A failing cudaStreamGetCaptureInfo leaves
    # PyTorch's stream capturing for good, so nothing after it can be
    # compared; reservoir's own handling of a failing cudaStreamIsCapturing
    # is cuda_backend_test's.)
    got = same_everywhere(FAULT, modes=("native", "own"), env={"FAIL_NEXT": call})
    assert got["graph"] == "CUDA error: unknown error"


ROUTED_EMPTY_CACHE = """
x = torch.empty(3 * MiB, dtype=torch.uint8, device="cuda")
del x
pool = torch.cuda.MemPool()
with torch.cuda.use_mem_pool(pool):
    y = torch.empty(MiB, dtype=torch.uint8, device="cuda")
    torch.cuda.empty_cache()
    record("empty_cache inside use_mem_pool")
del y
torch.cuda.empty_cache()
record("empty_cache after")
emit()
"""


def test_empty_cache_while_a_pool_route_is_open_as_the_release_does():
    # While a capture or use_mem_pool routes allocations to a pool, PyTorch
    # before 2.15 leaves the default pools' cache in place; 2.15 empties it.
    got = same_everywhere(ROUTED_EMPTY_CACHE, modes=("native", "own"))
    kept = got["empty_cache inside use_mem_pool"]["stats"]["reserved_bytes.all.current"]
    assert kept == (20 * 2**20 + 2 * 2**20 if RELEASE < (2, 15) else 2 * 2**20)


RECORDED = """
torch.cuda.memory._record_memory_history(max_entries=1000000)
""" + FIRST_GRAPH + """
g1.replay()
g2 = torch.cuda.CUDAGraph()
with torch.cuda.graph(g2, pool=g1.pool()):
    d = torch.empty(2 * MiB, dtype=torch.uint8, device="cuda")
x = torch.empty(7 * MiB, dtype=torch.uint8, device="cuda")
del g1, g2, a, b, c, d
gc.collect()
torch.cuda.empty_cache()
pool = torch.cuda.MemPool()
with torch.cuda.use_mem_pool(pool):
    m = torch.empty(3 * MiB, dtype=torch.uint8, device="cuda")
    n = torch.empty(100, dtype=torch.uint8, device="cuda")
del m
g3 = torch.cuda.CUDAGraph()
with torch.cuda.graph(g3):
    e = torch.empty(MiB, dtype=torch.uint8, device="cuda")
torch.cuda.memory._dump_snapshot(os.environ["SNAPSHOT"])
emit()
"""


@pytest.mark.parametrize("settings", [{}, EXPANDABLE], ids=["default", "expandable"])
def test_verify_follows_the_private_pools_a_recording_names(tmp_path, settings):
    # PyTorch 2.15 records each event's pool (pool_id): reservoir verify
    # routes those allocations to their pools and agrees, final state and
    # all (under expandable segments too, a pool's pages mapped into its own
    # reservation where PyTorch mapped them). 2.11 does not record them:
    # where the replay then differs, verify says it cannot verify, and why.
    snapshot = tmp_path / "graphs.pickle"
    run("native", RECORDED, {"SNAPSHOT": str(snapshot), **settings})
    r = subprocess.run([os.environ["RESERVOIR"], "verify", str(snapshot)], capture_output=True, text=True,
                       timeout=300)
    if RELEASE >= (2, 15):
        assert r.returncode == 0, r.stdout + r.stderr
        assert "agrees" in r.stdout and "private pools" not in r.stdout, r.stdout
    else:
        assert r.returncode != 0
        assert "cannot verify" in r.stdout and "does not say which allocations" in r.stdout, \
            r.stdout + r.stderr


# scenarios.CAPTURE_REUSE, then the graph replayed and deleted.
RECORD_STREAM_REUSE = CAPTURE_REUSE + """
out["reused"] = reused
out["history"] = history
record("captured")
g.replay()
if os.environ.get("SNAPSHOT"):
    torch.cuda.memory._dump_snapshot(os.environ["SNAPSHOT"])
del g, y, z, w, s
gc.collect()
torch.cuda.empty_cache()
record("graph deleted")
emit()
"""
REUSE = {"PYTORCH_CUDA_ALLOC_CONF": "graph_capture_record_stream_reuse:True"}
# What training recipes that capture whole iterations set (Megatron's).
EXPANDABLE_REUSE = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True,graph_capture_record_stream_reuse:True"}


@pytest.mark.skipif(RELEASE < (2, 9), reason="graph_capture_record_stream_reuse is PyTorch 2.9's")
@pytest.mark.parametrize("settings", [REUSE, {}], ids=["reuse", "default"])
def test_a_block_freed_after_record_stream_in_a_capture(settings):
    got = same_everywhere(RECORD_STREAM_REUSE, modes=("native", "own"), env=settings)
    reused = bool(settings)
    assert got["reused"] == [False, False, reused, False]
    # The history, addresses from the freed block's (the capture pool's
    # first): the side stream's request gets a segment of its own (a
    # stream's blocks are its own).
    M = 3 * MiB
    start = [["segment_alloc", 0, 20 * MiB], ["alloc", 0, M], ["free_requested", 0, M], ["alloc", M, M],
             ["segment_alloc", 20 * MiB, 20 * MiB], ["alloc", 20 * MiB, M]]
    assert got["history"] == start + (
        [["free_completed", 0, M], ["alloc", 0, M], ["alloc", 2 * M, M]] if reused else
        [["alloc", 2 * M, M], ["alloc", 3 * M, M]])
    first = [s for s in got["captured"]["layout"] if s[0] == [1, 0]][0]
    assert first[3] == ([[M, "active_allocated"]] * 3 + [[11 * MiB, "inactive"]] if reused else
                        [[M, "active_pending_free"]] + [[M, "active_allocated"]] * 3 + [[8 * MiB, "inactive"]])


@pytest.mark.skipif(RELEASE < (2, 9), reason="graph_capture_record_stream_reuse is PyTorch 2.9's")
def test_a_block_freed_after_record_stream_in_a_capture_under_expandable_segments():
    # The pool's memory in expandable segments (a reservation per stream):
    # the same reuse, the same pages mapped, the same history.
    got = same_everywhere(RECORD_STREAM_REUSE, modes=("native", "own"), env=EXPANDABLE_REUSE)
    assert got["reused"] == [False, False, True, False]
    assert ["free_completed", 0, 3 * MiB] in got["history"]
    assert {s[4] for s in got["captured"]["layout"]} == {True}


@pytest.mark.skipif(RELEASE < (2, 15), reason="2.15 records each event's pool")
def test_verify_follows_a_capture_that_reused_a_block(tmp_path):
    snapshot = tmp_path / "reuse.pickle"
    run("native", RECORD_STREAM_REUSE, {"SNAPSHOT": str(snapshot), **REUSE})
    r = subprocess.run([os.environ["RESERVOIR"], "verify", str(snapshot)], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "agrees" in r.stdout, r.stdout
