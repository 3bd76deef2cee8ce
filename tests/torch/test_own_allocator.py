"""reservoir as PyTorch's own allocator (reservoir.use_as_allocator(): a
CUDAAllocator, as PyTorch's native caching allocator is) under the real
PyTorch on the simulated CUDA device, beside PyTorch's native allocator: the
same programs in two processes, compared.

The simulated device hands out host memory the operating system places, so
addresses are compared relative to the first allocation of each process.
"""
import json
import os
import subprocess
import sys
import textwrap

import pytest
from scenarios import PENDING_FREE

torch = pytest.importorskip("torch")

PRELUDE = """
import json, os, sys
import torch
mode = sys.argv[1]
if mode != "native":
    import reservoir
    reservoir.use_as_allocator("" if mode == "reservoir" else mode)
MiB = 1 << 20
def emit(**kw):
    print("RESULT " + json.dumps(kw), flush=True)
"""


def run(mode, body, env=None):
    code = PRELUDE + textwrap.dedent(body)
    r = subprocess.run([sys.executable, "-c", code, mode], capture_output=True, text=True, timeout=300,
                       env={**os.environ, **(env or {})})
    lines = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
    assert r.returncode == 0 and lines, f"{mode}: exit {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
    return json.loads(lines[-1][len("RESULT "):])


# Sizes of both pools, a split, frees that leave holes, reuse of the holes.
PROGRAM = """
sizes = [512, MiB, 3 * MiB, 7 * MiB + 123, 25 * MiB, 100, 64 * MiB, 1500, 11 * MiB]
ts = [torch.empty(s, dtype=torch.uint8, device="cuda") for s in sizes]
ptrs = [t.data_ptr() for t in ts]
for i in (1, 3, 5):
    ts[i] = None
more = [torch.empty(s, dtype=torch.uint8, device="cuda") for s in (2 * MiB, 6 * MiB, 200, 20 * MiB)]
ptrs += [t.data_ptr() for t in more]
stats = torch.cuda.memory_stats()
summary = torch.cuda.memory_summary()
ts = more = None
free_before = torch.cuda.mem_get_info()[0]
torch.cuda.empty_cache()
free_after = torch.cuda.mem_get_info()[0]
after_empty = torch.cuda.memory_stats()
torch.cuda.reset_peak_memory_stats()
after_reset = torch.cuda.memory_stats()
torch.cuda.reset_accumulated_memory_stats()
after_accumulated = torch.cuda.memory_stats()
emit(ptrs=[p - ptrs[0] for p in ptrs], stats=stats, summary=summary, after_empty=after_empty,
     released=free_after - free_before, after_reset=after_reset, after_accumulated=after_accumulated,
     backend=torch.cuda.get_allocator_backend())
"""


def test_the_same_statistics_addresses_and_summary_as_the_native_allocator():
    native = run("native", PROGRAM)
    ours = run("reservoir", PROGRAM)
    assert native["backend"] == "native" and ours["backend"] == "reservoir"
    assert ours["ptrs"] == native["ptrs"]
    assert ours["stats"] == native["stats"]
    assert ours["summary"] == native["summary"]
    assert ours["stats"]["reserved_bytes.all.current"] > 0
    # empty_cache() gives every cached segment back, as the native allocator does.
    assert ours["after_empty"] == native["after_empty"]
    assert ours["after_empty"]["reserved_bytes.all.current"] == 0
    assert ours["released"] == native["released"] == ours["stats"]["reserved_bytes.all.current"]
    assert ours["after_reset"] == native["after_reset"]
    assert ours["after_accumulated"] == native["after_accumulated"]
    assert ours["after_accumulated"]["allocation.all.allocated"] == 0


# Blocks freed between larger ones: the native policy keeps the holes, paging
# gives their pages back.
FRAGMENTING = """
keep = []
for step in range(12):
    big = torch.empty((40 + 3 * step) * MiB, dtype=torch.uint8, device="cuda")
    small = torch.empty((2 + step) * MiB, dtype=torch.uint8, device="cuda")
    keep.append(small)
    big = None
emit(reserved=torch.cuda.memory_stats()["reserved_bytes.all.peak"],
     allocated=torch.cuda.memory_stats()["allocated_bytes.all.current"])
"""


def test_policy_paging_reserves_less_on_a_fragmenting_program():
    native = run("native", FRAGMENTING)
    paging = run("policy:paging", FRAGMENTING)
    assert paging["allocated"] == native["allocated"]
    assert paging["reserved"] < native["reserved"], (paging, native)


def test_policy_native_paged_takes_pytorchs_decisions_and_never_reserves_more():
    # PyTorch's own allocator beside reservoir's native_paged: the same
    # statistics but for the reserved memory, which is never more.
    native = run("native", PROGRAM)
    paged = run("policy:native_paged", PROGRAM)
    assert paged["backend"] == "reservoir"
    differ = {k for k in native["stats"] if paged["stats"].get(k) != native["stats"][k]}
    assert all(k.startswith(("reserved_bytes", "num_device_")) for k in differ), sorted(differ)
    for key in ("reserved_bytes.all.current", "reserved_bytes.all.peak"):
        assert 0 < paged["stats"][key] <= native["stats"][key], key
    native = run("native", FRAGMENTING)
    paged = run("policy:native_paged", FRAGMENTING)
    assert paged["allocated"] == native["allocated"]
    assert paged["reserved"] <= native["reserved"], (paged, native)


