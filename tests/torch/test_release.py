"""reservoir under the running PyTorch release, on the simulated CUDA
device: run under every release tested (ctest's torch_<release>_* tests;
`make test-releases` runs them all). Where reservoir's own allocator is
built for the release (RESERVOIR_EXPECT_OWN_ALLOCATOR=1), one program over
both pools, a MemPool and empty_cache(), in two processes (the native
allocator, then reservoir's library for this release), compared:
statistics, summary, addresses and the snapshot, with its history; where it
is not, use_as_allocator() refuses with what to do. Under every release, the
pluggable allocator (install_torch()) serves the program's memory.

The simulated device hands out host memory the operating system places, so
addresses are compared relative to the first allocation of each process.
"""
import json
import os
import re
import subprocess
import sys
import textwrap

import pytest
from scenarios import CAPTURE_REUSE, POOL_ALLOCATOR_PRELUDE, POOL_ALLOCATOR_STEPS

torch = pytest.importorskip("torch")

OWN = os.environ.get("RESERVOIR_EXPECT_OWN_ALLOCATOR", "1") == "1"
own_only = pytest.mark.skipif(not OWN, reason="no own allocator is built for this release: "
                              "test_without_a_library_use_as_allocator_is_refused_with_what_to_do runs instead")

PRELUDE = """
import json, os, sys
import torch
mode = sys.argv[1]
if mode != "native":
    import reservoir
    reservoir.use_as_allocator("")
MiB = 1 << 20
def emit(**kw):
    print("RESULT " + json.dumps(kw), flush=True)
"""


def run(mode, body, env=None):
    code = PRELUDE + textwrap.dedent(body)
    r = subprocess.run([sys.executable, "-W", "ignore", "-c", code, mode], capture_output=True, text=True,
                       timeout=300, env={**os.environ, **(env or {})})
    lines = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
    assert r.returncode == 0 and lines, f"{mode}: exit {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
    return json.loads(lines[-1][len("RESULT "):])


PROGRAM = """
torch.cuda.memory._record_memory_history(max_entries=100000)
sizes = [512, MiB, 3 * MiB, 7 * MiB + 123, 25 * MiB, 100, 64 * MiB, 1500, 11 * MiB]
ts = [torch.empty(s, dtype=torch.uint8, device="cuda") for s in sizes]
base = ts[0].data_ptr()
def rel(a):
    return a - base if a else 0
for i in (1, 3, 5):
    ts[i] = None
pool = torch.cuda.MemPool()
with torch.cuda.use_mem_pool(pool):
    pooled = [torch.empty(s, dtype=torch.uint8, device="cuda") for s in (700, 2 * MiB, 30 * MiB)]
more = [torch.empty(s, dtype=torch.uint8, device="cuda") for s in (2 * MiB, 6 * MiB, 200, 20 * MiB)]
ptrs = [rel(t.data_ptr()) for t in ts if t is not None] + [rel(t.data_ptr()) for t in pooled + more]
def segments(snap):
    return sorted([rel(g["address"]), g["total_size"], g["allocated_size"], g["active_size"],
                   g["requested_size"], g["segment_type"], list(g.get("segment_pool_id", (0, 0))),
                   [[b["size"], b["requested_size"], b["state"]] for b in g["blocks"]]]
                  for g in snap["segments"])
live = torch.cuda.memory._snapshot()
stats = torch.cuda.memory_stats()
summary = torch.cuda.memory_summary()
pool_reserved = pool.snapshot() if hasattr(pool, "snapshot") else None
pooled = None
del pool
ts = more = None
torch.cuda.empty_cache()
after_empty = torch.cuda.memory_stats()
final = torch.cuda.memory._snapshot()
trace = [[e["action"], rel(e["addr"]), e["size"]] for e in final["device_traces"][0]]
emit(ptrs=ptrs, segments=segments(live), stats=stats, summary=summary, after_empty=after_empty,
     final_segments=segments(final), trace=trace, settings=live.get("allocator_settings"),
     pool_segments=segments({"segments": pool_reserved}) if pool_reserved is not None else None,
     backend=torch.cuda.get_allocator_backend(), version=torch.__version__,
     library=reservoir.torch_hooks_path(torch.__version__) if mode != "native" else None)
"""


