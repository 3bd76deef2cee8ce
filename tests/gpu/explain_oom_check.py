"""The answer at the moment of an out-of-memory error on a real GPU
(reservoir.explain_oom), and what its recording costs there.

1. answer: under a memory fraction of 2 GiB, a fragmenting program (two
   800 MiB segments carved into 120 MiB tensors, every other one freed) runs
   out of memory; the error carries PyTorch's message first and whole, then
   reservoir's lines (at most eight), the snapshot and the page are written,
   and the analysis took the time it reports.
2. recording_cost: bench/torch_recording_bench.py (history off, explain_oom's
   recording, with Python stacks) per allocate/free pair and per training step.

Prints one JSON line per check and a last line with every verdict.
Run: python3 explain_oom_check.py [--bench PATH] (PYTHONPATH: reservoir's package)
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
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 77
    verdicts = {}
    with tempfile.TemporaryDirectory(prefix="explain-oom-") as workdir:
        for name, fn in (("answer", lambda: answer(workdir)),
                         ("recording_cost", lambda: recording_cost(args.bench, workdir))):
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