def test_the_gpu_bundles_native_paged_check_runs_and_holds_the_bound_here():
    # tests/gpu/native_paged_check.py (the GPU bundle's native_paged step),
    # its allocations without kernels on the simulated device: both pairs of
    # runs make the same program, native_paged never above native at a call.
    script = os.path.join(os.path.dirname(__file__), "..", "gpu", "native_paged_check.py")
    r = subprocess.run([sys.executable, script, "--steps", "10", "--program", "allocations"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["check"] == "native_paged" and out["ok"] is True
    assert len(out["pairs"]) == 2
    for rules, pair in out["pairs"].items():
        assert pair["same_program"] and pair["calls"] == 404, (rules, pair)
        assert pair["calls_above_native"] == 0 and pair["most_above_native_bytes"] == 0, (rules, pair)
        assert 0 < pair["peak_reserved"]["native_paged"] <= pair["peak_reserved"]["native"], (rules, pair)


OOM = """
seen = []
torch._C._cuda_attach_out_of_memory_observer(lambda *args: seen.append(list(args)))
total = torch.cuda.mem_get_info()[1]
torch.cuda.set_per_process_memory_fraction(0.25)
fraction = torch.cuda.get_per_process_memory_fraction() if hasattr(torch.cuda, "get_per_process_memory_fraction") else None
ok = torch.empty(int(total * 0.1), dtype=torch.uint8, device="cuda")
try:
    torch.empty(int(total * 0.3), dtype=torch.uint8, device="cuda")
    kind, message = "none", ""
except torch.OutOfMemoryError as e:
    kind, message = "OutOfMemoryError", str(e)
emit(kind=kind, message=message, observed=[s[0] for s in seen], fraction=fraction,
     ooms=torch.cuda.memory_stats()["num_ooms"])
"""


def test_the_memory_fraction_is_enforced_with_pytorchs_error_and_the_observers_run():
    native = run("native", OOM)
    ours = run("reservoir", OOM)
    for r in (native, ours):
        assert r["kind"] == "OutOfMemoryError", r
        assert "CUDA out of memory. Tried to allocate" in r["message"], r["message"]
        assert r["observed"] == [0], r
        assert r["ooms"] == 1, r
    assert ours["fraction"] == native["fraction"]


MEMPOOL = """
pool = torch.cuda.MemPool()
with torch.cuda.use_mem_pool(pool):
    x = torch.empty(5 * MiB, dtype=torch.uint8, device="cuda")
y = torch.empty(5 * MiB, dtype=torch.uint8, device="cuda")
in_pool = torch.cuda.memory_stats()["allocated_bytes.all.current"]
x = None
del pool
emit(allocated=in_pool, apart=y.data_ptr() != 0)
"""


def test_a_mempool_allocates_apart_and_is_released():
    native = run("native", MEMPOOL)
    ours = run("reservoir", MEMPOOL)
    assert ours == native


HISTORY = """
import pickle
torch.cuda.memory._record_memory_history(max_entries=100000)
def step():
    a = torch.empty(3 * MiB, dtype=torch.uint8, device="cuda")
    b = torch.empty(700, dtype=torch.uint8, device="cuda")
    c = torch.empty(25 * MiB, dtype=torch.uint8, device="cuda")
    d = torch.empty(5 * MiB, dtype=torch.uint8, device="cuda")
    del a, d
    return b, c
keep = step()
torch.cuda.empty_cache()
path = os.environ["SNAPSHOT_PATH"] + "." + mode + ".pickle"
torch.cuda.memory._dump_snapshot(path)
snap = pickle.load(open(path, "rb"))
from torch.cuda import _memory_viz
pages = [len(_memory_viz.trace_plot(snap)), len(_memory_viz.segment_plot(snap))]
base = snap["device_traces"][0][0]["addr"]
def rel(a):
    return a - base if a else 0
trace = [[e["action"], rel(e["addr"]), e["size"],
          [(f["filename"], f["line"], f["name"]) for f in e.get("frames", [])
           if f["filename"] == "<string>" or f["filename"].endswith(".py")]]
         for e in snap["device_traces"][0]]
segments = [[rel(g["address"]), g["total_size"], g["allocated_size"], g["active_size"], g["requested_size"],
             g["segment_type"], [[b["size"], b["requested_size"], b["state"]] for b in g["blocks"]]]
            for g in snap["segments"]]
emit(trace=trace, segments=segments, settings=snap["allocator_settings"], pages=pages, path=path)
"""


def test_history_and_snapshot_as_pytorch_records_them_read_by_memory_viz_and_verified(tmp_path):
    env = {"SNAPSHOT_PATH": str(tmp_path / "snap")}
    native = run("native", HISTORY, env)
    ours = run("reservoir", HISTORY, env)
    assert ours["segments"] == native["segments"]
    assert ours["settings"] == native["settings"]
    assert min(ours["pages"]) > 1000
    assert [e[:3] for e in ours["trace"]] == [e[:3] for e in native["trace"]]
    # The program's frames on every entry, segment releases included (the
    # empty_cache() call they happened in).
    for mine, theirs in zip(ours["trace"], native["trace"]):
        assert mine[3] == theirs[3] and mine[3], (mine, theirs)
    assert any(e[0] == "segment_free" for e in ours["trace"])
    verify = subprocess.run([os.environ["RESERVOIR"], "verify", ours["path"]], capture_output=True, text=True)
    assert verify.returncode == 0 and "agrees with the recording" in verify.stdout, verify.stdout + verify.stderr


# cuDNN's benchmark mode asks cacheInfo for the largest cached block; IPC and
# others ask getBaseAllocation for a block's segment. No Python binding
# reaches them: the hooks library's test helpers ask the current allocator.
CACHE_INFO = """
import ctypes
lib = ctypes.CDLL(reservoir.torch_hooks_path(torch.__version__)) if mode != "native" else None
if lib is None:
    import reservoir as r
    lib = ctypes.CDLL(r.torch_hooks_path(torch.__version__))
lib.reservoir_torch_current_cache_info.restype = ctypes.c_longlong
lib.reservoir_torch_current_cache_info.argtypes = [ctypes.c_int, ctypes.c_ulonglong]
lib.reservoir_torch_current_base_allocation.restype = ctypes.c_void_p
lib.reservoir_torch_current_base_allocation.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_ulonglong)]
a = torch.empty(30 * MiB, dtype=torch.uint8, device="cuda")
b = torch.empty(12 * MiB, dtype=torch.uint8, device="cuda")
c = torch.empty(3 * MiB, dtype=torch.uint8, device="cuda")
inner = c.data_ptr()
a = None  # a 30 MiB block cached free
size = ctypes.c_ulonglong(0)
base = lib.reservoir_torch_current_base_allocation(inner, ctypes.byref(size))
emit(from_one=lib.reservoir_torch_current_cache_info(0, 1),
     from_zero_at_least_free=lib.reservoir_torch_current_cache_info(0, 0) >= torch.cuda.mem_get_info()[0],
     base_offset=inner - base, base_size=size.value)
"""


def test_cache_info_and_base_allocation_answer_as_the_native_allocator_does():
    native = run("native", CACHE_INFO)
    ours = run("reservoir", CACHE_INFO)
    assert ours == native
    assert ours["from_one"] == 30 * (1 << 20) and ours["from_zero_at_least_free"]


def test_a_release_newer_than_every_library_is_refused_with_what_to_do():
    body = """
    import reservoir
    real = torch.__version__
    torch.__version__ = "2.99.0"
    try:
        reservoir.use_as_allocator("")
        emit(error="")
    except RuntimeError as e:
        emit(error=str(e))
    """
    r = run("native", body)
    assert r["error"].startswith("reservoir.use_as_allocator: PyTorch 2.99.0 is newer than every release "
                                 "this package was built for ("), r
    assert "reservoir.install_torch() (the pluggable allocator" in r["error"], r


def run_with_environment(value, body, extra_env=None):
    """A program that never names reservoir: RESERVOIR_TORCH_ALLOCATOR and
    the .pth beside the package (read here by site.addsitedir, as Python
    reads site-packages at start-up) install it when torch is imported."""
    import reservoir
    site_dir = os.path.dirname(os.path.dirname(os.path.abspath(reservoir.__file__)))
    code = (f"import site; site.addsitedir({site_dir!r})\n" + PRELUDE.replace('mode = sys.argv[1]', 'mode = "native"')
            + textwrap.dedent(body))
    env = {**os.environ, "RESERVOIR_TORCH_ALLOCATOR": value, **(extra_env or {})}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)


def result_of(r):
    lines = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
    assert r.returncode == 0 and lines, f"exit {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
    return json.loads(lines[-1][len("RESULT "):])


def test_an_environment_variable_installs_it_in_a_program_that_never_names_reservoir():
    assert os.path.isfile(os.path.join(os.path.dirname(os.path.dirname(
        os.path.abspath(__import__("reservoir").__file__))), "reservoir_autoinstall.pth"))
    explicit = run("reservoir", PROGRAM)
    own = result_of(run_with_environment("own", PROGRAM, {"RESERVOIR_ALLOC_CONF": ""}))
    assert own["backend"] == "reservoir"
    assert own["ptrs"] == explicit["ptrs"] and own["stats"] == explicit["stats"]
    # The settings come from RESERVOIR_ALLOC_CONF, as for use_as_allocator().
    paging = result_of(run_with_environment(
        "own", "x = torch.empty(100, device='cuda')\n"
        "emit(settings=torch.cuda.memory._snapshot()['allocator_settings']['PYTORCH_CUDA_ALLOC_CONF'], "
        "backend=torch.cuda.get_allocator_backend())", {"RESERVOIR_ALLOC_CONF": "policy:paging"}))
    assert paging == {"backend": "reservoir", "settings": "policy:paging"}
    pluggable = result_of(run_with_environment("pluggable", "x = torch.empty(10, device='cuda')\n"
                                               "emit(backend=torch.cuda.get_allocator_backend())"))
    assert pluggable["backend"] == "pluggable"
    # A value it does not know stops the program at `import torch`, saying why.
    bad = run_with_environment("paging", "emit(backend=torch.cuda.get_allocator_backend())")
    assert bad.returncode != 0 and "RESERVOIR_TORCH_ALLOCATOR='paging': expected one of own, pluggable" \
        in bad.stderr, bad.stderr[-2000:]


# A trace tracker (what NCCL's memory registration attaches) sees every event
# as it happens: the same actions, sizes and relative addresses as under the
# native allocator, segments included.
TRACKER = """
import ctypes
import reservoir as r
lib = ctypes.CDLL(r.torch_hooks_path(torch.__version__))
lib.reservoir_torch_current_trace_tracker_take.restype = ctypes.c_void_p
torch.empty(1, device="cuda")  # the allocator initialised
assert lib.reservoir_torch_current_trace_tracker_start() == 0
sizes = [512, 3 * MiB, 25 * MiB, 100, 7 * MiB]
ts = [torch.empty(s, dtype=torch.uint8, device="cuda") for s in sizes]
ts[1] = ts[3] = None
more = torch.empty(2 * MiB, dtype=torch.uint8, device="cuda")
ts = more = None
torch.cuda.empty_cache()
raw = lib.reservoir_torch_current_trace_tracker_take()
events = json.loads(ctypes.string_at(raw).decode())
base = next(e[1] for e in events if e[0] == "alloc")
emit(events=[[e[0], e[1] - base, e[2]] for e in events])
"""


def test_a_trace_tracker_sees_what_it_sees_under_the_native_allocator():
    native = run("native", TRACKER)
    ours = run("reservoir", TRACKER)
    assert ours["events"] == native["events"]
    actions = [e[0] for e in ours["events"]]
    assert actions.count("alloc") == 6 and actions.count("segment_alloc") == 2
    assert "segment_free" in actions and "free_completed" in actions


# History's annotations (record_function with global_record_annotations) and
# user metadata (_set_memory_metadata) reach _snapshot() as the native
# allocator writes them.
ANNOTATED = """
torch.cuda.memory._record_memory_history(max_entries=10000, global_record_annotations=True)
enabled = torch._C._cuda_isHistoryEnabled() if hasattr(torch._C, "_cuda_isHistoryEnabled") else None
with torch.profiler.record_function("phase one"):
    a = torch.empty(3 * MiB, dtype=torch.uint8, device="cuda")
torch.cuda.memory._set_memory_metadata("step two")
metadata = torch.cuda.memory._get_memory_metadata()
b = torch.empty(5 * MiB, dtype=torch.uint8, device="cuda")
a = None
snap = torch.cuda.memory._snapshot()
torch.cuda.memory._record_memory_history(enabled=None)
trace = snap["device_traces"][0]
skip = ("time_us", "frames", "addr", "stream")
emit(enabled=enabled, metadata=metadata,
     annotations=[{k: v for k, v in x.items() if k != "time_us"} for x in snap.get("external_annotations", [])],
     trace=[{k: v for k, v in e.items() if k not in skip} for e in trace])
"""


def test_annotations_and_user_metadata_reach_the_snapshot_as_under_the_native_allocator():
    native = run("native", ANNOTATED)
    ours = run("reservoir", ANNOTATED)
    assert ours == native
    assert ours["metadata"] == "step two"
    assert any(x.get("name") == "phase one" for x in ours["annotations"]), ours["annotations"]
    assert any(e.get("user_metadata") == "step two" for e in ours["trace"]), ours["trace"]


# PyTorch 2.15 on: an "annotate" entry for a live tensor, in time order.
ANNOTATE_TENSOR = """
torch.cuda.memory._record_memory_history(max_entries=10000)
a = torch.empty(3 * MiB, dtype=torch.uint8, device="cuda")
torch.cuda.memory._annotate_tensor(a, "weights")
b = torch.empty(5 * MiB, dtype=torch.uint8, device="cuda")
snap = torch.cuda.memory._snapshot()
torch.cuda.memory._record_memory_history(enabled=None)
skip = ("time_us", "frames", "addr", "stream")
emit(supported=torch._C._cuda_memoryMetadataSupported(),
     trace=[{k: v for k, v in e.items() if k not in skip} for e in snap["device_traces"][0]])
"""


@pytest.mark.skipif(not hasattr(torch.cuda.memory, "_annotate_tensor"), reason="PyTorch 2.15 on")
def test_a_tensor_annotation_is_an_entry_of_the_trace_as_under_the_native_allocator():
    native = run("native", ANNOTATE_TENSOR)
    ours = run("reservoir", ANNOTATE_TENSOR)
    assert ours == native
    assert ours["supported"] is True
    assert [e["action"] for e in ours["trace"]][-3:] == ["alloc", "annotate", "alloc"], ours["trace"]
    assert ours["trace"][-2]["user_metadata"] == "weights"


def test_with_allocation_contexts_only_frees_carry_the_allocation_frames_and_releases_none(tmp_path):
    body = HISTORY.replace("_record_memory_history(max_entries=100000)",
                           "_record_memory_history(context='alloc', max_entries=100000)")
    env = {"SNAPSHOT_PATH": str(tmp_path / "snap")}
    native = run("native", body, env)
    ours = run("reservoir", body, env)
    assert ours["trace"] == native["trace"]
    releases = [e for e in ours["trace"] if e[0] == "segment_free"]
    frees = [e for e in ours["trace"] if e[0] == "free_requested"]
    assert releases and not any(e[3] for e in releases)
    assert frees and all(e[3] for e in frees)


# torch.multiprocessing's CUDA tensors: PyTorch's handle format both ways, so
# a process under PyTorch's native allocator opens what reservoir shares and
# the other way round. The tensor lies 2 MiB into its segment; the child
# reads what the parent wrote and writes where the parent reads.
IPC_PROGRAM = """
import json, sys
import torch
import torch.multiprocessing as mp
MiB = 1 << 20

def install(mode):
    if mode != "native":
        import reservoir
        reservoir.use_as_allocator("" if mode == "reservoir" else mode)

def child(mode, queue, done):
    install(mode)
    x = queue.get()
    seen = bool((x.cpu() == 7).all()) and x.numel() == 3 * MiB
    x[1000:2000].copy_(torch.full((1000,), 9, dtype=torch.uint8))
    torch.cuda.synchronize()
    done.put((seen, torch.cuda.get_allocator_backend()))
    del x

if __name__ == "__main__":
    parent_mode, child_mode = sys.argv[1:3]
    install(parent_mode)
    first = torch.empty(2 * MiB, dtype=torch.uint8, device="cuda")  # the same 20 MiB segment
    x = torch.empty(3 * MiB, dtype=torch.uint8, device="cuda")
    x.copy_(torch.full((3 * MiB,), 7, dtype=torch.uint8))
    try:
        handle = x.untyped_storage()._share_cuda_()
    except RuntimeError as e:
        print("RESULT " + json.dumps({"error": str(e)}), flush=True)
        sys.exit(0)
    ctx = mp.get_context("spawn")
    queue, done = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=child, args=(child_mode, queue, done))
    p.start()
    queue.put(x)
    seen, backend = done.get(timeout=240)
    p.join(timeout=60)
    written = x.cpu()
    print("RESULT " + json.dumps({
        "seen": seen, "child_backend": backend, "exit": p.exitcode, "offset": handle[3],
        "parent_backend": torch.cuda.get_allocator_backend(), "version": handle[1][0], "type": chr(handle[1][1]),
        "written": bool((written[1000:2000] == 9).all()) and bool((written[:1000] == 7).all())}), flush=True)
"""


@pytest.mark.parametrize("parent,child", [("reservoir", "native"), ("native", "reservoir"),
                                          ("reservoir", "reservoir")])
def test_cuda_tensors_shared_between_processes_in_pytorchs_handle_format(parent, child, tmp_path):
    script = tmp_path / "ipc.py"
    script.write_text(IPC_PROGRAM)
    r = subprocess.run([sys.executable, str(script), parent, child], capture_output=True, text=True, timeout=400)
    lines = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
    assert r.returncode == 0 and lines, f"exit {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
    out = json.loads(lines[-1][len("RESULT "):])
    version = 3 if tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 13) else 2
    assert out == {"seen": True, "written": True, "exit": 0, "offset": 2 << 20, "version": version, "type": "c",
                   "parent_backend": "native" if parent == "native" else "reservoir",
                   "child_backend": "native" if child == "native" else "reservoir"}


