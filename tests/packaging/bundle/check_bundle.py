"""Checks the GPU bundle (make gpu-bundle) on a machine without a GPU:
its size, that every ELF file in it needs nothing beyond glibc, libstdc++ and
libgcc (the CUDA program also the CUDA runtime, found at run time), that it
holds what the proofs run, and that run.sh, copied into an empty directory and
started under `env -i`, runs the checks that need no GPU, says no GPU was
found and exits with 77; and that it refuses bad arguments and an incomplete
bundle with exit 2 and a message that says what is wrong.

Usage: check_bundle.py BUNDLE_DIR
"""
import json
import os
import shutil
import subprocess
import sys
import tempfile

from checks import check, finish

bundle = os.path.abspath(sys.argv[1])


ALLOWED = {"libc.so.6", "libm.so.6", "libdl.so.2", "libpthread.so.0", "librt.so.1",
           "ld-linux-x86-64.so.2", "libstdc++.so.6", "libgcc_s.so.1"}
EXTRA = {"bin/cuda_probe": {"libcudart.so.13"}}  # a plain CUDA program links the shared runtime
# The pluggable allocator's hooks, per PyTorch release: PyTorch's own
# libraries, found loaded once `import torch` has run.
TORCH_LIBS = {"libtorch_cuda.so", "libc10_cuda.so", "libc10.so"}
GPU_TORCH = "2.11.0"  # the release the GPU machines have
EXPECTED = ["run.sh", "run_steps.py", "README.txt", "BUILD_INFO.json",
            "bin/gpu_test", "bin/gpu_bench", "bin/reservoir", "bin/cuda_probe",
            "lib/libreservoir_torch.so", "lib/libreservoir_preload.so",
            "python/reservoir/__init__.py", "python/reservoir/memory_saver.py",
            "python/reservoir/_core.cpython-312-x86_64-linux-gnu.so", "python/reservoir_torch.py",
            "tests/torch_training_test.py", "tests/torch_pause_test.py", "tests/torch_preload_test.py",
            "tests/torch_native_bench.py", "tests/torch_native_bench.cpp", "tests/test_reservoir.py",
            "tests/module_smoke.py", "tests/installed_check.py", "traces/resnet_training.pickle",
            "tests/torch_saver_compare.py", "tests/rmm_compare.py", "tests/own_allocator_check.py",
            "tests/graphs_check.py", "tests/stream_capture_sim.json", "tests/scenarios.py",
            "tests/explain_oom_check.py", "tests/torch_recording_bench.py", "tests/torch_service.py",
            "tests/native_paged_check.py", "tests/cudnn_workspaces.py",
            "tests/peer_suites.py",
            f"python/reservoir/lib/torch-{GPU_TORCH}/libreservoir_torch_hooks.so"]

# What it holds, and how big it is.
for rel in EXPECTED:
    check(os.path.isfile(os.path.join(bundle, rel)), f"holds {rel}")
third = sorted(f for f in os.listdir(os.path.join(bundle, "thirdparty")) if f.endswith(".whl"))
for name in ("torch_memory_saver-0.0.10-", "rmm_cu13-26.10.0-", "librmm_cu13-26.10.0-", "rapids_logger-", "numpy-",
             "expecttest-0.3.0-", "psutil-7.2.2-", "nvidia_ml_py-", "pytest-9.2.0-", "pluggy-", "iniconfig-",
             "pygments-", "packaging-"):
    check(any(f.startswith(name) for f in third), f"thirdparty/ holds {name}* ({third})")
wheels = sorted(f for f in os.listdir(os.path.join(bundle, "wheels")) if f.endswith(".whl"))
check(len(wheels) == 1 and wheels[0].startswith("reservoir-") and "-cp312-cp312-linux_x86_64" in wheels[0],
      f"holds the package as one CPython 3.12 wheel ({wheels})")
size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(bundle) for f in fs)
# The device machines take at most 64 MiB of carried files in all: the bundle,
# and beside it PyTorch's test_cuda.py (0.3 MiB) and the run's own files.
check(size <= 56 << 20, f"size {size / (1 << 20):.1f} MiB <= 56 MiB")

