#!/usr/bin/env python3
"""policy:native_paged against reservoir's native policy on a real driver,
both as PyTorch's own allocator (reservoir.use_as_allocator): the same
training loop (a small transformer, batches of varying sequence length, so
segments of many sizes come and go) in a process per run, with the
allocator's history on. From each run's snapshot, reserved memory after
every allocation and free of the program; the two runs compared call by
call, with their losses (bitwise equal) and steps per second.

Two pairs of runs: under the running release's rules, and under
pytorch_version:2.15's. From PyTorch 2.12 ties among cached blocks of one
size go to the oldest segment, so the order in which the driver hands out
addresses decides nothing: native_paged must never hold more than native at
any call (the check fails otherwise). Before 2.12 the lowest address wins,
and a driver that gives a lower address after a free (as an H100 did,
tests/data/gpu/h100-2026-11-25, malloc_sequence) can lay the native policy's
segments out otherwise than native_paged's arena: that pair is measured and
reported, not required.

Prints one JSON line {"check": "native_paged", "ok": ..., ...}; exit 1 when
not ok. Runs on the simulated CUDA device too (make test's torch suite).

    python3 tests/gpu/native_paged_check.py [--steps N] [--program train|allocations]
    (reservoir importable, e.g. the bundle's wheel installed)
"""
import argparse
import json
import os
import pickle
import subprocess
import sys
import tempfile

CHILD = r'''
import json, sys, time
config, steps, snapshot_path, program = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
import torch, torch.nn as nn, torch.nn.functional as F
import reservoir
reservoir.use_as_allocator(config)
torch.cuda.memory._record_memory_history(max_entries=1000000)
lengths = [32, 256, 64, 512, 128, 384, 48, 320, 96, 448]
dev = torch.device("cuda")
if program == "allocations":
    # The loop's allocations without its kernels (for a device that runs
    # none): weights, then per step activations and attention scores
    # scaled by the step's length, freed in reverse.
    weights = [torch.empty(s, dtype=torch.uint8, device=dev) for s in (1 << 20, 3 << 20, 700 << 10, 5 << 20)]
    t0 = time.perf_counter()
    for step in range(steps):
        n = lengths[step % len(lengths)]
        acts = []
        for layer in range(4):
            acts.append(torch.empty((8, n, 256), dtype=torch.float32, device=dev))
            scores = torch.empty((8, 8, n, n), dtype=torch.float32, device=dev)
            acts.append(torch.empty((8, n, 1024), dtype=torch.float32, device=dev))
            del scores
        while acts:
            grad = torch.empty_like(acts[-1])
            acts.pop()
            del grad
    seconds = time.perf_counter() - t0
    torch.cuda.memory._dump_snapshot(snapshot_path)
    print("RESULT " + json.dumps({"config": config, "losses": [], "steps": steps, "seconds": seconds,
                                  "reserved": torch.cuda.memory_reserved()}))
    sys.exit(0)
torch.manual_seed(0)
torch.use_deterministic_algorithms(True)
torch.backends.cuda.matmul.allow_tf32 = False
layer = nn.TransformerEncoderLayer(256, 8, 1024, dropout=0.0, batch_first=True)
model = nn.Sequential(nn.Embedding(1000, 256), nn.TransformerEncoder(layer, 2), nn.Linear(256, 1000)).to(dev)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
gen = torch.Generator(device="cpu").manual_seed(1)
losses = []
torch.cuda.synchronize()
t0 = time.perf_counter()
for step in range(steps):
    n = lengths[step % len(lengths)]
    x = torch.randint(0, 1000, (8, n), generator=gen).to(dev)
    loss = F.cross_entropy(model(x).view(-1, 1000), x.view(-1))
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    losses.append(loss.item().hex())
torch.cuda.synchronize()
seconds = time.perf_counter() - t0
torch.cuda.memory._dump_snapshot(snapshot_path)
print("RESULT " + json.dumps({"config": config, "losses": losses, "steps": steps, "seconds": seconds,
                              "reserved": torch.cuda.memory_reserved()}))
'''

GROW = {"segment_alloc": 1, "segment_map": 1, "segment_free": -1, "segment_unmap": -1}


def reserved_per_call(path):
    """[(action, size, reserved after it)] for every allocation and free
    request of device 0's history, reserved counted from its segment events."""
    with open(path, "rb") as f:
        snap = pickle.load(f)
    traces = snap.get("device_traces") or [[]]
    reserved = 0
    calls = []
    for e in traces[0]:
        action = e.get("action")
        if action in GROW:
            reserved += GROW[action] * int(e.get("size", 0))
        elif action in ("alloc", "free_requested"):
            calls.append((action, int(e.get("size", 0)), reserved))
    return calls


def run_child(config, steps, scratch, program):
    snapshot = os.path.join(scratch, (config or "native").replace(":", "_").replace(",", "_") + ".pickle")
    r = subprocess.run([sys.executable, "-c", CHILD, config, str(steps), snapshot, program],
                       capture_output=True, text=True, timeout=240)
    result = next((json.loads(line[7:]) for line in r.stdout.splitlines() if line.startswith("RESULT ")), None)
    if r.returncode != 0 or result is None:
        raise RuntimeError(f"[{config}] exit {r.returncode}: {(r.stderr or r.stdout)[-1500:]}")
    result["calls"] = reserved_per_call(snapshot)
    return result


def compare(native, paged):
    a, b = native["calls"], paged["calls"]
    same_program = len(a) == len(b) and all(x[:2] == y[:2] for x, y in zip(a, b))
    above = [(i, y[2] - x[2]) for i, (x, y) in enumerate(zip(a, b)) if y[2] > x[2]]
    return {
        "calls": len(a),
        "same_program": same_program,
        "identical_losses": native["losses"] == paged["losses"],
        "calls_above_native": len(above),
        "most_above_native_bytes": max((d for _, d in above), default=0),
        "first_call_above": above[0][0] if above else None,
        "peak_reserved": {"native": max((c[2] for c in a), default=0),
                          "native_paged": max((c[2] for c in b), default=0)},
        "reserved_below_native_calls": sum(1 for x, y in zip(a, b) if y[2] < x[2]),
        "steps_per_second": {"native": native["steps"] / native["seconds"],
                             "native_paged": paged["steps"] / paged["seconds"]},
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--program", choices=("train", "allocations"), default="train",
                    help="train: a transformer's training steps (a GPU); allocations: the same "
                         "pattern of allocations without kernels (the simulated device)")
    args = ap.parse_args()
    import torch  # the release whose rules the first pair follows
    release = ".".join(torch.__version__.split("+")[0].split(".")[:2])
    out = {"check": "native_paged", "torch": torch.__version__}
    with tempfile.TemporaryDirectory() as scratch:
        pairs = {}
        for rules in ("", "pytorch_version:2.15"):
            sep = "," if rules else ""
            native = run_child(rules, args.steps, scratch, args.program)
            paged = run_child(rules + sep + "policy:native_paged", args.steps, scratch, args.program)
            pairs[rules or f"{release} (running)"] = compare(native, paged)
    out["pairs"] = pairs
    strict = pairs["pytorch_version:2.15"]
    ok = all(p["same_program"] and p["identical_losses"] for p in pairs.values())
    ok = ok and strict["calls_above_native"] == 0 and strict["calls"] > 0
    out["ok"] = ok
    print(json.dumps(out))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