def test_sharing_under_paging_says_it_needs_the_native_policy(tmp_path):
    script = tmp_path / "ipc.py"
    script.write_text(IPC_PROGRAM)
    r = subprocess.run([sys.executable, str(script), "policy:paging", "native"], capture_output=True, text=True,
                       timeout=400)
    lines = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
    assert r.returncode == 0 and lines, f"exit {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
    error = json.loads(lines[-1][len("RESULT "):])["error"]
    assert "shareIpcHandle" in error and "need reservoir's native policy" in error, error


# getExpandableSegmentSizes (no Python binding: the hooks library's helper
# asks the current allocator): per stream and pool, the memory mapped into
# its expandable segment, as PyTorch's allocator reports it (not the default
# stream's).
EXPANDABLE_SIZES = """
import ctypes
import reservoir as r
lib = ctypes.CDLL(r.torch_hooks_path(torch.__version__))
lib.reservoir_torch_current_expandable_segment_sizes.restype = ctypes.c_void_p
side = torch.cuda.Stream()
ts = [torch.empty(s, dtype=torch.uint8, device="cuda") for s in (700, 3 * MiB, 45 * MiB, 5000)]
with torch.cuda.stream(side):
    ts.append(torch.empty(30 * MiB, dtype=torch.uint8, device="cuda"))
    ts.append(torch.empty(900, dtype=torch.uint8, device="cuda"))
ts[2] = None
raw = lib.reservoir_torch_current_expandable_segment_sizes(0)
sizes = json.loads(ctypes.string_at(raw).decode())
default = torch.cuda.current_stream().cuda_stream
emit(sizes=sorted([s[0] == default, s[1], s[2]] for s in sizes))
"""