@own_only
def test_this_releases_library_decides_and_reports_as_the_releases_own_allocator():
    native = run("native", PROGRAM)
    ours = run("reservoir", PROGRAM)
    assert native["backend"] == "native" and ours["backend"] == "reservoir"
    # The library of this minor release (its newest patch built) was loaded.
    release = ".".join(torch.__version__.split("+")[0].split(".")[:2])
    assert os.path.basename(os.path.dirname(ours["library"])).startswith(f"torch-{release}."), ours["library"]
    assert ours["ptrs"] == native["ptrs"]
    assert ours["segments"] == native["segments"]
    # Both pools and the MemPool's own segments were used.
    types = {(s[5], tuple(s[6]) != (0, 0)) for s in native["segments"]}
    assert {("small", False), ("large", False), ("large", True)} <= types, types
    assert ours["pool_segments"] == native["pool_segments"]
    assert ours["stats"] == native["stats"]
    assert ours["summary"] == native["summary"]
    assert ours["settings"] == native["settings"]
    # empty_cache() after the pool went: every segment back, as natively.
    assert ours["after_empty"] == native["after_empty"]
    assert ours["final_segments"] == native["final_segments"] == []
    assert ours["after_empty"]["reserved_bytes.all.current"] == 0
    assert ours["trace"] == native["trace"]
    assert sum(1 for e in ours["trace"] if e[0] == "segment_free") == len(native["segments"])


@own_only
def test_a_patch_release_of_the_same_minor_gets_its_library_and_a_newer_release_is_refused():
    body = """
    import reservoir
    built = reservoir.torch_hook_releases()
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    torch.__version__ = f"{major}.{minor}.99+cu130"
    reservoir.use_as_allocator("")
    x = torch.empty(MiB, device="cuda")
    newer = f"{major}.{int(minor) + 1}.0"
    emit(built=built, backend=torch.cuda.get_allocator_backend(), path=reservoir.torch_hooks_path(newer),
         refusal=reservoir._no_library("use_as_allocator", "2.99.0"))
    """
    r = run("native", body)
    assert r["backend"] == "reservoir"
    assert r["refusal"].startswith("reservoir.use_as_allocator: PyTorch 2.99.0 is newer than every release")
    assert "reservoir.install_torch()" in r["refusal"]
    major, minor = torch.__version__.split(".")[:2]
    next_built = [b for b in r["built"] if b.startswith(f"{major}.{int(minor) + 1}.")]
    assert (r["path"] is None) == (not next_built), (r["path"], r["built"])


# scenarios.CAPTURE_REUSE with the setting made at run time.
CAPTURE_REUSE_RUN = """
torch.cuda.memory._set_allocator_settings("graph_capture_record_stream_reuse:True")
""" + CAPTURE_REUSE + """
emit(reused=reused, history=history, stats=torch.cuda.memory_stats())
"""


@own_only
@pytest.mark.skipif(tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) < (2, 9),
                    reason="graph_capture_record_stream_reuse is PyTorch 2.9's")
def test_a_capture_reuses_a_block_freed_after_record_stream_as_this_release_does():
    # This release's CUDA runtime's capture queries (12's _v2 calls or 13's
    # with edges): from 2.10 the block comes back once the capture stream
    # joined the side stream, not before; 2.9 (which adds empty nodes to the
    # capture as markers: cudaGraphAddEmptyNode) gives it back only when the
    # capture ends.
    kernels = {"RESERVOIR_SIMCUDA_KERNELS": "skip"}  # captured, never run
    native = run("native", CAPTURE_REUSE_RUN, kernels)
    ours = run("reservoir", CAPTURE_REUSE_RUN, kernels)
    release = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    assert native["reused"] == [False, False, release >= (2, 10), False]
    assert ours["reused"] == native["reused"]
    assert ours["history"] == native["history"]
    assert (["free_completed", 0, 3 * 2**20] in native["history"]) == (release >= (2, 10))
    assert ours["stats"] == native["stats"]


