"""reservoir as PyTorch's own allocator, driven into out-of-memory errors at
random points, under AddressSanitizer and UBSan (the ASan build's Python
module and own-allocator library, PyTorch on the simulated CUDA device): each
seeded program draws a device size, a policy, history (entries, stacks), an
out-of-memory observer that takes a snapshot, the live answer, and a training
loop whose batches grow until errors come in forward and in backward (on
autograd's thread); it catches every error, dumps snapshots, empties the
cache, and exits. A program passes when it exits 0 with no sanitizer report,
so a write after free or out of bounds anywhere on the error path (history,
snapshot, observer, the answer, the allocator's teardown at exit) fails it.

  error_path.py PROGRAMS [FIRST_SEED]   (environment: see tests/CMakeLists.txt)
"""
import os
import random
import subprocess
import sys
import tempfile

PROGRAM = r'''
import os, pickle, random, sys
import torch
rng = random.Random(int(sys.argv[1]))
spec = eval(sys.argv[2])
MiB = 1 << 20
if spec["history"]:
    torch.cuda.memory._record_memory_history(max_entries=spec["entries"], stacks=spec["stacks"])
if spec["observer"]:
    def observer(device, alloc, device_alloc, device_free):
        with open(os.path.join(spec["dir"], "observer.pickle"), "wb") as f:
            pickle.dump(torch.cuda.memory._snapshot(), f)
    torch._C._cuda_attach_out_of_memory_observer(observer)
width = spec["width"]
model = torch.nn.Sequential(torch.nn.Linear(256, width), torch.nn.ReLU(), torch.nn.Linear(width, width),
                            torch.nn.ReLU(), torch.nn.Linear(width, 256)).cuda()
opt = torch.optim.Adam(model.parameters())
kept, errors = [], 0
for step in range(spec["steps"]):
    batch = spec["batch"] * (step + 1)
    try:
        x = torch.randn(batch, 256, device="cuda")
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        kept.append(torch.empty(rng.randrange(1, 4 * MiB), dtype=torch.uint8, device="cuda"))
        if rng.random() < 0.3:
            kept.append(torch.empty(rng.randrange(1, 64) * MiB, dtype=torch.uint8, device="cuda"))
    except torch.OutOfMemoryError as e:
        errors += 1
        str(e)
        opt.zero_grad()
        if rng.random() < 0.5 and kept:
            del kept[rng.randrange(len(kept))]
        if rng.random() < spec["dump"]:
            torch.cuda.memory._dump_snapshot(os.path.join(spec["dir"], f"step{step}.pickle"))
        if rng.random() < 0.3:
            torch.cuda.empty_cache()
    if rng.random() < 0.1:
        torch.cuda.memory_stats()
        torch.cuda.memory_summary()
print("errors", errors, flush=True)
'''


def spec_for(seed, directory):
    rng = random.Random(seed)
    return {
        "policy": rng.choice(["", "policy:native_paged", "expandable_segments:True", "max_split_size_mb:64"]),
        "memory": rng.choice(["700MiB", "900MiB", "1100MiB"]),
        "history": rng.random() < 0.85,
        "entries": rng.choice([16, 500, 100_000]),
        "stacks": rng.choice(["python", "all"]),
        "observer": rng.random() < 0.5,
        "explain": rng.random() < 0.5,
        "dump": rng.choice([0.0, 0.3, 1.0]),
        "width": rng.choice([1024, 2048, 3072]),
        "batch": rng.choice([2000, 4000, 8000]),
        "steps": 12,
        "dir": directory,
    }


def main():
    programs = int(sys.argv[1])
    first = int(sys.argv[2]) if len(sys.argv) > 2 else 0
    failed = 0
    for seed in range(first, first + programs):
        with tempfile.TemporaryDirectory() as directory:
            spec = spec_for(seed, directory)
            env = {**os.environ, "RESERVOIR_TORCH_ALLOCATOR": "own", "RESERVOIR_ALLOC_CONF": spec["policy"],
                   "RESERVOIR_SIMCUDA_MEMORY": spec["memory"], "RESERVOIR_SIMCUDA_KERNELS": "skip",
                   "RESERVOIR_OOM_DIR": os.path.join(directory, "oom")}
            env.pop("RESERVOIR_EXPLAIN_OOM", None)
            if spec["explain"]:
                env["RESERVOIR_EXPLAIN_OOM"] = "1"
            # The package's start-up hook (.pth) is read from a site directory.
            code = f"import site; site.addsitedir({os.environ['RESERVOIR_PYTHON_DIR']!r})\n" + PROGRAM
            r = subprocess.run([sys.executable, "-c", code, str(seed), repr(spec)], capture_output=True,
                               text=True, timeout=600, env=env)
            report = [x for x in r.stderr.splitlines() if "Sanitizer" in x or "runtime error" in x]
            errors = [x for x in r.stdout.splitlines() if x.startswith("errors ")]
            ok = r.returncode == 0 and not report and errors
            print(f"seed {seed}: {'ok' if ok else 'FAILED'}: rc {r.returncode}, "
                  f"{errors[0] if errors else 'no result'}; {spec['policy'] or 'native'}, {spec['memory']}, "
                  f"history {spec['history']} ({spec['entries']}, {spec['stacks']}), observer {spec['observer']}, "
                  f"explain {spec['explain']}, dump {spec['dump']}", flush=True)
            if not ok:
                failed += 1
                print(r.stdout[-2000:], r.stderr[-6000:], sep="\n")
    print(f"{programs - failed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
