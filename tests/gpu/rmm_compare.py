#!/usr/bin/env python3
"""RMM's memory resources beside reservoir and PyTorch's native allocator, as
PyTorch uses them, on one GPU.

Each allocator serves PyTorch in its own process: PyTorch's native caching
allocator; reservoir's pluggable allocator (libreservoir_torch.so) under the
native policy and under policy:paging; RMM's cuda (cudaMalloc per request),
pool (pool_memory_resource over cuda), arena and cuda_async
(cudaMallocAsync) resources through rmm.allocators.torch.rmm_torch_allocator.
The same path for all: torch.empty on the GPU and its release, so that the
figures compare the allocators and not their bindings.

  hit     torch.empty of a size just freed, then its release: median ns per
          pair over --pairs pairs (4 KiB, 1 MiB and 64 MiB)
  growth  64 requests of sizes never seen before (2 MiB + k * 512 KiB), held:
          median us per request, the first time (a caching allocator goes to
          the device for each; a pool carves its pool)

Printed, one JSON line per allocator ("RESULT {...}"); exit 1 when one failed.

    python3 tests/gpu/rmm_compare.py --reservoir-lib LIB --rmm DIR [--pairs N]

--rmm is the folder holding rmm, librmm and rapids_logger (PyPI's CUDA 13
wheels installed with pip --target).
"""
import argparse
import json
import os
import subprocess
import sys
import textwrap

ALLOCATORS = ["torch_native", "reservoir", "reservoir_paging", "rmm_cuda", "rmm_pool", "rmm_arena",
              "rmm_cuda_async"]

CHILD = """
import json, os, statistics, sys, time
impl, pairs, lib = {impl!r}, {pairs}, {lib!r}
import torch
if impl.startswith("reservoir"):
    if impl == "reservoir_paging":
        os.environ["RESERVOIR_ALLOC_CONF"] = "policy:paging"
    alloc = torch.cuda.memory.CUDAPluggableAllocator(lib, "reservoir_torch_malloc", "reservoir_torch_free")
    torch.cuda.memory.change_current_allocator(alloc)
elif impl.startswith("rmm_"):
    import rmm, rmm.mr
    from rmm.allocators.torch import rmm_torch_allocator
    kind = impl[4:]
    if kind == "cuda":
        mr = rmm.mr.CudaMemoryResource()
    elif kind == "pool":
        mr = rmm.mr.PoolMemoryResource(rmm.mr.CudaMemoryResource(), initial_pool_size=1 << 30)
    elif kind == "arena":
        mr = rmm.mr.ArenaMemoryResource(rmm.mr.CudaMemoryResource(), arena_size=1 << 30)
    else:
        mr = rmm.mr.CudaAsyncMemoryResource()
    rmm.mr.set_current_device_resource(mr)
    torch.cuda.memory.change_current_allocator(rmm_torch_allocator)
dev = torch.device("cuda")
torch.empty(1, device=dev)  # the context and the allocator's first call
torch.cuda.synchronize()
hit = {{}}
for size in (4 << 10, 1 << 20, 64 << 20):
    for _ in range(100):
        del_me = torch.empty(size, dtype=torch.uint8, device=dev)
        del del_me
    samples = []
    for _ in range(5):
        t = time.perf_counter_ns()
        for _ in range(pairs):
            x = torch.empty(size, dtype=torch.uint8, device=dev)
            del x
        samples.append((time.perf_counter_ns() - t) / pairs)
    hit[str(size)] = statistics.median(samples)
held, growth = [], []
for k in range(64):
    size = (2 << 20) + k * (512 << 10)
    t = time.perf_counter_ns()
    held.append(torch.empty(size, dtype=torch.uint8, device=dev))
    growth.append((time.perf_counter_ns() - t) / 1e3)
torch.cuda.synchronize()
print("RESULT " + json.dumps({{"impl": impl, "hit_pair_ns": hit, "growth_us_median": statistics.median(growth),
                              "growth_us_first": growth[0], "pairs": pairs}}), flush=True)
"""


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reservoir-lib", required=True, help="libreservoir_torch.so")
    ap.add_argument("--rmm", required=True, help="folder holding rmm, librmm and rapids_logger")
    ap.add_argument("--pairs", type=int, default=2000)
    ap.add_argument("--only", default="", help="comma-separated allocators (default: all)")
    args = ap.parse_args()
    failed = 0
    for impl in [a for a in ALLOCATORS if not args.only or a in args.only.split(",")]:
        env = dict(os.environ)
        if impl.startswith("rmm_"):
            env["PYTHONPATH"] = os.path.abspath(args.rmm) + (":" + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        code = textwrap.dedent(CHILD.format(impl=impl, pairs=args.pairs, lib=os.path.abspath(args.reservoir_lib)))
        try:
            p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=180)
            out, rc = p.stdout + p.stderr, p.returncode
        except subprocess.TimeoutExpired as e:
            out, rc = str(e), "timeout"
        lines = [x for x in out.splitlines() if x.startswith("RESULT ")]
        if lines:
            print(lines[-1][len("RESULT "):], flush=True)
        else:
            failed += 1
            print(json.dumps({"impl": impl, "error": f"exit {rc}", "output": out[-3000:]}), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
