#!/usr/bin/env python3
"""reservoir as PyTorch's own CUDA allocator on a GPU: reservoir.use_as_allocator()
(a CUDAAllocator built for the running release; --api pluggable:
install_torch(), the pluggable allocator with every hook) under the native,
expandable, paging and native_paged policies, beside PyTorch's allocator.

Each run, in its own process: ten training steps of a small transformer
(bitwise-identical losses required), then empty_cache() (reservoir's native
policy keeps what PyTorch's keeps, read through torch.cuda.memory_stats(),
which the own allocator answers; under the pluggable one reservoir.stats()),
a CUDA graph captured and replayed (the same output as eager; with the own
allocator also after its pool's checkpoint is restored, as CUDA graph trees
do), a block
recorded on a second stream, set_per_process_memory_fraction driving an
allocation into torch.cuda.OutOfMemoryError, and (own allocator) a snapshot
dumped with history on, which `reservoir verify` must agree with when
--reservoir-cli is given. Then (own allocator) a CUDA tensor sent through
torch.multiprocessing from reservoir to PyTorch's allocator and back: the
child sums what the parent made, and writes where the parent reads. One
JSON line per run; exit 1 on a difference.

    python3 tests/gpu/own_allocator_check.py [--api own|pluggable] [--reservoir-cli PATH]
    (reservoir importable, e.g. the bundle's wheel installed)
"""
import json
import os
import subprocess
import sys

CHILD = r'''
import json, sys, time
config, api, snapshot_path = sys.argv[1], sys.argv[2], sys.argv[3]
import torch, torch.nn as nn, torch.nn.functional as F
if config != "native":
    import reservoir
    if api == "own":
        reservoir.use_as_allocator(config)
    else:
        reservoir.install_torch(config)
if snapshot_path:
    torch.cuda.memory._record_memory_history(max_entries=200000)
torch.manual_seed(0)
torch.use_deterministic_algorithms(True)
torch.backends.cuda.matmul.allow_tf32 = False
dev = torch.device("cuda")
layer = nn.TransformerEncoderLayer(256, 8, 1024, dropout=0.1, batch_first=True)
model = nn.Sequential(nn.Embedding(1000, 256), nn.TransformerEncoder(layer, 3), nn.Linear(256, 1000)).to(dev)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
gen = torch.Generator(device="cpu").manual_seed(1)
losses = []
t0 = time.perf_counter()
for step in range(10):
    x = torch.randint(0, 1000, (16, 128), generator=gen).to(dev)
    loss = F.cross_entropy(model(x).view(-1, 1000), x.view(-1))
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    losses.append(loss.item().hex())
torch.cuda.synchronize()
seconds = time.perf_counter() - t0
del x, loss
torch.cuda.empty_cache()
if config == "native" or api == "own":
    live, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
else:  # PyTorch's pluggable allocator does not forward memory_stats(): reservoir's own
    stats = reservoir.stats(0)
    live, reserved = stats["allocated_bytes.all.current"], stats["reserved_bytes.all.current"]
# A CUDA graph: captured into a private pool, replayed, the same as eager.
model.eval()
static_x = torch.randint(0, 1000, (4, 64), generator=gen).to(dev)
with torch.no_grad():
    eager = model(static_x).clone()
    side_warm = torch.cuda.Stream()
    side_warm.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side_warm):
        for _ in range(2):
            model(static_x)
    torch.cuda.current_stream().wait_stream(side_warm)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = model(static_x)
    graph.replay()
    torch.cuda.synchronize()
    graph_same = bool(torch.equal(static_y, eager))
    # What CUDA graph trees do before recording after a replay: the graph
    # pool's layout checkpointed and laid out again (own allocator only:
    # the pluggable one forwards no such call), then replayed once more.
    checkpoint = "not asked"
    if api == "own" or config == "native":
        try:
            state = torch._C._cuda_getCheckpointState(0, graph.pool())
            torch._C._cuda_setCheckpointPoolState(0, state, [], [])
            graph.replay()
            torch.cuda.synchronize()
            checkpoint = "same" if torch.equal(static_y, eager) else "differs after a restore"
        except RuntimeError as e:
            checkpoint = str(e)[:300]
del graph, static_y, eager
side = torch.cuda.Stream()
a = torch.empty(64 << 20, dtype=torch.uint8, device=dev)
a.record_stream(side)
pa = a.data_ptr()
del a
b = torch.empty(64 << 20, dtype=torch.uint8, device=dev)  # may reuse a's block only once side is idle
side.synchronize()
del b
# graph_capture_record_stream_reuse:True (PyTorch 2.9+): a block freed in a
# capture after use on a side stream, reused once the capture stream waited
# on it, not before (the real runtime's capture graph); the replay computes
# what eager does. Not under the pluggable allocator (PyTorch's pluggable
# interface has no such setting).
capture_reuse = "not asked"
if (config == "native" or api == "own") and hasattr(torch.cuda.memory, "_set_allocator_settings"):
    try:
        torch.cuda.memory._set_allocator_settings("graph_capture_record_stream_reuse:True")
        side2 = torch.cuda.Stream()
        g2 = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g2):
            cap = torch.cuda.current_stream()
            xx = torch.empty(3 << 20, dtype=torch.uint8, device=dev)
            xx.fill_(1)
            side2.wait_stream(cap)
            with torch.cuda.stream(side2):
                out2 = xx.to(torch.int32).sum().reshape(1)
            xx.record_stream(side2)
            freed = xx.data_ptr()
            del xx
            yy = torch.empty(3 << 20, dtype=torch.uint8, device=dev)
            cap.wait_stream(side2)
            zz = torch.empty(3 << 20, dtype=torch.uint8, device=dev)
            zz.fill_(7)
        g2.replay()
        torch.cuda.synchronize()
        capture_reuse = {"reused": [yy.data_ptr() == freed, zz.data_ptr() == freed],
                         "sum": int(out2.item()), "filled": bool((zz == 7).all())}
        del g2, yy, zz, out2
        torch.cuda.memory._set_allocator_settings("graph_capture_record_stream_reuse:False")
    except (RuntimeError, AttributeError) as e:
        capture_reuse = str(e)[:300]
# The profiler's memory events: PyTorch's allocator reports each allocation
# and free (and reservoir's own allocator does too). With the profiler's
# default activities, as people start it: the GPU's, through the real CUPTI,
# beside the allocator's events (the simulated device has no GPU activity to
# trace).
profiler_events = "not asked"
if config == "native" or api == "own":
    from torch.profiler import profile
    with profile(profile_memory=True) as prof:
        pe = torch.empty(5 << 20, dtype=torch.uint8, device=dev)
        del pe
    usage = [getattr(e, "device_memory_usage", getattr(e, "cuda_memory_usage", 0)) for e in prof.events()
             if e.name == "[memory]"]
    profiler_events = sorted(u for u in usage if u != 0)
total = torch.cuda.get_device_properties(0).total_memory
torch.cuda.set_per_process_memory_fraction((reserved + (256 << 20)) / total)
try:
    big = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    oom = "no error"
except torch.OutOfMemoryError as e:
    oom = "OutOfMemoryError"
if snapshot_path:
    torch.cuda.memory._dump_snapshot(snapshot_path)
print("RESULT " + json.dumps({"config": config, "losses": losses, "seconds": seconds, "live": live,
                              "reserved_after_empty_cache": reserved, "oom_under_fraction": oom,
                              "graph_same_as_eager": graph_same, "checkpoint": checkpoint,
                              "capture_reuse": capture_reuse, "profiler_events": profiler_events}))
'''