def test_expandable_segment_sizes_per_stream_as_the_native_allocator_reports_them():
    native = run("native", EXPANDABLE_SIZES, env={"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"})
    ours = run("expandable_segments:True", EXPANDABLE_SIZES)
    assert ours["sizes"] == native["sizes"] == [[False, False, 40 << 20], [False, True, 2 << 20]], (ours, native)


# MemPool(use_on_oom=True): when the default pools run out (here against a
# memory fraction), a free block of the pool serves the request; and
# MemPool(no_split=True): the pool's blocks are handed out whole. The same
# addresses and statistics as PyTorch's allocator.
MEMPOOL_OPTIONS = """
total = torch.cuda.get_device_properties(0).total_memory
torch.cuda.set_per_process_memory_fraction(61 * MiB / total)
lender = torch.cuda.MemPool(use_on_oom=True)
with torch.cuda.use_mem_pool(lender):
    a = torch.empty(20 * MiB, dtype=torch.uint8, device="cuda")
base = a.data_ptr()
a = None
b = torch.empty(20 * MiB, dtype=torch.uint8, device="cuda")
c = torch.empty(20 * MiB, dtype=torch.uint8, device="cuda")
try:
    d = torch.empty(12 * MiB, dtype=torch.uint8, device="cuda")
    borrowed = d.data_ptr() - base
except torch.OutOfMemoryError:
    borrowed = "out of memory"
after_borrow = torch.cuda.memory_stats()
d = b = c = None
torch.cuda.set_per_process_memory_fraction(1.0)
whole = torch.cuda.MemPool(no_split=True)
with torch.cuda.use_mem_pool(whole):
    xs = [torch.empty(s, dtype=torch.uint8, device="cuda") for s in (3 * MiB, 3 * MiB, 4096)]
emit(borrowed=borrowed, after_borrow=after_borrow, whole=[x.data_ptr() - base for x in xs],
     after_whole=torch.cuda.memory_stats())
"""


MiB = 1 << 20


def test_mempool_use_on_oom_and_no_split_as_under_the_native_allocator():
    native = run("native", MEMPOOL_OPTIONS)
    ours = run("reservoir", MEMPOOL_OPTIONS)
    assert ours == native  # PyTorch 2.15's per-pool keys included
    assert ours["borrowed"] == 0  # the pool's cached block
    # Whole blocks: two 20 MiB segments and a 2 MiB one, for 6 MiB and 4 KiB asked.
    assert ours["after_whole"]["allocated_bytes.all.current"] == 2 * 20 * MiB + 2 * MiB
    assert ours["after_whole"]["requested_bytes.all.current"] == 6 * MiB + 4096


# The running release's decisions: of two free blocks of equal size, PyTorch
# 2.12 and later take the one whose segment was made first, before the one
# at the lowest address. The library built for the release says which it is.
SEGMENT_AGE = """
a = torch.empty(12 * MiB, dtype=torch.uint8, device="cuda")
x = a.data_ptr()
b = torch.empty(12 * MiB, dtype=torch.uint8, device="cuda")  # a second 12 MiB segment, above
a = None
torch.cuda.empty_cache()  # the first segment goes
c = torch.empty(12 * MiB, dtype=torch.uint8, device="cuda")  # a newer segment, where the first was
b = c = None
d = torch.empty(12 * MiB, dtype=torch.uint8, device="cuda")
emit(taken=d.data_ptr() - x)
"""


def test_the_running_release_decides_as_pytorchs_allocator_of_that_release():
    native = run("native", SEGMENT_AGE)
    ours = run("reservoir", SEGMENT_AGE)
    assert ours == native
    newer = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 12)
    assert ours["taken"] == (12 * MiB if newer else 0)  # the older segment, above; or the lower
    # A configuration naming a release keeps it.
    assert run("pytorch_version:2.11", SEGMENT_AGE)["taken"] == 0


# What CUDA graph trees ask of a pool (checkPoolLiveAllocations) and whether
# history is on (isHistoryEnabled), through PyTorch's own bindings.
POOL_CHECKS = """
pool = torch.cuda.MemPool()
with torch.cuda.use_mem_pool(pool):
    xs = [torch.empty(s, dtype=torch.uint8, device="cuda") for s in (3 * MiB, 700, 5 * MiB)]
outside = torch.empty(MiB, dtype=torch.uint8, device="cuda")
ptrs = {x.data_ptr() for x in xs}
check = lambda expected: torch._C._cuda_checkPoolLiveAllocations(0, pool.id, expected)
answers = [check(ptrs), check(ptrs - {xs[0].data_ptr()}), check(ptrs | {outside.data_ptr()}), check(set())]
xs[1] = None
answers.append(check({xs[0].data_ptr(), xs[2].data_ptr()}))
before = torch._C._cuda_isHistoryEnabled()
torch.cuda.memory._record_memory_history(max_entries=10)
during = torch._C._cuda_isHistoryEnabled()
torch.cuda.memory._record_memory_history(enabled=None)
emit(answers=answers, history=[before, during, torch._C._cuda_isHistoryEnabled()])
"""


def test_pool_live_allocation_checks_and_history_state_as_under_the_native_allocator():
    native = run("native", POOL_CHECKS)
    ours = run("reservoir", POOL_CHECKS)
    assert ours == native
    assert ours == {"answers": [True, False, False, False, True], "history": [False, True, False]}


# PyTorch 2.15 reports each private pool's reserved bytes from its first
# segment on, keeps them once the pool is gone (current 0) and resets them
# with the rest; 2.11 has no such keys.
POOL_STATS = """
def pools():
    return {k: v for k, v in torch.cuda.memory_stats().items() if k.startswith("reserved_bytes_by_private_pools.")}
torch.empty(1, device="cuda")
p = torch.cuda.MemPool()
seen = [pools()]
with torch.cuda.use_mem_pool(p):
    x = torch.empty(3 * MiB, dtype=torch.uint8, device="cuda")
    y = torch.empty(700, dtype=torch.uint8, device="cuda")
seen.append(pools())
x = y = None
del p
torch.cuda.empty_cache()
seen.append(pools())
torch.cuda.reset_peak_memory_stats()
seen.append(pools())
torch.cuda.reset_accumulated_memory_stats()
seen.append(pools())
emit(seen=seen)
"""


def test_each_private_pools_reserved_bytes_as_the_release_reports_them():
    native = run("native", POOL_STATS)
    ours = run("reservoir", POOL_STATS)
    assert ours == native
    newer = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 15)
    if newer:
        assert ours["seen"][0] == {} and ours["seen"][1]["reserved_bytes_by_private_pools.0_1.all.current"] == 22 * MiB
        assert ours["seen"][2]["reserved_bytes_by_private_pools.0_1.all.current"] == 0
        assert ours["seen"][2]["reserved_bytes_by_private_pools.0_1.large_pool.freed"] == 20 * MiB
    else:
        assert all(s == {} for s in ours["seen"])


