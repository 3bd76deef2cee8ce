"""A small transformer trained under PyTorch's native allocator and under
reservoir (libreservoir_torch.so through CUDAPluggableAllocator): the losses
must be bitwise identical, and reservoir's memory_stats must agree with the
native allocator's on what the loop asked for (requested bytes, peak and
total, and allocation counts: the same requests in the same order). Prints
each allocator's training steps per second (steps 5 to 20, after warm-up).

Usage: torch_training_test.py LIBRARY SOURCE_DIR    (exit 77 without CUDA PyTorch)
"""
import json
import os
import subprocess
import sys

lib, src = sys.argv[1], sys.argv[2]

try:
    import torch
    if not torch.cuda.is_available() or not hasattr(torch.cuda.memory, "CUDAPluggableAllocator"):
        raise ImportError("no CUDA build of PyTorch 2.x")
except ImportError as e:
    print(f"SKIPPED: {e}")
    sys.exit(77)

CHILD = r'''
import json, os, sys, time
sys.path.insert(0, os.path.join(sys.argv[2], "python"))
use_reservoir = sys.argv[1] == "reservoir"
if use_reservoir:
    import reservoir_torch
    reservoir_torch.install("")
import torch, torch.nn as nn, torch.nn.functional as F
torch.manual_seed(0)
torch.use_deterministic_algorithms(True)
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False
dev = torch.device("cuda")
layer = nn.TransformerEncoderLayer(256, 8, 1024, dropout=0.1, batch_first=True)
model = nn.Sequential(nn.Embedding(1000, 256), nn.TransformerEncoder(layer, 4), nn.Linear(256, 1000)).to(dev)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
gen = torch.Generator(device="cpu").manual_seed(1)
losses = []
for step in range(20):
    if step == 5:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
    x = torch.randint(0, 1000, (16, 128), generator=gen).to(dev)
    y = torch.randint(0, 1000, (16, 128), generator=gen).to(dev)
    loss = F.cross_entropy(model(x).view(-1, 1000), y.view(-1))
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    losses.append(loss.item().hex())
torch.cuda.synchronize()
steps_per_second = 15 / (time.perf_counter() - t0)
stats = reservoir_torch.memory_stats() if use_reservoir else torch.cuda.memory_stats()
keys = ["requested_bytes.all.peak", "requested_bytes.all.allocated", "allocation.all.allocated",
        "allocated_bytes.all.current"]
print(json.dumps({"losses": losses, "stats": {k: stats[k] for k in keys},
                  "steps_per_second": steps_per_second}))
'''

env = {**os.environ, "RESERVOIR_TORCH_LIB": lib, "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
results = {}
for which in ("native", "reservoir"):
    out = subprocess.run([sys.executable, "-c", CHILD, which, src], env=env, check=True,
                         capture_output=True, text=True).stdout
    results[which] = json.loads(out.strip().splitlines()[-1])
n, r = results["native"], results["reservoir"]
failures = []
if n["losses"] != r["losses"]:
    failures.append(f"losses differ: native {n['losses'][:3]}..., reservoir {r['losses'][:3]}...")
for key, value in n["stats"].items():
    if r["stats"][key] != value:
        failures.append(f"{key}: native {value}, reservoir {r['stats'][key]}")
print(json.dumps(results, indent=1))
print(f"steps per second: native {n['steps_per_second']:.2f}, reservoir {r['steps_per_second']:.2f}")
if failures:
    print("FAILED:\n  " + "\n  ".join(failures))
    sys.exit(1)
print("identical losses and request statistics")
