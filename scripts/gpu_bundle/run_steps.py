"""The GPU bundle's driver (run.sh starts it): runs the GPU proofs, most
important first, each in its own process with a time limit, a failing step
never stopping the others; writes OUTDIR/log.txt (everything every step
printed), OUTDIR/results.json (every figure and the machine's facts) and
OUTDIR/summary.txt (what run.sh prints last).

Exit status: 0 every step passed; 1 a step failed; 2 the bundle or its
arguments are unusable; 77 no GPU here (the checks that need none passed).

Runs on any Python 3.8 or later; the steps that need PyTorch or the
extension module use the Python that has them (RESERVOIR_PYTHON, else
python3 on PATH, else python3.12).
"""
import argparse
import datetime
import glob
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
BIN = os.path.join(HERE, "bin")
LIB = os.path.join(HERE, "lib")
PYDIR = os.path.join(HERE, "python")
TESTS = os.path.join(HERE, "tests")
NO_GPU = 77
# The bundled trace's exact peak of requested memory (tests/CMakeLists.txt
# checks the same number in the build tree).
RESNET_PEAK = 58416096


class Run:
    """The log, the results and the environments the steps run in."""

    def __init__(self, out, budget):
        self.out = out
        self.deadline = time.monotonic() + budget
        self.step_deadline = None  # the running step's own limit (STEPS), when it has one
        self.log = open(os.path.join(out, "log.txt"), "w")
        self.results = {"facts": {}, "steps": {}, "figures": {}}
        self.scratch = tempfile.mkdtemp(prefix="reservoir-gpu-bundle-")
        self.gpu = None          # None: not known yet; else True/False
        self.no_gpu_reason = ""
        self.env_native = dict(os.environ)   # for our own programs (CUDA's libraries found)
        self.env_torch = dict(os.environ)    # for PyTorch's processes (its own CUDA runtime)
        self.torch_python = None
        self.module_python = None
        self.package_dir = None  # where the bundle's wheel was installed, once it is
        self.test_cuda = ""      # PyTorch's test_cuda.py, when given

    def python_path(self):
        """Where the Python steps import reservoir from: the installed wheel,
        else the bundle's loose python/ folder."""
        return self.package_dir or PYDIR

    def say(self, text=""):
        print(text, flush=True)
        self.log.write(text + "\n")
        self.log.flush()

    def left(self):
        """Seconds left to the run, or to the running step's limit if sooner."""
        deadline = self.deadline if self.step_deadline is None else min(self.deadline, self.step_deadline)
        return deadline - time.monotonic()

    def run_left(self):
        return self.deadline - time.monotonic()

    def cmd(self, argv, env=None, timeout=120, cwd=None):
        """Runs argv, its output going to the log; returns (exit status, output).
        A time-out gives status 124."""
        self.say("$ " + " ".join(argv))
        timeout = max(1, min(timeout, self.left()))
        try:
            p = subprocess.run(argv, env=env if env is not None else self.env_native, cwd=cwd,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               errors="replace", timeout=timeout)
            rc, text = p.returncode, p.stdout
        except subprocess.TimeoutExpired as e:
            text = e.stdout if isinstance(e.stdout, str) else (e.stdout or b"").decode("utf8", "replace")
            rc, text = 124, text + f"\n[timed out after {timeout:.0f} s]\n"
        except OSError as e:
            rc, text = 127, f"{argv[0]}: {e}\n"
        self.log.write(text)
        if not text.endswith("\n"):
            self.log.write("\n")
        self.log.write(f"[exit {rc}]\n")
        self.log.flush()
        return rc, text


class StepFailed(Exception):
    pass


class StepSkipped(Exception):
    pass