# CUDA graph trees checkpoint a private pool's layout and lay it out again
# before recording a new graph (getCheckpointState / setCheckpointPoolState):
# the storages of tensors that died since lose their deleter, the restored
# blocks get new storages. Driven here through the same bindings the graph
# trees call, outside a capture (the simulated device captures no graphs).
CHECKPOINT = """
torch.cuda.memory._record_memory_history(max_entries=100000)
torch.empty(1, device="cuda")
pool = torch.cuda.MemPool()
with torch.cuda.use_mem_pool(pool):
    a = torch.empty(3 * MiB, dtype=torch.uint8, device="cuda")
    b = torch.empty(4 * MiB, dtype=torch.uint8, device="cuda")
    c = torch.empty(5 * MiB, dtype=torch.uint8, device="cuda")
base = a.data_ptr()
state = torch._C._cuda_getCheckpointState(0, pool.id)
b_ptr, b_bytes = b.data_ptr(), b.untyped_storage().nbytes()
del b
with torch.cuda.use_mem_pool(pool):
    d = torch.empty(2 * MiB, dtype=torch.uint8, device="cuda")
    e = torch.empty(int(os.environ.get("E_MIB", "30")) * MiB, dtype=torch.uint8, device="cuda")
seen = [d.data_ptr() - base, e.data_ptr() - base]
# d and e die with the restore: their storages let go without freeing.
b_again = torch._C._construct_storage_from_data_pointer(b_ptr, torch.device("cuda", 0), b_bytes)
torch._C._cuda_setCheckpointPoolState(0, state, [d.untyped_storage()._cdata, e.untyped_storage()._cdata],
                                      [b_again._cdata])
def layout():
    return [[g["address"] - base, g["total_size"], g["allocated_size"], g["requested_size"],
             [[x["size"], x["requested_size"], x["state"]] for x in g["blocks"]]]
            for g in torch.cuda.memory._snapshot()["segments"] if g["address"] >= base]
restored = layout()
stats = torch.cuda.memory_stats()
del d, e
after_stale = torch.cuda.memory_stats()["allocated_bytes.all.current"]
# Restored again with nothing stale: a, b and c are made again at once.
try:
    torch._C._cuda_setCheckpointPoolState(0, state, [], [])
    again = ""
except RuntimeError as err:
    again = str(err)
del b_again
freed_b = torch.cuda.memory_stats()["allocated_bytes.all.current"]
trace = [[x["action"], x["addr"] - base if x["addr"] >= base else -1, x["size"], bool(x.get("frames"))]
         for x in torch.cuda.memory._snapshot()["device_traces"][0]]
del a, c
del pool
torch.cuda.empty_cache()
emit(seen=seen, restored=restored, stats=stats, after_stale=after_stale, again=again, freed_b=freed_b,
     trace=trace, end=torch.cuda.memory_stats())
"""


def test_a_pools_checkpoint_is_laid_out_again_as_under_the_native_allocator():
    native = run("native", CHECKPOINT)
    ours = run("reservoir", CHECKPOINT)
    assert ours["restored"] == native["restored"]
    assert ours["stats"] == native["stats"]
    # PyTorch frees a pool's allocations segment by segment in the order of a
    # hash set of its blocks (reservoir: by address): the same entries, and
    # the same order within each segment.
    assert sorted(ours["trace"]) == sorted(native["trace"])
    first = [x for x in ours["trace"] if 0 <= x[1] < 20 * MiB]
    assert first == [x for x in native["trace"] if 0 <= x[1] < 20 * MiB]
    assert len(first) > 20 and [x for x in ours["trace"] if x[0] == "snapshot"] == [["snapshot", -1, 12 * MiB, False]]
    assert {k: v for k, v in ours.items() if k != "trace"} == {k: v for k, v in native.items() if k != "trace"}
    # a, b and c allocated again where they were, the rest of the segment
    # free; e's segment (not in the checkpoint) cached whole.
    assert ours["restored"] == [[0, 20 * MiB, 12 * MiB, 12 * MiB,
                                 [[3 * MiB, 3 * MiB, "active_allocated"], [4 * MiB, 4 * MiB, "active_allocated"],
                                  [5 * MiB, 5 * MiB, "active_allocated"], [8 * MiB, 8 * MiB, "inactive"]]],
                                [20 * MiB, 30 * MiB, 0, 0, [[30 * MiB, 30 * MiB, "inactive"]]]]
    assert ours["after_stale"] == 12 * MiB and ours["freed_b"] == 8 * MiB
    assert ours["again"] == "" and ours["end"]["reserved_bytes.all.current"] == 0


def test_a_checkpoint_of_an_expandable_pool_as_under_the_native_allocator():
    # Under expandable segments (PyTorch 2.5 and later) the pool's memory is
    # a reservation of its own; e takes the checkpoint's free room, so the
    # restore finds the reservation mapped as it was (PyTorch takes an
    # unmapped end as it finds it).
    env = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "E_MIB": "6"}
    native = run("native", CHECKPOINT, env)
    ours = run("expandable_segments:True", CHECKPOINT, env)
    assert sorted(ours["trace"]) == sorted(native["trace"])
    assert {k: v for k, v in ours.items() if k != "trace"} == {k: v for k, v in native.items() if k != "trace"}
    assert ours["seen"] == [3 * MiB, 12 * MiB]
    # (The default pool's small reservation lies above the pool's.)
    assert ours["restored"][0] == [0, 20 * MiB, 12 * MiB, 12 * MiB,
                                   [[3 * MiB, 3 * MiB, "active_allocated"], [4 * MiB, 4 * MiB, "active_allocated"],
                                    [5 * MiB, 5 * MiB, "active_allocated"], [8 * MiB, 8 * MiB, "inactive"]]]
    assert ours["again"] == "" and ours["end"]["reserved_bytes.all.current"] == 0


# policy:paging on a small device, its memory in one handle pinned by the
# blocks carved from it: CUDA maps a handle from its start only, so the free
# pages between the live blocks cannot be lent to a request the device has
# no memory left for. The request runs out of memory, as under PyTorch's
# allocator, and the allocator serves what fits afterwards; no device call
# fails (before, paging's stitching mapped part of the handle and the
# simulated CUDA device refused it: "device call map failed with
# not_supported").
PINNED_HANDLE = """
big = torch.empty(200 * MiB, dtype=torch.uint8, device="cuda")
del big
parts = [torch.empty(20 * MiB, dtype=torch.uint8, device="cuda") for _ in range(10)]
for i in range(0, 10, 2):
    parts[i] = None
try:
    x = torch.empty(60 * MiB, dtype=torch.uint8, device="cuda")
    got = "served"
except torch.OutOfMemoryError as err:
    got = "out of memory" if "CUDA out of memory" in str(err) else str(err)
except RuntimeError as err:
    got = "error: " + str(err).splitlines()[0]
y = torch.empty(15 * MiB, dtype=torch.uint8, device="cuda")
emit(got=got, after=y.data_ptr() != 0)
"""


def test_paging_under_pressure_runs_out_of_memory_as_the_device_allows():
    env = {"RESERVOIR_SIMCUDA_MEMORY": "256MiB"}
    native = run("native", PINNED_HANDLE, env)
    ours = run("policy:paging", PINNED_HANDLE, env)
    assert native == {"got": "out of memory", "after": True}
    assert ours == native


# A MemPool used by several `with use_mem_pool` blocks gives its memory back
# when the pool goes (its destructor empties the pool's cache at once), a
# segment still holding a live tensor when that tensor goes and the cache is
# emptied: as under PyTorch's allocator, step by step.
POOL_LIFETIME = """
torch.empty(1, device="cuda")
def reserved():
    s = torch.cuda.memory_stats()
    return [s["reserved_bytes.all.current"], s["segment.all.current"], s["num_sync_all_streams"],
            s["num_device_free"]]
pool = torch.cuda.MemPool()
with torch.cuda.use_mem_pool(pool):
    x = torch.empty(3 * MiB, dtype=torch.uint8, device="cuda")
with torch.cuda.use_mem_pool(pool):
    y = torch.empty(25 * MiB, dtype=torch.uint8, device="cuda")
with torch.cuda.use_mem_pool(pool):
    z = torch.empty(700, dtype=torch.uint8, device="cuda")
x = z = None
seen = [reserved(), pool.use_count()]
del pool  # y still lives in the pool
seen.append(reserved())
y = None
torch.cuda.empty_cache()
seen.append(reserved())
emit(seen=seen)
"""


def test_a_pool_used_several_times_gives_its_memory_back_as_under_the_native_allocator():
    native = run("native", POOL_LIFETIME)
    ours = run("reservoir", POOL_LIFETIME)
    assert ours == native
    assert ours["seen"][0][:2] == [2 * MiB + 20 * MiB + 26 * MiB + 2 * MiB, 4]
    assert ours["seen"][2] == [2 * MiB + 26 * MiB, 2, 1, 2]
    assert ours["seen"][3][:2] == [0, 0]


def run_both(body, extra_env=None):
    """The same program under PyTorch's allocator and under reservoir's,
    installed by RESERVOIR_TORCH_ALLOCATOR=own (as a user with PyTorch's
    own test suites runs it): both results."""
    env = {k: v for k, v in os.environ.items() if k != "RESERVOIR_TORCH_ALLOCATOR"}
    env.update(extra_env or {})
    code = PRELUDE.replace('mode = sys.argv[1]', 'mode = "native"') + textwrap.dedent(body)
    native = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    ours = run_with_environment("own", body, extra_env)
    run_both.stderr = ours.stderr
    return result_of(native), result_of(ours)


