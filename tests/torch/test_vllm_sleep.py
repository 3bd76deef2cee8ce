"""vLLM's sleep mode on reservoir's simulated CUDA device: the real vLLM
0.33.0 from PyPI (its CuMemAllocator, the cumem_allocator extension on the
simulated driver's virtual-memory calls, and CudaRTLibrary, which opens the
libcudart it finds mapped, by its path), under the PyTorch release it pins
(2.14.0), with PyTorch's allocator and with reservoir's own beside it.

Also: both sleep-mode backends, vLLM's own ("cumem") and reservoir's
(python/reservoir/vllm_sleep.py), running one program as vLLM's worker
drives them.

Run by ctest (vllm_0.33.0_sleep) with the simulated runtime preloaded and
tests/torch/requirements-vllm-0.33.0.txt's folder first on PYTHONPATH.
"""
import functools
import json
import os
import subprocess
import sys
import textwrap

MiB = 1 << 20

PROGRAM = """
import json, os
import torch
from vllm.device_allocator.cumem import CuMemAllocator
from vllm.utils.system_utils import find_loaded_library
import vllm.device_allocator.cumem as cumem
MiB = 1 << 20
a = CuMemAllocator.get_instance()
with a.use_memory_pool(tag="weights"):
    w = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")
with a.use_memory_pool(tag="kv_cache"):
    kv = torch.empty(32 * MiB, dtype=torch.uint8, device="cuda")
pattern = (torch.arange(64 * MiB, dtype=torch.int64) * 7 % 251).to(torch.uint8)
w.copy_(pattern)
outside = torch.empty(8 * MiB, dtype=torch.uint8, device="cuda")  # the caching allocator's, not vLLM's
outside.copy_(torch.full((8 * MiB,), 3, dtype=torch.uint8))
ptrs = (w.data_ptr(), kv.data_ptr())
cycles = []
for cycle in range(2):
    free0, _ = torch.cuda.mem_get_info()
    a.sleep(offload_tags=("weights",))
    free1, _ = torch.cuda.mem_get_info()
    a.wake_up()
    free2, _ = torch.cuda.mem_get_info()
    cycles.append({"released": free1 - free0, "retaken": free1 - free2,
                   "same_pointers": (w.data_ptr(), kv.data_ptr()) == ptrs,
                   "weights_restored": torch.equal(w.cpu(), pattern),
                   "outside_kept": bool((outside.cpu() == 3).all())})
print("RESULT " + json.dumps({"cycles": cycles, "backend": torch.cuda.get_allocator_backend(),
                              "cudart": find_loaded_library("libcudart"), "torch": torch.__version__,
                              "cudart_opened": cumem.libcudart is not None}), flush=True)
"""


def run(allocator):
    env = {k: v for k, v in os.environ.items() if k != "RESERVOIR_TORCH_ALLOCATOR"}
    env["RESERVOIR_SIMCUDA_KERNELS"] = "skip"  # torch.empty's own kernels; the bytes move by copies
    code = textwrap.dedent(PROGRAM)
    if allocator == "own":
        import reservoir
        site_dir = os.path.dirname(os.path.dirname(os.path.abspath(reservoir.__file__)))
        code = f"import site; site.addsitedir({site_dir!r})\n" + code
        env["RESERVOIR_TORCH_ALLOCATOR"] = "own"
    r = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True, timeout=300,
                       env=env)
    lines = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
    assert r.returncode == 0 and lines, f"{allocator}: exit {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
    return json.loads(lines[-1][len("RESULT "):])


def check(result, backend):
    assert result["torch"].startswith("2.14.0")
    assert result["backend"] == backend
    # CudaRTLibrary opened the runtime it found mapped: the simulated one,
    # the only libcudart in the process.
    assert result["cudart_opened"]
    assert os.path.realpath(result["cudart"]) == os.path.realpath(os.environ["LD_PRELOAD"].split(":")[0])
    # Each cycle: both tags' 96 MiB leave the device and come back at the
    # same addresses, the offloaded weights with their bytes; memory outside
    # vLLM's pool stays.
    for c in result["cycles"]:
        assert c == {"released": 96 * MiB, "retaken": 96 * MiB, "same_pointers": True, "weights_restored": True,
                     "outside_kept": True}, result["cycles"]


def test_sleep_and_wake_under_pytorchs_allocator():
    check(run("native"), "native")


def test_sleep_and_wake_beside_reservoirs_own_allocator():
    check(run("own"), "reservoir")