@own_only
@pytest.mark.skipif(not os.path.isfile(os.environ.get("RESERVOIR_TEST_POOL_ALLOCATOR", "")),
                    reason="RESERVOIR_TEST_POOL_ALLOCATOR (ctest sets it)")
def test_a_mempool_over_another_allocator_as_this_release_serves_it():
    # MemPool(allocator=...): the other allocator's calls in order, the
    # pool's segments and blocks and the statistics after each step, as this
    # release's own allocator has them (2.6 and 2.7 read the allocator from
    # the active pool; 2.8 to 2.10 get it with the pool; 2.11 and later
    # shared). tests/torch/test_pool_allocator.py has the rest.
    program = POOL_ALLOCATOR_PRELUDE + textwrap.dedent(POOL_ALLOCATOR_STEPS)
    native = run("native", program)
    ours = run("reservoir", program)
    assert ours == native
    assert native["steps"][0]["calls"] == f"a {2 << 20};a {20 << 20};a {26 << 20};"


@pytest.mark.skipif(OWN, reason="this release has its own allocator: the tests above run instead")
def test_without_a_library_use_as_allocator_is_refused_with_what_to_do():
    body = """
    import reservoir
    try:
        reservoir.use_as_allocator("")
        emit(error="")
    except RuntimeError as e:
        emit(error=str(e), built=reservoir.torch_hook_releases())
    """
    r = run("native", body)
    assert r["error"] == (
        f"reservoir.use_as_allocator: this package has no library for PyTorch {torch.__version__} "
        f"(built for: {', '.join(r['built'])}): use reservoir.install_torch() (the pluggable allocator: "
        "allocations and frees reach reservoir; torch.cuda.memory_stats(), snapshots and MemPool do not), "
        "or build reservoir against it (docs/integrations.md)")


PLUGGABLE = """
import reservoir
reservoir.install_torch("")
host = [torch.arange(n, dtype=torch.int32) % 251 for n in (100, 300000, 700000, 6000000)]
ts = [h.cuda() for h in host]
back_equal = all(torch.equal(t.cpu(), h) for t, h in zip(ts, host))
stats = reservoir.stats()
live = stats["allocated_bytes.all.current"]
ts = None
after_free = reservoir.stats()
torch.cuda.empty_cache()
after_torch_empty = reservoir.stats()["reserved_bytes.all.current"]
reservoir.empty_cache()
emit(back_equal=back_equal, live=live, freed=after_free["allocated_bytes.all.current"],
     reserved=after_free["reserved_bytes.all.current"], after_torch_empty=after_torch_empty,
     after_reservoir_empty=reservoir.stats()["reserved_bytes.all.current"],
     hooks=reservoir.torch_hooks_path(torch.__version__) is not None)
"""


