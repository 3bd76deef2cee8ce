#!/usr/bin/env bash
# Builds build/gpu-bundle: everything the GPU proofs run, for a GPU machine
# that has a driver, CUDA 13, Python 3.12 and PyTorch but none of our
# development packages. Every program and library in it needs only glibc,
# libstdc++ and libgcc (CUDA itself is loaded at run time); see
# docs/integrations.md, "The GPU bundle".
#
#   scripts/gpu_bundle/build.sh [OUT_DIR]      (make gpu-bundle; OUT_DIR defaults to build/gpu-bundle)
#
# Environment: RESERVOIR_PYTHON312 (a CPython 3.12 interpreter with its
# headers, for the extension module; found by itself otherwise),
# BUNDLE_BUILD (the CMake build folder, default build-bundle), JOBS, NVCC.
set -euo pipefail
cd "$(dirname "$0")/../.."
root=$PWD
out=${1:-build/gpu-bundle}
bb=${BUNDLE_BUILD:-build-bundle}
jobs=${JOBS:-2}
mkdir -p "$bb"
bb=$(cd "$bb" && pwd)
say() { echo "gpu-bundle: $*"; }
die() { echo "gpu-bundle: error: $*" >&2; exit 1; }

# CPython 3.12 with headers: the GPU machines' Python.
python312_ok() {
  "$1" -c 'import sys, sysconfig, os
sys.exit(0 if sys.version_info[:2] == (3, 12) and
         os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")) else 1)' \
    >/dev/null 2>&1
}
find_python312() {
  local c
  for c in "${RESERVOIR_PYTHON312:-}" "$(command -v python3.12 2>/dev/null || true)" \
           "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12*/bin/python3.12 \
           /usr/local/bin/python3.12 /usr/bin/python3.12; do
    [ -n "$c" ] && [ -x "$c" ] && python312_ok "$c" && { echo "$c"; return 0; }
  done
  return 1
}
py312=$(find_python312) || die "no CPython 3.12 with its headers (Python.h) was found: set RESERVOIR_PYTHON312=/path/to/python3.12"
py312=$("$py312" -c 'import sys; print(sys.executable)')
say "Python module for $("$py312" -c 'import sys; print(sys.version.split()[0])') at $py312"

# Google Benchmark as a static library: Debian ships only the shared one, so
# its source package (the same version) is built here once.
bench_prefix=$bb/deps/benchmark
if [ ! -f "$bench_prefix/lib/libbenchmark.a" ] && [ ! -f "$bench_prefix/lib64/libbenchmark.a" ]; then
  src=$bb/deps/src
  rm -rf "$src" && mkdir -p "$src/lists/partial"
  version=$(dpkg-query -W -f='${Version}' libbenchmark-dev 2>/dev/null || true)
  [ -n "$version" ] || die "libbenchmark-dev is not installed (make deps installs it)"
  cat > "$src/debian-source.sources" <<SRC
Types: deb-src
URIs: http://deb.debian.org/debian
Suites: $(. /etc/os-release && echo "$VERSION_CODENAME")
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
SRC
  apt_opts=(-qq -o "Dir::Etc::SourceList=$src/debian-source.sources" -o Dir::Etc::SourceParts=/dev/null
            -o "Dir::State::Lists=$src/lists")
  say "fetching Debian's source of Google Benchmark $version (for a static library)"
  apt-get "${apt_opts[@]}" update >/dev/null 2>&1 || die "apt-get update of Debian's source index failed"
  (cd "$src" && apt-get "${apt_opts[@]}" source --download-only "benchmark=$version" >/dev/null 2>&1) ||
    die "could not download Debian's source package benchmark=$version"
  tar -xzf "$src"/benchmark_*.orig.tar.gz -C "$src"
  bsrc=$(find "$src" -maxdepth 1 -mindepth 1 -type d -name 'benchmark-*' | head -1)
  [ -n "$bsrc" ] || die "the benchmark source package held no source folder"
  cmake -S "$bsrc" -B "$src/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
    -DCMAKE_POSITION_INDEPENDENT_CODE=ON -DBENCHMARK_ENABLE_TESTING=OFF \
    -DBENCHMARK_ENABLE_GTEST_TESTS=OFF -DBENCHMARK_ENABLE_WERROR=OFF -DBENCHMARK_ENABLE_LIBPFM=OFF \
    -DBENCHMARK_INSTALL_DOCS=OFF -DCMAKE_INSTALL_PREFIX="$bench_prefix" >/dev/null
  cmake --build "$src/build" -j "$jobs" >/dev/null
  cmake --install "$src/build" >/dev/null
fi
bench_cmake=$(dirname "$(find "$bench_prefix" -name benchmarkConfig.cmake | head -1)")

say "configuring $bb"
cmake -S "$root" -B "$bb" -G Ninja -DCMAKE_BUILD_TYPE=Release -DRESERVOIR_PORTABLE=ON \
  -DRESERVOIR_BUILD_TESTS=ON -DRESERVOIR_BUILD_BENCH=ON -DRESERVOIR_BUILD_TOOLS=ON \
  -DPython_EXECUTABLE="$py312" -Dbenchmark_DIR="$bench_cmake" >/dev/null
cmake --build "$bb" -j "$jobs" --target gpu_test gpu_bench reservoir_cli reservoir_torch \
  reservoir_preload reservoir_python

# The Python package as a CPython 3.12 wheel (pyproject.toml, setup.py), from
# this same build: setup.py configures it with the bundle's own options again
# (CMAKE_ARGS), so it only gathers what is built. Debian's pure-Python
# setuptools and wheel serve a 3.12 that has none (no package index here).
wheel_env=(RESERVOIR_CMAKE_BUILD_DIR="$bb" RESERVOIR_TORCH_RELEASES=all PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1
           CMAKE_ARGS="-DRESERVOIR_BUILD_TESTS=ON -DRESERVOIR_BUILD_BENCH=ON -Dbenchmark_DIR=$bench_cmake")
if ! "$py312" -c 'import setuptools, wheel' >/dev/null 2>&1; then
  tools=$(python3 "$root/scripts/debian_python_tools.py" "$bb/python-tools" setuptools wheel) ||
    die "CPython 3.12 has no setuptools and wheel, and Debian's could not be used (python3-setuptools-whl, python3-wheel)"
  wheel_env+=(PYTHONPATH="$tools")
fi
say "wheel for CPython 3.12"
rm -rf "$bb/wheels"
if ! env "${wheel_env[@]}" "$py312" -m pip wheel "$root" --no-build-isolation --no-deps \
     -w "$bb/wheels" >"$bb/wheel.log" 2>&1; then
  tail -40 "$bb/wheel.log" >&2
  die "pip wheel failed for CPython 3.12 (log: $bb/wheel.log)"
fi

# The plain CUDA program for the interposer: linked against the shared CUDA
# runtime, as programs must be for LD_PRELOAD to see their calls.
nvcc=${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
[ -x "$nvcc" ] || die "nvcc not found (set NVCC)"
mkdir -p "$bb/cuda"
if [ ! -f "$bb/cuda/cuda_probe" ] || [ "$root/tests/gpu/cuda_probe.cu" -nt "$bb/cuda/cuda_probe" ]; then
  say "nvcc: tests/gpu/cuda_probe.cu"
  "$nvcc" -O2 -std=c++17 -cudart shared \
    -gencode arch=compute_80,code=sm_80 -gencode arch=compute_90,code=sm_90 \
    -gencode arch=compute_90,code=compute_90 \
    -o "$bb/cuda/cuda_probe" "$root/tests/gpu/cuda_probe.cu"
fi

# The real torch_memory_saver and RMM's CUDA 13 wheels, run beside reservoir
# there (from the PyPI cache; `make deps` downloads them once).
thirdparty=$(/usr/bin/python3 "$root/scripts/pypi_cache.py" "$root/scripts/gpu_bundle/wheelhouse-gpu-bundle.txt") ||
  die "the GPU bundle's wheels (scripts/gpu_bundle/wheelhouse-gpu-bundle.txt) are not in the PyPI cache and could not be fetched"

# Assemble.
say "assembling $out"
rm -rf "$out"
mkdir -p "$out"/{bin,lib,python/reservoir,tests,traces,wheels,thirdparty}
install -m 644 "$thirdparty"/*.whl "$out/thirdparty/"
install -m 755 "$bb/bin/gpu_test" "$bb/bin/gpu_bench" "$bb/bin/reservoir" "$bb/cuda/cuda_probe" "$out/bin/"
install -m 755 "$bb/lib/libreservoir_torch.so" "$bb/lib/libreservoir_preload.so" "$out/lib/"
install -m 644 "$root"/python/reservoir/*.py "$out/python/reservoir/"
install -m 755 "$bb"/python/reservoir/_core*.so "$out/python/reservoir/"
# reservoir's own allocator and the pluggable one's hooks for the release the
# GPU machines run (2.11; the package carries one per release, which would
# take the bundle over its size): use_as_allocator() loads it.
for hooks in "$bb"/python/reservoir/lib/torch-2.11.*/libreservoir_torch_hooks.so; do
  [ -e "$hooks" ] || continue
  release=$(basename "$(dirname "$hooks")")
  install -D -m 755 "$hooks" "$out/python/reservoir/lib/$release/libreservoir_torch_hooks.so"
done
install -m 644 "$root/python/reservoir_torch.py" "$out/python/"
install -m 644 "$bb"/wheels/reservoir-*-cp312-cp312-*.whl "$out/wheels/"
install -m 644 "$root"/tests/gpu/torch_*.py "$root/tests/gpu/torch_native_bench.cpp" \
  "$root/tests/gpu/cuda_behaviour.py" "$root/tests/gpu/record_gpu_snapshots.py" \
  "$root/tests/gpu/rmm_compare.py" "$root/tests/gpu/own_allocator_check.py" \
  "$root/tests/gpu/graphs_check.py" "$root/tests/gpu/stream_capture_sim.json" "$root/tests/torch/scenarios.py" \
  "$root/tests/gpu/explain_oom_check.py" "$root/bench/torch_recording_bench.py" "$root/bench/torch_service.py" \
  "$root/tests/gpu/native_paged_check.py" "$root/tests/gpu/cudnn_workspaces.py" "$root/scripts/peer_suites.py" \
  "$root/tests/python/test_reservoir.py" "$root/scripts/gpu_bundle/module_smoke.py" \
  "$root/tests/packaging/wheel/installed_check.py" "$out/tests/"
install -m 644 "$root/examples/traces/resnet_training.pickle" "$out/traces/"
install -m 755 "$root/scripts/gpu_bundle/run.sh" "$out/"
install -m 644 "$root/scripts/gpu_bundle/run_steps.py" "$root/scripts/gpu_bundle/README.txt" "$out/"
strip --strip-debug "$out"/bin/* "$out"/lib/*.so "$out"/python/reservoir/*.so
find "$out/python/reservoir/lib" -name '*.so' -exec strip --strip-debug {} +

# What it was built from and what it needs of the machine it runs on.
"$py312" - "$out" "$root" "$py312" <<'PY'
import datetime, json, os, re, subprocess, sys
out, root, py = sys.argv[1:4]
def run(*cmd):
    try:
        return subprocess.run(cmd, capture_output=True, text=True, cwd=root).stdout.strip()
    except OSError:
        return ""
need = {"GLIBC": (0,), "GLIBCXX": (0,), "CXXABI": (0,)}
for folder, _, files in os.walk(out):
    for f in files:
        path = os.path.join(folder, f)
        with open(path, "rb") as fh:
            if fh.read(4) != b"\x7fELF":
                continue
        for kind, ver in re.findall(r"\b(GLIBC|GLIBCXX|CXXABI)_([0-9.]+)\b", run("objdump", "-T", path)):
            v = tuple(int(x) for x in ver.split("."))
            need[kind] = max(need[kind], v)
info = {
    "commit": run("git", "rev-parse", "HEAD"),
    "describe": run("git", "describe", "--always", "--dirty"),
    "built": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
    "compiler": run("c++", "--version").splitlines()[0],
    "nvcc": run("nvcc", "--version").splitlines()[-1] if run("nvcc", "--version") else "",
    "python_module_built_for": subprocess.run([py, "-c", "import sys; print(sys.version.split()[0])"],
                                              capture_output=True, text=True).stdout.strip(),
    "python_used": py,
    "requires": {k: ".".join(map(str, v)) for k, v in need.items()},
}
with open(os.path.join(out, "BUILD_INFO.json"), "w") as f:
    json.dump(info, f, indent=1)
    f.write("\n")
PY
size=$(du -sb "$out" | cut -f1)
say "$out: $((size / 1024 / 1024)) MiB; run it on a GPU machine with: $out/run.sh OUTDIR"