# The same program under both sleep-mode backends, as vLLM's worker drives
# them (its SleepModeBackend: suspend at levels 1 and 2, selective resumes,
# discard), on a 1 GiB simulated device: tagged pools of weights (64 MiB),
# KV cache (32 MiB) and runtime state (8 MiB), each filled with its own
# bytes; then 100 level-1 cycles; then a wake on a full device. argv[1]:
# "cumem" (vLLM's own) or "reservoir" (registered as vLLM's plugin loader
# does, selected by the worker's config, the KV cache restored as zeros).
BACKENDS = """
import json, os, resource, sys
import torch
from vllm.device_allocator.sleep_mode_backend import SleepModeBackendFactory, SleepModeBackend
from vllm.device_allocator import get_mem_allocator_instance
MiB = 1 << 20
name = sys.argv[1]
out = {}
if name == "cumem" and os.environ.get("RESERVOIR_VLLM_SLEEP") == "1":
    import reservoir.vllm_sleep as rv
    rv.register()  # as vLLM's plugin loader does; the worker's config names vLLM's own backend
if name == "reservoir":
    import reservoir.vllm_sleep as rv
    rv.register()
    rv.register()  # plugins may be loaded more than once
    # What a worker made with --sleep-mode-backend reservoir sets (vLLM's
    # config module needs packages this folder does not hold).
    rv._worker_selected.set()
    out["registered"] = issubclass(SleepModeBackendFactory.get_backend_class("reservoir"), SleepModeBackend)
backend = SleepModeBackendFactory.get_backend_class(name)()
allocator = get_mem_allocator_instance()
out["allocator"] = type(allocator).__name__
def tagged(tag, n, value):
    with allocator.use_memory_pool(tag=tag):
        t = torch.empty(n * MiB, dtype=torch.uint8, device="cuda")
    t.copy_(torch.full((n * MiB,), value, dtype=torch.uint8))
    return t
w, kv, rt = tagged("weights", 64, 7), tagged("kv_cache", 32, 5), tagged("runtime", 8, 9)
ptrs = (w.data_ptr(), kv.data_ptr(), rt.data_ptr())
def free():
    return torch.cuda.mem_get_info()[0] // MiB
def same(t, value):
    return bool((t.cpu() == value).all())
def asleep_ok():
    return (w.data_ptr(), kv.data_ptr(), rt.data_ptr()) == ptrs
steps = []
def step(what, **kw):
    steps.append(dict(what=what, free=free(), state=backend.state(), pointers=asleep_ok(), **kw))
f0 = free()
step("start", usage=allocator.get_current_usage() // MiB)
backend.suspend(level=1)
step("level 1")
backend.resume(["weights"])
step("woke weights", weights=same(w, 7), runtime=same(rt, 9))
backend.resume(["kv_cache"])
step("woke kv_cache", kv_zero=same(kv, 0))
backend.suspend(level=2)
step("level 2")
backend.resume()
step("woke all", weights=same(w, 7), runtime=same(rt, 9))
backend.discard(("kv_cache",))
step("discarded kv_cache")
backend.resume(["kv_cache"])
step("woke kv_cache")
out["steps"] = steps
# 100 cycles: what is held while asleep, and the host's memory.
w.copy_(torch.full((64 * MiB,), 7, dtype=torch.uint8))
asleep, rss = [], []
for i in range(100):
    backend.suspend(level=1)
    asleep.append(free())
    backend.resume()
    if i in (0, 99):
        rss.append(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024)
out["asleep_first_last"] = [asleep[0], asleep[-1]]
out["rss_growth_mib"] = rss[1] - rss[0]
out["weights_after_cycles"] = same(w, 7)
# A wake on a full device: another tenant took the memory meanwhile.
backend.suspend(level=1)
hog = torch.empty((free() - 40) * MiB, dtype=torch.uint8, device="cuda")
try:
    backend.resume()
    out["full_wake"] = "woke"
except Exception as e:
    out["full_wake"] = type(e).__name__ + ": " + str(e).splitlines()[0][:300]
del hog
torch.cuda.empty_cache()
try:
    backend.resume()
    out["wake_after"] = same(w, 7) and same(rt, 9) and asleep_ok()
except Exception as e:
    out["wake_after"] = type(e).__name__ + ": " + str(e)[:200]
print("RESULT " + json.dumps(out), flush=True)
os._exit(0)
"""