# Every ELF file's dynamic section.
elves = []
for d, _, files in os.walk(bundle):
    for f in files:
        path = os.path.join(d, f)
        with open(path, "rb") as fh:
            if fh.read(4) == b"\x7fELF":
                elves.append(path)
hooks = [e for e in elves if e.endswith("/libreservoir_torch_hooks.so")]
check(len(elves) - len(hooks) == 7 and hooks,
      f"{len(elves)} ELF files (4 programs, 2 libraries, 1 extension module, "
      f"{len(hooks)} PyTorch hooks libraries)")
for path in hooks:
    EXTRA[os.path.relpath(path, bundle)] = TORCH_LIBS
for path in sorted(elves):
    rel = os.path.relpath(path, bundle)
    text = subprocess.run(["readelf", "-d", path], capture_output=True, text=True, check=True).stdout
    needed = set()
    for line in text.splitlines():
        if "(NEEDED)" in line:
            needed.add(line.split("[", 1)[1].rstrip("]"))
    extra = needed - ALLOWED - EXTRA.get(rel, set())
    check(not extra, f"{rel} needs only glibc/libstdc++/libgcc"
          + (f" and {', '.join(sorted(EXTRA[rel]))}" if rel in EXTRA else "")
          + (f" (also {', '.join(sorted(extra))})" if extra else ""))
    check("RPATH" not in text and "RUNPATH" not in text, f"{rel} has no RPATH/RUNPATH into a build tree")
    if rel == "bin/cuda_probe":
        check("libcudart.so.13" in needed, "bin/cuda_probe links the shared CUDA runtime (for LD_PRELOAD)")

# README.txt names every step in the driver's order, with its limit.
sys.path.insert(0, bundle)
import run_steps  # noqa: E402 - the bundle's own driver

with open(os.path.join(bundle, "README.txt")) as f:
    readme = [line.split() for line in f if line.startswith("  ") and not line.startswith("   ")]
listed = [(words[0], words[1]) for words in readme if len(words) == 2 and words[1].startswith("[")]
check(listed == [(name, f"[{limit}]") for name, _, _, limit in run_steps.STEPS],
      f"README.txt lists the {len(run_steps.STEPS)} steps in order with their limits ({listed})")

with open(os.path.join(bundle, "BUILD_INFO.json")) as f:
    info = json.load(f)
check(info.get("python_module_built_for", "").startswith("3.12."),
      f"extension module built for CPython {info.get('python_module_built_for')}")
check(all(k in info.get("requires", {}) for k in ("GLIBC", "GLIBCXX")),
      f"BUILD_INFO.json says what it needs of glibc and libstdc++: {info.get('requires')}")


def run_copy(env_extra, args=(), remove=()):
    """Copies the bundle into an empty directory and runs its run.sh there
    under env -i (plus env_extra); returns (exit status, output, out dir)."""
    top = tempfile.mkdtemp(prefix="bundle-check-")
    copy = os.path.join(top, "gpu-bundle")
    shutil.copytree(bundle, copy, symlinks=True)
    for rel in remove:
        os.remove(os.path.join(copy, rel))
    cwd = os.path.join(top, "empty")
    os.mkdir(cwd)
    out = os.path.join(top, "out")
    env_args = [f"{k}={v}" for k, v in env_extra.items()]
    p = subprocess.run(["env", "-i"] + env_args + ["/bin/bash", os.path.join(copy, "run.sh"), out, *args],
                       cwd=cwd, capture_output=True, text=True, timeout=600)
    return p.returncode, p.stdout + p.stderr, out, top


