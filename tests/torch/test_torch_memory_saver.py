"""The real torch_memory_saver (PyPI) beside reservoir's drop-in
(reservoir.memory_saver), on the simulated CUDA device under the real
PyTorch: the same scripts both ways, in both hook modes, and the public API
compared name by name, so that a new release shows its differences at once.

Environment (ctest): RESERVOIR_TMS_SITE holds torch_memory_saver; the
reservoir package and PyTorch are on PYTHONPATH; LD_PRELOAD the simulated
runtime. What differs on purpose is listed in docs/integrations.md
("torch_memory_saver drop-in").
"""
import glob
import re
import inspect
import json
import os
import subprocess
import sys
import textwrap

import pytest
from scenarios import GRAPH_RL_LOOP, PAUSE_RESUME, PENDING_FREE

SITE = os.environ["RESERVOIR_TMS_SITE"]
SIMCUDA = os.environ["LD_PRELOAD"]
REAL = "torch_memory_saver"
OURS = "reservoir.memory_saver"


# The drop-in's two ways in: reservoir as PyTorch's allocator, or under
# reservoir's interposer (what configure_subprocess gives a child), where
# PyTorch's own allocator asks the interposer for memory.
OURS_UNDER_INTERPOSER = "reservoir.memory_saver under its interposer"