@functools.lru_cache(maxsize=None)  # each backend's run once, for every test that compares it
def run_backend(name, **extra):
    env = {k: v for k, v in os.environ.items() if k not in ("RESERVOIR_TORCH_ALLOCATOR", "RESERVOIR_VLLM_SLEEP")}
    env.update({"RESERVOIR_SIMCUDA_KERNELS": "skip", "RESERVOIR_SIMCUDA_MEMORY": "1GiB",
                "RESERVOIR_VLLM_RESTORE": "kv_cache:zero"}, **extra)
    r = subprocess.run([sys.executable, "-W", "ignore", "-c", BACKENDS, name], capture_output=True, text=True,
                       timeout=600, env=env)
    lines = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
    assert r.returncode == 0 and lines, f"{name}: exit {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
    return json.loads(lines[-1][len("RESULT "):])


def test_both_sleep_mode_backends_run_the_same_program():
    ours, theirs = run_backend("reservoir"), run_backend("cumem")
    assert ours["registered"] and ours["allocator"] == "ReservoirMemAllocator"
    assert theirs["allocator"] == "CuMemAllocator"
    free0 = ours["steps"][0]["free"]
    got = [(s["what"], free0 - s["free"], s["state"], s["pointers"]) for s in ours["steps"]]
    # Memory taken from the device at each step (MiB): all 116 while it
    # runs (the 8 MiB of runtime state in a 20 MiB segment, as PyTorch's
    # caching allocator sizes a pool's segment for it), none asleep, all but
    # the deferred KV cache's 32 after waking the weights.
    assert got == [("start", 0, "RUNNING", True), ("level 1", -116, "SUSPENDED", True),
                   ("woke weights", -32, "RUNNING", True), ("woke kv_cache", 0, "RUNNING", True),
                   ("level 2", -116, "SUSPENDED", True), ("woke all", 0, "RUNNING", True),
                   ("discarded kv_cache", -32, "SUSPENDED", True), ("woke kv_cache", 0, "RUNNING", True)], got
    assert ours["steps"][0]["usage"] == 116
    assert ours["steps"][2]["weights"] and ours["steps"][2]["runtime"]
    assert ours["steps"][3]["kv_zero"]  # restored as zeros, as asked
    assert not ours["steps"][5]["weights"] and ours["steps"][5]["runtime"]  # level 2 drops the weights
    # The same memory given back and taken at every step under vLLM's own.
    assert [free0 - s["free"] for s in ours["steps"]] == \
        [theirs["steps"][0]["free"] - s["free"] for s in theirs["steps"]]
    assert theirs["steps"][2]["weights"] and theirs["steps"][2]["runtime"]
    # No growth over 100 cycles: held asleep the same after the last as
    # after the first; the host's memory within 16 MiB.
    assert ours["asleep_first_last"][0] == ours["asleep_first_last"][1]
    assert ours["rss_growth_mib"] < 16 and ours["weights_after_cycles"]
    # A wake on a full device: an error naming the tag and the bytes, the
    # tag left asleep with its backup, and the next wake, once memory is
    # back, gives everything back.
    assert ours["full_wake"].startswith("OutOfMemoryError: resume of tag '"), ours["full_wake"]
    assert "the tag stays paused" in ours["full_wake"], ours["full_wake"]
    assert ours["wake_after"] is True, ours["wake_after"]
    # vLLM's own, on the simulated device: its error is the driver's, with
    # neither tag nor bytes; it too wakes once memory is back (a GPU's memory
    # comes back holding what it held: vLLM's KV cache is zeros here only
    # because the simulated device's new memory is).
    assert theirs["full_wake"].startswith("RuntimeError: CUDA Error: out of memory"), theirs["full_wake"]
    assert theirs["wake_after"] is True and theirs["asleep_first_last"] == ours["asleep_first_last"]


def test_the_environment_selects_reservoirs_allocator_under_vllms_own_backend():
    # RESERVOIR_VLLM_SLEEP=1, the worker's config left at vLLM's own backend
    # ("cumem", as a stack that passes no engine argument through): vLLM's
    # backend drives reservoir's allocator, with the same results step by
    # step as reservoir's backend.
    ours, env = run_backend("reservoir"), run_backend("cumem", RESERVOIR_VLLM_SLEEP="1")
    assert env["allocator"] == "ReservoirMemAllocator"
    strip = [{k: v for k, v in s.items() if k != "state"} for s in env["steps"]]
    assert strip == [{k: v for k, v in s.items() if k != "state"} for s in ours["steps"]], env["steps"]
    assert env["asleep_first_last"] == ours["asleep_first_last"] and env["weights_after_cycles"]
    assert env["full_wake"].startswith("OutOfMemoryError: resume of tag '"), env["full_wake"]
    assert env["wake_after"] is True, env["wake_after"]