# torch.multiprocessing's CUDA tensors between reservoir (own allocator,
# native policy) and PyTorch's allocator, both ways: PyTorch's handle format
# on a real GPU (cudaIpcMemHandle_t, the block's offset in its segment).
IPC = r'''
import json, sys
import torch
import torch.multiprocessing as mp

def install(mode):
    if mode == "reservoir":
        import reservoir
        reservoir.use_as_allocator("")

def child(mode, queue, done):
    install(mode)
    x = queue.get()
    seen = int(x.sum().item())
    x[:1000].fill_(3)
    torch.cuda.synchronize()
    done.put((seen, torch.cuda.get_allocator_backend()))
    del x

if __name__ == "__main__":
    parent, child_mode = sys.argv[1:3]
    install(parent)
    first = torch.empty(2 << 20, dtype=torch.uint8, device="cuda")
    x = torch.ones(3 << 20, dtype=torch.int64, device="cuda")
    ctx = mp.get_context("spawn")
    queue, done = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=child, args=(child_mode, queue, done))
    p.start()
    queue.put(x)
    seen, backend = done.get(timeout=120)
    p.join(timeout=60)
    print("RESULT " + json.dumps({"seen": seen, "after": int(x.sum().item()), "child": backend,
                                  "parent": torch.cuda.get_allocator_backend(), "exit": p.exitcode}))
'''


