"""PyTorch under libreservoir_preload.so: a small model's training steps run
with and without the interposer, and once more with PyTorch's own cache off
(PYTORCH_NO_CUDA_MEMORY_CACHING=1, so that every tensor is a cudaMalloc
call). The losses must be bitwise identical in all three runs, and the
interposer's statistics (RESERVOIR_PRELOAD_STATS) must show that reservoir
served PyTorch's device allocations: at least one reservoir allocation for
every segment PyTorch allocated.

Usage: torch_preload_test.py LIBRESERVOIR_PRELOAD WORK_DIR    (exit 77 without CUDA PyTorch)
"""
import json
import os
import subprocess
import sys

preload, work = os.path.abspath(sys.argv[1]), sys.argv[2]

try:
    import torch
    if not torch.cuda.is_available():
        raise ImportError("torch.cuda.is_available() is False")
except ImportError as e:
    print(f"SKIPPED: {e}")
    sys.exit(77)

CHILD = r'''
import json
import torch, torch.nn as nn, torch.nn.functional as F
torch.manual_seed(0)
torch.use_deterministic_algorithms(True)
torch.backends.cuda.matmul.allow_tf32 = False
dev = torch.device("cuda")
model = nn.Sequential(nn.Linear(512, 2048), nn.GELU(), nn.Linear(2048, 512)).to(dev)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
gen = torch.Generator(device="cpu").manual_seed(1)
losses = []
for step in range(10):
    x = torch.randn(256, 512, generator=gen).to(dev)
    loss = F.mse_loss(model(x), x)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    losses.append(loss.item().hex())
big = torch.empty(300 << 20, dtype=torch.uint8, device=dev).fill_(7)  # a large segment too
assert int(big.sum().item()) == 7 * (300 << 20)
del big
torch.cuda.synchronize()
s = torch.cuda.memory_stats()
print(json.dumps({"losses": losses, "torch_segments": s.get("segment.all.allocated", 0),
                  "torch_allocations": s.get("allocation.all.allocated", 0)}))
'''

os.makedirs(work, exist_ok=True)
env0 = {**os.environ, "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
env0.pop("LD_PRELOAD", None)
runs = {}
for name, extra in (("plain", {}),
                    ("preload", {"LD_PRELOAD": preload}),
                    ("preload_no_torch_cache", {"LD_PRELOAD": preload,
                                                "PYTORCH_NO_CUDA_MEMORY_CACHING": "1"})):
    stats_file = os.path.join(work, f"preload_stats_{name}.json")
    if os.path.exists(stats_file):
        os.remove(stats_file)
    env = {**env0, **extra}
    if "LD_PRELOAD" in extra:
        env["RESERVOIR_PRELOAD_STATS"] = stats_file
    p = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True)
    if p.returncode != 0:
        print(p.stdout, p.stderr)
        sys.exit(f"{name}: the PyTorch program failed (exit {p.returncode})")
    runs[name] = json.loads(p.stdout.strip().splitlines()[-1])
    if "LD_PRELOAD" in extra:
        if not os.path.exists(stats_file):
            print(p.stderr)
            sys.exit(f"{name}: the interposer wrote no statistics (was it loaded?)")
        with open(stats_file) as f:
            runs[name]["reservoir"] = json.load(f).get("0", {})

failures = []
base = runs["plain"]["losses"]
for name, run in runs.items():
    if run["losses"] != base:
        failures.append(f"{name}: losses {run['losses'][:2]}... differ from {base[:2]}...")
    if name == "plain":
        continue
    served = run["reservoir"].get("allocation.all.allocated", 0)
    wanted = run["torch_segments"] if name == "preload" else run["torch_allocations"]
    print(f"{name}: PyTorch made {wanted} device allocations "
          f"({'segments' if name == 'preload' else 'tensors, cache off'}); reservoir served {served}, "
          f"peak reserved {run['reservoir'].get('reserved_bytes.all.peak', 0)} bytes")
    if served < max(wanted, 1):
        failures.append(f"{name}: reservoir served {served} allocations, PyTorch made {wanted}")
print(json.dumps({k: {kk: vv for kk, vv in v.items() if kk != "reservoir"} for k, v in runs.items()}))
if failures:
    print("FAILED:\n  " + "\n  ".join(failures))
    sys.exit(1)
print("identical losses with and without the interposer; PyTorch's allocations served by reservoir")
