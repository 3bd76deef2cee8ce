"""vLLM's sleep mode, both backends side by side in one run on the simulated
device: vLLM 0.33.0's own ("cumem": its CuMemAllocator, one virtual-memory
call per block, a host copy per block) and reservoir's (`--sleep-mode-backend
reservoir`, python/reservoir/vllm_sleep.py), each driven as vLLM's worker
drives it: weights in `--blocks` tensors and a KV cache, tagged; then
`--cycles` level-1 sleeps (the weights backed up to host memory, the KV cache
dropped) and wakes.

Per backend: the first sleep and wake (where host memory is pinned), the
median of the others, what they move (the weights' bytes each way), the time
per GiB moved, and the device calls each makes (the simulated driver's
counts: cuMemCreate/Map/SetAccess/Unmap/Release and the copies). Each
backend runs in its own process, alternately, `--repetitions` times; the
figures are medians over them. Host memory stands in for the device's, so
the times are of the host's memory bandwidth and the calls' bookkeeping, not
a GPU's link: the GPU bundle's vllm_sleep step measures that.

Run from the source folder after the build, with the interpreter the tests
use (Debian's, whose `packaging` vLLM imports):
  /usr/bin/python3 bench/vllm_sleep_bench.py --build build --torch-site <torch site>
(<torch site>: the PyPI cache's folder of the newest PyTorch; vLLM's folder,
vllm-0.33.0, is beside it.)
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

MiB = 1 << 20

CHILD = r"""
import ctypes, json, sys, time
import torch
from vllm.device_allocator.sleep_mode_backend import SleepModeBackendFactory
from vllm.device_allocator import get_mem_allocator_instance
MiB = 1 << 20
name, weights_mib, blocks, kv_mib, cycles = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
if name == "reservoir":
    import reservoir.vllm_sleep as rv
    rv.register()
    rv._worker_selected.set()  # what --sleep-mode-backend reservoir sets in the worker
backend = SleepModeBackendFactory.get_backend_class(name)()
allocator = get_mem_allocator_instance()
cuda = ctypes.CDLL("libcuda.so.1")
cuda.reservoirSimCudaCalls.restype = ctypes.c_ulonglong
cuda.reservoirSimCudaCalls.argtypes = [ctypes.c_char_p]
VM = ["cuMemCreate", "cuMemMap", "cuMemSetAccess", "cuMemUnmap", "cuMemRelease", "cuMemAddressReserve",
      "cuMemAddressFree"]
COPIES = ["cudaMemcpy", "cudaMemcpyAsync", "cuMemcpyDtoH_v2", "cuMemcpyHtoD_v2", "cuMemcpyDtoHAsync_v2",
          "cuMemcpyHtoDAsync_v2", "cudaMemset", "cudaMemsetAsync", "cuMemsetD8_v2"]
def counts():
    return {c: cuda.reservoirSimCudaCalls(c.encode()) for c in VM + COPIES}
def spent(a, b, names):
    return sum(b[c] - a[c] for c in names)
per = weights_mib * MiB // blocks
with allocator.use_memory_pool(tag="weights"):
    weights = [torch.empty(per, dtype=torch.uint8, device="cuda") for _ in range(blocks)]
with allocator.use_memory_pool(tag="kv_cache"):
    kv = torch.empty(kv_mib * MiB, dtype=torch.uint8, device="cuda")
source = (torch.arange(per, dtype=torch.int64) % 251).to(torch.uint8)
for w in weights:
    w.copy_(source)
torch.cuda.synchronize()
out = {"backend": name, "moved_bytes": blocks * per, "cycles": []}
for _ in range(cycles):
    a = counts()
    t0 = time.perf_counter()
    backend.suspend(level=1)
    torch.cuda.synchronize()
    t1 = time.perf_counter()
    b = counts()
    backend.resume()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    c = counts()
    out["cycles"].append({"sleep_s": t1 - t0, "wake_s": t2 - t1, "sleep_vm": spent(a, b, VM),
                          "sleep_copies": spent(a, b, COPIES), "wake_vm": spent(b, c, VM),
                          "wake_copies": spent(b, c, COPIES),
                          "sleep_calls": {n: b[n] - a[n] for n in VM + COPIES if b[n] != a[n]},
                          "wake_calls": {n: c[n] - b[n] for n in VM + COPIES if c[n] != b[n]}})