def test_the_pluggable_allocator_serves_the_programs_memory():
    r = run("native", PLUGGABLE)
    assert r["back_equal"]
    # 400 B, 1.2 MB, 2.8 MB and 24 MB of int32, each rounded up to 512 B.
    assert r["live"] == sum(-(-4 * n // 512) * 512 for n in (100, 300000, 700000, 6000000))
    assert r["freed"] == 0 and r["reserved"] > 0
    assert r["hooks"] == OWN
    # With this release's library, torch.cuda.empty_cache() reaches reservoir;
    # through malloc and free alone it does not, and reservoir's own does.
    assert r["after_torch_empty"] == (0 if OWN else r["reserved"])
    assert r["after_reservoir_empty"] == 0


# ---- the interposer and the drop-in, under every release ----

SIMCUDA = os.environ["LD_PRELOAD"]  # this release's CUDA runtime, simulated
PRELOAD = os.environ["RESERVOIR_PRELOAD"]  # libreservoir_preload.so


def run_plain(code, preload=SIMCUDA):
    """`code` in a fresh interpreter with `preload` as LD_PRELOAD; its output's words."""
    r = subprocess.run([sys.executable, "-W", "ignore", "-c", textwrap.dedent(code)],
                       env={**os.environ, "LD_PRELOAD": preload}, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    return r.stdout.split()


def test_the_interposer_serves_this_releases_cudamalloc():
    # PyTorch's own allocator over the interposer: the runtime this release
    # was built with (13, 12 or 11) is the one the interposer answers for.
    code = """
        import ctypes, torch
        sim = ctypes.CDLL("libcuda.so.1")
        MiB = 1 << 20
        torch.cuda.init()
        before = sim.reservoirSimCudaCalls(b"cudaMalloc")
        for i in range(12):
            x = torch.empty(48 * MiB, dtype=torch.uint8, device="cuda")
            x.copy_(torch.full((48 * MiB,), i, dtype=torch.uint8))
            assert int(x[-1].item()) == i
            del x
            torch.cuda.empty_cache()  # PyTorch hands the segment back: cudaFree
        print(sim.reservoirSimCudaCalls(b"cudaMalloc") - before)
    """
    # Alone, PyTorch calls cudaMalloc each time; under the interposer
    # reservoir keeps what PyTorch frees, and the device sees one call.
    assert run_plain(code) == ["12"]
    assert run_plain(code, preload=PRELOAD + " " + SIMCUDA) == ["1"]


@pytest.mark.parametrize("through", ["in_process", "interposer"])
def test_the_drop_in_pauses_and_resumes_tagged_memory(through):
    # torch_memory_saver's calls on reservoir.memory_saver: in the process
    # (reservoir made PyTorch's allocator: its own under a release with a
    # library, else the pluggable one), or driving the interposer's tags.
    from scenarios import PAUSE_RESUME
    code = ("from reservoir.memory_saver import torch_memory_saver as tms\nimport torch\nMiB = 1 << 20\n"
            + textwrap.dedent(PAUSE_RESUME))
    preload = PRELOAD + " " + SIMCUDA if through == "interposer" else SIMCUDA
    # Each pause gives its tag's memory back to the device (MiB), addresses
    # and the backed-up bytes hold, and the device's free memory is as before.
    assert run_plain(code, preload=preload) == ["128", "64", "True", "True", "True", "True", "True", "True"]


KEYS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "allocator_keys.py")


def reservoir_settings():
    """reservoir's settings table (`reservoir settings`): each PyTorch key
    with the first release that knows it; reservoir's own keys left out."""
    out = subprocess.run([os.environ["RESERVOIR"], "settings"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    rows = {}
    for line in out.stdout.splitlines()[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        key, pytorch = cells[0].strip("`"), cells[3]
        if pytorch != "reservoir":
            rows[key] = tuple(int(x) for x in re.search(r"(\d+)\.(\d+)", pytorch).groups())
    return rows


def test_every_key_this_release_accepts_is_reservoirs_and_no_other():
    # The keys the release's own parser accepts, read from its libraries
    # (allocator_keys.py), against reservoir's table: the same set, each
    # from the release the table names.
    ours = reservoir_settings()
    r = subprocess.run([sys.executable, "-W", "ignore", KEYS, *ours], capture_output=True, text=True, timeout=300)
    lines = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
    assert r.returncode == 0 and lines, r.stdout[-2000:] + r.stderr[-3000:]
    found = json.loads(lines[-1][len("RESULT "):])
    theirs = set(found["keys"])
    release = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    unknown = sorted(theirs - set(ours))
    assert not unknown, f"PyTorch {torch.__version__} accepts keys reservoir does not know: {unknown}"
    expected = {k for k, since in ours.items() if since <= release}
    assert sorted(theirs) == sorted(expected), (
        f"PyTorch {torch.__version__} accepts {sorted(theirs - expected)} beyond reservoir's table and refuses "
        f"{sorted(expected - theirs)} that it names for this release")
    assert found["candidates"] > len(ours)  # the libraries' strings were read
