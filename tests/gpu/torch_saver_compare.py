#!/usr/bin/env python3
"""The real torch_memory_saver beside reservoir's drop-in, on one GPU.

For each implementation (in its own process, hook_mode "torch"): weights of
--gib GiB in a tag backed up to the CPU and a KV cache of the same size in a
tag without backup; --cycles pause/resume cycles of both tags. Printed, one
JSON line per implementation: pause and resume seconds and GiB/s of the
backed-up tag (median over cycles), memory the pauses gave back to the device
(cudaMemGetInfo), and whether addresses and bytes survived every cycle.

    python3 tests/gpu/torch_saver_compare.py --tms DIR --reservoir DIR [--gib N] [--cycles N]

--tms is the folder holding the torch_memory_saver package (PyPI's wheel,
unpacked), --reservoir the one holding reservoir's Python package.
"""
import argparse
import json
import os
import subprocess
import sys
import textwrap

CHILD = """
import json, os, statistics, time, torch
GiB = 1 << 30
gib, cycles, impl = {gib}, {cycles}, {impl!r}
if impl == "reservoir":
    from reservoir.memory_saver import torch_memory_saver as tms
else:
    from torch_memory_saver import torch_memory_saver as tms
tms.hook_mode = "torch"
n = int(gib * GiB)
with tms.region(tag="weights", enable_cpu_backup=True):
    w = torch.empty(n, dtype=torch.uint8, device="cuda")
with tms.region(tag="kv"):
    kv = torch.empty(n, dtype=torch.uint8, device="cuda")
w.copy_(torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda"))
digest = int(w.view(torch.int64).sum().item())
pw, pk = w.data_ptr(), kv.data_ptr()
torch.cuda.synchronize()
rows = []
ok = True
for _ in range(cycles):
    free0 = torch.cuda.mem_get_info()[0]
    took = {{}}
    for verb, fn in (("pause", tms.pause), ("resume", tms.resume)):
        if verb == "resume":
            free1 = torch.cuda.mem_get_info()[0]
        for tag in ("weights", "kv"):  # the backed-up tag timed alone
            t = time.perf_counter()
            fn(tag)
            torch.cuda.synchronize()
            took.setdefault(verb, time.perf_counter() - t)
    ok = ok and w.data_ptr() == pw and kv.data_ptr() == pk and int(w.view(torch.int64).sum().item()) == digest
    rows.append({{"pause_s": took["pause"], "resume_s": took["resume"], "released": free1 - free0}})
med = lambda k: statistics.median(r[k] for r in rows)
print("RESULT " + json.dumps({{"impl": impl, "gib": gib, "cycles": cycles,
    "pause_backup_s": med("pause_s"), "resume_backup_s": med("resume_s"),
    "pause_GiB_per_s": gib / med("pause_s"), "resume_GiB_per_s": gib / med("resume_s"),
    "released_bytes": min(r["released"] for r in rows), "expected_release": 2 * n,
    "addresses_and_bytes_kept": ok, "rows": rows}}), flush=True)
os._exit(0)  # torch_memory_saver's torch mode fails at interpreter exit (frees outside a region)
"""


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tms", required=True)
    ap.add_argument("--reservoir", required=True)
    ap.add_argument("--gib", type=float, default=4)
    ap.add_argument("--cycles", type=int, default=3)
    args = ap.parse_args()
    failed = 0
    for impl, path in (("torch_memory_saver", args.tms), ("reservoir", args.reservoir)):
        env = dict(os.environ)
        env["PYTHONPATH"] = os.path.abspath(path) + (":" + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        code = textwrap.dedent(CHILD.format(gib=args.gib, cycles=args.cycles, impl=impl))
        try:
            p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=240)
            out, rc = p.stdout + p.stderr, p.returncode
        except subprocess.TimeoutExpired as e:
            out, rc = str(e), "timeout"
        lines = [x for x in out.splitlines() if x.startswith("RESULT ")]
        if lines:
            print(lines[-1][len("RESULT "):])
        else:
            failed += 1
            print(json.dumps({"impl": impl, "error": f"exit {rc}", "output": out[-3000:]}))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