# torch.accelerator's memory calls (the device-generic API) reach the
# allocator PyTorch allocates CUDA memory from: reservoir's, once installed.
ACCELERATOR = """
torch.cuda.empty_cache()
torch.cuda.reset_peak_memory_stats()
x = torch.empty(256, dtype=torch.float32, device="cuda")
stats = torch.accelerator.memory_stats()
allocated = torch.accelerator.memory_allocated()
reserved = torch.accelerator.memory_reserved()
del x
torch.accelerator.empty_cache()
after = torch.accelerator.memory_stats()
torch.accelerator.reset_peak_memory_stats()
emit(backend=torch.cuda.get_allocator_backend(), active=stats["active_bytes.all.current"], allocated=allocated,
     reserved=reserved, reserved_after=torch.accelerator.memory_reserved(),
     freed=after["active_bytes.all.freed"], max_allocated=torch.accelerator.max_memory_allocated(),
     max_reserved=torch.accelerator.max_memory_reserved(), keys=sorted(stats))
"""


def test_torch_accelerator_memory_calls_reach_reservoir():
    native, ours = run_both(ACCELERATOR)
    assert (native.pop("backend"), ours.pop("backend")) == ("native", "reservoir")
    assert ours == native
    assert (ours["active"], ours["allocated"], ours["reserved"]) == (1024, 1024, 2 * 1024 * 1024)
    assert (ours["reserved_after"], ours["freed"], ours["max_allocated"], ours["max_reserved"]) == (0, 1024, 0, 0)


# torch.cuda.memory._set_allocator_settings() at run time: each call's
# rounding, split limit and collection threshold apply from the next
# allocation on (the three fall back to their defaults when a call leaves
# them out, as PyTorch's parser does).
RUNTIME_SETTINGS = """
nelems = 21 * MiB  # 84 MiB of floats
def grown(f):
    before = torch.cuda.memory_stats().get("active_bytes.all.allocated", 0)
    t = f()
    return torch.cuda.memory_stats()["active_bytes.all.allocated"] - before, t
keep = []
def alloc():
    return torch.empty(nelems, dtype=torch.float32, device="cuda")
sizes = []
for settings in (None, "roundup_power2_divisions:4", "garbage_collection_threshold:0.5,max_split_size_mb:40",
                 "roundup_power2_divisions:[64:8,128:2,256:2,512:2,1024:1,>:1]", "release_lock_on_cudamalloc:True"):
    if settings is not None:
        torch.cuda.memory._set_allocator_settings(settings)
    n, t = grown(alloc)
    keep.append(t)
    sizes.append(n)
    split = torch.cuda.memory_stats()["max_split_size"]
    sizes.append(split)
def layout():
    return [[s["total_size"], s["is_expandable"], [[b["size"], b["state"]] for b in s["blocks"]]]
            for s in sorted(torch.cuda.memory_snapshot(), key=lambda s: s["address"])]
kinds = []
# The kind of segments changes at run time too: new memory is expandable,
# the ordinary segments made before stay and serve as before; and back.
torch.cuda.memory._set_allocator_settings("expandable_segments:True")
x = torch.empty(3 * MiB, dtype=torch.uint8, device="cuda")
y = torch.empty(100, dtype=torch.uint8, device="cuda")
kinds.append(layout())
del keep[0]
z = torch.empty(50 * MiB, dtype=torch.uint8, device="cuda")
kinds.append(layout())
torch.cuda.memory._set_allocator_settings("expandable_segments:False")
w = torch.empty(5 * MiB, dtype=torch.uint8, device="cuda")
v = torch.empty(70 * MiB, dtype=torch.uint8, device="cuda")
kinds.append(layout())
del x, y, z, w, v, keep
torch.cuda.empty_cache()
kinds.append(layout())
s = torch.cuda.memory_stats()
emit(sizes=sizes, backend=torch.cuda.get_allocator_backend(), kinds=kinds,
     stats=[s["reserved_bytes.all.current"], s["num_device_alloc"], s["num_device_free"],
            s["segment.all.current"]])
"""


def test_settings_changed_at_run_time_apply_to_the_next_allocation():
    native, ours = run_both(RUNTIME_SETTINGS)
    assert ours["sizes"] == native["sizes"]
    MiB = 1 << 20
    # 84 MiB as asked; to 96 MiB in quarters; back to 84; to 88 in eighths; 84 again.
    assert ours["sizes"][0::2] == [84 * MiB, 96 * MiB, 84 * MiB, 88 * MiB, 84 * MiB]
    # The max_split_size statistic stays as the allocator was made (-1: no
    # limit), though the limit itself applied, as under PyTorch's.
    assert set(ours["sizes"][1::2]) == {-1}
    # A change of segment kind applies from the next device request, as under
    # PyTorch's: segments, blocks and counts the same at every step.
    assert ours["kinds"] == native["kinds"] and ours["stats"] == native["stats"]
    assert "is not applied at run time" not in run_both.stderr, run_both.stderr
    assert {s[1] for s in ours["kinds"][0]} == {False, True}
    # Emptied: only the ordinary segment of the last tensor kept (t) stays.
    assert [s[:2] for s in ours["kinds"][3]] == [[84 * MiB, False]]


# torch.cuda.memory.caching_allocator_enable(False): every request is a
# cudaMalloc of its own, outside the cache and its statistics, and its
# memory goes back to the device when freed.
UNCACHED = """
device = torch.cuda.current_device()
stream = torch._C._cuda_getCurrentRawStream(device)
def requested(n):
    start = torch.cuda.memory_stats()["requested_bytes.all.allocated"]
    p = torch._C._cuda_cudaCachingAllocator_raw_alloc(n, stream)
    finish = torch.cuda.memory_stats()["requested_bytes.all.allocated"]
    torch._C._cuda_cudaCachingAllocator_raw_delete(p)
    return finish - start
torch.cuda.empty_cache()
torch.cuda.caching_allocator_enable(False)
off = requested(MiB)
free0 = torch.cuda.mem_get_info()[0]
t = torch.empty(6 * MiB, dtype=torch.uint8, device="cuda")
free1 = torch.cuda.mem_get_info()[0]
reserved_off = torch.cuda.memory_reserved()
del t
free2 = torch.cuda.mem_get_info()[0]
torch.cuda.caching_allocator_enable(True)
on = requested(MiB)
emit(off=off, on=on, reserved_off=reserved_off, taken=free0 - free1, back=free2 - free1,
     enabled=getattr(torch._C, "_cuda_cudaCachingAllocator_is_enabled", lambda: True)())
"""


def test_a_disabled_cache_allocates_from_the_device_each_time():
    native, ours = run_both(UNCACHED)
    assert ours == native
    assert (ours["off"], ours["on"], ours["reserved_off"]) == (0, 1 << 20, 0)
    assert ours["taken"] == ours["back"] >= 6 << 20 and ours["enabled"]


# per_process_memory_fraction in the settings: what the getter answers, 0.0
# accepted, and a value outside [0, 1] is PyTorch's ValueError when CUDA
# starts, with PyTorch's words.
FRACTION = """
device = torch._C._cuda_getDevice()
emit(fraction=torch.cuda.memory.get_per_process_memory_fraction(device), backend=torch.cuda.get_allocator_backend())
"""


@pytest.mark.parametrize("value", ["0.0", "0.5", "1.0"])
def test_the_memory_fraction_of_the_settings_is_what_the_getter_answers(value):
    env = {"PYTORCH_CUDA_ALLOC_CONF": f"per_process_memory_fraction:{value}"}
    native, ours = run_both(FRACTION, env)
    assert (native["backend"], ours["backend"]) == ("native", "reservoir")
    assert ours["fraction"] == native["fraction"] == float(value)


@pytest.mark.parametrize("value", ["-0.1", "1.1"])
def test_a_memory_fraction_out_of_range_stops_the_program_in_pytorchs_words(value):
    env = {"PYTORCH_CUDA_ALLOC_CONF": f"per_process_memory_fraction:{value}"}
    r = run_with_environment("own", FRACTION, env)
    assert r.returncode != 0
    assert "ValueError" in r.stderr and "per_process_memory_fraction is invalid" in r.stderr, r.stderr[-2000:]


