"""The answer at the moment of an out-of-memory error on a real GPU
(reservoir.explain_oom), and what its recording costs there.

1. answer: under a memory fraction of 2 GiB, a fragmenting program (two
   800 MiB segments carved into 120 MiB tensors, every other one freed) runs
   out of memory; the error carries PyTorch's message first and whole, then
   reservoir's lines (at most eight), the snapshot and the page are written,
   and the analysis took the time it reports.
2. batch_finder: a batch-size finder of the usual kind (a step whose
   activations grow with the batch, the batch shrunk by an eighth after each
   out-of-memory error until a step completes, every error caught) under a
   memory fraction of --finder-gib, switched on as people switch it on
   (RESERVOIR_EXPLAIN_OOM=1, read at start-up by the package's .pth), under
   PyTorch's allocator and under reservoir's own, beside the same loop with
   nothing explained: the same batch found after the same errors, each
   exception carrying the answer to its own request once, the files of the
   three most recent errors kept; the answer's cost per error.
3. recording_cost: bench/torch_recording_bench.py (history off, explain_oom's
   recording, with Python stacks) per allocate/free pair and per training step.

Prints one JSON line per check and a last line with every verdict.
Run: python3 explain_oom_check.py [--bench PATH] [--only CHECK,...] [--finder-gib N]
(PYTHONPATH: reservoir's package, as installed, with its .pth)
"""
import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

MiB = 1 << 20


def answer(workdir):
    import reservoir

    out_dir = os.path.join(workdir, "oom")
    reservoir.explain_oom(out_dir)
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction((2 << 30) / total)
    a = torch.empty(800 * MiB, dtype=torch.uint8, device="cuda")
    b = torch.empty(800 * MiB, dtype=torch.uint8, device="cuda")
    del a, b
    ts = [torch.empty(120 * MiB, dtype=torch.uint8, device="cuda") for _ in range(12)]
    keep = ts[::2]  # noqa: F841 - pins the segments
    del ts
    t0 = time.perf_counter()
    message = None
    try:
        torch.empty(1000 * MiB, dtype=torch.uint8, device="cuda")
    except torch.OutOfMemoryError as e:
        message = str(e)
    seconds = time.perf_counter() - t0
    torch.cuda.set_per_process_memory_fraction(1.0)
    if message is None:
        return {"check": "answer", "ok": False, "error": "the request did not fail"}
    pytorch, _, ours = message.partition("\nreservoir")
    lines = ("reservoir" + ours).splitlines() if ours else []
    files = sorted(os.path.basename(p) for p in glob.glob(os.path.join(out_dir, "*")))
    ok = (pytorch.startswith("CUDA out of memory. Tried to allocate 1000.00 MiB.") and 2 <= len(lines) <= 8
          and lines[0].startswith("reservoir: out of memory on a 1000.00 MiB request: ")
          and any(f.endswith(".pickle") for f in files) and any(f.endswith("-advice.html") for f in files))
    return {"check": "answer", "ok": ok, "lines": lines, "files": files, "seconds_at_error": seconds}


# The finder's program, in a process of its own. CAP is the memory it may use
# (a memory fraction of the device); the weights take a quarter of it, a
# sample's three activations 64, 96 and 32 KiB, and the first batch is
# CAP / 64 KiB samples (65,536 at 4 GiB), so that it needs four times what is
# left beside the weights, and about a dozen errors come before a batch fits
# (more than the sizes alone say: the segments cached from the failed
# batches fragment what is left).
FINDER = """
import json, os, site, sys, time
site.addsitedir(os.environ["FINDER_SITE"])  # the installed package's .pth, as site-packages is read
import torch
cap = int(os.environ["FINDER_CAP"])
total = torch.cuda.get_device_properties(0).total_memory
torch.cuda.set_per_process_memory_fraction(cap / total)
weights = torch.empty(cap // 4, dtype=torch.uint8, device="cuda")
per_sample = [k * 1024 for k in (64, 96, 32)]
stage = 0
def step(batch):
    global stage
    held = []
    for stage, per in enumerate(per_sample):
        held.append(torch.empty(batch * per, dtype=torch.uint8, device="cuda"))
batch, errors = cap >> 16, []
t0 = time.perf_counter()
while batch >= 1:
    try:
        step(batch)
        break
    except torch.OutOfMemoryError as e:
        errors.append([str(e), batch, stage])
        batch = batch * 7 // 8
seconds = time.perf_counter() - t0
print("RESULT " + json.dumps({"batch": batch, "errors": errors, "seconds": seconds,
                              "allocator": torch.cuda.get_allocator_backend()}), flush=True)
"""
KEEP = 3


def finder_run(workdir, name, cap, env_more):
    import reservoir

    site_dir = os.path.dirname(os.path.dirname(os.path.abspath(reservoir.__file__)))
    env = {k: v for k, v in os.environ.items()
           if k not in ("RESERVOIR_EXPLAIN_OOM", "RESERVOIR_TORCH_ALLOCATOR", "PYTORCH_ALLOC_CONF",
                        "PYTORCH_CUDA_ALLOC_CONF", "RESERVOIR_OOM_DIR", "RESERVOIR_EXPLAIN_OOM_KEEP")}
    oom_dir = os.path.join(workdir, "finder-" + name)
    env.update({"FINDER_SITE": site_dir, "FINDER_CAP": str(cap),
                "RESERVOIR_OOM_DIR": oom_dir, **env_more})
    r = subprocess.run([sys.executable, "-W", "ignore", "-c", FINDER], capture_output=True, text=True,
                       timeout=240, env=env)
    lines = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
    if r.returncode != 0 or not lines:
        raise RuntimeError(f"{name}: exit {r.returncode}: {(r.stdout + r.stderr)[-1500:]}")
    out = json.loads(lines[-1][len("RESULT "):])
    out["files"] = sorted(os.path.basename(p) for p in glob.glob(os.path.join(oom_dir, "*")))
    return out


