#!/usr/bin/env bash
# On a GPU machine: build, run the GPU test suite (ctest label gpu) and the
# GPU benchmarks, and PyTorch's native allocator beside them when a CUDA
# build of PyTorch is importable. Prints the GPU, driver and date first, for
# docs/benchmarks.md. The GPU tests include pause/resume (GpuSaver, and
# tests/gpu/torch_pause_test.py, which prints pause/resume bandwidth beside a
# pinned copy); gpu_bench includes the Pause_/Resume_/Copy_ cases.
#
#   scripts/gpu_check.sh [BUILD_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build-gpu}
echo "== $(date -u +%Y-%m-%d) $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || echo 'nvidia-smi: not found')"
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build "$build" -j "$(nproc)" --target gpu_test gpu_bench reservoir_torch reservoir_python
echo "== GPU tests"
(cd "$build" && ctest -L gpu --output-on-failure)
echo "== GPU benchmarks"
"$build/bin/gpu_bench" --benchmark_repetitions=5 --benchmark_report_aggregates_only=true \
  --benchmark_min_time=0.2
echo "== PyTorch's native caching allocator (cache-hit pair)"
python3 - <<'PY' || echo "PyTorch with CUDA not available: skipped"
import time
import torch
assert torch.cuda.is_available()
alloc, free = torch.cuda.caching_allocator_alloc, torch.cuda.caching_allocator_delete
for size in (4096, 1 << 20, 64 << 20):
    free(alloc(size))
    samples = []
    for _ in range(5):
        n = 20000
        t = time.perf_counter_ns()
        for _ in range(n):
            free(alloc(size))
        samples.append((time.perf_counter_ns() - t) / n)
    samples.sort()
    print(f"torch caching_allocator_alloc+delete {size} bytes: median {samples[2]:.0f} ns "
          "(includes the Python call overhead)")
PY