def test_zero_memory_fraction_allows_no_memory():
    body = """
torch.cuda.set_per_process_memory_fraction(0.0)
try:
    torch.empty(1, device="cuda")
    emit(oom=False, fraction=torch.cuda.get_per_process_memory_fraction())
except torch.OutOfMemoryError as e:
    emit(oom=True, fraction=torch.cuda.get_per_process_memory_fraction())
"""
    native, ours = run_both(body)
    assert ours == native == {"oom": True, "fraction": 0.0}


# _record_memory_history(context="state"): frames on the blocks in use
# only; the trace's entries carry none.
STATE_CONTEXT = """
torch.cuda.memory._record_memory_history(context="state", stacks="python")
x = torch.empty(3 * MiB, dtype=torch.uint8, device="cuda")
y = torch.empty(5 * MiB, dtype=torch.uint8, device="cuda")
del y
snap = torch.cuda.memory._snapshot()
torch.cuda.memory._record_memory_history(None)
blocks = [b for s in snap["segments"] for b in s["blocks"] if b["state"] == "active_allocated"]
trace = snap["device_traces"][0]
emit(block_frames=[len(b["frames"]) > 0 for b in blocks], actions=[e["action"] for e in trace],
     trace_frames=[len(e.get("frames", [])) for e in trace])
"""


def test_state_context_keeps_frames_on_blocks_in_use_only():
    native, ours = run_both(STATE_CONTEXT)
    assert ours == native
    assert ours["block_frames"] == [True] and set(ours["trace_frames"]) == {0}


# Nested torch.cuda.use_mem_pool: what is allocated inside the innermost
# block goes to its pool.
NESTED_POOLS = """
pools = [torch.cuda.MemPool() for _ in range(3)]
keep = []
with torch.cuda.use_mem_pool(pools[0]):
    keep.append(torch.empty(3 * MiB, dtype=torch.uint8, device="cuda"))
    with torch.cuda.use_mem_pool(pools[1]):
        keep.append(torch.empty(3 * MiB, dtype=torch.uint8, device="cuda"))
        with torch.cuda.use_mem_pool(pools[2]):
            keep.append(torch.empty(3 * MiB, dtype=torch.uint8, device="cuda"))
        keep.append(torch.empty(30 * MiB, dtype=torch.uint8, device="cuda"))
    keep.append(torch.empty(30 * MiB, dtype=torch.uint8, device="cuda"))
emit(segments=[len(p.snapshot()) for p in pools])
"""


def test_nested_memory_pools_allocate_to_the_innermost():
    native, ours = run_both(NESTED_POOLS)
    assert ours == native == {"segments": [2, 2, 1]}


# A request of 1 EiB or more: PyTorch's own words, before any device call.
def test_a_request_beyond_an_exabyte_is_pytorchs_error():
    body = """
try:
    torch.empty(1024 * 1024 * 1024 * 8000000000, dtype=torch.int8, device="cuda")
    emit(error=None)
except torch.OutOfMemoryError as e:
    emit(error=str(e).split("\\n")[0], ooms=torch.cuda.memory_stats().get("num_ooms", 0))
"""
    native, ours = run_both(body)
    assert ours == native
    assert ours["error"] == "CUDA out of memory. Tried to allocate more than 1EB memory."


# A child told to use another backend of PyTorch's (backend:cudaMallocAsync)
# gets it: the inherited RESERVOIR_TORCH_ALLOCATOR steps aside, in one line.
def test_another_backend_asked_of_pytorch_wins_over_the_inherited_variable():
    body = "torch.cuda.init()\nemit(backend=torch.cuda.get_allocator_backend())"
    r = run_with_environment("own", body, {"PYTORCH_ALLOC_CONF": "max_split_size_mb:20,backend:cudaMallocAsync"})
    assert result_of(r) == {"backend": "cudaMallocAsync"}
    lines = [x for x in r.stderr.splitlines() if x.startswith("reservoir:")]
    assert lines == ["reservoir: RESERVOIR_TORCH_ALLOCATOR=own ignored: PYTORCH_ALLOC_CONF asks PyTorch for "
                     "backend:cudaMallocAsync, which PyTorch keeps"], r.stderr[-2000:]


# Work that takes time on the simulated device (torch.cuda._sleep keeps its
# stream busy): a block freed after record_stream onto a busy stream is not
# handed out again until that stream's work is done, under either allocator.
BUSY_STREAM = """
cycles_per_ms = 1.98e6
side = torch.cuda.Stream()
x = torch.empty(MiB, dtype=torch.uint8, device="cuda")
px = x.data_ptr()
with torch.cuda.stream(side):
    torch.cuda._sleep(int(300 * cycles_per_ms))
    x.record_stream(side)
done = side.record_event()
del x
y = torch.empty(MiB, dtype=torch.uint8, device="cuda")
reused_while_busy = y.data_ptr() == px
busy = (side.query(), done.query())
side.synchronize()
z = torch.empty(MiB, dtype=torch.uint8, device="cuda")
emit(reused_while_busy=reused_while_busy, busy=busy, after=(side.query(), done.query()),
     reused_after=z.data_ptr() == px)
"""


def test_a_block_recorded_on_a_busy_stream_waits_for_its_work():
    native, ours = run_both(BUSY_STREAM, {"RESERVOIR_SIMCUDA_KERNELS": "skip"})
    assert ours == native == {"reused_while_busy": False, "busy": [False, False], "after": [True, True],
                              "reused_after": True}


# cuBLAS on the simulated device (handles, no math): PyTorch's cuBLAS
# workspace comes from the allocator, 32 MiB on a compute capability 9.0
# device, under either allocator.
CUBLAS_WORKSPACE = """
a = torch.empty(7, 7, device="cuda")
torch._C._cuda_clearCublasWorkspaces()
start = torch.cuda.memory_stats()["active_bytes.all.allocated"]
with torch.no_grad():
    torch.matmul(a, a)
emit(grown=torch.cuda.memory_stats()["active_bytes.all.allocated"] - start)
"""


def test_the_cublas_workspace_comes_from_the_allocator():
    native, ours = run_both(CUBLAS_WORKSPACE, {"RESERVOIR_SIMCUDA_KERNELS": "skip"})
    assert ours == native == {"grown": 32 * MiB + 512}


# torch.profiler.profile(profile_memory=True): the profiler's memory events
# (each allocation and free: its block's size, negative for a free, and the
# device's allocated and reserved bytes after it; a failed request: its size
# rounded, and the totals), in order, with each address as the order of its
# first event (the simulated device's addresses differ between processes),
# and the memory each operator allocated by the profiler's own account.
PROFILER = """
import collections, tempfile
from torch.profiler import profile, ProfilerActivity
keep = torch.empty(100, device="cuda")
side = torch.cuda.Stream()
with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
    a = torch.empty(1000, device="cuda")
    b = torch.empty(3 * MiB, device="cuda")
    del a
    c = torch.ones(5 * MiB, device="cuda")
    with torch.cuda.stream(side):
        d = torch.empty(2 * MiB + 7, dtype=torch.uint8, device="cuda")
    d.record_stream(torch.cuda.current_stream())
    del b, d
    e = c + 1
    del c, e
    torch.cuda.empty_cache()
    f = torch.empty(10, device="cuda")
    try:
        torch.empty((1 << 40) + 3, dtype=torch.uint8, device="cuda")
    except torch.OutOfMemoryError:
        pass
    del f
path = tempfile.mktemp(suffix=".json")
prof.export_chrome_trace(path)
with open(path) as fh:
    trace = json.load(fh)["traceEvents"]
order = {}
events = []
for ev in trace:
    args = ev.get("args", {})
    if ev.get("name") not in ("[memory]", "[OutOfMemory]") or args.get("Device Type") != 1:
        continue
    addr = args.get("Addr", 0)
    where = order.setdefault(addr, len(order)) if ev["name"] == "[memory]" else None
    events.append([ev["name"], where, args["Bytes"], args["Total Allocated"], args["Total Reserved"]])
per_op = collections.Counter()
for avg in prof.key_averages():
    per_op[avg.key] += avg.self_device_memory_usage
emit(events=events, per_op={k: v for k, v in sorted(per_op.items()) if v})
"""