def ipc_round_trips(scratch):
    """Failures of the two IPC round trips (none when both agree)."""
    script = os.path.join(scratch, "ipc.py")
    with open(script, "w") as f:
        f.write(IPC)
    failures = []
    n = 3 << 20
    for parent, child in (("reservoir", "native"), ("native", "reservoir")):
        p = subprocess.run([sys.executable, script, parent, child], capture_output=True, text=True, timeout=300)
        line = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
        if p.returncode != 0 or not line:
            failures.append(f"IPC {parent} -> {child}: exit {p.returncode}: {(p.stdout + p.stderr)[-1500:]}")
            continue
        r = json.loads(line[-1][len("RESULT "):])
        print(json.dumps({"ipc": f"{parent} -> {child}"} | r))
        if r != {"seen": n, "after": n + 2 * 1000, "child": child, "parent": parent, "exit": 0}:
            failures.append(f"IPC {parent} -> {child}: {r}")
    return failures


def main():
    import argparse
    import tempfile
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--api", choices=["own", "pluggable"], default="own")
    ap.add_argument("--reservoir-cli", default="", help="the reservoir tool, to verify the dumped snapshot")
    args = ap.parse_args()
    scratch = tempfile.mkdtemp(prefix="own-allocator-")
    results, failures = {}, []
    for config in ("native", "", "expandable_segments:True", "policy:paging", "policy:native_paged"):
        snapshot = os.path.join(scratch, "reservoir_native.pickle") if config == "" and args.api == "own" else ""
        p = subprocess.run([sys.executable, "-c", CHILD, config, args.api, snapshot], capture_output=True,
                           text=True, timeout=240, env={**os.environ, "CUBLAS_WORKSPACE_CONFIG": ":4096:8"})
        line = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
        if p.returncode != 0 or not line:
            failures.append(f"{config or 'reservoir native'}: exit {p.returncode}: {(p.stdout + p.stderr)[-1500:]}")
            continue
        r = json.loads(line[-1][len("RESULT "):])
        results[config] = r
        print(json.dumps({k: v for k, v in r.items() if k != "losses"} | {"first_loss": r["losses"][0]}))
        if r["oom_under_fraction"] != "OutOfMemoryError":
            failures.append(f"{config}: the memory fraction did not stop a 1 GiB allocation")
        if not r["graph_same_as_eager"]:
            failures.append(f"{config}: the replayed CUDA graph's output differs from eager")
        if r["checkpoint"] not in ("same", "not asked"):
            failures.append(f"{config}: the graph pool's checkpoint restored: {r['checkpoint']}")
        if snapshot and args.reservoir_cli:
            v = subprocess.run([args.reservoir_cli, "verify", snapshot], capture_output=True, text=True)
            print(v.stdout.strip())
            if v.returncode != 0:
                failures.append(f"reservoir verify of the snapshot under reservoir: exit {v.returncode}: {v.stdout[-500:]}")
    if args.api == "own":
        failures += ipc_round_trips(scratch)
    native = results.get("native")
    if native and isinstance(native["capture_reuse"], dict) and native["capture_reuse"]["reused"] != [False, True]:
        failures.append(f"PyTorch's allocator did not reuse the block as expected: {native['capture_reuse']}")
    for config, r in results.items():
        if native and r["losses"] != native["losses"]:
            failures.append(f"{config}: losses differ from native's ({r['losses'][:2]} vs {native['losses'][:2]})")
        # A capture's reuse of a block freed after record_stream, and the
        # profiler's memory events: PyTorch's under reservoir's native policy.
        if native and config == "" and r["capture_reuse"] != native["capture_reuse"]:
            failures.append(f"capture reuse: PyTorch {native['capture_reuse']}, reservoir {r['capture_reuse']}")
        if native and config == "" and r["profiler_events"] != native["profiler_events"]:
            failures.append(f"profiler memory events: PyTorch {native['profiler_events']}, "
                            f"reservoir {r['profiler_events']}")
        if isinstance(r["capture_reuse"], dict) and (r["capture_reuse"]["sum"] != 3 << 20 or
                                                     not r["capture_reuse"]["filled"]):
            failures.append(f"{config}: the graph that reused a block computed {r['capture_reuse']}")
    # reservoir's native policy makes PyTorch's decisions: the same memory live and reserved after empty_cache.
    if native and "" in results:
        for key in ("live", "reserved_after_empty_cache"):
            if results[""][key] != native[key]:
                failures.append(f"{key}: PyTorch {native[key]}, reservoir's native policy {results[''][key]}")
    if failures:
        print("FAILED:\n  " + "\n  ".join(failures))
        return 1
    print(f"identical losses under {len(results) - 1} reservoir policies and native ({args.api} allocator); "
          "empty_cache() and the memory fraction reach reservoir; a CUDA graph replays as eager; a block recorded "
          "on a second stream freed and reallocated without error"
          + ("; CUDA tensors shared with PyTorch's allocator both ways" if args.api == "own" else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
