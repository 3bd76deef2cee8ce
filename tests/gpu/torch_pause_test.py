"""PyTorch on a GPU with reservoir as its allocator (the Python module): a
model's weights (with CPU backup) and a KV cache (without) are paused and
resumed under every policy; the weights keep their addresses, the GPU's free
memory rises by what the tags held, and the model gives bitwise-identical
outputs afterwards. A CUDA graph captured into a tag (the drop-in's
cuda_graph) is paused and resumed and replays the same. Prints pause and resume bandwidth with backup beside a
plain pinned copy of the same bytes, measured in the same process.

Usage: torch_pause_test.py     (PYTHONPATH holding the reservoir package; exit 77 without CUDA PyTorch)
"""
import json
import os
import subprocess
import sys

try:
    import torch
    if not torch.cuda.is_available() or not hasattr(torch.cuda.memory, "CUDAPluggableAllocator"):
        raise ImportError("no CUDA build of PyTorch 2.x")
except ImportError as e:
    print(f"SKIPPED: {e}")
    sys.exit(77)

CHILD = r'''
import json, sys, time
import reservoir
reservoir.install_torch(sys.argv[1])
import torch, torch.nn as nn
torch.manual_seed(0)
torch.backends.cuda.matmul.allow_tf32 = False
dev = torch.device("cuda")
GiB = 1 << 30
with reservoir.region("weights", cpu_backup=True):
    model = nn.Sequential(nn.Linear(4096, 4096), nn.GELU(), nn.Linear(4096, 4096)).to(dev)
    big = torch.randn(1 * GiB // 4, device=dev)          # 1 GiB of weights to time
with reservoir.region("kv_cache"):
    kv = torch.empty(512 << 20, dtype=torch.uint8, device=dev)
x = torch.randn(64, 4096, device=dev)
with torch.no_grad():
    y0 = model(x).clone()
ptrs = [p.data_ptr() for p in model.parameters()] + [big.data_ptr(), kv.data_ptr()]
big_sum = big.double().sum().item()
torch.cuda.synchronize()
free0 = torch.cuda.mem_get_info()[0]
reservoir.pause("weights")
reservoir.pause("kv_cache")
free1 = torch.cuda.mem_get_info()[0]
info = {t["tag"]: t for t in reservoir.tags()}
reservoir.resume("kv_cache")
reservoir.resume("weights")
with torch.no_grad():
    y1 = model(x)
assert torch.equal(y0, y1), "outputs differ after resume"
assert ptrs == [p.data_ptr() for p in model.parameters()] + [big.data_ptr(), kv.data_ptr()]
assert big.double().sum().item() == big_sum
released = info["weights"]["last_released_bytes"] + info["kv_cache"]["last_released_bytes"]
assert free1 - free0 >= released - (64 << 20), (free0, free1, released)
# Bandwidth: three cycles, against a plain copy of the same bytes into pinned memory.
nbytes = info["weights"]["last_pause_copied"]
host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
flat = torch.empty(nbytes, dtype=torch.uint8, device=dev)
rows = []
for _ in range(3):
    torch.cuda.synchronize(); t0 = time.perf_counter()
    host.copy_(flat, non_blocking=True); torch.cuda.synchronize()
    d2h = time.perf_counter() - t0
    t0 = time.perf_counter()
    flat.copy_(host, non_blocking=True); torch.cuda.synchronize()
    h2d = time.perf_counter() - t0
    reservoir.pause("weights"); reservoir.resume("weights")
    t = reservoir.default_saver().tag_info("weights")
    rows.append({"bytes": nbytes, "pinned_d2h_s": d2h, "pinned_h2d_s": h2d,
                 "pause_s": t["last_pause_seconds"], "resume_s": t["last_resume_seconds"]})
with torch.no_grad():
    assert torch.equal(y0, model(x))
print(json.dumps({"freed": free1 - free0, "released": released, "cycles": rows}))
'''

# A CUDA graph captured with the torch_memory_saver drop-in's cuda_graph():
# its private pool lives in the tag, so pausing the tag releases the graph's
# memory, and after resume the graph replays to the same result.
GRAPH_CHILD = r'''
import sys
import reservoir
reservoir.install_torch(sys.argv[1])
import torch
from reservoir.memory_saver import torch_memory_saver as tms
torch.manual_seed(0)
dev = torch.device("cuda")
static_in = torch.randn(256, 1024, device=dev)
w = torch.randn(1024, 1024, device=dev)
side = torch.cuda.Stream()
side.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(side):
    for _ in range(3):
        (static_in @ w).relu() @ w     # warm-up outside the capture
torch.cuda.current_stream().wait_stream(side)
g = torch.cuda.CUDAGraph()
with tms.cuda_graph(g, tag="graph"):
    static_out = (static_in @ w).relu() @ w
static_in.copy_(torch.randn(256, 1024, device=dev))
g.replay()
torch.cuda.synchronize()
expected = static_out.clone()
held = reservoir.default_saver().tag_info("graph")["physical_bytes"]
free0 = torch.cuda.mem_get_info()[0]
tms.pause("graph")
freed = torch.cuda.mem_get_info()[0] - free0
tms.resume("graph")
g.replay()
torch.cuda.synchronize()
assert torch.equal(static_out, expected), "the graph's output changed after pause and resume"
assert held > 0 and freed >= held, (held, freed)
print(held, freed)
'''

for config in ["", "expandable_segments:True", "policy:paging", "policy:native_paged"]:
    out = subprocess.run([sys.executable, "-c", GRAPH_CHILD, config], capture_output=True, text=True)
    if out.returncode != 0:
        print(out.stdout, out.stderr)
        sys.exit(f"config '{config}': the captured graph failed")
    held, freed = out.stdout.split()[-2:]
    print(f"config '{config}': a captured graph's {held} bytes paused (free memory rose by {freed}) "
          f"and the graph replayed the same after resume")

for config in ["", "expandable_segments:True", "policy:paging", "policy:native_paged"]:
    out = subprocess.run([sys.executable, "-c", CHILD, config], capture_output=True, text=True)
    if out.returncode != 0:
        print(out.stdout, out.stderr)
        sys.exit(f"config '{config}': failed")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    gib = 1 << 30
    for row in result["cycles"]:
        n = row["bytes"] / gib
        print(f"config '{config}': {n:.2f} GiB  pause {n / row['pause_s']:.1f} GiB/s "
              f"(pinned copy {n / row['pinned_d2h_s']:.1f})  resume {n / row['resume_s']:.1f} GiB/s "
              f"(pinned copy {n / row['pinned_h2d_s']:.1f})")
    print(f"config '{config}': GPU free memory rose by {result['freed']} bytes "
          f"({result['released']} released)")
print("OK")