def batch_finder(workdir, gib):
    from reservoir.oom import format_size

    cap = int(gib * (1 << 30))
    per_sample = [k * 1024 for k in (64, 96, 32)]
    explain = {"RESERVOIR_EXPLAIN_OOM": "1", "RESERVOIR_EXPLAIN_OOM_KEEP": str(KEEP)}
    runs = {"plain": finder_run(workdir, "plain", cap, {}),
            "pytorch": finder_run(workdir, "pytorch", cap, explain),
            "own": finder_run(workdir, "own", cap, {**explain, "RESERVOIR_TORCH_ALLOCATOR": "own"})}
    plain = runs["plain"]
    problems = []
    if len(plain["errors"]) < 8:
        problems.append(f"the plain loop met {len(plain['errors'])} errors, not at least 8")
    summary = {}
    for name in ("pytorch", "own"):
        got = runs[name]
        if (got["batch"], len(got["errors"])) != (plain["batch"], len(plain["errors"])):
            problems.append(f"{name}: batch {got['batch']} after {len(got['errors'])} errors, "
                            f"plain {plain['batch']} after {len(plain['errors'])}")
        wrong = 0
        for (message, batch, stage), (plain_message, _, _) in zip(got["errors"], plain["errors"]):
            pytorch, _, ours = message.partition("\nreservoir")
            lines = ("reservoir" + ours).splitlines() if ours else []
            head = f"reservoir: out of memory on a {format_size(batch * per_sample[stage])} request: "
            if (not lines or not lines[0].startswith(head)
                    or sum(x.startswith("reservoir: out of memory on a ") for x in lines) != 1
                    or pytorch.split(" Including")[0] != plain_message.split(" Including")[0]):
                wrong += 1
        if wrong:
            problems.append(f"{name}: {wrong} of {len(got['errors'])} errors without their own answer")
        pickles = sum(f.endswith(".pickle") for f in got["files"])
        pages = sum(f.endswith("-advice.html") for f in got["files"])
        if (pickles, pages) != (KEEP, KEEP):
            problems.append(f"{name}: {pickles} snapshots and {pages} pages kept, not {KEEP}")
        first = got["errors"][0][0].partition("\nreservoir")[2] if got["errors"] else ""
        summary[name] = {"allocator": got["allocator"], "errors": len(got["errors"]), "seconds": got["seconds"],
                         "ms_per_error": 1000 * (got["seconds"] - plain["seconds"]) / max(1, len(got["errors"])),
                         "first_answer": ("reservoir" + first)[:400] if first else ""}
    if runs["own"]["allocator"] != "reservoir":
        problems.append(f"RESERVOIR_TORCH_ALLOCATOR=own: the allocator is {runs['own']['allocator']!r}, "
                        "not reservoir's")
    return {"check": "batch_finder", "ok": not problems, "problems": problems, "cap_bytes": cap,
            "batch": plain["batch"], "errors": len(plain["errors"]), "plain_seconds": plain["seconds"],
            "explained": summary}


def recording_cost(bench, workdir):
    out = os.path.join(workdir, "recording.json")
    r = subprocess.run([sys.executable, bench, "--json", out], capture_output=True, text=True, timeout=240)
    if r.returncode != 0:
        return {"check": "recording_cost", "ok": False, "error": r.stderr[-1500:]}
    with open(out) as f:
        figures = json.load(f)
    return {"check": "recording_cost", "ok": True, "table": r.stdout, **figures}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bench", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                     "torch_recording_bench.py"))
    ap.add_argument("--only", default="", help="comma-separated checks (default: all three)")
    ap.add_argument("--finder-gib", type=float, default=4.0,
                    help="the memory fraction the batch-size finder runs under, in GiB (default 4)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 77
    verdicts = {}
    with tempfile.TemporaryDirectory(prefix="explain-oom-") as workdir:
        checks = (("answer", lambda: answer(workdir)),
                  ("batch_finder", lambda: batch_finder(workdir, args.finder_gib)),
                  ("recording_cost", lambda: recording_cost(args.bench, workdir)))
        only = [x for x in args.only.split(",") if x]
        unknown = set(only) - {name for name, _ in checks}
        if unknown:
            print(f"explain_oom_check: unknown checks {sorted(unknown)}", file=sys.stderr)
            return 2
        for name, fn in checks:
            if only and name not in only:
                continue
            try:
                result = fn()
            except Exception as e:  # noqa: BLE001 - each check reports its own failure
                result = {"check": name, "ok": False, "error": f"{type(e).__name__}: {e}"}
            print(json.dumps(result), flush=True)
            verdicts[name] = bool(result.get("ok"))
    print(json.dumps({"checks": verdicts}))
    return 0 if all(verdicts.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