def test_the_profilers_memory_events_are_pytorchs():
    native, ours = run_both(PROFILER, {"RESERVOIR_SIMCUDA_KERNELS": "skip"})
    assert ours == native
    memory = [e[1:] for e in ours["events"] if e[0] == "[memory]"]
    failed = [e[2:] for e in ours["events"] if e[0] == "[OutOfMemory]"]
    assert len(memory) == 12, ours["events"]
    # a (4 KiB of the small pool's 2 MiB), b (12 MiB); a freed: its size
    # back, reserved unchanged.
    assert memory[:3] == [[0, 4096, 4608, 2 * MiB], [1, 12 * MiB, 12 * MiB + 4608, 14 * MiB],
                          [0, -4096, 12 * MiB + 512, 14 * MiB]]
    # d, freed after record_stream: reported when freed, not when its
    # stream's work is done.
    assert memory[6] == [3, -(2 * MiB + 512), 20 * MiB + 512, 54 * MiB]
    # After empty_cache: f alone, in a fresh small segment.
    assert memory[10] == [0, 512, 1024, 2 * MiB]
    # The failed request, rounded as the allocator rounds it, with f live.
    assert failed == [[(1 << 40) + 512, 1024, 2 * MiB]]
    # The profiler's own account by operator.
    assert ours["per_op"] == {"[memory]": -56628224, "aten::add": 20 * MiB, "aten::empty": 35656704}


# The profiler as people start it, with its default activities (CUDA's
# among them, which load CUPTI: the simulated device's says there is no GPU
# activity to trace, and the profiler goes on), and PyTorch's memory viewer
# made from it (torch.cuda._memory_viz's profile_plot and
# _profile_to_snapshot): the memory events come from the allocator either
# way. Before the simulated device had a CUPTI of its own, PyTorch 2.15's
# (13.2) recursed until the stack overflowed when the profiler started.
PROFILER_DEFAULT_ACTIVITIES = """
from torch.profiler import profile
from torch.cuda._memory_viz import profile_plot, _profile_to_snapshot
with profile(with_stack=True, profile_memory=True, record_shapes=True) as prof:
    x = torch.ones(128, 128, device="cuda")
    y = x * x + x * x
    del x
    z = torch.zeros(3 * MiB, device="cuda")
    del y, z
snapshot = _profile_to_snapshot(prof)
page = profile_plot(prof)
emit(traces=[[e["action"], e["size"]] for e in snapshot["device_traces"][0]],
     page="Active Memory Timeline" in page)
"""


def test_the_profiler_with_its_default_activities():
    native, ours = run_both(PROFILER_DEFAULT_ACTIVITIES, {"RESERVOIR_SIMCUDA_KERNELS": "skip"})
    assert ours == native
    kib64 = 128 * 128 * 4
    # The viewer's account (tensors it can follow from their allocation):
    # three of 64 KiB made and freed, then z's 12 MiB.
    assert ours["traces"] == ([["alloc", kib64]] * 3 + [["free_requested", kib64], ["free_completed", kib64]] * 3
                              + [["alloc", 12 * MiB], ["free_requested", 12 * MiB], ["free_completed", 12 * MiB]])
    assert ours["page"] is True
    assert "CUPTI is not served by the simulated device" in run_both.stderr


# Failing programs on a 2 GiB device: a request too large with memory cached
# in split segments, the same under a memory fraction, and under expandable
# segments. reservoir's own allocator writes PyTorch's message for the
# running release sentence for sentence (NVML's list of processes included:
# the simulated device answers NVML as a GPU's driver does).
# A request that may fail: its message, or "no error", in `messages`.
FAIL = """
messages = []
def fail(n):
    try:
        torch.empty(n, dtype=torch.uint8, device="cuda")
        messages.append("no error")
    except torch.OutOfMemoryError as e:
        messages.append(str(e))
"""
MESSAGES = FAIL + """
GiB = 1 << 30
keep = [torch.empty(300 * MiB, dtype=torch.uint8, device="cuda"),
        torch.empty(5 * MiB + 1, dtype=torch.uint8, device="cuda")]
cached = torch.empty(200 * MiB, dtype=torch.uint8, device="cuda")
small = torch.empty(1000, dtype=torch.uint8, device="cuda")
cached = None
fail(int(1.75 * GiB))
torch.cuda.set_per_process_memory_fraction(0.5)
fail(800 * MiB)
torch.cuda.set_per_process_memory_fraction(1.0)
fail(3 * GiB)
emit(messages=messages)
"""


@pytest.mark.parametrize("settings", ["", "expandable_segments:True"])
def test_the_out_of_memory_message_is_pytorchs_sentence_for_sentence(settings):
    env = {"RESERVOIR_SIMCUDA_MEMORY": "2GiB", "PYTORCH_CUDA_ALLOC_CONF": settings}
    native = run("native", MESSAGES, env)
    ours = run(settings or "reservoir", MESSAGES, env)  # use_as_allocator(settings)
    assert len(native["messages"]) == 3
    for theirs, mine in zip(native["messages"], ours["messages"]):
        assert theirs.startswith("CUDA out of memory."), theirs
        assert "this process has" in theirs, theirs  # NVML answered
        assert mine == theirs


# PyTorch 2.15's expandable_segments_reserve on a 1 GiB device: 5% (51.20
# MiB, three 20 MiB pages) a segment; 55 MiB fits a new segment, 61 MiB fits
# none and fails with 2.15's sentence on the reserve; an invalid value is
# ignored with PyTorch's warning (the default reserve kept: 61 MiB fits).
RESERVE = FAIL + """
keep = torch.empty(30 * MiB, dtype=torch.uint8, device="cuda")
fail(55 * MiB)
fail(61 * MiB)
stats = torch.cuda.memory_stats()
emit(messages=messages, ooms=stats["num_ooms"], retries=stats["num_alloc_retries"],
     reserved=stats["reserved_bytes.all.current"])
"""


@pytest.mark.parametrize("reserve", ["0.05", "0.05G", "none"])
def test_the_expandable_segment_reserve_is_215s(reserve):
    if tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2]) < (2, 15):
        pytest.skip("expandable_segments_reserve arrived in PyTorch 2.15")
    settings = f"expandable_segments:True,expandable_segments_reserve:{reserve}"
    env = {"RESERVOIR_SIMCUDA_MEMORY": "1GiB", "PYTORCH_CUDA_ALLOC_CONF": settings}
    native = run("native", RESERVE, env)
    ours = run(settings, RESERVE, env)
    assert ours == native
    if reserve == "none":
        assert native["messages"] == ["no error", "no error"] and native["ooms"] == 0
    else:
        assert native["messages"][0] == "no error" and native["ooms"] == 1 and native["retries"] == 1
        assert native["messages"][1].endswith(
            "This allocation exceeds the expandable-segment reserve of 51.20 MiB for this stream, and a single "
            "allocation cannot span expandable segments. Raise PYTORCH_CUDA_ALLOC_CONF expandable_segments_reserve "
            "or expandable_segments_reserve_by_class (or unset it) so that a segment is at least 62.00 MiB.")


# The pending-free case of pytorch/pytorch#189504 (scenarios.py).
PENDING_FREE_STATS = PENDING_FREE + """
stats = torch.cuda.memory_stats()
emit(outcome=outcome, ooms=stats["num_ooms"], retries=stats["num_alloc_retries"])
"""


def test_a_block_the_retry_ladder_freed_serves_the_request_pytorchs_raises():
    # (torch.cuda._sleep's kernel spins on the simulated device's clock: its
    # stream stays busy; other kernels are taken without computing.)
    env = {"RESERVOIR_SIMCUDA_MEMORY": "2GiB", "RESERVOIR_SIMCUDA_KERNELS": "skip"}
    native = run("native", PENDING_FREE_STATS, env)
    assert native == {"outcome": ["oom", 0], "ooms": 1, "retries": 1}
    ours = run("reservoir", PENDING_FREE_STATS, env)
    assert ours == {"outcome": [0], "ooms": 0, "retries": 0}
    as_pytorch = run("retry_searches_pool:False", PENDING_FREE_STATS, env)
    assert as_pytorch == native
    # The pluggable allocator (reservoir.install_torch()) is the same allocator.
    pluggable = run("native", "import reservoir\nreservoir.install_torch()\n" + PENDING_FREE +
                    "emit(outcome=outcome)\n", env)
    assert pluggable == {"outcome": [0]}
