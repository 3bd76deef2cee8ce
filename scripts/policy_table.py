"""The segment-policy comparison of docs/benchmarks.md, as Markdown.

Usage: policy_table.py [RESERVOIR_BINARY]
Replays every trace in ../shared/traces and examples/traces under the native
policy, expandable segments, policy:paging and policy:paging with the native
bound (paging_slack_mb:2) in one run (`reservoir replay
... --min-capacity --json`), then prints the per-trace table and the figures
policy:paging is judged by, each beside its target.
"""
import glob
import json
import math
import os
import subprocess
import sys

root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
binary = sys.argv[1] if len(sys.argv) > 1 else os.path.join(root, "build", "bin", "reservoir")
traces = sorted(glob.glob(os.path.join(root, "..", "shared", "traces", "*.pickle")))
traces += sorted(glob.glob(os.path.join(root, "..", "shared", "traces", "oom", "*.pickle")))
traces += sorted(glob.glob(os.path.join(root, "examples", "traces", "*")))
configs = ["", "expandable_segments:True", "policy:paging", "policy:paging,paging_slack_mb:2"]
command = [binary, "replay", *traces, "--min-capacity", "--json"]
for c in configs:
    command += ["-c", c]
rows = json.loads(subprocess.run(command, capture_output=True, text=True, check=True).stdout)
by = {(os.path.basename(r["trace"]), r["config"]): r for r in rows}
names = sorted({name for name, _ in by}, key=lambda n: (not n.startswith("cs336") and not n.startswith("octree"), n))


def gib(b):
    return f"{b / 2**30:.3f} GiB"


def geomean(xs):
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def cell(r):
    return (f"{gib(r['min_capacity_bytes'])} ({r['min_capacity_over_requested']:.4f}) / "
            f"{gib(r['peak_reserved_bytes'])} / {r['device_calls_per_1000_allocs']:.1f} / "
            f"{r['device_call_seconds'] * 1e3:.1f} ms")


print("| trace | peak requested | native | expandable_segments:True | policy:paging | policy:paging,paging_slack_mb:2 |")
print("|---|---|---|---|---|---|")
for n in names:
    native = by[(n, "")]
    print(f"| {n} | {gib(native['peak_requested_bytes'])} | {cell(native)} | "
          f"{cell(by[(n, 'expandable_segments:True')])} | {cell(by[(n, 'policy:paging')])} | "
          f"{cell(by[(n, 'policy:paging,paging_slack_mb:2')])} |")
print()
print("| config | min capacity / peak requested: geometric mean | worst | peak reserved vs native: worst | "
      "vs expandable: geometric mean | calls per 1k vs native: geometric mean | worst | "
      "device time vs native: geometric mean |")
print("|---|---|---|---|---|---|---|---|")
for c in configs:
    rs = [by[(n, c)] for n in names]
    nat = [by[(n, "")] for n in names]
    exp = [by[(n, "expandable_segments:True")] for n in names]
    mins = [r["min_capacity_over_requested"] for r in rs]
    res_n = [r["peak_reserved_bytes"] / x["peak_reserved_bytes"] for r, x in zip(rs, nat)]
    res_e = [r["peak_reserved_bytes"] / x["peak_reserved_bytes"] for r, x in zip(rs, exp)]
    calls = [r["device_calls_per_1000_allocs"] / x["device_calls_per_1000_allocs"] for r, x in zip(rs, nat)]
    time = [r["device_call_seconds"] / x["device_call_seconds"] for r, x in zip(rs, nat)]
    worst_calls = max(zip(calls, names))
    worst_res = max(zip(res_n, names))
    print(f"| {c or 'native'} | {geomean(mins):.4f} | {max(mins):.4f} | {worst_res[0]:.3f} ({worst_res[1]}) | "
          f"{geomean(res_e):.4f} | {geomean(calls):.2f}x | {worst_calls[0]:.2f}x ({worst_calls[1]}) | "
          f"{geomean(time):.2f}x |")