def check_no_gpu_run(env_extra, label, module_checked):
    rc, text, out, top = run_copy(env_extra)
    print(text[-3000:])
    check(rc == 77, f"{label}: exit status {rc}, expected 77 (no GPU)")
    check(sorted(os.listdir(out)) == ["log.txt", "results.json", "summary.txt"] if os.path.isdir(out) else False,
          f"{label}: OUTDIR holds log.txt, results.json and summary.txt")
    try:
        with open(os.path.join(out, "results.json")) as f:
            r = json.load(f)
    except (OSError, ValueError) as e:
        check(False, f"{label}: results.json readable ({e})")
        return
    steps = r.get("steps", {})
    names = ["bundle", "torch_training", "gpu_test", "torch_pause", "preload_cuda_program",
             "preload_torch", "gpu_bench", "torch_native_bench", "pause_resume_bench"]
    check([k for k in steps if k in names] == names, f"{label}: every step reported, in order")
    check(steps.get("bundle", {}).get("status") == "passed",
          f"{label}: the checks that need no GPU passed ({steps.get('bundle')})")
    check(all(steps.get(n, {}).get("status") == "skipped" for n in names[1:]),
          f"{label}: every GPU step skipped")
    check(steps.get("gpu_test", {}).get("note", "").startswith("no GPU: "),
          f"{label}: gpu_test says why there is no GPU")
    checks = r.get("figures", {}).get("bundle_checks", {})
    check(checks.get("replay of the bundled trace") is True, f"{label}: the CLI replayed the bundled trace exactly")
    check(any(k.startswith("libreservoir_torch.so") and v for k, v in checks.items()),
          f"{label}: the plug-in and the interposer loaded; the plug-in allocated on a simulated device")
    module = [k for k in checks if k.startswith("the Python module")]
    check(bool(module) == module_checked and all(checks[k] for k in module),
          f"{label}: extension module {'checked' if module_checked else 'not checked'} ({module})")
    facts = r.get("facts", {})
    check(all(k in facts for k in ("date", "glibc", "bundle", "nvcc", "pytorch", "cuda_libraries")),
          f"{label}: results.json holds the machine's facts")
    check(r.get("exit_status") == 77 and r.get("verdict", "").startswith("NO GPU FOUND"),
          f"{label}: verdict {r.get('verdict', '')[:60]}")
    with open(os.path.join(out, "summary.txt")) as f:
        summary = f.read()
    check("NO GPU FOUND" in summary and "PASSED   bundle" in summary, f"{label}: summary.txt says so")
    check(text.rstrip().endswith(summary.rstrip().splitlines()[-1]), f"{label}: run.sh ends by printing the summary")
    check(len(summary.splitlines()) <= 24, f"{label}: the summary fits on one screen")
    shutil.rmtree(top, ignore_errors=True)


# A bare environment: the system's python3 may not be 3.12, so the module is
# checked only where one is found.
bare_python = shutil.which("python3", path="/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin")
bare_is_312 = bare_python is not None and subprocess.run(
    [bare_python, "-c", "import sys; sys.exit(sys.version_info[:2] != (3, 12))"]).returncode == 0
check_no_gpu_run({}, "env -i", bare_is_312)
# With the CPython 3.12 the module was built with: the module is loaded and used.
py312 = info.get("python_used")
if py312 and os.path.exists(py312):
    check_no_gpu_run({"RESERVOIR_PYTHON": py312}, "env -i RESERVOIR_PYTHON=3.12", True)
else:
    check(False, f"the CPython 3.12 the module was built with ({py312}) is here to check it")

# Bad arguments and an incomplete bundle: exit 2 and a plain message.
rc, text, out, top = run_copy({}, args=["--only", "gpu_tset"])
check(rc == 2 and "unknown step 'gpu_tset'" in text, f"an unknown step: exit {rc}, says {text.strip()[-80:]!r}")
shutil.rmtree(top, ignore_errors=True)
rc, text, out, top = run_copy({}, remove=["bin/cuda_probe"])
check(rc == 2 and "missing bin/cuda_probe" in text, f"an incomplete bundle: exit {rc}, says {text.strip()[-80:]!r}")
shutil.rmtree(top, ignore_errors=True)
rc, text, out, top = run_copy({}, args=["--only", "bundle"])
check(rc == 0 and "PASSED: every step (1)" in text, f"--only bundle: exit {rc}")
shutil.rmtree(top, ignore_errors=True)

finish("bundle checks")