def first_error(text):
    """The line of a program's output that best says what went wrong."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    for pattern in (r"^FAILED", r"Failure$|error:|Error:|Error\b|FAIL|failed|Traceback|differ",
                    r"timed out|not found|No such file"):
        for i, line in enumerate(lines):
            if re.search(pattern, line):
                if line.startswith("FAILED") and line.endswith(":") and i + 1 < len(lines):
                    return lines[i + 1][:300]
                if line == "Traceback (most recent call last):":
                    return lines[-1][:300]
                if line.endswith("Failure") and i + 1 < len(lines):
                    return f"{line} {lines[i + 1]}"[:300]
                return line[:300]
    return lines[-1][:300] if lines else "(no output)"


def last_json(text):
    for line in reversed(text.strip().splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                continue
    return None


# --- the machine -----------------------------------------------------------

def ldconfig_libs():
    try:
        text = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.TimeoutExpired):
        try:
            text = subprocess.run(["/sbin/ldconfig", "-p"], capture_output=True, text=True,
                                  timeout=20).stdout
        except (OSError, subprocess.TimeoutExpired):
            return {}
    libs = {}
    for line in text.splitlines():
        m = re.match(r"\s*(\S+) \(([^)]*)\) => (\S+)", line)
        if m and "x86-64" in m.group(2) or (m and "64bit" in m.group(2)):
            libs.setdefault(m.group(1), m.group(3))
    return libs


def python_version(python):
    try:
        out = subprocess.run([python, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                             capture_output=True, text=True, timeout=30).stdout.strip()
        return out or None
    except (OSError, subprocess.TimeoutExpired):
        return None


def find_pythons(run):
    """The Python with PyTorch (for the PyTorch steps) and a CPython 3.12 (for
    the extension module, built for 3.12)."""
    candidates = []
    for c in (os.environ.get("RESERVOIR_PYTHON"), shutil.which("python3"), shutil.which("python3.12"),
              shutil.which("python")):
        if c and c not in candidates:
            candidates.append(c)
    versions = {c: python_version(c) for c in candidates}
    usable = [c for c in candidates if versions[c]]
    run.torch_python = usable[0] if usable else None
    run.module_python = next((c for c in usable if versions[c] == "3.12"), None)
    run.results["facts"]["pythons"] = {c: versions[c] for c in candidates}


def find_cuda_libraries(run):
    """libcuda.so.1 (the driver) and libcudart.so.13 (the runtime): where the
    dynamic linker finds them, else in the usual folders, which then go on
    LD_LIBRARY_PATH for our programs."""
    cache = ldconfig_libs()
    found = {}
    extra = []
    site = []
    if run.torch_python:
        try:
            site = json.loads(subprocess.run(
                [run.torch_python, "-c",
                 "import json, site, sysconfig; print(json.dumps([sysconfig.get_paths()['purelib']]"
                 " + site.getsitepackages()))"],
                capture_output=True, text=True, timeout=30).stdout)
        except (OSError, ValueError, subprocess.TimeoutExpired):
            site = []
    searches = {
        "libcuda.so.1": ["/usr/local/nvidia/lib64", "/usr/local/nvidia/lib", "/usr/lib/x86_64-linux-gnu",
                         "/usr/lib64", "/usr/lib/wsl/lib", "/usr/local/cuda/compat"],
        "libcudart.so.13": [os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "lib64"),
                            "/usr/local/cuda/lib64", "/usr/local/cuda/targets/x86_64-linux/lib"]
                           + sorted(glob.glob("/usr/local/cuda-13*/lib64"))
                           + [d for s in site for d in sorted(glob.glob(os.path.join(s, "nvidia", "*", "lib")))
                              + sorted(glob.glob(os.path.join(s, "nvidia", "cuda_runtime", "lib")))],
    }
    for name, dirs in searches.items():
        if name in cache:
            found[name] = cache[name]
            continue
        for d in dirs:
            path = os.path.join(d, name)
            if os.path.exists(path):
                found[name] = path
                extra.append(d)
                break
    for name in list(found):
        found[name] = os.path.realpath(found[name])
    run.results["facts"]["cuda_libraries"] = {n: found.get(n, "not found") for n in searches}
    old = ":" + os.environ["LD_LIBRARY_PATH"] if os.environ.get("LD_LIBRARY_PATH") else ""
    if extra:
        run.env_native["LD_LIBRARY_PATH"] = ":".join(dict.fromkeys(extra)) + old
    # PyTorch brings its own runtime: its processes get the driver's folder only.
    if "libcuda.so.1" in found and "libcuda.so.1" not in cache:
        run.env_torch["LD_LIBRARY_PATH"] = os.path.dirname(found["libcuda.so.1"]) + old
    return found


def glibcxx_versions(found_libstdcxx):
    try:
        with open(found_libstdcxx, "rb") as f:
            data = f.read()
    except OSError:
        return []
    return sorted({tuple(int(x) for x in v.split(b"."))
                   for v in re.findall(rb"GLIBCXX_([0-9]+\.[0-9]+(?:\.[0-9]+)?)", data)})


def as_tuple(text):
    return tuple(int(x) for x in text.split("."))


def collect_facts(run, info):
    f = run.results["facts"]
    f["date"] = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    f["host"] = platform.node()
    f["kernel"] = platform.release()
    f["machine"] = platform.machine()
    f["glibc"] = (os.confstr("CS_GNU_LIBC_VERSION") or "").replace("glibc ", "")
    f["bundle"] = info
    smi = shutil.which("nvidia-smi")
    f["nvidia_smi"] = smi or "not found"
    if smi:
        rc, text = run.cmd([smi, "--query-gpu=name,driver_version,memory.total,compute_cap,pci.bus_id",
                            "--format=csv,noheader"], timeout=60)
        gpus = []
        for line in text.splitlines():
            parts = [p.strip() for p in line.split(",")]
            if rc == 0 and len(parts) >= 5:
                gpus.append(dict(zip(["name", "driver", "memory_total", "compute_capability", "pci"], parts)))
        f["gpus"] = gpus
        rc, text = run.cmd([smi], timeout=60)
        m = re.search(r"CUDA Version:\s*([0-9.]+)", text)
        f["driver_cuda_version"] = m.group(1) if m else "unknown"
    nvcc = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc" if os.path.exists("/usr/local/cuda/bin/nvcc")
                                    else None)
    if nvcc:
        rc, text = run.cmd([nvcc, "--version"], timeout=60)
        m = re.search(r"release ([0-9.]+), (V[0-9.]+)", text)
        f["nvcc"] = f"{m.group(1)} ({m.group(2)})" if m else text.strip().splitlines()[-1:]
    else:
        f["nvcc"] = "not found"
    if run.torch_python:
        rc, text = run.cmd([run.torch_python, "-c",
                            "import json, torch; c = torch.cuda.is_available(); print(json.dumps("
                            "{'torch': torch.__version__, 'torch_cuda': torch.version.cuda,"
                            " 'cuda_available': c, 'device': torch.cuda.get_device_name(0) if c else None,"
                            " 'device_count': torch.cuda.device_count() if c else 0}))"],
                           env=run.env_torch, timeout=120)
        t = last_json(text) if rc == 0 else None
        f["pytorch"] = t or {"torch": None, "why": first_error(text)}
    else:
        f["pytorch"] = {"torch": None, "why": "no python3 found"}


# --- the steps -------------------------------------------------------------

def install_wheel(run, target):
    """The bundle's CPython 3.12 wheel, installed with pip into target:
    (exit status, output, the wheel's path)."""
    wheels = sorted(glob.glob(os.path.join(HERE, "wheels", "reservoir-*-cp312-cp312-*.whl")))
    if len(wheels) != 1:
        return 1, f"error: wheels/ holds {len(wheels)} CPython 3.12 wheels, not one", None
    rc, text = run.cmd([run.module_python, "-m", "pip", "install", "--no-index", "--no-deps",
                        "--disable-pip-version-check", "--target", target, wheels[0]], timeout=180)
    return rc, text, wheels[0]


def step_bundle(run):
    """The checks that need no GPU: the machine meets what the bundle was
    built against, every program and library loads, the CLI replays the
    bundled trace exactly, the PyTorch plug-in runs on a simulated device,
    the Python module runs on host memory."""
    info = run.results["facts"]["bundle"]
    problems = []
    need = info.get("requires", {})
    glibc = run.results["facts"]["glibc"]
    if need.get("GLIBC") and glibc and as_tuple(glibc) < as_tuple(need["GLIBC"]):
        problems.append(f"this machine's glibc is {glibc}; the bundle needs {need['GLIBC']} or later")
    libs = ldconfig_libs()
    libstdcxx = libs.get("libstdc++.so.6") or next(
        (p for p in ("/usr/lib/x86_64-linux-gnu/libstdc++.so.6", "/usr/lib64/libstdc++.so.6")
         if os.path.exists(p)), None)
    if libstdcxx is None:
        problems.append("libstdc++.so.6 not found")
    elif need.get("GLIBCXX"):
        have = glibcxx_versions(os.path.realpath(libstdcxx))
        if have and max(have) < as_tuple(need["GLIBCXX"]):
            problems.append(f"{libstdcxx} provides GLIBCXX up to {'.'.join(map(str, max(have)))}; "
                            f"the bundle needs {need['GLIBCXX']}")
    checks = {}

    # Every program loads (what each prints without a GPU is checked too).
    rc, text = run.cmd([os.path.join(BIN, "reservoir"), "--help"], timeout=60)
    checks["reservoir --help"] = rc == 0
    rc, text = run.cmd([os.path.join(BIN, "reservoir"), "replay",
                        os.path.join(HERE, "traces", "resnet_training.pickle"), "--json"], timeout=120)
    m = re.search(r'"peak_requested_bytes": (\d+)', text)
    checks["replay of the bundled trace"] = rc == 0 and m is not None and int(m.group(1)) == RESNET_PEAK
    if not checks["replay of the bundled trace"]:
        problems.append(f"reservoir replay: peak requested {m.group(1) if m else '?'}, expected {RESNET_PEAK}")
    rc, text = run.cmd([os.path.join(BIN, "gpu_test"), "--gtest_list_tests"], timeout=60)
    checks["gpu_test loads"] = rc in (0, NO_GPU) and ("SKIPPED: no usable GPU" in text or "Gpu." in text)
    rc, text = run.cmd([os.path.join(BIN, "gpu_bench"), "--benchmark_list_tests"], timeout=60)
    checks["gpu_bench loads"] = rc == 0 and ("no usable GPU" in text or "Reservoir_CacheHit" in text)
    if "libcudart.so.13" in run.found:
        rc, text = run.cmd([os.path.join(BIN, "cuda_probe")], timeout=60)
        checks["cuda_probe loads"] = rc in (0, NO_GPU) and "cuda_probe:" in text
    else:
        run.say("cuda_probe: not run, libcudart.so.13 not found (it links the shared CUDA runtime)")

    # The shared libraries load, and the PyTorch plug-in serves a simulated device.
    driver = run.torch_python or sys.executable
    plugin_check = (
        "import ctypes, json, os, sys\n"
        "pre = ctypes.CDLL(sys.argv[2])\n"
        "lib = ctypes.CDLL(sys.argv[1])\n"
        "lib.reservoir_torch_malloc.restype = ctypes.c_void_p\n"
        "lib.reservoir_torch_malloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]\n"
        "lib.reservoir_torch_free.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]\n"
        "lib.reservoir_torch_stats_json.restype = ctypes.c_char_p\n"
        "lib.reservoir_torch_stats_json.argtypes = [ctypes.c_int]\n"
        "p = lib.reservoir_torch_malloc(3 << 20, 0, None)\n"
        "assert p, 'reservoir_torch_malloc returned NULL'\n"
        "lib.reservoir_torch_free(p, 3 << 20, 0, None)\n"
        "s = json.loads(lib.reservoir_torch_stats_json(0))\n"
        "assert s['allocation.all.allocated'] == 1 and s['allocated_bytes.all.current'] == 0, s\n"
        "assert s['reserved_bytes.all.current'] == 20 << 20, s\n"
        "print('plug-in on a simulated device: one 3 MiB allocation in a 20 MiB segment, freed')\n")
    rc, text = run.cmd([driver, "-c", plugin_check, os.path.join(LIB, "libreservoir_torch.so"),
                        os.path.join(LIB, "libreservoir_preload.so")],
                       env={**run.env_native, "RESERVOIR_TORCH_DEVICE": "sim"}, timeout=60)
    checks["libreservoir_torch.so and libreservoir_preload.so load; the plug-in allocates"] = rc == 0
    if rc != 0:
        problems.append("PyTorch plug-in on a simulated device: " + first_error(text))

    # The Python package as pip installs it: the bundle's CPython 3.12 wheel,
    # into a folder of this run's own, checked where it landed; the Python
    # steps then import it from there (from the loose python/ folder only
    # where this fails).
    if run.module_python:
        target = os.path.join(run.scratch, "site")
        rc, text, wheel = install_wheel(run, target)
        if rc == 0:
            version = os.path.basename(wheel).split("-")[1]
            rc, text = run.cmd([run.module_python, os.path.join(TESTS, "installed_check.py"), target,
                                os.path.join(target, "bin"), version,
                                os.path.join(HERE, "traces", "resnet_training.pickle"), "ON"],
                               env={**run.env_native, "PYTHONPATH": target}, timeout=120, cwd=run.scratch)
        checks["the Python module's wheel installs with pip; the installed package's checks pass"] = rc == 0
        if rc == 0:
            run.package_dir = target
            run.results["facts"]["python_package"] = "the wheel " + os.path.basename(wheel)
        else:
            problems.append("Python wheel: " + first_error(text))
            run.results["facts"]["python_package"] = "the loose python/ folder (the wheel failed)"

    # The extension module (CPython 3.12) on host memory.
    if run.module_python:
        env = {**run.env_native, "PYTHONPATH": run.python_path(), "RESERVOIR_TORCH_DEVICE": "host"}
        has_pytest = run.cmd([run.module_python, "-c", "import pytest"], env=env, timeout=60)[0] == 0
        if has_pytest:
            rc, text = run.cmd([run.module_python, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                                os.path.join(TESTS, "test_reservoir.py")], env=env, timeout=240,
                               cwd=run.scratch)
            name = "the Python module's test suite (pytest, host memory)"
        else:
            rc, text = run.cmd([run.module_python, os.path.join(TESTS, "module_smoke.py")], env=env,
                               timeout=60)
            name = "the Python module on host memory (no pytest here: module_smoke.py)"
        checks[name] = rc == 0
        if rc != 0:
            problems.append("Python module: " + first_error(text))
    else:
        run.say("Python module: not checked, no CPython 3.12 here (it is built for 3.12; "
                "set RESERVOIR_PYTHON to one)")
        run.results["facts"]["python_module"] = "not imported: no CPython 3.12 found"
    run.results["figures"]["bundle_checks"] = checks
    failed = [k for k, ok in checks.items() if not ok]
    if failed and not problems:
        problems.append("failed: " + "; ".join(failed))
    if problems:
        raise StepFailed("; ".join(problems))
    return f"{len(checks)} checks passed"


def step_gpu_test(run):
    report = os.path.join(run.scratch, "gpu_test.json")
    rc, text = run.cmd([os.path.join(BIN, "gpu_test"), f"--gtest_output=json:{report}"], timeout=240)
    if rc == NO_GPU:
        run.gpu = False
        last = text.strip().splitlines()[-1] if text.strip() else "gpu_test found no GPU"
        run.no_gpu_reason = last.replace("SKIPPED: no usable GPU here: ", "")
        gpus = run.results["facts"].get("gpus")
        if gpus:
            raise StepFailed(f"nvidia-smi lists {gpus[0]['name']}, but reservoir cannot use it: "
                             f"{run.no_gpu_reason}")
        raise StepSkipped("no GPU: " + run.no_gpu_reason)
    run.gpu = True
    tests = {}
    try:
        with open(report) as f:
            for suite in json.load(f).get("testsuites", []):
                for t in suite.get("testsuite", []):
                    tests[f"{suite['name']}.{t['name']}"] = {
                        "passed": not t.get("failures"), "seconds": float(str(t.get("time", "0")).rstrip("s"))}
    except (OSError, ValueError):
        pass
    m = re.search(r"granularity (\d+), GPUDirect RDMA (\w+)", text)
    run.results["figures"]["gpu_test"] = {
        "tests": tests,
        "vmm_granularity": int(m.group(1)) if m else None,
        "gpudirect_rdma": m.group(2) if m else None}
    if rc != 0:
        raise StepFailed(first_error(text))
    return f"{len(tests)} tests passed"


def need_gpu(run):
    if run.gpu is False:
        raise StepSkipped("no GPU (gpu_test says why)")


def need_torch_cuda(run):
    need_gpu(run)
    t = run.results["facts"].get("pytorch", {})
    if not t.get("torch"):
        raise StepSkipped("PyTorch not importable: " + t.get("why", "?"))
    if not t.get("cuda_available"):
        raise StepSkipped(f"PyTorch {t['torch']} sees no CUDA device")


def python_step(run, argv, env, timeout, figure):
    rc, text = run.cmd([run.torch_python] + argv, env=env, timeout=timeout, cwd=run.scratch)
    if rc == NO_GPU:
        raise StepSkipped(first_error(text))
    result = last_json(text)
    if result is not None:
        run.results["figures"][figure] = result
    if rc != 0:
        raise StepFailed(first_error(text))
    return text


def step_torch_training(run):
    need_torch_cuda(run)
    text = python_step(run, [os.path.join(TESTS, "torch_training_test.py"),
                             os.path.join(LIB, "libreservoir_torch.so"), HERE],
                       run.env_torch, 300, "torch_training")
    m = re.search(r"steps per second: native ([0-9.]+), reservoir ([0-9.]+)", text)
    return f"identical losses; steps/s native {m.group(1)}, reservoir {m.group(2)}" if m else "passed"


def step_torch_pause(run):
    need_torch_cuda(run)
    if not run.module_python or run.module_python != run.torch_python:
        raise StepSkipped("the Python with PyTorch is not CPython 3.12, the module's version")
    text = python_step(run, [os.path.join(TESTS, "torch_pause_test.py")],
                       {**run.env_torch, "PYTHONPATH": run.python_path()}, 300, "torch_pause_last")
    rows = re.findall(r"config '([^']*)': ([0-9.]+) GiB\s+pause ([0-9.]+) GiB/s \(pinned copy ([0-9.]+)\)"
                      r"\s+resume ([0-9.]+) GiB/s \(pinned copy ([0-9.]+)\)", text)
    run.results["figures"]["torch_pause"] = [
        {"config": c, "gib": float(g), "pause_gib_s": float(p), "pinned_d2h_gib_s": float(pd),
         "resume_gib_s": float(r), "pinned_h2d_gib_s": float(ph)} for c, g, p, pd, r, ph in rows]
    return f"{len(rows)} pause/resume cycles under {len({r[0] for r in rows})} policies, outputs identical"


def step_preload_cuda_program(run):
    need_gpu(run)
    if "libcudart.so.13" not in run.found:
        raise StepFailed("libcudart.so.13 not found on this machine (cuda_probe links the shared runtime)")
    probe = os.path.join(BIN, "cuda_probe")
    rc0, plain = run.cmd([probe], timeout=120)
    if rc0 != 0:
        raise StepFailed("without the interposer: " + first_error(plain))
    stats_file = os.path.join(run.scratch, "preload_stats.json")
    env = {**run.env_native, "LD_PRELOAD": os.path.join(LIB, "libreservoir_preload.so"),
           "RESERVOIR_PRELOAD_STATS": stats_file, "RESERVOIR_PRELOAD_SUMMARY": "1"}
    rc1, served = run.cmd([probe], env=env, timeout=120)
    if rc1 != 0:
        raise StepFailed("under the interposer: " + first_error(served))
    line0 = next((x for x in plain.splitlines() if x.startswith("cuda_probe: ok")), "")
    line1 = next((x for x in served.splitlines() if x.startswith("cuda_probe: ok")), "")
    try:
        with open(stats_file) as f:
            stats = json.load(f).get("0", {})
    except (OSError, ValueError):
        raise StepFailed("the interposer wrote no statistics: was it loaded?")
    m = re.search(r"(\d+) allocations checked", line0)
    calls = int(m.group(1)) if m else -1
    run.results["figures"]["preload_cuda_program"] = {
        "output_without": line0, "output_with": line1, "program_allocations": calls,
        "reservoir_allocations": stats.get("allocation.all.allocated"),
        "reservoir_segments": stats.get("segment.all.allocated"),
        "reservoir_reserved_peak": stats.get("reserved_bytes.all.peak")}
    if line0 != line1:
        raise StepFailed(f"outputs differ: '{line0}' without, '{line1}' with the interposer")
    if stats.get("allocation.all.allocated") != calls:
        raise StepFailed(f"the program made {calls} cudaMalloc/cudaMallocAsync calls; reservoir served "
                         f"{stats.get('allocation.all.allocated')}")
    if stats.get("allocated_bytes.all.current") != 0:
        raise StepFailed(f"reservoir still held {stats.get('allocated_bytes.all.current')} bytes at exit")
    return (f"identical output; {calls} allocations served from "
            f"{stats.get('segment.all.allocated')} segments")


def step_preload_torch(run):
    need_torch_cuda(run)
    text = python_step(run, [os.path.join(TESTS, "torch_preload_test.py"),
                             os.path.join(LIB, "libreservoir_preload.so"), run.scratch],
                       run.env_torch, 240, "preload_torch")
    return "identical losses; " + "; ".join(
        line.split(": ", 1)[1] for line in text.splitlines() if line.startswith("preload"))[:200]


def read_benchmarks(path):
    """Google Benchmark's JSON: {run name: its figures}; with repetitions,
    the median aggregate of each."""
    with open(path) as f:
        data = json.load(f)
    rows = {}
    for b in data.get("benchmarks", []):
        if b.get("run_type") == "aggregate" and b.get("aggregate_name") != "median":
            continue
        row = {"real_time": b.get("real_time"), "time_unit": b.get("time_unit"),
               "iterations": b.get("iterations")}
        for k in ("bytes_per_second", "per_2MiB_page_ns", "released_bytes", "median_ms",
                  "median_GiB_per_s"):
            if k in b:
                row[k] = b[k]
        if b.get("error_occurred"):
            row["error"] = b.get("error_message")
        rows[b.get("run_name", b["name"])] = row
    return rows, data.get("context", {})


def gpu_bench_run(run, name, args):
    """One run of gpu_bench; returns (its figures, its errors)."""
    report = os.path.join(run.scratch, f"gpu_bench_{name}.json")
    rc, text = run.cmd([os.path.join(BIN, "gpu_bench")] + args +
                       [f"--benchmark_out={report}", "--benchmark_out_format=json"], timeout=400)
    rows = {}
    try:
        rows, context = read_benchmarks(report)
        run.results["figures"]["gpu_bench_context"] = context
    except (OSError, ValueError):
        pass
    errors = [f"{k}: {v['error']}" for k, v in rows.items() if "error" in v]
    if rc != 0:
        errors.insert(0, first_error(text))
    if not rows and not errors:
        errors.append("gpu_bench wrote no results")
    return rows, errors


def step_gpu_bench(run):
    """The allocator's cache hit and miss beside cudaMalloc and
    cudaMallocAsync, and the VMM calls' costs: medians of five repetitions."""
    need_gpu(run)
    rows, errors = gpu_bench_run(run, "allocator", [
        "--benchmark_filter=^BM_", "--benchmark_repetitions=5",
        "--benchmark_report_aggregates_only=true", "--benchmark_min_time=0.1"])
    run.results["figures"]["gpu_bench"] = rows
    if errors:
        raise StepFailed("; ".join(errors)[:300])
    hit = rows.get("BM_Reservoir_CacheHit/4096/real_time", {}).get("real_time")
    return f"{len(rows)} benchmarks" + (f"; cache-hit pair (4 KiB) {hit:.0f} ns" if hit else "")


def step_pause_resume_bench(run):
    """Pause and resume with backup of 1, 4 and 16 GiB beside a pinned copy of
    the same bytes, and without backup under every policy: medians of five
    cycles of one setup each (a setup of 16 GiB takes seconds)."""
    need_gpu(run)
    rows, errors = gpu_bench_run(run, "saver", ["--benchmark_filter=^(Copy|Pause|Resume)_"])
    versus = {}
    for mib in (1024, 4096, 16384):
        def gib_s(name):
            return rows.get(f"{name}/{mib}/0/iterations:5/manual_time", {}).get("median_GiB_per_s")
        pause, resume = gib_s("Pause_Backup"), gib_s("Resume_Backup")
        d2h, h2d = gib_s("Copy_DeviceToPinned"), gib_s("Copy_PinnedToDevice")
        if pause and d2h:
            versus[f"{mib} MiB"] = {
                "pause_GiB_per_s": pause, "copy_d2h_GiB_per_s": d2h, "pause_over_copy": pause / d2h,
                "resume_GiB_per_s": resume, "copy_h2d_GiB_per_s": h2d,
                "resume_over_copy": resume / h2d if resume and h2d else None}
    run.results["figures"]["pause_resume_bench"] = rows
    run.results["figures"]["pause_resume_vs_pinned_copy"] = versus
    if errors:
        raise StepFailed("; ".join(errors)[:300])
    return "pause/resume over pinned copy: " + ", ".join(
        f"{int(k.split()[0]) >> 10} GiB {v['pause_over_copy']:.2f}/{(v['resume_over_copy'] or 0):.2f}"
        for k, v in versus.items())


def step_torch_native_bench(run):
    need_torch_cuda(run)
    # PyTorch's C++ extension loader needs ninja and a C++ compiler here.
    rc, text = run.cmd([run.torch_python, "-c",
                        "from torch.utils.cpp_extension import verify_ninja_availability as v; v()"],
                       env=run.env_torch, timeout=120)
    if rc != 0:
        raise StepFailed("PyTorch's C++ extension loader cannot run here: " + first_error(text))
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        raise StepFailed(f"no C++ compiler ({compiler}) for PyTorch's C++ extension loader")
    text = python_step(run, [os.path.join(TESTS, "torch_native_bench.py"),
                             os.path.join(LIB, "libreservoir_torch.so"),
                             # kept between runs: a second run skips the compile
                             os.path.join(tempfile.gettempdir(), "reservoir-native-bench-build")],
                       run.env_torch, 420, "torch_native_bench")
    r = run.results["figures"].get("torch_native_bench", {}).get("ratio_reservoir_over_torch", {})
    return "cache-hit pair, reservoir / PyTorch native: " + ", ".join(
        (f"{int(k) >> 20} MiB" if int(k) >= 1 << 20 else f"{int(k) >> 10} KiB") + f" {v:.2f}x"
        for k, v in r.items())


def thirdparty_site(run, names):
    """The bundle's third-party wheels whose names start with `names`,
    installed with pip into a folder of this run (no index, no deps)."""
    wheels = sorted(os.path.join(HERE, "thirdparty", f) for f in os.listdir(os.path.join(HERE, "thirdparty"))
                    if f.endswith(".whl") and f.startswith(tuple(names)))
    if len(wheels) < len(names):
        raise StepFailed(f"thirdparty/ lacks some of {names}: has {wheels}")
    site = os.path.join(run.scratch, "site-" + names[0].rstrip("-_"))
    shutil.rmtree(site, ignore_errors=True)
    rc, text = run.cmd([run.torch_python, "-m", "pip", "install", "--no-index", "--no-deps",
                        "--disable-pip-version-check", "--quiet", "--target", site] + wheels,
                       env=run.env_torch, timeout=120)
    if rc != 0:
        raise StepFailed("pip could not install the bundled wheels: " + first_error(text))
    return site


def result_lines(text):
    rows = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{") and '"impl"' in line:
            try:
                rows.append(json.loads(line))
            except ValueError:
                pass
    return rows


def step_tms_beside_reservoir(run):
    """The real torch_memory_saver (PyPI's wheel) and reservoir's drop-in
    pause and resume the same tensors (1 GiB backed up, 1 GiB not), each in
    its own process: addresses and bytes kept, memory given back, pause and
    resume GiB/s side by side."""
    need_torch_cuda(run)
    if not run.module_python or run.module_python != run.torch_python:
        raise StepSkipped("the Python with PyTorch is not CPython 3.12, the module's version")
    site = thirdparty_site(run, ["torch_memory_saver-"])
    rc, text = run.cmd([run.torch_python, os.path.join(TESTS, "torch_saver_compare.py"), "--tms", site,
                        "--reservoir", run.python_path(), "--gib", "1", "--cycles", "3"],
                       env=run.env_torch, timeout=280, cwd=run.scratch)
    rows = {r["impl"]: r for r in result_lines(text)}
    run.results["figures"]["tms_beside_reservoir"] = rows
    bad = [f"{k}: {v.get('error') or 'addresses or bytes changed'}" for k, v in rows.items()
           if v.get("error") or not v.get("addresses_and_bytes_kept")]
    short = [f"{k}: gave back {v['released_bytes']} of {v['expected_release']} bytes" for k, v in rows.items()
             if "released_bytes" in v and v["released_bytes"] < v["expected_release"]]
    if rc != 0 or len(rows) != 2 or bad or short:
        raise StepFailed("; ".join(bad + short) or first_error(text))
    t, r = rows["torch_memory_saver"], rows["reservoir"]
    return (f"1 GiB backed up: pause GiB/s tms {t['pause_GiB_per_s']:.1f}, reservoir {r['pause_GiB_per_s']:.1f}; "
            f"resume tms {t['resume_GiB_per_s']:.1f}, reservoir {r['resume_GiB_per_s']:.1f}")


def step_rmm_beside_reservoir(run):
    """RMM's cuda, pool, arena and cuda_async resources (PyPI's CUDA 13
    wheels) beside reservoir's pluggable allocator (native policy and
    paging) and PyTorch's own, each serving PyTorch in its own process: the
    cache-hit pair and first-time growth."""
    need_torch_cuda(run)
    site = thirdparty_site(run, ["rmm_cu13-", "librmm_cu13-", "rapids_logger-", "numpy-"])
    rc, text = run.cmd([run.torch_python, os.path.join(TESTS, "rmm_compare.py"),
                        "--reservoir-lib", os.path.join(LIB, "libreservoir_torch.so"), "--rmm", site],
                       env=run.env_torch, timeout=280, cwd=run.scratch)
    rows = {r["impl"]: r for r in result_lines(text)}
    run.results["figures"]["rmm_beside_reservoir"] = rows
    bad = [f"{k}: {v['error']}: {first_error(v.get('output', ''))}" for k, v in rows.items() if v.get("error")]
    if rc != 0 or bad or not rows:
        raise StepFailed("; ".join(bad)[:400] or first_error(text))
    mib = str(1 << 20)
    return "1 MiB hit pair, ns: " + ", ".join(f"{k} {v['hit_pair_ns'][mib]:.0f}" for k, v in rows.items())


def step_own_allocator(run):
    """reservoir as PyTorch's own allocator (use_as_allocator) beside PyTorch's:
    ten training steps per policy with identical losses, memory_stats after
    empty_cache equal under the native policy, a CUDA graph replayed as eager,
    the memory fraction enforced, a snapshot that reservoir verify agrees with."""
    need_torch_cuda(run)
    if not run.module_python or run.module_python != run.torch_python:
        raise StepSkipped("the Python with PyTorch is not CPython 3.12, the module's version")
    text = python_step(run, [os.path.join(TESTS, "own_allocator_check.py"), "--api", "own",
                             "--reservoir-cli", os.path.join(HERE, "bin", "reservoir")],
                       {**run.env_torch, "PYTHONPATH": run.python_path()}, 280, "own_allocator_last")
    rows = []
    for line in text.splitlines():
        if line.startswith("{") and '"config"' in line:
            try:
                rows.append(json.loads(line))
            except ValueError:
                pass
    run.results["figures"]["own_allocator"] = rows
    per = {r.get("config") or "reservoir native": r.get("seconds") for r in rows}
    return "identical losses; seconds per 10 steps: " + ", ".join(
        f"{k} {v:.2f}" for k, v in per.items() if isinstance(v, (int, float)))


def step_native_paged(run):
    """policy:native_paged beside reservoir's native policy on the real
    driver (own allocator, a training loop of varying sequence length):
    reserved memory after every allocation and free compared call by call,
    losses, steps per second; under 2.15's rules never above native."""
    need_torch_cuda(run)
    if not run.module_python or run.module_python != run.torch_python:
        raise StepSkipped("the Python with PyTorch is not CPython 3.12, the module's version")
    rc, text = run.cmd([run.torch_python, os.path.join(TESTS, "native_paged_check.py"), "--steps", "20"],
                       env={**run.env_torch, "PYTHONPATH": run.python_path()}, timeout=280, cwd=run.scratch)
    checks = check_lines(text)
    run.results["figures"]["native_paged"] = checks
    if rc != 0 or len(checks) != 1 or not checks[0].get("ok"):
        raise StepFailed(first_error(text) if not checks else "failed: " + json.dumps(checks[0])[:600])
    parts = []
    for rules, p in checks[0]["pairs"].items():
        sps = p["steps_per_second"]
        parts.append(f"{rules}: {p['calls_above_native']} of {p['calls']} calls above native "
                     f"(most {p['most_above_native_bytes'] / 2**20:.0f} MiB), peak "
                     f"{p['peak_reserved']['native_paged'] / 2**20:.0f} vs {p['peak_reserved']['native'] / 2**20:.0f} MiB, "
                     f"steps/s {sps['native_paged']:.1f} vs {sps['native']:.1f}")
    return "; ".join(parts)


def check_lines(text):
    """The JSON lines {"check": ...} a check script prints, one per check."""
    checks = []
    for line in text.splitlines():
        if line.startswith("{") and '"check"' in line:
            try:
                checks.append(json.loads(line))
            except ValueError:
                pass
    return checks


def step_graphs(run):
    """CUDA graphs with real kernels: the stream-capture probe's answers beside
    the simulated device's, the same graph pools under PyTorch's allocator and
    reservoir's two ways in, a captured forward equal to eager before and
    after its tag is paused, under every policy, and the RL loop of the drop-in
    beside the real torch_memory_saver's preload mode."""
    need_torch_cuda(run)
    if not run.module_python or run.module_python != run.torch_python:
        raise StepSkipped("the Python with PyTorch is not CPython 3.12, the module's version")
    argv = [os.path.join(TESTS, "graphs_check.py")]
    try:
        argv += ["--tms", thirdparty_site(run, ["torch_memory_saver-"])]
    except (StepSkipped, StepFailed):
        pass  # the drop-in alone; graphs_check says which ran
    rc, text = run.cmd([run.torch_python] + argv, env={**run.env_torch, "PYTHONPATH": run.python_path()},
                       timeout=280, cwd=run.scratch)
    checks = check_lines(text)
    run.results["figures"]["graphs"] = checks
    failed = [c["check"] for c in checks if not c.get("ok")]
    if rc != 0 or failed or len(checks) != 4:
        raise StepFailed("failed: " + (", ".join(failed) or first_error(text)))
    differ = next((c for c in checks if c["check"] == "stream_capture"), {}).get("differ", {})
    return (f"pools as PyTorch's; replays equal eager after pause under 4 policies; "
            f"{len(differ)} stream-capture answers differ from the simulated device's")


def step_cudnn(run):
    """cuDNN's requests on the GPU (tests/cudnn_workspaces.py): the allocation
    sequences of a convolution net, an LSTM and cuDNN attention, forward and
    backward, which the simulated cuDNN's model is corrected by."""
    need_torch_cuda(run)
    rc, text = run.cmd([run.torch_python, os.path.join(TESTS, "cudnn_workspaces.py")], env=run.env_torch,
                       timeout=60, cwd=run.scratch)
    if rc == NO_GPU:
        raise StepSkipped(first_error(text))
    checks = [c for c in check_lines(text) if c.get("check") == "cudnn"]
    if checks:
        run.results["figures"]["cudnn"] = checks[0]
    if rc != 0 or not checks or not checks[0].get("ok"):
        errors = checks[0].get("errors", {}) if checks else {}
        raise StepFailed("failed: " + (", ".join(f"{k} ({v})" for k, v in errors.items()) or first_error(text)))
    r = checks[0]
    return (f"cuDNN {r['cudnn']}: {len(r['requests'])} programs' requests recorded "
            f"({sum(len(v) for v in r['requests'].values())} allocations)")


def step_explain_oom(run):
    """The answer at an out-of-memory error with real CUDA (reservoir.explain_oom):
    a fragmenting program under a 2 GiB memory fraction gets PyTorch's message
    then reservoir's lines, with the snapshot and the page written; a
    batch-size finder under a 4 GiB fraction, RESERVOIR_EXPLAIN_OOM=1, under
    PyTorch's allocator and reservoir's own: the batch and errors of the loop
    with nothing explained, each error answered for itself, the cost per
    error; the cost of the recording per allocate/free pair and training step."""
    need_torch_cuda(run)
    if not run.module_python or run.module_python != run.torch_python:
        raise StepSkipped("the Python with PyTorch is not CPython 3.12, the module's version")
    rc, text = run.cmd([run.torch_python, os.path.join(TESTS, "explain_oom_check.py"),
                        "--bench", os.path.join(TESTS, "torch_recording_bench.py")],
                       env={**run.env_torch, "PYTHONPATH": run.python_path()}, timeout=280, cwd=run.scratch)
    checks = check_lines(text)
    run.results["figures"]["explain_oom"] = checks
    failed = [c["check"] for c in checks if not c.get("ok")]
    if rc != 0 or failed or len(checks) != 3:
        problems = [f"{c['check']}: {'; '.join(c.get('problems') or [c.get('error', '')])}"[:300]
                    for c in checks if not c.get("ok")]
        raise StepFailed("failed: " + ("; ".join(problems) or first_error(text)))
    cost = next(c for c in checks if c["check"] == "recording_cost")
    at = next(c for c in checks if c["check"] == "answer")
    finder = next(c for c in checks if c["check"] == "batch_finder")
    return (f"answered in {at['seconds_at_error']:.2f} s; batch finder: batch {finder['batch']} after "
            f"{finder['errors']} errors, each answered, "
            + ", ".join(f"{m} {r['ms_per_error']:.0f} ms" for m, r in finder["explained"].items())
            + f" per error; recording: pair {cost['pair']['explain'] / cost['pair']['off']:.2f}x, step "
            f"{cost['step']['explain'] / cost['step']['off']:.2f}x of none")


def step_service(run):
    """bench/torch_service.py on the real driver: an inference service of
    2,000 requests under a 12 GiB memory fraction, each failed request caught
    and the next served, under PyTorch's default, expandable segments,
    reservoir's native and policy:native_paged; then 300 requests with the
    live answer on (its cost per error and its verdict on each failure).
    native_paged must fail no request the device serves alone and no more than
    the others; every answer's first line must name the failure's class."""
    need_torch_cuda(run)
    if not run.module_python or run.module_python != run.torch_python:
        raise StepSkipped("the Python with PyTorch is not CPython 3.12, the module's version")
    out = os.path.join(run.scratch, "service.json")
    rc, text = run.cmd([run.torch_python, os.path.join(TESTS, "torch_service.py"), "--requests", "2000",
                        "--explained", "300", "--timeout", "200", "--json", out],
                       env={**run.env_torch, "PYTHONPATH": run.python_path()}, timeout=280, cwd=run.scratch)
    try:
        with open(out) as f:
            figures = json.load(f)
    except (OSError, ValueError):
        raise StepFailed(first_error(text))
    run.results["figures"]["service"] = figures
    if rc != 0:
        raise StepFailed(first_error(text))
    service, explained = figures["service"], figures["explained"]
    problems = []
    paged = service["native_paged"]
    if paged["fragmentation"]:
        problems.append(f"native_paged failed {paged['fragmentation']} requests the device serves alone")
    for other in ("default", "expandable"):
        if paged["failed"] > service[other]["failed"]:
            problems.append(f"native_paged failed {paged['failed']}, {other} {service[other]['failed']}")
    for mode, r in explained.items():
        v = r["verdicts"]
        if v["disagree"] or v["none"]:
            problems.append(f"{mode}: {v['disagree']} answers name another cause, {v['none']} none")
    if problems:
        raise StepFailed("; ".join(problems))
    return ("served/failed/fragmentation: " +
            ", ".join(f"{m} {r['served']}/{r['failed']}/{r['fragmentation']}" for m, r in service.items()) +
            "; the answer per error: " +
            ", ".join(f"{m} {r['ms_per_failed']:.0f} ms" for m, r in explained.items()))


def step_pytorch_tests(run):
    """PyTorch's own allocator and memory tests (the test_cuda.py given with
    --test-cuda, read from PyTorch's repository at this machine's release)
    with real kernels, under PyTorch's allocator and under reservoir's
    (RESERVOIR_TORCH_ALLOCATOR=own): every test that passes the first way
    must pass the second."""
    need_torch_cuda(run)
    if not run.module_python or run.module_python != run.torch_python:
        raise StepSkipped("the Python with PyTorch is not CPython 3.12, the module's version")
    test_file = run.test_cuda or os.environ.get("RESERVOIR_TEST_CUDA")
    release = run.results["facts"]["pytorch"].get("torch")
    if not test_file:
        raise StepSkipped(f"no copy of PyTorch's test/test_cuda.py given (run.sh OUT --test-cuda FILE; "
                          f"the file of the release this machine runs, {release})")
    if not os.path.isfile(test_file):
        raise StepFailed(f"--test-cuda {test_file}: no such file")
    # What the file imports beside PyTorch, and pytest, which runs it.
    site = thirdparty_site(run, ["expecttest-", "psutil-", "nvidia_ml_py-", "pytest-", "pluggy-", "iniconfig-",
                                 "pygments-", "packaging-"])
    package = run.package_dir
    if package is None:  # the bundle step did not run (--only): the wheel, as it installs it
        package = os.path.join(run.scratch, "site")
        rc, text, _ = install_wheel(run, package)
        if rc != 0:
            raise StepFailed("the bundle's wheel does not install: " + first_error(text))
    report = os.path.join(run.scratch, "pytorch_tests.json")
    # Within the step's limit: each way's batch gets 4 x --timeout, a test
    # run again alone --timeout (a tenth of what is left, 20 to 120 s).
    per_test = int(max(20, min(120, run.left() / 10)))
    rc, text = run.cmd([run.torch_python, os.path.join(TESTS, "peer_suites.py"), "--device", "as-is",
                        "--pytorch", os.path.abspath(test_file), "--package", package, "--site", site,
                        "--batch", "--jobs", "1", "--timeout", str(per_test), "--json", report],
                       env=run.env_torch, timeout=560, cwd=run.scratch)
    try:
        with open(report) as f:
            result = json.load(f)["pytorch"]
    except (OSError, ValueError, KeyError):
        raise StepFailed(first_error(text))
    run.results["figures"]["pytorch_tests"] = result
    names = result["results"]
    counts = {way: {o: sum(r[k] == o for r in names.values()) for o in ("pass", "fail", "skip", "timeout")}
              for k, way in enumerate(("pytorch", "reservoir"))}
    result["counts"] = counts
    if rc not in (0, 1) or (rc == 1) != bool(result["differ"]):
        raise StepFailed(first_error(text))
    if result["differ"]:
        raise StepFailed(f"{len(result['differ'])} of the tests PyTorch's allocator passes fail under "
                         "reservoir's: " + ", ".join(d.split("::")[-1] for d in result["differ"][:8]))
    p, r = counts["pytorch"], counts["reservoir"]
    return (f"PyTorch {result['release']}'s test_cuda.py, {len(names)} tests: PyTorch's allocator passes "
            f"{p['pass']} (skips {p['skip']}), reservoir's {r['pass']} (skips {r['skip']}); none passes only "
            f"under PyTorch's")


STEPS = [
    # Most needed first (what has never run on a GPU), then what the first
    # GPU run proved on 2026-11-25. The last column is each step's limit in
    # seconds; the run's budget (--budget) skips the steps that no longer fit.
    ("bundle", "the bundle loads; checks that need no GPU", step_bundle, 90),
    ("pytorch_tests", "PyTorch's test_cuda.py allocator tests under PyTorch's allocator and reservoir's",
     step_pytorch_tests, 240),
    ("own_allocator", "reservoir as PyTorch's own allocator: training, stats, a CUDA graph, a verified snapshot",
     step_own_allocator, 150),
    ("native_paged", "policy:native_paged vs native on the real driver: reserved at every call, steps/s",
     step_native_paged, 120),
    ("graphs", "CUDA graphs: capture answers, pools as PyTorch's, replays equal eager after a pause",
     step_graphs, 120),
    ("cudnn", "what cuDNN asks the allocator for: a convolution net, an LSTM, cuDNN attention",
     step_cudnn, 60),
    ("explain_oom", "the answer at an out-of-memory error, and its recording's cost",
     step_explain_oom, 150),
    ("service", "an inference service meeting out-of-memory errors: four settings, the live answer on each",
     step_service, 240),
    ("tms_beside_reservoir", "the real torch_memory_saver and reservoir's drop-in on the same tensors",
     step_tms_beside_reservoir, 120),
    ("torch_training", "PyTorch training, native vs reservoir: identical losses and stats",
     step_torch_training, 300),
    ("gpu_test", "GPU test suite: both CUDA backends, every policy, the saver", step_gpu_test, 240),
    ("torch_pause", "PyTorch pause/resume of weights and KV cache, every policy", step_torch_pause, 300),
    ("preload_cuda_program", "LD_PRELOAD interposer under a plain CUDA program",
     step_preload_cuda_program, 240),
    ("preload_torch", "LD_PRELOAD interposer under PyTorch", step_preload_torch, 240),
    ("gpu_bench", "allocator cache hit/miss vs cudaMalloc and cudaMallocAsync, VMM call costs",
     step_gpu_bench, 300),
    ("torch_native_bench", "PyTorch's native allocator from C++ beside reservoir",
     step_torch_native_bench, 420),
    ("pause_resume_bench", "pause/resume of 1, 4, 16 GiB vs a pinned copy; without backup per policy",
     step_pause_resume_bench, 400),
    ("rmm_beside_reservoir", "RMM's pool, arena, cuda_async resources vs reservoir's cache hit and growth",
     step_rmm_beside_reservoir, 300),
]


def main():
    parser = argparse.ArgumentParser(description="Run the GPU proofs of the reservoir bundle.")
    parser.add_argument("outdir")
    parser.add_argument("--budget", type=float, default=float(os.environ.get("RESERVOIR_BUNDLE_BUDGET", 420)),
                        help="seconds for the whole run (default 420); steps that do not fit are skipped")
    parser.add_argument("--only", default="", help="comma-separated steps to run (default: all)")
    parser.add_argument("--limit", action="append", default=[], metavar="STEP=SECONDS",
                        help="another time limit for a step (again for each step); the defaults are "
                             "README.txt's")
    parser.add_argument("--test-cuda", default="",
                        help="PyTorch's test/test_cuda.py at this machine's release (the pytorch_tests step)")
    args = parser.parse_args()
    names = [s[0] for s in STEPS]
    only = [x for x in args.only.split(",") if x]
    for x in only:
        if x not in names:
            print(f"run.sh: unknown step '{x}'; the steps are: {', '.join(names)}", file=sys.stderr)
            return 2
    limits = {name: limit for name, _, _, limit in STEPS}
    for item in args.limit:
        name, _, seconds = item.partition("=")
        try:
            value = float(seconds)
        except ValueError:
            value = 0
        if name not in limits or value <= 0:
            print(f"run.sh: --limit {item}: expected STEP=SECONDS with a step of {', '.join(names)} "
                  "and a positive number", file=sys.stderr)
            return 2
        limits[name] = value
    os.makedirs(args.outdir, exist_ok=True)
    run = Run(args.outdir, args.budget)
    run.test_cuda = args.test_cuda
    try:
        with open(os.path.join(HERE, "BUILD_INFO.json")) as f:
            info = json.load(f)
    except (OSError, ValueError) as e:
        print(f"run.sh: the bundle is incomplete: BUILD_INFO.json: {e}", file=sys.stderr)
        return 2
    missing = [p for p in ("bin/gpu_test", "bin/gpu_bench", "bin/reservoir", "bin/cuda_probe",
                           "lib/libreservoir_torch.so", "lib/libreservoir_preload.so")
               if not os.path.exists(os.path.join(HERE, p))]
    if missing:
        print(f"run.sh: the bundle is incomplete: missing {', '.join(missing)}", file=sys.stderr)
        return 2

    started = time.monotonic()
    run.say(f"== reservoir GPU bundle {info.get('describe', '?')} (built {info.get('built', '?')})")
    find_pythons(run)
    run.found = find_cuda_libraries(run)
    collect_facts(run, info)
    facts = run.results["facts"]
    gpu = facts.get("gpus", [{}])[0] if facts.get("gpus") else {}
    run.say(f"== {facts['date']}  GPU: {gpu.get('name', 'none seen')}  driver {gpu.get('driver', '?')} "
            f"(CUDA {facts.get('driver_cuda_version', '?')})  nvcc {facts.get('nvcc')}  "
            f"PyTorch {facts['pytorch'].get('torch')} (CUDA {facts['pytorch'].get('torch_cuda')})")
    run.say(f"== CUDA libraries: {facts['cuda_libraries']}")

    outcomes = []
    for name, title, fn, _ in STEPS:
        limit = limits[name]
        if only and name not in only:
            continue
        run.say(f"\n== {name}: {title}")
        t0 = time.monotonic()
        if run.run_left() < 20:
            status, note = "skipped", f"the run's {args.budget:.0f} s budget was spent"
        else:
            run.step_deadline = t0 + limit
            try:
                note = fn(run) or ""
                status = "passed"
            except StepSkipped as e:
                status, note = "skipped", str(e)
            except StepFailed as e:
                status, note = "failed", str(e)
            except Exception as e:  # a broken step must not stop the others
                status, note = "failed", f"{type(e).__name__}: {e}"
            run.step_deadline = None
            if status == "failed" and time.monotonic() - t0 >= limit - 1:
                note = f"stopped at its {limit:.0f} s limit: {note}"
        seconds = time.monotonic() - t0
        run.results["steps"][name] = {"status": status, "note": note, "seconds": round(seconds, 1)}
        outcomes.append((name, status, note, seconds))
        run.say(f"== {name}: {status.upper()} ({seconds:.0f} s) {note}")

    total = time.monotonic() - started
    failed = [o for o in outcomes if o[1] == "failed"]
    if failed:
        code, verdict = 1, f"FAILED: {len(failed)} of {len(outcomes)} steps failed"
    elif run.gpu is False and not facts.get("gpus"):
        code, verdict = NO_GPU, f"NO GPU FOUND ({run.no_gpu_reason}): only the checks that need none ran, and passed"
    else:
        code, verdict = 0, f"PASSED: every step ({len(outcomes)})"
    run.results["exit_status"] = code
    run.results["verdict"] = verdict
    run.results["seconds"] = round(total, 1)
    with open(os.path.join(args.outdir, "results.json"), "w") as f:
        json.dump(run.results, f, indent=1, default=str)
        f.write("\n")
    lines = [f"reservoir GPU bundle {info.get('describe', '?')}: {gpu.get('name', 'no GPU')}, "
             f"driver {gpu.get('driver', '-')}, PyTorch {facts['pytorch'].get('torch') or '-'}, "
             f"{facts['date']}, {total:.0f} s"]
    for name, status, note, seconds in outcomes:
        lines.append(f"  {status.upper():8} {name:22} {seconds:5.0f} s  {note}")
    lines.append(verdict)
    lines.append(f"full log: {os.path.join(args.outdir, 'log.txt')}; figures: "
                 f"{os.path.join(args.outdir, 'results.json')}")
    summary = "\n".join(lines)
    with open(os.path.join(args.outdir, "summary.txt"), "w") as f:
        f.write(summary + "\n")
    run.log.write("\n" + summary + "\n")
    run.log.close()
    print("\n" + summary)
    shutil.rmtree(run.scratch, ignore_errors=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
