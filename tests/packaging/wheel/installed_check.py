"""Run with the interpreter reservoir's wheel was installed for (a virtual
environment's, or any with PYTHONPATH=SITE after pip install --target SITE):
the package is the installed one in SITE (not a build tree), its version is
the CMake project's, the native files are inside the package and work (the
pluggable allocator on host memory through reservoir_torch, the interposer
preloaded into a program, the command-line tool as the console script pip
put in SCRIPTS and as python -m reservoir).

Usage: installed_check.py SITE SCRIPTS VERSION TRACE EXPECT_PRELOAD(ON|OFF)
"""
import ctypes
import importlib.metadata
import os
import subprocess
import sys

site, scripts, version, trace, expect_preload = sys.argv[1:6]
site = os.path.realpath(site)
os.environ["RESERVOIR_TORCH_DEVICE"] = "host"  # the pluggable allocator on real host memory

import reservoir  # noqa: E402
import reservoir_torch  # noqa: E402

package = os.path.dirname(os.path.realpath(reservoir.__file__))
assert package == os.path.join(site, "reservoir"), (package, site)
assert os.path.realpath(reservoir._core.__file__).startswith(package + os.sep), reservoir._core.__file__
assert os.path.realpath(reservoir_torch.__file__) == os.path.join(site, "reservoir_torch.py")
assert not any("build/python" in p for p in sys.path), sys.path

assert reservoir.__version__ == version, (reservoir.__version__, version)
assert importlib.metadata.version("reservoir") == version

paths = {"torch": reservoir.torch_library_path(), "cli": reservoir.cli_path()}
if expect_preload.upper() in ("ON", "1", "TRUE", "YES"):
    paths["preload"] = reservoir.preload_library_path()
for what, path in paths.items():
    assert os.path.realpath(path).startswith(package + os.sep) and os.path.isfile(path), (what, path)
assert os.path.realpath(reservoir.library_path()).startswith(package + os.sep)

# reservoir_torch finds its library through the package.
assert reservoir_torch.library_path() == paths["torch"], reservoir_torch.library_path()
lib = reservoir_torch.library()
ptr = lib.reservoir_torch_malloc(3 << 20, 0, None)
assert ptr, lib.reservoir_torch_last_error()
data = os.urandom(3 << 20)
ctypes.memmove(ptr, data, len(data))
assert ctypes.string_at(ptr, len(data)) == data
stats = reservoir_torch.memory_stats(0)
assert stats["allocated_bytes.all.current"] == 3 << 20, stats["allocated_bytes.all.current"]
lib.reservoir_torch_free(ctypes.c_void_p(ptr), 3 << 20, 0, None)
assert reservoir_torch.memory_stats(0)["allocated_bytes.all.current"] == 0

# The command-line tool: the console script, python -m reservoir, errors.
script = os.path.join(scripts, "reservoir")
for command in ([script], [sys.executable, "-m", "reservoir"]):
    out = subprocess.run(command + ["--version"], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == f"reservoir {version}", (command, out)
out = subprocess.run([script, "replay", trace], capture_output=True, text=True)
assert out.returncode == 0 and os.path.basename(trace) in out.stdout, out
out = subprocess.run([script, "replay", trace + ".missing"], capture_output=True, text=True)
assert out.returncode != 0 and ".missing" in out.stderr, out

# The interposer loads into a program that makes no CUDA call at all.
if "preload" in paths:
    out = subprocess.run(["/bin/true"], env=dict(os.environ, LD_PRELOAD=paths["preload"]),
                         capture_output=True, text=True)
    assert out.returncode == 0 and out.stderr == "", out

# RESERVOIR_TORCH_ALLOCATOR: the .pth installed beside the package arms the
# hook at start-up when it is set, and only then; a value it does not know
# makes `import torch` fail with the reason (a stand-in torch here: the
# real one is not in this environment).
assert os.path.isfile(os.path.join(site, "reservoir_autoinstall.pth"))
# Python reads .pth files in site directories, not in PYTHONPATH folders
# (pip install --target): there, the probes read SITE as a site directory.
import site as site_module  # noqa: E402
reads_pth = site in {os.path.realpath(p) for p in site_module.getsitepackages()}
prefix = "" if reads_pth else f"import site; site.addsitedir({site!r}); "
probe = prefix + "import sys; print(sorted(type(f).__name__ for f in sys.meta_path if 'After' in type(f).__name__))"
env = {k: v for k, v in os.environ.items() if k not in ("RESERVOIR_TORCH_ALLOCATOR", "RESERVOIR_EXPLAIN_OOM")}
out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True)
assert out.returncode == 0 and out.stdout.strip() == "[]", out
out = subprocess.run([sys.executable, "-c", probe], env=dict(env, RESERVOIR_TORCH_ALLOCATOR="own"),
                     capture_output=True, text=True)
assert out.returncode == 0 and out.stdout.strip() == "['_AfterTorch']", out
# RESERVOIR_EXPLAIN_OOM (reservoir.explain_oom() without a code change) arms it too.
out = subprocess.run([sys.executable, "-c", probe], env=dict(env, RESERVOIR_EXPLAIN_OOM="1"),
                     capture_output=True, text=True)
assert out.returncode == 0 and out.stdout.strip() == "['_AfterTorch']", out
import tempfile  # noqa: E402
with tempfile.TemporaryDirectory() as fake:
    os.makedirs(os.path.join(fake, "torch"))
    with open(os.path.join(fake, "torch", "__init__.py"), "w") as fh:
        fh.write("__version__ = '0.0.0'\n")
    out = subprocess.run([sys.executable, "-c", prefix + "import torch"], capture_output=True, text=True,
                         env=dict(env, RESERVOIR_TORCH_ALLOCATOR="yes please", PYTHONPATH=fake))
    assert out.returncode != 0 and "RESERVOIR_TORCH_ALLOCATOR='yes please': expected one of own, pluggable" \
        in out.stderr, out
    out = subprocess.run([sys.executable, "-c", prefix + "import torch"], capture_output=True, text=True,
                         env=dict(env, RESERVOIR_EXPLAIN_OOM="maybe", PYTHONPATH=fake))
    assert out.returncode != 0 and "RESERVOIR_EXPLAIN_OOM='maybe': expected 1 (on) or 0 (off)" in out.stderr, out

print(f"installed package checks passed: reservoir {version} at {package}")