def run(impl, hook_mode, body, extra_env=None):
    env = dict(os.environ)
    env.update(extra_env or {})
    env["PYTHONPATH"] = SITE + ":" + env["PYTHONPATH"]
    if impl == OURS_UNDER_INTERPOSER:
        impl = OURS
        env["LD_PRELOAD"] = os.environ["RESERVOIR_PRELOAD"] + ":" + SIMCUDA
    if impl == REAL and hook_mode == "preload":
        # Its preload mode finds its library in LD_PRELOAD (colon-separated),
        # ahead of the runtime; the library needs the driver on the path.
        [lib] = glob.glob(os.path.join(SITE, "torch_memory_saver_hook_mode_preload_cu13.abi3.so"))
        env["LD_PRELOAD"] = lib + ":" + SIMCUDA
        env["LD_LIBRARY_PATH"] = os.path.dirname(SIMCUDA)
    code = f"import importlib, torch\ntms = importlib.import_module({impl!r}).torch_memory_saver\n"
    code += f"tms.hook_mode = {hook_mode!r}\nMiB = 1 << 20\n" + textwrap.dedent(body)
    return subprocess.run([sys.executable, "-W", "ignore", "-c", code], env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("ours_impl", [OURS, OURS_UNDER_INTERPOSER])
@pytest.mark.parametrize("hook_mode", ["torch", "preload"])
def test_the_same_script_gives_the_same_results(hook_mode, ours_impl):
    real = run(REAL, hook_mode, PAUSE_RESUME)
    ours = run(ours_impl, hook_mode, PAUSE_RESUME)
    assert real.returncode == 0, real.stderr
    assert ours.returncode == 0, ours.stderr
    assert real.stdout.split() == ours.stdout.split() == [
        "128", "64", "True", "True", "True", "True", "True", "True"]


# TMS_INIT_ENABLE: every allocation of the process is tagged from the start,
# with no region() at all (what sglang's subprocesses get); with
# TMS_INIT_ENABLE_CPU_BACKUP its contents survive a pause of every tag.
INIT_ENABLE = """
x = torch.empty(8 * MiB, dtype=torch.uint8, device="cuda")
src = torch.arange(8 * MiB, dtype=torch.int64).to(torch.uint8)
x.copy_(src)
torch.cuda.synchronize()
free0 = torch.cuda.mem_get_info()[0]
tms.pause()
free1 = torch.cuda.mem_get_info()[0]
tms.resume()
print(free1 - free0 >= 8 * MiB, torch.equal(x.cpu(), src), x.data_ptr() == x.data_ptr())
"""


@pytest.mark.parametrize("backup", ["1", "0"])
def test_tms_init_enable_tags_every_allocation_from_the_start(backup):
    env = {"TMS_INIT_ENABLE": "1", "TMS_INIT_ENABLE_CPU_BACKUP": backup}
    real = run(REAL, "preload", INIT_ENABLE, env)
    ours = run(OURS_UNDER_INTERPOSER, "preload", INIT_ENABLE, env)
    assert real.returncode == 0, real.stderr
    assert ours.returncode == 0, ours.stderr
    # Without a backup the bytes after resume are whatever the new memory holds.
    expected = ["True", "True", "True"] if backup == "1" else ["True"]
    assert real.stdout.split()[:len(expected)] == expected, real.stdout
    assert ours.stdout.split()[:len(expected)] == expected, ours.stdout


def test_a_bad_tms_init_value_is_an_error_naming_the_variable():
    ours = run(OURS_UNDER_INTERPOSER, "preload", INIT_ENABLE, {"TMS_INIT_ENABLE": "maybe"})
    assert "TMS_INIT_ENABLE=maybe: not a flag" in ours.stderr, ours.stderr


# A pause of a paused tag, and a resume of a running one: the process
# exits there (with its message); here UsageError, and the process goes on.
MISUSE = {
    "double_pause": ('tms.pause("a")\n', 'tms.pause("a")', 'tms.resume("a")\n',
                     "Cannot pause allocation that is not active"),
    "resume_running": ("", 'tms.resume("a")', "", "Cannot resume allocation that is not paused"),
}


@pytest.mark.parametrize("case", sorted(MISUSE))
def test_misuse_kills_the_process_there_and_is_an_error_here(case):
    before, call, after, message = MISUSE[case]
    body = ('with tms.region(tag="a"):\n'
            '    x = torch.empty(8 * MiB, dtype=torch.uint8, device="cuda")\n'
            + before + "try:\n    " + call + "\n    print('went through')\n"
            "except Exception as e:\n    print(type(e).__name__)\n" + after + "print('alive')\n")
    real = run(REAL, "torch", body)
    assert real.returncode != 0
    assert message in real.stdout + real.stderr
    ours = run(OURS, "torch", body)
    assert ours.returncode == 0, ours.stderr
    assert ours.stdout.split() == ["UsageError", "alive"]


# CUDA tensors made before the first region (as sglang and verl make them):
# PyTorch's own allocator is in charge then, and a region's allocations go
# through a MemPool of the saver's allocator, both ways.
BEFORE_THE_FIRST_REGION = """
    y = torch.full((16 * MiB,), 3, dtype=torch.uint8).to("cuda")
    with tms.region(tag="a", enable_cpu_backup=True):
        x = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")
    x.copy_(torch.arange(64 * MiB, dtype=torch.int64).to(torch.uint8))
    px = x.data_ptr()
    free0 = torch.cuda.mem_get_info()[0]
    tms.pause("a")
    free1 = torch.cuda.mem_get_info()[0]
    tms.resume("a")
    free2 = torch.cuda.mem_get_info()[0]
    print((free1 - free0) // MiB, free2 == free0, x.data_ptr() == px,
          torch.equal(x.cpu(), torch.arange(64 * MiB, dtype=torch.int64).to(torch.uint8)),
          bool((y.cpu() == 3).all()), torch.cuda.get_allocator_backend())
    import os
    os._exit(0)
"""


def prints_both_ways(hook_mode, ours_impl, body, expected, env=None):
    """The real package and the drop-in run `body`; each ends its output
    with `expected`."""
    for impl in (REAL, ours_impl):
        r = run(impl, hook_mode, body, env)
        assert r.returncode == 0, f"{impl}: {r.stderr[-3000:]}"
        assert r.stdout.split()[-len(expected):] == expected, f"{impl}: {r.stdout[-2000:]}"


def test_tensors_before_the_first_region_work_both_ways():
    prints_both_ways("torch", OURS, BEFORE_THE_FIRST_REGION, ["64", "True", "True", "True", "True", "native"])


# Tensors of one tag on two devices (each made in a region opened with its
# device current): pause and resume act on both, from whichever device is
# current, as torch_memory_saver's do.
TWO_DEVICES = """
    keep = []
    for d in (0, 1):
        torch.cuda.set_device(d)
        with tms.region(tag="w"):
            keep.append(torch.empty(256 * MiB, dtype=torch.uint8, device="cuda"))
    torch.cuda.set_device(0)
    free = lambda: (torch.cuda.mem_get_info(0)[0], torch.cuda.mem_get_info(1)[0])
    before = free()
    tms.pause("w")
    paused = free()
    tms.resume("w")
    print((paused[0] - before[0]) // MiB, (paused[1] - before[1]) // MiB, free() == before)
    tms.pause()
    print([(p - q) // MiB for p, q in zip(free(), before)])
    tms.resume()
    import os
    os._exit(0)
"""


@pytest.mark.parametrize("ours_impl", [OURS, OURS_UNDER_INTERPOSER])
@pytest.mark.parametrize("hook_mode", ["torch", "preload"])
def test_pause_and_resume_act_on_every_device(hook_mode, ours_impl):
    prints_both_ways(hook_mode, ours_impl, TWO_DEVICES, ["256", "256", "True", "[256,", "256]"],
                     {"RESERVOIR_SIMCUDA_DEVICES": "2"})


# A program that calls the preload library's C functions itself
# (torch_memory_saver's own cuda_vmm_granularity example does).
C_ENTRY_POINTS = """
    import ctypes
    api = ctypes.CDLL(None)
    pause, resume = api.tms_pause, api.tms_resume
    pause.argtypes = resume.argtypes = [ctypes.c_char_p]
    pause.restype = resume.restype = None
    with tms.region(tag="t"):
        x = torch.empty(32 * MiB, dtype=torch.uint8, device="cuda")
    free0 = torch.cuda.mem_get_info()[0]
    pause(b"t")
    free1 = torch.cuda.mem_get_info()[0]
    resume(None)
    x.copy_(torch.full((32 * MiB,), 4, dtype=torch.uint8))
    print((free1 - free0) // MiB, torch.cuda.mem_get_info()[0] == free0, bool((x.cpu() == 4).all()))
    import os
    os._exit(0)
"""


def test_the_preload_librarys_c_entry_points_pause_and_resume():
    prints_both_ways("preload", OURS_UNDER_INTERPOSER, C_ENTRY_POINTS, ["32", "True", "True"])


def test_an_inherited_allocator_variable_leaves_a_child_under_the_interposer_alone():
    # RESERVOIR_TORCH_ALLOCATOR from the parent, in a child that
    # configure_subprocess() put under the interposer: the child's
    # allocations are the interposer's, and the variable steps aside.
    import reservoir
    site_dir = os.path.dirname(os.path.dirname(os.path.abspath(reservoir.__file__)))
    for value in ("pluggable", "own"):
        ours = run(OURS_UNDER_INTERPOSER, "preload", f"import site\nsite.addsitedir({site_dir!r})\n" +
                   textwrap.dedent(PAUSE_RESUME), {"RESERVOIR_TORCH_ALLOCATOR": value})
        assert ours.returncode == 0, ours.stderr[-3000:]
        assert ours.stdout.split() == ["128", "64", "True", "True", "True", "True", "True", "True"]
        assert (f"reservoir: RESERVOIR_TORCH_ALLOCATOR={value} ignored: this process runs under reservoir's "
                "interposer") in ours.stderr


def test_disable_outside_a_region_asserts_there_and_is_allowed_here():
    body = """
        with tms.disable():
            y = torch.empty(4 * MiB, dtype=torch.uint8, device="cuda")
        print("ok")
    """
    real = run(REAL, "torch", body)
    assert real.returncode != 0
    assert "disable() should be called only when tms is active" in real.stderr
    ours = run(OURS, "torch", body)
    assert ours.returncode == 0 and ours.stdout.split() == ["ok"], ours.stderr


API = """
import inspect, json
mod = importlib.import_module({impl!r})
def sig(v):
    try:
        return str(inspect.signature(v))
    except (TypeError, ValueError):
        return "?"
out = {{}}
cls = type(mod.torch_memory_saver)
for k in dir(cls):
    if k.startswith("_"):
        continue
    v = inspect.getattr_static(cls, k)
    out["torch_memory_saver." + k] = (("property" + (" get" if v.fget else "") + (" set" if v.fset else ""))
                                      if isinstance(v, property) else sig(v))
for k in dir(mod):
    v = getattr(mod, k)
    if not k.startswith("_") and (inspect.isfunction(v) or inspect.isclass(v)):
        out[k] = sig(v)
print(json.dumps(out))
"""

# What reservoir's drop-in does not have yet, or has otherwise (checked
# both ways: a name the real release adds or drops fails this test).
MISSING = {}


def test_the_public_api_name_by_name():
    real = run(REAL, "torch", "print(0)")  # importable
    assert real.returncode == 0, real.stderr
    real_api = json.loads(run(REAL, "torch", API.format(impl=REAL)).stdout)
    ours = json.loads(run(OURS, "torch", API.format(impl=OURS)).stdout)
    for name, signature in MISSING.items():
        assert real_api.get(name) == signature, name
        assert name not in ours, name
    shared = sorted(set(real_api) - set(MISSING))
    assert shared == ["TorchMemorySaver", "configure_subprocess", "torch_memory_saver.cuda_graph",
                      "torch_memory_saver.disable", "torch_memory_saver.enabled",
                      "torch_memory_saver.get_cpu_backup", "torch_memory_saver.hook_mode",
                      "torch_memory_saver.memory_margin_bytes",
                      "torch_memory_saver.pause", "torch_memory_saver.region",
                      "torch_memory_saver.resume", "torch_memory_saver.retain_cpu_backup",
                      "torch_memory_saver.set_disk_backup_dir"]
    for name in shared:
        assert name in ours, name
    # The same signatures, keywords and properties both ways, but
    # hook_mode's (readable here) and the class's (it takes the device here).
    for name in shared:
        if name not in ("torch_memory_saver.hook_mode", "TorchMemorySaver"):
            assert ours[name] == real_api[name], (name, real_api[name], ours[name])
    assert real_api["torch_memory_saver.region"] == (
        "(self, tag: str = 'default', enable_cpu_backup: bool = False, enable_disk_backup: bool = "
        "False, cpu_backup_backend: Optional[Literal['mmap', 'pinned']] = None)")


# Cases run both ways: what the real release prints, the drop-in prints.
SAME_BOTH_WAYS = {
    "nested_regions_inner_tag_wins": """
        with tms.region(tag="outer"):
            a = torch.empty(16 * MiB, dtype=torch.uint8, device="cuda")
            with tms.region(tag="inner"):
                b = torch.empty(32 * MiB, dtype=torch.uint8, device="cuda")
            c = torch.empty(8 * MiB, dtype=torch.uint8, device="cuda")
        free0 = torch.cuda.mem_get_info()[0]
        tms.pause("inner")
        free1 = torch.cuda.mem_get_info()[0]
        tms.pause("outer")
        free2 = torch.cuda.mem_get_info()[0]
        tms.resume()
        print((free1 - free0) // MiB, (free2 - free1) // MiB)
    """,
    "outside_regions_is_never_paused": """
        with tms.region(tag="a"):
            x = torch.empty(16 * MiB, dtype=torch.uint8, device="cuda")
        y = torch.empty(16 * MiB, dtype=torch.uint8, device="cuda")
        y.copy_(torch.full((16 * MiB,), 9, dtype=torch.uint8))
        free0 = torch.cuda.mem_get_info()[0]
        tms.pause()
        print((torch.cuda.mem_get_info()[0] - free0) // MiB, int(y[-1].item()))
        tms.resume()
    """,
    "freed_then_paused": """
        with tms.region(tag="a"):
            x = torch.empty(16 * MiB, dtype=torch.uint8, device="cuda")
            z = torch.empty(4 * MiB, dtype=torch.uint8, device="cuda")
        del x
        free0 = torch.cuda.mem_get_info()[0]
        tms.pause("a")
        free1 = torch.cuda.mem_get_info()[0]
        tms.resume("a")
        print((free1 - free0) // MiB >= 4, torch.cuda.mem_get_info()[0] == free0)
    """,
    "enabled": """
        print(tms.enabled)
    """,
    # (Contents move by copies only: the simulated device runs no kernels.)
    "cpu_backup_with_each_backend": """
        src = torch.arange(4 * MiB, dtype=torch.int32)
        for backend in ["pinned", "mmap"]:
            with tms.region(tag="w_" + backend, enable_cpu_backup=True, cpu_backup_backend=backend):
                x = torch.empty(4 * MiB, dtype=torch.int32, device="cuda")
            x.copy_(src)
            free0 = torch.cuda.mem_get_info()[0]
            tms.pause("w_" + backend)
            freed = (torch.cuda.mem_get_info()[0] - free0) // MiB
            tms.resume("w_" + backend)
            print(backend, freed >= 16, torch.equal(x.cpu(), src))
    """,
    "disk_backup": """
        import tempfile
        spill = tempfile.TemporaryDirectory()
        tms.set_disk_backup_dir(spill.name + "/spill")
        src = (torch.arange(8 * MiB) % 251).to(torch.uint8)
        with tms.region(tag="kv", enable_disk_backup=True):
            x = torch.empty(8 * MiB, dtype=torch.uint8, device="cuda")
        x.copy_(src)
        free0 = torch.cuda.mem_get_info()[0]
        tms.pause("kv")
        freed = (torch.cuda.mem_get_info()[0] - free0) // MiB
        tms.resume("kv")
        print(freed >= 8, torch.equal(x.cpu(), src))
        spill.cleanup()  # the programs end with os._exit: no finalizer would
    """,
    "get_cpu_backup": """
        with tms.region(tag="w", enable_cpu_backup=True):
            x = torch.empty((32, 32), dtype=torch.float32, device="cuda")
        x.copy_(torch.arange(1024, dtype=torch.float32).view(32, 32))
        print(tms.get_cpu_backup(x) is None)
        tms.pause()
        b = tms.get_cpu_backup(x)
        print(b.device, b.dtype, tuple(b.shape), b.stride(), float(b[31, 31]), float(b.sum()))
        tms.resume()
        print(tms.get_cpu_backup(x) is None)
    """,
    "retain_cpu_backup": """
        tms.retain_cpu_backup = True
        print(tms.retain_cpu_backup)
        with tms.region(tag="w", enable_cpu_backup=True):
            x = torch.empty(4096, dtype=torch.int64, device="cuda")
        x.copy_(torch.full((4096,), 3, dtype=torch.int64))
        tms.pause("w")
        tms.resume("w")
        x.copy_(torch.full((4096,), 5, dtype=torch.int64))
        b = tms.get_cpu_backup(x)
        print(int(b.sum()), int(x.cpu().sum()))
        tms.pause("w")
        print(int(tms.get_cpu_backup(x).sum()))
        tms.resume("w")
    """,
    "memory_margin": """
        with tms.region(tag="kv"):
            a = torch.empty(16 * MiB, dtype=torch.uint8, device="cuda")
        free = torch.cuda.mem_get_info()[0]
        tms.memory_margin_bytes = free - 64 * MiB
        try:
            tms.memory_margin_bytes
        except NotImplementedError as e:
            print("getter:", e)
        with tms.region(tag="kv"):
            b = torch.empty(32 * MiB, dtype=torch.uint8, device="cuda")
            print("32 MiB fits")
            try:
                c = torch.empty(128 * MiB, dtype=torch.uint8, device="cuda")
                print("128 MiB fits")
            except torch.OutOfMemoryError:
                print("128 MiB: out of memory")
        tms.memory_margin_bytes = 0
        with tms.region(tag="kv"):
            c = torch.empty(128 * MiB, dtype=torch.uint8, device="cuda")
        print("margin off: fits")
    """,
    "region_arguments_checked": """
        for kwargs in [dict(cpu_backup_backend="mmap"),
                       dict(enable_cpu_backup=True, enable_disk_backup=True)]:
            try:
                with tms.region(tag="w", **kwargs):
                    pass
                print("accepted")
            except (ValueError, AssertionError) as e:
                print(type(e).__name__, str(e).replace(" ", "_"))
    """,
}


@pytest.mark.parametrize("ours_impl", [OURS, OURS_UNDER_INTERPOSER])
@pytest.mark.parametrize("case", sorted(SAME_BOTH_WAYS))
def test_behaviour_case_by_case(case, ours_impl):
    body = textwrap.dedent(SAME_BOTH_WAYS[case]) + "import os\nos._exit(0)\n"
    real = run(REAL, "preload", body)
    ours = run(ours_impl, "preload", body)
    assert real.returncode == 0, real.stderr
    assert ours.returncode == 0, ours.stderr
    # The real library logs some decisions on standard output.
    real_lines = [line for line in real.stdout.splitlines() if not line.startswith("[torch_memory_saver")]
    assert ours.stdout.split() == "\n".join(real_lines).split(), (real.stdout, ours.stdout)


CHILD_IN_CONFIGURE_SUBPROCESS = """
import importlib, os, torch
tms = importlib.import_module(IMPL).torch_memory_saver
MiB = 1 << 20
y = torch.empty(8 * MiB, dtype=torch.uint8, device="cuda")  # before any region
with tms.region(tag="kv"):
    x = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")
free0 = torch.cuda.mem_get_info()[0]
tms.pause("kv")
print((torch.cuda.mem_get_info()[0] - free0) // MiB)
tms.resume("kv")
print(torch.cuda.mem_get_info()[0] == free0, flush=True)
os._exit(0)
"""


def test_configure_subprocess_gives_children_the_interposer():
    # A parent (not itself under an interposer) starts a child inside
    # configure_subprocess(); the child's regions and pauses work from its
    # first CUDA allocation, both ways: there through torch_memory_saver's
    # LD_PRELOAD library, here through reservoir's interposer.
    body = f"""
import os, subprocess, sys
impl = next(n for n in ("torch_memory_saver", "reservoir.memory_saver")
            if getattr(sys.modules.get(n), "torch_memory_saver", None) is tms)
configure_subprocess = importlib.import_module(impl).configure_subprocess
child = {CHILD_IN_CONFIGURE_SUBPROCESS!r}.replace("IMPL", repr(impl))
os.environ["LD_LIBRARY_PATH"] = {os.path.dirname(SIMCUDA)!r}  # the real library's driver
before = os.environ.get("LD_PRELOAD")
with configure_subprocess():
    inside = os.environ["LD_PRELOAD"]
    r = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True)
print(r.returncode, r.stdout.strip(), r.stderr.strip()[-300:])
print(os.environ.get("LD_PRELOAD") == before, inside.endswith(":" + before))
os._exit(0)
"""
    real = run(REAL, "torch", body)
    ours = run(OURS, "torch", body)
    assert real.returncode == 0, real.stderr
    assert ours.returncode == 0, ours.stderr
    real_words = [w for w in real.stdout.split() if not w.startswith("[torch_memory_saver")]
    assert ours.stdout.split() == real_words == ["0", "64", "True", "True", "True"], (
        real.stdout, ours.stdout)


def test_get_cpu_backup_without_a_backup_kills_the_process_there_and_is_none_here():
    body = """
        with tms.region(tag="kv"):
            y = torch.zeros(1024, dtype=torch.float32, device="cuda")
        tms.pause("kv")
        print(tms.get_cpu_backup(y) is None)
        tms.resume("kv")
        print("alive")
    """
    real = run(REAL, "preload", body)
    assert real.returncode != 0
    assert "cpu_backup does not exist, do you forget to enable cpu backup" in real.stdout + real.stderr
    ours = run(OURS, "preload", body)
    assert ours.returncode == 0, ours.stderr
    assert ours.stdout.split() == ["True", "alive"]


# The environment variables the real release's libraries read, and what the
# drop-in does with each (a release that reads a new one fails this test).
ENVIRONMENT = {
    "TMS_DISK_BACKUP_CHUNK_MB": "read by the interposer and the plug-in: chunk_bytes of the copies",
    "TMS_DISK_BACKUP_DIR": "read: the directory of enable_disk_backup regions (and the interposer's)",
    "TMS_INIT_CPU_BACKUP_BACKEND": "read: the backend of enable_cpu_backup regions that name none",
    "TMS_INIT_ENABLE": "read by the interposer and the plug-in: every thread starts in tag 'default'",
    "TMS_INIT_ENABLE_CPU_BACKUP": "read: that initial tag backed up (TMS_INIT_CPU_BACKUP_BACKEND)",
    "TMS_INIT_ENABLE_DISK_BACKUP": "read: that initial tag backed up on disk",
    "TMS_RETAIN_CPU_BACKUP": "read: retain_cpu_backup's starting value",
}


def test_the_environment_variables_it_reads():
    libs = glob.glob(os.path.join(SITE, "torch_memory_saver_hook_mode_*_cu13.abi3.so"))
    assert len(libs) == 2, libs
    for lib in libs:
        with open(lib, "rb") as f:
            data = f.read()
        words = {m.decode() for m in re.findall(rb"(?<![A-Z_])(?:TMS|TORCH_MEMORY_SAVER)_[A-Z_]+(?=\0)", data)}
        assert words == set(ENVIRONMENT), (lib, sorted(words))


# GRAPH_RL_LOOP's result: replayed values 5 and 5, the graph's copy of the
# weights, 116 MiB given back by the first pause of the three tags (32 MiB
# weights, 64 MiB KV cache, the graph pool's 20 MiB segment), every round's
# replay right with addresses and bytes kept, no device memory kept after
# the rounds, and host memory grown by under 64 MiB from round 10 to 100.
GRAPH_RL_RESULT = ["5", "5", "True", "116", "True", "0", "True"]


@pytest.mark.parametrize("impl,hook_mode", [(REAL, "preload"), (OURS, "torch"), (OURS, "preload"),
                                            (OURS_UNDER_INTERPOSER, "preload")])
def test_a_captured_graphs_memory_is_paused_and_resumed_in_an_rl_loop(impl, hook_mode):
    r = run(impl, hook_mode, GRAPH_RL_LOOP)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split() == GRAPH_RL_RESULT


@pytest.mark.parametrize("config,freed", [("expandable_segments:True", "140"), ("policy:paging", "116"),
                                          ("policy:native_paged", "116")])
def test_the_rl_loop_under_every_policy(config, freed):
    # Under expandable segments the graph's pool and the tags' memory come
    # in larger pieces, so the first pause gives back more.
    r = run(OURS, "torch", GRAPH_RL_LOOP, {"RESERVOIR_ALLOC_CONF": config})
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split() == GRAPH_RL_RESULT[:3] + [freed] + GRAPH_RL_RESULT[4:]


def test_the_real_packages_torch_mode_refuses_a_pausable_graph_and_the_drop_in_serves_it():
    # torch_memory_saver 0.0.10 serves cuda_graph in its preload mode only;
    # the drop-in serves it in both (the test above).
    r = run(REAL, "torch", GRAPH_RL_LOOP)
    assert r.returncode != 0
    assert "Only hook_mode=preload supports pauseable CUDA Graph currently" in r.stderr


# A region as the process's first CUDA use: reservoir becomes PyTorch's own
# allocator (the running release has its library), so PyTorch's statistics
# answer; after a call that initializes CUDA (mem_get_info()), PyTorch
# refuses a change of allocator, and the regions go through MemPools of
# reservoir's allocator beside PyTorch's own (docs/integrations.md).
STATISTICS = """
import os
if os.environ.get("INIT_FIRST"):
    torch.cuda.mem_get_info()
with tms.region(tag="a"):
    x = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")
y = torch.empty(2 * MiB, dtype=torch.uint8, device="cuda")
allocated = torch.cuda.memory_allocated()
free0 = torch.cuda.mem_get_info()[0]
tms.pause("a")
free1 = torch.cuda.mem_get_info()[0]
tms.resume("a")
print(torch.cuda.get_allocator_backend(), allocated >= 66 * MiB, (free1 - free0) // MiB)
os._exit(0)
"""


def test_pytorchs_statistics_answer_whichever_way_the_drop_in_came_in():
    ours = run(OURS, "torch", STATISTICS)
    assert ours.returncode == 0, ours.stderr[-3000:]
    assert ours.stdout.split() == ["reservoir", "True", "64"]
    ours = run(OURS, "torch", STATISTICS, {"INIT_FIRST": "1"})
    assert ours.returncode == 0, ours.stderr[-3000:]
    # PyTorch's allocator stays; the region's 64 MiB are counted in its statistics
    # (a MemPool's), and its pause gives them back.
    assert ours.stdout.split() == ["native", "True", "64"]


# The pending-free case (scenarios.py, pytorch/pytorch#189504) inside a
# region: the real package in torch mode ends the process at the device's
# refusal (its allocation callback exits on an error); in preload mode
# PyTorch's ladder raises out-of-memory with the block it waited for at hand,
# and serves the same request an instant later. The drop-in serves it at once
# from that block in both modes. Under its interposer PyTorch's own allocator
# decides (the interposer only supplies its segments): PyTorch's answer.
PENDING_FREE_IN_A_REGION = ("import json\nwith tms.region(tag='kv'):\n" +
                            textwrap.indent(PENDING_FREE.strip(), "    ") + """
    stats = torch.cuda.memory_stats()
print(json.dumps({"outcome": outcome, "ooms": stats["num_ooms"], "retries": stats["num_alloc_retries"]}))
""")


def test_a_pending_free_in_a_region_serves_the_request_the_real_package_fails():
    env = {"RESERVOIR_SIMCUDA_MEMORY": "2GiB", "RESERVOIR_SIMCUDA_KERNELS": "skip"}
    real = run(REAL, "torch", PENDING_FREE_IN_A_REGION, env)
    assert real.returncode == 1 and "out of memory" in real.stderr, (real.returncode, real.stderr[-800:])
    real = run(REAL, "preload", PENDING_FREE_IN_A_REGION, env)
    assert real.returncode == 0, real.stderr[-1500:]
    assert json.loads(real.stdout) == {"outcome": ["oom", 0], "ooms": 1, "retries": 1}
    for mode in ("torch", "preload"):
        ours = run(OURS, mode, PENDING_FREE_IN_A_REGION, env)
        assert ours.returncode == 0, (mode, ours.stderr[-1500:])
        assert json.loads(ours.stdout) == {"outcome": [0], "ooms": 0, "retries": 0}, mode
    under = run(OURS_UNDER_INTERPOSER, "torch", PENDING_FREE_IN_A_REGION, env)
    assert under.returncode == 0, under.stderr[-1500:]
    assert json.loads(under.stdout) == json.loads(real.stdout)