out["restored"] = all(torch.equal(weights[i].cpu(), source) for i in (0, blocks // 2, blocks - 1))
print("RESULT " + json.dumps(out), flush=True)
"""


def run_one(args, backend, env):
    r = subprocess.run([sys.executable, "-W", "ignore", "-c", CHILD, backend, str(args.weights_mib),
                        str(args.blocks), str(args.kv_mib), str(args.cycles)],
                       capture_output=True, text=True, env=env, timeout=args.timeout)
    lines = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
    if r.returncode != 0 or not lines:
        sys.exit(f"{backend}: exit {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}")
    result = json.loads(lines[-1][len("RESULT "):])
    if not result["restored"]:
        sys.exit(f"{backend}: the weights did not come back as they were")
    return result


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--build", default="build")
    p.add_argument("--torch-site", required=True, help="the PyPI cache's folder of the newest PyTorch")
    p.add_argument("--vllm-site", help="vLLM 0.33.0's folder (default: vllm-0.33.0 beside --torch-site)")
    p.add_argument("--weights-mib", type=int, default=1024)
    # Above 10 MiB each: a segment of its own in PyTorch's allocator, so a
    # block of vLLM's allocator (a handle, a mapping and a copy) each.
    p.add_argument("--blocks", type=int, default=96, help="weight tensors (each its own segment)")
    p.add_argument("--kv-mib", type=int, default=512)
    p.add_argument("--cycles", type=int, default=6)
    p.add_argument("--repetitions", type=int, default=3)
    p.add_argument("--timeout", type=int, default=600)
    args = p.parse_args()
    if args.cycles < 2:
        p.error("--cycles must be at least 2 (the first, then the others)")
    torch_site = os.path.abspath(args.torch_site)
    vllm_site = os.path.abspath(args.vllm_site or os.path.join(os.path.dirname(torch_site), "vllm-0.33.0"))
    build = os.path.abspath(args.build)
    for need in (torch_site, vllm_site, os.path.join(build, "simcuda", "libcudart.so.13")):
        if not os.path.exists(need):
            sys.exit(f"vllm_sleep_bench: {need} is missing (run make, and scripts/pypi_cache.py for the folders)")
    env = {k: v for k, v in os.environ.items() if k not in ("RESERVOIR_TORCH_ALLOCATOR", "RESERVOIR_VLLM_RESTORE")}
    env.update({"PYTHONPATH": ":".join([vllm_site, torch_site, os.path.join(build, "python")]),
                "LD_PRELOAD": os.path.join(build, "simcuda", "libcudart.so.13"),
                "RESERVOIR_SIMCUDA_KERNELS": "skip",
                "RESERVOIR_SIMCUDA_MEMORY": f"{2 * (args.weights_mib + args.kv_mib) + 1024}MiB"})
    backends = ("cumem", "reservoir")
    runs = {b: [] for b in backends}
    for _ in range(args.repetitions):
        for b in backends:
            runs[b].append(run_one(args, b, env))
    moved_gib = runs["cumem"][0]["moved_bytes"] / (1 << 30)
    print(f"vLLM 0.33.0 sleep mode, level 1: {args.blocks} weight blocks ({args.weights_mib} MiB, "
          f"{moved_gib:.2f} GiB moved each way), KV cache {args.kv_mib} MiB dropped; {args.cycles} cycles x "
          f"{args.repetitions} runs per backend, medians; simulated device (host memory)")
    header = (f"{'backend':<10} {'first sleep':>12} {'first wake':>11} {'sleep':>9} {'wake':>9} {'s/GiB sleep':>12} "
              f"{'s/GiB wake':>11} {'calls/sleep':>12} {'calls/wake':>11}")
    print(header)
    figures = {}
    for b in backends:
        med = statistics.median
        first_sleep = med(r["cycles"][0]["sleep_s"] for r in runs[b])
        first_wake = med(r["cycles"][0]["wake_s"] for r in runs[b])
        sleep = med(c["sleep_s"] for r in runs[b] for c in r["cycles"][1:])
        wake = med(c["wake_s"] for r in runs[b] for c in r["cycles"][1:])
        cs = med(c["sleep_vm"] + c["sleep_copies"] for r in runs[b] for c in r["cycles"][1:])
        cw = med(c["wake_vm"] + c["wake_copies"] for r in runs[b] for c in r["cycles"][1:])
        figures[b] = (sleep, wake, cs, cw)
        print(f"{b:<10} {first_sleep * 1e3:>9.1f} ms {first_wake * 1e3:>8.1f} ms {sleep * 1e3:>6.1f} ms "
              f"{wake * 1e3:>6.1f} ms {sleep / moved_gib:>10.3f} s {wake / moved_gib:>9.3f} s {cs:>12.0f} {cw:>11.0f}")
    for b in backends:
        last = runs[b][-1]["cycles"][-1]
        print(f"{b}: a sleep's calls {last['sleep_calls']}; a wake's {last['wake_calls']}")
    (s0, w0, c0, d0), (s1, w1, c1, d1) = figures["cumem"], figures["reservoir"]
    print(f"cumem / reservoir: sleep {s0 / s1:.2f}x, wake {w0 / w1:.2f}x, calls per sleep {c0 / max(c1, 1):.1f}x, "
          f"per wake {d0 / max(d1, 1):.1f}x")


if __name__ == "__main__":
    main()
